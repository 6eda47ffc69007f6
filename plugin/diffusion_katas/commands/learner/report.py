"""`kata report`: one static HTML page of where the learner stands, written from the last grading record.

    kata report [--out PAGE] [--update | --fresh]

The page (default .kata/report.html) holds the progress table (every lab: solved/total, TODO, failing, over
budget), the next step with the hint tiers already earned for it, every check that did not pass with its
message as pytest shows it (and what the learner's code printed), and the pictures `kata see` wrote
(.kata/see/*.png) beside their lab. It reads .kata/last-grading.json (core/record.py) and grades nothing,
like `kata progress --cached`; --update first grades the labs changed since (as `kata progress` does),
--fresh every lab (as `kata progress --fresh`).

One file, readable offline and without a server: the CSS is inline, the pictures are embedded as data: URIs,
and the page runs no script (its Content-Security-Policy allows none, and nothing is fetched). Everything the
learner's code controls (failure messages quote its output, its prints) is HTML-escaped, as is every other
text, so a planted `<script>` shows as text.
"""
from __future__ import annotations

import base64
import html
import sys
from datetime import datetime
from pathlib import Path

from diffusion_katas.commands.learner.hints import TIER_NAMES, _static_hints, tiers_seen
from diffusion_katas.commands.learner.workspace import LearnerError, open_course
from diffusion_katas.commands.running import (MARKS, VERBS, after_grading, changed_labs, first_unsolved, grade,
                                              grading_failed, import_trouble, lab_entry, load_report, next_todo,
                                              statuses)
from diffusion_katas.core import record
from diffusion_katas.core.course import Course

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EMBED_LIMIT = 8 * 1024 * 1024  # bytes: a larger picture is linked (relative path), not embedded
# No script, no fetch: styles inline, images only as data: URIs (or files linked by the learner's click).
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
SHOWN = ("failed", "waiting", "over budget")  # the results whose messages the page shows

STYLE = """
:root { --ok: #1a7f37; --bad: #c62828; --todo: #6e7781; --budget: #9a6700; --line: #d0d7de; --soft: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 0 auto;
       max-width: 1100px; padding: 24px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 32px 0 8px; border-bottom: 1px solid var(--line); padding-bottom: 4px; }
h3 { font-size: 15px; margin: 18px 0 6px; }
.meta { color: #57606a; margin: 0 0 16px; }
code, pre { font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
pre { background: var(--soft); border: 1px solid var(--line); border-radius: 6px; padding: 10px 12px;
      white-space: pre-wrap; overflow-wrap: anywhere; margin: 6px 0 12px; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid var(--line); padding: 6px 8px; text-align: left; vertical-align: top; }
th { background: var(--soft); font-weight: 600; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.total td { font-weight: 600; border-top: 2px solid var(--line); }
.bar { display: inline-block; width: 90px; height: 8px; background: #eaeef2; border-radius: 4px;
       vertical-align: middle; margin-left: 6px; overflow: hidden; }
.bar > span { display: block; height: 100%; background: var(--ok); }
.status { display: inline-block; font-size: 12px; font-weight: 600; padding: 1px 7px; border-radius: 10px;
          color: #fff; background: var(--todo); white-space: nowrap; }
.status.passed { background: var(--ok); } .status.failed, .status.waiting { background: var(--bad); }
.status.over-budget { background: var(--budget); } .status.todo, .status.skipped { background: var(--todo); }
.next { border: 2px solid #0969da; border-radius: 8px; padding: 12px 16px; margin: 16px 0; background: #ddf4ff33; }
.next p { margin: 4px 0; }
.hint { margin: 6px 0; }
.note { color: #57606a; font-size: 13px; }
.edited { color: var(--budget); font-size: 13px; }
ul.functions { list-style: none; padding: 0; margin: 6px 0; }
ul.functions li { margin: 2px 0; }
figure { margin: 10px 0 16px; }
figure img { max-width: 100%; image-rendering: pixelated; border: 1px solid var(--line); }
figcaption { color: #57606a; font-size: 13px; }
"""


# ---- the page --------------------------------------------------------------------------------------------
def esc(text) -> str:
    """Text as HTML: every <, >, &, and both quotes escaped (so it is safe in attributes too)."""
    return html.escape("" if text is None else str(text), quote=True)


def status_badge(status: str) -> str:
    return f'<span class="status {esc(status.replace(" ", "-"))}">{esc(MARKS.get(status, status))}</span>'


def function_counts(entry: dict) -> dict[str, int]:
    """Per lab entry: functions solved, total (skipped left out), TODO, failing (failed, or a budget waiting on
    a failing check), over budget."""
    found = [s for _, s in statuses(entry)]
    return {"solved": found.count("passed"), "total": sum(s != "skipped" for s in found),
            "todo": found.count("todo"), "failing": found.count("failed") + found.count("waiting"),
            "over budget": found.count("over budget")}


def pictures(course: Course) -> dict[str, list[Path]]:
    """The PNGs `kata see` wrote (.kata/see/*.png), by lab stem ("" for those that name no lab of the course):
    LAB.png and LAB_*.png or NN_*.png belong to LAB."""
    folder = course.state / "see"
    found: dict[str, list[Path]] = {}
    if not folder.is_dir():
        return found
    labs = course.labs()
    for png in sorted(folder.glob("*.png")):
        stem = png.stem
        lab = next((lab for lab in labs if stem == lab or stem.startswith(lab + "_")), None) or \
            next((lab for lab in labs if stem[:3] == lab[:2] + "_"), "")
        found.setdefault(lab, []).append(png)
    return found


def figure(course: Course, png: Path, out: Path, lab: str | None) -> str:
    """A picture as an <img> with its data embedded, and a caption: its name, when it was drawn, and whether
    the kata file changed since."""
    try:
        data = png.read_bytes()
        drawn = png.stat().st_mtime
    except OSError as exc:
        return f'<p class="note">{esc(course.rel(png))} could not be read: {esc(exc)}</p>'
    if not data.startswith(PNG_SIGNATURE):
        return f'<p class="note">{esc(course.rel(png))} is not a PNG file: left out.</p>'
    when = datetime.fromtimestamp(drawn).isoformat(sep=" ", timespec="seconds")
    caption = f"{esc(course.rel(png))} · drawn {esc(when)}"
    if lab:
        kata = course.kata(lab)
        try:
            if kata.stat().st_mtime > drawn:
                caption += (f' · <span class="edited">{esc(course.rel(kata))} changed since: '
                            f"<code>kata see {esc(lab[:2])}</code> draws it again</span>")
        except OSError:
            pass
    if len(data) > EMBED_LIMIT:
        href = Path(_relpath(png, out.parent)).as_posix()
        return (f'<figure><p><a href="{esc(href)}">{esc(course.rel(png))}</a> ({len(data) / 2**20:.1f} MiB: '
                f"too large to embed, linked)</p><figcaption>{caption}</figcaption></figure>")
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return (f'<figure><img src="{uri}" alt="{esc(png.name)}" data-picture="{esc(png.name)}">'
            f"<figcaption>{caption}</figcaption></figure>")


def _relpath(path: Path, start: Path) -> str:
    import os

    try:
        return os.path.relpath(path, start)
    except ValueError:  # another drive (Windows)
        return path.as_uri()


def hint_tiers(course: Course, lab: str, function: str) -> tuple[list[str], int]:
    """(the hint tiers the learner has earned and seen for `function`, at least the free first one; how many
    tiers the grader declares), read from the grader's source without importing it, and without revealing
    a tier (`kata hint` does that)."""
    hints = _static_hints(course.grader(lab)) or {}
    tiers = list(hints.get(function, ()))
    if not tiers:
        return [], 0
    return tiers[:max(1, tiers_seen(course, lab, function, len(tiers)))], len(tiers)


def next_step(course: Course, report: dict) -> str:
    found = next_todo(report)
    if found is None:
        text = "Every graded function passes." if report.get("labs") else "Nothing was graded yet."
        return f'<section class="next" id="next"><h2>Next step</h2><p>{esc(text)}</p></section>'
    lab, function, status = found
    kata = course.rel(course.kata(lab))
    parts = ['<section class="next" id="next"><h2>Next step</h2>',
             f"<p><strong>{esc(VERBS.get(status, 'fix'))} <code>{esc(function)}</code></strong> in "
             f"<code>{esc(kata)}</code> {status_badge(status)}</p>"]
    entry = lab_entry(report, lab) or {}
    trouble = import_trouble(report, entry)
    if trouble:
        parts.append(f"<p>The whole file could not be used: {esc(trouble)}</p>")
    if status == "over budget":
        parts.append("<p>It is correct; it costs more than its budget allows. Its message below shows what was "
                     "measured against what is allowed: make it cheaper without changing its output.</p>")
    else:
        tiers, available = hint_tiers(course, lab, function)
        for number, text in enumerate(tiers, 1):
            name = TIER_NAMES[number - 1] if number <= len(TIER_NAMES) else "more"
            parts.append(f'<p class="hint"><strong>hint {number} ({esc(name)}):</strong> {esc(text.strip())}</p>')
        if len(tiers) < available:
            parts.append(f'<p class="note">{available - len(tiers)} more hint tier(s): <code>kata hint</code> shows '
                         "the next once you have earned it (a failed attempt at the one before).</p>")
    parts.append(f'<p class="note">then: <code>kata watch {esc(lab[:2])}</code> (grades on every save) · '
                 f"<code>python -m pytest {esc(kata)}</code> · <code>kata hint</code></p></section>")
    return "\n".join(parts)


def progress_table(course: Course, report: dict) -> str:
    rows = []
    total = {"solved": 0, "total": 0, "todo": 0, "failing": 0, "over budget": 0}
    for lab in course.labs():
        entry = lab_entry(report, lab)
        kata = course.kata(lab)
        name = f'<td><a href="#lab-{esc(lab)}">{esc(lab)}</a></td>' if entry else f"<td>{esc(lab)}</td>"
        if not kata.is_file():
            rows.append(f'<tr data-lab="{esc(lab)}">{name}<td colspan="5">{esc(course.rel(kata))} is missing: '
                        f"<code>kata reset {esc(lab[:2])}</code> restores it</td></tr>")
            continue
        if entry is None:
            why = "not graded yet (<code>kata progress</code> grades it)" if course.grader(lab).is_file() else \
                f"not graded: it has no grader ({esc(course.rel(course.grader(lab)))})"
            rows.append(f'<tr data-lab="{esc(lab)}">{name}<td colspan="5">{why}</td></tr>')
            continue
        c = function_counts(entry)
        for key in total:
            total[key] += c[key]
        share = 100 * c["solved"] / c["total"] if c["total"] else 0
        found = first_unsolved(entry)
        trouble = import_trouble(report, entry)
        if trouble:
            note = esc(trouble)
        elif found:
            note = f"next: <code>{esc(found[0])}</code> {status_badge(found[1])}"
        else:
            note = status_badge("passed") + " solved"
        if record.lab_changed(course, entry):
            note += (' <span class="edited">(edited since: <code>kata report --update</code> grades it)</span>'
                     if entry.get("files") else ' <span class="edited">(partly graded)</span>')
        rows.append(
            f'<tr data-lab="{esc(lab)}">{name}'
            f'<td class="n solved">{c["solved"]}/{c["total"]}<span class="bar"><span style="width:{share:.0f}%">'
            f"</span></span></td>"
            f'<td class="n todo">{c["todo"]}</td><td class="n failing">{c["failing"]}</td>'
            f'<td class="n over-budget">{c["over budget"]}</td><td>{note}</td></tr>')
    rows.append(f'<tr class="total"><td>all labs</td><td class="n">{total["solved"]}/{total["total"]}</td>'
                f'<td class="n">{total["todo"]}</td><td class="n">{total["failing"]}</td>'
                f'<td class="n">{total["over budget"]}</td><td></td></tr>')
    head = ('<tr><th>lab</th><th class="n">solved</th><th class="n">TODO</th><th class="n">failing</th>'
            '<th class="n">over budget</th><th>next</th></tr>')
    return f'<h2 id="progress">Progress</h2>\n<table id="progress-table">\n{head}\n' + "\n".join(rows) + "\n</table>"


def lab_section(course: Course, report: dict, lab: str, out: Path, pngs: list[Path]) -> str:
    entry = lab_entry(report, lab)
    results = [r for r in report.get("results", []) if r.get("lab") == lab and r.get("status") in SHOWN]
    if entry is None and not pngs:
        return ""
    if entry is not None and not results and not pngs:
        return ""
    title = (entry or {}).get("title") or course.title(lab)
    parts = [f'<section class="lab" id="lab-{esc(lab)}"><h2>{esc(title)} <span class="note">({esc(lab)}'
             f"{' · graded ' + esc(str(entry.get('graded_at', '')).replace('T', ' ')) if entry else ''}"
             f"{' · seed ' + esc(entry.get('seed')) if entry and entry.get('seed') is not None else ''})</span></h2>"]
    if entry is not None:
        parts.append('<ul class="functions">' + "".join(
            f"<li>{status_badge(s)} <code>{esc(f)}</code></li>" for f, s in statuses(entry)) + "</ul>")
    for r in results:
        parts.append(f'<article class="result" data-function="{esc(r.get("function"))}">'
                     f'<h3>{status_badge(r.get("status", ""))} <code>{esc(r.get("function"))}</code> · '
                     f'check “{esc(r.get("check"))}”</h3>')
        message = r.get("message") or r.get("detail") or "(no message recorded)"
        parts.append(f'<pre class="message">{esc(message.rstrip())}</pre>')
        printed = r.get("output")
        if printed:
            parts.append('<p class="note">what your code printed:</p>'
                         f'<pre class="printed">{esc(printed.rstrip())}</pre>')
        parts.append("</article>")
    if pngs:
        parts.append("<h3>Pictures (kata see)</h3>")
        parts += [figure(course, png, out, lab) for png in pngs]
    parts.append("</section>")
    return "\n".join(parts)


def render(course: Course, report: dict, out: Path, now: str | None = None) -> str:
    """The whole page, as text."""
    now = now or datetime.now().isoformat(sep=" ", timespec="seconds")
    saved = str(report.get("saved_at") or "?").replace("T", " ")
    by_lab = pictures(course)
    sections = [lab_section(course, report, lab, out, by_lab.get(lab, [])) for lab in course.labs()]
    if by_lab.get(""):
        sections.append('<section class="lab" id="other-pictures"><h2>Other pictures (kata see)</h2>'
                        + "".join(figure(course, png, out, None) for png in by_lab[""]) + "</section>")
    changed = [lab for lab in course.labs()
               if lab_entry(report, lab) and record.lab_changed(course, lab_entry(report, lab))]
    stale = (f'<p class="edited">{len(changed)} lab(s) changed since they were graded ({esc(", ".join(changed))}): '
             "their rows are the last grading. <code>kata report --update</code> grades them first.</p>"
             if changed else "")
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{esc(CSP)}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>kata report · {esc(course.root.name)}</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>Diffusion katas · your progress</h1>",
        f'<p class="meta">Course <code>{esc(course.root)}</code> · last grading saved {esc(saved)} '
        f"(seed {esc(report.get('seed'))}) · page written {esc(now)} by <code>kata report</code>; "
        "it grades nothing: <code>kata progress</code>, <code>kata watch</code> and <code>pytest katas</code> "
        "update what it shows.</p>",
        stale,
        next_step(course, report),
        progress_table(course, report),
        *[s for s in sections if s],
        "</body></html>",
        "",
    ])


# ---- the command -----------------------------------------------------------------------------------------
def regrade(course: Course, report: dict | None, every: bool) -> dict | None:
    """Grade the labs changed since the record (every lab with `every`) in one pytest run, as `kata progress`
    does; the record after it."""
    labs = [lab for lab in course.graded_labs() if course.kata(lab).is_file()] if every or report is None \
        else changed_labs(course, report)
    if not labs:
        print("no kata file changed since the last grading: nothing graded again", file=sys.stderr)
        return report
    targets = [course.rel(course.kata(lab)) for lab in labs]
    print(f"grading {len(labs)} lab(s) ({', '.join(labs)}) in one pytest run...", file=sys.stderr, flush=True)
    grading = grade(course, *targets, "--continue-on-collection-errors")
    if grading.report is None:
        raise LearnerError(grading_failed(grading, ", ".join(targets)), 1)
    return after_grading(course, report, grading)


def cmd_report(args) -> int:
    course = open_course(args.root)
    report = load_report(course)
    if args.update or args.fresh:
        report = regrade(course, report, every=args.fresh)
    if report is None:
        raise LearnerError(f"no grading recorded yet ({course.rel(course.record_path)}): grade first with "
                           "`kata progress` (or `python -m pytest katas`), or run `kata report --update`", 1)
    out = (args.out or course.state / "report.html").resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(course, report, out), encoding="utf-8")
    tmp.replace(out)
    print(f"wrote {course.rel(out)}: open {out.as_uri()} in a browser (one file, works offline)")
    return 0
