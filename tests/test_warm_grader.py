"""The course's warm grader behind a plain `pytest` (core/warm.py, pytest_plugin/warm.py, commands/warm.py --serve):
a run it grades prints what a cold run prints, with the same exit code and record; a stale one is never used; it
answers its own user only; the opt-outs work. Real subprocesses and a real grader on a copy of lab 01.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diffusion_katas.core import warm

REPO = Path(__file__).resolve().parent.parent
LAB = "01_forward_noise"
LIMIT = 300

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the warm grader passes descriptors over a Unix "
                                                                "socket and checks its peer's user: Linux only")


def environment(**extra) -> dict:
    """A learner's shell: no KATA_* or PYTEST_* settings (this suite's own KATA_NO_WARM left out)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KATA_", "PYTEST_"))}
    # a grader a test left behind ends soon (the course fixture ends them too), but not while a test's cold runs go
    # on around it: four cold runs on a loaded 2-core machine took over 30 s
    env.update(PYTHONUNBUFFERED="1", KATA_WARM_IDLE="180", **extra)
    return env


@pytest.fixture
def course(tmp_path):
    root = tmp_path / "course"
    for folder in ("katas", "graders", "solutions"):
        (root / folder).mkdir(parents=True)
        shutil.copy(REPO / folder / f"{LAB}.py", root / folder / f"{LAB}.py")
    text = (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    stub = text.index("raise NotImplementedError", text.index("def scaled_linear_betas("))
    (root / "katas" / f"{LAB}.py").write_text(  # one function written wrong: a failure with a hint and a trap
        text[:stub] + "return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)"
        + text[stub + len("raise NotImplementedError"):], encoding="utf-8")
    yield root
    for pid in re.findall(r"\(pid (\d+)\)", log(root)):
        try:
            os.killpg(int(pid), signal.SIGTERM)
        except OSError:
            pass


def log(root: Path) -> str:
    path = warm.folder(root)
    return "".join(p.read_text() for p in path.glob("*.log")) if path.is_dir() else ""


def pytest_run(root: Path, *args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", f"katas/{LAB}.py", *args], cwd=root,
                          capture_output=True, text=True, encoding="utf-8", env=environment(**env), timeout=LIMIT)


def started(root: Path) -> None:
    """Once a cold run has started the grader: wait until it listens."""
    deadline = time.monotonic() + LIMIT
    while "listening on" not in log(root):
        assert time.monotonic() < deadline, log(root)
        time.sleep(0.2)


def graded_here(root: Path, before: str) -> bool:
    """Whether the last run was graded by the warm grader (its log grew by a graded line)."""
    return "graded katas/" in log(root)[len(before):]


def same(out: str) -> str:
    return re.sub(r" in \d+\.\d+s", " in Ns", out)


def record(root: Path) -> dict:
    data = json.loads((root / ".kata" / "last-grading.json").read_text(encoding="utf-8"))
    return {"labs": [{k: v for k, v in e.items() if k not in ("graded_at", "files")} for e in data["labs"]],
            "results": data["results"], "failed_gradings": data["failed_gradings"]}


def test_a_run_the_warm_grader_grades_prints_what_a_cold_run_prints_with_its_exit_code_and_record(course):
    first = pytest_run(course, "-q")  # finds no grader: grades cold, then starts one
    assert first.returncode == 1 and not graded_here(course, "")
    started(course)
    kept = {p: p.read_bytes() for p in (course / ".kata").glob("*.json")}  # the record and the hint tiers

    cold = pytest_run(course, "--kata-seed", "7", KATA_NO_WARM="1")
    cold_record = record(course)
    assert cold.returncode == 1 and "FAILED" in cold.stdout and "hint 2 (the math)" in cold.stdout
    for path, data in kept.items():  # the same run again, from the same state, by the warm grader
        path.write_bytes(data)
    before = log(course)
    hot = pytest_run(course, "--kata-seed", "7")
    assert graded_here(course, before), log(course)
    assert hot.returncode == cold.returncode
    assert same(hot.stdout) == same(cold.stdout)
    assert hot.stderr == cold.stderr
    assert record(course) == cold_record


def test_a_stale_grader_is_never_used_and_the_opt_outs_grade_cold(course):
    pytest_run(course, "-q")
    started(course)
    before = log(course)
    assert graded_here(course, before) is False
    for args, env in ((("--kata-no-warm",), {}), ((), {"KATA_NO_WARM": "1"}), (("--solutions",), {}),
                      ((), {"KATA_HIDDEN_SEED": "s"})):
        done = pytest_run(course, "-q", *args, **env)
        assert done.returncode in (0, 1) and not graded_here(course, before), (args, env, log(course))
    assert graded_here(course, before) is False
    pytest_run(course, "-q")
    assert graded_here(course, before)

    with open(course / "graders" / f"{LAB}.py", "a") as grader:  # the grader edited: what it loaded is stale
        grader.write("\n# edited\n")
    before = log(course)
    done = pytest_run(course, "-q")
    assert "stale" in log(course)[len(before):] and not graded_here(course, before)
    assert done.returncode == 1 and "FAILED" in done.stdout


def test_a_course_deeper_than_a_socket_address_allows_still_gets_its_warm_grader(course, tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "course"
    shutil.copytree(course, deep)
    assert len(str(warm.socket_path(deep)).encode()) > 108  # a Unix socket's address is at most 108 bytes
    try:
        first = pytest_run(deep, "-q")
        started(deep)
        before = log(deep)
        again = pytest_run(deep, "-q")
        assert graded_here(deep, before), log(deep)
        assert again.returncode == first.returncode == 1 and "FAILED" in again.stdout  # (a hint tier further on)
    finally:
        for pid in re.findall(r"\(pid (\d+)\)", log(deep)):
            try:
                os.killpg(int(pid), signal.SIGTERM)
            except OSError:
                pass


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_another_users_grader_is_not_used_and_the_grader_answers_no_other_user(course):
    pytest_run(course, "-q")
    started(course)
    path = warm.socket_path(course)
    before = log(course)
    os.chown(path, 65534, 65534)  # a socket that is not this user's: never connected to
    done = pytest_run(course, "-q")
    assert done.returncode == 1 and not graded_here(course, before)
    os.chown(path, 0, 0)

    # a second user who reaches the socket (here by opening its folders up) is refused by the grader itself
    opened = {p: p.stat().st_mode & 0o7777 for p in path.parents if p != Path("/")}
    try:
        for folder, mode in opened.items():
            os.chmod(folder, mode | 0o011)
        os.chmod(path, 0o666)
        said = ask_as_nobody(path, course)
    finally:
        for folder, mode in opened.items():
            os.chmod(folder, mode)
    assert json.loads(said) == {"refused": "another user"}, said
    assert "refused a run of uid 65534" in log(course)


def ask_as_nobody(path: Path, course: Path) -> bytes:
    """The grader's first answer to a request made by uid 65534 (a forked child that drops to it)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            import socket

            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            with warm.address(path) as where:
                s.connect(where)
            request = {"v": 1, "args": ["katas"], "cwd": str(course), "stamp": "", "env": {}}
            socket.send_fds(s, [json.dumps(request).encode()], [1, 2])
            os.write(write, s.makefile("rb").readline())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as answer:
        said = answer.read()
    os.waitpid(pid, 0)
    return said


def test_which_runs_stay_cold():
    assert warm.cold_reason(["katas/01_forward_noise.py", "-q", "-k", "add_noise", "--lf"], {}) is None
    for args in (["--solutions"], ["--gradescope=x.json"], ["--kata-hidden-seed", "s"], ["-n", "2"], ["-pno:x"],
                 ["-p", "xdist"], ["--pdb"], ["--kata-no-warm"], ["--help"]):
        assert warm.cold_reason(["katas", *args], {}) is not None, args
    for env in ({"KATA_NO_WARM": "1"}, {"KATA_HIDDEN_SEED": "s"}, {"PYTEST_ADDOPTS": "-x"}, {"KATA_BOX": "3"}):
        assert warm.cold_reason(["katas"], env) is not None, env
    assert warm.cold_reason(["katas"], {"PYTEST_VERSION": "9", "KATA_WARM_IDLE": "60"}) is None
