"""The last grading: one record, `.kata/last-grading.json` under the course root, written by every run
that grades the learner's kata files (plain `pytest katas/...`, `kata watch`, `kata progress`) and read
by `kata hint`, `kata progress` and `kata watch`.

It is merged per lab: grading lab 11 replaces lab 11's entry and keeps every other lab's. Each entry
holds the lab's function statuses, the results that did not pass (their messages, reason codes and what
the learner's code printed),
when and with which seed it was graded, and a fingerprint of the files its grade depends on (the kata
file, its grader, and earlier kata files it loads by name, as lab 12 does): `kata progress` re-grades
only the labs whose fingerprint no longer matches.

A run that grades only part of a lab (`--kata-function`, `-m budget`, `-k`) updates the functions it
graded completely; the lab keeps its fingerprint only if its files are unchanged since, otherwise the
entry is marked stale (no fingerprint) so that `kata progress` grades it again.

It also counts, per "lab::function", the gradings in which the function failed a correctness check
(not a budget): the hint tiers of `kata hint` unlock on those counts.

Not written by: --solutions runs (not the learner's files), runs with hidden checks or --gradescope
(an instructor's or autograder's run of a scratch copy: its record would be thrown away, and a
learner's record never holds hidden check names), and interrupted runs (an incomplete grade).
Standard library only.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import re
from datetime import datetime
from pathlib import Path

from diffusion_katas.core.results import FILE_REASONS

FORMAT = 1
BUDGET_PREFIX = "budget: "
_STEM = re.compile(r"(\d\d_[A-Za-z0-9_]+)")


# ---- fingerprints ----------------------------------------------------------------------------------------
def fingerprint(path: Path) -> dict | None:
    """{"mtime_ns", "size", "sha256"} of a file, or None when it is not there."""
    try:
        st = path.stat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    return {"mtime_ns": st.st_mtime_ns, "size": st.st_size, "sha256": digest}


def unchanged(path: Path, recorded: dict | None) -> bool:
    """Whether the file is as recorded: the same mtime and size (no read), or else the same content."""
    try:
        st = path.stat()
    except OSError:
        return recorded is None
    if recorded is None:
        return False
    if st.st_mtime_ns == recorded.get("mtime_ns") and st.st_size == recorded.get("size"):
        return True
    if st.st_size != recorded.get("size"):
        return False
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() == recorded.get("sha256")
    except OSError:
        return False


def depends_on(course, lab: str) -> list[Path]:
    """The files a lab's grade depends on: its kata file, its grader, and the kata files of earlier labs
    its kata file names (lab 12 loads the learner's own labs 04, 06 and 07)."""
    kata = course.kata(lab)
    files = [kata, course.grader(lab)]
    for stem in sorted(_named_labs(kata) - {lab}):
        other = course.kata(stem)
        if other.is_file():
            files.append(other)
    return files


def _named_labs(path: Path) -> set[str]:
    """Lab stems the file's code names in a string ("04_classifier_free_guidance"), docstrings left out."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, SyntaxError, ValueError):
        return set()
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            match = _STEM.fullmatch(node.value.removesuffix(".py"))
            if match:
                found.add(match.group(1))
    return found


def lab_fingerprint(course, lab: str) -> dict:
    """{relative path: fingerprint or None} of every file the lab's grade depends on."""
    return {course.rel(path): fingerprint(path) for path in depends_on(course, lab)}


def lab_changed(course, entry: dict | None) -> bool:
    """Whether a lab must be graded again: never graded, stale, or one of its files differs from the record
    (or it now depends on a file the record does not know)."""
    if entry is None or not isinstance(entry.get("files"), dict):
        return True
    files = entry["files"]
    if {course.rel(p) for p in depends_on(course, entry["lab"])} - set(files):
        return True
    return not all(unchanged(course.root / rel, recorded) for rel, recorded in files.items())


# ---- reading and writing ---------------------------------------------------------------------------------
def path_of(course) -> Path:
    return course.record_path


def load(course) -> dict | None:
    """The record, or None when there is none (or it is unreadable, or of another format)."""
    try:
        data = json.loads(path_of(course).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("labs"), list):
        return None
    return data


def write(course, data: dict) -> None:
    """Write the record all at once (a reader never sees half a file)."""
    path = path_of(course)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def empty() -> dict:
    return {"format": FORMAT, "saved_at": None, "seed": None, "last_run": None, "labs": [], "results": [],
            "failed_gradings": {}}


def merge(old: dict | None, run_json: dict, declared: dict[str, dict[str, set[str]]],
          fingerprints: dict[str, dict], now: str | None = None) -> dict:
    """The record after one grading run.

    run_json: the run's kata JSON (core/results.Run.kata_json); declared: per lab, per function (in the
    grader's order), the names of its visible checks and budgets ("budget: NAME"); fingerprints: per lab,
    its files as they were when the run started grading it.
    """
    now = now or datetime.now().isoformat(timespec="seconds")
    data = old if old is not None else empty()
    data = json.loads(json.dumps(data))  # a copy
    results = [r for r in run_json.get("results", []) if not r.get("hidden")]
    titles = {e["lab"]: e.get("title", e["lab"]) for e in run_json.get("labs", [])}
    graded_labs = list(dict.fromkeys(r["lab"] for r in results))
    entries = {e["lab"]: e for e in data["labs"]}
    kept_results = {lab: [r for r in data["results"] if r.get("lab") == lab] for lab in entries}
    failed = data.setdefault("failed_gradings", {})
    rank = {"failed": 5, "waiting": 4, "over budget": 3, "todo": 2, "passed": 1, "skipped": 0}
    for lab in graded_labs:
        mine = [r for r in results if r["lab"] == lab]
        functions = declared.get(lab) or {r["function"]: set() for r in mine}
        graded_checks: dict[str, set[str]] = {}
        status: dict[str, str] = {}
        for r in mine:
            graded_checks.setdefault(r["function"], set()).add(r["check"])
            status[r["function"]] = max(status.get(r["function"], "skipped"), r["status"], key=rank.get)
        complete = {f for f in functions if f in graded_checks and functions[f] <= graded_checks[f]}
        for f in graded_checks:
            if any(r["function"] == f and r["status"] == "failed" and not r["check"].startswith(BUDGET_PREFIX)
                   and r.get("reason") not in FILE_REASONS for r in mine):  # a file that does not import: not
                # an attempt at the function (a half-typed line would spend its hint tiers)
                key = f"{lab}::{f}"
                failed[key] = int(failed.get(key, 0)) + 1
        old_entry = entries.get(lab)
        old_status = {f["name"]: f["status"] for f in (old_entry or {}).get("functions", [])}
        whole = complete >= set(functions)
        if whole:
            new_status = {f: status[f] for f in functions}
            new_results = []
        else:
            # the functions graded completely now, the others as they were (or as partly graded now)
            new_status = {f: status[f] if (f in complete or f not in old_status) and f in status
                          else old_status.get(f, "todo") for f in functions}
            new_results = [r for r in kept_results.get(lab, []) if r.get("function") not in complete]
        new_results += [slim(r) for r in mine if r["status"] not in ("passed", "skipped")
                        and (whole or r["function"] in complete or r["function"] not in old_status)]
        if whole:
            files = fingerprints.get(lab)
        elif old_entry is not None and isinstance(old_entry.get("files"), dict) and \
                old_entry["files"] == _without_times(fingerprints.get(lab), old_entry["files"]):
            files = old_entry["files"]  # the same files as the last full grading: the entry stays whole
        else:
            files = None  # stale: `kata progress` grades it again
        entries[lab] = {
            "lab": lab,
            "title": titles.get(lab, (old_entry or {}).get("title", lab)),
            "functions": [{"name": f, "status": s} for f, s in new_status.items()],
            "graded_at": now,
            "seed": run_json.get("seed"),
            "complete": whole,
            "files": files,
        }
        kept_results[lab] = new_results
    data["labs"] = [entries[lab] for lab in sorted(entries)]
    data["results"] = [r for lab in sorted(kept_results) for r in kept_results[lab]]
    data["saved_at"] = now
    data["seed"] = run_json.get("seed")
    data["last_run"] = {"labs": graded_labs, "at": now, "seed": run_json.get("seed"),
                        "complete": all(entries[lab]["complete"] for lab in graded_labs)}
    return data


def slim(result: dict) -> dict:
    """What the record keeps of a result that did not pass."""
    keep = ("lab", "title", "function", "check", "status", "reason", "detail", "message", "output", "nodeid")
    return {k: result.get(k) for k in keep}


def _without_times(now: dict | None, recorded: dict) -> dict | None:
    """`now` with each file's mtime taken from `recorded` where the content is the same (a file saved
    again unchanged is unchanged)."""
    if now is None:
        return None
    out = {}
    for rel, fp in now.items():
        old = recorded.get(rel)
        if fp is not None and old is not None and fp.get("sha256") == old.get("sha256"):
            out[rel] = old
        else:
            out[rel] = fp
    return out


# ---- what the record says --------------------------------------------------------------------------------
def entry(data: dict | None, lab: str) -> dict | None:
    for e in (data or {}).get("labs", []):
        if e.get("lab") == lab:
            return e
    return None


def failing_now(course, data: dict | None) -> set[tuple[str, str]]:
    """(lab, function) of the functions that failed when their lab was last graded, where none of the lab's
    files changed since (the same failure would come back)."""
    failing = set()
    for item in (data or {}).get("labs", []):
        if not isinstance(item, dict) or lab_changed(course, item):
            continue
        for function in item.get("functions", []):
            if isinstance(function, dict) and function.get("status") == "failed":
                failing.add((item.get("lab"), function.get("name")))
    return failing


def failed_gradings(data: dict | None, lab: str, function: str) -> int:
    return int(((data or {}).get("failed_gradings") or {}).get(f"{lab}::{function}", 0))
