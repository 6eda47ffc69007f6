"""A check's next case is built while the runner computes the current one (the grader's references and the
learner's code on two cores, not one after the other), and grading reads as if the cases were built one after the
other: each scenario's inputs as they were sent (a later build may configure a model the cases share), a later
case's build error in its turn, and no building ahead where the call's remote models run in the grader."""
import textwrap

import pytest

GRADER = '''
from pathlib import Path

import torch

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import Tol

TOL = Tol(1e-6, 0.0, "toy tolerance for tests")
ORDER = Path(__file__).with_name("order.txt")


def note(line):
    with ORDER.open("a") as f:
        f.write(line + "\\n")


class Scale(torch.nn.Module):
    """A model the cases share, configured for each (as lab 11 sets its VAE's tiling per case)."""

    def __init__(self):
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


class RemoteScale(Scale):
    """The same, run in the grader's process: the runner calls it through the grader."""

    kata_remote = True

    def remote_view(self):
        return dict(label="a remote scale")


SHARED = Scale()

scale = Kata("scale", hints=("x times the model's factor",))


@scale.check("vs the shared model", cases=[dict(factor=2.0), dict(factor=3.0), dict(factor=5.0)], tol=TOL)
def _(case, g):
    SHARED.factor = case["factor"]
    note(f"build {case['factor']:g}")
    x = torch.randn(4, generator=g)
    return Scenario(inputs=dict(model=SHARED, x=x), expected=x * case["factor"],
                    verify=lambda out, f=case["factor"]: note(f"judge {f:g}"))


@scale.trap("the factor added, not multiplied", hint="A scale multiplies.")
def _(model, x):
    return x + model.factor


remote = Kata("remote", hints=("call the model",))


@remote.check("through a remote model", cases=[dict(factor=2.0), dict(factor=3.0)], tol=TOL)
def _(case, g):
    note(f"build remote {case['factor']:g}")
    model = RemoteScale()
    model.factor = case["factor"]
    x = torch.randn(4, generator=g)
    return Scenario(inputs=dict(model=model, x=x), expected=x * case["factor"],
                    verify=lambda out, f=case["factor"]: note(f"judge remote {f:g}"))


broken = Kata("broken", hints=("x times the model's factor",))


@broken.check("a later case that cannot be built", cases=[dict(n=1), dict(n=2)], tol=TOL)
def _(case, g):
    if case["n"] == 2:
        raise RuntimeError("case 2 cannot be built")
    x = torch.randn(4, generator=g)
    return Scenario(inputs=dict(model=Scale(), x=x), expected=x.clone())
'''


# When the grader reads the runner's answer to opening the kata file (written to the same order file).
CONFTEST = '''
from pathlib import Path

from diffusion_katas.engine import runner

_read = runner.Runner.open_reply.fget


def _noted(self):
    if self._opened is None:
        with (Path(__file__).parent / "graders" / "order.txt").open("a") as f:
            f.write("opened\\n")
    return _read(self)


runner.Runner.open_reply = property(_noted)
'''


class Lab:
    def __init__(self, pytester: pytest.Pytester):
        self.pytester = pytester
        pytester.makeini("[pytest]\nkata_graders_dir = graders\n")
        pytester.makeconftest(CONFTEST)
        (pytester.path / "graders").mkdir()
        (pytester.path / "graders" / "01_toy.py").write_text(GRADER)
        (pytester.path / "katas").mkdir()

    def kata(self, top: str = "", **bodies: str) -> None:
        text = '"""Lab 01 · Toy lab"""\nimport torch\n\n' + top
        for name in ("scale", "remote", "broken"):
            body = textwrap.indent(textwrap.dedent(bodies.get(name, "return model(x)")).strip(), "    ")
            text += f"\ndef {name}(model, x):\n{body}\n\n"
        (self.pytester.path / "katas" / "01_toy.py").write_text(text)

    def run(self, *args: str):
        return self.pytester.runpytest("katas", *args)

    def order(self) -> list[str]:
        return (self.pytester.path / "graders" / "order.txt").read_text().splitlines()


@pytest.fixture
def lab(pytester: pytest.Pytester) -> Lab:
    return Lab(pytester)


def test_the_next_case_is_built_before_the_current_one_is_judged(lab):
    lab.kata()
    lab.run("-k", "scale").assert_outcomes(passed=1)
    assert [line for line in lab.order() if line != "opened"] == [
        "build 2", "build 3", "judge 2", "build 5", "judge 3", "judge 5"]


def test_the_first_case_is_built_while_the_runner_imports_the_kata_file(lab):
    lab.kata()
    lab.run("-k", "scale").assert_outcomes(passed=1)
    assert lab.order()[:3] == ["build 2", "opened", "build 3"]


def test_nothing_is_built_for_a_todo_stub_while_its_runner_imports_the_file(lab):
    lab.kata(scale='''"""Multiply."""\nraise NotImplementedError("TODO")''', top="x = 1\n")
    result = lab.run("-k", "scale")
    assert result.parseoutcomes().get("todo") == 1
    assert lab.order() == ["opened"]


def test_a_function_written_in_the_file_but_a_stub_when_imported_is_todo_though_its_first_case_was_built(lab):
    lab.kata(top="def _todo(model, x):\n    raise NotImplementedError\n\n",
             scale="return model(x)\n")
    path = lab.pytester.path / "katas" / "01_toy.py"
    path.write_text(path.read_text() + "\nscale = _todo\n")
    result = lab.run("-k", "scale")
    assert result.parseoutcomes().get("todo") == 1
    assert lab.order() == ["build 2", "opened"]


def test_a_kata_file_that_fails_to_import_says_so_though_the_first_case_was_built_meanwhile(lab):
    lab.kata(top="raise ValueError('broken at import')\n")
    result = lab.run("-k", "scale")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "broken at import" in out and "case 1/3" not in out
    assert lab.order() == ["build 2", "opened"]


def test_nothing_is_built_ahead_of_a_call_whose_remote_model_runs_in_the_grader(lab):
    lab.kata()
    lab.run("-k", "remote").assert_outcomes(passed=1)
    assert [line for line in lab.order() if line != "opened"] == [
        "build remote 2", "judge remote 2", "build remote 3", "judge remote 3"]


def test_a_trap_runs_on_the_inputs_as_sent_though_the_next_build_configured_the_shared_model_since(lab):
    lab.kata(scale="return x + model.factor")
    result = lab.run("-k", "scale")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*case 1/3*", "*trap: the factor added, not multiplied*"])


def test_a_later_cases_build_error_comes_in_its_turn_after_the_verdict_on_the_case_before(lab):
    lab.kata(broken="return x * 2")
    result = lab.run("-k", "broken")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*case 1/2*", "*values differ*"])
    assert "case 2 cannot be built" not in result.stdout.str()
    lab.kata(broken="return x.clone()")
    result = lab.run("-k", "broken")
    assert "case 2 cannot be built" in result.stdout.str()
    assert result.ret != 0
