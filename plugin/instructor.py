"""Instructor commands of `kata`: class, gradescope-bundle, classroom.

    kata class SUBMISSION_DIR... --out DIR   grade every submission in its own process, in parallel;
                                             class.csv, checks.csv, class.md, class.json, gradescope/
    kata gradescope-bundle --out autograder.zip
                                             a Gradescope autograder (setup.sh, run_autograder, project/)
    kata classroom [--out .github]           a GitHub Classroom autograding workflow, one test per lab

How a submission is graded (shared by `kata class` and the Gradescope autograder; see
/work/shared/notes/grading-reliability.md, sections 1 and 5-6):

- The learner's kata files (`NN_lab.py`, directly in the submission folder or in a `katas/` subfolder)
  are copied into a scratch project; symbolic links are refused, nothing else of the submission is
  copied (no conftest.py, no plugin). A selected lab whose file is missing gets a placeholder that fails
  to import with "missing file", so its functions score 0 through the same graders.
- `python -m pytest -p plugin.plugin katas -q --kata-json R --gradescope G` runs in a child process, in
  its own process group, under a wall-clock limit; on expiry the whole group is killed (SIGKILL reaches
  code stuck in C, where pytest-timeout's signal cannot). R and G are fresh uuid names in a folder the
  parent owns.
- The score comes only from the report R the child wrote, read by the parent. A child that hangs,
  crashes, segfaults, calls os._exit (even with status 0) or writes no report scores 0, with the reason.
- Items marked `cuda` (GPU budgets) never share a GPU: the first pass runs `-m "not cuda"` (children in
  parallel), then one serial pass runs `-m cuda` per submission, one child at a time, for the labs that
  have such items (without CUDA they are skipped with "CUDA not available"). A submission's score uses
  both passes; if either wrote no report, it scores 0.
- Points per kata function are the graders' `Kata.points` (in every result); a function counts when all
  its checks and budgets pass (plugin/formats.py's rule, reused here, so the class table and the
  Gradescope file agree).

Known limit: the child is a process, not a sandbox. Learner code can read what the child can read
(including its command line, hence the report's path) and write where it can write: grade untrusted
submissions inside a container (Gradescope does: one container per submission).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from plugin import explain

ROOT = explain.ROOT
# Where the `plugin` package imports from: every grading child needs it on its path.
PACKAGE_PARENT = Path(__file__).resolve().parent.parent
LAB_GLOB = "[0-9][0-9]_*.py"
DEFAULT_JOBS = 2
DEFAULT_CLASS_TIMEOUT = 900.0  # seconds per submission and pass (all labs of a correct one take ~40 s)
DEFAULT_AUTOGRADER_TIMEOUT = 600.0
MANIFEST = "autograder.json"
# Pinned at bundle time from pyproject.toml's [project].dependencies; this list is the fallback.
FALLBACK_DEPENDENCIES = ("torch==2.13.0", "diffusers==0.42.1", "peft==0.21.2", "transformers==5.23.0",
                         "accelerate", "numpy", "pytest", "pytest-timeout")
# The graders run on the CPU: take torch's CPU wheels (the default Linux wheel pulls in CUDA libraries).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
MISSING = "missing file"
NOT_GRADED = "not graded"
# Gradescope results.json (gradescope-autograders.readthedocs.io/en/latest/specs/).
GS_TOP_LEVEL = {"score", "max_score", "execution_time", "output", "output_format", "test_output_format",
                "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests", "leaderboard"}
GS_PER_TEST = {"score", "max_score", "status", "name", "name_format", "number", "output", "output_format",
               "tags", "visibility", "extra_data"}
GS_VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


class InstructorError(Exception):
    """A message for the instructor; the command prints it and exits with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ---- what the graders declare ------------------------------------------------------------------------------
@dataclass
class Function:
    """One graded kata function, as its grader declares it."""

    lab: str
    name: str
    points: float
    checks: list[str]  # item names as results carry them: each check's name, then "budget: <name>"
    cuda_checks: list[str] = field(default_factory=list)


@dataclass
class Catalog:
    """The selected labs, their titles and graded functions, in order."""

    labs: list[str]
    titles: dict[str, str]
    functions: dict[str, list[Function]]

    def all_functions(self) -> list[Function]:
        return [f for lab in self.labs for f in self.functions[lab]]

    def cuda_labs(self) -> list[str]:
        return [lab for lab in self.labs if any(f.cuda_checks for f in self.functions[lab])]

    def points(self, lab: str | None = None) -> float:
        return sum(f.points for f in self.all_functions() if lab is None or f.lab == lab)

    def to_json(self) -> dict:
        return {"labs": [{"lab": lab, "title": self.titles[lab],
                          "functions": [{"name": f.name, "points": f.points, "checks": f.checks,
                                         "cuda_checks": f.cuda_checks} for f in self.functions[lab]]}
                         for lab in self.labs]}

    @classmethod
    def from_json(cls, data: dict) -> "Catalog":
        labs = [entry["lab"] for entry in data["labs"]]
        return cls(labs, {e["lab"]: e["title"] for e in data["labs"]},
                   {e["lab"]: [Function(e["lab"], f["name"], float(f["points"]), list(f["checks"]),
                                        list(f.get("cuda_checks", []))) for f in e["functions"]]
                    for e in data["labs"]})


_GRADER_MODULES: dict[Path, list] = {}
_GRADER_LOCK = threading.Lock()


def _grader_katas(path: Path) -> list:
    """The Kata objects a grader module declares (imported once per process)."""
    from plugin.collection import load_module
    from plugin.spec import Kata

    with _GRADER_LOCK:
        if path not in _GRADER_MODULES:
            try:
                module = load_module(path, f"_kata_instructor_{path.stem}")
            except BaseException as exc:  # noqa: BLE001  (any failure of a grader import is reported)
                raise InstructorError(f"could not import the grader {path}: {type(exc).__name__}: {exc}")
            _GRADER_MODULES[path] = [v for v in vars(module).values() if isinstance(v, Kata)]
        return _GRADER_MODULES[path]


def lab_stems(graders_dir: Path) -> list[str]:
    return [p.stem for p in explain.lab_files(graders_dir)]


def select_labs(graders_dir: Path, wanted: list[str] | None) -> list[str]:
    """Lab stems from --labs values ('1', '01', '01_forward_noise', comma lists); all labs by default."""
    if not lab_stems(graders_dir):
        raise InstructorError(f"there are no graders ({LAB_GLOB}) in {graders_dir}")
    names = [n.strip() for value in (wanted or []) for n in value.split(",") if n.strip()]
    if not names:
        return lab_stems(graders_dir)
    chosen = []
    for name in names:
        try:
            stem = explain.find_lab(name, graders_dir).stem
        except LookupError as exc:
            raise InstructorError(f"--labs {name}: {exc}") from None
        if stem not in chosen:
            chosen.append(stem)
    return sorted(chosen)


def lab_title(root: Path, lab: str) -> str:
    """A lab's title from the first line of its kata (or solution) file's docstring."""
    from plugin.collection import lab_title as title_of

    for folder in ("katas", "solutions"):
        path = root / folder / f"{lab}.py"
        if path.is_file():
            return title_of(path)
    return lab


def load_catalog(root: Path, labs: list[str], graders_dir: Path | None = None) -> Catalog:
    """What the graders of `labs` declare: functions, points, check and budget names, cuda marks."""
    graders_dir = graders_dir or root / "plugin" / "graders"
    functions: dict[str, list[Function]] = {}
    for lab in labs:
        functions[lab] = []
        for kata in _grader_katas(graders_dir / f"{lab}.py"):
            checks = [c.name for c in kata.checks] + [f"budget: {b.name}" for b in kata.budgets]
            cuda = [c.name for c in kata.checks if _has_cuda(c.marks)]
            cuda += [f"budget: {b.name}" for b in kata.budgets if _has_cuda(b.marks)]
            functions[lab].append(Function(lab, kata.name, float(kata.points), checks, cuda))
    return Catalog(list(labs), {lab: lab_title(root, lab) for lab in labs}, functions)


def _has_cuda(marks) -> bool:
    return any(getattr(mark, "name", None) == "cuda" for mark in marks)


# ---- submissions -------------------------------------------------------------------------------------------
@dataclass
class Prepared:
    """A submission laid out for grading: a project whose katas/ holds its kata files."""

    learner: str
    source: Path
    project: Path  # the child's rootdir and working directory
    config: Path  # its pytest config file (-c)
    present: list[str] = field(default_factory=list)  # selected labs whose file was found
    missing: list[str] = field(default_factory=list)  # selected labs given a "missing file" placeholder
    notes: list[str] = field(default_factory=list)  # files refused (symbolic links, ...)
    problem: str = ""  # set when there is nothing to grade: not a folder, empty, no kata files
    outcome: str = ""  # the outcome that goes with `problem`


def kata_files(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """The lab files of a submission: NN_lab.py directly in it or in a katas/ subfolder (one level of
    wrapping folder, as a zip of a folder gives, is looked through). Symbolic links are refused."""
    def found(where: Path) -> list[Path]:
        return sorted(p for p in where.glob(LAB_GLOB) if p.is_file() or p.is_symlink()) if where.is_dir() else []

    where = next((w for w in (folder / "katas", folder) if found(w)), None)
    if where is None:
        inner = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))] \
            if folder.is_dir() else []
        if len(inner) == 1:
            where = next((w for w in (inner[0] / "katas", inner[0]) if found(w)), None)
    files: dict[str, Path] = {}
    notes: list[str] = []
    inside = folder.resolve()
    for path in found(where) if where is not None else []:
        if path.is_symlink() or not path.resolve().is_relative_to(inside):
            notes.append(f"{path.name} is a symbolic link (or lies behind one): refused, graded as missing")
        else:
            files[path.stem] = path
    return files, notes


def learner_names(folders: list[Path]) -> list[str]:
    """A file-name-safe, unique name per submission folder (its name; -2, -3 ... for repeats)."""
    names: list[str] = []
    for folder in folders:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", folder.name).strip("._") or "submission"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def placeholder(lab: str, title: str) -> str:
    """A kata file for a lab the submission lacks: it fails to import, so every function scores 0."""
    message = f"missing file: the submission has no {lab}.py"
    return (f'"""{title}\n\nPlaceholder written by the grader: {message}.\n"""\n'
            f"raise ImportError({message!r})\n")


def lay_out(learner: str, folder: Path, project: Path, config: Path, catalog: Catalog) -> Prepared:
    """Copy a submission's kata files for the selected labs into project/katas/ (a fresh folder)."""
    prep = Prepared(learner, folder, project, config)
    if not folder.is_dir():
        prep.problem, prep.outcome = f"not a folder: {folder}", "not graded"
        return prep
    try:
        files, prep.notes = kata_files(folder)
    except OSError as exc:
        prep.problem, prep.outcome = f"could not read the submission folder: {exc}", "not graded"
        return prep
    katas = project / "katas"
    if katas.exists():
        shutil.rmtree(katas)
    katas.mkdir(parents=True)
    for lab in catalog.labs:
        try:
            if lab not in files:
                raise FileNotFoundError
            shutil.copyfile(files[lab], katas / f"{lab}.py")
            prep.present.append(lab)
        except OSError as exc:
            if lab in files:
                prep.notes.append(f"{lab}.py could not be read ({exc}): graded as missing")
            (katas / f"{lab}.py").write_text(placeholder(lab, catalog.titles[lab]), encoding="utf-8")
            prep.missing.append(lab)
    if not prep.present:
        if not any(folder.iterdir()):
            prep.problem = "empty submission folder"
        else:
            others = sorted(p.name for p in folder.iterdir())[:5]
            prep.problem = (f"no kata file for the selected labs ({', '.join(f'{lab}.py' for lab in catalog.labs)}); "
                            f"the folder holds: {', '.join(others)}")
        prep.outcome = MISSING
    return prep


def scratch_config(root: Path, path: Path) -> None:
    """A pytest.ini with the repository's pytest settings, reading katas from the scratch copy and the
    graders (and solutions) from the repository."""
    options = dict(_pyproject(root).get("tool", {}).get("pytest", {}).get("ini_options", {}))
    graders = root / options.get("kata_graders_dir", "plugin/graders")
    solutions = root / options.get("kata_solutions_dir", "solutions")
    for key in ("testpaths", "pytest_plugins", "kata_dir", "kata_solutions_dir", "kata_graders_dir"):
        options.pop(key, None)
    options.update(testpaths=["katas"], kata_dir="katas", kata_solutions_dir=str(solutions.resolve()),
                   kata_graders_dir=str(graders.resolve()))
    lines = ["# Written by `kata class`: the repository's pytest settings, for a scratch copy of one submission.",
             "[pytest]"]
    for key, value in options.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, list):
            lines.append(f"{key} =" + "".join(f"\n    {item}" for item in value))
        else:
            lines.append(f"{key} = {value}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _pyproject(root: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return {}
    try:
        return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


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
              workdir: Path, children: Children) -> ChildRun:
    """Grade project/katas in a child pytest; the result is only what its report file says."""
    run = ChildRun(marker)
    token = uuid.uuid4().hex
    report_path = workdir / f"{token}.json"
    gradescope_path = workdir / f"{token}-gradescope.json"
    log_path = workdir / f"{token}.log"
    command = [sys.executable, "-m", "pytest", "-p", "plugin.plugin", "katas", "-q", "-p", "no:cacheprovider",
               "-c", str(config), "--rootdir", str(project), "--kata-json", str(report_path),
               "--gradescope", str(gradescope_path), "-m", marker, *pytest_args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH")]))
    env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
    start = time.monotonic()
    with open(log_path, "wb") as log:
        # Output to a file, not a pipe: a grandchild holding the pipe open could not block the parent.
        proc = subprocess.Popen(command, cwd=project, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
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


# ---- from reports to grades --------------------------------------------------------------------------------
@dataclass
class Cell:
    status: str
    score: float
    max_score: float


@dataclass
class Graded:
    learner: str
    source: str
    outcome: str  # graded / timed out / crashed / no report / missing file / not graded
    reason: str
    score: float
    max_score: float
    cells: dict[tuple[str, str], Cell]
    checks: dict[tuple[str, str, str], str]  # (lab, function, check) -> status of its result
    gradescope: dict
    gradescope_text: str  # what is written to gradescope/<learner>.json
    passes: list[dict] = field(default_factory=list)
    seconds: float = 0.0


def _results(report: dict):
    from plugin import state

    fields = set(state.Result.__dataclass_fields__)
    return [state.Result(**{k: v for k, v in r.items() if k in fields}) for r in report["results"]]


def _scored(results, hidden_run: bool, seed) -> dict:
    """formats.gradescope over these results: the one scoring rule (all or nothing per function)."""
    from plugin import formats

    return formats.gradescope(SimpleNamespace(results=list(results), hidden_seed=0 if hidden_run else None,
                                              seed=seed))


def zero_gradescope(catalog: Catalog, reason: str) -> dict:
    """A valid zero-score Gradescope results.json: one test per kata function, each saying why."""
    tests = []
    for lab in catalog.labs:
        for function in catalog.functions[lab]:
            tests.append({"name": f"{catalog.titles[lab]} · {function.name}",
                          "number": f"{lab[:2]}.{len(tests) + 1}", "score": 0.0, "max_score": function.points,
                          "status": "failed", "output": f"Not graded: {reason}", "visibility": "visible"})
    return {"score": 0.0, "max_score": catalog.points(), "output": f"Not graded: {reason}",
            "visibility": "visible", "stdout_visibility": "hidden", "tests": tests,
            "extra_data": {"reason": reason}}


def conclude(prep: Prepared, runs: list[ChildRun], catalog: Catalog) -> Graded:
    """The grade of one submission from its child reports (and nothing else)."""
    functions = catalog.all_functions()
    seconds = sum(r.seconds for r in runs)
    passes = [{"marker": r.marker, "seconds": round(r.seconds, 2), "returncode": r.returncode,
               "outcome": r.outcome or "report"} for r in runs]
    failed = next((r for r in runs if r.report is None), None)
    results = []
    if not prep.problem and failed is None:
        try:
            results = [r for run in runs for r in _results(run.report)]
        except (TypeError, KeyError, AttributeError) as exc:  # not what our plugin writes
            failed = runs[0]
            failed.outcome = "no report"
            failed.reason = f"the grading process wrote a report that is not ours ({type(exc).__name__}: {exc})"
    if prep.problem or failed is not None:
        reason = prep.problem or failed.reason
        outcome = prep.outcome if prep.problem else failed.outcome
        status = MISSING if outcome == MISSING else NOT_GRADED
        gradescope = zero_gradescope(catalog, reason)
        return Graded(prep.learner, str(prep.source), outcome, reason, 0.0, catalog.points(),
                      {(f.lab, f.name): Cell(status, 0.0, f.points) for f in functions}, {}, gradescope,
                      json.dumps(gradescope, indent=2, ensure_ascii=False), passes, seconds)

    from plugin import formats, reporting

    first = runs[0].report
    hidden_run, seed = bool(first.get("hidden_run")), first.get("seed")
    statuses = {lab: fns for lab, (_title, fns) in reporting.progress(SimpleNamespace(results=results)).items()}
    grouped: dict[tuple[str, str], list] = {}
    for (lab, _title, function), rs in formats.functions(results).items():
        grouped.setdefault((lab, function), []).extend(rs)
    cells: dict[tuple[str, str], Cell] = {}
    for f in functions:
        rs = grouped.get((f.lab, f.name), [])
        if f.lab in prep.missing:
            status = MISSING
        elif not rs:
            status = NOT_GRADED
        else:
            status = statuses.get(f.lab, {}).get(f.name, NOT_GRADED)
        score = _scored(rs, hidden_run, seed)["score"] if rs else 0.0
        cells[(f.lab, f.name)] = Cell(status, float(score), f.points)
    score = sum(c.score for c in cells.values())
    checks = {(r.lab, r.function, r.check): r.status for r in results}
    rebuilt = _scored(results, hidden_run, seed)
    text = runs[0].gradescope_text if len(runs) == 1 else None
    gradescope = None
    if text is not None:
        try:
            gradescope = json.loads(text)
        except ValueError:
            gradescope = None
    if gradescope is None or validate_gradescope(gradescope) or abs(gradescope["score"] - score) > 1e-9:
        # Two passes (or a missing or doubtful file): rebuild it from the report, with the same code.
        gradescope = rebuilt
        text = json.dumps(gradescope, indent=2, ensure_ascii=False)
    return Graded(prep.learner, str(prep.source), "graded", _reasons(prep, results), score, catalog.points(),
                  cells, checks, gradescope, text, passes, seconds)


def _reasons(prep: Prepared, results) -> str:
    """File-level problems in a few words: missing files, files that do not import, deleted functions,
    functions that timed out."""
    reasons: list[str] = [f"{lab}.py: {MISSING}" for lab in prep.missing] + list(prep.notes)
    for r in results:
        if r.status in ("passed", "skipped", "todo") or r.lab in prep.missing:
            continue
        first = r.message.strip().splitlines()[0] if r.message.strip() else ""
        if " does not parse: " in first or first.startswith("importing ") or " has no function " in first:
            reason = first.split(". Keep the name")[0]
        elif "timed out after" in r.message:
            reason = f"{r.function}: timed out (per-check limit)"
        else:
            continue
        if reason not in reasons:
            reasons.append(reason)
    return "; ".join(reasons)


def validate_gradescope(data) -> list[str]:
    """What is wrong with a Gradescope results.json (an empty list: nothing)."""
    problems: list[str] = []
    if not isinstance(data, dict):
        return ["not a JSON object"]
    problems += [f"unknown top-level field {k!r}" for k in sorted(set(data) - GS_TOP_LEVEL)]
    if not isinstance(data.get("score"), (int, float)):
        problems.append("score is not a number")
    tests = data.get("tests", [])
    if not isinstance(tests, list):
        return problems + ["tests is not a list"]
    for key in ("visibility", "stdout_visibility"):
        if key in data and data[key] not in GS_VISIBILITY:
            problems.append(f"{key} {data[key]!r} is not one of {sorted(GS_VISIBILITY)}")
    for i, test in enumerate(tests):
        if not isinstance(test, dict):
            problems.append(f"tests[{i}] is not an object")
            continue
        problems += [f"tests[{i}]: unknown field {k!r}" for k in sorted(set(test) - GS_PER_TEST)]
        if not isinstance(test.get("name"), str) or not test.get("name"):
            problems.append(f"tests[{i}]: no name")
        score, max_score = test.get("score"), test.get("max_score")
        if not isinstance(score, (int, float)) or not isinstance(max_score, (int, float)):
            problems.append(f"tests[{i}]: score and max_score must be numbers")
        elif not 0 <= score <= max_score:
            problems.append(f"tests[{i}]: score {score} outside 0..{max_score}")
        if test.get("status") not in ("passed", "failed"):
            problems.append(f"tests[{i}]: status {test.get('status')!r}")
        if test.get("visibility", "visible") not in GS_VISIBILITY:
            problems.append(f"tests[{i}]: visibility {test.get('visibility')!r}")
        if not isinstance(test.get("output", ""), str):
            problems.append(f"tests[{i}]: output is not text")
    if tests and isinstance(data.get("score"), (int, float)) and all(
            isinstance(t, dict) and isinstance(t.get("score"), (int, float)) for t in tests):
        if abs(data["score"] - sum(t["score"] for t in tests)) > 1e-9:
            problems.append("score is not the sum of the tests' scores")
    return problems


# ---- grading runs ------------------------------------------------------------------------------------------
@dataclass
class Grading:
    """What every child of one run shares."""

    catalog: Catalog
    pytest_args: list[str]
    timeout: float
    workdir: Path
    children: Children = field(default_factory=Children)


def first_pass(prep: Prepared, grading: Grading) -> ChildRun | None:
    if prep.problem:
        return None
    return run_child(prep.project, prep.config, "not cuda", grading.pytest_args, grading.timeout, grading.workdir,
                     grading.children)


def needs_cuda_pass(prep: Prepared, first: ChildRun | None, grading: Grading) -> bool:
    return (first is not None and first.report is not None
            and any(lab in prep.present for lab in grading.catalog.cuda_labs()))


def cuda_pass(prep: Prepared, grading: Grading) -> ChildRun:
    return run_child(prep.project, prep.config, "cuda", grading.pytest_args, grading.timeout, grading.workdir,
                     grading.children)


def pytest_options(args) -> list[str]:
    """The grading options a command passes on to every child."""
    options = ["--kata-seed", str(args.seed)]
    if getattr(args, "kata_timeout", None) is not None:
        options += ["--kata-timeout", f"{args.kata_timeout:g}"]
    if getattr(args, "hidden_seed", None) is not None:
        options += ["--kata-hidden-seed", str(args.hidden_seed)]
    if getattr(args, "hidden_cases", None):
        options += ["--kata-hidden-cases", str(Path(args.hidden_cases).resolve())]
    if getattr(args, "hidden_output", None):
        options += ["--kata-hidden-output", args.hidden_output]
    return options


# ---- kata class --------------------------------------------------------------------------------------------
def cmd_class(args) -> int:
    root = Path(args.root).resolve()
    graders_dir = root / "plugin" / "graders"
    if args.jobs < 1:
        raise InstructorError("--jobs must be at least 1")
    if args.timeout <= 0:
        raise InstructorError("--timeout must be a positive number of seconds")
    if args.hidden_cases and not Path(args.hidden_cases).is_file():
        raise InstructorError(f"--hidden-cases {args.hidden_cases}: no such file")
    labs = select_labs(graders_dir, args.labs)
    catalog = load_catalog(root, labs, graders_dir)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10**6)
    out = Path(args.out)
    folders = [Path(p) for p in args.submissions]
    names = learner_names(folders)
    print(f"kata class: {len(folders)} submission(s), labs {', '.join(labs)}, seed {args.seed}, "
          f"{args.jobs} job(s), {args.timeout:g} s per submission and pass")
    with tempfile.TemporaryDirectory(prefix="kata-class-") as tmp:
        tmp = Path(tmp)
        reports = tmp / "reports"  # the children's reports: uuid names, never inside a submission's project
        reports.mkdir()
        grading = Grading(catalog, pytest_options(args), args.timeout, reports)
        preps = []
        for name, folder in zip(names, folders):
            project = tmp / "projects" / name
            project.mkdir(parents=True)
            config = project / "pytest.ini"
            scratch_config(root, config)
            preps.append(lay_out(name, folder.resolve() if folder.exists() else folder, project, config, catalog))
        graded = grade_all(preps, grading, args.jobs)
    write_class(out, graded, catalog, args)
    return 0


def grade_all(preps: list[Prepared], grading: Grading, jobs: int) -> list[Graded]:
    """First pass in parallel (`-m "not cuda"`), then the cuda pass one child at a time."""
    printing = threading.Lock()
    firsts: dict[str, ChildRun | None] = {}

    def first(prep: Prepared):
        run = first_pass(prep, grading)
        with printing:
            what = prep.problem or (run.reason if run.report is None else "report written")
            took = f" ({run.seconds:.1f} s)" if run else ""
            print(f"  {prep.learner}: {what}{took}", flush=True)
        return prep.learner, run

    pool = ThreadPoolExecutor(max_workers=jobs)
    cuda_runs: dict[str, list[ChildRun]] = {}
    previous = _terminate_as_exit()
    try:
        for learner, run in pool.map(first, preps):
            firsts[learner] = run
        pool.shutdown()
        for prep in preps:  # one at a time: GPU budgets never share the device
            if needs_cuda_pass(prep, firsts[prep.learner], grading):
                run = cuda_pass(prep, grading)
                print(f"  {prep.learner}: cuda pass: {run.reason or 'report written'} ({run.seconds:.1f} s)",
                      flush=True)
                cuda_runs[prep.learner] = [run]
    except BaseException:  # Ctrl-C, SIGTERM: kill every child's group now, not after their time limits
        grading.children.kill_all()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        _restore(previous)
    graded = []
    for prep in preps:
        runs = [r for r in [firsts[prep.learner], *cuda_runs.get(prep.learner, [])] if r is not None]
        graded.append(conclude(prep, runs, grading.catalog))
    return graded


def _terminate_as_exit():
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


def _restore(previous) -> None:
    for name, handler in (previous or {}).items():
        signal.signal(getattr(signal, name), handler)


def _fmt(x: float) -> str:
    return f"{x:g}"


def _md(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def check_rows(graded: list[Graded], catalog: Catalog) -> list[dict]:
    """Per (lab, function, check): how many learners passed it, out of the whole class."""
    rows = []
    seen = {key for g in graded for key in g.checks}
    for f in catalog.all_functions():
        visible = [c for c in f.checks if not c.startswith("budget: ")]
        budgets = [c for c in f.checks if c.startswith("budget: ")]
        extra = sorted({c for (lab, fn, c) in seen if lab == f.lab and fn == f.name and c not in f.checks})
        names = visible + extra + budgets  # the order the items run in: checks, hidden checks, budgets
        for check in names:
            statuses = [g.checks.get((f.lab, f.name, check)) for g in graded]
            passed = sum(s == "passed" for s in statuses)
            skipped = sum(s == "skipped" for s in statuses)
            rows.append({"lab": f.lab, "function": f.name, "check": check, "passed": passed,
                         "skipped": skipped, "learners": len(graded),
                         "pass_rate": round(passed / len(graded), 4) if graded else 0.0,
                         "cuda": check in f.cuda_checks})
    return rows


def write_class(out: Path, graded: list[Graded], catalog: Catalog, args) -> None:
    from plugin import formats

    out.mkdir(parents=True, exist_ok=True)
    gs_dir = out / "gradescope"
    gs_dir.mkdir(exist_ok=True)
    for old in gs_dir.glob("*.json"):  # a previous roster's files must not linger
        old.unlink()
    functions = catalog.all_functions()
    keys = [(f.lab, f.name) for f in functions]
    rows = check_rows(graded, catalog)

    for g in graded:
        (gs_dir / f"{g.learner}.json").write_text(g.gradescope_text, encoding="utf-8")

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["learner", "score", "max_score", "outcome", "reason"] + [f"{lab}::{fn}" for lab, fn in keys])
    for g in graded:
        writer.writerow([g.learner, _fmt(g.score), _fmt(g.max_score), g.outcome, g.reason]
                        + [g.cells[k].status for k in keys])
    (out / "class.csv").write_text(buffer.getvalue(), encoding="utf-8")

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["lab", "function", "check", "passed", "skipped", "learners", "pass_rate"])
    for row in rows:
        writer.writerow([row["lab"], row["function"], row["check"], row["passed"], row["skipped"],
                         row["learners"], row["pass_rate"]])
    (out / "checks.csv").write_text(buffer.getvalue(), encoding="utf-8")

    versions = formats.versions()
    md = ["# Class results", "",
          f"{len(graded)} submission(s) graded on {', '.join(catalog.labs)} with seed {args.seed} "
          f"(torch {versions['torch']}, diffusers {versions['diffusers']}); {args.jobs} in parallel, "
          f"{args.timeout:g} s wall clock per submission and pass. A score counts only what the grading "
          "process reported; no report (a crash, a hang, os._exit) scores 0 with the reason.", "",
          "## Learners", "",
          "| learner | score | outcome | reason | " + " | ".join(f"{lab[:2]} {fn}" for lab, fn in keys) + " |",
          "|---|---|---|---|" + "---|" * len(keys)]
    for g in graded:
        md.append(f"| {_md(g.learner)} | {_fmt(g.score)}/{_fmt(g.max_score)} | {g.outcome} | {_md(g.reason)} | "
                  + " | ".join(g.cells[k].status for k in keys) + " |")
    md += ["", "## Pass rate per check", "",
           "Out of the whole class: a learner whose submission was not graded counts as not passing. "
           "Skipped: items that did not run (GPU budgets without CUDA).", "",
           "| lab | function | check | passed | rate | skipped |", "|---|---|---|---|---|---|"]
    for row in rows:
        md.append(f"| {row['lab']} | {row['function']} | {_md(row['check'])} | "
                  f"{row['passed']}/{row['learners']} | {row['pass_rate']:.0%} | {row['skipped'] or ''} |")
    (out / "class.md").write_text("\n".join(md) + "\n", encoding="utf-8")

    data = {"seed": args.seed, "labs": catalog.labs, "jobs": args.jobs, "timeout": args.timeout,
            "versions": versions, "max_score": catalog.points(),
            "learners": [{"learner": g.learner, "source": g.source, "score": g.score, "max_score": g.max_score,
                          "outcome": g.outcome, "reason": g.reason, "seconds": round(g.seconds, 2),
                          "passes": g.passes,
                          "functions": [{"lab": lab, "function": fn, "status": g.cells[(lab, fn)].status,
                                         "score": g.cells[(lab, fn)].score,
                                         "max_score": g.cells[(lab, fn)].max_score} for lab, fn in keys]}
                         for g in graded],
            "checks": rows}
    (out / "class.json").write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")

    width = max([len(g.learner) for g in graded] + [7])
    print()
    for g in graded:
        print(f"  {g.learner:<{width}}  {_fmt(g.score):>5}/{_fmt(g.max_score):<5} {g.outcome}"
              + (f": {g.reason}" if g.reason else ""))
    print(f"\nwrote {out / 'class.csv'}, {out / 'checks.csv'}, {out / 'class.md'}, {out / 'class.json'} "
          f"and {len(graded)} file(s) in {gs_dir}/")


# ---- Gradescope autograder ---------------------------------------------------------------------------------
SETUP_SH = """\
#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder image: it installs the pinned dependencies
# and the bundled project. run_autograder installs nothing.
set -euo pipefail
SOURCE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
  apt-get update && apt-get install -y python3 python3-pip
fi
export PIP_BREAK_SYSTEM_PACKAGES=1  # images whose system Python is marked externally managed
# CPU wheels of torch: the graders run on the CPU, and the default Linux wheel pulls in CUDA libraries.
python3 -m pip install --extra-index-url {index} {dependencies}
python3 -m pip install --no-deps -e "$SOURCE/project"
"""

RUN_AUTOGRADER = """\
#!/usr/bin/env bash
# Gradescope runs this for every submission (as /autograder/run_autograder). It installs nothing
# (setup.sh did). It copies the kata files of $AUTOGRADER_ROOT/submission into the bundled project's
# katas/, grades them with `python3 -m pytest -p plugin.plugin katas ... --gradescope <random path>` in a
# child process under a wall-clock limit (plugin/instructor.py: autograde), and writes
# $AUTOGRADER_ROOT/results/results.json from what that child reported: a child that crashes, hangs or
# writes nothing scores 0 with the reason. AUTOGRADER_ROOT defaults to /autograder (set it to test this).
set -u
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PROJECT="$ROOT/source/project"
PYTHON="${KATA_PYTHON:-python3}"
RESULTS="$ROOT/results/results.json"
mkdir -p "$ROOT/results"
rm -f "$RESULTS"  # only what this run writes counts
cd "$PROJECT" || exit 1
PYTHONPATH="$PROJECT${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m plugin.instructor autograde \\
  --project "$PROJECT" --submission "$ROOT/submission" --results "$RESULTS"
status=$?
if [ ! -s "$RESULTS" ]; then
  cat > "$RESULTS" <<EOF
{"score": 0, "output": "Not graded: the autograder failed (its grading program exited with status $status and wrote no results). Please tell your instructor.", "visibility": "visible", "stdout_visibility": "hidden", "tests": []}
EOF
fi
exit 0
"""


def bundle_dependencies(root: Path) -> list[str]:
    deps = _pyproject(root).get("project", {}).get("dependencies")
    return list(deps) if deps else list(FALLBACK_DEPENDENCIES)


def bundle_files(root: Path, labs: list[str]) -> list[tuple[str, Path]]:
    """(name in the zip, file): the project an autograder needs. Not solutions/: grading katas never
    reads them (only --solutions, derive and explain do)."""
    files = [(f"project/{name}", root / name) for name in ("pyproject.toml", "README.md", "conftest.py")
             if (root / name).is_file()]
    for path in sorted((root / "plugin").rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo"):
            continue
        if rel.parent == Path("plugin/graders") and re.match(r"\d\d_", path.name) and path.stem not in labs:
            continue
        files.append((f"project/{rel.as_posix()}", path))
    return files


def cmd_gradescope_bundle(args) -> int:
    root = Path(args.root).resolve()
    graders_dir = root / "plugin" / "graders"
    labs = select_labs(graders_dir, args.labs)
    if args.hidden_cases and not Path(args.hidden_cases).is_file():
        raise InstructorError(f"--hidden-cases {args.hidden_cases}: no such file")
    catalog = load_catalog(root, labs, graders_dir)
    options = []
    if args.kata_timeout is not None:
        options += ["--kata-timeout", f"{args.kata_timeout:g}"]
    if args.hidden_seed is not None:
        options += ["--kata-hidden-seed", str(args.hidden_seed)]
    if args.hidden_cases:
        options += ["--kata-hidden-cases", "hidden-cases.json"]  # relative to the project: the child's cwd
    if args.hidden_output:
        options += ["--kata-hidden-output", args.hidden_output]
    manifest = {"labs": labs, "timeout": args.timeout, "pytest_args": options, "catalog": catalog.to_json()}
    setup = SETUP_SH.format(index=TORCH_CPU_INDEX,
                            dependencies=" ".join(shlex.quote(d) for d in bundle_dependencies(root)))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        def add(name: str, data: bytes, mode: int = 0o644) -> None:
            info = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            bundle.writestr(info, data)

        add("setup.sh", setup.encode(), 0o755)
        add("run_autograder", RUN_AUTOGRADER.encode(), 0o755)
        for name, path in bundle_files(root, labs):
            add(name, path.read_bytes())
        add(f"project/{MANIFEST}", json.dumps(manifest, indent=2, ensure_ascii=False).encode())
        if args.hidden_cases:
            add("project/hidden-cases.json", Path(args.hidden_cases).read_bytes())
    print(f"wrote {out}: a Gradescope autograder for {', '.join(labs)} ({_fmt(catalog.points())} points); "
          "upload it as the assignment's autograder (setup.sh installs the pinned dependencies)")
    return 0


def autograde(project: Path, submission: Path, results: Path) -> int:
    """Grade one Gradescope submission (run_autograder calls this) and write results.json."""
    project = project.resolve()
    results.parent.mkdir(parents=True, exist_ok=True)
    try:
        manifest = json.loads((project / MANIFEST).read_text(encoding="utf-8"))
        catalog = Catalog.from_json(manifest["catalog"])
    except (OSError, ValueError, KeyError) as exc:
        _write_json(results, {"score": 0.0, "output": f"Not graded: the autograder bundle is broken ({exc}).",
                              "visibility": "visible", "stdout_visibility": "hidden", "tests": []})
        return 1
    seed = random.SystemRandom().randrange(1, 10**6)
    with tempfile.TemporaryDirectory(prefix="kata-autograde-") as tmp:
        grading = Grading(catalog, ["--kata-seed", str(seed), *manifest.get("pytest_args", [])],
                          float(manifest.get("timeout", DEFAULT_AUTOGRADER_TIMEOUT)), Path(tmp))
        prep = lay_out("submission", submission, project, project / "pyproject.toml", catalog)
        try:
            runs = [r for r in [first_pass(prep, grading)] if r is not None]
            if runs and needs_cuda_pass(prep, runs[0], grading):
                runs.append(cuda_pass(prep, grading))
        finally:
            grading.children.kill_all()
        graded = conclude(prep, runs, catalog)
    data = graded.gradescope
    if validate_gradescope(data):
        data = zero_gradescope(catalog, "the grader's results were not a valid Gradescope file: "
                               + "; ".join(validate_gradescope(data)))
    _write_json(results, data)
    print(f"graded with seed {seed}: {_fmt(graded.score)}/{_fmt(graded.max_score)} ({graded.outcome})"
          + (f": {graded.reason}" if graded.reason else ""))
    for run in runs:
        print(f"--- pass -m {run.marker!r}: exit code {run.returncode}, {run.seconds:.1f} s\n{run.output_tail}")
    return 0


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


# ---- GitHub Classroom --------------------------------------------------------------------------------------
def _yaml(text: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(text, ensure_ascii=False)


def classroom_workflow(catalog: Catalog, python: str, timeout_minutes: int) -> str:
    ids = {lab: "lab-" + lab.replace("_", "-") for lab in catalog.labs}
    lines = [
        "# GitHub Classroom autograding, written by `kata classroom` from the graders: one test per lab.",
        "# A lab's test earns its max-score (the sum of its graders' Kata.points) when",
        "# `python -m pytest katas/NN_lab.py` exits 0, that is when every kata function of the lab passes.",
        "name: Autograding Tests",
        "'on':",
        "- push",
        "- repository_dispatch",
        "permissions:",
        "  checks: write",
        "  actions: read",
        "  contents: read",
        "jobs:",
        "  run-autograding-tests:",
        "    runs-on: ubuntu-latest",
        "    if: github.actor != 'github-classroom[bot]'",
        "    steps:",
        "    - name: Checkout code",
        "      uses: actions/checkout@v4",
        "    - name: Set up Python",
        "      uses: actions/setup-python@v5",
        "      with:",
        f"        python-version: '{python}'",
        "    - name: Install the pinned dependencies",
        f"      run: python -m pip install --extra-index-url {TORCH_CPU_INDEX} -e .",
    ]
    for lab in catalog.labs:
        title = catalog.titles.get(lab, lab)
        lines += [
            f"    - name: {_yaml(title)}",
            f"      id: {ids[lab]}",
            "      uses: classroom-resources/autograding-command-grader@v1",
            "      with:",
            f"        test-name: {_yaml(title)}",
            "        setup-command: ''",
            f"        command: python -m pytest katas/{lab}.py",
            f"        timeout: {timeout_minutes}",
            f"        max-score: {_fmt(catalog.points(lab))}",
        ]
    lines += [
        "    - name: Autograding Reporter",
        "      uses: classroom-resources/autograding-grading-reporter@v1",
        "      env:",
        *[f"        {ids[lab].upper()}_RESULTS: \"${{{{steps.{ids[lab]}.outputs.result}}}}\"" for lab in catalog.labs],
        "      with:",
        f"        runners: {','.join(ids[lab] for lab in catalog.labs)}",
    ]
    return "\n".join(lines) + "\n"


def cmd_classroom(args) -> int:
    root = Path(args.root).resolve()
    graders_dir = root / "plugin" / "graders"
    labs = select_labs(graders_dir, args.labs)
    if not 1 <= args.timeout_minutes <= 60:
        raise InstructorError("--timeout-minutes must be between 1 and 60 (the command grader's limit)")
    catalog = load_catalog(root, labs, graders_dir)
    path = Path(args.out) / "workflows" / "classroom.yml"
    text = classroom_workflow(catalog, args.python, args.timeout_minutes)
    if path.exists() and path.read_text(encoding="utf-8") != text and not args.force:
        raise InstructorError(f"{path} exists and differs: pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}: {len(labs)} test(s), {_fmt(catalog.points())} points in all")
    return 0


# ---- the commands ------------------------------------------------------------------------------------------
def _guarded(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except InstructorError as exc:
            print(f"kata {args.command}: {exc}", file=sys.stderr)
            return exc.code

    return run


def _labs_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--labs", action="append", metavar="LAB",
                        help=f"{what} only these labs ('01', '01_forward_noise'; repeat or comma-separate); "
                             "default: all")


def _hidden_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-seed", type=int, metavar="N",
                        help="also run the hidden checks with this instructor seed (--kata-hidden-seed)")
    parser.add_argument("--hidden-cases", metavar="FILE",
                        help='JSON file of extra hidden cases {"lab::function::check": [case, ...]}')
    parser.add_argument("--hidden-output", choices=("name-only", "full"),
                        help="what a failing hidden check shows (default: its name only)")
    parser.add_argument("--kata-timeout", type=float, metavar="SECONDS",
                        help="per-check time limit (pytest-timeout; default: the project's kata_timeout)")


def add_commands(commands) -> None:
    """Add the instructor subcommands to the `kata` parser."""
    p = commands.add_parser(
        "class", help="grade a class of submissions, each in its own process, in parallel",
        description="Grade every submission folder (kata files NN_lab.py in it or in a katas/ subfolder) in a "
                    "scratch copy, in its own pytest process under a wall-clock limit; write class.csv, "
                    "checks.csv, class.md, class.json and gradescope/<learner>.json in --out.")
    p.add_argument("submissions", nargs="+", metavar="SUBMISSION_DIR", help="one folder per learner")
    p.add_argument("--out", required=True, metavar="DIR", help="where the class results go")
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS, metavar="N",
                   help=f"submissions graded at once (default {DEFAULT_JOBS}; items marked cuda always run one "
                        "at a time, in a second pass)")
    p.add_argument("--timeout", type=float, default=DEFAULT_CLASS_TIMEOUT, metavar="S",
                   help=f"wall-clock seconds per submission and pass before its process group is killed and it "
                        f"scores 0 (default {DEFAULT_CLASS_TIMEOUT:g})")
    p.add_argument("--seed", type=int, metavar="N", help="the graders' input seed, the same for every learner "
                                                         "(default: a fresh one, printed and recorded)")
    _labs_option(p, "grade")
    _hidden_options(p)
    p.add_argument("--root", default=str(ROOT), help="the repository root (holds plugin/graders and pyproject.toml)")
    p.set_defaults(run=_guarded(cmd_class))

    p = commands.add_parser(
        "gradescope-bundle", help="build a Gradescope autograder zip (setup.sh, run_autograder, the project)",
        description="Build a Gradescope autograder: setup.sh installs the pinned dependencies and the bundled "
                    "project; run_autograder grades /autograder/submission's kata files and writes "
                    "/autograder/results/results.json (zero with the reason when grading reports nothing).")
    p.add_argument("--out", default="autograder.zip", metavar="ZIP", help="the zip to write (default autograder.zip)")
    p.add_argument("--timeout", type=float, default=DEFAULT_AUTOGRADER_TIMEOUT, metavar="S",
                   help=f"wall-clock seconds per submission (default {DEFAULT_AUTOGRADER_TIMEOUT:g}); keep it "
                        "below the assignment's Gradescope timeout so a hang still scores 0 with a reason")
    _labs_option(p, "grade")
    _hidden_options(p)
    p.add_argument("--root", default=str(ROOT), help="the repository root")
    p.set_defaults(run=_guarded(cmd_gradescope_bundle))

    p = commands.add_parser(
        "classroom", help="write a GitHub Classroom autograding workflow (one test per lab)",
        description="Write OUT/workflows/classroom.yml: one classroom-resources/autograding-command-grader test "
                    "per lab (`python -m pytest katas/NN_lab.py`, max-score = the lab's points) and the "
                    "autograding-grading-reporter step.")
    p.add_argument("--out", default=".github", metavar="DIR", help="the .github folder (default .github)")
    p.add_argument("--python", default="3.11", help="Python version for actions/setup-python (default 3.11)")
    p.add_argument("--timeout-minutes", type=int, default=10, help="per-lab limit in minutes (default 10)")
    p.add_argument("--force", action="store_true", help="overwrite an existing, different classroom.yml")
    _labs_option(p, "include")
    p.add_argument("--root", default=str(ROOT), help="the repository root")
    p.set_defaults(run=_guarded(cmd_classroom))


def main(argv: list[str] | None = None) -> int:
    """`python -m plugin.instructor autograde ...`: what run_autograder calls inside Gradescope."""
    parser = argparse.ArgumentParser(prog="python -m plugin.instructor")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("autograde", help="grade one Gradescope submission and write results.json")
    p.add_argument("--project", required=True, type=Path)
    p.add_argument("--submission", required=True, type=Path)
    p.add_argument("--results", required=True, type=Path)
    args = parser.parse_args(argv)
    return autograde(args.project, args.submission, args.results)


if __name__ == "__main__":
    sys.exit(main())
