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
                 answer_key_direct: tuple = ()):
        self.zygote = Zygote.shared()
        self.zygote.load(grader_modules, (source, *learner_files))
        self.pid, self.sock = self.zygote.fork()
        self.timeout = timeout
        self.printed = ""
        self.closed = False
        self.open_reply = self._ask({
            "op": "open", "cwd": os.getcwd(), "sys_path": list(sys.path), "source": str(source), "module": module,
            "grader_modules": grader_modules, "answer_key": tuple(answer_key), "kata": kata,
            "forbidden_ops": tuple(forbidden_ops), "learner_files": [str(p) for p in learner_files],
            "answer_key_direct": tuple(answer_key_direct)})

    def _ask(self, request: dict, inputs: bytes | None = None) -> dict:
        import torch

        try:
            send(self.sock, pickle.dumps(request, protocol=5))
            if inputs is not None:
                send(self.sock, inputs)
        except OSError:
            raise self._gone() from None
        ready, _, _ = select.select([self.sock], [], [], self.timeout)
        if not ready:
            self._kill()
            raise RunnerGone(f"killed after the time limit of {self.timeout:g} s", timed_out=True)
        blob = recv(self.sock)
        if blob is None:
            raise self._gone()
        data = torch.load(io.BytesIO(blob), weights_only=True)
        self.printed += data.pop("output_text", "") or ""
        return data

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
        """One call of the learner's function; the runner's reply as a dict (kind: ok / raised / ...)."""
        blob = pickle.dumps(inputs, protocol=5)
        return self._ask({"op": "call", "function": function, "rng": rng, "meter": meter}, blob)

    def close(self) -> None:
        """End the runner and everything its learner code started. Every reply is already in (what it printed
        came with them), so nothing is lost by not letting it exit on its own."""
        if self.closed:
            return
        self.closed = True
        self.sock.close()
        _kill_group(self.pid)
        self.zygote.forget(self.pid)


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
