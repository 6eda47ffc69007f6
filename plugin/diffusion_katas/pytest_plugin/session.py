"""What a grading session knows, kept in config.stash (never on config attributes or globals)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from diffusion_katas.core.course import Course
from diffusion_katas.core.results import Result, Run


@dataclass
class KataSession:
    course: Course
    grade_solutions: bool
    seed: int
    seed_given: bool
    hint_tiers: int | None  # --kata-hints; None: reveal one more tier per consecutive failure
    timeout: float
    memory_gib: float = 4.0  # --kata-memory: what learner code may allocate beyond the runner's start
    json_path: Path | None = None  # --kata-json
    gradescope_path: Path | None = None  # --gradescope
    # Hidden checks: the instructor's secret seed (any text) and extra cases ("lab::function::check" -> [case]).
    hidden_seed: str | None = None
    hidden_cases: dict = field(default_factory=dict)
    hidden_output: str = "name-only"  # or "full"
    # The hint tiers the learner has seen (core/tiers.py: .kata/hints.json, shared with `kata hint`), and the
    # tiers this run's failure messages show, per "lab::function".
    tiers: dict[str, dict] = field(default_factory=dict)
    tiers_now: dict[str, int] = field(default_factory=dict)
    hints_shown: bool = True  # whether this run prints its failure texts (then their tiers are remembered)
    # One entry per graded item, in run order.
    results: list[Result] = field(default_factory=list)
    # Per lab, its files as they were when its first item started (for .kata/last-grading.json).
    fingerprints: dict[str, dict] = field(default_factory=dict)
    # (lab, function) -> whether it passes its checks, as its budgets found out when the checks were not part
    # of this run: ("ok",), ("todo", waits_on) or ("failed", check); one run of the checks per function.
    gates: dict[tuple[str, str], tuple] = field(default_factory=dict)
    # (lab, function, check) of kata items a selection (-k, -m, --kata-function) left out.
    deselected: list[tuple[str, str, str]] = field(default_factory=list)
    interrupted: bool = False
    # Checks whose runner was opened while the check before them ran (closed at the end if they never ran).
    opened_ahead: list = field(default_factory=list)
    # --kata-reuse-builds (the warm grader of `kata watch`): built references kept between gradings.
    reuse_builds: bool = False
    # Whether this run froze what collection imported (gc.freeze): each kata file's setup then freezes again.
    heap_frozen: bool = False
    _recorded_failures: set | None = field(default=None, repr=False)

    def close_runners_opened_ahead(self) -> None:
        """Close the runners opened for checks that never ran (the run stopped first: -x, Ctrl-C)."""
        for item in self.opened_ahead:
            runner = getattr(item, "runner", None)
            if runner is not None:
                runner.close()
                item.runner = None
        self.opened_ahead.clear()

    @property
    def root(self) -> Path:
        return self.course.root

    @property
    def kata_dir(self) -> Path:
        return self.course.katas

    @property
    def solutions_dir(self) -> Path:
        return self.course.solutions

    @property
    def graders_dir(self) -> Path:
        return self.course.graders

    def rel(self, path: Path) -> str:
        return self.course.rel(path)

    def recorded_failures(self) -> set[tuple[str, str]]:
        """(lab, function) that failed when their lab was last graded, its files unchanged since (core/record.py),
        read once per run; none outside the learner's own runs (keeps_record)."""
        if self._recorded_failures is None:
            from diffusion_katas.core import record

            self._recorded_failures = (record.failing_now(self.course, record.load(self.course))
                                       if self.keeps_record else set())
        return self._recorded_failures

    @property
    def keeps_record(self) -> bool:
        """Whether this run writes the learner's .kata/last-grading.json (core/record.py): it grades the
        kata files, with no hidden checks and no Gradescope output (an instructor's or autograder's run)."""
        return not self.grade_solutions and self.hidden_seed is None and self.gradescope_path is None

    def run(self) -> Run:
        graded = self.rel(self.solutions_dir if self.grade_solutions else self.kata_dir)
        return Run(list(self.results), self.seed, self.hidden_seed is not None, graded, self.interrupted)


# The grading session: course, seed, results. Set in pytest_configure, only inside a course.
SESSION = pytest.StashKey[KataSession]()


def hidden_check_seed(secret: str, *parts: str) -> int:
    """A hidden check's seed: a keyed hash of the check's name under the instructor's secret. Every learner gets
    the same hidden inputs, and nothing a learner can see of one check (its inputs, the seed behind them) leads
    back to the secret or to another check's seed, as long as the secret cannot be guessed (a long random one)."""
    import hashlib

    key = hashlib.sha256(str(secret).encode("utf-8")).digest()
    digest = hashlib.blake2b(":".join(parts).encode("utf-8"), key=key, digest_size=8).digest()
    return int.from_bytes(digest, "big") % 2**31
