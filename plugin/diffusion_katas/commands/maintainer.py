"""Maintainer commands of `kata`: derive the katas from the solutions, and build a learner's copy.

    kata derive [LAB...] [--check]   rewrite katas/ and notebooks/ from solutions/ (or only report drift)
    kata learner-copy OUT            a course for learners that installs on its own: katas/, graders/,
                                     pristine/, the engine's source, pyproject.toml, a README; no solutions/

The instructor's checkout keeps solutions/ as the single source of truth; a learner's copy carries the
untouched katas in pristine/ instead, so `kata reset` works there without a single solution in it. The copy is
what a Classroom template repository or a workshop's USB stick holds: it installs with the same two lines as the
checkout (a venv, `pip install -e .`), from the course's own pyproject.toml and the engine's source in plugin/,
so it needs no registry the course is not on.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from diffusion_katas.core.course import Course, CourseNotFound, lab_files
from diffusion_katas.core.derive import MarkerError, derived, derived_notebooks, drift
from diffusion_katas.core.notebooks import PICTURED, lab_notebook

LEARNER_README = """\
# {title}

Learn how diffusion inference really works by writing it. Each file in `katas/` is a lab: a lesson
(its docstring) and TODO functions. `pytest` grades your code live against the real Hugging Face
diffusers and peft implementations, on fresh seeded inputs, and tells you what is wrong and where.

```bash
# once: a virtual environment (Python >= 3.10), then in each new shell: . .venv/bin/activate
python3 -m venv .venv && . .venv/bin/activate
# set up, then grade every lab (all TODO at first; the run exits non-zero until all pass)
python -m pip install -e . && python -m pytest katas
```

On Linux without an NVIDIA GPU, install with PyTorch's CPU wheels instead (the default pulls 2+ GB of CUDA):
`python -m pip install --extra-index-url https://download.pytorch.org/whl/cpu -e .`

```bash
python -m pytest katas/01_forward_noise.py   # grade one lab
kata watch 01      # re-grade on every save          kata hint       # the next hint tier
kata progress      # every lab and the next TODO     kata reset 01   # restore a kata (keeps a backup)
kata explain 01    # read the lab's lesson
```

In Jupyter or Colab: `python -m pip install -e ".[notebook]"`, then open `notebooks/NN_name.ipynb` and run its
first cell; `%kata check FUNCTION` under a function's cell saves the code you ran into the kata file and grades it.

The labs:

{labs}

`graders/` holds what grades each lab and `plugin/` the grading engine (do not edit them: your instructor
grades with their own copies); `pristine/` holds the untouched katas that `kata reset` restores.
"""

GITIGNORE = ".kata/\n__pycache__/\n.pytest_cache/\n*.egg-info/\nbuild/\n.venv/\n"

class MaintainerError(Exception):
    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def _course(args) -> Course:
    try:
        return Course.at(args.root)
    except CourseNotFound as exc:
        raise MaintainerError(str(exc)) from None


def cmd_derive(args) -> int:
    course = _course(args)
    if not lab_files(course.solutions):
        raise MaintainerError(f"there are no solutions in {course.rel(course.solutions)}/ to derive katas from")
    try:
        if args.check:
            problems = drift(course.solutions, course.katas, course.notebooks)
            args.verdict = 1 if problems else 0  # the answer, even if nobody reads what follows
            for p in problems:
                print(p)
            print("katas/, notebooks/ and solutions/ agree" if not problems else f"{len(problems)} file(s) drifted: "
                  "run `kata derive`")
            return 1 if problems else 0
        for folder, files in ((course.katas, derived(course.solutions)),
                              (course.notebooks, derived_notebooks(course.solutions))):
            folder.mkdir(exist_ok=True)
            for name, text in files.items():
                if args.labs and name.rsplit(".", 1)[0] not in args.labs:
                    continue
                target = folder / name
                if not target.exists() or target.read_text(encoding="utf-8") != text:
                    target.write_text(text, encoding="utf-8")
                    print(f"wrote {course.rel(target)}")
    except MarkerError as exc:
        raise MaintainerError(str(exc), 1) from None
    return 0


def build_learner_copy(course: Course, out: Path, labs: list[str] | None = None, course_url: str = "") -> list[str]:
    """Write a learner's copy of `course` into `out` (which must not exist or be empty); return its labs.
    `course_url`: where the copy will be published (a git URL), which its notebooks' set-up cells fetch it from
    in a fresh runtime (Colab)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise MaintainerError(f"{out} is not empty: choose a new folder for the learner's copy")
    pyproject = course.root / "pyproject.toml"
    if not pyproject.is_file():
        raise MaintainerError(f"{course.rel(pyproject)} is missing: the copy installs from the course's own")
    chosen = [lab for lab in course.graded_labs() if not labs or lab in labs]
    if not chosen:
        raise MaintainerError("no graded lab to copy")
    for folder in ("katas", "graders", "pristine", "notebooks"):
        (out / folder).mkdir(parents=True, exist_ok=True)
    for lab in chosen:
        try:
            pristine = course.pristine_text(lab)
        except (FileNotFoundError, MarkerError) as exc:
            raise MaintainerError(f"cannot copy {lab}: {exc}") from None
        (out / "katas" / f"{lab}.py").write_text(pristine, encoding="utf-8")
        (out / "pristine" / f"{lab}.py").write_text(pristine, encoding="utf-8")
        (out / "notebooks" / f"{lab}.ipynb").write_text(
            lab_notebook(pristine, lab, picture=lab in PICTURED, course_url=course_url), encoding="utf-8")
        shutil.copyfile(course.grader(lab), out / "graders" / f"{lab}.py")
    # the engine, as this command runs it (its source: the pyproject builds it from plugin/, as the checkout's does)
    shutil.copytree(Path(__file__).resolve().parents[1], out / "plugin" / "diffusion_katas",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    shutil.copyfile(pyproject, out / "pyproject.toml")  # the pins, the `kata` command, the plugin, pytest's settings
    rows = "\n".join(f"- `katas/{lab}.py`: {course.title(lab)}" for lab in chosen)
    (out / "README.md").write_text(LEARNER_README.format(title="Diffusion katas", labs=rows), encoding="utf-8")
    (out / ".gitignore").write_text(GITIGNORE, encoding="utf-8")
    return chosen


def _source_course(args) -> tuple[Course, str]:
    """The course to copy, and how it was found: --root, the course at or above the working directory, or else
    the course checkout this package is installed from (an editable install), which holds solutions/."""
    if args.root is not None:
        return _course(args), ""
    try:
        return Course.find(), ""
    except CourseNotFound as exc:
        home = Path(__file__).resolve().parents[3]  # plugin/diffusion_katas/commands/ -> the checkout
        if Course.is_course(home) and lab_files(home / "solutions"):
            return Course(home), f" from the course this package is installed from ({home})"
        raise MaintainerError(str(exc)) from None


def cmd_learner_copy(args) -> int:
    course, found = _source_course(args)
    labs = [course.resolve_lab(name) for value in (args.labs or []) for name in value.split(",") if name.strip()]
    chosen = build_learner_copy(course, Path(args.out), labs, args.course_url or "")
    print(f"wrote a learner's copy of {len(chosen)} lab(s){found} to {args.out} (no solutions in it): "
          f"cd {args.out}, then its README's two lines (a venv; pip install -e . and pytest)")
    return 0


def _guarded(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except MaintainerError as exc:
            print(f"kata {args.command}: {exc}", file=sys.stderr)
            return exc.code

    return run


def add_commands(commands) -> None:
    """Add the maintainer subcommands to the `kata` parser."""
    p = commands.add_parser("derive", help="rewrite katas/ from solutions/ (maintainers)",
                            description="Every solution block becomes a TODO that raises NotImplementedError.")
    p.add_argument("labs", nargs="*", help="only these labs (file stems, e.g. 04_classifier_free_guidance)")
    p.add_argument("--check", action="store_true", help="report drift and exit 1; write nothing")
    p.add_argument("--root", default=None, help="the course folder (default: found from the working directory)")
    p.set_defaults(run=_guarded(cmd_derive))

    p = commands.add_parser("learner-copy", help="build a learner's copy of the course (no solutions in it)",
                            description="Write OUT with katas/ (all TODO), graders/, pristine/ (for `kata reset`), "
                                        "the engine's source in plugin/, the course's pyproject.toml and a README "
                                        "for learners: a project that installs on its own; solutions/ is left "
                                        "out.")
    p.add_argument("out", metavar="OUT", help="a new (or empty) folder")
    p.add_argument("--labs", action="append", metavar="LABS", help="only these labs (numbers or names, comma lists)")
    p.add_argument("--course-url", metavar="URL", help="the git URL the copy will be published at: the notebooks' "
                                                       "set-up cells fetch the course from it in a fresh runtime "
                                                       "(Colab)")
    p.add_argument("--root", default=None, help="the course folder (default: found from the working directory, else "
                                                "the checkout this package is installed from)")
    p.set_defaults(run=_guarded(cmd_learner_copy))
