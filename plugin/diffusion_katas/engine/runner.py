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
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_katas.engine.runner_main import recv, send


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


@dataclass
class Reply:
    output: object = None
    measurement: object = None
    state: dict = field(default_factory=dict)
    rng_after: object = None
    printed: str = ""


class Zygote:
    """The warm parent: one per grading process, started on first use, ended at exit."""

    _lock = threading.Lock()
    _shared: "Zygote | None" = None

    def __init__(self):
        parent, child = socket.socketpair()
        env = dict(os.environ)
        # the package the grader runs is the package the runner runs
        package_parent = str(Path(__file__).resolve().parent.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
        for key in [k for k in env if k.startswith("KATA_HIDDEN")]:
            env.pop(key)  # the instructor's hidden seed never reaches the learner's side
        # Libraries' own thread pools run as many threads as torch does (KATA_THREADS, 1 by default), read when they
        # load: numpy's OpenBLAS would otherwise work in a second thread, which at one thread the runner counts
        # as work done outside the learner's call (engine/alone.py), and tokenizers' Rust pool likewise.
        threads = env.get("KATA_THREADS", "1")
        env.update(OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                   TOKENIZERS_PARALLELISM="false" if threads == "1" else "true")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "diffusion_katas.engine.runner_main", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True)
        child.close()
        self.control = parent
        self._buffer = b""

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

    def _line(self) -> str:
        while b"\n" not in self._buffer:
            chunk = self.control.recv(4096)
            if not chunk:
                raise RunnerGone("the runners' warm parent ended")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _command(self, command: dict, fds: list[int] = ()) -> str:
        socket.send_fds(self.control, [pickle.dumps(command)], list(fds))
        return self._line()

    def load(self, modules: list[tuple[str, str]], learner_sources: tuple = ()) -> None:
        """Load graders into the warm parent (once each), with the grader's cwd and import path, and the
        library modules they and the learner's files name (read, never run there)."""
        with self._lock:
            answer = self._command({"op": "load", "modules": list(modules), "cwd": os.getcwd(),
                                    "sys_path": list(sys.path), "learner_sources": [str(p) for p in learner_sources]})
        if answer != "ok":
            raise RuntimeError(f"the runners' warm parent could not load the grader: {answer[6:]}")

    def fork(self) -> tuple[int, socket.socket]:
        with self._lock:
            mine, theirs = socket.socketpair()
            try:
                pid = int(self._command({"op": "fork"}, [theirs.fileno()]).split()[1])
            finally:
                theirs.close()
        return pid, mine

    def wait(self, pid: int) -> str:
        with self._lock:
            return self._command({"op": "wait", "pid": pid})

    def forget(self, pid: int) -> None:
        """The runner was killed and its end does not matter: the warm parent reaps it when it can, and the
        next check does not wait for the old process's teardown."""
        with self._lock:
            self._command({"op": "forget", "pid": pid})

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


class Runner:
    """One runner process: opened for one check, on one learner file, then closed."""

    def __init__(self, source: Path, module: str, grader_modules: list[tuple[str, str]], answer_key: tuple,
                 kata: str, timeout: float, forbidden_ops: tuple = (), learner_files: tuple = (),
                 answer_key_direct: tuple = (), memory: int | None = None):
        self.zygote = Zygote.shared()
        self.zygote.load(grader_modules, (source, *learner_files))
        self.pid, self.sock = self.zygote.fork()
        self.timeout = timeout
        self.printed = ""
        self.closed = False
        self.remote: dict = {}
        self.remote_failures: list = []
        self.open_reply = self._ask({
            "op": "open", "cwd": os.getcwd(), "sys_path": list(sys.path), "source": str(source), "module": module,
            "grader_modules": grader_modules, "answer_key": tuple(answer_key), "kata": kata,
            "forbidden_ops": tuple(forbidden_ops), "learner_files": [str(p) for p in learner_files],
            "answer_key_direct": tuple(answer_key_direct), "memory": memory})

    def _ask(self, request: dict, inputs: bytes | None = None) -> dict:
        """Send a request and wait for its reply, serving the remote models' calls that come first; the time
        limit covers them all (a model call the grader runs is the learner's time too)."""
        import torch

        try:
            send(self.sock, pickle.dumps(request, protocol=5))
            if inputs is not None:
                send(self.sock, inputs)
        except OSError:
            raise self._gone() from None
        end = time.monotonic() + self.timeout
        while True:
            ready, _, _ = select.select([self.sock], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                self._kill()
                raise RunnerGone(f"killed after the time limit of {self.timeout:g} s", timed_out=True)
            blob = recv(self.sock)
            if blob is None:
                raise self._gone()
            data = torch.load(io.BytesIO(blob), weights_only=True)
            self.printed += data.pop("output_text", "") or ""
            if data.get("kind") != "callback":
                return data
            try:
                send(self.sock, self._serve_remote(data))
            except OSError:
                raise self._gone() from None

    def _serve_remote(self, data: dict) -> bytes:
        """Run one call of a remote model (runner_main's RemoteModel) here, under the runner's RNG, and answer
        with its output and the RNG after it. A KataFailure the model raises (a probe checking its calls) is
        kept as the check's verdict, whatever the learner's code does with the error it gets."""
        import torch

        from diffusion_katas.core.spec import KataFailure

        model = self.remote.get(data.get("handle"))
        args, kwargs = decode(data.get("args") or []), decode(data.get("kwargs") or {})
        answer: dict = {}
        if model is None:
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

    def call(self, function: str, inputs: dict, rng=None, meter=None) -> dict:
        """One call of the learner's function; the runner's reply as a dict (kind: ok / raised / ...).
        The remote models among the inputs (a class with `kata_remote = True`) stay here: the runner gets
        stand-ins whose calls `_ask` serves, and `remote_failures` holds what their checks raised."""
        buffer = io.BytesIO()
        self.remote, self.remote_failures = {}, []
        _Outbound(buffer, self.remote).dump(inputs)
        try:
            return self._ask({"op": "call", "function": function, "rng": rng, "meter": meter}, buffer.getvalue())
        finally:
            self.remote = {}

    def close(self) -> None:
        """End the runner and everything its learner code started. Every reply is already in (what it printed
        came with them), so nothing is lost by not letting it exit on its own."""
        if self.closed:
            return
        self.closed = True
        self.sock.close()
        _kill_group(self.pid)
        self.zygote.forget(self.pid)


class _Outbound(pickle.Pickler):
    """Pickles a call's inputs; a remote model becomes a persistent id (a handle and what the runner's stand-in
    shows of it: `remote_view()`), and the model itself stays in `remote`."""

    def __init__(self, file, remote: dict):
        super().__init__(file, protocol=5)
        self.remote = remote

    def persistent_id(self, obj):
        if not getattr(type(obj), "kata_remote", False):
            return None
        self.remote[id(obj)] = obj
        return ("kata-remote", id(obj), obj.remote_view())


# A remote model runs in the grader's process, so a call's inputs are capped there: the tiny models' real
# inputs are kilobytes (8x8 latents, 77-token embeddings), and a huge one would cost the grader, not the runner.
REMOTE_INPUT_CAP = 16 * 2**20


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
