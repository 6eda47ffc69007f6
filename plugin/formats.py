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
