"""Built scenarios kept between gradings in one warm process (`kata watch`): a save re-grades the learner's
code, not the references.

A check's `build(case, g)` is a function of the case, its generator's state and the global RNG's state
(models built inside a check draw from it), and of nothing else a grader may rely on: the same states
give the same scenarios. So the first build of a case is kept, keyed by those states, and a later grading
that reaches the same case with the same states gets it back, with the generator and the global RNG left
exactly where the build would have left them. A learner whose code draws differently reaches the next case
with another global state: that case is built again, as it would be without this shelf.

What is kept of the inputs is a pickle taken right after the build (the runner is sent a pickle of them
anyway), so each grading gets inputs exactly as they were built, even where a grader configures a shared
model for each case (lab 11 sets a VAE's tiling per case). The grader's own probes among the inputs
(a counted denoiser: objects of a grader module's or of engine.helpers' classes) stay the same objects,
because the scenario's verify and on_mismatch closures read them: their recorded attributes are set back
to what they were after the build. Expected values, float64 shadows and reference generators are kept
as they are (nothing writes to them).

Only a warm grading process keeps a shelf (`--kata-reuse-builds`, which the warm grader passes); a shelf
belongs to one Check object, so a grader that changed, and was loaded again, starts an empty one.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import io
import pickle
from typing import Any

MAX_ENTRIES = 64  # per check: cases × the global states learners reached them with


def _digest(state) -> bytes:
    return hashlib.blake2b(state.numpy().tobytes(), digest_size=16).digest()


def _is_probe(value: Any) -> bool:
    module = type(value).__module__
    return module.startswith("diffusion_katas_grader_") or module == "diffusion_katas.engine.helpers"


def _plain_attrs(value: Any) -> dict:
    return {k: v for k, v in vars(value).items() if not k.startswith("__") and _plain(v)}


def _plain(value, depth: int = 0) -> bool:
    import torch

    if value is None or type(value) in (bool, int, float, str, torch.Tensor):  # a Tensor itself, no subclass
        return True
    if type(value) in (list, tuple) and depth < 3:
        return all(_plain(v, depth + 1) for v in value)
    return False


class _Pickler(pickle.Pickler):
    def __init__(self, file, probes: dict[int, str]):
        super().__init__(file, protocol=5)
        self.probes = probes

    def persistent_id(self, obj):  # a probe, wherever it is referenced from, stays the grader's own object
        return self.probes.get(id(obj))


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, probes: dict[str, Any]):
        super().__init__(file)
        self.probes = probes

    def persistent_load(self, pid):
        return self.probes[pid]


@dataclasses.dataclass
class _Built:
    scenarios: list
    single: bool
    blobs: list[bytes]
    probes: list[dict[str, Any]]  # per scenario: name -> the probe object
    probe_attrs: list[dict[str, dict]]  # per scenario: name -> its plain attributes after the build
    g_after: Any
    rng_after: Any

    def restore(self, g) -> Any:
        import torch

        scenarios = []
        for scenario, blob, probes, attrs in zip(self.scenarios, self.blobs, self.probes, self.probe_attrs):
            for name, probe in probes.items():
                for key in [k for k, v in _plain_attrs(probe).items() if k not in attrs[name]]:
                    delattr(probe, key)
                for key, value in copy.deepcopy(attrs[name]).items():
                    setattr(probe, key, value)
            inputs = _Unpickler(io.BytesIO(blob), probes).load()
            scenarios.append(dataclasses.replace(scenario, inputs=inputs))
        g.set_state(self.g_after)
        torch.random.set_rng_state(self.rng_after)
        return scenarios[0] if self.single else scenarios


def _capture(built, g) -> _Built | None:
    import torch

    from diffusion_katas.core.spec import Scenario

    single = isinstance(built, Scenario)
    scenarios = [built] if single else list(built)
    blobs, all_probes, all_attrs = [], [], []
    try:
        for scenario in scenarios:
            probes = {f"probe:{name}": value for name, value in scenario.inputs.items() if _is_probe(value)}
            buffer = io.BytesIO()
            _Pickler(buffer, {id(v): k for k, v in probes.items()}).dump(scenario.inputs)
            blobs.append(buffer.getvalue())
            all_probes.append(probes)
            all_attrs.append({k: copy.deepcopy(_plain_attrs(v)) for k, v in probes.items()})
    except Exception:  # noqa: BLE001  (inputs that cannot be kept are built again each time)
        return None
    return _Built(scenarios, single, blobs, all_probes, all_attrs, g.get_state(), torch.random.get_rng_state())


class Shelf:
    """The kept builds of one check."""

    def __init__(self, check):
        self.check = check
        self.entries: dict[tuple, _Built] = {}


_SHELVES: dict[tuple[str, str, str], Shelf] = {}


def build(lab: str, check, number: int, case: dict, g):
    """`check.build(case, g)`, or what it built last time from the same states, restored."""
    import torch

    key = (number, _digest(g.get_state()), _digest(torch.random.get_rng_state()))
    shelf = _SHELVES.get((lab, check.kata.name, check.name))
    if shelf is None or shelf.check is not check:
        shelf = _SHELVES[(lab, check.kata.name, check.name)] = Shelf(check)
    kept = shelf.entries.get(key)
    if kept is not None:
        return kept.restore(g)
    built = check.build(case, g)
    kept = _capture(built, g)
    if kept is not None:
        if len(shelf.entries) >= MAX_ENTRIES:
            shelf.entries.clear()
        shelf.entries[key] = kept
    return built
