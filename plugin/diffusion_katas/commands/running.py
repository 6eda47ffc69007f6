"""Grading in a pytest subprocess, and the last grading (.kata/last-grading.json) with what it says.

The commands talk to pytest only through its subprocess and the results file: `kata watch` and
`kata progress` run `python -m pytest ... --kata-json` and read the report. The command, its environment
and the JSON files are shared with the instructor's grading children (instructor/children.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

from diffusion_katas.core import record
from diffusion_katas.core.course import Course
from diffusion_katas.core.results import FILE_REASONS

# Where the diffusion_katas package imports from: every pytest subprocess needs it, even for a course elsewhere.
PACKAGE_PARENT = Path(__file__).resolve().parent.parent.parent
UNSOLVED = ("todo", "failed", "waiting", "over budget")
VERBS = {"todo": "write", "failed": "fix", "waiting": "fix", "over budget": "make cheaper"}
MARKS = {"passed": "passed", "failed": "FAILED", "todo": "TODO", "over budget": "OVER BUDGET", "waiting": "WAITING",
         "skipped": "skipped"}


# ---- pytest in a subprocess ------------------------------------------------------------------------------
def pytest_command(*args: str) -> list[str]:
    """`python -m pytest ARGS` with this interpreter (the plugin loads through its entry point)."""
    return [sys.executable, "-m", "pytest", *args]


def pytest_env(package_parent: Path = PACKAGE_PARENT) -> dict[str, str]:
    """This process's environment, with the diffusion_katas package (the one under `package_parent`) first
    on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(package_parent), env.get("PYTHONPATH")]))
    return env


def read_json(path: Path):
    """The JSON in `path`, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(path: Path, data) -> None:
    """Write `data` as JSON all at once (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


@dataclass
class Grading:
    report: dict | None  # the --kata-json report; None when pytest wrote none
    output: str  # what pytest printed
    returncode: int
    seconds: float


def grade(course: Course, target: str, *extra: str) -> Grading:
    """`python -m pytest TARGET -q --kata-json ...` in the repository root, in a subprocess."""
    with tempfile.TemporaryDirectory(prefix="kata-") as tmp:
        json_path = Path(tmp) / "report.json"
        # the commands show what they choose of the output: the hint tiers they show, they remember themselves
        command = pytest_command(target, "-q", "--kata-json", str(json_path), "--rootdir", str(course.root),
                                 "--kata-hints-unseen", *extra)
        start = time.monotonic()
        # On Ctrl-C, subprocess.run kills pytest before the KeyboardInterrupt reaches the caller.
        done = subprocess.run(command, cwd=course.root, env=pytest_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace")
        seconds = time.monotonic() - start
        report = read_json(json_path)
    return Grading(report, done.stdout or "", done.returncode, seconds)


class WarmGrader:
    """`grade`, through one pytest process kept warm between gradings (commands/warm.py): what
    `kata watch` uses, so that a save is graded without importing torch, diffusers and the graders again.
    The seed stays the same for the whole session, so the numbers do not move between saves."""

    def __init__(self, course: Course, seed: int):
        self.course = course
        self.seed = seed
        self.process = None

    def _start(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "diffusion_katas.commands.warm"], cwd=self.course.root, env=pytest_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8",
            errors="replace", bufsize=1)

    def grade(self, target: str, *extra: str) -> Grading:
        from diffusion_katas.commands.warm import DONE

        if self.process is None or self.process.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="kata-") as tmp:
            json_path = Path(tmp) / "report.json"
            args = [target, "-q", "--kata-json", str(json_path), "--rootdir", str(self.course.root),
                    "--kata-seed", str(self.seed), "-p", "no:cacheprovider", "--kata-reuse-builds",
                    "--kata-hints-unseen", *extra]
            start = time.monotonic()
            self.process.stdin.write(json.dumps(args) + "\n")
            self.process.stdin.flush()
            lines, code = [], 1
            for line in self.process.stdout:
                if line.startswith(DONE):
                    code = int(line.split()[1])
                    break
                lines.append(line)
            else:  # the warm process ended: grade cold once, and start a new one next time
                self.process = None
                return grade(self.course, target, "--kata-seed", str(self.seed), *extra)
            seconds = time.monotonic() - start
            report = read_json(json_path)
        return Grading(report, "".join(lines), code, seconds)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def grading_failed(grading: Grading, what: str) -> str:
    tail = "\n".join(grading.output.rstrip().splitlines()[-30:])
    return (f"pytest could not grade {what} (exit code {grading.returncode}) and wrote no report; "
            f"what it said:\n{textwrap.indent(tail, '  ')}")


# ---- .kata/last-grading.json -----------------------------------------------------------------------------
def load_report(course: Course) -> dict | None:
    """The last grading (core/record.py): written by the plugin in every run that grades katas/, merged
    per lab. Same shape as a --kata-json report where the commands read it ("labs", "results", "seed")."""
    return record.load(course)


def changed_labs(course: Course, report: dict | None) -> list[str]:
    """The labs with a grader and a kata file whose grade in the record is missing, stale or out of date
    (a file it depends on changed since)."""
    return [lab for lab in course.graded_labs()
            if course.kata(lab).is_file() and record.lab_changed(course, record.entry(report, lab))]


UNTOUCHED_CHECK = "still the TODO stub"


def record_untouched(course: Course, report: dict | None, labs: list[str]) -> dict | None:
    """The record with `labs`, whose kata files are untouched (Course.untouched), entered as all TODO without
    grading them: their TODO stubs are the graded functions (a test holds every lab to that), and a stub raises
    NotImplementedError whatever the inputs. Written to the record where the record may be written."""
    labs = [lab for lab in labs if course.untouched(lab)]
    if not labs:
        return report
    results = [{"lab": lab, "title": course.title(lab), "function": function, "check": UNTOUCHED_CHECK,
                "status": "todo", "reason": "", "detail": "", "output": "", "nodeid": course.rel(course.kata(lab)),
                "message": f"`{function}` is still its TODO stub (read from the file, not graded): write it"}
               for lab in labs for function in course.untouched_todos(lab)]
    run = {"seed": None, "labs": [{"lab": lab, "title": course.title(lab)} for lab in labs], "results": results}
    data = record.merge(report, run, {}, {lab: record.lab_fingerprint(course, lab) for lab in labs})
    try:
        record.write(course, data)
    except OSError:
        pass
    return data


def widen_last_run(course: Course, report: dict | None, labs) -> dict | None:
    """The record with `labs` (read as untouched by the same command) counted in its last run: `kata hint`'s
    current TODO is then the first of everything the command looked at, as its own "next:" line says."""
    if not report or not report.get("last_run") or not labs:
        return report
    report["last_run"]["labs"] = sorted(set(report["last_run"].get("labs") or []) | set(labs))
    try:
        record.write(course, report)
    except OSError:
        pass
    return report


def after_grading(course: Course, before: dict | None, grading: "Grading") -> dict | None:
    """The record once `grading` is done: the plugin wrote it; if it could not (a run with hidden checks
    from the environment, a folder it may not write), this run merged in memory."""
    now = record.load(course)
    if grading.report is None:
        return now
    if now is not None and now.get("saved_at") != (before or {}).get("saved_at"):
        return now
    return record.merge(before, grading.report, {}, {})


# ---- what a report says ----------------------------------------------------------------------------------
def lab_entry(report: dict | None, lab: str) -> dict | None:
    for entry in (report or {}).get("labs", []):
        if entry.get("lab") == lab:
            return entry
    return None


def statuses(entry: dict) -> list[tuple[str, str]]:
    return [(f["name"], f["status"]) for f in entry.get("functions", [])]


def counts(entry: dict) -> tuple[int, int]:
    functions = statuses(entry)
    return (sum(s == "passed" for _, s in functions), sum(s != "skipped" for _, s in functions))


def first_unsolved(entry: dict) -> tuple[str, str] | None:
    return next(((f, s) for f, s in statuses(entry) if s in UNSOLVED), None)


def next_todo(report: dict | None, labs=None) -> tuple[str, str, str] | None:
    """(lab, function, status) of the first function not passing, in lab order (among `labs`, if given)."""
    for entry in sorted((report or {}).get("labs", []), key=lambda e: e.get("lab", "")):
        if labs is not None and entry.get("lab") not in labs:
            continue
        found = first_unsolved(entry)
        if found:
            return entry["lab"], found[0], found[1]
    return None


def messages(report: dict | None, lab: str, function: str, wanted=UNSOLVED) -> list[str]:
    return [r.get("message", "") for r in (report or {}).get("results", [])
            if r.get("lab") == lab and r.get("function") == function and r.get("status") in wanted]


def import_trouble(report: dict | None, entry: dict) -> str | None:
    """The reason in a few words when the whole kata file could not be used (it does not import, or is
    missing), else None: read from the results' reason codes."""
    found = first_unsolved(entry)
    if not found or found[1] != "failed":
        return None
    for r in (report or {}).get("results", []):
        if r.get("lab") == entry["lab"] and r.get("function") == found[0] and r.get("reason") in FILE_REASONS:
            return r.get("detail") or r.get("reason")
    return None
