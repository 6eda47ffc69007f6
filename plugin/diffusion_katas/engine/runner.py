"""The grader's side of the runner: learner code runs in a process of its own, never in the grader's.

One warm parent per grading process (a fresh interpreter, started once and shared by every session in
the process) forks one runner per check. The grader sends the runner the inputs of each call and gets
back the output, the exception, the meter reading and what the call printed; references, expected
values, traps and the report stay in the grader's process, where learner code never ran. Every way a
call can end is a verdict: an exception (KeyboardInterrupt and SystemExit included), os._exit, a
signal or segfault, a hang (killed on a wall clock, which also ends a hang inside C code), an output
nothing can grade.
"""
from __future__ import annotations

import atexit
import io
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from diffusion_katas.engine import runner_main
from diffusion_katas.engine.runner_main import send


class RunnerGone(Exception):
    """The runner ended without answering: `how` says how (signal 11, exit 0, killed after the time limit)."""

    def __init__(self, how: str, output: str = "", timed_out: bool = False):
        super().__init__(how)
        self.how = how
        self.output = output
        self.timed_out = timed_out


class RemoteError(Exception):
    """An exception raised in the runner, as the grader sees it: its type's name, message and frames."""

    def __init__(self, data: dict):
        super().__init__(data.get("message", ""))
        self.type_name = data.get("type", "Exception")
        self.module = data.get("module", "")
        self.message = data.get("message", "")
        self.frames = [tuple(f) for f in data.get("frames", [])]
        self.data = data

    def is_a(self, name: str) -> bool:
        return self.type_name == name

    def __str__(self) -> str:
        return self.message


class Zygote:
    """The warm parent: one per grading process, started on first use, ended at exit."""

    _lock = threading.Lock()
    _shared: "Zygote | None" = None

    def __init__(self):
        parent, child = socket.socketpair()
        # the package the grader runs is the package the runner runs
        package_parent = str(Path(__file__).resolve().parent.parent.parent)
        # Isolated mode (-I: no PYTHON* variables, no user site, no script folder on the path) and no bytecode
        # written (-B); the package is put first on the path by hand.
        code = ("import sys; sys.path.insert(0, sys.argv[1]); "
                "from diffusion_katas.engine.runner_main import zygote; zygote(int(sys.argv[2]))")
        # KATA_RUNNER_LOG (a file the grader's user names): where the warm parent and the runners write what
        # breaks them outside any learner call (a diagnostic; their stderr goes nowhere otherwise).
        log = os.environ.get("KATA_RUNNER_LOG")
        stderr = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115  (the child holds it)
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", code, package_parent, str(child.fileno())],
            pass_fds=(child.fileno(),), env=runner_environment(), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        if log:
            stderr.close()
        child.close()
        self.control = parent
        self._buffer = b""
        self._unread = 0  # answers to `preload` not read yet
        self._forked: list = []  # a `fork` sent, its pid not read yet (at most one: see `fork`)

    @classmethod
    def shared(cls) -> "Zygote":
        """The process's warm parent. Kept on `sys` as well, so that a second import of this module (pytester
        restores sys.modules between inline runs) finds it instead of starting another."""
        with cls._lock:
            current = cls._shared or getattr(sys, "_diffusion_katas_zygote", None)
            if current is None or current.process.poll() is not None:
                current = cls()
                atexit.register(current.close)
            cls._shared = current
            sys._diffusion_katas_zygote = current
            return current

    @classmethod
    def replaced(cls, dead: "Zygote") -> "Zygote":
        """A new warm parent in place of one that ended (or stopped answering) since it was last used."""
        with cls._lock:
            if cls._shared is dead or getattr(sys, "_diffusion_katas_zygote", None) is dead:
                dead.close()
                cls._shared = None
                sys._diffusion_katas_zygote = None
        return cls.shared()

    def _line(self) -> str:
        while b"\n" not in self._buffer:
            chunk = self.control.recv(4096)
            if not chunk:
                raise RunnerGone("the runners' warm parent ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _command(self, command: dict, fds: list[int] = ()) -> str:
        self._read_pending()
        socket.send_fds(self.control, [pickle.dumps(command)], list(fds))
        return self._line()

    def _read_pending(self) -> None:
        """Read the answers to commands sent without waiting, in the order they were sent: `preload`'s (a real
        `load` follows it and says what failed) and a `fork`'s pid."""
        while self._unread:
            self._line()
            self._unread -= 1
        while self._forked:
            pending = self._forked.pop(0)
            try:
                answer = self._line()
            except (OSError, RunnerGone) as exc:
                pending.append(exc)
                raise
            pending.append(answer)

    @classmethod
    def preload(cls, modules: list[tuple[str, str]], learner_sources: tuple = ()) -> None:
        """Ask the running warm parent (none is started here) to load graders, without waiting for it: it imports
        them while this process collects the same graders, on another core. One at a time: the control socket is a
        stream, and two commands sent before the first is read could arrive as one message (the second lost)."""
        with cls._lock:
            current = cls._shared or getattr(sys, "_diffusion_katas_zygote", None)
        if current is None or current.process.poll() is not None:
            return
        with current._lock:
            if current._unread or current._forked:
                return
            try:
                socket.send_fds(current.control, [pickle.dumps(current._load_command(modules, learner_sources))], [])
            except OSError:
                return
            current._unread += 1

    def load(self, modules: list[tuple[str, str]], learner_sources: tuple = ()) -> None:
        """Load graders into the warm parent (once each), with the grader's cwd and import path, and the
        library modules they and the learner's files name (read, never run there)."""
        with self._lock:
            answer = self._command(self._load_command(modules, learner_sources))
        if answer != "ok":
            raise RuntimeError(f"the runners' warm parent could not load the grader: {answer[6:]}")

    @staticmethod
    def _load_command(modules, learner_sources) -> dict:
        return {"op": "load", "modules": [tuple(m) for m in modules], "cwd": os.getcwd(), "sys_path": list(sys.path),
                "learner_sources": [str(p) for p in learner_sources]}

    def fork(self, lock: tuple = ()) -> tuple["Forked", socket.socket]:
        """A runner, forked with `lock` (CodeLock's arguments) already installed by the warm parent: the answer
        key's code is read once there, where its pages are the parent's own, not copied on first touch in each
        runner. The fork is not waited for: its socket can be written to at once (the runner reads it when it is
        there), and its pid is read when first needed, or before the next command (one unread command at most:
        the control socket is a stream, and the warm parent reads a command per message). Forking the warm
        parent's large heap takes it tens of milliseconds, which the grader spends building instead."""
        with self._lock:
            mine, theirs = socket.socketpair()
            try:
                self._read_pending()
                socket.send_fds(self.control, [pickle.dumps({"op": "fork", "lock": tuple(lock)})], [theirs.fileno()])
            finally:
                theirs.close()
            answer: list = []
            self._forked.append(answer)
        return Forked(self, answer), mine

    def wait(self, pid: int) -> str:
        with self._lock:
            return self._command({"op": "wait", "pid": pid})

    def forget(self, pid: int) -> None:
        """The runner was killed and its end does not matter: the warm parent reaps it when it can, and the
        next check does not wait for the old process's teardown."""
        with self._lock:
            self._command({"op": "forget", "pid": pid})

    def pid_of(self, answer: list) -> int:
        """The pid of a runner `fork` started (its answer read here if not yet)."""
        with self._lock:
            if not answer:
                self._read_pending()
        if isinstance(answer[0], BaseException):
            raise RunnerGone(f"the runners' warm parent could not fork ({answer[0]})")
        try:
            return int(answer[0].split()[1])
        except (IndexError, ValueError):
            raise RunnerGone(f"the runners' warm parent could not fork: {answer[0][:200]}") from None

    def close(self) -> None:
        try:
            self.control.close()
            self.process.terminate()
            self.process.wait(timeout=5)
        except Exception:  # noqa: BLE001
            try:
                self.process.kill()
            except Exception:  # noqa: BLE001
                pass


class Forked:
    """A runner being forked by the warm parent: its pid, read when first asked for."""

    def __init__(self, zygote: Zygote, answer: list):
        self._zygote, self._answer, self._pid = zygote, answer, None

    @property
    def pid(self) -> int:
        if self._pid is None:
            self._pid = self._zygote.pid_of(self._answer)
        return self._pid


# What the runners' environment keeps of the grader's: locale, paths the libraries read, the GPU's settings and
# the kata's own; never a secret (a token, a key, the instructor's hidden seed), whatever the grader was given.
_ENV_KEEP = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "NO_COLOR", "LD_LIBRARY_PATH",
             "SYSTEMROOT", "TMPDIR")
_ENV_KEEP_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "ROCM_", "HIP_", "TORCH_", "PYTORCH_", "KATA_", "HF_HUB_")
_ENV_SECRET_WORDS = ("TOKEN", "SECRET", "KEY", "PASSWORD", "CREDENTIAL", "AUTH", "HIDDEN", "COOKIE", "SESSION")


def runner_environment() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if (key in _ENV_KEEP or key.startswith(_ENV_KEEP_PREFIXES))
           and not any(word in key.upper() for word in _ENV_SECRET_WORDS)}
    # Libraries' own thread pools run as many threads as torch does (KATA_THREADS, 1 by default), read when they
    # load: numpy's OpenBLAS would otherwise work in a second thread, which at one thread the runner counts
    # as work done outside the learner's call (engine/alone.py), and tokenizers' Rust pool likewise.
    threads = env.get("KATA_THREADS", "1")
    env.update(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
               TOKENIZERS_PARALLELISM="false" if threads == "1" else "true", HF_HUB_OFFLINE="1")
    # Runners are forked from the warm parent, and a CUDA driver started before a fork is unusable after it: the
    # parent's imports ask torch.cuda.is_available(), which asks NVML instead of starting the driver with this set.
    env.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return env


class Runner:
    """One runner process: opened for one check, on one learner file, then closed."""

    def __init__(self, source: Path, module: str, grader_modules: list[tuple[str, str]], answer_key: tuple,
                 kata: str, timeout: float, forbidden_ops: tuple = (), learner_files: tuple = (),
                 answer_key_direct: tuple = (), memory: int | None = None, cuda: bool = False, wait: bool = True):
        """Fork a runner and send it `open`. Its reply (`open_reply`) is waited for here, or, with `wait=False`,
        when first read: the grader may build a case while the runner imports the learner's file."""
        self.zygote = Zygote.shared()
        try:
            self.zygote.load(grader_modules, (source, *learner_files))
        except (OSError, RunnerGone):  # it ended since it was last used (killed, out of memory): one more, once
            self.zygote = Zygote.replaced(self.zygote)
            self.zygote.load(grader_modules, (source, *learner_files))
        learner = {str(source), *(str(p) for p in learner_files)}
        self._forked, self.sock = self.zygote.fork((tuple(answer_key), kata, tuple(forbidden_ops), tuple(sorted(learner)),
                                                tuple(answer_key_direct)))
        self.timeout = timeout
        self.printed = ""
        self.closed = False
        self.remote: dict = {}
        self.remote_failures: list = []
        self.remote_calls = self.remote_bytes = 0
        self._opened: dict | None = None
        self._send({
            "op": "open", "cwd": os.getcwd(), "sys_path": list(sys.path), "source": str(source), "module": module,
            "grader_modules": grader_modules, "answer_key": tuple(answer_key), "kata": kata,
            "forbidden_ops": tuple(forbidden_ops), "learner_files": [str(p) for p in learner_files],
            "answer_key_direct": tuple(answer_key_direct), "memory": memory, "cuda": cuda})
        if wait:
            self._opened = self._answer()

    @property
    def pid(self) -> int:
        return self._forked.pid

    @property
    def open_reply(self) -> dict:
        """The runner's answer to `open`, read once: RunnerGone where the import ended the runner or outlived the
        time limit, which counts from when `open` was sent. Read after the limit (the grader was building), the
        reply is still read: a second's grace for what is already on its way."""
        if self._opened is None:
            self._end = max(self._end, time.monotonic() + 1.0)
            self._opened = self._answer()
        return self._opened

    def _ask(self, request: dict, inputs: bytes | None = None) -> dict:
        """Send a request and wait for its reply (`_send`, then `_answer`)."""
        self._send(request, inputs)
        return self._answer()

    def _send(self, request: dict, inputs: bytes | None = None) -> None:
        """Send a request; its time limit starts now."""
        try:
            send(self.sock, pickle.dumps(request, protocol=5))
            if inputs is not None:
                send(self.sock, inputs)
        except OSError:
            raise self._gone() from None
        self._end = time.monotonic() + self.timeout

    def _answer(self) -> dict:
        """The reply to the request sent last, serving the remote models' calls that come first; the time limit
        covers them all (a model call the grader runs is the learner's time too). What comes back is
        untrusted: its size is bounded before it is read, its reading by the same clock, its contents checked
        (`checked_reply`) before the grader uses any of it."""
        import torch

        end = self._end
        while True:
            blob = self._receive(end)
            try:
                data = torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as exc:  # noqa: BLE001  (whatever the bytes were, they were no reply)
                raise self._refuse_reply(f"a reply that could not be read ({type(exc).__name__})") from None
            try:
                data = checked_reply(data)
            except ValueError as exc:
                raise self._refuse_reply(str(exc)) from None
            text = data.pop("output_text", "")
            room = PRINTED_CAP - len(self.printed)
            if room > 0:
                self.printed += text[:room] + ("\n... (output capped)" if len(text) > room else "")
            if data.get("kind") != "callback":
                return data
            try:
                send(self.sock, self._serve_remote(data))
            except OSError:
                raise self._gone() from None

    def _receive(self, end: float) -> bytes:
        """One message from the runner: an 8-byte length, at most REPLY_CAP, then the bytes, all by `end`."""
        head = self._read_exactly(8, end)
        size = struct.unpack("!Q", head)[0]
        if size > REPLY_CAP:
            raise self._refuse_reply(f"a reply of {size:,} bytes (at most {REPLY_CAP // 2**20} MiB are read)")
        return self._read_exactly(size, end)

    def _read_exactly(self, n: int, end: float) -> bytes:
        chunks, got = [], 0
        while got < n:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                self._kill()
                raise RunnerGone(f"killed after the time limit of {self.timeout:g} s", timed_out=True)
            try:
                chunk = self.sock.recv(min(n - got, 1 << 20))
            except OSError:
                chunk = b""
            if not chunk:
                raise self._gone()
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def _refuse_reply(self, what: str) -> RunnerGone:
        self._kill()
        return RunnerGone(f"it sent {what}, which is not a reply; the runner was ended")

    def _serve_remote(self, data: dict) -> bytes:
        """Run one call of a remote model (runner_main's RemoteModel) here, under the runner's RNG, and answer
        with its output and the RNG after it. A KataFailure the model raises (a probe checking its calls) is
        kept as the check's verdict, whatever the learner's code does with the error it gets."""
        import torch

        from diffusion_katas.core.spec import KataFailure

        model = self.remote.get(data.get("handle"))
        args, kwargs = decode(data.get("args") or []), decode(data.get("kwargs") or {})
        answer: dict = {}
        self.remote_calls += 1
        self.remote_bytes += _tensor_bytes([args, kwargs])
        if self.remote_calls > REMOTE_CALLS_CAP or self.remote_bytes > REMOTE_BYTES_CAP:
            answer["error"] = ("RuntimeError", f"{model!r} was called {self.remote_calls:,} times with "
                                               f"{self.remote_bytes / 2**20:.0f} MiB of tensors in this check; the "
                                               f"grader runs at most {REMOTE_CALLS_CAP:,} calls and "
                                               f"{REMOTE_BYTES_CAP // 2**20} MiB for one check")
        elif model is None:
            answer["error"] = ("RuntimeError", "this model was an input of an earlier call: use the one your "
                                               "function is given")
        elif _ungradable(args) or _ungradable(kwargs):
            answer["error"] = ("TypeError", f"{model!r} got an argument of a type that cannot reach it: "
                                            f"{_ungradable(args) or _ungradable(kwargs)}")
        elif _tensor_bytes([args, kwargs]) > REMOTE_INPUT_CAP:
            answer["error"] = ("ValueError", f"{model!r} got {_tensor_bytes([args, kwargs]) / 2**20:.0f} MiB of "
                                             f"tensors in one call; the tiny models here take kilobytes (at most "
                                             f"{REMOTE_INPUT_CAP // 2**20} MiB a call)")
        else:
            saved = torch.random.get_rng_state()
            if data.get("rng") is not None:
                torch.random.set_rng_state(data["rng"])
            if hasattr(type(model), "kata_caller_grad"):  # whether the learner's code called it with autograd on
                model.kata_caller_grad = data.get("grad", False)
            try:
                with torch.no_grad():
                    answer["output"] = model(*args, **kwargs)
            except KataFailure as exc:
                self.remote_failures.append(exc)
                answer["error"] = ("RuntimeError", str(exc).strip())
            except Exception as exc:  # noqa: BLE001  (the learner's arguments made the model raise)
                answer["error"] = (type(exc).__name__, str(exc)[:2000])
            answer["rng"] = torch.random.get_rng_state()
            torch.random.set_rng_state(saved)
        try:
            return pickle.dumps(answer, protocol=5)
        except Exception as exc:  # noqa: BLE001
            return pickle.dumps({"error": ("TypeError", f"the model's output could not be sent back: {exc}"),
                                 "rng": answer.get("rng")}, protocol=5)

    def _gone(self) -> RunnerGone:
        how = self.zygote.wait(self.pid)
        _kill_group(self.pid)  # what the learner's code started goes with it
        self.closed = True
        return RunnerGone(how)

    def _kill(self) -> None:
        _kill_group(self.pid)
        self.zygote.wait(self.pid)
        self.closed = True

    def call(self, function: str, inputs: dict, rng=None, meter=None, observe: tuple = ()) -> dict:
        """One call of the learner's function; the runner's reply as a dict (kind: ok / raised / ...).
        The remote models among the inputs (a class with `kata_remote = True`) stay here: the runner gets
        stand-ins whose calls `_answer` serves, and `remote_failures` holds what their checks raised."""
        self.send_call(function, inputs, rng, meter, observe)
        return self.reply()

    def send_call(self, function: str, inputs: dict, rng=None, meter=None, observe: tuple = ()) -> "Sent":
        """`call`'s first half: the call is sent and the runner starts on it; `reply()` waits for it. The inputs as
        sent are returned (`Sent.inputs()` gives them back as they were, whatever changed the objects since)."""
        buffer = io.BytesIO()
        self.remote, self.remote_failures = {}, []
        self.remote_calls = self.remote_bytes = 0
        _Outbound(buffer, self.remote).dump(inputs)
        sent = Sent(buffer.getvalue(), dict(self.remote))
        try:
            self._send({"op": "call", "function": function, "rng": rng, "meter": meter,
                        "observe": list(observe)}, sent.blob)
        except BaseException:
            self.remote = {}
            raise
        return sent

    def reply(self) -> dict:
        """The reply to the call `send_call` sent."""
        try:
            return self._answer()
        finally:
            self.remote = {}

    def close(self) -> None:
        """End the runner and everything its learner code started. Every reply is already in (what it printed
        came with them), so nothing is lost by not letting it exit on its own."""
        if self.closed:
            return
        self.closed = True
        self.sock.close()
        try:
            pid = self.pid
        except RunnerGone:  # it was never forked: nothing to end
            return
        _kill_group(pid)
        self.zygote.forget(pid)


class Sent:
    """A call's inputs as they were pickled for the runner (the grader's own bytes: trusted), its remote models
    kept as the same objects."""

    def __init__(self, blob: bytes, remote: dict):
        self.blob, self.remote = blob, remote

    def inputs(self) -> dict:
        """A copy of the inputs as they were when sent, for the grader's own use (its traps)."""
        remote = self.remote

        class _Back(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) == (runner_main.__name__, "remote_stand_in"):  # the grader's model itself
                    return lambda handle, _view: remote[handle]
                return super().find_class(module, name)

        return _Back(io.BytesIO(self.blob)).load()


class _Outbound(pickle.Pickler):
    """Pickles a call's inputs; a remote model becomes a call of runner_main.remote_stand_in (a handle and what the
    runner's stand-in shows of it: `remote_view()`), and the model itself stays in `remote`. A CPU storage goes as
    its bytes (runner_main.typed_storage). reducer_override sees only objects pickle has no fast path for."""

    def __init__(self, file, remote: dict):
        super().__init__(file, protocol=5)
        self.remote = remote

    def reducer_override(self, obj):
        cls = type(obj)
        if cls.__name__ == "TypedStorage" and cls.__module__ == "torch.storage" and \
                obj._untyped_storage.device.type == "cpu":
            import torch

            data = torch.empty(0, dtype=torch.uint8).set_(obj._untyped_storage).numpy()
            return runner_main.typed_storage, (pickle.PickleBuffer(data), obj.dtype)
        if getattr(cls, "kata_remote", False):
            self.remote[id(obj)] = obj
            return runner_main.remote_stand_in, (id(obj), obj.remote_view())
        return NotImplemented


# A remote model runs in the grader's process, so a call's inputs are capped there: the tiny models' real
# inputs are kilobytes (8x8 latents, 77-token embeddings), and a huge one would cost the grader, not the runner.
REMOTE_INPUT_CAP = 16 * 2**20
# ... and so are a check's calls in all (a probe keeps what each call saw): the longest loops here make hundreds.
REMOTE_CALLS_CAP = 10_000
REMOTE_BYTES_CAP = 512 * 2**20
# What a runner sends is read only up to these: a reply (the tiny models' outputs are kilobytes to a few MiB)
# and what the learner's code printed, kept for the check's report.
REPLY_CAP = 64 * 2**20
PRINTED_CAP = 16_000

# The shape of a reply, checked before the grader uses it: kinds, and for each field the types it may hold.
_KINDS = frozenset({"ok", "raised", "import_error", "grader_error", "missing_function", "callback"})
_TEXT_CAP = 8_000  # characters of any one string in a reply


def _text(value, cap: int = _TEXT_CAP) -> str:
    return value[:cap] if isinstance(value, str) else ""


def _names(value, cap: int = 2_000) -> list[str]:
    return [v[:200] for v in value[:cap] if isinstance(v, str)] if isinstance(value, list) else []


def checked_reply(data) -> dict:
    """A runner's reply, reduced to what the grader reads, each field of the type it must have (ValueError where
    the reply is not one). The runner is the learner's process: nothing in it is taken on trust."""
    import torch

    if not isinstance(data, dict) or data.get("kind") not in _KINDS:
        raise ValueError("a reply of an unknown kind")
    kind = data["kind"]
    out: dict = {"kind": kind, "output_text": _text(data.get("output_text"), PRINTED_CAP)}
    if kind in ("ok", "raised") and data.get("state_kept") is True:  # the call changed what outlives it
        out["state_kept"] = True
    if kind == "ok":
        out["output"] = data.get("output")  # graded as a value: compared, never run
        measurement = data.get("measurement")
        if measurement is not None and (type(measurement) not in (int, float)):
            raise ValueError("a measurement that is not a number")
        out["measurement"] = measurement
        state = torch.random.get_rng_state()
        after = data.get("rng_after")
        out["rng_after"] = after if isinstance(after, torch.Tensor) and after.dtype == torch.uint8 \
            and after.shape == state.shape else None
        generators = data.get("generators")
        out["generators"] = {k[:200]: v for k, v in generators.items() if isinstance(k, str) and (
            _generator_state(v) or isinstance(v, list) and len(v) <= 4096 and all(map(_generator_state, v)))} \
            if isinstance(generators, dict) and len(generators) <= 64 else {}
        out["called"] = [[_text(pair[0], 500), _text(pair[1], 200)] for pair in data.get("called") or []
                         if isinstance(pair, (list, tuple)) and len(pair) == 2][:1000] \
            if isinstance(data.get("called"), list) else []
        observed = data.get("observed")
        out["observed"] = {k[:200]: v for k, v in observed.items() if isinstance(k, str) and _plain_data(v)} \
            if isinstance(observed, dict) and len(observed) <= 16 else {}
    elif kind in ("raised", "import_error"):
        for key in ("type", "module", "message", "reason", "detail"):
            out[key] = _text(data.get(key))
        out["frames"] = [(_text(f[0], 500), f[1] if type(f[1]) is int else 0, _text(f[2], 200), _text(f[3], 300))
                         for f in data.get("frames") or [] if isinstance(f, (list, tuple)) and len(f) == 4][:50] \
            if isinstance(data.get("frames"), list) else []
        out["called"] = [[_text(p[0], 500), _text(p[1], 200)] for p in data.get("called") or []
                         if isinstance(p, (list, tuple)) and len(p) == 2][:1000] \
            if isinstance(data.get("called"), list) else []
        for flag in ("kata_failure", "answer_key"):
            if data.get(flag) is True:
                out[flag] = True
        syntax = data.get("syntax")
        if isinstance(syntax, dict):
            out["syntax"] = dict(msg=_text(syntax.get("msg")), text=_text(syntax.get("text"), 300),
                                 filename=_text(syntax.get("filename"), 500),
                                 lineno=syntax.get("lineno") if type(syntax.get("lineno")) is int else 0)
    elif kind == "grader_error":
        out["message"] = _text(data.get("message"))
    elif kind == "callback":
        out["handle"] = data.get("handle") if type(data.get("handle")) is int else None
        out["args"] = data.get("args") if isinstance(data.get("args"), list) else []
        out["kwargs"] = {k: v for k, v in data["kwargs"].items() if isinstance(k, str)} \
            if isinstance(data.get("kwargs"), dict) else {}
        rng = data.get("rng")
        out["rng"] = rng if isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 \
            and rng.shape == torch.random.get_rng_state().shape else None
        out["grad"] = data.get("grad") is True
    out["functions"] = _names(data.get("functions"))
    out["stubs"] = _names(data.get("stubs"))
    return out


def _plain_data(value, depth: int = 0, budget: list | None = None) -> bool:
    """Strings, numbers, booleans and None, in lists, tuples and str-keyed dicts: at most 3 deep and 10,000 items."""
    budget = [10_000] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if value is None or type(value) in (bool, int, float):
        return True
    if type(value) is str:
        return len(value) <= _TEXT_CAP
    if type(value) in (list, tuple) and depth < 3:
        return all(_plain_data(v, depth + 1, budget) for v in value)
    if type(value) is dict and depth < 3:
        return all(type(k) is str and _plain_data(v, depth + 1, budget) for k, v in value.items())
    return False


def _generator_state(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1 and value.numel() <= 2**16


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(map(_tensor_bytes, value))
    if isinstance(value, dict):
        return sum(map(_tensor_bytes, value.values()))
    return 0


def _ungradable(value) -> str:
    """The type name of the first value in a decoded structure that could not cross from the runner."""
    if isinstance(value, Ungradable):
        return value.type_name
    if isinstance(value, (list, tuple)):
        return next((found for found in map(_ungradable, value) if found), "")
    if isinstance(value, dict):
        return next((found for found in map(_ungradable, value.values()) if found), "")
    return ""


def _kill_group(pid: int) -> None:
    """SIGKILL the runner's process group (the runner and every process its learner code started)."""
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except (ProcessLookupError, PermissionError):
            pass


def decode(value):
    """A reply value back into what the learner returned (numpy arrays untagged)."""
    if isinstance(value, dict) and "__kata__" in value:
        kind = value["__kata__"]
        if kind == "ndarray":
            return value["tensor"].numpy()
        if kind == "npscalar":
            return value["tensor"].numpy()[()]
        return Ungradable(value.get("type", "?"), value.get("repr", ""))
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, tuple):
        return tuple(decode(v) for v in value)
    if isinstance(value, dict):
        return {k: decode(v) for k, v in value.items()}
    return value


@dataclass(frozen=True)
class Ungradable:
    """An output of a type that cannot cross from the runner (a custom object): graded as itself, wrong."""

    type_name: str
    text: str = ""

    def __repr__(self) -> str:
        return f"<{self.type_name}>"
