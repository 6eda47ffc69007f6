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
_COMPILE = "a compiler"
# What runs learner or library code as other bytecode than it was written in (dynamo rewrites frames, TorchScript
# compiles them): refused in every kata, since a rewritten copy of the answer key is no longer its code.
# (torch.compile is torch._dynamo.optimize underneath: refused there, so that the lock need not read the code of torch's
# own top-level module, which every tensor operation under a torch function mode passes through.)
COMPILERS = ("torch._dynamo.eval_frame.optimize", "torch._dynamo.eval_frame._optimize",
             "torch._dynamo.eval_frame.optimize_assert", "torch.jit.script", "torch.jit.trace",
             "torch.jit.trace_module", "torch.fx.symbolic_trace")
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


_PLAIN_VALUES = (int, float, complex, str, bytes, bool, type(None))


def changed_inputs(given: dict, pristine: dict, before: dict | None = None) -> list[str]:
    """Names (with index paths) of inputs the learner changed in place: tensors, and the dicts and lists that hold
    them or plain values (a cache dict written into, a list appended to, an entry replaced).

    A tensor counts as changed when its values differ from the untouched copy, or when its version
    counter moved (an in-place op ran on it, even one that left the values as they were). A dict counts as
    changed when its keys do, a list when its length does, and an entry when it is now another kind of value,
    another plain value (a number, a string), or a tensor with other values.
    """
    import torch

    changed = []

    def walk(a, b, name):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape \
                    or a.dtype != b.dtype or not torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)):
                changed.append(name)
        elif isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                changed.append(name)
            else:
                for k in b:
                    walk(a[k], b[k], f"{name}[{k!r}]")
        elif isinstance(b, (list, tuple)):
            if type(a) is not type(b) or len(a) != len(b):
                changed.append(name)
            else:
                for i, (x, y) in enumerate(zip(a, b)):
                    walk(x, y, f"{name}[{i}]")
        elif isinstance(b, _PLAIN_VALUES):
            if type(a) is not type(b) or (a != b and not (a != a and b != b)):  # NaN stays NaN
                changed.append(name)

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


# ---- answer-key families -------------------------------------------------------------------------------------------
# An answer-key path is a dotted name ('diffusers.schedulers.scheduling_ddpm.DDPMScheduler.add_noise') or a family:
# 'MODULES:OBJECTS', where MODULES is a module ('diffusers.models.embeddings') or a package and every module below
# it ('diffusers.schedulers.**'), and OBJECTS names, with shell wildcards, functions defined there ('get_*embedding*')
# or attributes of classes defined there ('*Scheduler.add_noise', '*.get_delta_weight'). A family closes the answer
# key over every library route to it: another scheduler's step, another model's copy of a helper, a sibling layer.
# The lock matches a family by name when a function starts (its module, its qualified name), so no module has to be
# imported for it beforehand; C functions, which have no frame, are found in the modules already loaded.
def family_parts(pattern: str) -> tuple[str, bool, str]:
    """(module or package, whether every module below it counts, object pattern) of a family pattern."""
    module_part, object_part = pattern.split(":", 1)
    below = module_part.endswith(".**")
    return (module_part[:-3] if below else module_part), below, object_part


def family_matches(pattern: str, module: str, qualname: str) -> bool:
    """Whether a function defined in `module` under `qualname` belongs to the family."""
    import fnmatch

    package, below, objects = family_parts(pattern)
    if not (module == package or below and module.startswith(package + ".")):
        return False
    names, parts = objects.split("."), qualname.split(".")
    return len(names) == len(parts) and all(fnmatch.fnmatchcase(p, n) for p, n in zip(parts, names))


def family_regex(families) -> "re.Pattern | None":
    """One regex over 'module|qualname' for a lock's families (`(pattern, direct)` pairs): its group 'direct' or
    'any' says which kind matched. Matching it is what the lock does for each new code object."""
    import fnmatch
    import re

    parts: dict[bool, list[str]] = {True: [], False: []}
    for pattern, direct in families:
        package, below, objects = family_parts(pattern)
        module_re = re.escape(package) + (r"(?:\..*)?" if below else "")
        object_re = r"\.".join(fnmatch.translate(name)[4:-3] for name in objects.split("."))  # (?s:...)\Z stripped
        parts[bool(direct)].append(f"{module_re}\\|{object_re}")
    groups = [f"(?P<{name}>{'|'.join(f'(?:{p})' for p in parts[key])})" for key, name in ((True, "direct"), (False, "any"))
              if parts[key]]
    return re.compile(f"(?:{'|'.join(groups)})\\Z", re.S) if groups else None


def family_members(pattern: str, loaded_only: bool = False) -> list:
    """(owner, attribute, dotted name) of everything a family names: in every module below a package (imported here,
    as the course's own tests do), or with `loaded_only` in the modules already loaded (the runner's C functions)."""
    import fnmatch

    package, below, objects = family_parts(pattern)
    if loaded_only:
        modules = [m for name, m in list(sys.modules.items()) if m is not None
                   and (name == package or below and name.startswith(package + "."))]
    else:
        modules = _modules(package, below)
    names = objects.split(".")
    found = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if not fnmatch.fnmatchcase(name, names[0]):
                continue
            if len(names) == 1:  # a function defined there, or a C function found there (it has no module of its own)
                if callable(value) and (getattr(value, "__module__", module.__name__) == module.__name__
                                        or not hasattr(value, "__code__") and not isinstance(value, type)):
                    found.append((module, name, f"{module.__name__}.{name}"))
            elif isinstance(value, type) and value.__module__ == module.__name__:
                found += [(value, attr, f"{module.__name__}.{name}.{attr}") for attr in list(vars(value))
                          if fnmatch.fnmatchcase(attr, names[1])]
    return found


def _modules(package: str, below: bool) -> list:
    """The module, or the package and every module below it that imports here (a module needing a library that is not
    installed, flax say, is not part of any answer)."""
    import pkgutil

    top = importlib.import_module(package)
    if not below:
        return [top]
    modules = [top]
    for info in pkgutil.walk_packages(getattr(top, "__path__", []), top.__name__ + "."):
        try:
            modules.append(importlib.import_module(info.name))
        except Exception:  # noqa: BLE001  (optional dependencies, deprecated shims: not a route to the answer here)
            continue
    return modules


def _targets(path: str, loaded_only: bool = False) -> list:
    """(owner, attribute, dotted name) of an answer-key path, a family's members included."""
    if ":" in path:
        return family_members(path, loaded_only)
    owner, attr = _resolve(path)
    return [(owner, attr, path)]


def _builtins_at(path: str) -> list:
    """The builtin (C) callables an answer-key path names (torch.nn.functional.conv2d, say; a family's, among the
    modules already loaded)."""
    found = []
    for owner, attr, _name in _targets(path, loaded_only=True):
        value = getattr(owner, attr, None)
        if value is not None and not hasattr(value, "__code__") and callable(value) and \
                type(value).__name__ in ("builtin_function_or_method", "method_descriptor", "wrapper_descriptor"):
            found.append(value)
    return found


def _functions_at(path: str) -> list[tuple]:
    """(plain function, dotted name) behind an answer-key path: a method, a property's getter, a classmethod..."""
    found = []
    for owner, attr, name in _targets(path):
        value = owner.__dict__.get(attr, getattr(owner, attr, None)) if hasattr(owner, "__dict__") \
            else getattr(owner, attr)
        if isinstance(value, property):
            candidates = [value.fget, value.fset]
        elif isinstance(value, (staticmethod, classmethod)):
            candidates = [value.__func__]
        else:
            candidates = [value, getattr(value, "__wrapped__", None), getattr(value, "__func__", None)]
        found += [(f, name) for f in candidates if f is not None and hasattr(f, "__code__")]
    return found


def _module_of(function) -> str:
    """The module a function is defined in: the one its frames' globals are."""
    return (getattr(function, "__globals__", None) or {}).get("__name__", "") or getattr(function, "__module__", "")


_FINGERPRINTS: dict[int, tuple] = {}  # id(code) -> (code, fingerprint): the answer keys' own, read once per process


def _fingerprint_of(code) -> tuple:
    known = _FINGERPRINTS.get(id(code))
    if known is None or known[0] is not code:
        known = _FINGERPRINTS[id(code)] = (code, fingerprint(code))
    return known[1]


def fingerprint(code) -> tuple:
    """What makes two code objects the same computation: bytecode, names and constants (nested code
    included), not where they were defined nor how they are documented. A sibling class's "Copied from" method
    (its docstring reworded), a module executed a second time from its file, and a reference captured before any
    lock all share it. A function's first constant is its docstring's slot (None where it has none): a string
    there is read as the docstring and left out."""
    consts = tuple(fingerprint(c) if hasattr(c, "co_code") else (type(c).__name__, repr(c)) for c in code.co_consts)
    if consts and consts[0][0] == "str" and code.co_flags & _CO_NEWLOCALS:
        consts = (("str", "<docstring>"),) + consts[1:]
    return (code.co_code, code.co_names, code.co_varnames, code.co_argcount, code.co_kwonlyargcount, consts)


_CO_NEWLOCALS = 0x0002  # a function's code (not a module's or a class body's)


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
        self.families: list[tuple[str, bool]] = []  # (family pattern, refused only where the learner calls it)
        self.modules: set[str] = set()  # where the locked functions are defined (the lock reads every call there)
        self.builtins: dict[Any, tuple] = {}
        self.switches: dict[Any, Any] = {}
        # The learner's own functions that ran during the last call, as (file, name): a failure that comes
        # from another kata function it calls is reported as that function's ("fix it first").
        self.called: set[tuple[str, str]] = set()

    def install(self) -> None:
        for path in self.paths + self.direct_paths:
            direct = path in self.direct_paths
            if ":" in path:  # a family: matched by name as its functions start (and its C functions found now)
                self.families.append((path, direct))
            else:
                for function, name in _functions_at(path):
                    key = _fingerprint_of(function.__code__)
                    self.locked.setdefault(key, name)
                    self.modules.add(_module_of(function))
                    if direct:
                        self.direct.add(key)
            for builtin in _builtins_at(path):  # a C function: refused at its call (the profiler's c_call event)
                self.builtins[builtin] = (builtin, path, direct)
        for starter in thread_starters():  # graded code runs alone (engine/alone.py)
            self.builtins[starter] = (starter, _THREAD, False)
        for path in COMPILERS:
            try:
                functions = _functions_at(path)
            except (ImportError, AttributeError):
                continue
            for function, _name in functions:
                self.locked.setdefault(_fingerprint_of(function.__code__), _COMPILE)
                self.modules.add(_module_of(function))
        for path in MODE_SWITCHES:
            try:
                functions, builtins = _functions_at(path), _builtins_at(path)
            except (ImportError, AttributeError):
                continue
            for function, _name in functions:  # a contextmanager's generator code runs under contextlib's __enter__
                code = getattr(function, "__wrapped__", function).__code__
                self.switches[code] = code
                self.modules.add(_module_of(getattr(function, "__wrapped__", function)))
            for builtin in builtins:
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
        # What was let through, by the function itself: these modes see every op of the learner's call, each seen
        # op costing the lock's profile hook a Python call or more (a chunked attention's 290 ops per call).
        allowed: set = set()

        def check(func) -> None:
            name = getattr(func, "__name__", "") + " " + str(func)
            for op in forbidden:
                if op in name:
                    raise _answer_key_error(f"`{kata}`", f"torch's {op} ({getattr(func, '__name__', func)})")
            try:
                allowed.add(func)
            except TypeError:  # unhashable: read again each time
                pass

        class RefuseFunctions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                try:
                    seen = func in allowed
                except TypeError:
                    seen = False
                if not seen:
                    check(func)
                return func(*args, **(kwargs or {}))

        class RefuseKernels(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func not in allowed:  # an OpOverload: hashable
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
    shapes = frozenset((len(key[0]), key[3]) for key in locked)  # (bytecode length, argument count) of each
    families = tuple(lock.families)
    families_re = family_regex(families)
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
    # the plain modules, but those holding a locked function, a compiler or a mode switch, and every family's (their
    # code is read as any other)
    looked_at = lock.modules
    family_modules = [family_parts(pattern)[:2] for pattern, _ in families]
    plain = {name: namespace for name, namespace in _PLAIN.items() if name not in looked_at and not any(
        name == package or below and name.startswith(package + ".") for package, below in family_modules)}

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
            # a fingerprint is read only where one could match (the same bytecode length and argument count)
            key = fingerprint(code) if not mine and (len(code.co_code), code.co_argcount) in shapes else None
            answer, is_direct = (locked.get(key), key in direct) if key else (None, False)
            if answer is None and families_re is not None and not mine:
                module = namespace.get("__name__") or ""
                hit = families_re.match(f"{module}|{name_of(code)}")
                if hit is not None:
                    answer, is_direct = f"{module}.{name_of(code)}", hit.lastgroup == "direct"
            known = (code, answer, is_direct, mine, switches.get(code) is code)
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
            if known[1] == _COMPILE:
                raise record(AnswerKeyError(
                    f"{who[0]} compiled code ({code.co_name}): a compiled frame runs as other code than it was written "
                    "in, out of the answer-key lock's view. Graded code runs as it is written."))
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


class GraderError(Exception):
    """The grader's own work around a learner call failed (copying the inputs, comparing them after): said as the
    runner's failure, never as the learner's function raising."""


def call_learner(fn, inputs: dict, kata: str, meter=None, lock: CodeLock | None = None, used: dict | None = None):
    """Call the learner's function on fresh inputs (inside `lock`, the answer key closed); fail if it
    changed them in place.

    With `meter` (e.g. diffusion_katas.engine.meters.peak_bytes), the call runs as meter(call) after the
    inputs are copied, so copying is not measured, and (measurement, output) is returned.
    """
    try:
        given = fresh(inputs)
        pristine = fresh(inputs)
        before = {key: versions(value) for key, value in given.items()}
    except Exception as exc:  # noqa: BLE001  (the grader's inputs, before any learner code: not the learner's)
        raise GraderError(f"the check's inputs could not be copied: {type(exc).__name__}: {exc}") from None
    if used is not None:  # the copies the learner got: their generators' states are read after the call
        used.update(given)
    elsewhere = OtherThreads()

    def call():
        elsewhere.start()
        out = fn(**given) if meter is None else meter(lambda: fn(**given))
        return out, elsewhere.spent()

    if lock is not None:
        out, spent = lock.run(call, modes=lock.op_modes())
    else:
        out, spent = call()
    try:
        mutated = changed_inputs(given, pristine, before)
    except Exception as exc:  # noqa: BLE001  (the comparison is the grader's; what it met may be the learner's)
        raise GraderError(f"the in-place check could not compare the inputs after the call: "
                          f"{type(exc).__name__}: {exc}") from None
    if mutated:
        names = ", ".join(mutated)
        raise KataFailure(
            f"`{kata}` changed its input(s) {names} in place.\n"
            f"  trap: the caller's {names} changed in place\n"
            "    The caller still needs them (the pipeline reuses the latents, the schedule, the cache): compute "
            "into a new tensor (or dict, or list) instead of using in-place ops such as mul_, add_, x[...] =, "
            "`out=`, or assigning into the caller's dict.", Reason.MUTATED_INPUT)
    return out
