"""The results model: one `Result` per graded item, a `Run` of them, and every format written from it.

- `Run.kata_json()`: our own report (`--kata-json`): seed, versions, per-lab function statuses, every item.
- `Run.gradescope()`: Gradescope's results.json (gradescope-autograders.readthedocs.io/en/latest/specs):
  one test per kata function worth its declared points (all or nothing: a function counts when every
  one of its checks and budgets passes), and with hidden checks run, one more test per function for
  them, visible only after the grades are published.
- JUnit XML: pytest's own --junitxml, as it is.

A result carries a status and, when it did not pass, a reason code: tools read the code, never the prose.
"""
from __future__ import annotations

import dataclasses
import json
import platform
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


class Status(str, Enum):
    PASSED = "passed"
    FAILED = "failed"
    TODO = "todo"
    OVER_BUDGET = "over budget"
    WAITING = "waiting"  # a budget of a function that is not correct yet: judged once it is
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


class Reason(str, Enum):
    """Why an item did not pass, as a code a tool can read."""

    NONE = ""
    WRONG = "wrong"  # the output's structure or values differ from the reference
    TODO = "todo"  # the function still raises NotImplementedError
    WAITS_ON = "waits on"  # an earlier kata function it builds on is still TODO
    IMPORT_ERROR = "import error"  # the kata file does not parse or import
    MISSING_FILE = "missing file"
    MISSING_FUNCTION = "missing function"
    CRASH = "crash"  # the learner's function raised
    TIMEOUT = "timeout"
    ANSWER_KEY = "answer key"  # called the reference it is graded against
    MUTATED_INPUT = "mutated input"
    OVER_BUDGET = "over budget"
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value


# Whole-file problems: every function of the lab fails with the same reason.
FILE_REASONS = (Reason.IMPORT_ERROR, Reason.MISSING_FILE)
UNSOLVED = (Status.FAILED, Status.WAITING, Status.OVER_BUDGET, Status.TODO)
# The worst status of a function's items wins; a skipped item (a GPU budget without CUDA) holds nothing back.
# A budget waiting on correctness is outranked by the failing check it waits on, when that check ran.
RANK = {Status.FAILED: 5, Status.WAITING: 4, Status.OVER_BUDGET: 3, Status.TODO: 2, Status.PASSED: 1,
        Status.SKIPPED: 0}

VERSIONED = ("torch", "diffusers", "peft", "transformers")
# Gradescope's results.json fields and visibility values (gradescope-autograders.readthedocs.io specs).
GS_TOP_LEVEL = {"score", "max_score", "execution_time", "output", "output_format", "test_output_format",
                "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests", "leaderboard"}
GS_PER_TEST = {"score", "max_score", "status", "name", "name_format", "number", "output", "output_format",
               "tags", "visibility", "extra_data"}
GS_VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


@dataclass
class Result:
    """The graded outcome of one item (one check, or one budget, of one kata function)."""

    nodeid: str
    lab: str
    title: str
    function: str
    check: str
    status: Status
    points: float  # the function's points (shared by its checks)
    message: str = ""
    duration: float = 0.0
    hidden: bool = False
    reason: Reason = Reason.NONE
    detail: str = ""  # the reason in a few words ("does not parse: invalid syntax at line 3")
    output: str = ""  # what the learner's code printed while the item ran, when it did not pass (capped)

    def __post_init__(self) -> None:
        self.status = Status(self.status)
        self.reason = Reason(self.reason)

    @classmethod
    def from_dict(cls, data: dict) -> "Result":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["status"], data["reason"] = self.status.value, self.reason.value
        return data


def versions() -> dict:
    from importlib import metadata

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(), **{name: version(name) for name in VERSIONED}}


@dataclass
class Run:
    """One grading run: its results in run order, the seed, and whether hidden checks ran."""

    results: list[Result] = field(default_factory=list)
    seed: int | None = None
    hidden_run: bool = False
    graded: str = "katas"  # the folder graded, relative to the course root
    interrupted: bool = False

    def progress(self) -> "OrderedDict[str, tuple[str, OrderedDict[str, Status]]]":
        """Per lab: its title and, per function in order, its status (the worst of its items)."""
        labs: OrderedDict[str, tuple[str, OrderedDict[str, Status]]] = OrderedDict()
        for r in self.results:
            functions = labs.setdefault(r.lab, (r.title, OrderedDict()))[1]
            previous = functions.get(r.function, Status.SKIPPED)
            functions[r.function] = max(previous, r.status, key=RANK.__getitem__)
        return labs

    def by_function(self) -> "OrderedDict[tuple[str, str, str], list[Result]]":
        """(lab, title, function) -> its results, in run order."""
        grouped: OrderedDict[tuple[str, str, str], list[Result]] = OrderedDict()
        for r in self.results:
            grouped.setdefault((r.lab, r.title, r.function), []).append(r)
        return grouped

    # ---- our own report ----------------------------------------------------------------------------------
    def kata_json(self, versions_: dict | None = None) -> dict:
        return {
            "graded": self.graded,
            "seed": self.seed,
            "hidden_run": self.hidden_run,
            "interrupted": self.interrupted,
            "versions": versions_ if versions_ is not None else versions(),
            "labs": [{"lab": lab, "title": title,
                      "functions": [{"name": f, "status": s.value} for f, s in functions.items()]}
                     for lab, (title, functions) in self.progress().items()],
            "results": [r.to_dict() for r in self.results],
        }

    @classmethod
    def from_kata_json(cls, data: dict) -> "Run":
        return cls([Result.from_dict(r) for r in data["results"]], data.get("seed"),
                   bool(data.get("hidden_run")), data.get("graded", "katas"), bool(data.get("interrupted")))

    # ---- Gradescope --------------------------------------------------------------------------------------
    def gradescope(self, versions_: dict | None = None) -> dict:
        """Gradescope's results.json as a dict."""
        tests = []
        for (lab, title, function), results in self.by_function().items():
            points = results[0].points
            visible = [r for r in results if not r.hidden]
            hidden = [r for r in results if r.hidden]
            share = points / 2 if self.hidden_run and hidden else points
            tests.append(_gradescope_test(f"{title} · {function}", f"{lab[:2]}.{len(tests) + 1}", visible, share,
                                          "visible"))
            if self.hidden_run and hidden:
                tests.append(_gradescope_test(f"{title} · {function} (hidden checks)", f"{lab[:2]}.{len(tests) + 1}",
                                              hidden, points - share, "after_published"))
        v = versions_ if versions_ is not None else versions()
        output = (f"Graded live against diffusers {v.get('diffusers')} and torch {v.get('torch')} with seed "
                  f"{self.seed}" + ("; hidden checks included." if self.hidden_run else "."))
        if self.interrupted:
            output += " The grading run was interrupted: functions it did not reach score 0."
        return {
            "score": sum(t["score"] for t in tests),
            "max_score": sum(t["max_score"] for t in tests),
            "execution_time": round(sum(r.duration for r in self.results), 2),
            "output": output,
            "visibility": "visible",
            "stdout_visibility": "hidden",
            "tests": tests,
            "extra_data": {"seed": self.seed, "versions": v},
        }


def _gradescope_test(name: str, number: str, results: list[Result], points: float, visibility: str) -> dict:
    graded = [r for r in results if r.status != Status.SKIPPED]
    passed = bool(graded) and all(r.status == Status.PASSED for r in graded)
    lines = []
    for r in results:
        lines.append(f"{r.status.value.upper():<11} {r.check}")
        if r.status not in (Status.PASSED, Status.SKIPPED) and r.message:
            lines.append(r.message)
    return {"name": name, "number": number, "score": points if passed else 0.0, "max_score": points,
            "status": "passed" if passed else "failed", "output": "\n".join(lines),
            "visibility": visibility}


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False), encoding="utf-8")


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
