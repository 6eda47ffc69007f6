"""A Python-number answer is graded as that kind of number: no tensor stands in for a float, no 8.0 for 8."""
import torch

from diffusion_katas.core.tolerances import Tol
from diffusion_katas.engine.comparison import mismatch

TOL = Tol(1e-6, 1e-6, "test")


def test_an_integer_answer_must_be_an_integer():
    assert mismatch(8, 8, TOL) is None
    assert "should be the integer 8, got 8.0" in mismatch(8.0, 8, TOL)
    assert "should be 8, got 9" in mismatch(9, 8, TOL)


def test_a_one_element_tensor_is_not_a_python_float():
    problem = mismatch(torch.tensor(0.5), 0.5, TOL)
    assert "should be a Python float like 0.5" in problem and ".item()" in problem
    assert mismatch(0.5, 0.5, TOL) is None
    assert mismatch(1, 1.0, TOL) is None  # an int where a float is expected is the same number


def test_a_one_number_tensor_where_a_python_number_is_documented_is_named_as_a_trap():
    problem = mismatch(torch.tensor(0.5), 0.5, TOL)
    assert "trap: a one-number tensor returned where a Python float is documented" in problem
    assert "trap:" not in mismatch(torch.tensor([0.5, 1.0]), 0.5, TOL)  # not one number: no such mistake to name


def test_a_bool_is_not_a_number():
    assert "should be a Python int" in mismatch(True, 1, TOL)
