"""Learner commands of `kata`: watch, progress, hint, reset, explain.

    kata watch [LAB]          grade a lab, show its verdict and next step, grade again on every save
    kata progress [--cached]  every lab: solved/total functions and the next TODO
    kata hint [FUNCTION]      one more hint tier for the function you are on (remembered)
    kata reset LAB            restore a kata file to its TODOs, keeping your version as a backup
    kata explain [LAB]        the lab's lesson (concept, mental model, traps, say it out loud)

pytest stays the engine: watch and progress run `python -m pytest ... --kata-json` in a subprocess
and read the report (plugin/grading_run.py). What the learner's tools remember lives in .kata/ under
the repository root (plugin/workspace.py); hint tiers are in plugin/hints_state.py, file watching and
the verdict in plugin/watch.py. Every command takes --root, the repository root.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from datetime import datetime
from pathlib import Path

from diffusion_katas.core import lessons
from diffusion_katas.core.course import Course, lab_files
from diffusion_katas.core.derive import MarkerError
from diffusion_katas.commands.running import (MARKS, VERBS, WarmGrader, counts, first_unsolved, grade, grading_failed, import_trouble,
                                lab_entry, load_report, next_todo, save_report, statuses)
from diffusion_katas.commands.learner.hints import grader_hints, hint_target, hint_text, reveal_next
from diffusion_katas.commands.learner.watch import CLEAR, file_events, seconds_text, signature, verdict_lines, wait_for_change
from diffusion_katas.commands.learner.workspace import LearnerError, open_course, resolve_lab


# ---- watch -----------------------------------------------------------------------------------------------
def cmd_watch(args) -> int:
    course = open_course(args.root)
    if args.interval <= 0:
        raise LearnerError("--interval takes a number of seconds above 0, e.g. --interval 0.5")
    tty = sys.stdout.isatty()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    warm = WarmGrader(course, seed)  # one warm pytest process and one seed for the whole session
    try:
        grading = None
        if args.lab:
            lab = resolve_lab(course, args.lab)
        else:
            labs = lab_files(course.katas)
            print(f"grading the {len(labs)} lab(s) in {course.rel(course.katas)}/ to find where you are...",
                  flush=True)
            before = {p.stem: signature(p) for p in labs}
            grading = warm.grade(course.rel(course.katas), "--continue-on-collection-errors")
            if grading.report is None:
                raise LearnerError(grading_failed(grading, f"{course.rel(course.katas)}/"), 1)
            save_report(course, grading.report)
            found = next_todo(grading.report)
            if found is None:
                print("every graded function in every lab passes. Watch one anyway with `kata watch LAB`.")
                return 0
            lab = found[0]
        kata = course.kata(lab)
        if not (course.graders / f"{lab}.py").is_file():
            raise LearnerError(f"lab {lab} has no grader ({course.rel(course.graders / (lab + '.py'))}): "
                               "nothing to watch")
        events = file_events()
        how = (f"file events via watchfiles, and a check every {seconds_text(args.interval)} s" if events
               else f"polling every {seconds_text(args.interval)} s")
        header = f"watching {course.rel(kata)} ({how}) · seed {seed} · Ctrl-C to stop"
        since = before[lab] if grading is not None and lab in before else signature(kata)
        while True:
            if grading is None:
                print(f"grading {course.rel(kata)}...", flush=True)
                since = signature(kata)
                grading = warm.grade(course.rel(kata))
                if grading.report is not None:
                    save_report(course, grading.report, only_labs={lab})
            out = [(CLEAR if tty else "") + header, *verdict_lines(course, lab, grading)]
            if not args.once:
                out += ["", f"waiting for a change of {course.rel(kata)}... (Ctrl-C to stop)"]
            print("\n".join(out), flush=True)
            if args.once:
                return 0
            if signature(kata) == since:
                wait_for_change(kata, since, args.interval, events)
            grading = None
    except KeyboardInterrupt:
        print("\nstopped watching.", flush=True)
        return 0
    finally:
        warm.close()


# ---- progress --------------------------------------------------------------------------------------------
def progress_lines(course: Course, report: dict, cached: bool) -> list[str]:
    labs = course.labs()
    width = max([len(lab) for lab in labs] + [3])
    lines = []
    for lab in labs:
        entry = lab_entry(report, lab)
        kata = course.kata(lab)
        if not kata.is_file():
            lines.append(f"  {lab:<{width}}    -   {course.rel(kata)} is missing: `kata reset {lab[:2]}` restores it")
            continue
        if entry is None:
            if not (course.graders / f"{lab}.py").is_file():
                why = f"not graded: it has no grader ({course.rel(course.graders / (lab + '.py'))})"
            elif lab not in report.get("attempted", [lab]):
                why = "not graded yet (`kata progress` grades every lab)"
            else:
                why = f"not graded: pytest could not collect it (`python -m pytest {course.rel(kata)}` shows why)"
            lines.append(f"  {lab:<{width}}    ?   {why}")
            continue
        solved, total = counts(entry)
        bar = "#" * solved + "." * (total - solved)
        found = first_unsolved(entry)
        trouble = import_trouble(report, entry)
        if trouble:
            todo = trouble
        elif found:
            todo = f"next: {found[0]} ({MARKS[found[1]]})"
        else:
            todo = "solved"
        edited = ""
        graded_at = entry.get("graded_at")
        if cached and graded_at:
            try:
                if datetime.fromtimestamp(kata.stat().st_mtime) > datetime.fromisoformat(graded_at):
                    edited = "  (edited since)"
            except (OSError, ValueError):
                pass
        lines.append(f"  {lab:<{width}}  {solved:>2}/{total:<2} {bar:<{max(total, 6)}}  {todo}{edited}")
    found = next_todo(report)
    lines.append("")
    if found is None:
        lines.append("every graded function passes." if report.get("labs") else "nothing was graded.")
    else:
        lab, function, status = found
        lines.append(f"next: {VERBS.get(status, 'fix')} `{function}` in {course.rel(course.kata(lab))}"
                     f"   (kata watch {lab[:2]} · kata hint)")
    return lines


def cmd_progress(args) -> int:
    course = open_course(args.root)
    if args.cached:
        report = load_report(course)
        if report is None:
            raise LearnerError(f"no report yet ({course.rel(course.report_path)}): run `kata progress` "
                               "once; it grades every lab", 1)
        header = (f"kata progress · last report, saved {report.get('saved_at', '?').replace('T', ' ')} "
                  "(`kata progress` grades again)")
    else:
        labs = lab_files(course.katas)
        print(f"grading the {len(labs)} lab(s) in {course.rel(course.katas)}/ in one pytest run...",
              file=sys.stderr, flush=True)
        grading = grade(course, course.rel(course.katas), "--continue-on-collection-errors")
        if grading.report is None:
            raise LearnerError(grading_failed(grading, f"{course.rel(course.katas)}/"), 1)
        report = save_report(course, grading.report)
        header = f"kata progress · graded in {grading.seconds:.0f} s (seed {report.get('seed')})"
    print("\n".join([header, *progress_lines(course, report, args.cached)]))
    return 0


# ---- hint ------------------------------------------------------------------------------------------------
def cmd_hint(args) -> int:
    course = open_course(args.root)
    report = load_report(course)
    lab = resolve_lab(course, args.lab) if args.lab else None
    lab, function, status = hint_target(course, report, lab, args.function)
    hints_by_function = grader_hints(course, lab)
    if function not in hints_by_function:
        raise LearnerError(f"{lab} has no graded function `{function}`; its functions are: "
                           + ", ".join(hints_by_function))
    if status is None:
        entry = lab_entry(report, lab)
        status = dict(statuses(entry)).get(function) if entry else None
    hints = hints_by_function[function]
    where = f"{lab} · `{function}`" + (f" ({MARKS.get(status, status)} in the last report)" if status else "")
    if not hints:
        print(f"{where}\nthe grader gives no hints for `{function}`: read the lesson, kata explain {lab[:2]}")
        return 0
    tier = reveal_next(course, lab, function, len(hints))
    lines = [where, *(hint_text(i + 1, h) for i, h in enumerate(hints[:tier]))]
    if tier < len(hints):
        lines.append(f"(run `kata hint` again for hint {tier + 1} of {len(hints)})")
    else:
        lines.append(f"(that is every hint for `{function}`; "
                     f"the traps are in `kata explain {lab[:2]} --section traps`)")
    print("\n".join(lines))
    return 0


# ---- reset -----------------------------------------------------------------------------------------------
def cmd_reset(args) -> int:
    course = open_course(args.root)
    lab = resolve_lab(course, args.lab)
    kata = course.kata(lab)
    try:
        pristine = course.pristine_text(lab)
    except FileNotFoundError as exc:
        raise LearnerError(f"cannot reset: {exc}", 1) from None
    except MarkerError as exc:
        raise LearnerError(f"cannot reset {course.rel(kata)}: {exc}", 1) from None
    current = kata.read_text(encoding="utf-8") if kata.is_file() else None
    if current == pristine:
        print(f"{course.rel(kata)} is already pristine: nothing to reset.")
        return 0
    backup = None
    if current is not None:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        backup = course.backups / f"{lab}-{stamp}.py"
        number = 1
        while backup.exists():
            backup = course.backups / f"{lab}-{stamp}-{number}.py"
            number += 1
    if not args.yes:
        kept = f"Your version is kept in {course.rel(backup)}" if backup else "There is no file there now"
        if not sys.stdin.isatty():
            keep = f" (your version will be kept in {course.rel(course.backups)}/)" if backup else ""
            raise LearnerError(f"not resetting {course.rel(kata)}: there is no terminal to ask you on. "
                               f"Pass --yes to reset it{keep}.", 1)
        try:
            answer = input(f"Reset {course.rel(kata)} ? {kept} [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print(f"kept {course.rel(kata)} as it is.")
            return 1
    if backup is not None:
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_text(current, encoding="utf-8")
    kata.parent.mkdir(parents=True, exist_ok=True)
    kata.write_text(pristine, encoding="utf-8")
    print(f"reset {course.rel(kata)}: every function is TODO again.")
    if backup is not None:
        print(f"your version: {course.rel(backup)}  (compare: diff {course.rel(backup)} {course.rel(kata)})")
    return 0


# ---- explain ---------------------------------------------------------------------------------------------
def cmd_explain(args) -> int:
    course = open_course(args.root)
    if not args.lab:
        for lab in course.labs():
            print(f"{lab:<32} {_lesson_title(course, lab)}")
        print("\nread one: kata explain NN [--section traps]")
        return 0
    lab = resolve_lab(course, args.lab)
    path = _lesson_source(course, lab)
    print(lessons.render(path, args.section))
    return 0


def _lesson_source(course: Course, lab: str) -> Path:
    """The kata file, unless it is gone or does not parse: then the solution or pristine copy (same docstring)."""
    path = course.lesson_source(lab)
    if path is None:
        raise LearnerError(f"cannot read the lesson of {lab}: {course.rel(course.kata(lab))} does not parse "
                           "and there is no solution or pristine file to read it from", 1)
    return path


def _lesson_title(course: Course, lab: str) -> str:
    try:
        return lessons.lesson(_lesson_source(course, lab))[0]
    except LearnerError:
        return "(does not parse)"


# ---- the parser ------------------------------------------------------------------------------------------
def _runner(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except LearnerError as exc:
            print(f"kata {args.command}: {exc}", file=sys.stderr)
            return exc.code
        except KeyboardInterrupt:
            print("\ninterrupted.", file=sys.stderr)
            return 130
        except BrokenPipeError:  # `kata progress | head`: the reader left; say nothing more
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            except (OSError, ValueError):
                pass
            return 0

    return run


def add_commands(commands) -> None:
    """Add the learner subcommands to the `kata` parser."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=None, metavar="DIR",
                        help="the course folder (holding katas/ and graders/); default: the one at or "
                             "above the working directory")

    def add(name, fn, help_text, description):
        parser = commands.add_parser(name, parents=[common], help=help_text, description=description)
        parser.set_defaults(run=_runner(fn))
        return parser

    watch = add("watch", cmd_watch, "grade a lab, show what to do next, grade again on every save",
                "Grade a lab with pytest, show each function's status, the next function with its hint "
                "and the first failure's text; then grade again each time the kata file changes.")
    watch.add_argument("lab", nargs="?", metavar="LAB",
                       help="lab number or name (default: the first lab not fully solved)")
    watch.add_argument("--interval", type=float, default=1.0, metavar="S",
                       help="seconds between checks of the file's mtime and size (default: 1.0)")
    watch.add_argument("--once", action="store_true", help="grade once, show the verdict and exit")
    watch.add_argument("--seed", type=int, default=None, metavar="N",
                       help="the graders' input seed for the whole session (default: a fresh one, shown)")

    progress = add("progress", cmd_progress, "every lab: functions solved and the next TODO",
                   "Grade every lab in one pytest run and print solved/total functions and the next TODO "
                   "per lab. The report is kept in .kata/last-report.json.")
    progress.add_argument("--cached", action="store_true",
                          help="print the last report (.kata/last-report.json) without grading")

    hint = add("hint", cmd_hint, "one more hint tier for the function you are on",
               "Show the next hint tier (nudge, the math, near code) of the current TODO (the first "
               "function not passing in the last report) or of FUNCTION; tiers revealed are remembered "
               "in .kata/hints.json.")
    hint.add_argument("function", nargs="?", metavar="FUNCTION", help="a kata function (default: the current TODO)")
    hint.add_argument("--lab", metavar="LAB", help="the lab of FUNCTION, by number or name")

    reset = add("reset", cmd_reset, "restore a kata file to its TODOs (your version is backed up)",
                "Restore katas/LAB.py to its pristine form (derived from solutions/LAB.py, or kept in pristine/ "
                "in a learner's copy); your version is "
                "kept in .kata/backups/ first. Asks before it overwrites.")
    reset.add_argument("lab", metavar="LAB", help="lab number or name, e.g. 01 or 01_forward_noise")
    reset.add_argument("--yes", "-y", action="store_true", help="do not ask (needed without a terminal)")

    lesson = add("explain", cmd_explain, "read a lab's lesson in the terminal",
                 "Print a lab's lesson: concept, mental model, traps, how to say it out loud.")
    lesson.add_argument("lab", nargs="?", metavar="LAB", help="lab number or name; omit to list the labs")
    lesson.add_argument("--section", choices=[s.lower() for s in lessons.SECTIONS], help="print one section only")
