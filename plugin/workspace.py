"""The learner's repository: where katas, solutions, graders and .kata/ live, and how a lab is named.

What the learner's tools remember lives in .kata/ under the repository root (git-ignored): the last
report (last-report.json), the hint tiers revealed (hints.json) and the backups `kata reset` keeps
(backups/).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from plugin import explain

ROOT = explain.ROOT


class LearnerError(Exception):
    """A message for the learner; the command prints it and exits with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass
class Repo:
    root: Path

    @property
    def katas(self) -> Path:
        return self.root / "katas"

    @property
    def solutions(self) -> Path:
        return self.root / "solutions"

    @property
    def graders(self) -> Path:
        return self.root / "plugin" / "graders"

    @property
    def state(self) -> Path:
        return self.root / ".kata"

    @property
    def report_path(self) -> Path:
        return self.state / "last-report.json"

    @property
    def hints_path(self) -> Path:
        return self.state / "hints.json"

    @property
    def backups(self) -> Path:
        return self.state / "backups"

    def kata(self, lab: str) -> Path:
        return self.katas / f"{lab}.py"

    def rel(self, path: Path) -> str:
        try:
            return path.relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    def labs(self) -> list[str]:
        """Lab stems from katas/ (and solutions/, so that a deleted kata file still shows), in order."""
        stems = {p.stem for p in explain.lab_files(self.katas)}
        stems |= {p.stem for p in explain.lab_files(self.solutions)}
        return sorted(stems)


def open_repo(root: Path) -> Repo:
    repo = Repo(Path(root).resolve())
    if not repo.katas.is_dir():
        raise LearnerError(f"there is no katas/ folder in {repo.root}: --root must be the repository root "
                           "(the folder that holds katas/, solutions/ and plugin/)")
    return repo


def resolve_lab(repo: Repo, name: str) -> str:
    """A lab stem from '1', '01', '01_forward_noise' or a unique part of the name."""
    try:
        return explain.find_lab(name, repo.katas).stem
    except LookupError as exc:
        try:  # the learner's kata file may be gone; its solution still names the lab
            return explain.find_lab(name, repo.solutions).stem
        except LookupError:
            pass
        if not repo.labs():
            raise LearnerError(f"there are no labs in {repo.rel(repo.katas)}/ (files named NN_name.py)") from None
        raise LearnerError(f"{exc}\n(a lab is named by its number, e.g. `01`, or by its name)") from None
