"""Learner commands of `kata`: watch, progress, hint, reset, explain.

    kata watch [LAB]          grade a lab, show its verdict and next step, grade again on every save
    kata progress [--cached]  every lab: solved/total functions and the next TODO
    kata hint [FUNCTION]      one more hint tier for the function you are on (remembered)
    kata reset LAB            restore a kata file to its TODOs, keeping your version as a backup
    kata explain [LAB]        the lab's lesson (concept, mental model, traps, say it out loud)

pytest stays the engine: watch and progress run `python -m pytest ... --kata-json` in a subprocess
and read the report. What the learner's tools remember lives in .kata/ under the repository root
(git-ignored): the last report (last-report.json), the hint tiers revealed (hints.json) and the
backups `kata reset` keeps (backups/). Every command takes --root, the repository root.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from plugin import explain
from plugin.derive import MarkerError, strip_solutions

ROOT = explain.ROOT
# Where the `plugin` package imports from: the pytest subprocess needs it even for a --root elsewhere.
PACKAGE_PARENT = Path(__file__).resolve().parent.parent
TIER_NAMES = ("nudge", "the math", "near code")
UNSOLVED = ("todo", "failed", "over budget")
VERBS = {"todo": "write", "failed": "fix", "over budget": "make cheaper"}
MARKS = {"passed": "passed", "failed": "FAILED", "todo": "TODO", "over budget": "OVER BUDGET",
         "skipped": "skipped"}
CLEAR = "\033[2J\033[H"
# The first line of a message that means the whole kata file could not be imported (plugin/collection.py).
IMPORT_TROUBLE = (" does not parse", " is missing")


class LearnerError(Exception):
    """A message for the learner; the command prints it and exits with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


# ---- where things are --------------------------------------------------------------------------------
@dataclass
class Repo:
    root: Path

    @property
    def katas(self) -> Path:
        return self.root / "katas"

    @property
    def solutions(self) -> Path:
        return self.root / "solutions"

    @property
    def graders(self) -> Path:
        return self.root / "plugin" / "graders"

    @property
    def state(self) -> Path:
        return self.root / ".kata"

    @property
    def report_path(self) -> Path:
        return self.state / "last-report.json"

    @property
    def hints_path(self) -> Path:
        return self.state / "hints.json"

    @property
    def backups(self) -> Path:
        return self.state / "backups"

    def kata(self, lab: str) -> Path:
        return self.katas / f"{lab}.py"

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def labs(self) -> list[str]:
        """Lab stems from katas/ (and solutions/, so that a deleted kata file still shows), in order."""
        stems = {p.stem for p in explain.lab_files(self.katas)}
        stems |= {p.stem for p in explain.lab_files(self.solutions)}
        return sorted(stems)


def open_repo(root: Path) -> Repo:
    repo = Repo(Path(root).resolve())
    if not repo.katas.is_dir():
        raise LearnerError(f"there is no katas/ folder in {repo.root}: --root must be the repository root "
                           "(the folder that holds katas/, solutions/ and plugin/)")
    return repo


def resolve_lab(repo: Repo, name: str) -> str:
    """A lab stem from '1', '01', '01_forward_noise' or a unique part of the name."""
    try:
        return explain.find_lab(name, repo.katas).stem
    except LookupError as exc:
        try:  # the learner's kata file may be gone; its solution still names the lab
            return explain.find_lab(name, repo.solutions).stem
        except LookupError:
            pass
        if not repo.labs():
            raise LearnerError(f"there are no labs in {repo.rel(repo.katas)}/ (files named NN_name.py)") from None
        raise LearnerError(f"{exc}\n(a lab is named by its number, e.g. `01`, or by its name)") from None


# ---- grading ---------------------------------------------------------------------------------------------
@dataclass
class Grading:
    report: dict | None  # the --kata-json report; None when pytest wrote none
    output: str  # what pytest printed
    returncode: int
    seconds: float


def grade(repo: Repo, target: str, *extra: str) -> Grading:
    """`python -m pytest TARGET -q --kata-json ...` in the repository root, in a subprocess."""
    with tempfile.TemporaryDirectory(prefix="kata-") as tmp:
        json_path = Path(tmp) / "report.json"
        command = [sys.executable, "-m", "pytest", target, "-q", "--kata-json", str(json_path),
                   "-p", "plugin.plugin", "--rootdir", str(repo.root), *extra]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), env.get("PYTHONPATH")]))
        start = time.monotonic()
        # On Ctrl-C, subprocess.run kills pytest before the KeyboardInterrupt reaches the caller.
        done = subprocess.run(command, cwd=repo.root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace")
        seconds = time.monotonic() - start
        report = None
        if json_path.is_file():
            try:
                report = json.loads(json_path.read_text(encoding="utf-8"))
            except ValueError:
                report = None
    return Grading(report, done.stdout or "", done.returncode, seconds)


def grading_failed(grading: Grading, what: str) -> str:
    tail = "\n".join(grading.output.rstrip().splitlines()[-30:])
    return (f"pytest could not grade {what} (exit code {grading.returncode}) and wrote no report; "
            f"what it said:\n{textwrap.indent(tail, '  ')}")


def now() -> str:
    return datetime.now().isoformat(timespec="seconds")


def load_report(repo: Repo) -> dict | None:
    try:
        return json.loads(repo.report_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def save_report(repo: Repo, report: dict, only_labs: set[str] | None = None) -> dict:
    """Store `report` as .kata/last-report.json; with `only_labs`, replace just those labs in it.

    "attempted" lists the labs a run tried to grade: one of them missing from "labs" could not be
    collected, while a lab never attempted is simply not graded yet.
    """
    stamp = now()
    data = dict(report)
    data["saved_at"] = stamp
    data["labs"] = [dict(entry, graded_at=stamp) for entry in report.get("labs", [])]
    data["attempted"] = sorted(only_labs) if only_labs is not None else [p.stem for p in explain.lab_files(repo.katas)]
    old = load_report(repo) if only_labs is not None else None
    if old:
        data["attempted"] = sorted(set(old.get("attempted", [])) | only_labs)
        kept = [e for e in old.get("labs", []) if e.get("lab") not in only_labs]
        data["labs"] = sorted(kept + data["labs"], key=lambda e: e.get("lab", ""))
        results = [r for r in old.get("results", []) if r.get("lab") not in only_labs]
        data["results"] = sorted(results + list(report.get("results", [])), key=lambda r: r.get("lab", ""))
    write_json(repo.report_path, data)
    return data


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


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


def next_todo(report: dict | None) -> tuple[str, str, str] | None:
    """(lab, function, status) of the first function not passing, in lab order."""
    for entry in sorted((report or {}).get("labs", []), key=lambda e: e.get("lab", "")):
        found = first_unsolved(entry)
        if found:
            return entry["lab"], found[0], found[1]
    return None


def messages(report: dict | None, lab: str, function: str, wanted=UNSOLVED) -> list[str]:
    return [r.get("message", "") for r in (report or {}).get("results", [])
            if r.get("lab") == lab and r.get("function") == function and r.get("status") in wanted]


def import_trouble(report: dict | None, entry: dict) -> str | None:
    """The first line of the failure when the whole kata file does not import, else None."""
    found = first_unsolved(entry)
    if not found or found[1] != "failed":
        return None
    for message in messages(report, entry["lab"], found[0], ("failed",)):
        first = message.strip().splitlines()[0] if message.strip() else ""
        path_first = first.split(" ", 1)[0].endswith(".py")
        if first.startswith("importing ") or (path_first and any(m in first for m in IMPORT_TROUBLE)):
            return first
    return None


# ---- hints -----------------------------------------------------------------------------------------------
_HINTS_CACHE: dict[tuple[Path, int], dict[str, tuple[str, ...]]] = {}


def grader_hints(repo: Repo, lab: str) -> dict[str, tuple[str, ...]]:
    """Function name -> hint tiers, in the grader's declaration order.

    Read from the grader's source when every `Kata(...)` call there spells its name and hints as
    literals (no import: instant); otherwise the grader module is loaded and its Kata objects read
    (this imports diffusers).
    """
    path = repo.graders / f"{lab}.py"
    if not path.is_file():
        raise LearnerError(f"lab {lab} has no grader ({repo.rel(path)}), so it has no hints")
    key = (path, path.stat().st_mtime_ns)
    if key not in _HINTS_CACHE:
        hints = _static_hints(path)
        if hints is None:
            from plugin.collection import load_module
            from plugin.spec import Kata

            module = load_module(path, f"kata_grader_{lab}")
            hints = {v.name: tuple(v.hints) for v in vars(module).values() if isinstance(v, Kata)}
        _HINTS_CACHE[key] = hints
    return _HINTS_CACHE[key]


def _static_hints(path: Path) -> dict[str, tuple[str, ...]] | None:
    """Hints from the source, or None when any Kata is declared in a way this cannot read for sure."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, OSError, ValueError):
        return None

    def is_kata(node) -> bool:
        return (isinstance(node, ast.Name) and node.id == "Kata") or \
            (isinstance(node, ast.Attribute) and node.attr == "Kata")

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and is_kata(n.func)]
    annotations = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            notes = [x.annotation for x in a.posonlyargs + a.args + a.kwonlyargs + [a.vararg, a.kwarg]
                     if x is not None and x.annotation is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        else:
            continue
        annotations |= {id(n) for note in notes if note is not None for n in ast.walk(note)}
    other_uses = [n for n in ast.walk(tree) if is_kata(n) and id(n) not in annotations]
    if not calls or len(other_uses) != len(calls):  # `K = Kata`, map(Kata, ...): load the module instead
        return None
    found: dict[str, tuple[str, ...]] = {}
    for call in sorted(calls, key=lambda c: (c.lineno, c.col_offset)):
        keywords = {k.arg: k.value for k in call.keywords}
        if None in keywords:  # **kwargs
            return None
        name_node = call.args[0] if call.args else keywords.get("name")
        hints_node = call.args[1] if len(call.args) > 1 else keywords.get("hints")
        try:
            name = ast.literal_eval(name_node) if name_node is not None else None
            hints = ast.literal_eval(hints_node) if hints_node is not None else ()
        except ValueError:
            return None
        if not isinstance(name, str) or name in found or not isinstance(hints, (tuple, list)) \
                or not all(isinstance(h, str) for h in hints):
            return None
        found[name] = tuple(hints)
    return found


def load_revealed(repo: Repo) -> dict[str, int]:
    try:
        data = json.loads(repo.hints_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: int(v) for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}


def failures_cache(repo: Repo) -> dict[str, int]:
    """Consecutive failures per "lab::function" from pytest's cache (the plugin's progressive hints)."""
    try:
        data = json.loads((repo.root / ".pytest_cache" / "v" / "katas" / "failures").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {k: int(v) for k, v in data.items() if isinstance(v, int)} if isinstance(data, dict) else {}


def tiers_seen(repo: Repo, lab: str, function: str, available: int) -> int:
    """Tiers the learner has already seen: through `kata hint`, or with pytest's repeated failures."""
    key = f"{lab}::{function}"
    return min(available, max(load_revealed(repo).get(key, 0), failures_cache(repo).get(key, 0)))


def hint_text(number: int, hint: str) -> str:
    name = TIER_NAMES[number - 1] if number <= len(TIER_NAMES) else "more"
    head = f"hint {number} ({name}): "
    first, *rest = hint.strip().splitlines() or [""]
    return head + first + "".join("\n" + " " * len(head) + line.strip() for line in rest)


# ---- watch -----------------------------------------------------------------------------------------------
def signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def file_events():
    """The optional `watchfiles` module, or None: then we poll."""
    try:
        import watchfiles
    except ImportError:
        return None
    return watchfiles


def seconds_text(s: float) -> str:
    return f"{s:.1f}" if round(s, 1) == s else f"{s:g}"


def wait_for_change(path: Path, since, interval: float, events=None) -> None:
    """Return once the file's mtime or size differs from `since` (and has settled).

    Polling mtime+size works everywhere, including where file events never arrive (NFS) and with
    editors that save by deleting and re-creating the file. With watchfiles, an event ends the wait
    at once, and the same mtime+size check still runs every `interval`.
    """
    if events is not None:
        for _changes in events.watch(path.parent, watch_filter=lambda _c, p: Path(p).name == path.name,
                                     rust_timeout=max(1, int(interval * 1000)), yield_on_timeout=True):
            if _changes or signature(path) != since:
                break
    else:
        while signature(path) == since:
            time.sleep(interval)
    # Editors write in steps (or delete, then create): wait until the file is back and holds still.
    pause = min(interval, 0.2)
    deadline = time.monotonic() + max(2.0, 3 * interval)
    last = signature(path)
    while time.monotonic() < deadline:
        time.sleep(pause)
        current = signature(path)
        if current is not None and current == last:
            return
        last = current


def verdict_lines(repo: Repo, lab: str, grading: Grading) -> list[str]:
    """The lab's verdict, the next step with its hint tier, and the first failure's text."""
    report = grading.report
    entry = lab_entry(report, lab)
    kata = repo.rel(repo.kata(lab))
    stamp = datetime.now().strftime("%H:%M:%S")
    seed = (report or {}).get("seed")
    lines = [f"graded at {stamp} in {grading.seconds:.1f} s" + (f" (seed {seed})" if seed is not None else "")]
    if entry is None:
        if not repo.kata(lab).is_file():
            return lines + ["", f"{kata} is gone: `kata reset {lab[:2]}` restores it (or undo the delete in your "
                                "editor); grading starts again when it is back."]
        tail = "\n".join(grading.output.rstrip().splitlines()[-40:])
        lines += ["", f"{kata} could not be graded; pytest said:", textwrap.indent(tail, "  ")]
        return lines
    solved, total = counts(entry)
    lines += ["", f"{entry.get('title', lab)}: {solved}/{total} solved"]
    width = max((len(MARKS.get(s, s)) for _, s in statuses(entry)), default=6)
    lines += [f"  {MARKS.get(s, s):<{width}}  {f}" for f, s in statuses(entry)]
    found = first_unsolved(entry)
    lines.append("")
    if found is None:
        labs = repo.labs()
        later = [other for other in labs if other > lab]
        lines.append("every function in this lab passes." + (
            f" On to the next lab: kata watch {later[0][:2]}  ({later[0]})" if later else " That was the last lab."))
        return lines
    function, status = found
    lines.append(f"next: {VERBS.get(status, 'fix')} `{function}` in {kata}")
    try:
        hints = grader_hints(repo, lab).get(function, ())
    except LearnerError:
        hints = ()
    if hints:
        tier = max(1, tiers_seen(repo, lab, function, len(hints)))
        lines.append(textwrap.indent(hint_text(tier, hints[tier - 1]), "  "))
        if tier < len(hints):
            lines.append(f"  (`kata hint` shows hint {tier + 1} of {len(hints)})")
    failing = next(((f, s) for f, s in statuses(entry) if s in ("failed", "over budget")), None)
    if failing is None:
        lines.append("nothing fails yet: the functions not passing are still TODO.")
        return lines
    text = next((m for m in messages(report, lab, failing[0], (failing[1],)) if m.strip()), "")
    body = text.rstrip().splitlines()
    if len(body) > 80:
        body = body[:80] + [f"... ({len(body) - 80} more lines: python -m pytest {kata})"]
    lines += ["", f"---- why `{failing[0]}` is {MARKS[failing[1]]} (pytest) ----", *body]
    return lines


def cmd_watch(args) -> int:
    repo = open_repo(args.root)
    if args.interval <= 0:
        raise LearnerError("--interval takes a number of seconds above 0, e.g. --interval 0.5")
    tty = sys.stdout.isatty()
    try:
        grading = None
        if args.lab:
            lab = resolve_lab(repo, args.lab)
        else:
            labs = explain.lab_files(repo.katas)
            print(f"grading the {len(labs)} lab(s) in {repo.rel(repo.katas)}/ to find where you are...",
                  flush=True)
            before = {p.stem: signature(p) for p in labs}
            grading = grade(repo, repo.rel(repo.katas), "--continue-on-collection-errors")
            if grading.report is None:
                raise LearnerError(grading_failed(grading, f"{repo.rel(repo.katas)}/"), 1)
            save_report(repo, grading.report)
            found = next_todo(grading.report)
            if found is None:
                print("every graded function in every lab passes. Watch one anyway with `kata watch LAB`.")
                return 0
            lab = found[0]
        kata = repo.kata(lab)
        if not (repo.graders / f"{lab}.py").is_file():
            raise LearnerError(f"lab {lab} has no grader ({repo.rel(repo.graders / (lab + '.py'))}): "
                               "nothing to watch")
        events = file_events()
        how = (f"file events via watchfiles, and a check every {seconds_text(args.interval)} s" if events
               else f"polling every {seconds_text(args.interval)} s")
        header = f"watching {repo.rel(kata)} ({how}) · Ctrl-C to stop"
        since = before[lab] if grading is not None and lab in before else signature(kata)
        while True:
            if grading is None:
                print(f"grading {repo.rel(kata)}...", flush=True)
                since = signature(kata)
                grading = grade(repo, repo.rel(kata))
                if grading.report is not None:
                    save_report(repo, grading.report, only_labs={lab})
            out = [(CLEAR if tty else "") + header, *verdict_lines(repo, lab, grading)]
            if not args.once:
                out += ["", f"waiting for a change of {repo.rel(kata)}... (Ctrl-C to stop)"]
            print("\n".join(out), flush=True)
            if args.once:
                return 0
            if signature(kata) == since:
                wait_for_change(kata, since, args.interval, events)
            grading = None
    except KeyboardInterrupt:
        print("\nstopped watching.", flush=True)
        return 0


# ---- progress --------------------------------------------------------------------------------------------
def progress_lines(repo: Repo, report: dict, cached: bool) -> list[str]:
    labs = repo.labs()
    width = max([len(lab) for lab in labs] + [3])
    lines = []
    for lab in labs:
        entry = lab_entry(report, lab)
        kata = repo.kata(lab)
        if not kata.is_file():
            lines.append(f"  {lab:<{width}}    -   {repo.rel(kata)} is missing: `kata reset {lab[:2]}` restores it")
            continue
        if entry is None:
            if not (repo.graders / f"{lab}.py").is_file():
                why = f"not graded: it has no grader ({repo.rel(repo.graders / (lab + '.py'))})"
            elif lab not in report.get("attempted", [lab]):
                why = "not graded yet (`kata progress` grades every lab)"
            else:
                why = f"not graded: pytest could not collect it (`python -m pytest {repo.rel(kata)}` shows why)"
            lines.append(f"  {lab:<{width}}    ?   {why}")
            continue
        solved, total = counts(entry)
        bar = "#" * solved + "." * (total - solved)
        found = first_unsolved(entry)
        trouble = import_trouble(report, entry)
        if trouble:
            todo = trouble
        elif found:
            todo = f"next: {found[0]} ({MARKS[found[1]]})"
        else:
            todo = "solved"
        edited = ""
        graded_at = entry.get("graded_at")
        if cached and graded_at:
            try:
                if datetime.fromtimestamp(kata.stat().st_mtime) > datetime.fromisoformat(graded_at):
                    edited = "  (edited since)"
            except (OSError, ValueError):
                pass
        lines.append(f"  {lab:<{width}}  {solved:>2}/{total:<2} {bar:<{max(total, 6)}}  {todo}{edited}")
    found = next_todo(report)
    lines.append("")
    if found is None:
        lines.append("every graded function passes." if report.get("labs") else "nothing was graded.")
    else:
        lab, function, status = found
        lines.append(f"next: {VERBS.get(status, 'fix')} `{function}` in {repo.rel(repo.kata(lab))}"
                     f"   (kata watch {lab[:2]} · kata hint)")
    return lines


def cmd_progress(args) -> int:
    repo = open_repo(args.root)
    if args.cached:
        report = load_report(repo)
        if report is None:
            raise LearnerError(f"no report yet ({repo.rel(repo.report_path)}): run `kata progress` "
                               "once; it grades every lab", 1)
        header = (f"kata progress · last report, saved {report.get('saved_at', '?').replace('T', ' ')} "
                  "(`kata progress` grades again)")
    else:
        labs = explain.lab_files(repo.katas)
        print(f"grading the {len(labs)} lab(s) in {repo.rel(repo.katas)}/ in one pytest run...",
              file=sys.stderr, flush=True)
        grading = grade(repo, repo.rel(repo.katas), "--continue-on-collection-errors")
        if grading.report is None:
            raise LearnerError(grading_failed(grading, f"{repo.rel(repo.katas)}/"), 1)
        report = save_report(repo, grading.report)
        header = f"kata progress · graded in {grading.seconds:.0f} s (seed {report.get('seed')})"
    print("\n".join([header, *progress_lines(repo, report, args.cached)]))
    return 0


# ---- hint ------------------------------------------------------------------------------------------------
def labs_defining(repo: Repo, function: str) -> list[str]:
    """Labs whose kata file (or solution) defines `function` at the top level."""
    found = []
    for lab in repo.labs():
        for path in (repo.kata(lab), repo.solutions / f"{lab}.py"):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, ValueError):
                continue
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function for n in tree.body):
                found.append(lab)
                break
    return found


def cmd_hint(args) -> int:
    repo = open_repo(args.root)
    report = load_report(repo)
    lab = resolve_lab(repo, args.lab) if args.lab else None
    function = args.function
    status = None
    if function is None:
        if report is None:
            raise LearnerError("no grading report yet, so no current TODO: run `kata progress` (or `kata watch`) "
                               "first, or name the function: kata hint FUNCTION [--lab LAB]", 1)
        if lab is not None:
            entry = lab_entry(report, lab)
            found = first_unsolved(entry) if entry else None
            if entry is None:
                raise LearnerError(f"the last report has no grades for {lab}: run `kata watch {lab[:2]} --once`, "
                                   f"or name the function: kata hint FUNCTION --lab {lab[:2]}", 1)
            if found is None:
                raise LearnerError(f"every function in {lab} passes in the last report; "
                                   f"name one to see its hints: kata hint FUNCTION --lab {lab[:2]}", 1)
            function, status = found
        else:
            found = next_todo(report)
            if found is None:
                raise LearnerError("every graded function passes in the last report; name one to see its "
                                   "hints: kata hint FUNCTION --lab LAB", 1)
            lab, function, status = found
    elif lab is None:
        graded = sorted({r.get("lab") for r in (report or {}).get("results", []) if r.get("function") == function})
        candidates = graded or labs_defining(repo, function)
        candidates = [c for c in candidates if function in _hints_or_empty(repo, c)]
        if len(candidates) != 1:
            where = f"labs {', '.join(candidates)} all have" if candidates else "no lab has"
            raise LearnerError(f"{where} a graded function `{function}`: name the lab, "
                               f"e.g. kata hint {function} --lab 01")
        lab = candidates[0]
    hints_by_function = grader_hints(repo, lab)
    if function not in hints_by_function:
        raise LearnerError(f"{lab} has no graded function `{function}`; its functions are: "
                           + ", ".join(hints_by_function))
    if status is None:
        entry = lab_entry(report, lab)
        status = dict(statuses(entry)).get(function) if entry else None
    hints = hints_by_function[function]
    where = f"{lab} · `{function}`" + (f" ({MARKS.get(status, status)} in the last report)" if status else "")
    if not hints:
        print(f"{where}\nthe grader gives no hints for `{function}`: read the lesson, kata explain {lab[:2]}")
        return 0
    key = f"{lab}::{function}"
    tier = min(len(hints), tiers_seen(repo, lab, function, len(hints)) + 1)
    revealed = load_revealed(repo)
    revealed[key] = max(revealed.get(key, 0), tier)
    write_json(repo.hints_path, revealed)
    lines = [where, *(hint_text(i + 1, h) for i, h in enumerate(hints[:tier]))]
    if tier < len(hints):
        lines.append(f"(run `kata hint` again for hint {tier + 1} of {len(hints)})")
    else:
        lines.append(f"(that is every hint for `{function}`; "
                     f"the traps are in `kata explain {lab[:2]} --section traps`)")
    print("\n".join(lines))
    return 0


def _hints_or_empty(repo: Repo, lab: str) -> dict:
    try:
        return grader_hints(repo, lab)
    except LearnerError:
        return {}


# ---- reset -----------------------------------------------------------------------------------------------
def cmd_reset(args) -> int:
    repo = open_repo(args.root)
    lab = resolve_lab(repo, args.lab)
    kata = repo.kata(lab)
    solution = repo.solutions / f"{lab}.py"
    if not solution.is_file():
        raise LearnerError(f"cannot reset {repo.rel(kata)}: its pristine form is derived from "
                           f"{repo.rel(solution)}, which is not there", 1)
    try:
        pristine = strip_solutions(solution.read_text(encoding="utf-8"), repo.rel(solution))
    except MarkerError as exc:
        raise LearnerError(f"cannot reset {repo.rel(kata)}: {exc}", 1) from None
    current = kata.read_text(encoding="utf-8") if kata.is_file() else None
    if current == pristine:
        print(f"{repo.rel(kata)} is already pristine: nothing to reset.")
        return 0
    backup = None
    if current is not None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        backup = repo.backups / f"{lab}-{stamp}.py"
        number = 1
        while backup.exists():
            backup = repo.backups / f"{lab}-{stamp}-{number}.py"
            number += 1
    if not args.yes:
        kept = f"Your version is kept in {repo.rel(backup)}" if backup else "There is no file there now"
        if not sys.stdin.isatty():
            keep = f" (your version will be kept in {repo.rel(repo.backups)}/)" if backup else ""
            raise LearnerError(f"not resetting {repo.rel(kata)}: there is no terminal to ask you on. "
                               f"Pass --yes to reset it{keep}.", 1)
        try:
            answer = input(f"Reset {repo.rel(kata)} ? {kept} [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print(f"kept {repo.rel(kata)} as it is.")
            return 1
    if backup is not None:
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_text(current, encoding="utf-8")
    kata.parent.mkdir(parents=True, exist_ok=True)
    kata.write_text(pristine, encoding="utf-8")
    print(f"reset {repo.rel(kata)}: every function is TODO again.")
    if backup is not None:
        print(f"your version: {repo.rel(backup)}  (compare: diff {repo.rel(backup)} {repo.rel(kata)})")
    return 0


# ---- explain ---------------------------------------------------------------------------------------------
def cmd_explain(args) -> int:
    repo = open_repo(args.root)
    if not args.lab:
        for lab in repo.labs():
            print(f"{lab:<32} {_lesson_title(repo, lab)}")
        print("\nread one: kata explain NN [--section traps]")
        return 0
    lab = resolve_lab(repo, args.lab)
    path = _lesson_source(repo, lab)
    print(explain.render(path, args.section))
    return 0


def _lesson_source(repo: Repo, lab: str) -> Path:
    """The kata file, unless it is gone or does not parse: then the solution (same docstring)."""
    for path in (repo.kata(lab), repo.solutions / f"{lab}.py"):
        try:
            ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        return path
    raise LearnerError(f"cannot read the lesson of {lab}: {repo.rel(repo.kata(lab))} does not parse "
                       "and there is no solution file to read it from", 1)


def _lesson_title(repo: Repo, lab: str) -> str:
    try:
        return explain.lesson(_lesson_source(repo, lab))[0]
    except LearnerError:
        return "(does not parse)"


# ---- the parser ------------------------------------------------------------------------------------------
def _runner(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except LearnerError as exc:
            print(f"kata {args.command}: {exc}", file=sys.stderr)
            return exc.code
        except KeyboardInterrupt:
            print("\ninterrupted.", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `kata progress | head`: the reader left; say nothing more
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            return 0

    return run


def add_commands(commands) -> None:
    """Add the learner subcommands to the `kata` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=ROOT, metavar="DIR",
                        help="the repository root: the folder holding katas/, solutions/ and plugin/ "
                             "(default: %(default)s)")

    def add(name, fn, help_text, description):
        parser = commands.add_parser(name, parents=[common], help=help_text, description=description)
        parser.set_defaults(run=_runner(fn))
        return parser

    watch = add("watch", cmd_watch, "grade a lab, show what to do next, grade again on every save",
                "Grade a lab with pytest, show each function's status, the next function with its hint "
                "and the first failure's text; then grade again each time the kata file changes.")
    watch.add_argument("lab", nargs="?", metavar="LAB",
                       help="lab number or name (default: the first lab not fully solved)")
    watch.add_argument("--interval", type=float, default=1.0, metavar="S",
                       help="seconds between checks of the file's mtime and size (default: 1.0)")
    watch.add_argument("--once", action="store_true", help="grade once, show the verdict and exit")

    progress = add("progress", cmd_progress, "every lab: functions solved and the next TODO",
                   "Grade every lab in one pytest run and print solved/total functions and the next TODO "
                   "per lab. The report is kept in .kata/last-report.json.")
    progress.add_argument("--cached", action="store_true",
                          help="print the last report (.kata/last-report.json) without grading")

    hint = add("hint", cmd_hint, "one more hint tier for the function you are on",
               "Show the next hint tier (nudge, the math, near code) of the current TODO (the first "
               "function not passing in the last report) or of FUNCTION; tiers revealed are remembered "
               "in .kata/hints.json.")
    hint.add_argument("function", nargs="?", metavar="FUNCTION", help="a kata function (default: the current TODO)")
    hint.add_argument("--lab", metavar="LAB", help="the lab of FUNCTION, by number or name")

    reset = add("reset", cmd_reset, "restore a kata file to its TODOs (your version is backed up)",
                "Restore katas/LAB.py to its pristine form, derived from solutions/LAB.py; your version is "
                "kept in .kata/backups/ first. Asks before it overwrites.")
    reset.add_argument("lab", metavar="LAB", help="lab number or name, e.g. 01 or 01_forward_noise")
    reset.add_argument("--yes", "-y", action="store_true", help="do not ask (needed without a terminal)")

    lesson = add("explain", cmd_explain, "read a lab's lesson in the terminal",
                 "Print a lab's lesson: concept, mental model, traps, how to say it out loud.")
    lesson.add_argument("lab", nargs="?", metavar="LAB", help="lab number or name; omit to list the labs")
    lesson.add_argument("--section", choices=[s.lower() for s in explain.SECTIONS], help="print one section only")
