"""A failure that comes from another kata function the learner's code calls says so first."""
import shutil


def test_a_function_failing_because_it_calls_a_wrong_sibling_is_told_to_fix_that_sibling_first(toy):
    toy.kata(double="return x * 3", stay_put="return double(x) / 2")
    result = toy.run("katas", "-p", "no:cacheprovider")
    out = result.stdout.str()
    assert "fix `double` first: `stay_put` calls `double`, which already fail(s) its own checks (above" in out
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


def test_a_function_calling_an_earlier_labs_function_that_failed_when_last_graded_is_told_to_fix_that_first(toy):
    root = toy.pytester.path
    shutil.copy(root / "graders" / "01_toy.py", root / "graders" / "02_toy.py")
    shutil.copy(root / "solutions" / "01_toy.py", root / "solutions" / "02_toy.py")
    toy.kata(double="return x * 3")
    (root / "katas" / "02_toy.py").write_text(
        '"""Lab 02 · Toy lab, built on lab 01"""\nimport importlib.util\nfrom pathlib import Path\n\n'
        'spec = importlib.util.spec_from_file_location("_earlier_01", Path(__file__).with_name("01_toy.py"))\n'
        'first = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(first)\n\n\n'
        'def double(x):\n    return first.double(x)\n\n\n'
        'def normalize(x):\n    raise NotImplementedError\n\n\n'
        'def stay_put(x):\n    raise NotImplementedError\n')
    toy.run("katas/01_toy.py", "-p", "no:cacheprovider")  # lab 01 graded: its double fails (the record says so)
    out = toy.run("katas/02_toy.py", "-p", "no:cacheprovider").stdout.str()
    assert "fix `01_toy.py::double` first: `double` calls `01_toy.py::double`" in out
    toy.kata(double="return x * 4")  # lab 01 changed since it was graded: not known to fail (not graded since)
    result = toy.run("katas/02_toy.py", "-p", "no:cacheprovider")
    assert result.ret != 0 and "first: `double` calls" not in result.stdout.str()
