"""From the children's reports to grades: one Gradescope-rule score per function, and results.json checks.

Points per kata function are the graders' `Kata.points` (in every result); a function counts when all
its checks and budgets pass (the results model's Gradescope rule, reused here, so the class table and
the Gradescope file agree). A submission scores only what its children reported: no report, a zero.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from diffusion_katas.commands.instructor.catalog import Catalog
from diffusion_katas.core.results import Reason, Run, Status, validate_gradescope
from diffusion_katas.commands.instructor.children import ChildRun
from diffusion_katas.commands.instructor.submissions import MISSING, Prepared

NOT_GRADED = "not graded"
# Gradescope results.json (gradescope-autograders.readthedocs.io/en/latest/specs/).
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


def _scored(results, hidden_run: bool, seed) -> dict:
    """Gradescope's file over these results: the one scoring rule (all or nothing per function)."""
    return Run(list(results), seed, hidden_run).gradescope()


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


def conclude(prep: Prepared, runs: list[ChildRun], catalog: Catalog, cuda_skipped: bool = False) -> Graded:
    """The grade of one submission from its child reports (and nothing else). `cuda_skipped`: the cuda pass
    was not run (no CUDA here), so its items count as skipped, as a child without CUDA would report them."""
    functions = catalog.all_functions()
    seconds = sum(r.seconds for r in runs)
    passes = [{"marker": r.marker, "seconds": round(r.seconds, 2), "returncode": r.returncode,
               "outcome": r.outcome or "report"} for r in runs]
    failed = next((r for r in runs if r.report is None), None)
    results = []
    if not prep.problem and failed is None:
        try:
            results = [r for run in runs for r in Run.from_kata_json(run.report).results]
        except (TypeError, KeyError, AttributeError, ValueError) as exc:  # not what our plugin writes
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

    first = runs[0].report
    hidden_run, seed = bool(first.get("hidden_run")), first.get("seed")
    run = Run(results, seed, hidden_run)
    statuses = {lab: fns for lab, (_title, fns) in run.progress().items()}
    grouped: dict[tuple[str, str], list] = {}
    for (lab, _title, function), rs in run.by_function().items():
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
    if cuda_skipped:
        for f in functions:
            if f.lab in prep.present:
                checks.update({(f.lab, f.name, c): "skipped" for c in f.cuda_checks})
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
    """File-level problems in a few words, from the results' reason codes: missing files, files that do
    not import, deleted functions, functions that timed out."""
    reasons: list[str] = [f"{lab}.py: {MISSING}" for lab in prep.missing] + list(prep.notes)
    for r in results:
        if r.status in (Status.PASSED, Status.SKIPPED, Status.TODO) or r.lab in prep.missing:
            continue
        if r.reason in (Reason.IMPORT_ERROR, Reason.MISSING_FILE, Reason.MISSING_FUNCTION):
            reason = r.detail or f"{r.lab}: {r.reason}"
        elif r.reason == Reason.TIMEOUT:
            reason = f"{r.function}: timed out (per-check limit)"
        else:
            continue
        if reason not in reasons:
            reasons.append(reason)
    return "; ".join(reasons)
