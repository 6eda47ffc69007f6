"""The instructor's hidden seed and hidden cases: checked before anyone is graded, handed over on a pipe.

A hidden-case file maps "lab::function::check" to a list of cases, each a dict like the check's own
cases. Before the first submission is graded every key must name a check of a selected lab and every case
must build: the grader's own `build(case, generator)` runs on it here, in the instructor's process, so a
typo is the instructor's error, not a class of zeros.

Neither the seed nor the cases go on a command line, into an environment or into a file a submission can
read: each grading child reads them from an inherited pipe (`--kata-secret-fd`) and closes it before any
runner starts (the runners are forked later, from a parent that never had it).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_katas.commands.instructor.catalog import Catalog, InstructorError
from diffusion_katas.core.course import Course


@dataclass
class Hidden:
    """What the hidden checks draw from; empty when the instructor gave neither."""

    seed: str | None = None  # the instructor's secret (any text)
    cases: dict = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.seed is not None or bool(self.cases)

    def secret(self) -> bytes | None:
        """The bytes a child reads from --kata-secret-fd (None: no hidden checks)."""
        if not self:
            return None
        return json.dumps({"hidden_seed": self.seed, "hidden_cases": self.cases}).encode("utf-8")

    @classmethod
    def from_secret(cls, data: bytes) -> "Hidden":
        raw = json.loads(data.decode("utf-8"))
        seed = raw.get("hidden_seed")
        return cls(None if seed is None else str(seed), raw.get("hidden_cases") or {})


def read_cases(path: str | Path) -> dict:
    """The hidden-case file as a dict, or an InstructorError naming what is wrong with it."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise InstructorError(f"--hidden-cases {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise InstructorError(f"--hidden-cases {path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values()):
        raise InstructorError(f'--hidden-cases {path}: expected {{"lab::function::check": [case, ...]}}')
    return data


def case_problems(course: Course, catalog: Catalog, cases: dict) -> list[str]:
    """Every problem of a hidden-case table: unknown keys, cases that are not dicts, cases whose keys the
    check's own cases never use, and cases the grader cannot build."""
    import warnings

    import torch

    problems = []
    katas = {lab: {k.name: k for k in course.graders_of(lab)} for lab in catalog.labs}
    for key, listed in cases.items():
        parts = key.split("::")
        if len(parts) != 3:
            problems.append(f'{key!r}: a key is "lab::function::check"')
            continue
        lab, function, name = parts
        if lab not in katas:
            problems.append(f"{key!r}: no lab {lab!r} among the selected labs ({', '.join(catalog.labs)})")
            continue
        kata = katas[lab].get(function)
        check = next((c for c in kata.checks if c.name == name), None) if kata else None
        if check is None:
            known = sorted(c.name for c in kata.checks) if kata else sorted(katas[lab])
            what = "check" if kata else "function"
            problems.append(f"{key!r}: no such {what}; {lab} has: {', '.join(known)}")
            continue
        allowed = {k for c in check.cases for k in c}
        for number, case in enumerate(listed, 1):
            where = f"{key!r} case {number}"
            if not isinstance(case, dict):
                problems.append(f"{where}: a case is a JSON object, got {json.dumps(case)}")
                continue
            extra = sorted(set(case) - allowed)
            if extra:
                problems.append(f"{where}: unknown parameter(s) {', '.join(extra)}; this check's cases use: "
                                f"{', '.join(sorted(allowed)) or 'none'}")
                continue
            try:
                torch.manual_seed(0)
                with warnings.catch_warnings():  # diffusers' deprecation notes are not the instructor's
                    warnings.simplefilter("ignore")
                    check.build(dict(case), torch.Generator().manual_seed(0))
            except Exception as exc:  # noqa: BLE001  (whatever the grader raises: the case is invalid)
                problems.append(f"{where} {json.dumps(case)}: the grader cannot build it "
                                f"({type(exc).__name__}: {exc})")
    return problems


def load_hidden(course: Course, catalog: Catalog, seed: str | None, cases_path: str | None) -> Hidden:
    """The hidden seed and cases for a grading run, checked: InstructorError before anyone is graded."""
    cases = read_cases(cases_path) if cases_path else {}
    problems = case_problems(course, catalog, cases) if cases else []
    if problems:
        raise InstructorError(f"--hidden-cases {cases_path}: {len(problems)} problem(s), stopped before grading anyone:\n  "
                              + "\n  ".join(problems))
    if cases and seed is None:
        seed = "0"  # as the plugin does: hidden cases run with hidden checks, drawn from seed 0
    return Hidden(seed, cases)


def feed(data: bytes | None) -> tuple[int | None, threading.Thread | None]:
    """A pipe whose read end a child inherits; a thread writes `data` and closes the write end (a table of
    cases may be larger than the pipe's buffer). (None, None) when there is nothing to hand over."""
    if data is None:
        return None, None
    read, write = os.pipe()

    def pour():
        try:
            with os.fdopen(write, "wb") as pipe:
                pipe.write(data)
        except OSError:  # the child died before reading: it has no report either
            pass

    writer = threading.Thread(target=pour, daemon=True)
    return read, writer
