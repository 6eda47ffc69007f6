"""The course in numbers, lab by lab: what is graded and what grading it costs.

    python benchmarks/labs.py [--labs 20 21] [--no-time]

Prints a markdown table: per lab its functions, checks, graded scenarios (the cases as the plugin builds
them, seed 0), declared traps, budgets, and the wall time of `python -m pytest katas/LAB.py --solutions` in a
fresh process (every check run to the end). Wall clocks swing on shared machines: one run, read the ratios.
This is a script, not a test.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def inventory(lab: str) -> dict:
    import torch

    from diffusion_katas.core.course import Course
    from diffusion_katas.core.spec import Scenario

    katas = Course(ROOT).graders_of(lab)
    scenarios = 0
    for kata in katas:
        for check in kata.checks:
            torch.manual_seed(0)
            g = torch.Generator().manual_seed(0)
            for case in check.cases:
                built = check.build(case, g)
                scenarios += 1 if isinstance(built, Scenario) else len(list(built))
    return dict(functions=len(katas), checks=sum(len(k.checks) for k in katas), scenarios=scenarios,
                traps=sum(len(k.traps) for k in katas), budgets=sum(len(k.budgets) for k in katas))


def graded_seconds(lab: str) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "pytest", f"katas/{lab}.py", "--solutions", "-q", "-p", "no:cacheprovider"],
                   cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--labs", nargs="*", default=None, help="lab numbers (default: every lab with a grader)")
    parser.add_argument("--no-time", action="store_true", help="counts only, no grading run")
    args = parser.parse_args()
    labs = sorted(p.stem for p in (ROOT / "graders").glob("[0-9][0-9]_*.py"))
    if args.labs:
        labs = [lab for lab in labs if lab[:2] in {n.zfill(2) for n in args.labs}]
    print("| lab | functions | checks | scenarios | traps | budgets | --solutions (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    total = dict(functions=0, checks=0, scenarios=0, traps=0, budgets=0)
    for lab in labs:
        row = inventory(lab)
        for key in total:
            total[key] += row[key]
        seconds = "" if args.no_time else f"{graded_seconds(lab):.1f}"
        print(f"| {lab} | {row['functions']} | {row['checks']} | {row['scenarios']} | {row['traps']} | "
              f"{row['budgets']} | {seconds} |", flush=True)
    print(f"| all {len(labs)} | {total['functions']} | {total['checks']} | {total['scenarios']} | {total['traps']} | "
          f"{total['budgets']} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
