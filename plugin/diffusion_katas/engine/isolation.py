"""Running learner code (in the runner process): fresh copies of the inputs, the answer key locked
by code, mutation detected.

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
from diffusion_katas.engine.alone import OTHER_CPU_S, OtherThreads, thread_starters


class AnswerKeyError(RuntimeError):
    """Raised when learner code calls the diffusers/peft function it is graded against."""


class NotAlone(RuntimeError):
    """Raised when learner code works outside the thread it was called in (engine/alone.py)."""


_THREAD = "a thread"  # the lock's mark on the functions that start one
_SWITCH = "a mode switch"
# What switches torch's dispatch modes off (the meters, the refused operators): refused when learner code calls it.
# torch calls some of them itself (printing a tensor under a mode), so only a learner's own call is refused.
MODE_SWITCHES = ("torch.utils._python_dispatch._disable_current_modes",
                 "torch.utils._python_dispatch._pop_mode_temporarily", "torch.utils._python_dispatch._pop_mode",
                 "torch.overrides._pop_mode_temporarily", "torch.overrides._pop_mode",
                 "torch._C._pop_torch_dispatch_stack", "torch._C._pop_torch_function_stack",
                 "torch._C._unset_dispatch_mode", "torch._C._set_dispatch_mode")


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


def _builtin_at(path: str):
    """The builtin (C) callable at an answer-key path (torch.nn.functional.conv2d, say), or None."""
    owner, attr = _resolve(path)
    value = getattr(owner, attr, None)
    return value if value is not None and not hasattr(value, "__code__") and callable(value) and \
        type(value).__name__ in ("builtin_function_or_method", "method_descriptor", "wrapper_descriptor") else None


def _functions_at(path: str) -> list:
    """The plain functions behind an answer-key path (a method, a property's getter, a classmethod...)."""
    owner, attr = _resolve(path)
    value = owner.__dict__.get(attr, getattr(owner, attr, None)) if hasattr(owner, "__dict__") else getattr(owner, attr)
    if isinstance(value, property):
        candidates = [value.fget, value.fset]
    elif isinstance(value, (staticmethod, classmethod)):
        candidates = [value.__func__]
    else:
        candidates = [value, getattr(value, "__wrapped__", None), getattr(value, "__func__", None)]
    return [f for f in candidates if f is not None and hasattr(f, "__code__")]


def fingerprint(code) -> tuple:
    """What makes two code objects the same computation: bytecode, names and constants (nested code
    included), not where they were defined. A sibling class's "Copied from" method, a module executed a
    second time from its file, and a reference captured before any lock all share it."""
    consts = tuple(fingerprint(c) if hasattr(c, "co_code") else (type(c).__name__, repr(c)) for c in code.co_consts)
    return (code.co_code, code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, consts)


class CodeLock:
    """The answer key, closed by code: while active, starting any function whose code is the answer's
    (wherever it came from) raises AnswerKeyError; where the answer is a single torch operator, that
    operator is refused too, at the Python API and at the kernel (aten) level.

    It runs in the learner's runner process, around each call of the learner's function."""

    def __init__(self, paths: tuple[str, ...], kata: str, forbidden_ops: tuple[str, ...] = (),
                 learner_files: tuple[str, ...] = (), direct_paths: tuple[str, ...] = ()):
        self.kata = kata
        self.direct_paths = tuple(direct_paths)
        self.direct: set[tuple] = set()  # fingerprints refused only when the learner's code is the caller
        # The learner's own code is never the answer key, even where it is written exactly like it.
        self.learner_files = frozenset(learner_files)
        self.paths = tuple(paths)
        self.forbidden_ops = tuple(forbidden_ops)
        self.locked: dict[tuple, str] = {}
        self.builtins: dict[int, tuple] = {}
        self.violations: list[RuntimeError] = []
        self._seen: dict[int, tuple] = {}
        # The learner's own functions that ran during the last call, as (file, name): a failure that comes
        # from another kata function it calls is reported as that function's ("fix it first").
        self.called: set[tuple[str, str]] = set()

    def install(self) -> None:
        for path in self.paths + self.direct_paths:
            direct = path in self.direct_paths
            for function in _functions_at(path):
                key = fingerprint(function.__code__)
                self.locked[key] = path
                if direct:
                    self.direct.add(key)
            builtin = _builtin_at(path)
            if builtin is not None:  # a C function: refused at its call (the profiler's c_call event)
                self.builtins[id(builtin)] = (builtin, path, direct)
        for starter in thread_starters():  # graded code runs alone (engine/alone.py)
            self.builtins[id(starter)] = (starter, _THREAD, False)
        self.switches: dict[int, Any] = {}  # id -> code (a code object's own hash reads all its bytes)
        for path in MODE_SWITCHES:
            try:
                functions, builtin = _functions_at(path), _builtin_at(path)
            except (ImportError, AttributeError):
                continue
            for function in functions:  # a contextmanager's generator code runs under contextlib's __enter__
                code = getattr(function, "__wrapped__", function).__code__
                self.switches[id(code)] = code
            if builtin is not None:
                self.builtins[id(builtin)] = (builtin, _SWITCH, True)

    def _refuse(self, what: str) -> AnswerKeyError:
        message = (f"`{self.kata}` called {what}, which is the answer key this kata is graded against (or a "
                   "library function that computes the same answer). Write the computation yourself: that is the "
                   "exercise.")
        self.violations.append(AnswerKeyError(message))
        return self.violations[-1]

    def _not_alone(self) -> NotAlone:
        self.violations.append(NotAlone(
            f"`{self.kata}` started a thread. Graded code runs in the thread that calls it: work in another thread "
            "escapes the meters and the answer-key lock. Compute in your function itself."))
        return self.violations[-1]

    def _switched_off(self, what: str) -> NotAlone:
        self.violations.append(NotAlone(
            f"`{self.kata}` switched off torch's dispatch modes ({what}): they are how the grader measures your "
            "function and refuses the answer's operator. Leave them on."))
        return self.violations[-1]

    def _hook(self, frame, event, arg):
        if event == "c_call":
            hit = self.builtins.get(id(arg))
            if hit is not None and hit[0] is arg:
                if hit[1] is _THREAD:
                    raise self._not_alone()
                if hit[2] and frame.f_code.co_filename not in self.learner_files:
                    return
                if hit[1] is _SWITCH:
                    raise self._switched_off(getattr(arg, "__name__", "?"))
                raise self._refuse(hit[1])
            return
        if event != "call":
            return
        code = frame.f_code
        seen = self._seen.get(id(code))  # what is known of this code, read once: the hook sees every Python call
        if seen is None or seen[0] is not code:
            mine = code.co_filename in self.learner_files
            key = fingerprint(code) if self.locked and not mine else None
            seen = (code, self.locked.get(key) if key else None, key in self.direct, mine,
                    self.switches.get(id(code)) is code)
            self._seen[id(code)] = seen
        if seen[4]:  # a mode switch: refused where the learner's own code turned it on
            caller = frame.f_back
            while caller is not None and caller.f_code.co_filename == contextlib.__file__:
                caller = caller.f_back
            if caller is not None and caller.f_code.co_filename in self.learner_files:
                raise self._switched_off(code.co_name)
            return
        if seen[3]:
            self.called.add((code.co_filename, code.co_name))
            return
        if seen[1] is not None:
            caller = frame.f_back
            if seen[2] and (caller is None or caller.f_code.co_filename not in self.learner_files):
                return  # called by library code the kata may use, not by the learner
            raise self._refuse(seen[1])

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        import sys
        import threading

        self.violations.clear()
        self.called.clear()
        modes = self._op_modes() if self.forbidden_ops else []
        previous = sys.getprofile()
        threading.setprofile(self._hook)
        sys.setprofile(self._hook)
        try:
            for mode in modes:
                mode.__enter__()
            try:
                yield
            finally:
                for mode in reversed(modes):
                    mode.__exit__(None, None, None)
        finally:
            sys.setprofile(previous)
            threading.setprofile(None)
        if self.violations:  # refused, even if the learner's code caught the error and went on
            first = self.violations[0]
            raise type(first)(str(first))

    def _op_modes(self) -> list:
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        lock = self

        def check(func) -> None:
            name = getattr(func, "__name__", "") + " " + str(func)
            for op in lock.forbidden_ops:
                if op in name:
                    raise lock._refuse(f"torch's {op} ({getattr(func, '__name__', func)})")

        class RefuseFunctions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                check(func)
                return func(*args, **(kwargs or {}))

        class RefuseKernels(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                check(func)
                return func(*args, **(kwargs or {}))

        return [RefuseFunctions(), RefuseKernels()]


def call_learner(fn, inputs: dict, kata: str, meter=None, lock: CodeLock | None = None, used: dict | None = None):
    """Call the learner's function on fresh inputs (inside `lock`, the answer key closed); fail if it
    changed them in place.

    With `meter` (e.g. diffusion_katas.engine.meters.peak_bytes), the call runs as meter(call) after the
    inputs are copied, so copying is not measured, and (measurement, output) is returned.
    """
    given = fresh(inputs)
    if used is not None:  # the copies the learner got: their generators' states are read after the call
        used.update(given)
    pristine = fresh(inputs)
    before = {key: versions(value) for key, value in given.items()}
    elsewhere = OtherThreads()
    with lock.active() if lock is not None else contextlib.nullcontext():
        elsewhere.start()
        out = fn(**given) if meter is None else meter(lambda: fn(**given))
        spent = elsewhere.spent()
    if spent > OTHER_CPU_S:
        raise NotAlone(
            f"`{kata}`'s call had {spent * 1000:.1f} ms of CPU work done in another thread. Graded code runs in the "
            "thread that calls it: work elsewhere escapes the meters and the answer-key lock. Compute in your "
            "function itself, and start no thread (at import either).")
    mutated = changed_inputs(given, pristine, before)
    if mutated:
        raise KataFailure(
            f"`{kata}` changed its input(s) {', '.join(mutated)} in place. The caller still needs them "
            "(the pipeline reuses the latents and the schedule): compute into a new tensor instead of "
            "using in-place ops such as mul_, add_, x[...] = or `out=`.", Reason.MUTATED_INPUT)
    return out
