"""The warm grader behind a plain `pytest`: where it listens, when a run may use it, and what makes it stale.

A learner's `python -m pytest katas/...` pays torch's, diffusers' and the graders' imports on every run; `kata
watch` pays them once. The first run in a course starts a grader that stays warm in the background
(commands/warm.py, `--serve`); later runs hand it their arguments and their terminal, and it runs pytest for them
exactly as they would have (pytest_plugin/warm.py). This module is what both sides agree on. Standard library only.

- **Where**: a Unix socket in `.kata/warm/` under the course root, one per Python environment (the key hashes the
  interpreter and its prefix). The folder is the user's own (0700) and the socket 0600; a client uses a socket
  only in such a folder owned by itself, and the grader answers only a peer of its own user (SO_PEERCRED).
- **When**: only runs a learner makes of kata files: never with `--solutions`, hidden checks, `--gradescope`,
  xdist, a debugger, extra plugins (`-p`), or KATA_* / PYTEST_* settings in the environment (a class's, an
  autograder's or an instructor's run stays cold), nor with `--kata-no-warm` or KATA_NO_WARM=1.
- **Stale**: the stamp covers the interpreter, its search path and the mtime of each of its folders (an install
  or upgrade changes them), the package's own files, the graders and a course conftest.py. A grader whose stamp
  differs from the one it started with answers "stale" and ends; the run goes cold and starts a new one.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import sys
from pathlib import Path

PROTOCOL = 1
IDLE_SECONDS = 15 * 60  # a grader nobody asked for this long ends (KATA_WARM_IDLE overrides)
REQUEST_LIMIT = 1 << 16  # bytes of one request
OWN_ENV = ("KATA_WARM_IDLE", "PYTEST_VERSION")  # set for the warm grader, or by pytest itself as it starts
PASSED_ENV = ("TERM", "COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "PY_COLORS")  # a run's own, applied to it

# Options after which a run stays cold: another grader's or an instructor's run, or one that needs this terminal.
COLD_LONG = ("--solutions", "--kata-hidden-seed", "--kata-hidden-cases", "--kata-secret-fd", "--gradescope",
             "--kata-no-warm", "--numprocesses", "--dist", "--pdb", "--pdbcls", "--trace", "--help", "--version",
             "--debug", "--fixtures", "--markers", "--override-ini")
COLD_SHORT = ("-n", "-p", "-h", "-V", "-o")


def folder(root: Path) -> Path:
    return Path(root) / ".kata" / "warm"


def key() -> str:
    """This Python environment's name for its grader: a course may be graded from more than one venv."""
    return hashlib.sha256(f"{sys.executable}\0{sys.prefix}\0{sys.version}".encode()).hexdigest()[:16]


def socket_path(root: Path) -> Path:
    return folder(root) / f"{key()}.sock"


@contextlib.contextmanager
def address(path: Path):
    """The socket's address to bind or connect to: its path, or, where that is longer than a Unix socket's
    address may be (108 bytes: a course in a deep folder), the same file reached through a descriptor of its
    folder (/proc/self/fd/N/name), which the kernel resolves like the path itself (permissions included)."""
    text = str(path)
    if len(text.encode()) < 100:
        yield text
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def lock_path(root: Path) -> Path:
    return folder(root) / f"{key()}.lock"


def log_path(root: Path) -> Path:
    return folder(root) / f"{key()}.log"


def cold_reason(args, environ) -> str | None:
    """Why a run with these arguments and this environment must grade in its own process, or None."""
    for arg in args:
        arg = str(arg)
        if arg.startswith("--") and any(arg == o or arg.startswith(o + "=") for o in COLD_LONG):
            return arg.split("=")[0]
        if not arg.startswith("--") and any(arg.startswith(o) for o in COLD_SHORT):
            return arg[:2]
    if environ.get("KATA_NO_WARM"):
        return "KATA_NO_WARM"
    for name in environ:
        if name.startswith(("KATA_", "PYTEST_")) and name not in OWN_ENV:
            return name
    return None


def own_folder(path: Path) -> bool:
    """A folder of this user's that nobody else may enter (not a link): where a socket can be trusted."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def own_socket(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid() and own_folder(path.parent)


def make_folder(root: Path) -> Path:
    """`.kata/warm/`, 0700 and this user's (or an error, when someone else's is in the way)."""
    where = folder(root)
    where.mkdir(parents=True, exist_ok=True)
    os.chmod(where, 0o700)
    if not own_folder(where):
        raise PermissionError(f"{where} is not this user's own folder")
    return where


def stamp(root: Path, package_dir: Path, graders_dir: Path) -> str:
    """What a warm grader depends on, as one digest (a few milliseconds: stats, no reads)."""
    root = Path(root).resolve()
    parts = [sys.executable, sys.prefix, sys.version]
    for entry in sys.path:  # the search path (PYTHONPATH included) and each folder's mtime: an install changes it
        try:
            path = Path(entry or ".").resolve()
        except OSError:
            continue
        if path == root or root in path.parents:
            continue  # the course itself (its files change as the learner works)
        parts.append(f"{path}:{_mtime(path)}")
    for base in (Path(package_dir), Path(graders_dir)):
        for dirpath, dirnames, filenames in sorted(os.walk(base)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith((".py", ".json", ".safetensors")):
                    full = os.path.join(dirpath, name)
                    parts.append(f"{full}:{_mtime(Path(full))}")
    parts.append(f"conftest:{_mtime(root / 'conftest.py')}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _mtime(path: Path) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return "-"
    return f"{st.st_mtime_ns}:{st.st_size}"


def idle_seconds(environ) -> float:
    try:
        return max(1.0, float(environ.get("KATA_WARM_IDLE", IDLE_SECONDS)))
    except ValueError:
        return float(IDLE_SECONDS)
