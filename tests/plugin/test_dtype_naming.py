"""A tuple output whose tensor comes back in a wider dtype with the right values is named as such, as a single tensor
output is: computed wider and never cast back (lab 15's edm_model_inputs returns (c_in·x, c_noise))."""
import textwrap

import pytest

GRADER = '''
import torch

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import Tol

TOL = Tol(1e-3, 0.0, "toy tolerance for tests")

pair = Kata("pair", hints=("(x * 2, x + 1) in x's dtype",))


@pair.check("vs (x * 2, x + 1)", cases=[dict(n=3)], tol=TOL)
def _(case, g):
    x = torch.randn(case["n"], generator=g).half()
    return Scenario(inputs=dict(x=x), expected=(x * 2, x + 1))
'''


@pytest.fixture
def lab(pytester: pytest.Pytester):
    pytester.makeini("[pytest]\nkata_graders_dir = graders\n")
    (pytester.path / "graders").mkdir()
    (pytester.path / "graders" / "01_toy.py").write_text(GRADER)
    (pytester.path / "katas").mkdir()

    def grade(body: str):
        body = textwrap.indent(textwrap.dedent(body).strip(), "    ")
        (pytester.path / "katas" / "01_toy.py").write_text(
            f'"""Lab 01 · Toy lab"""\nimport torch\n\n\ndef pair(x):\n{body}\n')
        return pytester.runpytest("katas")

    return grade


def test_a_tuples_tensor_computed_wider_with_the_right_values_is_named_computed_wider(lab):
    result = lab("return x.float() * 2, x + 1")
    result.assert_outcomes(failed=1)
    assert "trap: output[0] computed in float32 and never cast back to float16" in result.stdout.str()


def test_a_tuples_tensor_in_a_wider_dtype_with_wrong_values_gets_no_dtype_name(lab):
    result = lab("return x.float() * 3, x + 1")
    result.assert_outcomes(failed=1)
    assert "trap:" not in result.stdout.str()


def test_a_tuple_right_but_for_a_wider_tensor_elsewhere_is_not_named_by_the_first_one(lab):
    result = lab("return x * 2, (x + 2).float()")
    result.assert_outcomes(failed=1)
    assert "trap:" not in result.stdout.str()
