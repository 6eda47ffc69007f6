"""Every lab's traps can be named: each differs from the reference on at least one graded scenario.

A trap that equals the reference on every case the grader builds could never explain a learner's output
(or would be named on a right answer). One test over every grader, so a new lab is held to it too.
"""
from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
LABS = sorted(p.stem for p in (REPO / "graders").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("lab", LABS)
def test_the_graded_cases_separate_every_declared_trap(graders_loaded, lab):
    import torch

    from diffusion_katas.core.course import Course
    from diffusion_katas.core.spec import KataFailure, Scenario
    from diffusion_katas.core.tolerances import for_dtype, output_dtype
    from diffusion_katas.engine.comparison import matches
    from diffusion_katas.engine.isolation import fresh

    never = []
    for kata in Course(REPO).graders_of(lab):
        if not kata.traps:
            continue
        scenarios = []
        for check in kata.checks:
            torch.manual_seed(0)
            g = torch.Generator().manual_seed(0)
            for case in check.cases:
                built = check.build(case, g)
                scenarios += [(s, for_dtype(check.tol, output_dtype(s.expected)))
                              for s in ([built] if isinstance(built, Scenario) else list(built))]
        for trap in kata.traps:
            def differs(scenario, tol) -> bool:
                try:
                    wrong = trap.fn(**fresh(scenario.inputs))
                except Exception:  # noqa: BLE001  (the mistake crashes where the reference runs: it fails there,
                    return True  # and a trap raising the same error names the crash: pytest_plugin/collection.py)
                if not matches(scenario.expected, wrong, tol):
                    return True
                if scenario.verify is not None:  # a scenario's own assertion (counted flips, call counts)
                    try:
                        if scenario.observe:  # what the inputs recorded of the trap's call (in the runner: its reply)
                            scenario.verify(wrong, {n: scenario.inputs[n].kata_observe() for n in scenario.observe})
                        else:
                            scenario.verify(wrong)
                    except KataFailure:
                        return True
                return False

            if not any(differs(s, tol) for s, tol in scenarios):
                never.append(f"{kata.name}: '{trap.name}'")
    assert not never, "traps equal to the reference on every graded scenario:\n" + "\n".join(never)
