"""Both sides of every branch: each condition a solution function tests on its own parameters (an `if`, a
`while`, a conditional expression whose names are the function's parameters) is true in some graded case and
false in another. A branch only one side of which is graded lets a wrong answer for the other side pass (a VAE
scale factor only ever 8, a post_quant_conv only ever present, a prediction type only ever ε).

The conditions are evaluated on the inputs the checks build, as the plugin builds them (the same seeding), with
the function's defaults for what a case leaves out; nothing of a learner's runs. A branch that cannot take both
sides is listed in ONE_SIDED with the reason (an entry for a branch that does take both sides fails too).
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from diffusion_katas.core.course import load_module

REPO = Path(__file__).resolve().parents[2]
LABS = sorted(p.stem for p in (REPO / "graders").glob("[0-9][0-9]_*.py"))
SEED = 1234
HELPERS = {"math", "torch", "len", "isinstance", "min", "max", "abs", "int", "float", "tuple", "list"}

# (lab, function, condition as ast.unparse writes it) -> why only one side is graded
ONE_SIDED: dict[tuple[str, str, str], str] = {
    ("07_pipeline_components", "prepare_latents", "isinstance(generator, list) and len(generator) != batch_size"):
        "the raising side: a learner function that raises is graded as a crash, so that rule is graded in "
        "input_error (lab 07), and prepare_latents' cases keep generator lists of the right length",
}


def conditions(function: ast.FunctionDef) -> list[ast.expr]:
    """The tests of the function's branches whose names are its parameters (and builtins, math, torch)."""
    params = {a.arg for a in function.args.args + function.args.kwonlyargs}
    found = []
    for node in ast.walk(function):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            if names & params and names <= params | HELPERS:
                found.append(node.test)
    return found


def defaults(function: ast.FunctionDef) -> dict:
    args = function.args.args
    out = {}
    for arg, value in zip(args[len(args) - len(function.args.defaults):], function.args.defaults):
        try:
            out[arg.arg] = ast.literal_eval(value)
        except ValueError:
            pass
    return out


def sides(condition: ast.expr, inputs: dict, fallback: dict) -> bool | None:
    env = {"math": math, "torch": torch, **fallback, **inputs}
    try:
        value = eval(compile(ast.Expression(condition), "<branch>", "eval"), env)  # our solution's code, our inputs
    except Exception:  # noqa: BLE001  (a condition that needs the function's locals: not judged here)
        return None
    if isinstance(value, torch.Tensor):
        return bool(value) if value.numel() == 1 else None
    return bool(value)


@pytest.mark.parametrize("lab", LABS)
def test_every_branch_a_solution_takes_on_its_parameters_is_graded_on_both_sides(graders_loaded, lab):
    tree = ast.parse((REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8"))
    grader = load_module(REPO / "graders" / f"{lab}.py", f"_branches_grader_{lab}")
    katas = {v.name: v for v in vars(grader).values() if type(v).__name__ == "Kata"}
    problems, exempt_used = [], set()
    for function in tree.body:
        if not isinstance(function, ast.FunctionDef) or function.name not in katas:
            continue
        tests = conditions(function)
        if not tests:
            continue
        seen = {ast.unparse(t): set() for t in tests}
        fallback = defaults(function)
        for check in katas[function.name].checks:
            if any(getattr(m, "name", "") == "cuda" for m in check.marks):
                continue
            torch.manual_seed(SEED ^ 0x5EED)
            g = torch.Generator().manual_seed(SEED)
            for case in check.cases:
                built = check.build(dict(case), g)
                for scenario in [built] if not isinstance(built, (list, tuple)) else built:
                    for t in tests:
                        side = sides(t, scenario.inputs, fallback)
                        if side is not None:
                            seen[ast.unparse(t)].add(side)
        for text, taken in seen.items():
            key = (lab, function.name, text)
            if key in ONE_SIDED:
                exempt_used.add(key)
                if len(taken) == 2:
                    problems.append(f"{function.name}: `{text}` takes both sides now: remove its ONE_SIDED entry")
            elif len(taken) < 2:
                problems.append(f"{function.name}: `{text}` is only ever {sorted(taken) or 'not evaluated'} in the "
                                "graded cases: add a case for the other side, or list it in ONE_SIDED with the reason")
    stale = {key for key in ONE_SIDED if key[0] == lab} - exempt_used
    problems += [f"ONE_SIDED names a branch the solution no longer has: {key}" for key in sorted(stale)]
    assert not problems, f"{lab}:\n" + "\n".join(problems)


def test_the_branch_reader_finds_a_condition_on_a_parameter_and_evaluates_both_sides():
    source = "def f(x, flag: bool = False):\n    if flag:\n        return x\n    return -x\n"
    (function,) = ast.parse(source).body
    (test,) = conditions(function)
    assert sides(test, {"x": 1}, defaults(function)) is False
    assert sides(test, {"x": 1, "flag": True}, defaults(function)) is True
