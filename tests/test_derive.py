"""katas/ is derived from solutions/ by stripping solution markers, and a check proves they agree."""
import pytest

from diffusion_katas.core.derive import MarkerError, drift, strip_solutions
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_a_solution_block_becomes_its_todo_and_a_raise():
    text = "def f(x):\n    # BEGIN SOLUTION: double it\n    return 2 * x\n    # END SOLUTION\n"
    assert strip_solutions(text) == "def f(x):\n    # TODO: double it\n    raise NotImplementedError\n"


def test_everything_outside_the_markers_is_kept_as_it_is():
    text = '"""Doc."""\nimport torch\n\n\ndef f(x):\n    """f."""\n    # BEGIN SOLUTION\n    y = x\n    return y\n    # END SOLUTION\n'
    out = strip_solutions(text)
    assert out.startswith('"""Doc."""\nimport torch\n\n\ndef f(x):\n    """f."""\n    # TODO: ')
    assert "y = x" not in out


@pytest.mark.parametrize("text, problem", [
    ("# BEGIN SOLUTION\nx = 1\n", "never closed"),
    ("x = 1\n# END SOLUTION\n", "without BEGIN"),
    ("# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION\n", "inside the block"),
])
def test_unbalanced_markers_are_an_error_with_the_line(text, problem):
    with pytest.raises(MarkerError, match=problem):
        strip_solutions(text)


def test_the_repository_katas_agree_with_the_solutions():
    problems = drift(REPO / "solutions", REPO / "katas")
    assert not problems, "run `python -m diffusion_katas.core.derive`: " + "; ".join(problems)


def test_a_kata_edited_by_hand_is_reported_as_drift(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "katas").mkdir()
    (tmp_path / "solutions" / "01_a.py").write_text("def f():\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n")
    (tmp_path / "katas" / "01_a.py").write_text("def f():\n    return 1\n")
    (tmp_path / "katas" / "02_b.py").write_text("")
    assert drift(tmp_path / "solutions", tmp_path / "katas") == [
        "katas/02_b.py has no solution",
        "katas/01_a.py differs from what solutions/01_a.py derives",
    ]


def test_every_solution_function_has_a_solution_block_and_every_kata_a_todo():
    for solution in sorted((REPO / "solutions").glob("[0-9][0-9]_*.py")):
        kata = (REPO / "katas" / solution.name).read_text(encoding="utf-8")
        assert "# TODO:" in kata and "raise NotImplementedError" in kata, solution.name
