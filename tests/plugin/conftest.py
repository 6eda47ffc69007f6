"""A toy kata project for testing the plugin itself, without diffusers: fast and self-contained.

Its 'reference library' is toyref.py (standing in for diffusers); its lab is 01_toy with three
kata functions: double (with a trap and an answer key), normalize, and stay_put.
"""
import textwrap

import pytest

TOYREF = '''
import torch

def double(x):
    return x * 2


def twice(x):  # a sibling: the same computation under another name (as diffusers' "Copied from" methods)
    return x * 2
'''

GRADER = '''
import torch

import toyref
from diffusion_katas.engine.meters import peak_bytes
from diffusion_katas.core.spec import Kata, Measurement, Scenario
from diffusion_katas.core.tolerances import Tol

TOL = Tol(1e-6, 0.0, "toy tolerance for tests")

double = Kata("double", hints=("first nudge", "the math: y = 2x", "near code: return x * 2"),
              answer_key=("toyref.double",))


@double.check("vs toyref.double", cases=[dict(n=3), dict(n=5)], tol=TOL)
def _(case, g):
    x = torch.randn(case["n"], generator=g)
    return Scenario(inputs=dict(x=x), expected=toyref.double(x), label=f"x[0]={x[0].item():.6f}")


@double.trap("added 2 instead of multiplying by 2", hint="Doubling is x * 2, not x + 2.")
def _(x):
    return x + 2


@double.budget("one output-sized allocation")
def _(learner, g):
    x = torch.randn(1000, generator=g)
    peak, _ = learner.measure(peak_bytes, x=x)
    return [Measurement("peak live tensor bytes", peak, x.nbytes, "bytes", "the output alone: 4000 bytes")]


normalize = Kata("normalize", hints=("divide by the norm",))


@normalize.check("unit norm", cases=[dict(n=4)], tol=TOL)
def _(case, g):
    x = torch.randn(case["n"], generator=g)
    return Scenario(inputs=dict(x=x), expected=x / x.norm())


stay_put = Kata("stay_put", hints=("return it unchanged",))


@stay_put.check("identity", tol=TOL)
def _(case, g):
    x = torch.randn(3, generator=g)
    return Scenario(inputs=dict(x=x), expected=x.clone())
'''

SOLUTION = '''"""Lab 01 · Toy lab

Concept:
    Doubling things.
"""
import torch


def double(x):
    # BEGIN SOLUTION: multiply by two
    return x * 2
    # END SOLUTION


def normalize(x):
    # BEGIN SOLUTION
    return x / x.norm()
    # END SOLUTION


def stay_put(x):
    # BEGIN SOLUTION: give it back
    return x
    # END SOLUTION
'''


class Toy:
    """Writes the toy project; `kata(**bodies)` writes katas/01_toy.py with the given function bodies."""

    def __init__(self, pytester: pytest.Pytester):
        self.pytester = pytester
        pytester.syspathinsert()
        pytester.makeini("[pytest]\nkata_graders_dir = graders\n")
        pytester.makepyfile(toyref=TOYREF)
        (pytester.path / "graders").mkdir()
        (pytester.path / "graders" / "01_toy.py").write_text(GRADER)
        (pytester.path / "solutions").mkdir()
        (pytester.path / "solutions" / "01_toy.py").write_text(SOLUTION)
        (pytester.path / "katas").mkdir()
        self.kata()

    def kata(self, **bodies: str) -> None:
        todo = "raise NotImplementedError"
        text = '"""Lab 01 · Toy lab"""\nimport time\nimport torch\nimport toyref\n\n'
        for name in ("double", "normalize", "stay_put"):
            body = textwrap.indent(textwrap.dedent(bodies.get(name, todo)).strip(), "    ")
            text += f"\ndef {name}(x):\n{body}\n\n"
        (self.pytester.path / "katas" / "01_toy.py").write_text(text)

    def run(self, *args: str):
        return self.pytester.runpytest(*args)


@pytest.fixture
def toy(pytester: pytest.Pytester) -> Toy:
    return Toy(pytester)
