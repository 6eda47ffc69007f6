"""Running learner code: fresh copies of the inputs, the answer key locked, mutation detected.

Each callee (the reference, the learner, each trap) gets its own deep copy of the inputs, as
PrairieLearn does, so none can clobber another's. After the learner's call the inputs it was given are
compared with untouched copies: a kata function must not change its arguments in place.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Any, Iterator

from diffusion_katas.core.results import Reason
from diffusion_katas.core.spec import KataFailure


class AnswerKeyError(RuntimeError):
    """Raised when learner code calls the diffusers/peft function it is graded against."""


def fresh(value: Any) -> Any:
    """A copy of an input that a callee may use freely: tensors cloned, generators re-seeded."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, torch.Generator):
        copy = torch.Generator(device=value.device)
        copy.set_state(value.get_state())
        return copy
    if isinstance(value, dict):
        return {k: fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(fresh(v) for v in value)
    if _is_scheduler(value):
        # Schedulers are stateful (timesteps, step index, init_noise_sigma): a callee that calls
        # set_timesteps must not change what the next callee (a trap, say) starts from.
        import copy

        import torch

        # ...but only its state (tensors, arrays, numbers, containers) is copied: objects a grader
        # attached to it (a counted denoiser, say) stay shared, as modules passed directly are.
        import numpy

        state = (torch.Tensor, numpy.ndarray, numpy.generic, int, float, str, bool, type(None), list, tuple, dict)
        shared = {id(v): v for v in vars(value).values() if not isinstance(v, state)}
        return copy.deepcopy(value, shared)
    return value  # numbers, strings and modules are shared as they are (a module may count its calls)


def _is_scheduler(value: Any) -> bool:
    import torch

    return (not isinstance(value, torch.nn.Module) and hasattr(value, "set_timesteps")
            and hasattr(value, "step") and hasattr(value, "config"))


def versions(value: Any) -> list[int]:
    """The autograd version counters of the tensors in an input, in walk order."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value._version]
    if isinstance(value, dict):
        return [v for item in value.values() for v in versions(item)]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in versions(item)]
    return []


def changed_inputs(given: dict, pristine: dict, before: dict | None = None) -> list[str]:
    """Names (with index paths) of tensor inputs the learner changed in place.

    A tensor counts as changed when its values differ from the untouched copy, or when its version
    counter moved (an in-place op ran on it, even one that left the values as they were).
    """
    import torch

    changed = []

    def walk(a, b, name):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(
                    torch.nan_to_num(a), torch.nan_to_num(b)):
                changed.append(name)
        elif isinstance(a, dict):
            for k in a:
                walk(a[k], b.get(k), f"{name}[{k!r}]")
        elif isinstance(a, (list, tuple)):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{name}[{i}]")

    for key in given:
        if before is not None and versions(given[key]) != before[key]:
            changed.append(key)
        else:
            walk(given[key], pristine[key], key)
    return changed


def _resolve(path: str):
    """Split 'pkg.module.Class.attr' into (owner object, attribute name)."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:-1]:
            owner = getattr(owner, attr)
        return owner, parts[-1]
    raise ImportError(f"cannot resolve answer-key path {path!r}")


@contextlib.contextmanager
def answer_key_locked(paths: tuple[str, ...], kata: str) -> Iterator[None]:
    """While active, each callable at `paths` raises AnswerKeyError with a friendly message."""
    saved = []
    try:
        for path in paths:
            owner, attr = _resolve(path)
            original = owner.__dict__.get(attr, getattr(owner, attr))

            def locked(*args, __path=path, **kwargs):
                raise AnswerKeyError(
                    f"`{kata}` called {__path}, which is the answer key this kata is graded against. "
                    "Write the computation yourself: that is the exercise.")

            if isinstance(original, property):
                locked = property(locked)
            elif isinstance(original, staticmethod):
                locked = staticmethod(locked)
            elif isinstance(original, classmethod):
                locked = classmethod(locked)
            saved.append((owner, attr, original))
            setattr(owner, attr, locked)
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def call_learner(fn, inputs: dict, answer_key: tuple[str, ...], kata: str, meter=None):
    """Call the learner's function on fresh inputs; fail if it changed them in place.

    With `meter` (e.g. diffusion_katas.engine.meters.peak_bytes), the call runs as meter(call) after the inputs
    are copied, so copying is not measured, and (measurement, output) is returned.
    """
    given = fresh(inputs)
    pristine = fresh(inputs)
    before = {key: versions(value) for key, value in given.items()}
    with answer_key_locked(answer_key, kata):
        out = fn(**given) if meter is None else meter(lambda: fn(**given))
    mutated = changed_inputs(given, pristine, before)
    if mutated:
        raise KataFailure(
            f"`{kata}` changed its input(s) {', '.join(mutated)} in place. The caller still needs them "
            "(the pipeline reuses the latents and the schedule): compute into a new tensor instead of "
            "using in-place ops such as mul_, add_, x[...] = or `out=`.", Reason.MUTATED_INPUT)
    return out
