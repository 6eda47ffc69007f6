"""Grading from a Jupyter notebook (Jupyter, JupyterLab, VS Code, Colab): the `%kata` magic and `kata.check()`.

    %load_ext diffusion_katas       once per kernel (the notebook's set-up cell does it)
    %kata lab 01                    the lab this notebook is (also defines `kata` and `__file__`)
    %kata check [FUNCTION]          save the code you ran into the kata file, grade it, show the verdict
    %kata hint [FUNCTION]           the hint tiers you have earned
    %kata see                       the lab's picture, inline
    %kata progress                  every lab: solved/total and the next TODO, as a table
    %kata load FUNCTION             a new cell holding the function as the kata file has it

`kata.check("add_noise")`, `kata.see()`, ... are the same in plain Python.

A check never grades the kernel. It reads the source of the cells the kernel ran (IPython's input history),
splices what they define into katas/NN_name.py (core/notebooks.py holds the rule), and grades that file with
`python -m pytest` in a subprocess, through the same isolated runner as the terminal: a variable left in the
kernel cannot change a verdict, and the verdict is the one `python -m pytest` on the file gives. The kernel
imports nothing heavy: torch, diffusers and the graders load in the grading process only.
"""
from __future__ import annotations

import html
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from diffusion_katas.core.course import Course, CourseNotFound
from diffusion_katas.core.notebooks import changed_functions, splice, todo_functions
from diffusion_katas.commands.running import (MARKS, Grading, counts, first_unsolved, grade, lab_entry, load_report,
                                               pytest_env, record_untouched, changed_labs)
from diffusion_katas.commands.learner import incremental
from diffusion_katas.commands.learner.watch import verdict_lines
from diffusion_katas.commands.learner.workspace import LearnerError

COLOURS = {"passed": "#1a7f37", "FAILED": "#cf222e", "TODO": "#6e7781", "OVER BUDGET": "#bc4c00",
           "WAITING": "#bc4c00", "skipped": "#6e7781"}
USAGE = ("%kata lab NN · %kata check [FUNCTION] · %kata hint [FUNCTION] [--all] · %kata see · %kata progress · "
         "%kata load FUNCTION")


class Shown:
    """What a kata command shows: text for a terminal, HTML for Jupyter (IPython picks the richest it can)."""

    def __init__(self, text: str, html_text: str | None = None, ok: bool | None = None):
        self.text, self.html, self.ok = text, html_text, ok

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return self.html if self.html is not None else f"<pre>{html.escape(self.text)}</pre>"


def verdict_html(lines: list[str]) -> str:
    """The verdict's lines, as the terminal shows them, with each status coloured and the next step in bold."""
    marks = "|".join(re.escape(m) for m in sorted(COLOURS, key=len, reverse=True))
    out = []
    for line in lines:
        text = html.escape(line)
        found = re.match(rf"^(\s*)({marks})(\s)", line)
        if found:
            mark = found.group(2)
            text = (html.escape(found.group(1)) + f'<b style="color:{COLOURS[mark]}">{html.escape(mark)}</b>'
                    + html.escape(line[found.end(2):]))
        elif line.startswith(("next:", "every function")):
            text = f"<b>{text}</b>"
        elif line.lstrip().startswith("trap: "):  # the misconception the output matches, by name
            text = f'<b style="color:#8250df">{text}</b>'
        elif re.match(r"^\s*hint \d+ \(", line):
            text = f'<span style="color:#0550ae">{text}</span>'
        elif line.startswith("---- "):
            text = f'<span style="color:#57606a">{text}</span>'
        out.append(text)
    return ('<pre class="kata-verdict" style="white-space:pre-wrap;line-height:1.35">' + "\n".join(out) + "</pre>")


class Kata:
    """One lab of a course, graded from a kernel: what `%kata` calls, and the plain-Python form."""

    def __init__(self, lab: str | None = None, root: str | Path | None = None, shell=None):
        try:
            self.course = Course.at(root) if root is not None else _find_course()
        except CourseNotFound as exc:
            raise LearnerError(str(exc), 1) from None
        self.shell = shell
        self.lab = self.course.resolve_lab(lab) if lab else None

    # ---- the code the kernel ran, into the kata file ------------------------------------------------------
    def ran(self) -> list[str]:
        """The source of the cells this kernel ran, oldest first, as Python (IPython's transformed input)."""
        shell = self.shell if self.shell is not None else _ipython()
        if shell is None:
            return []
        return [source for source in shell.history_manager.input_hist_parsed if source and source.strip()]

    def save(self) -> tuple[list[str], list[str]]:
        """Splice what the cells define into the kata file; returns (what to tell the learner, the functions
        whose code it changed)."""
        lab = self._lab()
        kata = self.course.kata(lab)
        rel = self.course.rel(kata)
        if not kata.is_file():
            raise LearnerError(f"{rel} is missing: `kata reset {lab[:2]}` restores it", 1)
        current = kata.read_text(encoding="utf-8")
        try:
            pristine = self.course.pristine_text(lab)
        except (OSError, ValueError):
            pristine = None
        try:
            text, notes = splice(current, self.ran(), pristine)
        except SyntaxError as exc:
            return [f"{rel} does not parse (line {exc.lineno}: {exc.msg}): graded as it is, nothing of your cells "
                    "saved into it"], []
        notes = [n.replace("{kata}", rel) for n in notes]
        if text == current:
            return notes, []
        tmp = kata.with_name(kata.name + ".kata-tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, kata)
        return [f"saved the code you ran into {rel}"] + notes, changed_functions(current, text)

    # ---- the commands ------------------------------------------------------------------------------------
    def check(self, function: str | None = None) -> Shown:
        """Save the cells' code into the kata file, grade it (one function, or the whole lab), show the verdict.
        With FUNCTION, the functions whose code that save changed are graded with it, and so is any the record
        has never graded; the lab's other functions show as last graded."""
        lab = self._lab()
        notes, changed = self.save()
        if function:  # of the TODO-stub notes, only the checked function's
            notes = [n for n in notes if "still its TODO stub" not in n or n.startswith(f"`{function}` ")]
        rel = self.course.rel(self.course.kata(lab))
        stubs = self.course.untouched_todos(lab)
        try:
            graded_functions = todo_functions(self.course.pristine_text(lab))
        except (OSError, ValueError, SyntaxError):
            graded_functions = []
        if function and graded_functions and function not in graded_functions:
            raise LearnerError(f"lab {lab} grades no function `{function}`; it grades: "
                               + ", ".join(f"`{n}`" for n in graded_functions), 2)
        if (function in stubs) if function else self.course.untouched(lab):
            # still the TODO stub: it raises NotImplementedError whatever the inputs; read, not graded
            todo = [function] if function else stubs
            report = {"seed": None, "results": [], "labs": [{"lab": lab, "title": self.course.title(lab), "functions": [
                {"name": name, "status": "todo"} for name in todo]}]}
            grading = Grading(report, "", 1, 0.0)
            note = f"{', '.join(f'`{n}`' for n in todo)} {'is' if len(todo) == 1 else 'are'} still the TODO stub " \
                   "(read from the file, not graded)"
        elif function:
            before = load_report(self.course)
            known = {f["name"] for f in (lab_entry(before, lab) or {}).get("functions", [])}
            wanted = [n for n in graded_functions if n == function or (n in changed and n not in stubs)
                      or (n not in known and n not in stubs)] or [function]
            grading = grade(self.course, rel, *[a for n in wanted for a in ("--kata-function", n)])
            merged = incremental.merge(before, grading.report, lab, set(wanted)) \
                if grading.report is not None and lab_entry(before, lab) is not None else None
            report = merged if merged is not None else grading.report
            if report is not None:  # the whole lab: what was graded, the rest as last graded, stubs as TODO
                grading = Grading(_complete(report, lab, graded_functions, stubs), grading.output,
                                  grading.returncode, grading.seconds)
            others = [f"`{n}`" for n in wanted if n != function]
            note = (f"graded `{function}`" + (f" and {', '.join(others)} (changed or never graded)" if others else "")
                    + ("; the lab's other functions as last graded" if len(wanted) < len(graded_functions) else ""))
        else:
            grading = grade(self.course, rel)
            note = None
        lines = verdict_lines(self.course, lab, grading, note, focus=function)
        if grading.report is not None and grading.report.get("seed") is None and not grading.output:
            lines = lines[1:]  # read, not graded: no "graded at ... in 0.0 s"
        entry = lab_entry(grading.report, lab)
        ok = entry is not None and first_unsolved(entry) is None
        lines = notes + ([""] if notes else []) + [for_notebook(line, lab) for line in lines]
        return Shown("\n".join(lines), verdict_html(lines), ok)

    def hint(self, *args: str) -> Shown:
        """The hint tiers earned (`kata hint [FUNCTION] [--all]`), in a notebook's words."""
        lab = self._lab()
        shown = self._command("hint", *args, "--lab", lab)
        text = "\n".join(for_notebook(line, lab) for line in shown.text.splitlines())
        return Shown(text.replace("`kata hint --all`", "`%kata hint --all`"), ok=shown.ok)

    def load(self, function: str) -> Shown:
        """A new cell below holding `function` as the kata file has it (Jupyter; elsewhere, the text)."""
        from diffusion_katas.core.notebooks import function_span
        import ast

        kata = self.course.kata(self._lab())
        text = kata.read_text(encoding="utf-8")
        lines = text.splitlines()
        span = function_span(ast.parse(text), lines, function)
        if span is None:
            raise LearnerError(f"{self.course.rel(kata)} has no function `{function}`", 1)
        source = "\n".join(lines[span[0]:span[1]])
        shell = self.shell if self.shell is not None else _ipython()
        if shell is not None:
            shell.set_next_input(source, replace=False)
            return Shown(f"`{function}` from {self.course.rel(kata)} is in a new cell below: run it, then check")
        return Shown(source)

    def see(self) -> Shown:
        lab = self._lab()
        out = (self.course.state / "see" / f"{lab}.png").resolve()
        done = self._run("see", lab[:2], "--out", str(out))
        text = done.stdout.strip()
        if done.returncode != 0 or not out.is_file():
            return Shown(text or f"kata see exited with {done.returncode}", ok=False)
        import base64

        data = base64.b64encode(out.read_bytes()).decode("ascii")
        return Shown(text, f'<pre style="white-space:pre-wrap">{html.escape(text)}</pre>'
                           f'<img src="data:image/png;base64,{data}" alt="{html.escape(lab)}: your functions '
                           f'beside diffusers\'" style="max-width:100%">', True)

    def progress(self) -> Shown:
        done = self._run("progress")
        report = load_report(self.course)
        text = done.stdout.rstrip()
        if self.lab is not None:  # this notebook's lab first: the course's next TODO may be another lab's
            entry = lab_entry(report, self.lab)
            found = first_unsolved(entry) if entry is not None else None
            here = (f"this notebook ({self.lab}): next, `{found[0]}` ({MARKS.get(found[1], found[1])})" if found
                    else f"this notebook ({self.lab}): every function passes" if entry is not None else "")
            text = "\n".join(for_notebook(line, self.lab) for line in text.splitlines()) + (f"\n{here}" if here else "")
        last = "\n".join(text.splitlines()[-2:])
        return Shown(text, progress_html(self.course, report) +
                     f'<pre style="color:#57606a">{html.escape(last)}</pre>', done.returncode == 0)

    def lab_here(self, name: str) -> Shown:
        self.lab = self.course.resolve_lab(name)
        kata = self.course.kata(self.lab)
        shell = self.shell if self.shell is not None else _ipython()
        if shell is not None:  # the lab's own code can find its folder (lab 12 loads your earlier labs)
            shell.user_ns["__file__"] = str(kata)
            if isinstance(shell.user_ns.get("kata", self), Kata):  # never over a `kata` of the learner's own
                shell.user_ns["kata"] = self
        report = load_report(self.course)
        report = record_untouched(self.course, report, changed_labs(self.course, report))
        entry = lab_entry(report, self.lab)
        state = ""
        if self.course.untouched(self.lab):
            state = " · every function still its TODO stub"
        elif entry is not None:
            solved, total = counts(entry)
            state = f" · {solved}/{total} solved when last graded"
        return Shown(f"{self.course.title(self.lab)}: {self.course.rel(kata)}{state}\n"
                     "run a function's cell, then `%kata check FUNCTION` under it: the code you ran is saved into "
                     "the kata file and graded there.")

    # ---- helpers -----------------------------------------------------------------------------------------
    def _lab(self) -> str:
        if self.lab is None:
            raise LearnerError("which lab? run `%kata lab NN` first (the notebook's set-up cell does)", 2)
        return self.lab

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "diffusion_katas", *args, "--root", str(self.course.root)],
                              cwd=self.course.root, env=pytest_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, encoding="utf-8", errors="replace")

    def _command(self, *args: str) -> Shown:
        done = self._run(*args)
        return Shown(done.stdout.rstrip(), ok=done.returncode == 0)


def _complete(report: dict, lab: str, names: list[str], stubs: list[str]) -> dict:
    """`report` with the lab's functions in the lab's order, a graded function the record never saw (a TODO stub
    still) entered as TODO."""
    for entry in report.get("labs", []):
        if entry.get("lab") == lab and names:
            have = {f["name"]: f for f in entry.get("functions", [])}
            entry["functions"] = [have.get(n) or {"name": n, "status": "todo"} for n in names
                                  if n in have or n in stubs]
    return report


# What the terminal's words are in a notebook.
NOTEBOOK_WORDS = [
    (re.compile(r"`kata hint`"), "`%kata hint`"),
    (re.compile(r"`kata hint --all`"), "`%kata hint --all`"),
    (re.compile(r"pass --kata-hints \d+ to see all"), "`%kata hint --all` shows every tier"),
    (re.compile(r"kata watch (\d\d)\s+\((\w+)\)"), r"notebooks/\2.ipynb"),
    (re.compile(r"`?kata progress --fresh`?"), "`%kata progress`"),
    (re.compile(r"save it and grade it — python -m pytest \S+ or kata watch \d\d —"),
     "run its cell and its `%kata check` —"),
    (re.compile(r"`kata hint (\w+) --all`"), r"`%kata hint \1 --all`"),
    (re.compile(r"`kata explain \d\d --section traps`"), "the lesson's Traps, at the top of this notebook"),
]


def for_notebook(line: str, lab: str) -> str:
    """A verdict line as a notebook learner acts on it: the magics for the commands, the function's cell for the
    file."""
    found = re.match(r"^next: (\w[\w ]*) `(\w+)` in katas/\S+\.py$", line)
    if found:
        return f"next: {found.group(1)} `{found.group(2)}` in its cell, then run `%kata check {found.group(2)}`"
    for pattern, replacement in NOTEBOOK_WORDS:
        line = pattern.sub(replacement, line)
    return line


def progress_html(course: Course, report: dict | None) -> str:
    rows = []
    for lab in course.labs():
        entry = lab_entry(report, lab)
        if entry is None:
            rows.append((lab, course.title(lab), "not graded yet", ""))
            continue
        solved, total = counts(entry)
        found = first_unsolved(entry)
        rows.append((lab, entry.get("title") or course.title(lab), f"{solved}/{total}",
                     f"{MARKS.get(found[1], found[1])} `{found[0]}`" if found else "solved"))
    cells = "".join(f"<tr><td>{html.escape(lab[:2])}</td><td style='text-align:left'>{html.escape(title)}</td>"
                    f"<td>{html.escape(score)}</td><td style='text-align:left'>{html.escape(nxt)}</td></tr>"
                    for lab, title, score, nxt in rows)
    return ("<table class='kata-progress'><thead><tr><th>lab</th><th>title</th><th>solved</th><th>next</th></tr>"
            f"</thead><tbody>{cells}</tbody></table>")


def _find_course() -> Course:
    """The course at or above the working directory, or in ./course (where the Colab set-up cell fetches it)."""
    try:
        return Course.find()
    except CourseNotFound:
        if Course.is_course(Path("course")):
            return Course(Path("course"))
        raise


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


# ---- the magic -------------------------------------------------------------------------------------------
_KATA: dict[int, Kata] = {}


def kata_magic(line: str, shell=None):
    """`%kata SUBCOMMAND ...`: display what the command shows; a wrong use says how it is used."""
    from IPython.display import display

    shell = shell if shell is not None else _ipython()
    words = shlex.split(line)
    if not words:
        display(Shown(USAGE))
        return None
    command, args = words[0], words[1:]
    try:
        state = _KATA.get(id(shell))
        if command == "lab":
            if len(args) != 1:
                raise LearnerError("which lab? `%kata lab 01`", 2)
            state = Kata(shell=shell)
            shown = state.lab_here(args[0])
            _KATA[id(shell)] = state
        else:
            if state is None:
                raise LearnerError("which lab? run `%kata lab NN` first (the notebook's set-up cell does)", 2)
            if command == "check" and len(args) <= 1:
                shown = state.check(*args)
            elif command == "hint" and len([a for a in args if a != "--all"]) <= 1:
                shown = state.hint(*args)
            elif command == "load" and len(args) == 1:
                shown = state.load(args[0])
            elif command in ("see", "progress") and not args:
                shown = getattr(state, command)()
            else:
                raise LearnerError(f"not a %kata command: `{line.strip()}`. {USAGE}", 2)
    except (LearnerError, LookupError) as exc:
        display(Shown(f"kata: {exc}", f'<pre style="color:#cf222e">kata: {html.escape(str(exc))}</pre>', False))
        return None
    display(shown)
    return None


def load(shell) -> None:
    """Register `%kata` with an IPython shell (`%load_ext diffusion_katas`)."""
    shell.register_magic_function(lambda line: kata_magic(line, shell), magic_kind="line", magic_name="kata")
