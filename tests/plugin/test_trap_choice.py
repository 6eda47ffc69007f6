"""Which trap a failure names: the one whose output is nearest the learner's, and none on an output with no
finite number in it (every broken trap would match it, so naming one would be a guess)."""

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


def test_the_first_declared_trap_is_named_where_two_are_equally_near(toy):
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
