"""What a grading session knows, kept in config.stash (never on config attributes or globals)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest


@dataclass
class Result:
    """The graded outcome of one item: the one result model every report format is written from."""

    nodeid: str
    lab: str
    title: str
    function: str
    check: str
    status: str  # passed / failed / todo / skipped
    points: float  # the function's points (shared by its checks)
    message: str = ""
    duration: float = 0.0
    hidden: bool = False


@dataclass
class KataSession:
    root: Path
    kata_dir: Path
    solutions_dir: Path
    graders_dir: Path
    grade_solutions: bool
    seed: int
    seed_given: bool
    hint_tiers: int | None  # --kata-hints; None: reveal one more tier per consecutive failure
    timeout: float
    json_path: Path | None = None  # --kata-json
    gradescope_path: Path | None = None  # --gradescope
    # Hidden checks: the instructor's seed and extra cases ("lab::function::check" -> [case]).
    hidden_seed: int | None = None
    hidden_cases: dict = field(default_factory=dict)
    hidden_output: str = "name-only"  # or "full"
    # Consecutive failures per "lab::function", from the pytest cache: drives progressive hints.
    failures: dict[str, int] = field(default_factory=dict)
    # One entry per graded item, in run order.
    results: list["Result"] = field(default_factory=list)

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


# The grading session: paths, seed, results. Set in pytest_configure.
SESSION = pytest.StashKey[KataSession]()
# Grader modules already loaded this session, keyed by path, holding their Kata objects.
GRADERS = pytest.StashKey[dict]()
