"""Every lab's wrong-but-plausible implementations, in one table-driven test.

Each lab's test file declares MUTANTS: (function, wrong body, expectation). The expectation is the trap
the message must name (a string), or `Fails(reason, text)` for a mistake no trap describes: the reason
code the grader must give (results.Reason values: "wrong", "crash", ...) and text its message must hold.
A mutant that dies of its own typo then fails this test instead of counting as caught. A lab whose
mutants need only some of its items graded declares `mutant_args(function)`: extra pytest arguments.

A lab may also declare ALTERNATIVES: (function, right body written another way, why it is right). Each
must pass: a correct answer the grader fails (say, one closer to exact math than diffusers) is as much
a grading bug as a wrong one it passes.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from expect import Fails

HERE = Path(__file__).resolve().parent
LAB_TESTS = sorted(p.stem for p in HERE.glob("test_[0-9][0-9]_*.py"))


def table():
    rows = []
    for name in LAB_TESTS:
        module = importlib.import_module(name)
        lab = module.LAB
        extra = getattr(module, "mutant_args", lambda function: ())
        for i, (function, body, expect) in enumerate(getattr(module, "MUTANTS", [])):
            rows.append(pytest.param(lab, function, body, expect, tuple(extra(function)),
                                     id=f"{lab[:2]}-{function}-{i}"))
    return rows


def alternatives():
    rows = []
    for name in LAB_TESTS:
        module = importlib.import_module(name)
        extra = getattr(module, "mutant_args", lambda function: ())
        for i, (function, body, why) in enumerate(getattr(module, "ALTERNATIVES", [])):
            rows.append(pytest.param(module.LAB, function, body, why, tuple(extra(function)),
                                     id=f"{module.LAB[:2]}-{function}-alt{i}"))
    return rows


@pytest.mark.parametrize("lab, function, body, expect, extra", table())
def test_a_wrong_implementation_fails_as_its_table_declares(grade_mutant, lab, function, body, expect, extra):
    graded = grade_mutant(lab, function, body, *extra)
    assert graded.status == "failed", graded
    if isinstance(expect, Fails):
        assert expect.reason in graded.reasons, f"expected {expect}, got reasons {sorted(graded.reasons)}\n{graded}"
        assert expect.text in graded.text, graded.text
    else:
        assert isinstance(expect, str) and expect, f"a mutant must declare its trap or Fails(...), got {expect!r}"
        assert f"trap: {expect}" in graded.text, graded.text


def test_every_lab_declares_its_mutants():
    assert len(LAB_TESTS) >= 12
    assert all(getattr(importlib.import_module(name), "MUTANTS", None) for name in LAB_TESTS)


@pytest.mark.parametrize("lab, function, body, why, extra", alternatives())
def test_a_right_implementation_written_another_way_passes(grade_mutant, lab, function, body, why, extra):
    graded = grade_mutant(lab, function, body, *extra)
    assert graded.status == "passed", f"{why}\n{graded}"
