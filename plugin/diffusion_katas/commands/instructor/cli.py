"""Instructor commands of `kata`: class, gradescope-bundle, classroom.

    kata class SUBMISSION_DIR... --out DIR   grade every submission in its own process, in parallel;
                                             class.csv, checks.csv, class.md, class.json, gradescope/
    kata gradescope-bundle --out autograder.zip
                                             a Gradescope autograder (setup.sh, run_autograder, project/)
    kata classroom [--out .github]           a GitHub Classroom autograding workflow, one test per kata function
    kata autograde --project P --submission S --results R
                                             what a bundle's run_autograder calls for one submission

This module holds the commands and their options. How a submission is graded (shared by `kata class`
and the Gradescope autograder) is told in classgrade.py; the parts live in catalog.py (what the graders
declare), submissions.py (scratch projects), children.py (grading processes), scoring.py (reports to
grades), bundle.py (the autograder zip and the `kata autograde` it runs) and classroom.py (the workflow).
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from diffusion_katas.core.course import Course, CourseNotFound
from diffusion_katas.commands.instructor.bundle import DEFAULT_AUTOGRADER_TIMEOUT, autograde, write_bundle
from diffusion_katas.commands.instructor.catalog import InstructorError, load_catalog, number_text, select_labs
from diffusion_katas.commands.instructor.classgrade import DEFAULT_CLASS_TIMEOUT, DEFAULT_JOBS, grade_class
from diffusion_katas.commands.instructor.classroom import classroom_result, write_workflow
from diffusion_katas.commands.instructor.hidden import load_hidden
from diffusion_katas.core.results import validate_gradescope  # noqa: F401  (the results.json check, offered here too)



def _course(args) -> Course:
    """The course at --root, or the one found at or above the working directory."""
    try:
        return Course.at(args.root)
    except CourseNotFound as exc:
        raise InstructorError(str(exc)) from None


def read_hidden_seed(args) -> str | None:
    """The instructor's hidden seed from --hidden-seed-file (read, then closed), or asked for with '-'."""
    if getattr(args, "hidden_seed", None) is not None:
        raise InstructorError("the hidden seed is never given on the command line (every process on this machine, "
                              "a submission's included, can read command lines): put it in a file and pass "
                              "--hidden-seed-file FILE, or --hidden-seed-file - to be asked for it")
    path = getattr(args, "hidden_seed_file", None)
    if path is None:
        return None
    if path == "-":
        import getpass

        text = getpass.getpass("hidden seed: ") if sys.stdin.isatty() else sys.stdin.readline()
    else:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.readline()
        except OSError as exc:
            raise InstructorError(f"--hidden-seed-file {path}: {exc.strerror or exc}") from None
    secret = text.strip()
    if not secret:
        raise InstructorError(f"--hidden-seed-file {path}: no secret in it (its first line is empty)")
    if len(secret) < 16:
        print(f"kata: note: a hidden seed of {len(secret)} characters can be guessed from the hidden inputs a "
              "submission receives; a long random one cannot (python -c \"import secrets; "
              "print(secrets.token_hex(16))\" > hidden-seed.txt)", file=sys.stderr)
    return secret


# ---- the commands ------------------------------------------------------------------------------------------
def cmd_class(args) -> int:
    course = _course(args)
    if args.jobs < 1:
        raise InstructorError("--jobs must be at least 1")
    if args.timeout <= 0:
        raise InstructorError("--timeout must be a positive number of seconds")
    labs = select_labs(course, args.labs)
    catalog = load_catalog(course, labs)
    hidden = load_hidden(course, catalog, read_hidden_seed(args), args.hidden_cases)  # checked before anyone is graded
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10**6)
    grade_class(course, catalog, args, hidden)
    return 0


def cmd_gradescope_bundle(args) -> int:
    course = _course(args)
    labs = select_labs(course, args.labs)
    catalog = load_catalog(course, labs)
    hidden = load_hidden(course, catalog, read_hidden_seed(args), args.hidden_cases)
    out = Path(args.out)
    write_bundle(out, course, catalog, args, hidden)
    print(f"wrote {out}: a Gradescope autograder for {', '.join(labs)} ({number_text(catalog.points())} points); "
          "upload it as the assignment's autograder (setup.sh installs the pinned dependencies)")
    return 0


def cmd_classroom(args) -> int:
    course = _course(args)
    labs = select_labs(course, args.labs)
    if not 1 <= args.timeout_minutes <= 60:
        raise InstructorError("--timeout-minutes must be between 1 and 60 (the command grader's limit)")
    catalog = load_catalog(course, labs)
    path = Path(args.out) / "workflows" / "classroom.yml"
    write_workflow(path, catalog, args.python, args.timeout_minutes, args.force, course)
    print(f"wrote {path}: {len(catalog.all_functions())} test(s), one per kata function of {len(labs)} lab(s), "
          f"{number_text(catalog.points())} points in all")
    return 0


def cmd_classroom_result(args) -> int:
    return classroom_result(args.report, args.lab, args.function)


# ---- the parser --------------------------------------------------------------------------------------------
def _guarded(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except InstructorError as exc:
            print(f"kata {args.command}: {exc}", file=sys.stderr)
            return exc.code

    return run


def _labs_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--labs", action="append", metavar="LAB",
                        help=f"{what} only these labs ('01', '01_forward_noise'; repeat or comma-separate); "
                             "default: all")


def _hidden_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden-seed-file", metavar="FILE",
                        help="also run the hidden checks, drawn from the secret in FILE (its first line: any text, "
                             "best a long random one); '-' asks for it. Never on the command line, which every "
                             "process of the machine can read")
    parser.add_argument("--hidden-seed", metavar="N", help=argparse.SUPPRESS)  # refused: see read_hidden_seed
    parser.add_argument("--hidden-cases", metavar="FILE",
                        help='JSON file of extra hidden cases {"lab::function::check": [case, ...]}')
    parser.add_argument("--hidden-output", choices=("name-only", "full"),
                        help="what a failing hidden check shows (default: its name only)")
    parser.add_argument("--kata-timeout", type=float, metavar="SECONDS",
                        help="per-check time limit (pytest-timeout; default: the project's kata_timeout)")


def add_commands(commands) -> None:
    """Add the instructor subcommands to the `kata` parser."""
    p = commands.add_parser(
        "class", help="grade a class of submissions, each in its own process, in parallel",
        description="Grade every submission folder (kata files NN_lab.py in it or in a katas/ subfolder) in a "
                    "scratch copy, in its own pytest process under a wall-clock limit; write class.csv, "
                    "checks.csv, class.md, class.json and gradescope/<learner>.json in --out.")
    p.add_argument("submissions", nargs="+", metavar="SUBMISSION_DIR", help="one folder per learner")
    p.add_argument("--out", required=True, metavar="DIR", help="where the class results go")
    p.add_argument("--jobs", type=int, default=DEFAULT_JOBS, metavar="N",
                   help=f"submissions graded at once (default {DEFAULT_JOBS}; items marked cuda always run one "
                        "at a time, in a second pass)")
    p.add_argument("--timeout", type=float, default=DEFAULT_CLASS_TIMEOUT, metavar="S",
                   help=f"wall-clock seconds per submission and pass before its process group is killed and it "
                        f"scores 0 (default {DEFAULT_CLASS_TIMEOUT:g})")
    p.add_argument("--seed", type=int, metavar="N", help="the graders' input seed, the same for every learner "
                                                         "(default: a fresh one, printed and recorded)")
    _labs_option(p, "grade")
    _hidden_options(p)
    p.add_argument("--root", default=None, help="the course folder (holds graders/ and pyproject.toml); "
                   "default: the one at or above the working directory")
    p.set_defaults(run=_guarded(cmd_class))

    p = commands.add_parser(
        "gradescope-bundle", help="build a Gradescope autograder zip (setup.sh, run_autograder, the project)",
        description="Build a Gradescope autograder: setup.sh installs the pinned dependencies and the bundled "
                    "project; run_autograder grades /autograder/submission's kata files and writes "
                    "/autograder/results/results.json (zero with the reason when grading reports nothing).")
    p.add_argument("--out", default="autograder.zip", metavar="ZIP", help="the zip to write (default autograder.zip)")
    p.add_argument("--timeout", type=float, default=DEFAULT_AUTOGRADER_TIMEOUT, metavar="S",
                   help=f"wall-clock seconds per submission (default {DEFAULT_AUTOGRADER_TIMEOUT:g}); keep it "
                        "below the assignment's Gradescope timeout so a hang still scores 0 with a reason")
    _labs_option(p, "grade")
    _hidden_options(p)
    p.add_argument("--root", default=None, help="the course folder (default: found from the working directory)")
    p.set_defaults(run=_guarded(cmd_gradescope_bundle))

    p = commands.add_parser(
        "classroom", help="write a GitHub Classroom autograding workflow (one test per kata function)",
        description="Write OUT/workflows/classroom.yml and OUT/kata-grading.ini: a check that the grading files "
                    "are the instructor's, one grading of every lab, then one "
                    "classroom-resources/autograding-command-grader test per kata function (max-score = its "
                    "points) and the autograding-grading-reporter step.")
    p.add_argument("--out", default=".github", metavar="DIR", help="the .github folder (default .github)")
    p.add_argument("--python", default="3.11", help="Python version for actions/setup-python (default 3.11)")
    p.add_argument("--timeout-minutes", type=int, default=10, help="per-lab limit in minutes (default 10): the "
                   "grading step may take this times the number of labs, at most 360")
    p.add_argument("--force", action="store_true", help="overwrite an existing, different classroom.yml")
    _labs_option(p, "include")
    p.add_argument("--root", default=None, help="the course folder (default: found from the working directory)")
    p.set_defaults(run=_guarded(cmd_classroom))

    p = commands.add_parser(
        "classroom-result", help="one kata function's test in the Classroom workflow (exit 0 when it passes)",
        description="Read the workflow's grading report (--kata-json) and exit 0 when LAB's FUNCTION passes, "
                    "else 1, saying which checks failed.")
    p.add_argument("report", type=Path, help="the grading report")
    p.add_argument("lab", help="the lab's file stem, e.g. 01_forward_noise")
    p.add_argument("function", help="the kata function")
    p.set_defaults(run=_guarded(cmd_classroom_result))

    p = commands.add_parser(
        "autograde", help="grade one Gradescope submission and write results.json (run_autograder calls it)",
        description="What a Gradescope autograder built by `kata gradescope-bundle` runs for each submission.")
    p.add_argument("--project", required=True, type=Path, help="the bundled project")
    p.add_argument("--submission", required=True, type=Path, help="the submission folder")
    p.add_argument("--results", required=True, type=Path, help="where results.json goes")
    p.set_defaults(run=_guarded(lambda args: autograde(args.project, args.submission, args.results)))
