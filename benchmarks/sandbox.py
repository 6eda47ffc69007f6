"""Benchmark what the runner's sandbox (engine/sandbox.py) costs a runner: a fork that enters it and exits, against
a fork that exits at once, from a parent that imported torch and prepared the sandbox's plan (as the warm parent
does), and the answer-key lock's profile function (forwarded through the audit hook) on a call-heavy loop.

    python benchmarks/sandbox.py [--runs 40]

A script, not a test: wall clocks swing on shared machines, so read the differences and ratios.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugin"))


def fork_and_wait(enter: bool, reads: list[str]) -> float:
    from diffusion_katas.engine import sandbox

    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            if enter:
                sandbox.enter(reads)
        except BaseException:  # noqa: BLE001
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the runner could not enter the sandbox")
    return time.perf_counter() - start


def profiled_loop(lock: bool) -> float:
    """Seconds of 200,000 Python calls in a fork, with or without the lock's profile function armed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        if lock:
            from diffusion_katas.engine import sandbox

            def profile(frame, event, arg):
                return None

            untrusted = sandbox.untrusted_code((sys.prefix,), frozenset())
            sandbox.arm(profile, lambda *a: 1, untrusted, profiled_loop.__code__, [None])
            sys.audit("kata.lock", "open")  # the lock's window, as around a learner call

        def f(x):
            return x + 1

        start = time.perf_counter()
        total = 0
        for i in range(200_000):
            total += f(i)
        os.write(write, repr(time.perf_counter() - start).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        return float(pipe.read())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    import torch  # noqa: F401  (the warm parent's heap: a fork copies its page tables)

    from diffusion_katas.engine import sandbox

    scratch = tempfile.mkdtemp(prefix="kata-bench-")
    plan = sandbox.prepare(scratch, str(Path(sandbox.__file__).resolve().parent.parent))
    reads = [str(Path(__file__).resolve().parent.parent / "katas")]
    bare = [fork_and_wait(False, reads) for _ in range(args.runs)]
    boxed = [fork_and_wait(True, reads) for _ in range(args.runs)]
    status = None
    pid = os.fork()
    if pid == 0:
        status = sandbox.enter(reads)
        print(f"layers entered here: {', '.join(status.layers)}; missing: {', '.join(status.missing) or 'none'}")
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    print(f"box: {plan.box if plan.box is not None else 'none (not root)'}; Landlock ABI {plan.landlock_abi}; "
          f"{len(plan.reads)} readable paths")
    b, s = statistics.median(bare) * 1000, statistics.median(boxed) * 1000
    print(f"fork + exit, median of {args.runs}:            {b:7.2f} ms")
    print(f"fork + enter the sandbox + exit, median: {s:7.2f} ms   (the sandbox: {s - b:+.2f} ms a runner)")
    plain = statistics.median(profiled_loop(False) for _ in range(5))
    locked = statistics.median(profiled_loop(True) for _ in range(5))
    print(f"200,000 Python calls: {plain * 1000:.0f} ms bare, {locked * 1000:.0f} ms under the lock's profile "
          f"function ({locked / plain:.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
