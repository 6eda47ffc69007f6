"""A crash about sizes, on a case after others passed, is named by the one listed mistake that changes the output's
size there and is right on every case before it (a scale factor hard-coded to 8: right on x8 VAEs, and on the first
x4 one the learner's own buffers, sized for 8, cannot take the tiles). Nothing is named where no case passed
before, where the crash is not about sizes, or where two listed mistakes fit alike."""
import textwrap

import pytest

GRADER = '''
import torch

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import Tol

TOL = Tol(1e-6, 0.0, "toy tolerance for tests")

repeat = Kata("repeat", hints=("x.repeat(k)",))


@repeat.check("vs x.repeat(k)", cases=[dict(k=2), dict(k=2), dict(k=3)], tol=TOL)
def _(case, g):
    x = torch.randn(4, generator=g)
    return Scenario(inputs=dict(x=x, k=case["k"]), expected=x.repeat(case["k"]))


@repeat.trap("k hard-coded to 2", hint="Repeat k times, whatever k is.")
def _(x, k):
    return x.repeat(2)


@repeat.trap("repeated element by element", hint="x.repeat(k) repeats the whole vector: 1 2 1 2, not 1 1 2 2.")
def _(x, k):
    return x.repeat_interleave(k)
'''

SECOND_SIZE_TRAP = '''

@repeat.trap("one copy too few beyond two", hint="Repeat k times.")
def _(x, k):
    return x.repeat(min(k, 2))
'''


class Lab:
    def __init__(self, pytester: pytest.Pytester):
        self.pytester = pytester
        pytester.makeini("[pytest]\nkata_graders_dir = graders\n")
        (pytester.path / "graders").mkdir()
        (pytester.path / "katas").mkdir()
        self.grader(GRADER)

    def grader(self, text: str) -> None:
        (self.pytester.path / "graders" / "01_toy.py").write_text(text)

    def kata(self, body: str) -> None:
        body = textwrap.indent(textwrap.dedent(body).strip(), "    ")
        (self.pytester.path / "katas" / "01_toy.py").write_text(
            f'"""Lab 01 · Toy lab"""\nimport torch\n\n\ndef repeat(x, k):\n{body}\n')

    def run(self):
        return self.pytester.runpytest("katas")


@pytest.fixture
def lab(pytester: pytest.Pytester) -> Lab:
    return Lab(pytester)


# the learner's buffer sized for two copies: right for k = 2, a size error for k = 3
SIZED_FOR_TWO = """
out = torch.empty(2 * len(x))
out[:len(x) * k] = x.repeat(k)
return out
"""


def test_a_crash_about_sizes_after_passing_cases_is_named_by_the_one_mistake_that_first_shows_there(lab):
    lab.kata(SIZED_FOR_TWO)
    result = lab.run()
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "case 3/3" in out and "your function raised RuntimeError" in out
    assert "trap: k hard-coded to 2 (your function was right on the 2 case(s) before this one" in out


def test_a_crash_on_the_first_case_names_no_mistake(lab):
    lab.kata("raise RuntimeError('the size of tensor a (4) must match the size of tensor b (8)')")
    result = lab.run()
    result.assert_outcomes(failed=1)
    assert "case 1/3" in result.stdout.str() and "trap:" not in result.stdout.str()


def test_a_crash_that_is_not_about_sizes_names_no_mistake(lab):
    lab.kata("""
    if k != 2:
        raise ValueError("only pairs")
    return x.repeat(k)
    """)
    result = lab.run()
    result.assert_outcomes(failed=1)
    assert "case 3/3" in result.stdout.str() and "trap:" not in result.stdout.str()


def test_a_crash_that_two_listed_mistakes_fit_alike_names_neither(lab):
    lab.grader(GRADER + SECOND_SIZE_TRAP)
    lab.kata(SIZED_FOR_TWO)
    result = lab.run()
    result.assert_outcomes(failed=1)
    assert "case 3/3" in result.stdout.str() and "trap:" not in result.stdout.str()
