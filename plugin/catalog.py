"""The course as the graders declare it: labs, titles, graded functions, points and cuda marks.

Also what every instructor module shares: InstructorError, the repository's pyproject.toml, and how a
number of points is printed.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from plugin import explain

LAB_GLOB = "[0-9][0-9]_*.py"


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


_GRADER_MODULES: dict[Path, list] = {}
_GRADER_LOCK = threading.Lock()


def _grader_katas(path: Path) -> list:
    """The Kata objects a grader module declares (imported once per process)."""
    from plugin.collection import load_module
    from plugin.spec import Kata

    with _GRADER_LOCK:
        if path not in _GRADER_MODULES:
            try:
                module = load_module(path, f"_kata_instructor_{path.stem}")
            except BaseException as exc:  # noqa: BLE001  (any failure of a grader import is reported)
                raise InstructorError(f"could not import the grader {path}: {type(exc).__name__}: {exc}")
            _GRADER_MODULES[path] = [v for v in vars(module).values() if isinstance(v, Kata)]
        return _GRADER_MODULES[path]


def lab_stems(graders_dir: Path) -> list[str]:
    return [p.stem for p in explain.lab_files(graders_dir)]


def select_labs(graders_dir: Path, wanted: list[str] | None) -> list[str]:
    """Lab stems from --labs values ('1', '01', '01_forward_noise', comma lists); all labs by default."""
    if not lab_stems(graders_dir):
        raise InstructorError(f"there are no graders ({LAB_GLOB}) in {graders_dir}")
    names = [n.strip() for value in (wanted or []) for n in value.split(",") if n.strip()]
    if not names:
        return lab_stems(graders_dir)
    chosen = []
    for name in names:
        try:
            stem = explain.find_lab(name, graders_dir).stem
        except LookupError as exc:
            raise InstructorError(f"--labs {name}: {exc}") from None
        if stem not in chosen:
            chosen.append(stem)
    return sorted(chosen)


def lab_title(root: Path, lab: str) -> str:
    """A lab's title from the first line of its kata (or solution) file's docstring."""
    from plugin.collection import lab_title as title_of

    for folder in ("katas", "solutions"):
        path = root / folder / f"{lab}.py"
        if path.is_file():
            return title_of(path)
    return lab


def load_catalog(root: Path, labs: list[str], graders_dir: Path | None = None) -> Catalog:
    """What the graders of `labs` declare: functions, points, check and budget names, cuda marks."""
    graders_dir = graders_dir or root / "plugin" / "graders"
    functions: dict[str, list[Function]] = {}
    for lab in labs:
        functions[lab] = []
        for kata in _grader_katas(graders_dir / f"{lab}.py"):
            checks = [c.name for c in kata.checks] + [f"budget: {b.name}" for b in kata.budgets]
            cuda = [c.name for c in kata.checks if _has_cuda(c.marks)]
            cuda += [f"budget: {b.name}" for b in kata.budgets if _has_cuda(b.marks)]
            functions[lab].append(Function(lab, kata.name, float(kata.points), checks, cuda))
    return Catalog(list(labs), {lab: lab_title(root, lab) for lab in labs}, functions)


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
