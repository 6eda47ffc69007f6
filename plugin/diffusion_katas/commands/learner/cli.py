"""Learner commands of `kata`: watch, progress, hint, reset, explain, see, report.

    kata watch [LAB]          grade a lab, show its verdict and next step, grade again on every save
    kata progress [--fresh]   every lab: solved/total functions and the next TODO (re-grades only what changed)
    kata hint [FUNCTION]      the hint tiers earned for the function you are on (--all: every tier)
    kata reset LAB [FUNCTION] restore a kata file, or one function of it, keeping your version as a backup
    kata explain [LAB]        the lab's lesson (concept, mental model, traps, say it out loud)
    kata see LAB              a PNG: your own functions draw with the trained shapes model, beside diffusers
    kata report               one HTML page: the progress table, failing checks, the next step, the pictures

pytest stays the engine: watch and progress run `python -m pytest ... --kata-json` in a subprocess
(../running.py). Every run that grades katas/, plain pytest included, merges its grades into the last
grading record, .kata/last-grading.json (core/record.py), which hint, progress and watch read. What the
learner's tools remember lives in .kata/ under the course root (workspace.py); hint tiers are in
hints.py, file watching and the verdict in watch.py. Every command takes --root, the course folder.
"""
from __future__ import annotations

import argparse
import ast
import os
import random
import sys
from datetime import datetime
from pathlib import Path

from diffusion_katas.core import lessons, record
from diffusion_katas.core.course import Course, lab_files
from diffusion_katas.core.derive import MarkerError
from diffusion_katas.core.notebooks import function_span
from diffusion_katas.commands.running import (MARKS, VERBS, Grading, WarmGrader, after_grading, changed_labs, counts,
                                               first_unsolved, grade, grading_failed, import_trouble, lab_entry,
                                               load_report, messages, next_todo, pytest_env, record_untouched,
                                               statuses, widen_last_run)
from diffusion_katas.commands.learner import incremental
from diffusion_katas.commands.learner.hints import grader_hints, hint_target, hint_text, reveal
from diffusion_katas.commands.learner.watch import CLEAR, file_events, seconds_text, signature, verdict_lines, wait_for_change
from diffusion_katas.commands.learner.workspace import LearnerError, open_course, resolve_lab


# ---- watch -----------------------------------------------------------------------------------------------
COLUMNS = 100  # what the commands' own lines fit in


def graded_as_saved(warm: WarmGrader, course: Course, lab: str, *args: str) -> Grading:
    """`warm.grade(*args)`, on one version of the lab's files: each check imports the kata file afresh, so a save
    during a grading would grade some checks on one version and some on the next. When the files the lab
    depends on changed while it was graded, what that grading wrote (the record, the hint tiers) is put back and
    the lab is graded again."""
    files = record.depends_on(course, lab)
    for attempt in range(3):
        kept = {p: (p.read_bytes() if p.is_file() else None) for p in (course.record_path, course.hints_path)}
        before = [p.read_bytes() if p.is_file() else None for p in files]
        grading = warm.grade(*args)
        if [p.read_bytes() if p.is_file() else None for p in files] == before:
            return grading
        for path, data in kept.items():  # that grading mixed two versions: it counts for nothing
            if data is None:
                path.unlink(missing_ok=True)
            else:
                path.write_bytes(data)
        print(f"{course.rel(course.kata(lab))} changed while it was graded: grading it again...", flush=True)
    return grading


def keep_merged(course: Course, lab: str, merged: dict) -> None:
    """Write a watch's merged verdict (the functions a save changed, graded now, and the others' verdicts, which
    stand: their code did not change) into the record as the lab's whole grade, with the files as graded: the
    record then knows the lab as it is, and `kata progress` or `kata report` do not call it changed."""
    data = record.load(course)
    entry = record.entry(data, lab)
    now = lab_entry(merged, lab)
    if entry is None or now is None:
        return
    entry["functions"] = [{"name": f["name"], "status": f["status"]} for f in now.get("functions", [])]
    entry["files"], entry["complete"] = record.lab_fingerprint(course, lab), True
    data["results"] = [r for r in data.get("results", []) if r.get("lab") != lab] + [
        record.slim(r) for r in merged.get("results", []) if r.get("lab") == lab
        and r.get("status") not in ("passed", "skipped") and not r.get("hidden")]
    try:
        record.write(course, data)
    except OSError:
        pass


def grade_save(warm: WarmGrader, course: Course, lab: str, last: Grading | None, shape):
    """Grade the lab after a save: only the functions whose code changed (and those that use them) when the
    last grading of this lab stands for the rest, else all of it. Returns (grading, the code it saw, a note)."""
    kata = course.kata(lab)
    now = (incremental.code_shape(kata), record.fingerprint(course.grader(lab)))
    plan = None
    if shape is not None and last is not None and last.report is not None and shape[1] == now[1]:
        plan = incremental.to_regrade(shape[0], now[0])  # the grader unchanged too: its verdicts stand
        graded = {name for name, _ in statuses(lab_entry(last.report, lab) or {})}
        if plan:  # --kata-function takes graded functions only; a changed helper no graded one names: all of it
            plan = (plan & graded) or None
        if plan is not None and plan and graded <= plan:
            plan = None  # every function changed: one grading of the whole lab
    if plan is not None and not plan:
        keep_merged(course, lab, last.report)  # the same code: the record knows the file as it is now
        return last, now, "no code changed since the last grading (comments or blank lines only): its verdict stands"
    if plan is not None:
        names = sorted(plan)
        print(f"grading {', '.join(f'`{n}`' for n in names)} in {course.rel(kata)}...", flush=True)
        partial = graded_as_saved(warm, course, lab, course.rel(kata),
                                  *[a for n in names for a in ("--kata-function", n)])
        merged = incremental.merge(last.report, partial.report, lab, plan) if partial.report else None
        if merged is not None and not incremental.all_pass(merged, lab) and \
                incremental.code_shape(kata) == now[0]:  # the code as planned: the merge stands for the lab
            keep_merged(course, lab, merged)
            others = "the other functions' code is unchanged: their verdicts stand"
            return (Grading(merged, partial.output, partial.returncode, partial.seconds), now,
                    f"graded {', '.join(f'`{n}`' for n in names)} ({others})")
    print(f"grading {course.rel(kata)}...", flush=True)
    grading = graded_as_saved(warm, course, lab, course.rel(kata))
    now = (incremental.code_shape(kata), now[1])  # the code this grading saw (a save during it is graded again)
    return grading, (now if lab_entry(grading.report, lab) is not None else None), None


def cmd_watch(args) -> int:
    course = open_course(args.root)
    if args.interval <= 0:
        raise LearnerError("--interval takes a number of seconds above 0, e.g. --interval 0.5")
    tty = sys.stdout.isatty()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1, 10**6)
    warm = WarmGrader(course, seed)  # one warm pytest process and one seed for the whole session
    try:
        grading = None
        before = {}
        if args.lab:
            lab = resolve_lab(course, args.lab)
        else:
            report = load_report(course)
            stale = changed_labs(course, report)
            report = record_untouched(course, report, stale)  # an untouched lab is all TODO: read, not graded
            stale = changed_labs(course, report)
            if stale:  # grade only the labs the record does not know as they are now
                targets = [course.rel(course.katas)] if report is None else [course.rel(course.kata(l)) for l in stale]
                print(f"grading {len(stale)} lab(s) to find where you are...", flush=True)
                before = {l: signature(course.kata(l)) for l in stale}
                grading = warm.grade(*targets, "--continue-on-collection-errors")
                if grading.report is None:
                    raise LearnerError(grading_failed(grading, ", ".join(targets)), 1)
                report = after_grading(course, report, grading)
            found = next_todo(report)
            if found is None:
                print("every graded function in every lab passes. Watch one anyway with `kata watch LAB`.")
                return 0
            lab = found[0]
            if grading is not None and lab not in before:  # graded before this session: grade it now
                grading = None
        kata = course.kata(lab)
        if not (course.graders / f"{lab}.py").is_file():
            raise LearnerError(f"lab {lab} has no grader ({course.rel(course.graders / (lab + '.py'))}): "
                               "nothing to watch")
        events = file_events()
        how = (f"file events via watchfiles, and a check every {seconds_text(args.interval)} s" if events
               else f"polling every {seconds_text(args.interval)} s")
        header = (f"graded {course.rel(kata)} once · seed {seed}" if args.once else
                  f"watching {course.rel(kata)} ({how}) · seed {seed} · Ctrl-C to stop")
        since = before[lab] if grading is not None and lab in before else signature(kata)
        grading_before = grading
        shape = None  # the code the last grading saw (incremental.py): None until a full grading of this lab
        note = None
        while True:
            if grading is None:
                since = signature(kata)
                grading, shape, note = grade_save(warm, course, lab, grading_before, shape)
            out = [(CLEAR if tty else "") + header, *verdict_lines(course, lab, grading, note)]
            print("\n".join(out), flush=True)
            if args.see:  # after the verdict, so the picture never delays it
                print(see_picture(course, lab), flush=True)
            if not args.once:
                print(f"\nwaiting for a change of {course.rel(kata)}... (Ctrl-C to stop)", flush=True)
            if args.once:
                return 0
            if signature(kata) == since:
                wait_for_change(kata, since, args.interval, events)
            grading_before, grading = grading, None
    except KeyboardInterrupt:
        print("\nstopped watching.", flush=True)
        return 0
    finally:
        warm.close()


# ---- progress --------------------------------------------------------------------------------------------
def progress_lines(course: Course, report: dict, attempted: set[str] = frozenset()) -> list[str]:
    """The table: per lab, solved/total and the next TODO; `attempted`: the labs this command just graded
    (one of them without grades could not be collected)."""
    labs = course.labs()
    width = max([len(lab) for lab in labs] + [3])
    entries = [lab_entry(report, lab) for lab in labs]
    bars = max([counts(entry)[1] for entry in entries if entry is not None] + [6])  # one column for every lab
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
            elif lab not in attempted:
                why = "not graded yet (`kata progress` grades it)"
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
        if lab not in attempted and record.lab_changed(course, entry):
            edited = "  (edited since)" if entry.get("files") else "  (partly graded)"
        lines.append(f"  {lab:<{width}}  {solved:>2}/{total:<2} {bar:<{bars}}  {todo}{edited}")
    found = next_todo(report)
    lines.append("")
    if found is None:
        lines.append("every graded function passes." if report.get("labs") else "nothing was graded.")
    else:
        lab, function, status = found
        lines.append(f"next: {VERBS.get(status, 'fix')} `{function}` in {course.rel(course.kata(lab))}"
                     f"   (kata watch {lab[:2]} · kata hint)")
    return lines


def _saved(report: dict) -> str:
    return str(report.get("saved_at") or "?").replace("T", " ")


def cmd_progress(args) -> int:
    course = open_course(args.root)
    report = load_report(course)
    attempted: set[str] = set()
    if args.cached:
        if report is None:
            raise LearnerError(f"no grading recorded yet ({course.rel(course.record_path)}): run `kata progress` "
                               "once; it grades every lab", 1)
        header = (f"kata progress · last grading, saved {_saved(report)} "
                  "(`kata progress` grades what changed since)")
    else:
        stale = [p.stem for p in lab_files(course.katas) if (course.graders / p.name).is_file()] if args.fresh \
            else changed_labs(course, report)
        # an untouched lab is all TODO, read from its file: nothing to grade
        report = record_untouched(course, report, stale)
        read = [lab for lab in stale if lab_entry(report, lab) is not None and not record.lab_changed(
            course, lab_entry(report, lab))]
        stale = [lab for lab in stale if lab not in read]
        attempted = set(read)
        if not stale and read:
            header = (f"kata progress · {len(read)} untouched lab(s) read as TODO, nothing graded (every function "
                      "still its stub)")
        elif not stale:
            header = (f"kata progress · from the last grading, saved {_saved(report)}: no kata file changed since, "
                      "nothing graded again (`kata progress --fresh` grades every lab)")
        else:
            whole = (report is None or args.fresh) and not read
            targets = [course.rel(course.katas)] if whole else [course.rel(course.kata(lab)) for lab in stale]
            what = f"the {len(stale)} lab(s) in {course.rel(course.katas)}/" if whole else \
                f"{len(stale)} lab(s) not graded yet or changed since their last grading ({', '.join(stale)})"
            print(f"grading {what} in one pytest run...", file=sys.stderr, flush=True)
            grading = grade(course, *targets, "--continue-on-collection-errors")
            if grading.report is None:
                raise LearnerError(grading_failed(grading, ", ".join(targets)), 1)
            report = widen_last_run(course, after_grading(course, report, grading), read)
            attempted |= set(stale)
            seed = grading.report.get("seed")
            header = (f"kata progress · graded in {grading.seconds:.0f} s (seed {seed})" if whole else
                      f"kata progress · graded {', '.join(stale)} again in {grading.seconds:.0f} s (seed {seed}); "
                      + (f"{len(read)} untouched lab(s) read as TODO" if read else
                         "the other labs are from the last grading"))
    import textwrap

    header = textwrap.fill(header, COLUMNS, break_on_hyphens=False, break_long_words=False)  # rows are indented
    print("\n".join([header, *progress_lines(course, report, attempted)]))
    return 0


# ---- hint ------------------------------------------------------------------------------------------------
def cmd_hint(args) -> int:
    course = open_course(args.root)
    report = load_report(course)
    if args.function and args.function[0].isdigit() and not args.lab:  # `kata hint 14`: a lab (no name starts so)
        args.lab, args.function = args.function, None
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
    where = f"{lab} · `{function}`" + (f" ({MARKS.get(status, status)} when last graded)" if status else "")
    if status == "over budget" and not args.all:
        # correct, but too costly: what was measured against what is allowed, not a correctness tier
        text = next((m for m in messages(report, lab, function, ("over budget",)) if m.strip()), "")
        lines = [where, f"`{function}` is correct; it is over budget. What was measured against what is allowed:",
                 *(f"  {line}" for line in text.strip().splitlines() if not line.strip().startswith("reproduce:")),
                 "Make it cheaper without changing its output (no correctness hint is used up by this; "
                 f"`kata hint {function} --all` shows them anyway)."]
        print("\n".join(lines))
        return 0
    if not hints:
        print(f"{where}\nthe grader gives no hints for `{function}`: read the lesson, kata explain {lab[:2]}")
        return 0
    tier, locked = reveal(course, report, lab, function, len(hints), everything=args.all)
    lines = [where, *(hint_text(i + 1, h) for i, h in enumerate(hints[:tier]))]
    if tier >= len(hints):
        lines.append(f"(that is every hint for `{function}`; "
                     f"the traps are in `kata explain {lab[:2]} --section traps`)")
    elif locked:
        lines.append(f"(hint {tier + 1} of {len(hints)} comes after your next failed attempt at `{function}`: "
                     f"save it and grade it — python -m pytest {course.rel(course.kata(lab))} or kata watch {lab[:2]}"
                     f" — then `kata hint` again; stuck? `kata hint --all` shows every tier)")
    else:
        lines.append(f"(run `kata hint` again for hint {tier + 1} of {len(hints)})")
    print("\n".join(lines))
    return 0


# ---- reset -----------------------------------------------------------------------------------------------
def _top_level_names(tree: ast.Module) -> list[str]:
    return [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def reset_function(current: str, pristine: str, function: str, rel: str) -> str:
    """`current` with `def function` as it is in `pristine` (the other functions untouched); a function
    that is gone comes back where the pristine file has it, before the next function still there."""
    try:
        mine = ast.parse(current)
    except SyntaxError as exc:
        raise LearnerError(f"cannot reset `{function}` alone: {rel} does not parse (line {exc.lineno}: {exc.msg}). "
                           f"Fix that line, or reset the whole file: kata reset {Path(rel).stem[:2]}", 1) from None
    theirs = ast.parse(pristine)
    p_lines = pristine.splitlines(keepends=True)
    span = function_span(theirs, p_lines, function)
    if span is None:
        raise LearnerError(f"the pristine {rel} has no function `{function}`; its functions are: "
                           + ", ".join(_top_level_names(theirs)))
    block = p_lines[span[0]:span[1]]
    if block and not block[-1].endswith("\n"):
        block[-1] += "\n"
    lines = current.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    here = function_span(mine, lines, function)
    if here is not None:
        return "".join(lines[:here[0]] + block + lines[here[1]:])
    order = _top_level_names(theirs)
    for name in order[order.index(function) + 1:]:
        at = function_span(mine, lines, name)
        if at is not None:
            return "".join(lines[:at[0]] + block + ["\n", "\n"] + lines[at[0]:])
    return "".join(lines + ["\n", "\n"] + block)


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
    function = args.function
    if function is not None:
        if current is None:
            raise LearnerError(f"{course.rel(kata)} is missing: restore the whole file with `kata reset {lab[:2]}`", 1)
        target = reset_function(current, pristine, function, course.rel(kata))
        what = f"`{function}` in {course.rel(kata)}"
        done = f"`{function}` is TODO again; your other functions are as they were"
    else:
        target = pristine
        what, done = course.rel(kata), "every function is TODO again"
    if current == target:
        print(f"{what} is already pristine: nothing to reset.")
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
            raise LearnerError(f"not resetting {what}: there is no terminal to ask you on. "
                               f"Pass --yes to reset it{keep}.", 1)
        try:
            answer = input(f"Reset {what} ? {kept} [y/N] ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print(f"kept {course.rel(kata)} as it is.")
            return 1
    if backup is not None:
        backup.parent.mkdir(parents=True, exist_ok=True)
        backup.write_text(current, encoding="utf-8")
    kata.parent.mkdir(parents=True, exist_ok=True)
    kata.write_text(target, encoding="utf-8")
    print(f"reset {what}: {done}.")
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


# ---- see -------------------------------------------------------------------------------------------------
def see_picture(course: Course, lab: str) -> str:
    """`kata watch --see`: the lab's picture drawn again from the learner's code, and one line saying how it went
    (`kata see` in a subprocess, as cmd_see runs it, its own output kept to that line)."""
    import subprocess

    out = (course.state / "see" / f"{lab}.png").resolve()
    done = subprocess.run([sys.executable, "-m", "diffusion_katas.engine.see", lab, "--root", str(course.root),
                           "--out", str(out)], cwd=course.root, env=pytest_env(), capture_output=True, text=True,
                          encoding="utf-8", errors="replace")
    lines = [line.strip() for line in done.stdout.splitlines() if line.strip() and not line.startswith("[")]
    if done.returncode == 0:
        detail = next((line for line in lines if line.startswith(("identical", "max |difference|"))), "")
        return f"picture: {course.rel(out)} drawn again from your code" + (f" ({detail})" if detail else "")
    if done.returncode == 3:
        return "picture: " + (lines[-1].removeprefix("kata see: ") if lines else "none for this lab")
    return "picture: not drawn: " + (lines[-1] if lines else f"kata see exited with {done.returncode}")


def cmd_see(args) -> int:
    """`python -m diffusion_katas.engine.see` in a subprocess (the commands import nothing of the engine; the
    learner's code runs in a runner process of that one's, as in grading)."""
    import subprocess

    course = open_course(args.root)
    lab = resolve_lab(course, args.lab)
    # the solutions' picture has a folder of its own: it is never shown (by `kata report`) as the learner's
    default = course.state / "see" / ("solutions" if args.solutions else "") / f"{lab}.png"
    out = (args.out or default).resolve()
    command = [sys.executable, "-m", "diffusion_katas.engine.see", lab, "--root", str(course.root), "--out", str(out),
               "--seed", str(args.seed), "--steps", str(args.steps)]
    if args.solutions:
        command.append("--solutions")
    done = subprocess.run(command, cwd=course.root, env=pytest_env())
    return done.returncode


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
    watch.add_argument("--see", action="store_true",
                       help="after each verdict, draw the lab's `kata see` picture again from your code (labs with "
                            "a picture; a few seconds, after the verdict)")
    watch.add_argument("--seed", type=int, default=None, metavar="N",
                       help="the graders' input seed for the whole session (default: a fresh one, shown)")

    progress = add("progress", cmd_progress, "every lab: functions solved and the next TODO",
                   "Print solved/total functions and the next TODO per lab, from the last grading "
                   "(.kata/last-grading.json, which every pytest run of katas/ updates), grading again, in one "
                   "pytest run, only the labs whose kata file changed since.")
    progress.add_argument("--cached", action="store_true",
                          help="print the last grading without grading anything (changed labs are marked)")
    progress.add_argument("--fresh", action="store_true", help="grade every lab again")

    hint = add("hint", cmd_hint, "the hint tiers you have earned for the function you are on",
               "Show the hint tiers (nudge, the math, near code) of the current TODO (the first function not "
               "passing in the lab graded last, as .kata/last-grading.json records it) or of FUNCTION. Tier 1 "
               "is free; each further tier comes after a failed grading of the function since the tier before "
               "was shown (an OVER BUDGET grading is correct: it uses up no tier, and the hint shows the cost). "
               "What was shown is remembered in .kata/hints.json.")
    hint.add_argument("function", nargs="?", metavar="FUNCTION|LAB",
                      help="a kata function, or a lab by number or name for its current TODO (default: the current "
                           "TODO of the lab graded last)")
    hint.add_argument("--lab", metavar="LAB", help="the lab of FUNCTION, by number or name")
    hint.add_argument("--all", action="store_true", help="show every tier now (for when you are stuck)")

    reset = add("reset", cmd_reset, "restore a kata file, or one function of it, to its TODOs (backed up)",
                "Restore katas/LAB.py, or only FUNCTION in it, to its pristine form (derived from solutions/LAB.py, "
                "or kept in pristine/ in a learner's copy); the other functions stay as they are. The whole file "
                "as it was is kept in .kata/backups/ first. Asks before it overwrites.")
    reset.add_argument("lab", metavar="LAB", help="lab number or name, e.g. 01 or 01_forward_noise")
    reset.add_argument("function", nargs="?", metavar="FUNCTION",
                       help="restore only this function (default: the whole file)")
    reset.add_argument("--yes", "-y", action="store_true", help="do not ask (needed without a terminal)")

    lesson = add("explain", cmd_explain, "read a lab's lesson in the terminal",
                 "Print a lab's lesson: concept, mental model, traps, how to say it out loud.")
    lesson.add_argument("lab", nargs="?", metavar="LAB", help="lab number or name; omit to list the labs")
    lesson.add_argument("--section", choices=[s.lower() for s in lessons.SECTIONS], help="print one section only")

    see = add("see", cmd_see, "a picture: your own functions draw with the trained shapes model, beside diffusers",
              "Run your functions of LAB with the course's one trained model, a tiny class-conditional "
              "UNet2DModel that draws circles, squares and triangles, in a process of their own as in grading, and "
              "write a PNG beside diffusers' from the same seed: lab 01 your schedules' curves and add_noise, lab 02 "
              "your ddim_step's samples and x0 predictions over the steps, lab 05 your generate()'s samples, lab 15 your EDM loop on a 2-D toy "
              "set (two moons); with their differences. On a TODO kata it says which function to write first.")
    see.add_argument("lab", metavar="LAB", help="lab number or name (so far: 01, 02, 05, 15)")
    see.add_argument("--out", type=Path, default=None, metavar="PNG",
                     help="where to write the picture (default: .kata/see/LAB.png in the course)")
    see.add_argument("--solutions", action="store_true", help="draw with solutions/LAB.py instead of your kata")
    see.add_argument("--seed", type=int, default=0, metavar="N", help="the sampling seed (default: 0)")
    see.add_argument("--steps", type=int, default=25, metavar="N", help="sampling steps (default: 25)")

    from diffusion_katas.commands.learner.report import cmd_report

    report = add("report", cmd_report, "one HTML page: progress, failing checks, the next step, kata see's pictures",
                 "Write one static HTML page (default .kata/report.html; readable offline, no server, no script) from "
                 "the last grading (.kata/last-grading.json), grading nothing: every lab's solved/total, TODO, "
                 "failing and over-budget functions, each failing check's message, the next step with the hints "
                 "earned for it, and the pictures `kata see` wrote (.kata/see/*.png).")
    report.add_argument("--out", type=Path, default=None, metavar="HTML",
                        help="where to write the page (default: .kata/report.html in the course)")
    again = report.add_mutually_exclusive_group()
    again.add_argument("--update", action="store_true",
                       help="first grade the labs changed since the last grading, as `kata progress` does")
    again.add_argument("--fresh", action="store_true", help="first grade every lab again")
