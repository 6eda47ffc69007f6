"""The course: one folder holding katas/, graders/ and (in an instructor's checkout) solutions/.

A `Course` owns its root and folders, finds its labs, names a lab from what a person types, and is
the only place graders are loaded. It is found from the working directory, searching upward as
rustlings does, never from where this package was installed: a second clone is its own course.

    course/
      katas/NN_topic.py       what the learner edits (derived from solutions/, drift-checked)
      solutions/NN_topic.py   the single source of truth (absent from a learner's copy)
      graders/NN_topic.py     one grader per lab, named like the kata file it grades
      pristine/NN_topic.py    a learner's copy only: the untouched katas, for `kata reset`
      .kata/                  what the learner's tools remember (git-ignored): last-grading.json, hints.json,
                              backups/
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

LAB_GLOB = "[0-9][0-9]_*.py"


class CourseNotFound(LookupError):
    """No course folder at or above the starting point."""


def lab_files(folder: Path) -> list[Path]:
    """The lab files (NN_name.py) in a folder, in order."""
    return sorted(folder.glob(LAB_GLOB)) if folder.is_dir() else []


def find_lab(name: str, folder: Path) -> Path:
    """A lab file from '4', '04', '04_classifier_free_guidance' or a unique part of its name."""
    files = lab_files(folder)
    if name.isdigit():
        hits = [p for p in files if p.name.startswith(f"{int(name):02d}_")]
    else:
        hits = [p for p in files if p.stem == name] or [p for p in files if name in p.stem]
    if len(hits) != 1:
        known = ", ".join(p.stem for p in files)
        raise LookupError(f"no single lab matches {name!r}; the labs are: {known}")
    return hits[0]


def lab_title(path: Path) -> str:
    """The first line of a lab file's docstring ("Lab 01 · Forward noise"), or its stem."""
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, OSError, ValueError):
        doc = None
    return doc.strip().splitlines()[0].rstrip(".") if doc else path.stem


# Grader modules loaded in this process: path -> (digest of the file, its Kata objects).
_GRADERS: dict = {}


def load_module(path: Path, name: str) -> ModuleType:
    """Execute the Python file at `path` as a fresh module registered under `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


@dataclass
class Course:
    root: Path
    katas: Path | None = None
    solutions: Path | None = None
    graders: Path | None = None

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()
        self.katas = Path(self.katas).resolve() if self.katas else self.root / "katas"
        self.solutions = Path(self.solutions).resolve() if self.solutions else self.root / "solutions"
        self.graders = Path(self.graders).resolve() if self.graders else self.root / "graders"

    # ---- finding a course --------------------------------------------------------------------------------
    @staticmethod
    def is_course(folder: Path) -> bool:
        """A course folder has graders/ with lab graders, and katas/ or solutions/ beside it."""
        folder = Path(folder)
        return bool(lab_files(folder / "graders")) and ((folder / "katas").is_dir() or (folder / "solutions").is_dir())

    @classmethod
    def find(cls, start: Path | None = None) -> "Course":
        """The course at or above `start` (default: the working directory)."""
        here = Path(start or Path.cwd()).resolve()
        for folder in (here, *here.parents):
            if cls.is_course(folder):
                return cls(folder)
        raise CourseNotFound(
            f"no diffusion-katas course at or above {here}: run this inside a course folder (one holding "
            "katas/ and graders/), or pass --root")

    @classmethod
    def at(cls, root: str | Path | None) -> "Course":
        """The course a command works on: the folder given (--root), which must be one, or else the one at or
        above the working directory. CourseNotFound says why not."""
        if root is None:
            return cls.find()
        folder = Path(root).resolve()
        if not cls.is_course(folder):
            raise CourseNotFound(f"--root {root}: not a diffusion-katas course folder (it needs graders/ with lab "
                                 "graders, and katas/ or solutions/ beside it)")
        return cls(folder)

    @property
    def has_graders(self) -> bool:
        return bool(lab_files(self.graders))

    # ---- folders and files -------------------------------------------------------------------------------
    @property
    def pristine(self) -> Path:
        return self.root / "pristine"

    @property
    def state(self) -> Path:
        return self.root / ".kata"

    @property
    def record_path(self) -> Path:
        """The last grading, merged per lab (core/record.py)."""
        return self.state / "last-grading.json"

    @property
    def hints_path(self) -> Path:
        return self.state / "hints.json"

    @property
    def backups(self) -> Path:
        return self.state / "backups"

    def kata(self, lab: str) -> Path:
        return self.katas / f"{lab}.py"

    @property
    def notebooks(self) -> Path:
        """The labs as Jupyter notebooks (core/notebooks.py), beside katas/."""
        return self.root / "notebooks"

    def notebook(self, lab: str) -> Path:
        return self.notebooks / f"{lab}.ipynb"

    def solution(self, lab: str) -> Path:
        return self.solutions / f"{lab}.py"

    def grader(self, lab: str) -> Path:
        return self.graders / f"{lab}.py"

    def rel(self, path: Path) -> str:
        try:
            return Path(path).relative_to(self.root).as_posix()
        except ValueError:
            return str(path)

    # ---- labs --------------------------------------------------------------------------------------------
    def labs(self) -> list[str]:
        """Lab stems from katas/ (and solutions/ and pristine/, so that a deleted kata file still shows)."""
        stems = {p.stem for folder in (self.katas, self.solutions, self.pristine) for p in lab_files(folder)}
        return sorted(stems)

    def graded_labs(self) -> list[str]:
        """Lab stems that have a grader."""
        return [p.stem for p in lab_files(self.graders)]

    def resolve_lab(self, name: str) -> str:
        """A lab stem from '1', '01', '01_forward_noise' or a unique part of the name."""
        error = None
        for folder in (self.katas, self.solutions, self.pristine, self.graders):
            try:
                return find_lab(name, folder).stem
            except LookupError as exc:
                error = error or exc
        if not self.labs():
            raise LookupError(f"there are no labs in {self.rel(self.katas)}/ (files named NN_name.py)")
        raise error

    def title(self, lab: str) -> str:
        """A lab's title, from the first line of its kata (or solution, or pristine) file's docstring."""
        for path in (self.kata(lab), self.solution(lab), self.pristine / f"{lab}.py"):
            if path.is_file():
                return lab_title(path)
        return lab

    def lesson_source(self, lab: str) -> Path | None:
        """The file a lab's lesson is read from: the kata, unless it is gone or does not parse."""
        for path in (self.kata(lab), self.solution(lab), self.pristine / f"{lab}.py"):
            try:
                ast.parse(path.read_text(encoding="utf-8"))
            except (OSError, SyntaxError, ValueError):
                continue
            return path
        return None

    def pristine_text(self, lab: str) -> str:
        """The untouched kata: derived from the solution, or kept in pristine/ (a learner's copy)."""
        from diffusion_katas.core.derive import strip_solutions

        solution = self.solution(lab)
        if solution.is_file():
            return strip_solutions(solution.read_text(encoding="utf-8"), self.rel(solution))
        kept = self.pristine / f"{lab}.py"
        if kept.is_file():
            return kept.read_text(encoding="utf-8")
        raise FileNotFoundError(f"{self.rel(self.kata(lab))} has no pristine form: neither "
                                f"{self.rel(solution)} nor {self.rel(kept)} is there")

    def untouched(self, lab: str) -> bool:
        """Whether the kata's code is the pristine kata's (comments and blank lines aside): every function still
        its TODO stub. Read with `ast`, never run."""
        try:
            return ast.dump(ast.parse(self.kata(lab).read_text(encoding="utf-8"))) == \
                ast.dump(ast.parse(self.pristine_text(lab)))
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            return False

    def untouched_todos(self, lab: str) -> list[str]:
        """The kata's functions that are still their TODO stub, as the pristine kata has them, in file order: read
        with `ast` (parsed, never run), so nothing is graded to learn that a stub raises NotImplementedError.
        Empty when the kata or its pristine form cannot be read or parsed."""
        try:
            pristine = ast.parse(self.pristine_text(lab))
            now = ast.parse(self.kata(lab).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
            return []

        def stubs(tree, only_todo: bool) -> dict:
            return {node.name: ast.dump(node) for node in tree.body if isinstance(node, ast.FunctionDef)
                    and (not only_todo or any(isinstance(n, ast.Raise) and "NotImplementedError" in ast.dump(n)
                                              for n in ast.walk(node)))}

        todo, mine = stubs(pristine, True), stubs(now, False)
        return [name for name, code in mine.items() if todo.get(name) == code]

    # ---- graders: the one loader -------------------------------------------------------------------------
    def graders_of(self, lab: str) -> list:
        """The Kata objects the lab's grader declares, in declaration order: each file loaded once per
        process, again only when its content changed. A warm grading process (`kata watch`) thus keeps what
        the graders cache between gradings (the references' costs, tiny models)."""
        from diffusion_katas.core.spec import Kata

        path = self.grader(lab)
        name = f"diffusion_katas_grader_{lab}"
        digest = hashlib.blake2b(path.read_bytes(), digest_size=16).digest()
        cached = _GRADERS.get(path)
        if cached is None or cached[0] != digest:
            module = load_module(path, name)
            cached = (digest, module, [v for v in vars(module).values() if isinstance(v, Kata)])
            _GRADERS[path] = cached
        # Registered again each time: objects of the grader's classes are pickled by module name (a probe
        # sent to a runner), and someone may have dropped or replaced the name since (pytester's inline
        # runs restore sys.modules; another course's grader of the same lab takes the same name).
        sys.modules[name] = cached[1]
        return cached[2]
