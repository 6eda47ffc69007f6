"""A failure that comes from another kata function the learner's code calls says so first."""


def test_a_function_failing_because_it_calls_a_wrong_sibling_is_told_to_fix_that_sibling_first(toy):
    toy.kata(double="return x * 3", stay_put="return double(x) / 2")
    result = toy.run("katas", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert "fix `double` first: `stay_put` calls `double`, which already fail(s) its own checks above" in out
    block = out[out.index("stay_put · check"):] if "stay_put · check" in out else out
    assert "fix `double` first" not in block.split("\n", 1)[0]  # the note comes before the failure itself


def test_a_function_that_is_wrong_on_its_own_gets_no_dependency_note(toy):
    toy.kata(double="return x * 3", stay_put="return x + 1")
    result = toy.run("katas", "-p", "no:cacheprovider")
    assert "first: `stay_put` calls" not in result.stdout.str()


def test_a_correct_sibling_is_never_blamed(toy):
    toy.kata(double="return x * 2", stay_put="return double(x) / 2 + 1")
    result = toy.run("katas", "-p", "no:cacheprovider")
    assert "fix `double` first" not in result.stdout.str()
