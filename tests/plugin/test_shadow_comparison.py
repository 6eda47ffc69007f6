"""Tolerance from the reference's own error: comparison.mismatch with a float64 shadow (`exact`)."""
import torch

from diffusion_katas.core.tolerances import Tol
from diffusion_katas.engine.comparison import mismatch

TIGHT = Tol(1e-6, 0.0, "toy tolerance for tests")


def test_without_a_shadow_nothing_changes():
    problem = mismatch(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.001]), TIGHT)
    assert "values differ" in problem and "exact math" not in problem


def test_an_answer_closer_to_exact_math_than_diffusers_passes_however_far_from_diffusers():
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    diffusers = torch.tensor([1.0, 2.001])  # diffusers' rounding: 1e-3 off at index 1
    yours = torch.tensor([1.0, 2.0])  # 1e-3 from diffusers, 0 from exact
    assert mismatch(yours, diffusers, TIGHT) is not None
    assert mismatch(yours, diffusers, TIGHT, exact=exact) is None
    # up to 2× diffusers' own error (+ 2 ulps) from exact math passes too, on either side
    assert mismatch(torch.tensor([1.0, 1.998]), diffusers, TIGHT, exact=exact) is None


def test_a_wrong_answer_says_its_error_diffusers_error_and_the_allowance():
    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    diffusers = torch.tensor([1.0, 2.0 + 2**-10])  # 0.0009765625 from exact math
    problem = mismatch(torch.tensor([1.0, 2.0 + 2**-7]), diffusers, TIGHT, exact=exact)
    assert "values differ: worst element at index (1,)" in problem
    assert "exact    2 (the same math in float64 on the same inputs)" in problem
    assert "2. |yours − exact| 0.0078125, allowed" in problem
    assert "diffusers' own |diffusers − exact| (0.000976562)" in problem
    assert "an output passes when every element is within 1 or 2, or the whole output within 3" in problem
    assert "allowed 0.00195" in problem and "= 2 × diffusers' own |diffusers − exact|" in problem
    assert "+ 2 float32 ulps" in problem
    assert "tolerance: atol=1e-06, rtol=0: toy tolerance for tests" in problem
    assert "or, against exact float64 math: at most 2× diffusers' own error + 2 float32 ulps from it" in problem


def test_the_tolerance_against_diffusers_stays_a_floor():
    exact = torch.tensor([1.0], dtype=torch.float64)
    diffusers = torch.tensor([1.0])  # diffusers exact: the shadow allowance is 2 ulps
    assert mismatch(torch.tensor([1.0 + 5e-7]), diffusers, TIGHT, exact=exact) is None


def test_where_the_shadow_is_not_finite_only_the_tolerance_applies():
    exact = torch.tensor([float("inf")], dtype=torch.float64)
    problem = mismatch(torch.tensor([3.0]), torch.tensor([2.0]), TIGHT, exact=exact)
    assert problem is not None and "values differ" in problem


def test_nan_is_never_accepted_by_the_shadow():
    exact = torch.tensor([1.0, 1.0], dtype=torch.float64)
    problem = mismatch(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 1.5]), TIGHT, exact=exact)
    assert problem is not None


def test_a_python_float_answer_is_judged_against_its_shadow_too():
    assert mismatch(3.0, 3.001, TIGHT, exact=3.0) is None
    problem = mismatch(3.1, 3.001, TIGHT, exact=3.0)
    assert "|yours − exact| 0.1, allowed" in problem and "diffusers' own |diffusers − exact| (0.001)" in problem


def test_containers_carry_their_shadows_item_by_item():
    exact = (torch.tensor([2.0], dtype=torch.float64), 1.0)
    assert mismatch((torch.tensor([2.0]), 1.0), (torch.tensor([2.001]), 1.0), TIGHT, exact=exact) is None


def test_one_elements_rounding_luck_never_fails_a_correct_answer():
    # diffusers is exact at element 0 by luck, and off by rounding elsewhere; a correct formula in another
    # order is off by rounding at element 0 instead: element by element it fails, over the output it is as
    # close to exact math as diffusers
    torch.manual_seed(0)
    exact = torch.randn(256, dtype=torch.float64)
    rounding = torch.randn(256, dtype=torch.float64).abs() * 1e-3
    diffusers = (exact + rounding).float()
    diffusers[0] = exact[0].float()
    yours = (exact - rounding.flip(0)).float()
    assert mismatch(yours, diffusers, TIGHT, exact=exact) is None


def test_a_mistake_beyond_diffusers_largest_error_fails_even_at_one_element():
    exact = torch.linspace(-1, 1, 256, dtype=torch.float64)
    diffusers = (exact + 1e-3).float()
    yours = exact.clone().float()
    yours[17] += 5e-3  # 2× diffusers' largest error over the output is rounding's tail; 5× at one element is not
    problem = mismatch(yours, diffusers, TIGHT, exact=exact)
    assert problem is not None and "3. over the output: 1 element(s) beyond 3 × diffusers' largest" in problem
    assert "worst element at index (17,)" in problem


def test_an_error_of_rounding_size_above_diffusers_is_named_a_precision_problem():
    torch.manual_seed(1)
    exact = torch.randn(256, dtype=torch.float64)
    diffusers = (exact + torch.randn(256, dtype=torch.float64) * 1e-4).float()
    yours = (exact + torch.randn(256, dtype=torch.float64) * 5e-4).float()  # 5× diffusers' rounding
    problem = mismatch(yours, diffusers, TIGHT, exact=exact)
    assert "a precision problem, not the formula" in problem
    wrong = (exact * 1.1).float()  # a formula off by 10%
    assert "a precision problem" not in mismatch(wrong, diffusers, TIGHT, exact=exact)


# ---- a deferred shadow (Scenario.exact as a function): computed only where the tolerance alone fails ----------------
def _deferred(value):
    from diffusion_katas.core.spec import Scenario

    calls = []

    def compute():
        calls.append(1)
        return value

    return Scenario(inputs={}, expected=torch.tensor([1.0, 2.001]), exact=compute), calls


def test_a_deferred_shadow_is_not_computed_for_an_output_within_the_tolerance():
    from diffusion_katas.engine.comparison import scenario_mismatch

    scenario, calls = _deferred(torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert scenario_mismatch(torch.tensor([1.0, 2.001]), scenario, TIGHT) is None
    assert calls == []


def test_a_deferred_shadow_judges_as_a_given_one_and_is_computed_once():
    from diffusion_katas.engine.comparison import scenario_mismatch

    exact = torch.tensor([1.0, 2.0], dtype=torch.float64)
    scenario, calls = _deferred(exact)
    closer = torch.tensor([1.0, 2.0])  # 1e-3 from diffusers, 0 from exact math: the shadow lets it through
    wrong = torch.tensor([1.0, 2.0 + 2**-7])
    assert scenario_mismatch(closer, scenario, TIGHT) is None
    assert scenario_mismatch(wrong, scenario, TIGHT) == mismatch(wrong, scenario.expected, TIGHT, exact=exact)
    assert calls == [1]
