"""Failure messages: structure first, then values with index, tolerance, seed; traps; hints; guards."""
import re

import pytest


def test_a_wrong_value_shows_worst_element_index_expected_yours_tolerance_and_reason(toy):
    toy.kata(double="y = x * 2\ny[1] += 0.5\nreturn y")
    result = toy.run("katas")
    result.stdout.fnmatch_lines([
        "double · check 'vs toyref.double' · case 1/2 (n=3)*",
        "*output values differ: worst element at index (1,)*",
        "*expected *",
        "*yours *",
        "*|diff|   0.5, allowed 1e-06*",
        "*1 of 3 elements (33.3%) are outside the tolerance*",
        "*tolerance: atol=1e-06, rtol=0: toy tolerance for tests*",
        '*reproduce: python -m pytest "katas/01_toy.py::double?vs toyref.double?" --kata-seed *',
    ])


@pytest.mark.parametrize("body, message", [
    ("return (x * 2).tolist()", "*output should be a torch.Tensor, got list*"),
    ("return (x * 2)[:-1]", "*output has shape (2,); expected (3,)*"),
    ("return (x * 2).double()", "*output has dtype torch.float64; expected torch.float32*"),
    ("return (x * 2).unsqueeze(0)", "*output has shape (1, 3); expected (3,) (same number of elements*"),
    ("return x * 2 / 0 * 0", "*non-finite value(s) (nan/inf) where the reference is finite*"),
])
def test_structure_is_checked_before_values_with_a_plain_message(toy, body, message):
    toy.kata(double=body)
    result = toy.run("katas")
    result.stdout.fnmatch_lines([message])
    assert "values differ" not in result.stdout.str()


def test_right_values_computed_wider_and_never_cast_back_are_named_so(toy):
    toy.kata(double="return x.double() * 2")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*output has dtype torch.float64; expected torch.float32*",
                                 "*trap: computed in float64 and never cast back to float32*"])


def test_right_values_left_in_half_precision_are_named_so(toy):
    toy.kata(double="return (x * 2).half()")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*trap: the result left in float16 where diffusers returns float32*"])


def test_wrong_values_in_the_wrong_dtype_get_no_dtype_trap(toy):
    toy.kata(double="return (x * 3).double()")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*output has dtype torch.float64; expected torch.float32*"])
    assert "trap:" not in result.stdout.str()


def test_right_values_at_other_indices_are_named_a_layout_mistake(toy):
    toy.kata(normalize="return (x / x.norm()).flip(0)")
    result = toy.run("katas", "-k", "normalize")
    result.stdout.fnmatch_lines(["*trap: the right values at the wrong indices (output: a layout mistake)*",
                                 "*output is the reference reversed along dimension 0*"])


@pytest.mark.parametrize("body, named", [
    ("return (x / x.norm()).unsqueeze(0)", "*trap: output: the right values with an extra size-1 axis 0*"),
    ("return (x / x.norm()).reshape(4, 1)", "*trap: output: the right values with an extra size-1 axis 1*"),
])
def test_right_values_with_a_size_one_axis_too_many_are_named_so(toy, body, named):
    toy.kata(normalize=body)
    result = toy.run("katas", "-k", "normalize")
    result.stdout.fnmatch_lines(["*output has shape*", named])


def test_other_values_in_the_right_shape_are_no_layout_mistake(toy):
    toy.kata(normalize="return (x / x.norm()).flip(0) * 1.5")
    result = toy.run("katas", "-k", "normalize")
    assert "values differ" in result.stdout.str()
    assert "trap:" not in result.stdout.str()


def test_a_function_that_keeps_state_between_calls_is_named_so_when_it_fails(toy):
    toy.kata(double="seen = globals().setdefault('seen', [])\nseen.append(1)\nreturn x * (2 if len(seen) == 1 else 3)")
    result = toy.run("katas", "-k", "double and not budget")
    result.stdout.fnmatch_lines(["*case 2/2*", "*trap: state kept between calls*"])


def test_a_function_that_keeps_a_cache_and_is_right_passes(toy):
    toy.kata(double="cache = globals().setdefault('cache', {})\ncache[x.shape] = x * 2\nreturn cache[x.shape]")
    result = toy.run("katas", "-k", "double and not budget")
    assert "trap:" not in result.stdout.str()
    result.assert_outcomes(passed=1)


def test_an_output_matching_a_declared_misconception_names_the_trap_and_its_hint(toy):
    toy.kata(double="return x + 2")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*trap: added 2 instead of multiplying by 2*",
                                 "*Doubling is x * 2, not x + 2.*"])


def test_a_wrong_output_that_matches_no_trap_names_none(toy):
    toy.kata(double="return x * 3")
    result = toy.run("katas")
    assert "trap:" not in result.stdout.str()


def test_the_same_seed_reproduces_the_same_inputs_and_another_seed_does_not(toy):
    toy.kata(double="return x * 3")

    def first_input(*args):
        out = toy.run("katas", *args).stdout.str()
        return re.search(r"x\[0\]=(-?[\d.]+)", out).group(1)

    assert first_input("--kata-seed", "11") == first_input("--kata-seed", "11")
    assert first_input("--kata-seed", "11") != first_input("--kata-seed", "12")


def test_the_header_prints_the_seed_to_reproduce_a_run(toy):
    result = toy.run("katas", "--kata-seed", "4242")
    result.stdout.fnmatch_lines(["katas: grading katas/ with seed 4242 (reproduce with --kata-seed 4242)"])


def test_changing_an_input_in_place_fails_with_a_message_saying_so(toy):
    toy.kata(stay_put="x.mul_(1.0)\nreturn x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*`stay_put` changed its input(s) x in place*", "*trap: the caller's x changed in place*"])
    result.assert_outcomes(failed=1)


def test_changing_an_input_in_place_fails_even_when_the_result_is_right(toy):
    toy.kata(double="x.mul_(2)\nreturn x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*`double` changed its input(s) x in place*"])


def test_calling_the_answer_key_fails_with_a_friendly_message(toy):
    toy.kata(double="return toyref.double(x)")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*`double` called toyref.double, which is the answer key*"])
    result.assert_outcomes(failed=1)
    assert result.parseoutcomes()["waiting"] == 1  # double's budget waits on its failing check


def test_the_answer_key_works_again_after_the_learner_call(toy, pytester):
    toy.kata(double="return x * 2")
    result = toy.run("katas")
    result.assert_outcomes(passed=2)  # the reference ran after the lock was lifted on every case


def test_hints_are_revealed_one_more_tier_per_repeated_failure(toy):
    toy.kata(double="return x * 3")
    first = toy.run("katas").stdout.str()
    assert "hint 1 (nudge): first nudge" in first and "hint 2 (" not in first
    second = toy.run("katas").stdout.str()
    assert "hint 2 (the math): the math: y = 2x" in second and "hint 3 (" not in second
    third = toy.run("katas").stdout.str()
    assert "hint 3 (near code): near code: return x * 2" in third


def test_a_hint_tier_once_shown_stays_shown_after_the_function_passes(toy):
    toy.kata(double="return x * 3")
    toy.run("katas")
    toy.run("katas")  # hint 2 shown
    toy.kata(double="return x * 2")
    toy.run("katas")
    toy.kata(double="return x * 3")
    out = toy.run("katas").stdout.str()  # failing again earns one more tier; none is taken back
    assert "hint 2 (the math)" in out and "hint 3 (near code)" in out


def test_the_tiers_a_failure_shows_are_remembered_for_kata_hint(toy):
    import json

    toy.kata(double="return x * 3")
    toy.run("katas")
    toy.run("katas")
    remembered = json.loads((toy.pytester.path / ".kata" / "hints.json").read_text(encoding="utf-8"))
    (key,) = [k for k in remembered if k.endswith("::double")]
    assert remembered[key]["shown"] == 2 and remembered[key]["failures"] == 2


def test_a_run_that_prints_no_failure_texts_uses_up_no_hint_tier(toy):
    toy.kata(double="return x * 3")
    toy.run("katas", "--tb=no")
    toy.run("katas", "--tb=no")
    out = toy.run("katas").stdout.str()  # the first failure text this learner sees: the first tier
    assert "hint 1 (nudge)" in out and "hint 2 (" not in out


def test_the_footer_hint_is_the_most_specific_tier_the_learner_has(toy):
    toy.kata(double="return x * 3")
    toy.run("katas")
    out = toy.run("katas").stdout.str()
    assert "  hint 2: the math: y = 2x" in out


def test_a_misspelt_kata_function_is_a_usage_error_naming_the_functions(toy):
    result = toy.run("katas", "--kata-function", "doubel")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kata-function doubel: no such kata function*their functions are: double*"])


def test_kata_hints_shows_the_asked_number_of_tiers_at_once(toy):
    toy.kata(double="return x * 3")
    out = toy.run("katas", "--kata-hints", "3").stdout.str()
    assert "hint 3 (near code)" in out


def test_numpy_outputs_are_compared_structure_first_then_by_value():
    import numpy as np

    from diffusion_katas.engine.comparison import mismatch
    from diffusion_katas.core.tolerances import Tol

    tol = Tol(0, 0, "exact")
    want = np.arange(12, dtype=np.uint8).reshape(3, 4)
    assert mismatch(want.copy(), want, tol) is None
    assert "should be a numpy.ndarray, got Tensor" in mismatch(__import__("torch").zeros(3, 4), want, tol)
    assert "has shape (4, 3); expected (3, 4)" in mismatch(want.T.copy(), want, tol)
    assert "has dtype int64; expected uint8" in mismatch(want.astype(np.int64), want, tol)
    wrong = want.copy()
    wrong[2, 1] = 99
    assert "worst element at index (2, 1)" in mismatch(wrong, want, tol)


def test_a_trap_that_draws_from_the_global_rng_sees_what_the_learner_saw(pytester):
    pytester.syspathinsert()
    pytester.makeini("[pytest]\nkata_graders_dir = graders\n")
    (pytester.path / "graders").mkdir()
    (pytester.path / "graders" / "01_noisy.py").write_text(
        "import torch\n"
        "from diffusion_katas.core.spec import Kata, Scenario\n"
        "from diffusion_katas.core.tolerances import Tol\n"
        "noisy = Kata('noisy', hints=('use the generator',))\n"
        "@noisy.check('draws from g', tol=Tol(0, 0, 'exact'))\n"
        "def _(case, g):\n"
        "    s = int(torch.randint(0, 2**31, (1,), generator=g))\n"
        "    return Scenario(inputs=dict(generator=torch.Generator().manual_seed(s)),\n"
        "                    expected=torch.randn(4, generator=torch.Generator().manual_seed(s)))\n"
        "@noisy.trap('the generator was not passed', hint='pass generator=generator')\n"
        "def _(generator):\n"
        "    return torch.randn(4)\n")
    (pytester.path / "katas").mkdir()
    (pytester.path / "katas" / "01_noisy.py").write_text(
        "import torch\n\ndef noisy(generator):\n    return torch.randn(4)  # the generator forgotten\n")
    result = pytester.runpytest("katas")
    result.stdout.fnmatch_lines(["*trap: the generator was not passed*"])
