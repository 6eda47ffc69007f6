"""A pytest process kept warm between gradings: torch, diffusers, the graders and the runners' warm parent stay
loaded, so a save is graded in about a second instead of paying every import again.

    python -m diffusion_katas.commands.warm            # `kata watch`: one JSON list of pytest arguments per line
    python -m diffusion_katas.commands.warm --serve ROOT   # the course's warm grader behind a plain `pytest`

For each request of `kata watch` it runs pytest.main with those arguments (its output goes to stdout as usual)
and then prints a line `\\x00done EXIT_CODE`. With --serve it listens on the course's socket (core/warm.py) for
plain pytest runs (pytest_plugin/warm.py): each brings its arguments, working directory and its own stdout and
stderr, and gets its exit code back; the grader ends when idle, or when what it loaded went stale. Learner code
never runs here: pytest grades through the runners.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

DONE = "\x00done"


def main() -> int:
    if sys.argv[1:2] == ["--serve"] and len(sys.argv) == 3:
        return serve(Path(sys.argv[2]))
    os.environ["KATA_NO_WARM"] = "1"  # its pytest runs are the gradings: none is handed on
    import pytest  # noqa: F401

    # what a first grading imports anyway: import it now, while the learner is still typing (the plugin
    # itself loads through its entry point, on the first pytest.main)
    import torch  # noqa: F401

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        code = run_pytest(json.loads(line))
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"{DONE} {code}", flush=True)
    return 0


def run_pytest(args: list[str]) -> int:
    """pytest.main(args) as its exit code; the warm process outlives a usage error or one broken grading."""
    import pytest

    try:
        return int(pytest.main(list(args)))
    except SystemExit as exc:  # a usage error
        return exc.code if isinstance(exc.code, int) else 4
    except Exception as exc:  # noqa: BLE001
        print(f"the warm grader failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 3


class _Writing:
    """stdout and stderr (the descriptors, so pytest's capture and everything else follow) pointed at `out` and
    `err` for a while, then back."""

    def __init__(self, out: int, err: int):
        self.fds = (out, err)

    def __enter__(self):
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.fds[0], 1)
        os.dup2(self.fds[1], 2)
        return self

    def __exit__(self, *exc):
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        for fd in self.saved:
            os.close(fd)
        return False


def serve(root: Path) -> int:
    """The course's warm grader: one request at a time, until idle or stale."""
    import fcntl
    import socket
    import time

    from diffusion_katas.core import warm
    from diffusion_katas.core.course import Course

    os.environ["KATA_NO_WARM"] = "1"
    root = root.resolve()
    where = warm.make_folder(root)
    lock = open(warm.lock_path(root), "w")  # noqa: SIM115  (held for the grader's life: one per environment)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another one is starting or running
    path = warm.socket_path(root)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_mask = os.umask(0o177)
    try:
        with warm.address(path) as where_to:
            listener.bind(where_to)
    finally:
        os.umask(old_mask)
    listener.listen(8)
    identity = os.stat(path).st_ino
    course = Course(root)
    package = Path(__file__).resolve().parent.parent

    def current() -> str:
        return warm.stamp(root, package, course.graders)

    started = current()
    _warm_up(course)
    log(f"listening on {path} (pid {os.getpid()})")
    listener.settimeout(warm.idle_seconds(os.environ))
    try:
        while True:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                log("idle: ending")
                return 0
            with conn:
                begun = time.monotonic()
                outcome = _serve_one(conn, root, started, current)
                log(f"{outcome} in {time.monotonic() - begun:.2f} s")
                if outcome == "stale":
                    return 0
    finally:
        try:
            if os.stat(path).st_ino == identity:
                path.unlink()
        except OSError:
            pass


def _warm_up(course) -> None:
    """Before the first request: grade the labs graded last once, silently (their graders and what they import
    load here and in the runners' warm parent, their references are built once), keeping no record: a run with
    --gradescope (to a file thrown away) is an autograder's, which leaves the learner's record and hints alone."""
    import tempfile

    from diffusion_katas.core import record

    last = ((record.load(course) or {}).get("last_run") or {}).get("labs") or []
    targets = [str(course.kata(lab)) for lab in last if course.kata(lab).is_file()] or [str(course.katas)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        with _Writing(devnull, devnull), tempfile.TemporaryDirectory(prefix="kata-warm-") as tmp:
            run_pytest(["-q", "-p", "no:cacheprovider", "--rootdir", str(course.root), "--gradescope",
                        os.path.join(tmp, "thrown-away.json"), *targets])
    except BaseException as exc:  # noqa: BLE001  (a warm-up that fails only leaves the first grading colder)
        log(f"warm-up: {type(exc).__name__}: {exc}")
    finally:
        os.close(devnull)
    log(f"warmed up on {', '.join(last) or 'every lab'}")


def log(line: str) -> None:
    import time

    print(f"{time.strftime('%H:%M:%S')} {line}", flush=True)


def _serve_one(conn, root: Path, started: str, current) -> str:
    """One plain pytest run: checked, then run with the client's descriptors as stdout and stderr."""
    import socket
    import struct
    import threading
    import _thread

    from diffusion_katas.core import warm

    conn.settimeout(10.0)
    fds, accepted = [], False
    try:
        _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                              struct.calcsize("3i")))
        message, fds, _flags, _addr = socket.recv_fds(conn, warm.REQUEST_LIMIT, 2)
        if uid != os.getuid():
            _answer(conn, refused="another user")
            return f"refused a run of uid {uid}"
        request = json.loads(message)
        args, cwd, env = request.get("args"), request.get("cwd"), request.get("env")
        if not (request.get("v") == warm.PROTOCOL and isinstance(args, list) and len(args) < 1000
                and all(isinstance(a, str) for a in args) and isinstance(cwd, str) and isinstance(env, dict)
                and set(env) <= set(warm.PASSED_ENV) and all(isinstance(v, str) for v in env.values())
                and len(fds) == 2):
            _answer(conn, refused="not a request")
            return "refused a malformed request"
        if warm.cold_reason(args, {}) is not None:
            _answer(conn, refused="a run that grades cold")
            return "refused a cold run"
        if request.get("stamp") != started or current() != started:
            _answer(conn, stale=True)
            return "stale"
        place = Path(cwd).resolve()
        if not (place == root or root in place.parents):
            _answer(conn, refused="outside the course")
            return "refused a run outside the course"
        if _gone(conn):  # it waited too long for this grader (busy with another run) and graded cold itself
            return "dropped a run that had gone cold"
        _answer(conn, ok=True)
        accepted = True
    except (OSError, ValueError, struct.error):
        return "dropped a request"
    finally:
        if not accepted:
            for fd in fds:
                os.close(fd)

    old_env = {k: os.environ.get(k) for k in warm.PASSED_ENV}
    running = threading.Lock()
    state = {"running": True}

    def interrupter():  # the client's Ctrl-C (a byte) or its going away (end of stream): stop the grading
        try:
            conn.settimeout(None)
            conn.recv(1)
        except OSError:
            pass
        with running:
            if state["running"]:
                _thread.interrupt_main()

    code = 3
    try:
        with _Writing(*fds):
            for k in warm.PASSED_ENV:
                os.environ.pop(k, None)
            os.environ.update(env)
            os.chdir(cwd)
            threading.Thread(target=interrupter, daemon=True).start()
            try:
                code = run_pytest(args)
            except KeyboardInterrupt:
                code = 2
            finally:
                with running:
                    state["running"] = False
    except KeyboardInterrupt:  # a Ctrl-C that arrived as the grading ended
        code = 2
    finally:
        for fd in fds:
            os.close(fd)
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.chdir(root)
    try:
        _answer(conn, exit=code)
    except OSError:
        pass
    return f"graded {' '.join(args)[:200]}: exit {code}"


def _gone(conn) -> bool:
    """Whether the client has closed its end (nothing more to read, ever)."""
    import socket

    conn.setblocking(False)
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        conn.setblocking(True)


def _answer(conn, **fields) -> None:
    conn.sendall((json.dumps(fields) + "\n").encode())


if __name__ == "__main__":
    sys.exit(main())
