"""Grading children: one pytest process per pass, in its own process group, under a wall-clock limit.

`python -m pytest katas -q --kata-json R --gradescope G` runs in a child process that
leads its own session; on expiry the whole group is killed (SIGKILL reaches code stuck in C, where
pytest-timeout's signal cannot). R and G are fresh uuid names in a folder the parent owns, and the
result is only what the child's report R says: a child that hangs, crashes, segfaults, calls os._exit
(even with status 0) or writes no report has no result, with the reason.

Items marked `cuda` (GPU budgets) never share a GPU: the first pass runs `-m "not cuda"`, then a cuda
pass runs `-m cuda` for a submission whose selected labs have such items.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_katas.commands.instructor.catalog import Catalog
from diffusion_katas.commands.running import pytest_command, pytest_env
from diffusion_katas.commands.instructor.submissions import Prepared


# ---- one grading child -------------------------------------------------------------------------------------
@dataclass
class ChildRun:
    marker: str  # the -m expression of this pass
    report: dict | None = None
    gradescope_text: str | None = None  # the Gradescope file exactly as the child wrote it
    reason: str = ""  # why there is no usable report
    outcome: str = ""  # timed out / crashed / no report
    returncode: int | None = None
    seconds: float = 0.0
    output_tail: str = ""


class Children:
    """The grading children of one run, so that an interrupt kills their groups; once closed, a child
    that starts anyway (its thread was past the check) is killed at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._alive: set[subprocess.Popen] = set()
        self._closed = False

    def add(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._alive.add(proc)
            closed = self._closed
        if closed:
            kill_group(proc)

    def discard(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._alive.discard(proc)

    def kill_all(self) -> None:
        with self._lock:
            self._closed = True
            alive = list(self._alive)
        for proc in alive:
            kill_group(proc)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (it leads its own session)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:  # pragma: no cover  (Windows: no process groups to kill)
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to `timeout` s for the child to exit WITHOUT reaping it: while it is an unreaped zombie its
    process-group id cannot be reused, so killing the group afterwards cannot hit a stranger."""
    if not hasattr(os, "waitid"):  # pragma: no cover
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        try:
            if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(delay, left))
        delay = min(delay * 1.5, 0.5)


def run_child(project: Path, config: Path, marker: str, pytest_args: list[str], timeout: float,
              workdir: Path, children: Children, secret: bytes | None = None,
              package_parent: Path | None = None, box: int | None = None) -> ChildRun:
    """Grade project/katas in a child pytest; the result is only what its report file says. `secret` (the
    hidden seed and cases) reaches the child on an inherited pipe, never on its command line;
    `package_parent` is where the child imports diffusion_katas from (default: where this process does);
    `box` is the sandbox box its runners use where grading runs as root (engine/sandbox.py), the project
    opened to it."""
    try:
        return _run_child(project, config, marker, pytest_args, timeout, workdir, children, secret,
                          package_parent, box)
    except OSError as exc:  # its folders were removed under it (by another submission's code, say)
        run = ChildRun(marker, outcome="crashed")
        run.reason = f"the grading process could not run: {exc}"
        return run


def _run_child(project: Path, config: Path, marker: str, pytest_args: list[str], timeout: float,
               workdir: Path, children: Children, secret: bytes | None, package_parent: Path | None,
               box: int | None) -> ChildRun:
    from diffusion_katas.commands.instructor.hidden import feed

    run = ChildRun(marker)
    workdir.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    report_path = workdir / f"{token}.json"
    gradescope_path = workdir / f"{token}-gradescope.json"
    log_path = workdir / f"{token}.log"
    command = pytest_command("katas", "-q", "-p", "no:cacheprovider", "-c", str(config), "--rootdir", str(project),
                             "--kata-json", str(report_path), "--gradescope", str(gradescope_path), "-m", marker,
                             *pytest_args)
    env = pytest_env(package_parent) if package_parent else pytest_env()
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    for key in [k for k in env if k.startswith("KATA_HIDDEN")]:
        env.pop(key)  # hidden seeds travel on the pipe only
    env.pop("KATA_BOX", None)
    env["KATA_NO_WARM"] = "1"  # graded in its own process, never by a warm grader (core/warm.py), nor starting one
    if box is not None:  # the child opens its kata folder to it (engine/sandbox.py, open_to_box)
        env["KATA_BOX"] = str(box)
    read, writer = feed(secret)
    if read is not None:
        command += ["--kata-secret-fd", str(read)]
    start = time.monotonic()
    with open(log_path, "wb") as log:
        # Output to a file, not a pipe: a grandchild holding the pipe open could not block the parent.
        try:
            proc = subprocess.Popen(command, cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=(read,) if read is not None else ())
        finally:
            if read is not None:
                os.close(read)
        if writer is not None:
            writer.start()
        children.add(proc)
        try:
            timed_out = not _exited(proc, timeout)
        finally:
            kill_group(proc)  # on expiry, and after a normal exit: whatever the submission left running
            proc.wait()
            children.discard(proc)
    run.seconds = time.monotonic() - start
    run.returncode = proc.returncode
    run.output_tail = _tail(log_path)
    if timed_out:
        run.outcome = "timed out"
        run.reason = (f"timed out after {timeout:g} s (wall clock): the grading process and everything it "
                      "started were killed; look for a loop that never ends")
        return run
    if not report_path.is_file():
        run.outcome, run.reason = _no_report(proc.returncode, run.output_tail)
        return run
    try:
        report = json.loads(report_path.read_text(encoding="utf-8"))
        if not isinstance(report, dict) or not isinstance(report.get("results"), list):
            raise ValueError("no results list")
    except ValueError as exc:
        run.outcome = "no report"
        run.reason = f"the grading process wrote an unreadable report ({exc}); not graded"
        return run
    run.report = report
    if gradescope_path.is_file():
        run.gradescope_text = gradescope_path.read_text(encoding="utf-8", errors="replace")
    for path in (report_path, gradescope_path, log_path):
        path.unlink(missing_ok=True)
    return run


def _no_report(returncode: int, tail: str) -> tuple[str, str]:
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        extra = " (a segmentation fault: native code, e.g. ctypes, read memory it does not own)" \
            if name == "SIGSEGV" else ""
        return "crashed", f"the grading process was killed by {name}{extra} and wrote no report"
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    said = f"; it last printed: {last[:200]}" if last and returncode not in (0, None) else ""
    why = " (os._exit in the submission?)" if returncode == 0 else ""
    return "crashed", f"the grading process exited with code {returncode} without writing its report{why}{said}"


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", errors="replace")


# ---- the passes of one submission --------------------------------------------------------------------------
@dataclass
class Grading:
    """What every child of one run shares."""

    catalog: Catalog
    pytest_args: list[str]
    timeout: float
    workdir: Path
    children: Children = field(default_factory=Children)
    secret: bytes | None = None  # the hidden seed and cases, for each child's pipe
    package_parent: Path | None = None  # where the children import diffusion_katas from (a guarded copy)
    cuda: bool = True  # whether this machine has CUDA: without it the cuda pass is not run
    slots: "itertools.count" = field(default_factory=lambda: itertools.count())  # the children's sandbox boxes

    def box(self) -> int:
        """A box number for the next child (KATA_BOX): distinct from every child running at the same time, here and
        in another grading process (up to 100 children at once each)."""
        return (os.getpid() % 100_000) * 100 + next(self.slots) % 100


def first_pass(prep: Prepared, grading: Grading) -> ChildRun | None:
    if prep.problem:
        return None
    return run_child(prep.project, prep.config, "not cuda", grading.pytest_args, grading.timeout, grading.workdir,
                     grading.children, grading.secret, grading.package_parent, grading.box())


def needs_cuda_pass(prep: Prepared, first: ChildRun | None, grading: Grading) -> bool:
    return (grading.cuda and first is not None and first.report is not None
            and any(lab in prep.present for lab in grading.catalog.cuda_labs()))


def cuda_pass(prep: Prepared, grading: Grading) -> ChildRun:
    return run_child(prep.project, prep.config, "cuda", grading.pytest_args, grading.timeout, grading.workdir,
                     grading.children, grading.secret, grading.package_parent, grading.box())


def cuda_present() -> bool:
    """Whether this machine can run the cuda pass (asked once, in the instructor's process: the children
    would only skip every item, at ~10 s of imports per submission)."""
    if os.environ.get("KATA_CUDA_PASS") in ("always", "never"):
        return os.environ["KATA_CUDA_PASS"] == "always"
    import torch

    return torch.cuda.is_available()


# ---- signals while children run ---------------------------------------------------------------------------
def terminate_as_exit():
    """SIGTERM and SIGHUP raise SystemExit while children run, so that their groups get killed (the
    children lead their own sessions: a signal to the parent's group does not reach them)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {}
    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            previous[name] = signal.signal(getattr(signal, name), stop)
    return previous


def restore_signals(previous) -> None:
    for name, handler in (previous or {}).items():
        signal.signal(getattr(signal, name), handler)
