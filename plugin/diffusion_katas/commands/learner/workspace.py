"""The learner's course as the commands see it: found from the working directory (or --root), and a lab
named from what the learner types. What the tools remember lives in .kata/ under the course root
(git-ignored): the last report, the hint tiers revealed and the backups `kata reset` keeps.
"""
from __future__ import annotations

from pathlib import Path

from diffusion_katas.core.course import Course, CourseNotFound


class LearnerError(Exception):
    """A message for the learner; the command prints it and exits with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def open_course(root: Path | None) -> Course:
    """The course at `root` (--root), or the one found at or above the working directory."""
    try:
        course = Course.at(root)
    except CourseNotFound as exc:
        raise LearnerError(str(exc)) from None
    if not course.katas.is_dir():
        raise LearnerError(f"there is no katas/ folder in {course.root}: --root must be the course folder "
                           "(the one that holds katas/ and graders/)")
    return course


def resolve_lab(course: Course, name: str) -> str:
    """A lab stem from '1', '01', '01_forward_noise' or a unique part of the name."""
    try:
        return course.resolve_lab(name)
    except LookupError as exc:
        if not course.labs():
            raise LearnerError(str(exc)) from None
        raise LearnerError(f"{exc}\n(a lab is named by its number, e.g. `01`, or by its name)") from None
