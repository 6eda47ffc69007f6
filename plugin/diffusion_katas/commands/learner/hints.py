"""Hint tiers: read from the graders, which ones the learner has seen and earned (.kata/hints.json, the failed
gradings counted in .kata/last-grading.json, pytest's cache)."""
from __future__ import annotations

import ast
from pathlib import Path

from diffusion_katas.commands.running import first_unsolved, lab_entry, next_todo
from diffusion_katas.commands.learner.workspace import LearnerError
from diffusion_katas.core import record, tiers
from diffusion_katas.core.course import Course

TIER_NAMES = ("nudge", "the math", "near code")

_HINTS_CACHE: dict[tuple[Path, int], dict[str, tuple[str, ...]]] = {}


# ---- what the graders declare ----------------------------------------------------------------------------
def grader_hints(course: Course, lab: str) -> dict[str, tuple[str, ...]]:
    """Function name -> hint tiers, in the grader's declaration order.

    Read from the grader's source when every `Kata(...)` call there spells its name and hints as
    literals (no import: instant); otherwise the grader module is loaded and its Kata objects read
    (this imports diffusers).
    """
    path = course.graders / f"{lab}.py"
    if not path.is_file():
        raise LearnerError(f"lab {lab} has no grader ({course.rel(path)}), so it has no hints")
    key = (path, path.stat().st_mtime_ns)
    if key not in _HINTS_CACHE:
        hints = _static_hints(path)
        if hints is None:
            hints = {kata.name: tuple(kata.hints) for kata in course.graders_of(lab)}
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


def hints_or_empty(course: Course, lab: str) -> dict:
    try:
        return grader_hints(course, lab)
    except LearnerError:
        return {}


# ---- what the learner has seen, and what they have earned -------------------------------------------------
# One record for pytest's failure messages and `kata hint` (core/tiers.py, .kata/hints.json): tier 1 is free;
# each failed grading of the function earns one more tier than was shown before it, revealed by whichever
# comes first, its failure message or `kata hint`. A grading that is only over budget is correct: it earns no
# correctness tier. Tiers once shown stay shown.
def tiers_seen(course: Course, lab: str, function: str, available: int) -> int:
    """Tiers the learner has already seen, in failure messages or through `kata hint`."""
    return tiers.shown(tiers.load(course.hints_path), f"{lab}::{function}", available)


def reveal(course: Course, report: dict | None, lab: str, function: str, available: int,
           everything: bool = False) -> tuple[int, bool]:
    """(tiers to show, whether the next tier is still locked), remembered in .kata/hints.json: one more tier
    than before if a failed grading of the function came since the last was shown (every tier with
    `everything`, `kata hint --all`)."""
    key = f"{lab}::{function}"
    revealed = tiers.load(course.hints_path)
    mine = revealed.get(key, {"shown": 0, "failures": None})
    failed = record.failed_gradings(report, lab, function)
    shown = min(available, mine["shown"])
    at = failed if mine["failures"] is None else mine["failures"]  # an old hints.json: what it shows is earned
    if everything:
        tier = available
    elif shown == 0:
        tier = 1
    elif failed > at and shown < available:
        tier = shown + 1
    else:
        tier = shown
    revealed[key] = {"shown": max(tier, shown), "failures": failed if tier > shown else at}
    tiers.save(course.hints_path, revealed)
    return tier, tier < available and not failed > at


def next_tier_line(course: Course, lab: str, function: str, tier: int, available: int) -> str:
    """Where the tier after `tier` comes from: `kata hint` when a failed grading has earned it since the last
    tier was shown, else the next failed grading (as reveal() decides)."""
    mine = tiers.load(course.hints_path).get(f"{lab}::{function}", {"shown": 0, "failures": None})
    failed = record.failed_gradings(record.load(course), lab, function)
    if mine.get("failures") is not None and failed > mine["failures"]:
        return f"(`kata hint` shows hint {tier + 1} of {available})"
    return f"(hint {tier + 1} of {available} comes with your next failed grading; `kata hint --all` shows every tier)"


def hint_text(number: int, hint: str) -> str:
    name = TIER_NAMES[number - 1] if number <= len(TIER_NAMES) else "more"
    head = f"hint {number} ({name}): "
    first, *rest = hint.strip().splitlines() or [""]
    return head + first + "".join("\n" + " " * len(head) + line.strip() for line in rest)


# ---- which function a hint is for ------------------------------------------------------------------------
def labs_defining(course: Course, function: str) -> list[str]:
    """Labs whose kata file (or solution) defines `function` at the top level."""
    found = []
    for lab in course.labs():
        for path in (course.kata(lab), course.solutions / f"{lab}.py"):
            try:
                tree = ast.parse(path.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, ValueError):
                continue
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == function for n in tree.body):
                found.append(lab)
                break
    return found


def hint_target(course: Course, report: dict | None, lab: str | None,
                function: str | None) -> tuple[str, str, str | None]:
    """(lab, function, status or None): the current TODO (of `lab`, if given), or the lab of `function`."""
    status = None
    if function is None and lab is not None and lab_entry(report, lab) is None and course.untouched_todos(lab):
        # a lab not graded yet: its first function still a TODO stub is the current TODO (read, not graded)
        graded = hints_or_empty(course, lab)
        function = next((f for f in course.untouched_todos(lab) if f in graded), None)
        if function is not None:
            return lab, function, "todo"
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
            # the lab graded last (`pytest katas/11_memory.py` is where the learner is), then any lab
            found = next_todo(report, (report.get("last_run") or {}).get("labs") or None) or next_todo(report)
            if found is None:
                raise LearnerError("every graded function passes in the last report; name one to see its "
                                   "hints: kata hint FUNCTION --lab LAB", 1)
            lab, function, status = found
    elif lab is None:
        graded = sorted({r.get("lab") for r in (report or {}).get("results", []) if r.get("function") == function})
        candidates = graded or labs_defining(course, function)
        candidates = [c for c in candidates if function in hints_or_empty(course, c)]
        if len(candidates) != 1:
            where = f"labs {', '.join(candidates)} all have" if candidates else "no lab has"
            raise LearnerError(f"{where} a graded function `{function}`: name the lab, "
                               f"e.g. kata hint {function} --lab 01")
        lab = candidates[0]
    return lab, function, status
