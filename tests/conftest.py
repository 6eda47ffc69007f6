"""Fixtures for the project's own tests.

`grade_mutant` grades a wrong implementation of one kata function through the real grader: it takes
the solution file, swaps one function's solution block for the given body, and runs the plugin on it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch  # noqa: F401  (imported before any pytester snapshot: torch cannot be imported twice)

from diffusion_katas.engine import meters as budgets
# Imported before any pytester snapshot too: the runners' warm parent it keeps is shared by every inline
# run in this process (re-imported, the module would start a new one per run).
from diffusion_katas.engine import runner  # noqa: F401

# The meters pull in torch's dispatch and flop-counter modules, which register torch libraries and
# cannot be imported twice in one process: import them before any pytester snapshot too.
budgets.peak_bytes(lambda: torch.ones(1) + 1)
budgets.flops(lambda: torch.ones(1, 1) @ torch.ones(1, 1))

# The grader is a pytest plugin that loads through its entry point (`diffusion_katas`) once the project is
# installed; these tests drive it with pytester. (tests/ is their rootdir: tests/pytest.ini.)
pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parent.parent
# No run of these tests hands its grading to a course's warm grader or starts one (core/warm.py): each grades in
# its own process, as the test says. tests/test_warm_grader.py turns it back on for what it tests.
os.environ["KATA_NO_WARM"] = "1"
# Labs whose kata file loads the learner's own earlier kata files (they sit beside it).
BUILDS_ON = {"12_end_to_end": ("04_classifier_free_guidance", "06_vae_latents", "07_pipeline_components")}


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4 (each holds torch, diffusers and a warm parent for runners)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


# The modules whose tests take tens of seconds each (real kernels, fresh venvs, whole classes, warm graders): run
# first, so that the end of a parallel run is the many short lab tests spread over every worker, not one long test.
SLOW_FIRST = ("test_notebooks.py", "test_instructor_cli.py", "test_warm_grader.py", "test_see_command.py",
              "test_course.py", "test_learner_loop.py", "test_package.py", "test_learner_cli.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order kept


@pytest.fixture(scope="session")
def graders_loaded():
    """Import every grader's dependencies (diffusers, peft) once, before pytester snapshots sys.modules.

    Pytester removes modules imported during an inline run; torch and its extensions must not be
    imported a second time in one process.
    """
    from diffusion_katas.core.course import load_module

    for path in sorted((REPO / "graders").glob("[0-9][0-9]_*.py")):
        load_module(path, f"_preload_{path.stem}")


def replace_solution_block(source: str, function: str, body: str) -> str:
    """`source` with the solution block of `def function` replaced by `body` (dedented text)."""
    lines = source.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if re.match(rf"\s*def {function}\(", line)), None)
    if start is None:
        raise LookupError(f"no def {function}( in the solution")
    begin = next(i for i in range(start, len(lines)) if "# BEGIN SOLUTION" in lines[i])
    end = next(i for i in range(begin, len(lines)) if "# END SOLUTION" in lines[i])
    indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
    new = textwrap.indent(textwrap.dedent(body).strip("\n") + "\n", indent)
    return "".join(lines[:begin]) + new + "".join(lines[end + 1:])


@dataclass
class Graded:
    """The outcome of grading one kata function: its status, reason codes and the learner-facing text."""

    status: str  # passed / failed / over budget / todo (the worst over the function's checks)
    text: str  # the failure messages, joined
    reasons: frozenset = frozenset()  # the reason codes of the items that did not pass (results.Reason values)

    def __str__(self) -> str:
        return f"{self.status}\n{self.text}"


def kata_ini(pytester: pytest.Pytester) -> None:
    pytester.makeini(
        "[pytest]\n"
        "kata_dir = katas\n"
        "kata_solutions_dir = solutions\n"
        f"kata_graders_dir = {REPO / 'graders'}\n"
    )


@pytest.fixture
def grade_mutant(graders_loaded, pytester: pytest.Pytester):
    """grade_mutant(lab, function, body, *args) -> Graded, for a wrong body of one kata function."""

    def grade(lab: str, function: str, body: str, *args: str, todo_siblings: tuple = ()) -> Graded:
        source = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
        kata_ini(pytester)
        katas = pytester.path / "katas"
        katas.mkdir(exist_ok=True)
        (katas / f"{lab}.py").write_text(replace_solution_block(source, function, body), encoding="utf-8")
        for sibling in BUILDS_ON.get(lab, ()):  # solved, unless the test wants it still TODO
            origin = REPO / ("katas" if sibling in todo_siblings else "solutions") / f"{sibling}.py"
            (katas / f"{sibling}.py").write_text(origin.read_text(encoding="utf-8"), encoding="utf-8")
        recorder = pytester.inline_run(f"katas/{lab}.py", "--kata-seed", "7",
                                       "--kata-function", function, "-p", "no:cacheprovider", *args)
        reports = [r for r in recorder.getreports("pytest_runtest_logreport")
                   if r.nodeid.startswith(f"katas/{lab}.py::{function}[") and hasattr(r, "kata_status")]
        assert reports, f"no kata items graded for {function}"
        rank = {"failed": 5, "waiting": 4, "over budget": 3, "todo": 2, "skipped": 1, "passed": 0}
        status = max((r.kata_status for r in reports), key=rank.__getitem__)
        text = "\n".join(str(r.longrepr) for r in reports if r.longrepr)
        reasons = frozenset(r.kata_reason for r in reports if r.kata_status != "passed")
        return Graded(status, text, reasons)

    return grade



@pytest.fixture
def write_lab(graders_loaded, pytester: pytest.Pytester):
    """write_lab(lab, {function: wrong body, ...}): katas/<lab>.py in a pytester project graded by the real
    graders, from the solution with those functions' solution blocks replaced."""

    def write(lab: str, bodies: dict[str, str]) -> Path:
        source = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
        for function, body in bodies.items():
            source = replace_solution_block(source, function, body)
        kata_ini(pytester)
        katas = pytester.path / "katas"
        katas.mkdir(exist_ok=True)
        (katas / f"{lab}.py").write_text(source, encoding="utf-8")
        return katas / f"{lab}.py"

    return write


@pytest.fixture
def fresh_venv(tmp_path):
    """A fresh venv (its python returned) that imports what this environment has (torch, diffusers, pytest, pip,
    setuptools), the checkout left out: what a fresh `pip install` would give it, without the downloads.
    `--system-site-packages` would see the base interpreter's packages, which inside a venv are not these."""
    folder = tmp_path / "venv"
    # without pip (and the old setuptools it brings): this environment's pip and setuptools serve it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=300)
    python = folder / "bin" / "python"
    outer = [p for p in sys.path if p and Path(p).is_dir() and not Path(p).resolve().is_relative_to(REPO)]
    inner_site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                capture_output=True, text=True, check=True, timeout=120).stdout.strip()
    Path(inner_site, "_this_environment.pth").write_text("\n".join(outer) + "\n")
    return python
