"""Cost budgets: measurements that mean the same on every machine, and GPU ones where CUDA exists.

Deterministic (any machine):
- `peak_bytes(fn)`: the peak of live tensor bytes allocated while `fn` runs, counted by a
  TorchDispatchMode that sees every op's output storage and a weakref finalizer when it dies. Not RSS,
  not tracemalloc (blind to torch): the same code gives the same bytes every run.
- `flops(fn)`: torch.utils.flop_counter's count of matmul/conv/attention FLOPs.
- call counts: the graders wrap the denoiser and count (labs 04 and 05 each wrap it their way).

GPU (tests marked `cuda` and `budget`; they skip where CUDA is not available):
- `cuda_time_ms(fn)`: CUDA events around each run, after warm-up, median of several; each run queued behind
  a GPU spin, so the launches' Python (the answer-key lock's modes in a runner) is not timed.
- `cuda_peak_bytes(fn)`: max_memory_allocated after reset_peak_memory_stats, minus the baseline.
Wall clocks swing 3x on shared machines, so GPU budgets are ratios to the diffusers reference run in
the same process on the same GPU, never absolute milliseconds.
"""
from __future__ import annotations

import statistics
import weakref
from typing import Any, Callable


def _live_bytes_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytes(TorchDispatchMode):
        """Counts bytes of storages created under the mode while they are alive; keeps the peak.

        Lean on purpose: in the learner's runner every Python call made here also goes through the answer-key
        lock's profile hook, so outputs are flattened by hand (an aten op returns a tensor, or a tuple or list of
        them, at most one level deeper) and a storage's death is watched with a C weakref callback, not
        pytree and weakref.finalize (a third of a metered decode's time under the hook)."""

        def __init__(self):
            super().__init__()
            self.live = 0
            self.peak = 0
            self._sizes: dict[int, int] = {}
            self._watch: dict[int, weakref.ref] = {}

        def _free(self, key: int) -> None:
            nbytes = self._sizes.pop(key, None)
            self._watch.pop(key, None)
            if nbytes is not None:
                self.live -= nbytes

        def _count(self, t) -> None:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata  # the storage's own address: unlike id(), not an audited call
                if key not in self._sizes:
                    nbytes = storage.nbytes()
                    self._sizes[key] = nbytes
                    self._watch[key] = weakref.ref(storage, lambda _ref, key=key: self._free(key))
                    self.live += nbytes
                    if self.live > self.peak:
                        self.peak = self.live

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, (tuple, list)):
                for item in out:
                    if isinstance(item, (tuple, list)):
                        for inner in item:
                            self._count(inner)
                    else:
                        self._count(item)
            else:
                self._count(out)
            return out

    return LiveBytes()


def peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(peak live tensor bytes allocated during fn(), fn's result). Inputs and weights made before
    the call are not counted: this is the working memory the computation needs, output included."""
    import torch

    mode = _live_bytes_mode()
    with torch.no_grad(), mode:
        out = fn()
    return mode.peak, out


def flops(fn: Callable[[], Any]) -> tuple[int, Any]:
    """(FLOPs counted by torch.utils.flop_counter during fn(), fn's result)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        out = fn()
    return counter.get_total_flops(), out


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 2, runs: int = 5) -> float:
    """Median milliseconds the GPU spends on fn()'s work, timed with CUDA events around each run after warm-up.

    Each timed run is queued behind a GPU spin that lasts longer than the CPU takes to queue the run, so the
    events bracket the kernels back to back: the time is the GPU's, not that of the Python launching them. A
    learner's call pays Python the reference does not (in the runner the answer-key lock's torch modes see every
    op: tens of µs each, and lab 11's chunked attention queues 18 ops per block), and with the launches in the
    measurement a correct answer's ratio followed the CPU's speed (1.09x to 1.89x on one H100). A call that
    waits on the GPU itself (`.item()`, a copy to the CPU) is timed from there as before, its waits included."""
    import time

    import torch

    with torch.no_grad():
        queued = 0.0
        for _ in range(warmup):
            torch.cuda.synchronize()
            began = time.perf_counter()
            fn()
            queued = max(queued, time.perf_counter() - began)  # the CPU's time to queue it (the GPU may still run)
            torch.cuda.synchronize()
        spin = _spin_cycles(2 * queued + 0.002)
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            if spin:
                torch.cuda._sleep(spin)  # the GPU busy while fn() is queued behind it; not inside the events
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


_SPIN_RATE: list = []  # GPU spin cycles per second, read once per process


def _spin_cycles(seconds: float) -> int:
    """The `torch.cuda._sleep` argument that keeps the GPU busy for about `seconds` (at most 1 s), read from a timed
    spin right after the warm-ups (clocks up), then doubled against clocks that move; 0 where torch has none."""
    import torch

    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is None:
        return 0
    try:
        if not _SPIN_RATE:
            probe = 10_000_000
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            sleep(probe)
            end.record()
            torch.cuda.synchronize()
            _SPIN_RATE.append(probe / max(start.elapsed_time(end) / 1000, 1e-6))
        return int(2 * min(seconds, 1.0) * _SPIN_RATE[0])
    except Exception:  # noqa: BLE001  (no spin: runs are timed with their launches, as without one)
        return 0


def cuda_peak_bytes(fn: Callable[[], Any]) -> int:
    """Peak CUDA bytes allocated by fn() above what was allocated before it."""
    import gc

    import torch

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def human(value: float, unit: str) -> str:
    """1572864 bytes -> '1.50 MiB'; 3.2e9 FLOPs -> '3.20 GFLOP'."""
    if unit == "bytes":
        for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} B"
    if unit == "FLOPs":
        for scale, name in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP"), (1e3, "kFLOP")):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} FLOP"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "calls":
        return f"{value:g} call(s)"
    return f"{value:g} {unit}".strip()
