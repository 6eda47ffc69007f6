"""Benchmark the learner's feedback loop: how long from saving a kata file to reading its verdict.

    python benchmarks/feedback.py [--runs 5] [--labs 01 05 11]

Prints, medians side by side from one run on this machine (wall clocks swing on shared machines: read
the ratios, not the milliseconds):
1. the floor: `python -c "import torch, pytest"`;
2. a cold one-lab grading: `python -m pytest katas/NN_lab.py` (what a plain pytest run costs);
3. save-to-verdict through the warm grader `kata watch` uses (one pytest process kept warm, the
   learner's code in a fresh runner per check), after a first grading has warmed it.
Graded on the solutions (`--solutions`), so every check runs to the end. This is a script, not a test.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(command: list[str]) -> float:
    start = time.monotonic()
    subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--labs", nargs="*", default=["01", "05", "11"])
    args = parser.parse_args()

    from diffusion_katas.commands.running import WarmGrader
    from diffusion_katas.core.course import Course

    course = Course(ROOT)
    floor = statistics.median(timed([sys.executable, "-c", "import torch, pytest"]) for _ in range(args.runs))
    rows = [("python -c 'import torch, pytest' (floor)", floor, None)]
    warm = WarmGrader(course, seed=1)
    try:
        for name in args.labs:
            lab = course.resolve_lab(name)
            target = f"katas/{lab}.py"
            cold = statistics.median(timed([sys.executable, "-m", "pytest", target, "--solutions", "-q",
                                            "-p", "no:cacheprovider"]) for _ in range(args.runs))
            warm.grade(target, "--solutions")  # the first grading warms the process
            saves = []
            for _ in range(args.runs):
                (ROOT / "solutions" / f"{lab}.py").touch()
                saves.append(warm.grade(target, "--solutions").seconds)
            rows.append((f"{lab}: cold `python -m pytest {target}`", cold, None))
            rows.append((f"{lab}: save-to-verdict, warm (kata watch)", statistics.median(saves), min(saves)))
    finally:
        warm.close()
    print(f"| what | median s | x floor | best s |\n|---|---|---|---|")
    for what, seconds, best in rows:
        print(f"| {what} | {seconds:.2f} | {seconds / floor:.2f}x | {'' if best is None else f'{best:.2f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
