"""Machine-readable results, all written from the one result model (state.Result per graded item).

- `--kata-json PATH`: our own report: seed, versions, per-lab function statuses, every item.
- `--gradescope PATH`: Gradescope's results.json (gradescope-autograders.readthedocs.io/en/latest/specs):
  one test per kata function worth its declared points (all or nothing: a function counts when every
  one of its checks and budgets passes), and with hidden checks run, one more test per function for
  them, visible only after the grades are published.
- JUnit XML: pytest's own --junitxml, as it is.
"""
from __future__ import annotations

import dataclasses
import json
import platform
from collections import OrderedDict
from pathlib import Path

from plugin import state

VERSIONED = ("torch", "diffusers", "peft", "transformers")
# Gradescope's results.json fields and visibility values (gradescope-autograders.readthedocs.io specs).
GS_TOP_LEVEL = {"score", "max_score", "execution_time", "output", "output_format", "test_output_format",
                "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests", "leaderboard"}
GS_PER_TEST = {"score", "max_score", "status", "name", "name_format", "number", "output", "output_format",
               "tags", "visibility", "extra_data"}
GS_VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


def versions() -> dict:
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), **{name: version(name) for name in VERSIONED}}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


def write_json(session: state.KataSession, path: Path) -> None:
    """Our own report: versions, seed, per-lab function statuses, and every graded item."""
    from plugin.reporting import progress

    labs = progress(session)
    _write(path, {
        "graded": session.rel(session.solutions_dir if session.grade_solutions else session.kata_dir),
        "seed": session.seed,
        "hidden_run": session.hidden_seed is not None,
        "versions": versions(),
        "labs": [{"lab": lab, "title": title,
                  "functions": [{"name": f, "status": s} for f, s in functions.items()]}
                 for lab, (title, functions) in labs.items()],
        "results": [dataclasses.asdict(r) for r in session.results],
    })


def functions(results: list[state.Result]):
    """(lab, title, function) -> its results, in run order."""
    grouped: OrderedDict[tuple[str, str, str], list[state.Result]] = OrderedDict()
    for r in results:
        grouped.setdefault((r.lab, r.title, r.function), []).append(r)
    return grouped


def _test(name: str, number: str, results: list[state.Result], points: float, visibility: str) -> dict:
    graded = [r for r in results if r.status != "skipped"]
    passed = bool(graded) and all(r.status == "passed" for r in graded)
    lines = []
    for r in results:
        lines.append(f"{r.status.upper():<11} {r.check}")
        if r.status not in ("passed", "skipped") and r.message:
            lines.append(r.message)
    return {"name": name, "number": number, "score": points if passed else 0.0, "max_score": points,
            "status": "passed" if passed else "failed", "output": "\n".join(lines),
            "visibility": visibility}


def gradescope(session: state.KataSession) -> dict:
    """Gradescope's results.json as a dict."""
    tests = []
    hidden_run = session.hidden_seed is not None
    for (lab, title, function), results in functions(session.results).items():
        points = results[0].points
        visible = [r for r in results if not r.hidden]
        hidden = [r for r in results if r.hidden]
        share = points / 2 if hidden_run and hidden else points
        tests.append(_test(f"{title} · {function}", f"{lab[:2]}.{len(tests) + 1}", visible, share, "visible"))
        if hidden_run and hidden:
            tests.append(_test(f"{title} · {function} (hidden checks)", f"{lab[:2]}.{len(tests) + 1}",
                               hidden, points - share, "after_published"))
    score = sum(t["score"] for t in tests)
    v = versions()
    return {
        "score": score,
        "max_score": sum(t["max_score"] for t in tests),
        "execution_time": round(sum(r.duration for r in session.results), 2),
        "output": (f"Graded live against diffusers {v['diffusers']} and torch {v['torch']} with seed "
                   f"{session.seed}" + ("; hidden checks included." if hidden_run else ".")),
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
        "extra_data": {"seed": session.seed, "versions": v},
    }


def write_gradescope(session: state.KataSession, path: Path) -> None:
    _write(path, gradescope(session))


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
