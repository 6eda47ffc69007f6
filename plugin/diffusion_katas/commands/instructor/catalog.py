"""The course as the graders declare it: labs, titles, graded functions, points and cuda marks.

Also what every instructor module shares: InstructorError, the repository's pyproject.toml, and how a
number of points is printed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diffusion_katas.core.course import LAB_GLOB, Course, find_lab


class InstructorError(Exception):
    """A message for the instructor; the command prints it and exits with `code`."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


@dataclass
class Function:
    """One graded kata function, as its grader declares it."""

    lab: str
    name: str
    points: float
    checks: list[str]  # item names as results carry them: each check's name, then "budget: <name>"
    cuda_checks: list[str] = field(default_factory=list)


@dataclass
class Catalog:
    """The selected labs, their titles and graded functions, in order."""

    labs: list[str]
    titles: dict[str, str]
    functions: dict[str, list[Function]]

    def all_functions(self) -> list[Function]:
        return [f for lab in self.labs for f in self.functions[lab]]

    def cuda_labs(self) -> list[str]:
        return [lab for lab in self.labs if any(f.cuda_checks for f in self.functions[lab])]

    def points(self, lab: str | None = None) -> float:
        return sum(f.points for f in self.all_functions() if lab is None or f.lab == lab)

    def to_json(self) -> dict:
        return {"labs": [{"lab": lab, "title": self.titles[lab],
                          "functions": [{"name": f.name, "points": f.points, "checks": f.checks,
                                         "cuda_checks": f.cuda_checks} for f in self.functions[lab]]}
                         for lab in self.labs]}

    @classmethod
    def from_json(cls, data: dict) -> "Catalog":
        labs = [entry["lab"] for entry in data["labs"]]
        return cls(labs, {e["lab"]: e["title"] for e in data["labs"]},
                   {e["lab"]: [Function(e["lab"], f["name"], float(f["points"]), list(f["checks"]),
                                        list(f.get("cuda_checks", []))) for f in e["functions"]]
                    for e in data["labs"]})


def select_labs(course: Course, wanted: list[str] | None) -> list[str]:
    """Lab stems from --labs values ('1', '01', '01_forward_noise', comma lists); all labs by default."""
    if not course.graded_labs():
        raise InstructorError(f"there are no graders ({LAB_GLOB}) in {course.graders}")
    names = [n.strip() for value in (wanted or []) for n in value.split(",") if n.strip()]
    if not names:
        return course.graded_labs()
    chosen = []
    for name in names:
        try:
            stem = find_lab(name, course.graders).stem
        except LookupError as exc:
            raise InstructorError(f"--labs {name}: {exc}") from None
        if stem not in chosen:
            chosen.append(stem)
    return sorted(chosen)


def load_catalog(course: Course, labs: list[str]) -> Catalog:
    """What the graders of `labs` declare: functions, points, check and budget names, cuda marks."""
    functions: dict[str, list[Function]] = {}
    for lab in labs:
        try:
            katas = course.graders_of(lab)
        except BaseException as exc:  # noqa: BLE001  (any failure of a grader import is reported)
            raise InstructorError(f"could not import the grader {course.grader(lab)}: {type(exc).__name__}: {exc}")
        functions[lab] = []
        for kata in katas:
            checks = [c.name for c in kata.checks] + [f"budget: {b.name}" for b in kata.budgets]
            cuda = [c.name for c in kata.checks if _has_cuda(c.marks)]
            cuda += [f"budget: {b.name}" for b in kata.budgets if _has_cuda(b.marks)]
            functions[lab].append(Function(lab, kata.name, float(kata.points), checks, cuda))
    return Catalog(list(labs), {lab: course.title(lab) for lab in labs}, functions)


def _has_cuda(marks) -> bool:
    return any(getattr(mark, "name", None) == "cuda" for mark in marks)


def read_pyproject(root: Path) -> dict:
    """The repository's pyproject.toml ({} when it cannot be read)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return {}
    try:
        return tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def number_text(x: float) -> str:
    """A score or a number of points as the tables print it: 2, 0.5, 12.25."""
    return f"{x:g}"
