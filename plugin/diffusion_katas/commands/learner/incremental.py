"""`kata watch` re-grades only what a save changed.

A save usually edits one function. The watch session keeps the seed, so a function whose code did not
change would get the same verdict again: re-grading it only costs time (lab 11's decodes: seconds). So
after each save the watch compares the kata file's code, function by function, with the code its last
grading saw, and grades only

    the functions whose code changed, and every function that names one of them (transitively),

then merges those verdicts into the last report. It grades the whole lab instead whenever that could
differ: the first grading, anything outside the functions changed (imports, globals, a function added,
removed or renamed), the file does not parse, the partial grading met a file-level failure (the file no
longer imports), or the merged verdict says the whole lab passes (that verdict always comes from a full
grading). Comments and blank lines are not code: a save that changes only them grades nothing.

The code is read with `ast` (parsed, never run: learner code runs only in the runners).
"""
from __future__ import annotations

import ast
import copy
from dataclasses import dataclass
from pathlib import Path

from diffusion_katas.core.results import FILE_REASONS


@dataclass(frozen=True)
class CodeShape:
    """A kata file's code: each top-level function's code, the names it uses, and everything else."""

    functions: dict  # name -> ast.dump of the def (decorators, defaults and body; no positions or comments)
    names: dict  # name -> the names its code uses
    rest: str  # ast.dump of the module without its function bodies (imports, globals, the defs' order)


def code_shape(path: Path) -> CodeShape | None:
    """The file's CodeShape, or None when it cannot be read or parsed."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    functions, names, rest = {}, {}, []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = ast.dump(node)
            names[node.name] = frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name))
            rest.append(f"def {node.name}")
        else:
            rest.append(ast.dump(node))
    return CodeShape(functions, names, "\n".join(rest))


def to_regrade(before: CodeShape | None, now: CodeShape | None) -> set[str] | None:
    """The functions to grade again: None for the whole lab, an empty set for none."""
    if before is None or now is None or before.rest != now.rest:
        return None
    changed = {name for name, code in now.functions.items() if before.functions.get(name) != code}
    while True:  # and whoever names a function in the set, until nothing more joins
        more = {name for name, used in now.names.items() if name not in changed and used & changed}
        if not more:
            return changed
        changed |= more


def merge(last: dict, partial: dict, lab: str, graded: set[str]) -> dict | None:
    """The last full report with `graded` functions' statuses and results taken from `partial`; None when
    the partial report cannot stand for them (no entry for the lab, a function missing, or a file-level
    failure: then the caller grades the whole lab)."""
    entry = next((e for e in partial.get("labs", []) if e.get("lab") == lab), None)
    if entry is None:
        return None
    new = {f["name"]: f for f in entry.get("functions", [])}
    if not graded <= set(new):
        return None
    results = [r for r in partial.get("results", []) if r.get("lab") == lab]
    if any(r.get("reason") in FILE_REASONS for r in results):
        return None
    merged = copy.deepcopy(last)
    for old in merged.get("labs", []):
        if old.get("lab") == lab:
            old["functions"] = [dict(new[f["name"]]) if f["name"] in graded else f for f in old.get("functions", [])]
    merged["results"] = [r for r in merged.get("results", [])
                         if not (r.get("lab") == lab and r.get("function") in graded)] + results
    return merged


def all_pass(report: dict, lab: str) -> bool:
    entry = next((e for e in report.get("labs", []) if e.get("lab") == lab), None)
    return entry is not None and all(f.get("status") in ("passed", "skipped") for f in entry.get("functions", []))
