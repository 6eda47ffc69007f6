"""What a grading session knows, kept in config.stash (never on config attributes or globals)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest


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
    # Consecutive failures per "lab::function", from the pytest cache: drives progressive hints.
    failures: dict[str, int] = field(default_factory=dict)
    # One entry per graded item: (lab, title, function, check, status) with status in
    # passed / failed / todo / skipped.
    results: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)


# The grading session: paths, seed, results. Set in pytest_configure.
SESSION = pytest.StashKey[KataSession]()
# Grader modules already loaded this session, keyed by path, holding their Kata objects.
GRADERS = pytest.StashKey[dict]()
