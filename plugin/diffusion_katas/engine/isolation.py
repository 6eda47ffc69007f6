"""Running learner code (in the runner process): fresh copies of the inputs, the answer key locked
by code, mutation detected.

Each callee (the reference, the learner, each trap) gets its own deep copy of the inputs, as
PrairieLearn does, so none can clobber another's. After the learner's call the inputs it was given are
compared with untouched copies: a kata function must not change its arguments in place.
"""
from __future__ import annotations

import importlib
import operator
import sys
from typing import Any

from diffusion_katas.core.results import Reason
from diffusion_katas.core.spec import KataFailure
from diffusion_katas.engine.alone import OTHER_CPU_S, OtherThreads, thread_starters


class AnswerKeyError(RuntimeError):
    """Raised when learner code calls the diffusers/peft function it is graded against."""


class NotAlone(RuntimeError):
    """Raised when learner code works outside the thread it was called in (engine/alone.py)."""


_THREAD = "a thread"  # the lock's mark on the functions that start one
_CODE_NAME = operator.attrgetter("co_qualname" if sys.version_info >= (3, 11) else "co_name")
_SWITCH = "a mode switch"
# What switches torch's dispatch modes off (the meters, the refused operators): refused when learner code calls it.
# torch calls some of them itself (printing a tensor under a mode), so only a learner's own call is refused.
MODE_SWITCHES = ("torch.utils._python_dispatch._disable_current_modes",
                 "torch.utils._python_dispatch._pop_mode_temporarily", "torch.utils._python_dispatch._pop_mode",
                 "torch.overrides._pop_mode_temporarily", "torch.overrides._pop_mode",
                 "torch._C._pop_torch_dispatch_stack", "torch._C._pop_torch_function_stack",
                 "torch._C._unset_dispatch_mode", "torch._C._set_dispatch_mode",
                 # and what hands the modes themselves to the caller (a meter's count, to be rewritten)
                 "torch.utils._python_dispatch._get_current_dispatch_mode",
                 "torch.utils._python_dispatch._get_current_dispatch_mode_stack",
                 "torch.overrides._get_current_function_mode", "torch.overrides._get_current_function_mode_stack",
                 "torch._C._get_dispatch_stack_at", "torch._C._get_function_stack_at",
                 "torch._C._get_dispatch_mode")


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
    """The answer key, closed by code: starting any function whose code is the answer's (wherever it came
    from) raises AnswerKeyError; where the answer is a single torch operator, that operator is refused too, at
    the Python API and at the kernel (aten) level, during each call.

    It runs in the learner's runner. `install()` reads the answer key's code; `arm()` hands everything to a
    closure that the sandbox's audit hook calls for every profiled event (engine/sandbox.py), from before the
    learner's file is imported until the runner ends: after it, this object holds nothing the lock reads, so
    changing it changes nothing. `run(fn)` is the one way learner code is called (at import too): it opens a
    window whose refusals it reports when it closes, even where the learner's code caught them."""

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
        self.builtins: dict[Any, tuple] = {}
        self.switches: dict[Any, Any] = {}
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
                self.builtins[builtin] = (builtin, path, direct)
        for starter in thread_starters():  # graded code runs alone (engine/alone.py)
            self.builtins[starter] = (starter, _THREAD, False)
        for path in MODE_SWITCHES:
            try:
                functions, builtin = _functions_at(path), _builtin_at(path)
            except (ImportError, AttributeError):
                continue
            for function in functions:  # a contextmanager's generator code runs under contextlib's __enter__
                code = getattr(function, "__wrapped__", function).__code__
                self.switches[code] = code
            if builtin is not None:
                self.builtins[builtin] = (builtin, _SWITCH, True)

    def arm(self, library_roots: tuple[str, ...]) -> None:
        """Hand the lock to the sandbox's audit hook, for the rest of this process."""
        from diffusion_katas.engine import sandbox

        untrusted = sandbox.untrusted_code(library_roots, self.learner_files)
        pending: list = [None]  # the refusal being raised (engine/sandbox.py keeps the lock on through it)
        profile, window = _lock_closure(self, untrusted, pending)
        sandbox.arm(profile, window, untrusted, _window.__code__, pending)

    def run(self, fn, *args, modes: list = (), who: str = "", **kwargs):
        """fn(*args, **kwargs) inside the lock's window (and torch `modes`); its first refusal raised at the end,
        caught by the learner's code or not. `who` names the caller in refusals (the kata function by default)."""
        report: list = []
        try:
            result = _window(fn, args, kwargs, list(modes), who or f"`{self.kata}`", report)
        finally:  # what ran is known however the call ended (a failure from a kata function it called is theirs)
            violations, self.called = report if report else ([], set())
        if violations:
            first = violations[0]
            raise type(first)(str(first))
        return result

    def op_modes(self) -> list:
        """The torch modes that refuse the answer's operators during a call (none where it has none)."""
        if not self.forbidden_ops:
            return []
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        forbidden, kata = self.forbidden_ops, self.kata

        def check(func) -> None:
            name = getattr(func, "__name__", "") + " " + str(func)
            for op in forbidden:
                if op in name:
                    raise _answer_key_error(f"`{kata}`", f"torch's {op} ({getattr(func, '__name__', func)})")

        class RefuseFunctions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                check(func)
                return func(*args, **(kwargs or {}))

        class RefuseKernels(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                check(func)
                return func(*args, **(kwargs or {}))

        return [RefuseFunctions(), RefuseKernels()]


def _window(fn, args, kwargs, modes, who, report: list):
    """The lock's window around one call of learner code: opened and closed by this code object only (the
    sandbox's audit hook checks who asks), so learner code cannot close it early; a window opened inside
    another (learner code calling this) reports nothing of its own and clears nothing. `report` gets
    [violations, learner functions that ran] when the outermost window closes."""
    import sys

    sys.audit("kata.lock", "open", who)
    try:
        for mode in modes:
            mode.__enter__()
        try:
            return fn(*args, **kwargs)
        finally:
            for mode in reversed(modes):
                mode.__exit__(None, None, None)
    finally:
        sys.audit("kata.lock", "close", report)


def _answer_key_error(who: str, what: str) -> AnswerKeyError:
    return AnswerKeyError(
        f"{who} called {what}, which is the answer key this kata is graded against (or a library function that "
        "computes the same answer). Write the computation yourself: that is the exercise.")


# Modules the lock need not look into (`plain_modules`): torch's, numpy's and the standard library's, whose code is
# never the answer key here (torch's answers are C operators, refused at their call), by name and their namespace.
_PLAIN_PACKAGES = ("torch", "numpy")
_PLAIN: dict = {}


def plain_modules() -> None:
    """Read, in the warm parent (after each grader load), the plain modules loaded so far: a call whose code lives in
    one of them (its frame's globals are that very module's namespace) is let through without reading its code,
    which under the sandbox costs an audited read (frame.f_code) per Python call."""
    names = sys.stdlib_module_names | set(_PLAIN_PACKAGES)
    _PLAIN.clear()
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".")[0] in names and isinstance(getattr(module, "__dict__", None), dict):
            _PLAIN[name] = module.__dict__


def _lock_closure(lock: CodeLock, untrusted, pending: list):
    """The lock's profile function and window handler, over copies of its tables: the only references to them
    are these closures, which only the interpreter's profile slot and the sandbox's audit hook hold."""
    import contextlib

    locked = dict(lock.locked)
    direct = frozenset(lock.direct)
    builtins = dict(lock.builtins)
    switches = dict(lock.switches)
    learner_files = lock.learner_files
    kata = lock.kata
    contextlib_file = contextlib.__file__
    depth = [0]
    who = [f"`{kata}`"]  # the caller refusals name: the kata function, or the kata file at import
    violations: list = []
    called: set = set()
    # What is known of each code object, read once (the hook sees every Python call), in buckets by its qualified
    # name: not by id(), an audited call (each costs a call of the sandbox's hook), and not by the code object
    # itself, whose hash reads its constants on every lookup.
    seen: dict = {}
    name_of = _CODE_NAME
    # the plain modules, but those holding a locked path or a mode switch (their code is read as any other)
    looked_at = {path.rsplit(".", 2)[0] for path in lock.paths + lock.direct_paths} | \
        {path.rsplit(".", 1)[0] for path in lock.paths + lock.direct_paths} | \
        {path.rsplit(".", 1)[0] for path in MODE_SWITCHES}
    plain = {name: namespace for name, namespace in _PLAIN.items() if name not in looked_at}

    def record(exc):
        violations.append(exc)
        pending[0] = exc
        return exc

    def not_alone() -> NotAlone:
        return record(NotAlone(
            f"{who[0]} started a thread. Graded code runs in the thread that calls it: work in another thread "
            "escapes the meters and the answer-key lock. Compute in your function itself."))

    def switched_off(what: str) -> NotAlone:
        return record(NotAlone(
            f"{who[0]} switched off torch's dispatch modes ({what}): they are how the grader measures your "
            "function and refuses the answer's operator. Leave them on."))

    def profile(frame, event, arg):
        if not depth[0]:  # outside a window no learner call is running (the runner's own work between calls)
            return
        if event == "c_call":
            hit = builtins.get(arg)  # C callables compare equal when they are the same C function on the same object
            if hit is not None:
                if hit[1] is _THREAD:
                    raise not_alone()
                if hit[2] and not untrusted(frame.f_code):
                    return
                if hit[1] is _SWITCH:
                    raise switched_off(getattr(arg, "__name__", "?"))
                raise record(_answer_key_error(who[0], hit[1]))
            return
        if event != "call":
            return
        namespace = frame.f_globals
        if plain.get(namespace.get("__name__")) is namespace:  # torch's, numpy's or the standard library's own code
            return
        code = frame.f_code
        known = None
        for entry in seen.get(name_of(code), ()):
            if entry[0] is code:
                known = entry
                break
        if known is None:
            mine = code.co_filename in learner_files
            key = fingerprint(code) if locked and not mine else None
            known = (code, locked.get(key) if key else None, key in direct, mine, switches.get(code) is code)
            seen.setdefault(name_of(code), []).append(known)
        if known[4]:  # a mode switch: refused where the learner's own code turned it on
            caller = frame.f_back
            while caller is not None and caller.f_code.co_filename == contextlib_file:
                caller = caller.f_back
            if caller is not None and untrusted(caller.f_code):
                raise switched_off(code.co_name)
            return
        if known[3]:
            called.add((code.co_filename, code.co_name))
            return
        if known[1] is not None:
            caller = frame.f_back
            if known[2] and (caller is None or not untrusted(caller.f_code)):
                return  # called by library code the kata may use, not by the learner
            raise record(_answer_key_error(who[0], known[1]))

    def window(op, detail=None) -> int:
        if op == "open":
            depth[0] += 1
            if depth[0] == 1:
                violations.clear()
                called.clear()
                who[0] = detail if isinstance(detail, str) else f"`{kata}`"
        elif op == "close" and depth[0] > 0:
            depth[0] -= 1
            if depth[0] == 0 and isinstance(detail, list):
                detail[:] = [list(violations), set(called)]
                violations.clear()
                called.clear()
        return depth[0]

    return profile, window


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

    def call():
        elsewhere.start()
        out = fn(**given) if meter is None else meter(lambda: fn(**given))
        return out, elsewhere.spent()

    if lock is not None:
        out, spent = lock.run(call, modes=lock.op_modes())
    else:
        out, spent = call()
    mutated = changed_inputs(given, pristine, before)
    if mutated:
        raise KataFailure(
            f"`{kata}` changed its input(s) {', '.join(mutated)} in place. The caller still needs them "
            "(the pipeline reuses the latents and the schedule): compute into a new tensor instead of "
            "using in-place ops such as mul_, add_, x[...] = or `out=`.", Reason.MUTATED_INPUT)
    return out
