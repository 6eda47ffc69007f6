"""Reporting: TODO as its own status, failure messages that teach, the per-lab progress table.

A kata function still raising NotImplementedError is reported as TODO ("T" / "TODO"), not as a
failure with a traceback; the run still exits non-zero until every kata passes.
"""
from __future__ import annotations

import pytest

from diffusion_katas.core.results import Reason, Result, Status
from diffusion_katas.pytest_plugin import session as state

COLUMNS = 100  # what the summary's lines fit in


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[:width - 1].rstrip() + "…"


def fill(text: str, indent: str) -> str:
    import textwrap

    return textwrap.fill(text, COLUMNS, initial_indent=indent, subsequent_indent=indent + "  ",
                         break_on_hyphens=False, break_long_words=False)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Say what is graded and with which seed (inside a course only)."""
    session = config.stash.get(state.SESSION, None)
    if session is None:
        return []
    what = session.rel(session.solutions_dir if session.grade_solutions else session.kata_dir)
    return [f"katas: grading {what}/ with seed {session.seed} "
            f"(reproduce with --kata-seed {session.seed})"]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if not hasattr(item, "kata") or not hasattr(item, "check_name"):  # not a kata item
        return report
    if report.when == "setup":
        session = item.config.stash[state.SESSION]
        if session.keeps_record and item.lab not in session.fingerprints:
            from diffusion_katas.core import record

            session.fingerprints[item.lab] = record.lab_fingerprint(session.course, item.lab)
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        status, reason, detail = classify(call.excinfo, report)
        if status == Status.PASSED and getattr(item, "measurements", None):
            detail = headroom(item.measurements)  # a passing budget shows how close it came
        report.kata_status, report.kata_reason = status.value, reason.value
        session = item.config.stash[state.SESSION]
        if item.hidden and session.hidden_output == "name-only":
            detail = ""  # a hidden check's detail could carry text of the learner's making (a message, a name)
        message = "" if report.passed else str(report.longrepr or "")
        printed = "" if report.passed or item.hidden else printed_output(report)  # hidden inputs stay hidden
        session.results.append(Result(
            item.nodeid, item.lab, item.parent.title, item.kata.name, item.check_name, status,
            item.kata.points, message, report.duration, item.hidden, reason, detail, printed))
    return report


OUTPUT_KEPT = 8000  # characters of printed output a result keeps (the runner caps each call's at 4,000)


def printed_output(report) -> str:
    """What the item's run printed (pytest's captured stdout and stderr sections), capped."""
    text = "".join(content for title, content in report.sections if title.startswith("Captured std"))
    if len(text) <= OUTPUT_KEPT:
        return text
    return text[:OUTPUT_KEPT] + f"\n... ({len(text):,} characters, {OUTPUT_KEPT:,} kept)"


def classify(excinfo, report) -> tuple[Status, Reason, str]:
    """(status, reason code, reason in a few words) of a kata item's outcome, from the exception type."""
    from diffusion_katas.core.spec import KataFailure, OverBudget
    from diffusion_katas.pytest_plugin.outcomes import BudgetWaits, KataTodo, LearnerCrash

    if report.passed:
        return Status.PASSED, Reason.NONE, ""
    if report.skipped:
        return Status.SKIPPED, Reason.SKIPPED, ""
    if excinfo is None:
        return Status.FAILED, Reason.CRASH, ""
    if excinfo.errisinstance(KataTodo):
        waits_on = excinfo.value.waits_on
        return Status.TODO, (Reason.WAITS_ON if waits_on else Reason.TODO), waits_on
    if excinfo.errisinstance(OverBudget):
        return Status.OVER_BUDGET, Reason.OVER_BUDGET, ""
    if excinfo.errisinstance(BudgetWaits):
        return Status.WAITING, Reason.WAITS_ON, f"check '{excinfo.value.check}'"
    if excinfo.errisinstance(KataFailure):
        return Status.FAILED, excinfo.value.reason, excinfo.value.detail
    if excinfo.errisinstance(LearnerCrash):
        exc = excinfo.value.exc
        return Status.FAILED, Reason.CRASH, f"{exc.type_name}: {exc.message}"[:200]
    if excinfo.errisinstance(pytest.fail.Exception) and "Timeout" in str(excinfo.value):
        return Status.FAILED, Reason.TIMEOUT, "timed out (per-check limit)"
    return Status.FAILED, Reason.CRASH, f"{excinfo.typename}"


def _crash_trap_lines(crash) -> str:
    if crash.trap is None:
        return ""
    if crash.first_shows_after:
        why = (f"your function was right on the {crash.first_shows_after} case(s) before this one, where this mistake "
               "does not show either; this is the first case where it does, and no other listed mistake fits so")
    elif getattr(crash.trap, "fn", None) is None:  # not a declared mistake: what the call was seen to do
        why = "the call that raised changed it"
    else:
        why = "it raises the same error on these inputs"
    return f"  trap: {crash.trap.name} ({why})\n    {crash.trap.hint}\n"


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    status = getattr(report, "kata_status", None)
    if status == "todo":
        return "todo", "T", ("TODO", {"yellow": True})
    if status == "over budget":
        return "over budget", "B", ("OVER BUDGET", {"red": True})
    if status == "waiting":
        return "waiting", "w", ("WAITING", {"yellow": True})
    return None


def hint_lines(item, first_only: bool = False) -> list[str]:
    """The hint tiers this learner has earned for this function (one more per repeated failure)."""
    session = item.config.stash[state.SESSION]
    hints = item.kata.hints
    if not hints:
        return []
    key = f"{item.lab}::{item.kata.name}"
    if first_only:
        tiers = 1
    else:
        # One tier per failed grading, on from what this learner has seen (here or through `kata hint`); every
        # message of this grading shows the same tiers.
        from diffusion_katas.core.tiers import on_failure

        if key not in session.tiers_now:
            session.tiers_now[key] = (min(len(hints), session.hint_tiers) if session.hint_tiers is not None
                                      else on_failure(session.tiers, key, len(hints)))
        tiers = session.tiers_now[key]
    names = ("nudge", "the math", "near code")
    lines = [f"  hint {i + 1} ({names[i] if i < 3 else 'more'}): {h}" for i, h in enumerate(hints[:tiers])]
    if tiers < len(hints) and not first_only:
        lines.append(f"  (fail again for hint {tiers + 1}, or pass --kata-hints {len(hints)} to see all)")
    return lines


def reproduce_line(item) -> str:
    session = item.config.stash[state.SESSION]
    flags = " --solutions" if session.grade_solutions else ""
    return f'  reproduce: python -m pytest "{item.nodeid}" --kata-seed {session.seed}{flags}'


def failure_text(item, excinfo) -> str:
    """The learner-facing text for a failed kata item."""
    from diffusion_katas.pytest_plugin.outcomes import BudgetWaits, KataTodo, LearnerCrash
    from diffusion_katas.core.results import FILE_REASONS
    from diffusion_katas.core.spec import KataFailure, OverBudget

    session = item.config.stash[state.SESSION]
    rel = session.rel(item.parent.source)
    if item.hidden and session.hidden_output == "name-only":  # nothing the learner's code said or did reaches it
        if excinfo.errisinstance(KataTodo):
            return f"hidden check: `{item.kata.name}` is not written yet (TODO)"
        return (f"hidden check failed: {item.kata.name} · {item.check.name} "
                "(its inputs and message are withheld; the visible checks teach the same thing)")
    if excinfo.errisinstance(KataTodo):
        waits_on = excinfo.value.waits_on
        if waits_on:
            lab, function = waits_on.split("::")
            return (f"TODO: `{item.kata.name}` in {rel} builds on your `{function}` in "
                    f"{session.rel(item.parent.source.parent / lab)}, which is not written yet: do that one first")
        return "\n".join([f"TODO: write `{item.kata.name}` in {rel}", *hint_lines(item, first_only=True)])
    if excinfo.errisinstance(OverBudget):
        return "\n".join([budget_text(item), reproduce_line(item)])
    if excinfo.errisinstance(BudgetWaits):
        waits = excinfo.value
        where = "its failure is shown above" if waits.ran_here else \
            f'see why with: python -m pytest "{item.parent.nodeid}" -k {waits.function} -m "not budget"'
        return (f"budget '{waits.budget}' of `{waits.function}` is judged once `{waits.function}` is correct; "
                f"it fails check '{waits.check}' ({where})")
    if excinfo.errisinstance(KataFailure) and excinfo.value.reason in FILE_REASONS:
        # the file does not import (a half-typed line): about the file, not the function, so no hint tier is
        # shown or spent on it (core/record.py does not count it as a failed grading either)
        return "\n".join([str(excinfo.value), reproduce_line(item)])
    if excinfo.errisinstance(KataFailure):
        body = str(excinfo.value)
    elif excinfo.errisinstance(LearnerCrash):
        crash = excinfo.value
        exc = crash.exc
        body = (f"{crash.context}\n  your function raised {exc.type_name}: {exc.message}\n"
                + _learner_frames(exc.frames, item.parent.source, session)
                + _crash_trap_lines(crash))
    elif excinfo.errisinstance(pytest.fail.Exception) and "Timeout" in str(excinfo.value):
        body = (f"{item.last_context or item.kata.name}\n  timed out after {session.timeout:g} s "
                "(pytest-timeout): look for a loop that never ends, or far more work than the kata needs")
    else:
        return str(pytest.Item.repr_failure(item, excinfo))
    first = item.failing_dependencies_note() if hasattr(item, "failing_dependencies_note") else []
    return "\n".join([*first, body, *hint_lines(item), reproduce_line(item)])


def headroom(measurements) -> str:
    """Each measurement of a passing budget against its allowance, in one line."""
    from diffusion_katas.engine.meters import human

    return "; ".join(f"{m.what}: {human(m.measured, m.unit)} of "
                     + (f"at least {human(m.allowed, m.unit)}" if m.at_least else human(m.allowed, m.unit))
                     + (f" ({m.measured / m.allowed:.2f}x)" if m.allowed else "") for m in measurements)


def budget_text(item) -> str:
    """Measured against allowed, one line per measurement, the misses marked."""
    from diffusion_katas.engine.meters import human

    lines = [f"{item.last_context}: correct, but over budget"]
    for m in item.measurements:
        mark = "OVER" if m.over else "ok  "
        ratio = f" ({m.measured / m.allowed:.2f}x the allowance)" if m.allowed else ""
        allowed = f"at least {human(m.allowed, m.unit)}" if m.at_least else human(m.allowed, m.unit)
        lines.append(f"  {mark} {m.what}: measured {human(m.measured, m.unit)}, "
                     f"allowed {allowed}{ratio}\n         allowance: {m.why}")
    named = [m.trap for m in item.measurements if m.over and m.trap]
    if len(set(named)) == 1:  # one mistake explains every miss; two different ones would be a guess
        lines.append(f"  trap: {named[0][0]}\n    {named[0][1]}")
    return "\n".join(lines)


def _learner_frames(frames, source, session) -> str:
    """The traceback lines in the learner's file (or the last frame), as `path:line in function`."""
    mine = [f for f in frames if f[0] == str(source)] or list(frames)[-1:]
    return "".join(f"    {session.rel(type(source)(filename))}:{line} in {function}\n"
                   f"      {text}\n" for filename, line, function, text in mine)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """The kata progress table, then the next function to work on and its first hint."""
    session = config.stash.get(state.SESSION, None)
    if session is None:
        return
    session.interrupted = session.interrupted or exitstatus == pytest.ExitCode.INTERRUPTED
    labs = session.run().progress()
    if not labs:
        if session.interrupted:
            terminalreporter.write_line("katas: the run was interrupted before anything was graded.", red=True)
        return
    tr = terminalreporter
    over = tr.stats.get("over budget", [])
    if over:  # not in pytest's FAILURES section, whose reports are the "failed" category
        tr.write_sep("=", "over budget", red=True, bold=True)
        for report in over:
            tr.write_sep("_", report.head_line or report.nodeid, red=True)
            tr.write_line(str(report.longrepr))
    if tr.config.option.verbose > 0:  # how close each passing budget came to its allowance
        passing = [r for r in session.results if r.status == Status.PASSED and r.check.startswith("budget: ")
                   and r.detail]
        if passing:
            tr.write_sep("=", "budgets: measured of allowed", green=True)
            for r in passing:
                tr.write_line(f"  {r.function} · {r.check[len('budget: '):]}: {r.detail}")
    waiting = tr.stats.get("waiting", [])
    if waiting:  # one line each: the failure they wait on is reported once, where it happened
        tr.write_sep("=", "budgets waiting on correctness", yellow=True)
        for report in waiting:
            tr.write_line(f"  {report.longrepr}")
    tr.write_sep("=", "kata progress", cyan=True, bold=True)
    bars = max((len(functions) for _, functions in labs.values()), default=1)
    # a row fits COLUMNS: a title longer than what is left beside the count and the bar is shortened
    width = min(max(len(title) for title, _ in labs.values()), COLUMNS - 2 - 2 - 6 - bars)
    unselected = _unselected_functions(session, labs)
    next_up = None
    for lab, (title, functions) in labs.items():
        solved = sum(s == "passed" for s in functions.values())
        total = sum(s != "skipped" for s in functions.values())
        if not total:
            tr.write_line(f"  {title:<{width}}  skipped")
            continue
        bar = "#" * solved + "." * (total - solved)
        # A selection grades part of a lab: say of how many, so "1/1" never reads as the whole lab.
        part = (f"  (of the lab's {len(functions) + unselected[lab]} functions: {unselected[lab]} not graded in "
                f"this run)" if unselected.get(lab) else "")
        row = f"  {shorten(title, width):<{width}}  {solved:>2}/{total:<2} {bar}"
        if part and len(row + part) > COLUMNS:
            part = "\n" + fill(part.strip(), "    ")
        tr.write_line(row + part, green=solved == total and not part)
        for function, status in functions.items():
            if next_up is None and status in ("todo", "failed", "waiting", "over budget"):
                next_up = (lab, function, status)
    if session.interrupted:
        tr.write_line("  the run was interrupted: the table shows only what was graded before it stopped, and "
                      "nothing here counts as a complete grade.", red=True, bold=True)
        return
    left_out = _not_graded(session, labs)
    if left_out:
        tr.write_line(fill(f"not graded in this run (deselected): {left_out}. The table counts only what ran; "
                           f"`python -m pytest {session.rel(session.kata_dir)}"
                           f"{' --solutions' if session.grade_solutions else ''}` grades everything.", "  "),
                      yellow=True)
    if next_up is None and left_out:
        tr.write_line("  every graded check passes.", green=True, bold=True)
        return
    if next_up is None:
        if all(s == "skipped" for _, functions in labs.values() for s in functions.values()):
            tr.write_line("  nothing was graded: every selected check was skipped.", yellow=True)
            return
        if session.hidden_seed is None:
            tr.write_line("  every visible check passes. Hidden checks, if your instructor uses them, "
                          "were not run here.", green=True, bold=True)
        else:
            tr.write_line("  every graded kata function passes, hidden checks included.", green=True, bold=True)
        return
    lab, function, status = next_up
    source = session.rel((session.solutions_dir if session.grade_solutions else session.kata_dir) / f"{lab}.py")
    where = session.rel(session.kata_dir / f"{lab}.py") + (" --solutions" if session.grade_solutions else "")
    verb = {"todo": "write", "failed": "fix", "waiting": "fix", "over budget": "make cheaper"}[status]
    tr.write_line(f"  next: {verb} `{function}` in {source}", yellow=True, bold=True)
    if status == "over budget":  # it is correct: a correctness hint would be beside the point
        tr.write_line(fill("hint: it is correct; the OVER BUDGET section above shows what was measured against "
                           "what is allowed, and where the allowance comes from", "  "))
    else:
        for kata in session.course.graders_of(lab):
            if kata.name == function and kata.hints:
                # the most specific tier this learner has: the one this run's failure showed, or one seen before
                from diffusion_katas.core.tiers import shown

                key = f"{lab}::{function}"
                tier = max(1, session.tiers_now.get(key, 0), shown(session.tiers, key, len(kata.hints)))
                tr.write_line(fill(f"hint{f' {tier}' if tier > 1 else ''}: {kata.hints[min(tier, len(kata.hints)) - 1]}",
                                   "  "))
    tr.write_line(f"  then: python -m pytest {where}")


def pytest_deselected(items) -> None:
    """Remember which kata checks a selection (-k, -m, --kata-function) left out, for a true progress line."""
    for item in items:
        if hasattr(item, "kata") and hasattr(item, "check_name"):
            session = item.config.stash.get(state.SESSION, None)
            if session is not None:
                session.deselected.append((item.lab, item.kata.name, item.check_name))


def _unselected_functions(session, labs) -> dict[str, int]:
    """Per lab, how many of its functions a selection left out entirely."""
    graded = {(lab, f) for lab, (_title, functions) in labs.items() for f in functions}
    left = {(lab, function) for lab, function, _check in session.deselected if (lab, function) not in graded}
    counts: dict[str, int] = {}
    for lab, _function in left:
        counts[lab] = counts.get(lab, 0) + 1
    return counts


def _not_graded(session, labs) -> str:
    """The functions (or checks of graded functions) a selection left out, in a few words."""
    if not session.deselected:
        return ""
    graded = {(lab, f) for lab, (_title, functions) in labs.items() for f in functions}
    whole, partly = [], []
    for lab, function, _check in session.deselected:
        bucket = partly if (lab, function) in graded else whole
        if (lab, function) not in bucket:
            bucket.append((lab, function))
    parts = []
    several = len({lab for lab, _ in whole + partly} | set(labs)) > 1  # then say whose each function is

    def named(lab, f):
        return f"`{f}` (lab {lab[:2]})" if several else f"`{f}`"

    if whole:
        names = ", ".join(named(lab, f) for lab, f in whole[:6]) + (f" and {len(whole) - 6} more" if len(whole) > 6 else "")
        parts.append(f"{len(whole)} function(s) ({names})")
    if partly:
        parts.append(f"some checks or budgets of {', '.join(named(lab, f) for lab, f in partly[:6])}")
    return "; ".join(parts)


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    """Write --kata-json and --gradescope; keep the learner's record and the hint tiers shown."""
    config = session.config
    kata_session = config.stash.get(state.SESSION, None)
    if kata_session is None:
        return
    kata_session.interrupted = kata_session.interrupted or exitstatus == pytest.ExitCode.INTERRUPTED
    kata_session.close_runners_opened_ahead()
    run = kata_session.run()
    if kata_session.json_path is not None or kata_session.gradescope_path is not None:
        from diffusion_katas.core.results import versions, write_json

        found = versions()
        if kata_session.json_path is not None:
            write_json(kata_session.json_path, run.kata_json(found))
        if kata_session.gradescope_path is not None:
            write_json(kata_session.gradescope_path, run.gradescope(found))
    if kata_session.keeps_record and kata_session.results and not kata_session.interrupted:
        _keep_record(kata_session, run)
        if kata_session.hints_shown:
            _keep_tiers(kata_session)


def _keep_tiers(kata_session: state.KataSession) -> None:
    """Remember the hint tiers this run's failure messages showed (core/tiers.py), with the failed-grading
    counts the record now holds, so that `kata hint` goes on from them."""
    if not kata_session.tiers_now:
        return
    from diffusion_katas.core import record, tiers

    course = kata_session.course
    saved = record.load(course)
    for key, tier in kata_session.tiers_now.items():
        lab, function = key.split("::", 1)
        tiers.note_shown(kata_session.tiers, key, tier, record.failed_gradings(saved, lab, function))
    try:
        tiers.save(course.hints_path, kata_session.tiers)
    except OSError:  # a course folder that cannot be written to loses the memory, never the run
        pass


def _keep_record(kata_session: state.KataSession, run) -> None:
    """Merge this run into .kata/last-grading.json (core/record.py); a course folder that cannot be
    written to only loses the record, never the run."""
    from diffusion_katas.core import record

    course = kata_session.course
    declared = {}
    for lab in run.progress():
        try:
            declared[lab] = {k.name: {c.name for c in k.checks} | {f"{record.BUDGET_PREFIX}{b.name}" for b in k.budgets}
                             for k in course.graders_of(lab)}
        except Exception:  # noqa: BLE001  (a grader that does not load: the run already said so)
            continue
    try:
        record.write(course, record.merge(record.load(course), run.kata_json({}), declared,
                                          kata_session.fingerprints))
    except OSError:
        pass
