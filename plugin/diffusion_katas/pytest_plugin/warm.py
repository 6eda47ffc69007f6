"""A plain `pytest` run handed to the course's warm grader (core/warm.py says when, where and what is stale).

The run gives the grader its arguments, its working directory and its own stdout and stderr (the descriptors
themselves, over the socket): pytest runs there exactly as here, writing to this terminal, with this run's seed
and options, the same record and hint tiers, and the exit code comes back. A run that finds no grader (or a
stale one, or one it cannot trust) grades in its own process, and starts one when it is done.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from diffusion_katas.core import warm
from diffusion_katas.core.course import Course

START = pytest.StashKey[bool]()  # this cold run starts a warm grader when it is done


def _course(config: pytest.Config) -> Course | None:
    root = config.rootpath
    course = Course(root, katas=root / config.getini("kata_dir"), solutions=root / config.getini("kata_solutions_dir"),
                    graders=root / config.getini("kata_graders_dir"))
    return course if course.has_graders else None


def hand_over(config: pytest.Config) -> int | None:
    """The exit code of this run graded by the warm grader, or None: grade here."""
    if sys.platform != "linux" or config.getoption("kata_no_warm"):
        return None
    if warm.cold_reason(config.invocation_params.args, os.environ) is not None:
        return None
    course = _course(config)
    if course is None or not course.katas.is_dir() or not _only_katas(config, course):
        return None
    path = warm.socket_path(course.root)
    if not path.exists():
        config.stash[START] = True
        return None
    if not warm.own_socket(path):
        return None  # another user's, or in a folder others may write to: never used, never replaced from here
    request = {"v": warm.PROTOCOL, "args": [str(a) for a in config.invocation_params.args],
               "cwd": str(config.invocation_params.dir), "stamp": warm.stamp(course.root, _package(), course.graders),
               "env": {k: os.environ[k] for k in warm.PASSED_ENV if k in os.environ}}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(2.0)
        with warm.address(path) as where_to:
            sock.connect(where_to)
        sys.stdout.flush()
        sys.stderr.flush()
        socket.send_fds(sock, [json.dumps(request).encode()], [sys.stdout.fileno(), sys.stderr.fileno()])
        sock.settimeout(10.0)
        reader = sock.makefile("rb")
        answer = _line(reader)
        if not answer.get("ok"):
            config.stash[START] = bool(answer.get("stale"))  # it ended: start a fresh one after this run
            return None
        sock.settimeout(None)  # grading takes as long as it takes; Ctrl-C asks the grader to stop
        while True:
            try:
                done = _line(reader)
                break
            except KeyboardInterrupt:
                sock.sendall(b"i")
        code = done.get("exit")
        return code if isinstance(code, int) and 0 <= code < 256 else 3
    except (OSError, ValueError):
        config.stash[START] = True
        return None
    finally:
        sock.close()


def _only_katas(config: pytest.Config, course: Course) -> bool:
    """Whether every path this run collects is the learner's kata folder or in it (not the project's tests)."""
    katas = course.katas.resolve()
    for arg in config.args:
        path = (config.invocation_params.dir / str(arg).split("::")[0]).resolve()
        if not (path == katas or katas in path.parents):
            return False
    return bool(config.args)


def _line(reader) -> dict:
    line = reader.readline(warm.REQUEST_LIMIT)
    if not line.endswith(b"\n"):
        raise ValueError("the warm grader ended without answering")
    answer = json.loads(line)
    if not isinstance(answer, dict):
        raise ValueError("not an answer")
    return answer


def _package() -> Path:
    return Path(__file__).resolve().parent.parent


def start_if_asked(config: pytest.Config) -> None:
    """After a cold run that found no grader: start one in the background (it ends itself when idle)."""
    if not config.stash.get(START, False):
        return
    course = _course(config)
    if course is None:
        return
    import subprocess

    try:
        where = warm.make_folder(course.root)
        log = open(where / f"{warm.key()}.log", "ab")  # noqa: SIM115  (the grader holds it)
    except OSError:
        return
    env = dict(os.environ, KATA_NO_WARM="1")
    env.pop("PYTEST_CURRENT_TEST", None)
    with log:
        subprocess.Popen([sys.executable, "-m", "diffusion_katas.commands.warm", "--serve", str(course.root)],
                         cwd=course.root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                         start_new_session=True)
