"""A submission laid out for grading: its kata files copied into a scratch project with its own pytest.ini.

The learner's kata files (`NN_lab.py`, directly in the submission folder or in a `katas/` subfolder) are
copied into a scratch project; symbolic links are refused, nothing else of the submission is copied (no
conftest.py, no plugin). A selected lab whose file is missing gets a placeholder that fails to import
with "missing file", so its functions score 0 through the same graders.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from diffusion_katas.commands.instructor.catalog import LAB_GLOB, Catalog, read_pyproject
from diffusion_katas.core.course import Course

MISSING = "missing file"


@dataclass
class Prepared:
    """A submission laid out for grading: a project whose katas/ holds its kata files."""

    learner: str
    source: Path
    project: Path  # the child's rootdir and working directory
    config: Path  # its pytest config file (-c)
    present: list[str] = field(default_factory=list)  # selected labs whose file was found
    missing: list[str] = field(default_factory=list)  # selected labs given a "missing file" placeholder
    notes: list[str] = field(default_factory=list)  # files refused (symbolic links, ...)
    problem: str = ""  # set when there is nothing to grade: not a folder, empty, no kata files
    outcome: str = ""  # the outcome that goes with `problem`


def kata_files(folder: Path) -> tuple[dict[str, Path], list[str]]:
    """The lab files of a submission: NN_lab.py directly in it or in a katas/ subfolder (one level of
    wrapping folder, as a zip of a folder gives, is looked through). Symbolic links are refused."""
    def found(where: Path) -> list[Path]:
        return sorted(p for p in where.glob(LAB_GLOB) if p.is_file() or p.is_symlink()) if where.is_dir() else []

    where = next((w for w in (folder / "katas", folder) if found(w)), None)
    if where is None:
        inner = [p for p in folder.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))] \
            if folder.is_dir() else []
        if len(inner) == 1:
            where = next((w for w in (inner[0] / "katas", inner[0]) if found(w)), None)
    files: dict[str, Path] = {}
    notes: list[str] = []
    inside = folder.resolve()
    for path in found(where) if where is not None else []:
        if path.is_symlink() or not path.resolve().is_relative_to(inside):
            notes.append(f"{path.name} is a symbolic link (or lies behind one): refused, graded as missing")
        else:
            files[path.stem] = path
    return files, notes


def learner_names(folders: list[Path]) -> list[str]:
    """A file-name-safe, unique name per submission folder (its name; -2, -3 ... for repeats)."""
    names: list[str] = []
    for folder in folders:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", folder.name).strip("._") or "submission"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def placeholder(lab: str, title: str) -> str:
    """A kata file for a lab the submission lacks: it fails to import, so every function scores 0."""
    message = f"missing file: the submission has no {lab}.py"
    return (f'"""{title}\n\nPlaceholder written by the grader: {message}.\n"""\n'
            f"raise ImportError({message!r})\n")


def lay_out(learner: str, folder: Path, project: Path, config: Path, catalog: Catalog) -> Prepared:
    """Copy a submission's kata files for the selected labs into project/katas/ (a fresh folder)."""
    prep = Prepared(learner, folder, project, config)
    if not folder.is_dir():
        prep.problem, prep.outcome = f"not a folder: {folder}", "not graded"
        return prep
    try:
        files, prep.notes = kata_files(folder)
    except OSError as exc:
        prep.problem, prep.outcome = f"could not read the submission folder: {exc}", "not graded"
        return prep
    katas = project / "katas"
    if katas.exists():
        shutil.rmtree(katas)
    katas.mkdir(parents=True)
    for lab in catalog.labs:
        try:
            if lab not in files:
                raise FileNotFoundError
            shutil.copyfile(files[lab], katas / f"{lab}.py")
            prep.present.append(lab)
        except OSError as exc:
            if lab in files:
                prep.notes.append(f"{lab}.py could not be read ({exc}): graded as missing")
            (katas / f"{lab}.py").write_text(placeholder(lab, catalog.titles[lab]), encoding="utf-8")
            prep.missing.append(lab)
    if not prep.present:
        if not any(folder.iterdir()):
            prep.problem = "empty submission folder"
        else:
            others = sorted(p.name for p in folder.iterdir())[:5]
            prep.problem = (f"no kata file for the selected labs ({', '.join(f'{lab}.py' for lab in catalog.labs)}); "
                            f"the folder holds: {', '.join(others)}")
        prep.outcome = MISSING
    return prep


def scratch_config(course: Course, path: Path, labs: list[str], graders: Path | None = None) -> None:
    """A pytest.ini with the repository's pytest settings, reading katas from the scratch copy and the
    graders from `graders` (default: the repository's)."""
    options = dict(read_pyproject(course.root).get("tool", {}).get("pytest", {}).get("ini_options", {}))
    graders = graders or course.graders
    for key in ("testpaths", "pytest_plugins", "kata_dir", "kata_solutions_dir", "kata_graders_dir", "kata_labs"):
        options.pop(key, None)
    # no solutions here: a class grades submissions, and the instructor's answers are named nowhere it runs
    options.update(testpaths=["katas"], kata_dir="katas", kata_solutions_dir="no-solutions-here",
                   kata_graders_dir=str(graders.resolve()), kata_labs=list(labs))
    path.write_text(ini_text(options, "# Written by `kata class`: the repository's pytest settings, for a scratch "
                                      "copy of one submission."), encoding="utf-8")


def ini_text(options: dict, header: str) -> str:
    """A pytest.ini of `options` (pytest's ini_options, as pyproject.toml holds them) under a comment line."""
    lines = [header, "[pytest]"]
    for key, value in options.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, list):
            lines.append(f"{key} =" + "".join(f"\n    {item}" for item in value))
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"
