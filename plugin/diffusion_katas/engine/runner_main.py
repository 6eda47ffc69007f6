"""The learner's side of grading: a warm parent that forks one runner per check, and the runner itself.

    python -m diffusion_katas.engine.runner_main CONTROL_FD

The warm parent is a fresh interpreter (nothing of the grader's process is in it: no expected values,
no hidden seed) that imports torch and diffusers once and never touches CUDA. For each check the
grader sends it one end of a socket pair; it forks a runner that talks to the grader over that
socket, and reports the runner's pid and, when asked, how it ended.

A runner loads the lab's grader module (so the classes of the inputs it receives resolve), locks the
answer key, imports the learner's kata file fresh, and then answers calls: inputs in, outputs,
exceptions and meter readings out. Replies are written with torch.save and read by the grader with
torch.load(weights_only=True): tensors, numbers, strings and containers only, so nothing a learner
returns can run code in the grader. Everything the runner prints is captured and capped.
"""
from __future__ import annotations

import gc
import io
import os
import pickle
import signal
import socket
import struct
import sys
import traceback

# Where this interpreter imports libraries from, as it started (-I: the standard library, site-packages and
# what their .pth files add, the package first), before any grader's path replaces sys.path: library code.
STARTUP_PATH = tuple(p for p in sys.path if p)
OUTPUT_CAP = 4000  # characters of a runner's own prints returned with a reply
MESSAGE_CAP = 2000  # characters of an exception's message
RUNNER_FAILED = 70  # a runner's exit status where its own code failed (EX_SOFTWARE), not the learner's
FRAMES_CAP = 12  # traceback frames kept (the learner's, or the last ones)
# Imported by the warm parent so that a runner starts in milliseconds.
# (the graders themselves are loaded into the warm parent on first use, with what they import).
PRELOAD = ("torch", "numpy", "ctypes", "platform", "resource", "logging", "inspect", "traceback",
           "diffusion_katas.core.spec", "diffusion_katas.engine.isolation", "diffusion_katas.engine.meters",
           "diffusion_katas.engine.sandbox")


# ---- framing: an 8-byte length, then the payload -----------------------------------------------------------
def send(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(payload)) + payload)


def recv(sock: socket.socket) -> bytes | None:
    head = _exactly(sock, 8)
    if head is None:
        return None
    return _exactly(sock, struct.unpack("!Q", head)[0])


def _exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ---- the warm parent ---------------------------------------------------------------------------------------
def zygote(control_fd: int) -> None:
    import atexit
    import shutil
    import tempfile

    control = socket.socket(fileno=control_fd)
    # The runners' one writable folder (engine/sandbox.py): emptied after each runner, removed at the end.
    _SCRATCH[:] = [tempfile.mkdtemp(prefix="kata-runners-")]
    tempfile.tempdir = _SCRATCH[0]

    def end(*_):
        """The grader's close() (or its end): the scratch folder removed, then out at once. Finalizing an
        interpreter that holds torch and diffusers took a second the grader waited for, and freed nothing the
        end of the process does not."""
        shutil.rmtree(_SCRATCH[0], True)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(0)

    atexit.register(shutil.rmtree, _SCRATCH[0], True)  # should anything end it another way
    signal.signal(signal.SIGTERM, end)
    gc.disable()  # imports only: each full collection would walk the whole growing heap (frozen before each fork)
    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001  (a missing optional module only costs a runner its warm start)
            pass
    gc.enable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in the terminal is the grader's to handle
    _prepare_runners()
    loaded: dict[str, tuple[str, int]] = {}
    forgotten: set[int] = set()  # killed runners whose end nobody waits for: reaped when they are gone
    children: set[int] = set()  # every runner not reaped yet (two may be alive: the next check's opens early)
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(control, 1 << 16, 1)
        except OSError:
            end()
        if not message:
            end()
        for pid in list(forgotten):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    forgotten.discard(pid)
                    children.discard(pid)
            except ChildProcessError:
                forgotten.discard(pid)
                children.discard(pid)
        if _none_running(children):
            _empty_scratch()
        command = pickle.loads(message)
        if command["op"] == "load":  # a grader, loaded once here so that every runner starts with it
            before = dict(loaded)
            gc.disable()  # as for PRELOAD
            try:
                answer = _load_graders(command, loaded)
            finally:
                gc.enable()
            if loaded != before:
                _LOCKS.clear()
            # the sandbox's plan again only where a grader was (re)loaded; the size always (the graders' and their
            # imports' size is the runners' starting point)
            _prepare_runners(plan=loaded != before)
            control.sendall((answer + "\n").encode())
        elif command["op"] == "fork" and fds:
            # Python's advice for fork without exec: what the runner inherits (torch, diffusers, the graders)
            # is never collected there, so its collections neither walk it nor copy its pages on write.
            _PREPARED[:] = [_prepared_lock(command.get("lock") or ())]
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                control.close()
                os.setpgid(0, 0)  # its own process group: a kill ends whatever the learner's code started
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the warm parent's end() is not the runner's
                code = 0
                log = os.dup(2)  # the warm parent's stderr (KATA_RUNNER_LOG), before serve() captures fd 2
                try:
                    serve(socket.socket(fileno=fds[0]))
                except BaseException:  # noqa: BLE001
                    code = RUNNER_FAILED
                    try:  # the runner's own failure, said where the grader's user can read it
                        import traceback

                        os.write(log, traceback.format_exc()[-8000:].encode("utf-8", "replace"))
                    except BaseException:  # noqa: BLE001
                        pass
                os._exit(code)
            os.close(fds[0])
            children.add(pid)
            control.sendall(f"pid {pid}\n".encode())
        elif command["op"] == "forget":
            forgotten.add(command["pid"])
            control.sendall(b"ok\n")
        elif command["op"] == "wait":
            try:
                _, status = os.waitpid(command["pid"], 0)
                how = (f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                       else f"exit {os.WEXITSTATUS(status)}")
            except ChildProcessError:
                how = "unknown"
            children.discard(command["pid"])
            if _none_running(children):
                _empty_scratch()
            control.sendall(f"{how}\n".encode())
        for fd in fds[1:] if command["op"] == "fork" else fds:
            os.close(fd)


def _none_running(children: set[int]) -> bool:
    """Whether every runner forked has ended (a zombie counts as ended; none is reaped here: the grader's `wait`
    reads how it ended)."""
    for pid in children:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return False
        except ChildProcessError:
            pass
    return True


_PREPARED: list = []  # (CodeLock's arguments, the lock installed with them) for the runner forked next
# Locks installed here, by their arguments: reading the answer key's code took 20-30 ms a fork, and a grading asks
# for the same few again and again. Emptied when a grader is (re)loaded (its functions may be in an answer key).
_LOCKS: dict = {}


def _prepared_lock(arguments: tuple):
    """The runner's lock, installed here in the warm parent before the fork (no learner code has run in either).
    A runner arms its own copy of it (the fork's): the one kept here is never armed, so it is reused as it was."""
    from diffusion_katas.engine.isolation import CodeLock

    if len(arguments) != 5:
        return None
    lock = _LOCKS.get(arguments)
    if lock is None:
        try:
            lock = CodeLock(*arguments)
            lock.install()
        except Exception:  # noqa: BLE001  (the runner installs its own, and reports what fails)
            return None
        if len(_LOCKS) >= 256:
            _LOCKS.clear()
        _LOCKS[arguments] = lock
    return arguments, lock


def _load_graders(command: dict, loaded: dict) -> str:
    from diffusion_katas.core.course import load_module

    os.chdir(command["cwd"])
    sys.path[:] = list(command["sys_path"])
    for path, name in command["modules"]:
        try:
            stamp = (path, os.stat(path).st_mtime_ns)
            if loaded.get(name) != stamp:
                module = load_module(path, name)
                loaded[name] = stamp
                warm_imports(path)
                warm_locks(module)
        except BaseException as exc:  # noqa: BLE001  (reported to the grader, which says so)
            loaded.pop(name, None)
            return f"error {type(exc).__name__}: {exc}".replace("\n", " ")[:MESSAGE_CAP]
    for path in command.get("learner_sources", ()):
        warm_imports(path)
    return "ok"


# Packages whose modules the warm parent may import on a file's say-so: libraries, never the learner's own.
LIBRARIES = frozenset({"torch", "numpy", "diffusers", "peft", "transformers", "safetensors", "huggingface_hub",
                       "accelerate", "PIL", "gguf", "diffusion_katas"})
_warmed: dict[str, int] = {}


def warm_imports(path: str) -> None:
    """Import, here in the warm parent, the library modules a file names (anywhere in it: graders import
    inside their check builders), so that no runner pays them after its fork: a runner that imports
    diffusers' AutoencoderKL module itself, to resolve its answer key or to unpickle its inputs, spends
    seconds on it, once per check. The file is read with `ast`, never run; only modules of LIBRARIES are
    imported, and a module that fails to import is left to the runner, which reports it as it would."""
    import ast
    import importlib

    try:
        stamp = os.stat(path).st_mtime_ns
        if _warmed.get(path) == stamp:
            return
        _warmed[path] = stamp
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule, if it is one
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.count(".") >= 2 \
                and node.value.replace(".", "").replace("_", "").isalnum():
            names.add(node.value.rsplit(".", 1)[0])  # an answer-key path: its module (or class)
    for name in sorted(names):
        if name.split(".")[0] not in LIBRARIES or name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except BaseException:  # noqa: BLE001  (not a module, or not importable here: the runner will say)
            pass


def warm_locks(module) -> None:
    """Resolve, here in the warm parent, the answer keys of a grader's katas (their families walk whole packages)
    and read their code's fingerprints, so that each runner's lock starts from what is known (engine/isolation.py)."""
    from diffusion_katas.core.spec import Kata
    from diffusion_katas.engine.isolation import CodeLock

    for kata in [v for v in vars(module).values() if isinstance(v, Kata)]:
        try:
            CodeLock(kata.answer_key, kata.name, kata.forbidden_ops, (), kata.answer_key_direct).install()
        except Exception:  # noqa: BLE001  (a key that cannot be resolved here is reported by the runner's own lock)
            pass


# ---- the runner --------------------------------------------------------------------------------------------
class Captured:
    """fd 1 and 2 go to a temporary file; each reply takes what was printed since the last one, capped."""

    def __init__(self):
        import tempfile

        self.file = tempfile.TemporaryFile()
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.file.fileno(), 1)
        os.dup2(self.file.fileno(), 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)

    def take(self) -> str:
        """What was printed since the last take (capped); the file is emptied, so it never outgrows the runner's
        file size cap (engine/sandbox.py) across calls, only within one."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        fd = self.file.fileno()
        n = os.lseek(fd, 0, os.SEEK_END)
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, min(n, OUTPUT_CAP * 4)) if n > 0 else b""
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        text = data.decode("utf-8", "replace")
        if len(text) > OUTPUT_CAP or n > len(data):
            text = text[:OUTPUT_CAP] + f"\n... (output capped: {n:,} bytes printed, {OUTPUT_CAP:,} characters shown)"
        return text


def encode(value):
    """A value as torch.load(weights_only=True) can read it; numpy arrays and scalars are tagged."""
    import numpy
    import torch

    if isinstance(value, numpy.ndarray):
        return {"__kata__": "ndarray", "tensor": torch.from_numpy(numpy.ascontiguousarray(value)).clone()}
    if isinstance(value, numpy.generic):
        return {"__kata__": "npscalar", "tensor": torch.from_numpy(numpy.asarray(value)).clone()}
    if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
        return value.detach().clone() if isinstance(value, torch.nn.Parameter) else value
    if isinstance(value, torch.Tensor):  # a subclass: graded as what it claims to be, a plain tensor
        return {"__kata__": "unsupported", "type": f"{type(value).__module__}.{type(value).__qualname__}"}
    if value is None or type(value) in (bool, int, float, str, complex):
        return value
    if type(value) in (list, tuple):
        return type(value)(encode(v) for v in value)
    if type(value) is dict:
        return {k: encode(v) for k, v in value.items()} if all(type(k) is str for k in value) else \
            {"__kata__": "unsupported", "type": "dict with non-str keys"}
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return value
    return {"__kata__": "unsupported", "type": f"{type(value).__module__}.{type(value).__qualname__}",
            "repr": _safe_repr(value)}


def _safe_repr(value) -> str:
    try:
        return repr(value)[:200]
    except BaseException:  # noqa: BLE001
        return "<unrepresentable>"


def reply(sock: socket.socket, captured: Captured, data: dict) -> None:
    import torch

    data["output_text"] = captured.take()
    buffer = io.BytesIO()
    try:
        torch.save(data, buffer)
    except BaseException as exc:  # noqa: BLE001  (an output that cannot be written is a verdict too)
        buffer = io.BytesIO()
        torch.save({"kind": "raised", "type": "UngradableOutput", "module": "", "message":
                    f"the output could not be sent back for grading: {type(exc).__name__}: {exc}"[:MESSAGE_CAP],
                    "frames": [], "output_text": data.get("output_text", "")}, buffer)
    send(sock, buffer.getvalue())


def frames_of(exc: BaseException, learner_files: set[str]) -> list[tuple[str, int, str, str]]:
    """(file, line, function, text) of the traceback: the learner's frames, or the last few."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if f.filename in learner_files]
    chosen = mine[-FRAMES_CAP:] if mine else frames[-3:]
    return [(f.filename, f.lineno or 0, f.name, (f.line or "").strip()[:200]) for f in chosen]


def raised(exc: BaseException, learner_files: set[str]) -> dict:
    from diffusion_katas.core.spec import KataFailure
    from diffusion_katas.engine.isolation import AnswerKeyError
    from diffusion_katas.engine.sandbox import file_size_note, refused_process_note

    try:
        message = str(exc)
    except BaseException:  # noqa: BLE001
        message = "<the exception's message could not be read>"
    if len(message) > MESSAGE_CAP:
        message = message[:MESSAGE_CAP] + f" ... ({len(message):,} characters, capped)"
    message += refused_process_note(exc) + file_size_note(exc) + _memory_note(exc, message)
    data = {"kind": "raised", "type": type(exc).__name__, "module": type(exc).__module__, "message": message,
            "frames": frames_of(exc, learner_files)}
    if isinstance(exc, KataFailure):
        data.update(kata_failure=True, reason=str(exc.reason), detail=exc.detail)
    if isinstance(exc, AnswerKeyError):
        data["answer_key"] = True
    if isinstance(exc, SyntaxError):
        data.update(syntax=dict(msg=exc.msg, lineno=exc.lineno or 0, text=(exc.text or "")[:200],
                                filename=exc.filename or ""))
    if isinstance(exc, RecursionError):
        data["message"] = "maximum recursion depth exceeded"
    return data


def serve(sock: socket.socket) -> None:
    """Answer the grader's requests until it says goodbye (or the connection ends)."""
    captured = Captured()
    _CHANNEL[:] = [sock, captured]  # what a remote model's call goes through
    module = None
    learner_files: set[str] = set()
    lock = None
    while True:
        blob = recv(sock)
        if blob is None:
            return
        request = pickle.loads(blob)
        op = request["op"]
        if op == "bye":
            return
        if op == "open":
            module, learner_files, lock, error = _open(request)
            reply(sock, captured, error or {"kind": "ok", "functions": sorted(
                k for k, v in vars(module).items() if callable(v)), "stubs": stubs(module)})
            continue
        if op == "call":
            inputs_blob = recv(sock)
            if inputs_blob is None:
                return
            try:  # the grader's inputs, before any learner code runs in this call (a GPU's tensors start CUDA here)
                inputs = _Inbound(io.BytesIO(inputs_blob)).load()
            except BaseException as exc:  # noqa: BLE001  (said as the runner's failure, never the learner's)
                reply(sock, captured, {"kind": "grader_error", "message": f"the check's inputs could not be loaded "
                                       f"in the runner: {type(exc).__name__}: {exc}"[:MESSAGE_CAP]})
                continue
            reply(sock, captured, _call(request, inputs, module, learner_files, lock))


# ---- models the grader runs: a call crosses to the grader's process and back -----------------------------
# A grader marks a probe's class `kata_remote = True` (engine/helpers.py's DenoiserProbe, say): the runner gets
# a stand-in that holds no weights and no counts. Each call sends its arguments (and the global RNG) to the
# grader, which runs the real model, counts and checks the call there, and sends the output (and the RNG) back.
# Learner code cannot call the model without being counted, nor rewrite what the count says.
_CHANNEL: list = []
_REMOTE: list = []


class _Inbound(pickle.Unpickler):
    """The grader's inputs (engine/runner.py's _Outbound pickled them), its remote models as stand-ins."""


def remote_stand_in(handle: int, view: dict):
    """What a remote model becomes in the runner (engine/runner.py's _Outbound names this function)."""
    return _remote_model()(handle, dict(view))


def typed_storage(data, dtype):
    """A CPU storage pickled as its bytes (engine/runner.py's _Outbound), rebuilt around them without a copy:
    torch's own pickling saves each storage as a file of its own, which cost the grader seconds a course."""
    import torch

    untyped = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if len(data) else torch.UntypedStorage(0)
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _remote_model():
    if _REMOTE:
        return _REMOTE[0]
    import torch

    class RemoteModel(torch.nn.Module):
        """A model that runs in the grader's process. What a kata function reads of it (config, dtype,
        device, the config's entries as attributes) is a copy; calling it runs the grader's model."""

        def __init__(self, handle: int, view: dict):
            super().__init__()
            self.__dict__["_kata_handle"] = handle
            self.__dict__["_kata_label"] = str(view.pop("label", "a model"))
            self.__dict__.update(view)

        def forward(self, *args, **kwargs):
            return _remote_call(self.__dict__["_kata_handle"], args, kwargs)

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                config = self.__dict__.get("config")
                if config is not None and not name.startswith("_") and name in config:
                    return config[name]
                raise AttributeError(f"{self.__dict__['_kata_label']} has no attribute {name!r} here (the model runs "
                                     "in the grader's process: call it, or read its config, dtype and device)") from None

        def __repr__(self) -> str:
            return self.__dict__["_kata_label"]

    _REMOTE.append(RemoteModel)
    return RemoteModel


def _remote_call(handle: int, args: tuple, kwargs: dict):
    import builtins

    import torch

    sock, captured = _CHANNEL
    buffer = io.BytesIO()
    try:
        torch.save({"kind": "callback", "handle": handle, "args": encode(list(args)), "kwargs": encode(kwargs),
                    "rng": torch.random.get_rng_state(), "grad": torch.is_grad_enabled(),
                    "output_text": captured.take()}, buffer)
    except Exception as exc:  # noqa: BLE001  (nothing was sent: the call fails here, the protocol stays in step)
        raise TypeError(f"the arguments could not be sent to the model: {type(exc).__name__}: {exc}") from None
    send(sock, buffer.getvalue())
    blob = recv(sock)
    if blob is None:  # the grader is gone: nothing is left to answer
        os._exit(0)
    answer = pickle.loads(blob)
    if answer.get("rng") is not None:  # as if the model had run here: later draws see its draws
        torch.random.set_rng_state(answer["rng"])
    if "error" in answer:
        name, message = answer["error"]
        kind = getattr(builtins, name, None)
        if isinstance(kind, type) and issubclass(kind, Exception):
            raise kind(message)
        raise RuntimeError(f"{name}: {message}")
    return answer["output"]


# What a TODO stub's code may consist of: `raise NotImplementedError` or `raise NotImplementedError("...")`.
_STUB_OPS = frozenset({"RESUME", "NOP", "CACHE", "EXTENDED_ARG", "LOAD_GLOBAL", "LOAD_CONST", "PUSH_NULL", "PRECALL",
                       "CALL", "CALL_FUNCTION", "RAISE_VARARGS"})
_NOT_PLAIN = 0x20 | 0x80 | 0x200  # generator, coroutine, async generator: calling one raises nothing yet


def stubs(module) -> list[str]:
    """The module's functions that do nothing but raise NotImplementedError (the kata's TODO stubs), read from
    their code, not called: the grader marks them TODO without building a reference for them."""
    import builtins
    import dis
    import types

    found = []
    for name, value in vars(module).items():
        if type(value) is not types.FunctionType:
            continue
        code = value.__code__
        if code.co_filename != getattr(module, "__file__", None):  # imported from another file: graded as it runs
            continue
        if code.co_names != ("NotImplementedError",) or code.co_flags & _NOT_PLAIN or \
                value.__globals__.get("NotImplementedError", builtins.NotImplementedError) is not \
                builtins.NotImplementedError:
            continue
        try:
            ops = list(dis.get_instructions(code))
        except Exception:  # noqa: BLE001
            continue
        if ops and ops[-1].opname == "RAISE_VARARGS" and all(
                op.opname in _STUB_OPS and (op.opname != "LOAD_CONST" or op.argval is None or isinstance(op.argval, str))
                for op in ops) and sum(op.opname == "RAISE_VARARGS" for op in ops) == 1:
            found.append(name)
    return sorted(found)


def _open(request: dict):
    """Prepare the runner: the grader's cwd and path, its grader module, the lock, the learner's module."""
    from diffusion_katas.core.course import load_module

    import torch

    os.chdir(request["cwd"])
    sys.path[:] = list(request["sys_path"])
    torch.set_num_threads(_threads())
    for path, name in request.get("grader_modules", ()):
        if name not in sys.modules:  # normally loaded by the warm parent already
            try:
                load_module(path, name)
            except BaseException as exc:  # noqa: BLE001
                return None, set(), None, {"kind": "grader_error", "message": f"{type(exc).__name__}: {exc}"[:MESSAGE_CAP]}
    from diffusion_katas.engine import sandbox
    from diffusion_katas.engine.alone import watch_threads
    from diffusion_katas.engine.isolation import CodeLock

    source = request["source"]
    learner_files = {source, *request.get("learner_files", ())}
    graders = [path for path, _name in request.get("grader_modules", ())]
    if request.get("cuda"):
        try:
            _start_cuda()
        except BaseException as exc:  # noqa: BLE001
            return None, set(), None, {"kind": "grader_error", "message": f"CUDA did not start in the runner: "
                                       f"{type(exc).__name__}: {exc}"[:MESSAGE_CAP]}
    # Confined for good before any learner code: its own folder and the graders readable, nothing else of the
    # course (engine/sandbox.py). Graded code starts no process of its own, at import or in a call.
    sandbox.enter(sorted({os.path.dirname(f) for f in learner_files} | set(graders)))
    watch_threads(_threads())
    _limit_memory(request.get("memory"))
    arguments = (tuple(request.get("answer_key", ())), request.get("kata", ""), tuple(request.get("forbidden_ops", ())),
                 tuple(sorted(learner_files)), tuple(request.get("answer_key_direct", ())))
    prepared = _PREPARED.pop() if _PREPARED else None
    if prepared and prepared[0] == arguments:
        lock = prepared[1]
    else:
        lock = CodeLock(*arguments)
        lock.install()
    plan = sandbox.plan()
    lock.arm(tuple(plan.library_roots if plan else ()) + tuple(graders))
    sandbox.forget_ctypes()
    try:  # in the lock's window: the answer key is refused at import as in a call
        module = lock.run(load_module, source, request["module"], who="the kata file, at import,")
    except BaseException as exc:  # noqa: BLE001  (SyntaxError, ImportError, SystemExit, KeyboardInterrupt...)
        data = raised(exc, learner_files)
        data["kind"] = "import_error"
        return None, learner_files, lock, data
    return module, learner_files, lock, None


def _start_cuda() -> None:
    """Start CUDA (the driver and a context) in a GPU check's runner before its sandbox closes: the driver names its
    threads as it starts, through /proc/<pid>/task/<tid>/comm, a write the sandbox refuses (cuInit then fails with
    error 304, "OS call failed"). Its device files stay open; no learner code has run yet."""
    import torch

    if torch.cuda.is_available():
        torch.empty(1, device="cuda")
        torch.cuda.synchronize()


def _threads() -> int:
    return int(os.environ.get("KATA_THREADS", "1"))


_MEMORY: list = []  # the limit set, in bytes beyond the runner's start, for the note on a failed allocation
_START_SIZE: list = []  # the warm parent's address-space size, which each runner starts from


def _prepare_runners(plan: bool = True) -> None:
    """What every runner needs and the warm parent can do once: the sandbox's plan, its own size read."""
    from diffusion_katas.engine import sandbox

    if plan or sandbox.plan() is None:
        from diffusion_katas.engine.isolation import plain_modules

        sandbox.prepare(_SCRATCH[0] if _SCRATCH else "", os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        library_paths=STARTUP_PATH)
        plain_modules()
    _START_SIZE[:] = [_address_space()]


_SCRATCH: list = []  # the runners' writable folder, made by the warm parent


def _empty_scratch() -> None:
    """What the last runner left in the scratch folder goes (no runner is alive to need it)."""
    import shutil

    if not _SCRATCH:
        return
    try:
        entries = os.listdir(_SCRATCH[0])
    except OSError:
        return
    for name in entries:
        path = os.path.join(_SCRATCH[0], name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def _address_space() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, ValueError, StopIteration):
        return None


def _limit_memory(extra: int | None) -> None:
    """Cap what learner code can map: RLIMIT_AS (every mapping, shared memory such as /dev/shm included) at the
    runner's own size plus `extra`. Past it an allocation fails (MemoryError, torch's "can't allocate memory")
    instead of the machine running out: a verdict for the check, and the run goes on."""
    import resource

    used = _START_SIZE[0] if _START_SIZE and _START_SIZE[0] else _address_space()
    if not extra or used is None:
        return
    try:
        resource.setrlimit(resource.RLIMIT_AS, (used + extra, used + extra))
    except (OSError, ValueError):
        return
    _MEMORY[:] = [extra]


def _memory_note(exc: BaseException, message: str) -> str:
    import errno

    if _MEMORY and (isinstance(exc, MemoryError) or "can't allocate memory" in message
                    or isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
        return (f" (the runner's memory limit: {_MEMORY[0] / 2**30:g} GiB beyond its own; set with --kata-memory or "
                "kata_memory)")
    return ""


def _call(request: dict, inputs: dict, module, learner_files: set[str], lock) -> dict:
    import torch

    from diffusion_katas.engine.isolation import GraderError, call_learner

    fn = getattr(module, request["function"], None)
    if not callable(fn):
        return {"kind": "missing_function"}
    torch.set_num_threads(_threads())  # what grading runs with, whatever the learner's file set at import
    if request.get("rng") is not None:
        torch.random.set_rng_state(request["rng"])
    used: dict = {}
    kept = _kept_state(fn, module)
    # as the file left it when first called: a later call that starts from other state sees what earlier calls left
    first = _FIRST_STATE.setdefault((id(module), request["function"]), kept)
    try:
        result = call_learner(fn, inputs, request["function"], request.get("meter"), lock, used)
    except GraderError as exc:  # the grader's work around the call: its failure, with its message
        return {"kind": "grader_error", "message": str(exc)[:MESSAGE_CAP]}
    except BaseException as exc:  # noqa: BLE001  (every way a call can end is a verdict)
        return dict(raised(exc, learner_files), called=_called(lock),
                    state_kept=kept != first or _kept_state(fn, module) != kept)
    if request.get("meter") is None:
        measurement, out = None, result
    elif isinstance(result, tuple) and len(result) == 2:  # peak_bytes, flops: (measurement, output)
        measurement, out = result
    else:  # cuda_time_ms: the measurement alone
        measurement, out = result, None
    generators = {name: value.get_state() for name, value in used.items() if isinstance(value, torch.Generator)}
    generators.update({name: [v.get_state() for v in value] for name, value in used.items()  # one per sample
                       if isinstance(value, list) and value and all(isinstance(v, torch.Generator) for v in value)})
    observed = {}
    for name in request.get("observe") or ():  # what a grader's input recorded of the call (its dtype moves, say)
        try:
            observed[name] = used[name].kata_observe()
        except Exception:  # noqa: BLE001  (no such input, or it records nothing: nothing observed)
            pass
    return {"kind": "ok", "output": encode(out), "measurement": measurement, "observed": observed,
            "rng_after": torch.random.get_rng_state(), "called": _called(lock), "generators": generators,
            "state_kept": kept != first or _kept_state(fn, module) != kept}


_FIRST_STATE: dict[tuple[int, str], tuple] = {}  # (module, function) -> _kept_state before its first call here


def _kept_state(fn, module) -> tuple:
    """What the learner's function can keep between calls, fingerprinted: its mutable default arguments and its
    module's top-level dicts, lists and sets (which entries, each value by identity). A call that changes it
    leaves state the next call sees (a cache in a default argument carried into the next generation)."""
    try:
        held = list(getattr(fn, "__defaults__", None) or ()) + list((getattr(fn, "__kwdefaults__", None) or {}).values())
        held += [v for k, v in sorted(vars(module).items()) if not k.startswith("__")] if module is not None else []
        prints = []
        for value in held:
            if type(value) is dict:
                prints.append(("dict", id(value), tuple((repr(k)[:80], id(v)) for k, v in value.items())))
            elif type(value) in (list, set):
                prints.append((type(value).__name__, id(value), tuple(sorted(map(id, value)))))
        return tuple(prints)
    except Exception:  # noqa: BLE001  (a fingerprint is advice: it never fails a call)
        return ()


def _called(lock) -> list[list[str]]:
    """The learner's functions that ran in the call, as [file, name] pairs."""
    return sorted([file, name] for file, name in (lock.called if lock is not None else ()))


if __name__ == "__main__":
    zygote(int(sys.argv[1]))
