"""Which trap a failure names: the one whose output is nearest the learner's, or of which it is a near variant,
where the check's other cases agree (none where they contradict it, or where two traps explain every case alike);
none on an output with no finite number in it (every broken trap would match it, so naming one would be a guess),
and none after "fix X first"."""

EXTRA_TRAPS = '''

@double.trap("added 3", hint="hint for 3")
def _(x):
    return x * 2 + 3


@double.trap("added 3.4", hint="hint for 3.4")
def _(x):
    return x * 2 + 3.4


@double.trap("took the square root of a negative number", hint="hint for the root")
def _(x):
    return torch.sqrt(-(x.abs() + 1))
'''


def _loose_grader(toy) -> None:
    grader = toy.pytester.path / "graders" / "01_toy.py"
    text = grader.read_text().replace('Tol(1e-6, 0.0, "toy tolerance for tests")', 'Tol(0.5, 0.0, "a loose toy tolerance")')
    grader.write_text(text + EXTRA_TRAPS)


def test_where_several_traps_match_the_one_nearest_the_learners_output_is_named(toy):
    _loose_grader(toy)
    toy.kata(double="return x * 2 + 3.35")  # within 0.5 of both "added 3" (declared first) and "added 3.4"
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*trap: added 3.4*", "*hint for 3.4*"])
    assert "trap: added 3\n" not in result.stdout.str()


def test_the_trap_the_output_equals_is_named_over_one_it_is_merely_within_tolerance_of(toy):
    _loose_grader(toy)
    toy.kata(double="return x * 2 + 3")
    toy.run("katas").stdout.fnmatch_lines(["*trap: added 3*", "*hint for 3*"])


def test_an_output_with_no_finite_value_names_no_trap_even_where_a_trap_is_as_broken(toy):
    _loose_grader(toy)
    toy.kata(double="return torch.full_like(x, float('nan'))")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*non-finite value(s)*"])
    assert "trap:" not in result.stdout.str()
    toy.kata(double="return torch.sqrt(-(x.abs() + 1)) + 0 * x")  # the root trap's own output: all NaN too
    assert "trap:" not in toy.run("katas").stdout.str()


def test_a_trap_declared_nonfinite_is_named_on_an_output_with_no_finite_value(toy):
    _loose_grader(toy)
    grader = toy.pytester.path / "graders" / "01_toy.py"
    grader.write_text(grader.read_text().replace(
        '@double.trap("took the square root of a negative number", hint="hint for the root")',
        '@double.trap("took the square root of a negative number", hint="hint for the root", nonfinite=True)'))
    toy.kata(double="return torch.sqrt(-(x.abs() + 1))")
    toy.run("katas").stdout.fnmatch_lines(["*trap: took the square root of a negative number*"])


CRASH_TRAP = '''

@double.trap("indexed past the end", hint="hint for the index")
def _(x):
    return x[x.shape[0] + 3] * 2
'''


def test_a_crash_is_named_by_the_trap_that_raises_the_same_error_on_the_same_inputs(toy):
    grader = toy.pytester.path / "graders" / "01_toy.py"
    grader.write_text(grader.read_text() + CRASH_TRAP)
    toy.kata(double="return x[x.shape[0] + 3] * 2")  # the trap's own mistake: the same IndexError
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*your function raised IndexError*",
                                 "*trap: indexed past the end (it raises the same error on these inputs)*",
                                 "*hint for the index*"])
    toy.kata(double="return x[x.shape[0] + 4] * 2")  # another index: another message, no name
    assert "trap: indexed past the end" not in toy.run("katas").stdout.str()


# ---- naming beyond an exact match, and only where the other cases agree ------------------------------------
def _grader_with(toy, extra: str, before_check: str = "") -> None:
    grader = toy.pytester.path / "graders" / "01_toy.py"
    text = grader.read_text()
    if before_check:  # a check declared (so graded) before double's own
        text = text.replace('@double.check("vs toyref.double"', before_check + '\n\n@double.check("vs toyref.double"')
    grader.write_text(text + extra)


def test_a_near_variant_of_a_trap_is_named_and_said_to_be_near(toy):
    toy.kata(double="return x + 2 + 1e-3 * x")  # "added 2", computed a little differently: far beyond 1e-6
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*trap: added 2 instead of multiplying by 2*",
                                 "*near variant of this mistake's*"])


def test_an_output_as_far_from_a_trap_as_from_the_answer_names_no_trap(toy):
    toy.kata(double="return x * 3 + 1")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*output values differ*"])
    assert "trap:" not in result.stdout.str()


TIMES_N = '''

@double.trap("multiplied by the length", hint="hint for the length")
def _(x):
    return x * x.shape[0]
'''


def test_a_trap_that_matches_one_case_by_coincidence_and_the_others_not_is_not_named(toy):
    _grader_with(toy, TIMES_N)
    toy.kata(double="return x * 3")  # the trap's output on the n = 3 case, and neither on n = 5
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*case 1/2 (n=3)*", "*output values differ*"])
    assert "trap:" not in result.stdout.str()


def test_a_mistake_in_one_branch_is_named_and_the_case_where_the_learner_is_right_is_shown(toy):
    _grader_with(toy, TIMES_N)
    toy.kata(double="return x * x.shape[0] if x.shape[0] == 3 else x * 2")
    toy.run("katas").stdout.fnmatch_lines(["*trap: multiplied by the length*",
                                           "*it explains this case; on check 'vs toyref.double' · case 2/2 (n=5)*"
                                           "your output is right, where this mistake would show*"])


TWIN = '''

@double.trap("plus two, written the other way round", hint="hint for the twin")
def _(x):
    return 2 + x
'''


def test_two_traps_with_the_same_output_on_every_case_tried_name_neither(toy):
    _grader_with(toy, TWIN)
    toy.kata(double="return x + 2")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*output values differ*"])
    assert "trap:" not in result.stdout.str()


SMALL_CHECK = '''@double.check("short inputs", cases=[dict(n=2)], tol=TOL)
def _(case, g):
    x = torch.randn(case["n"], generator=g)
    return Scenario(inputs=dict(x=x), expected=toyref.double(x))
'''
LONG_ONLY = '''

@double.trap("added 2, but only to long inputs", hint="hint for long inputs")
def _(x):
    return x + 2 if x.shape[0] > 2 else x * 2
'''


def test_traps_alike_on_the_failing_check_are_told_apart_by_a_check_the_learner_passed(toy):
    _grader_with(toy, LONG_ONLY, before_check=SMALL_CHECK)
    toy.kata(double="return x + 2 if x.shape[0] > 2 else x * 2")  # passes 'short inputs', fails the other
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*trap: added 2, but only to long inputs*"])
    assert "trap: added 2 instead" not in result.stdout.str()


COINCIDENT_NORMALIZE = '''

@normalize.trap("the norm of x + 2", hint="hint for normalize")
def _(x):
    return (x + 2) / (x + 2).norm()
'''


def test_no_trap_is_named_after_fix_the_function_it_calls_first(toy):
    _grader_with(toy, COINCIDENT_NORMALIZE)
    toy.kata(double="return x + 2", normalize="return double(x) / double(x).norm()")
    result = toy.run("katas")
    text = result.stdout.str()
    result.stdout.fnmatch_lines(["*fix `double` first*"])
    assert "trap: the norm of x + 2" not in text  # it matches, but the output is double's mistake
