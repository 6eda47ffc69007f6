"""`kata watch`'s parts: waiting for a kata file to change, and the verdict shown after each grading."""
from __future__ import annotations

import re
import textwrap
import time
from datetime import datetime
from pathlib import Path

from diffusion_katas.commands.running import (MARKS, UNSOLVED, VERBS, Grading, counts, lab_entry,
                                               messages, statuses)
from diffusion_katas.commands.learner.hints import grader_hints, hint_text, next_tier_line, tiers_seen
from diffusion_katas.commands.learner.workspace import LearnerError
from diffusion_katas.core.course import Course

CLEAR = "\033[2J\033[H"


# ---- waiting for a save ----------------------------------------------------------------------------------
def signature(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def file_events():
    """The optional `watchfiles` module, or None: then we poll."""
    try:
        import watchfiles
    except ImportError:
        return None
    return watchfiles


def seconds_text(s: float) -> str:
    return f"{s:.1f}" if round(s, 1) == s else f"{s:g}"


def wait_for_change(path: Path, since, interval: float, events=None) -> None:
    """Return once the file's mtime or size differs from `since` (and has settled).

    Polling mtime+size works everywhere, including where file events never arrive (NFS) and with
    editors that save by deleting and re-creating the file. With watchfiles, an event ends the wait
    at once, and the same mtime+size check still runs every `interval`.
    """
    if events is not None:
        for _changes in events.watch(path.parent, watch_filter=lambda _c, p: Path(p).name == path.name,
                                     rust_timeout=max(1, int(interval * 1000)), yield_on_timeout=True):
            if _changes or signature(path) != since:
                break
    else:
        while signature(path) == since:
            time.sleep(interval)
    # Editors write in steps (or delete, then create): wait until the file is back and holds still.
    pause = min(interval, 0.2)
    deadline = time.monotonic() + max(2.0, 3 * interval)
    last = signature(path)
    while time.monotonic() < deadline:
        time.sleep(pause)
        current = signature(path)
        if current is not None and current == last:
            return
        last = current


# ---- the verdict -----------------------------------------------------------------------------------------
_HINT_LINE = re.compile(r"^\s*hint (\d+) \(", re.M)


def remember_shown(course: Course, lab: str, function: str, text: str) -> None:
    """The hint tiers in a failure text watch shows are seen now (the grading it ran remembered none: only what
    reaches the screen counts, core/tiers.py)."""
    from diffusion_katas.core import record, tiers

    shown = max((int(n) for n in _HINT_LINE.findall(text)), default=0)
    if not shown:
        return
    key = f"{lab}::{function}"
    seen = tiers.load(course.hints_path)
    tiers.note_shown(seen, key, shown, record.failed_gradings(record.load(course), lab, function))
    try:
        tiers.save(course.hints_path, seen)
    except OSError:
        pass


def verdict_lines(course: Course, lab: str, grading: Grading, note: str | None = None,
                  focus: str | None = None) -> list[str]:
    """The lab's verdict, the next step with its hint tier, and the first failure's text; `note`: what this
    grading covered when it was not the whole lab; `focus`: the function just checked, which is the next step
    and the failure shown when it does not pass."""
    report = grading.report
    entry = lab_entry(report, lab)
    kata = course.rel(course.kata(lab))
    stamp = datetime.now().strftime("%H:%M:%S")
    seed = (report or {}).get("seed")
    lines = [f"graded at {stamp} in {grading.seconds:.1f} s" + (f" (seed {seed})" if seed is not None else "")]
    if note:
        lines.append(note)
    if entry is None:
        if not course.kata(lab).is_file():
            return lines + ["", f"{kata} is gone: `kata reset {lab[:2]}` restores it (or undo the delete in your "
                                "editor); grading starts again when it is back."]
        tail = "\n".join(grading.output.rstrip().splitlines()[-40:])
        lines += ["", f"{kata} could not be graded; pytest said:", textwrap.indent(tail, "  ")]
        return lines
    solved, total = counts(entry)
    lines += ["", f"{entry.get('title', lab)}: {solved}/{total} solved"]
    width = max((len(MARKS.get(s, s)) for _, s in statuses(entry)), default=6)
    lines += [f"  {MARKS.get(s, s):<{width}}  {f}" for f, s in statuses(entry)]
    for r in (report or {}).get("results", []):  # passing budgets: how close they came to the allowance
        if r.get("lab") == lab and r.get("status") == "passed" and str(r.get("check", "")).startswith("budget: ") \
                and r.get("detail"):
            lines.append(f"  {'':<{width}}    {r['function']} · {r['check'][len('budget: '):]}: {r['detail']}")
    order = sorted(statuses(entry), key=lambda fs: fs[0] != focus)  # the checked function first, then lab order
    failing = next(((f, s) for f, s in order if s in ("failed", "waiting", "over budget")), None)
    text = next((m for m in messages(report, lab, failing[0], (failing[1],)) if m.strip()), "") if failing else ""
    if failing and failing[1] == "failed":
        remember_shown(course, lab, failing[0], text)
    found = next(((f, s) for f, s in order if s in UNSOLVED), None)
    lines.append("")
    if found is None:
        following = next_unsolved_lab(course, lab)
        lines.append("every function in this lab passes." + (
            f" On to the next lab: kata watch {following[:2]}  ({following})" if following else
            " So does every other lab, as last graded: the course is done."))
        return lines
    function, status = found
    lines.append(f"next: {VERBS.get(status, 'fix')} `{function}` in {kata}")
    try:
        hints = grader_hints(course, lab).get(function, ()) if status != "over budget" else ()
    except LearnerError:
        hints = ()
    if status == "over budget":
        lines.append("  it is correct: make it cheaper (what was measured against what is allowed is below)")
    if hints:
        tier = max(1, tiers_seen(course, lab, function, len(hints)))
        lines.append(textwrap.indent(hint_text(tier, hints[tier - 1]), "  "))
        if tier < len(hints):
            lines.append("  " + next_tier_line(course, lab, function, tier, len(hints)))
    if failing is None:
        lines.append("nothing fails yet: the functions not passing are still TODO.")
        return lines
    body = text.rstrip().splitlines()
    if len(body) > 80:
        body = body[:80] + [f"... ({len(body) - 80} more lines: python -m pytest {kata})"]
    lines += ["", f"---- why `{failing[0]}` is {MARKS[failing[1]]} (pytest) ----", *body]
    printed = next((str(r.get("output") or "") for r in (report or {}).get("results", [])
                    if r.get("lab") == lab and r.get("function") == failing[0] and r.get("output")), "")
    if printed.strip():
        shown = printed.rstrip().splitlines()
        more = f" (the first {PRINTED_LINES} of {len(shown)} lines)" if len(shown) > PRINTED_LINES else ""
        lines += ["", f"---- what your code printed{more} ----", *shown[:PRINTED_LINES]]
    return lines


PRINTED_LINES = 20  # of what the learner's code printed, under the verdict


def next_unsolved_lab(course: Course, lab: str) -> str | None:
    """The first lab after `lab` (then from the first) that the record does not know as solved, or None."""
    from diffusion_katas.commands.running import load_report

    report = load_report(course)
    labs = [other for other in course.graded_labs() if other != lab]
    for other in sorted(labs, key=lambda other: (other < lab, other)):
        entry = lab_entry(report, other)
        if entry is None or counts(entry)[0] < counts(entry)[1]:
            return other
    return None
