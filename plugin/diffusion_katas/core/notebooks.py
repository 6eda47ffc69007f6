"""A lab as a notebook: the kata file's lesson and functions as Jupyter cells, and a notebook's code back into
the kata file. The kata file stays the one thing graded; the notebook is a view of it.

- `lab_notebook(kata_text, lab)`: the .ipynb (nbformat 4.5) `kata derive` writes to notebooks/: the lesson as
  markdown, a set-up cell, each section heading as markdown, the header and every function in a cell of its
  own, a `%kata check FUNCTION` cell under each TODO function, and the lab's check, picture and progress.
- `splice(kata_text, cells, pristine_text)`: the kata file's text with what the notebook's cells define, read
  from their source (never from the kernel's objects): the last definition of a name wins, as in the kernel.

    The rule, in one place. A top-level function, class or assignment of the file whose name a cell defined
    is replaced by the cell's last definition. A name that code brought over uses and the file does not
    define comes along from the cell that last defined it (a helper, a constant, an import): imports after
    the file's own, the rest at the end. Everything else a cell does (calls, prints, experiments) stays in
    the kernel. A function the cell still has as its TODO stub never replaces code written in the file.

Pure standard library: the notebook is JSON, written in a stable order so that `kata derive --check` can
compare it byte for byte.
"""
from __future__ import annotations

import ast
import builtins
import json
import re
import symtable
import textwrap

from diffusion_katas.core.lessons import SECTIONS as LESSON_SECTIONS

SECTION = re.compile(r"^# ---- (?P<title>.*?) -*$")
NOTEBOOKS = "notebooks"  # the folder, beside katas/
# The labs `kata see` draws a picture for (engine/see.py: PICTURES; a test holds the two to the same labs).
PICTURED = ("01_forward_noise", "02_denoising_step", "05_sampling_loop", "15_karras_edm", "23_training_objective",
            "24_img2img_inpainting")
COURSE_URL = "COURSE = \"\"  # the course's git URL (your instructor's hand-out), for a fresh runtime such as Colab"


# ---- the kata file, as cells -----------------------------------------------------------------------------
def function_span(tree: ast.Module, lines: list[str], name: str) -> tuple[int, int] | None:
    """0-based [start, end) lines of the top-level `def name` (decorators included, and the indented or blank
    lines after its last statement, less trailing blank lines), or None when the file has no such def."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return statement_span(node, lines)
    return None


def statement_span(node: ast.stmt, lines: list[str]) -> tuple[int, int]:
    start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1
    end = node.end_lineno
    while end < len(lines) and (not lines[end].strip() or lines[end][:1] in (" ", "\t")):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return start, end


def is_todo(node: ast.stmt) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(n, ast.Raise) and "NotImplementedError" in ast.dump(n) for n in ast.walk(node))


def lesson_markdown(doc: str) -> str:
    """The module docstring as markdown: the title a heading, each lesson section a bold lead-in, its text one
    paragraph with what follows on the heading's line."""
    title, *rest = doc.strip("\n").splitlines()
    out = [f"# {title.strip()}"]
    section = re.compile(r"^(%s):\s*(.*)$" % "|".join(map(re.escape, LESSON_SECTIONS)))
    lead: list[str] = []  # the section's bold name and the text on its line
    body: list[str] = []

    def flush():
        text = textwrap.dedent("\n".join(body)).strip("\n")
        if lead:
            joined = lead[0] + (" " + lead[1] if lead[1] else "")
            out.extend(["", joined + ("\n" + text if text.strip() and lead[1] else "\n\n" + text if text.strip()
                                        else "")])
        elif text.strip():
            out.extend(["", text])
        lead.clear()
        body.clear()

    for line in rest:
        found = section.match(line)
        if found:
            flush()
            lead.extend([f"**{found.group(1)}.**", found.group(2).strip()])
        else:
            body.append(line)
    flush()
    return "\n".join(out).rstrip() + "\n"


def lab_cells(kata_text: str, lab: str, picture: bool = False, course_url: str = "") -> list[tuple[str, str]]:
    """(kind, source) of the lab's notebook, kind "markdown" or "code", from the kata file's text."""
    tree = ast.parse(kata_text)
    lines = kata_text.splitlines()
    doc = ast.get_docstring(tree) or lab
    number = lab[:2]
    cells = [("markdown", lesson_markdown(doc)),
             ("markdown", "**Set-up.** Run this cell first. It loads `%kata`, which saves the code you run here into "
                          f"`katas/{lab}.py` and grades that file, as `python -m pytest katas/{lab}.py` would: "
                          "what your kernel holds never changes a grade. In a fresh runtime (Colab) it first "
                          "fetches the course from `COURSE` and installs it (see the course's README)."),
             ("code", setup_cell(number, course_url))]
    first = 1 if ast.get_docstring(tree) is not None else 0
    cursor = tree.body[0].end_lineno if first else 0
    pending: list[str] = []  # lines of code that are not a function: the header, module-level assignments

    def flush_pending(keep_comments: bool = False) -> list[str]:
        """Make the pending lines a cell; a comment right above a function goes with the function."""
        above: list[str] = []
        while keep_comments and pending and pending[-1].lstrip().startswith("#"):
            above.insert(0, pending.pop())
        if "\n".join(pending).strip():
            cells.append(("code", "\n".join(pending).strip("\n")))
        pending.clear()
        return above

    def gap(upto: int) -> None:
        for line in lines[cursor:upto]:
            heading = SECTION.match(line)
            if heading:
                flush_pending()
                cells.append(("markdown", f"## {heading.group('title')}"))
            else:
                pending.append(line)

    for node in tree.body[first:]:
        start, end = statement_span(node, lines)
        gap(start)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            above = flush_pending(keep_comments=True)
            cells.append(("code", "\n".join(above + lines[start:end])))
            if is_todo(node):
                cells.append(("code", f"%kata check {node.name}"))
        else:
            pending.extend(lines[start:end])
        cursor = end
    gap(len(lines))
    flush_pending()
    cells.append(("markdown", "## The whole lab\n\nEvery check of the lab, the next step and its hint; then "
                              + ("the lab's picture, your functions beside diffusers', and " if picture else "")
                              + "your progress through the course."))
    cells.append(("code", "%kata check"))
    if picture:
        cells.append(("code", "%kata see"))
    cells.append(("code", "%kata progress"))
    return cells


def setup_cell(number: str, course_url: str = "") -> str:
    """The first code cell: in a fresh runtime, fetch the course from `COURSE` and install it; then `%kata`."""
    return "\n".join([
        COURSE_URL.replace('""', json.dumps(course_url), 1),
        "import importlib.util",
        "if importlib.util.find_spec(\"diffusion_katas\") is None:  # a fresh runtime: fetch and install the course",
        "    !git clone -q --depth 1 {COURSE} course",
        "    %cd course",
        "    !python -m pip install -q $(nvidia-smi -L >/dev/null 2>&1 || echo --extra-index-url "
        "https://download.pytorch.org/whl/cpu) \".[notebook]\"",
        "    importlib.invalidate_caches()",
        "%load_ext diffusion_katas",
        f"%kata lab {number}",
    ])


def lab_notebook(kata_text: str, lab: str, picture: bool = False, course_url: str = "") -> str:
    """The lab's notebook as nbformat 4.5 JSON text, the same bytes for the same kata text."""
    cells = []
    for n, (kind, source) in enumerate(lab_cells(kata_text, lab, picture, course_url), 1):
        cell = {"cell_type": kind, "id": f"{lab[:2]}-{n:02d}", "metadata": {}, "source": _lines(source)}
        if kind == "code":
            cell.update(execution_count=None, outputs=[])
        cells.append(cell)
    notebook = {"cells": cells, "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "kata": {"lab": lab, "derived_from": f"katas/{lab}.py"}}, "nbformat": 4, "nbformat_minor": 5}
    return json.dumps(notebook, indent=1, ensure_ascii=False) + "\n"


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def changed_functions(before: str, after: str) -> list[str]:
    """The top-level functions whose code differs between two versions of a file (comments aside), in the
    order `after` has them; every function when either does not parse."""
    try:
        old = {n.name: ast.dump(n) for n in ast.parse(before).body if isinstance(n, ast.FunctionDef)}
        new = [(n.name, ast.dump(n)) for n in ast.parse(after).body if isinstance(n, ast.FunctionDef)]
    except SyntaxError:
        return []
    return [name for name, code in new if old.get(name) != code]


def todo_functions(kata_text: str) -> list[str]:
    """The functions a kata file has as TODO stubs (in its pristine form: the graded functions), in order."""
    return [n.name for n in ast.parse(kata_text).body if is_todo(n)]


# ---- a notebook's code, into the kata file ---------------------------------------------------------------
BUILTINS = set(dir(builtins)) | {"__file__", "__name__", "__doc__"}


class Defined:
    """What the cells define, by name: the statement's source and the names it uses."""

    def __init__(self) -> None:
        self.statements: dict[str, tuple[int, str, ast.stmt]] = {}  # name -> (order, source, node)
        self.order = 0

    def read(self, source: str) -> None:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return  # a cell that is not Python (the kernel said so when it ran)
        lines = source.splitlines()
        for node in tree.body:
            names = bound_names(node)
            if not names:
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                span = (node.lineno - 1, node.end_lineno)
            else:
                span = statement_span(node, lines)
            text = "\n".join(lines[span[0]:span[1]]).rstrip()
            self.order += 1
            for name in names:
                self.statements[name] = (self.order, text, node)


def bound_names(node: ast.stmt) -> list[str]:
    """The top-level names a statement binds, for the statements a notebook's code may bring to the file."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Import):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return [] if node.module == "__future__" else [a.asname or a.name for a in node.names if a.name != "*"]
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if all(isinstance(t, ast.Name) for t in targets) and node.value is not None:
            return [t.id for t in targets]
    return []


def used_names(source: str) -> set[str]:
    """The global names a statement's code reads (its functions' parameters and locals are not), by the
    compiler's own symbol tables."""
    names: set[str] = set()

    def visit(table: symtable.SymbolTable, top: bool) -> None:
        for symbol in table.get_symbols():
            if symbol.is_referenced() and (top or symbol.is_global()):
                names.add(symbol.get_name())
        for child in table.get_children():
            visit(child, False)

    try:
        visit(symtable.symtable(source, "<cell>", "exec"), True)
    except SyntaxError:
        pass
    return names


def splice(kata_text: str, cells: list[str], pristine_text: str | None = None) -> tuple[str, list[str]]:
    """(the kata text with the cells' code, notes for the learner): see the module docstring for the rule.
    `cells` in the order they ran; a cell that does not parse is skipped."""
    defined = Defined()
    for source in cells:
        defined.read(source)
    tree = ast.parse(kata_text)
    lines = kata_text.splitlines()
    pristine = {}
    if pristine_text is not None:
        try:
            pristine = {n.name: ast.dump(n) for n in ast.parse(pristine_text).body if is_todo(n)}
        except SyntaxError:
            pristine = {}
    notes: list[str] = []
    replaced: dict[int, str] = {}  # index into tree.body -> new source
    file_names: set[str] = set()
    brought: set[str] = set()
    for i, node in enumerate(tree.body):
        names = bound_names(node)
        file_names.update(names)
        if isinstance(node, (ast.Import, ast.ImportFrom)) or len(names) != 1 or names[0] not in defined.statements:
            continue
        _, text, new = defined.statements[names[0]]
        if type(new) is not type(node) and not (bound_names(new) == names):
            continue
        if ast.dump(new) == ast.dump(node):
            continue
        if names[0] in pristine and ast.dump(new) == pristine[names[0]]:
            notes.append(f"`{names[0]}` in your notebook is still its TODO stub, but {{kata}} has code of yours "
                         f"for it: kept the file's (`%kata load {names[0]}` puts it in a cell)")
            continue
        replaced[i] = text
        brought.add(names[0])
    # what the code brought over uses, and only the cells define
    wanted = set()
    for name in brought:
        wanted |= used_names(defined.statements[name][1])
    added: dict[str, tuple[int, str, ast.stmt]] = {}
    while True:
        missing = {n for n in wanted if n not in file_names and n not in added and n in defined.statements}
        if not missing:
            break
        for name in missing:
            added[name] = defined.statements[name]
            wanted |= used_names(defined.statements[name][1])
    unknown = sorted(n for n in wanted - file_names - set(added) - BUILTINS)
    if unknown:
        notes.append("your code uses " + ", ".join(f"`{n}`" for n in unknown) + " that neither {kata} nor a cell "
                     "you ran defines at top level: the grading will say NameError")
    if not replaced and not added:
        return kata_text, notes
    out: list[str] = []
    body_spans = []
    for i, node in enumerate(tree.body):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            body_spans.append((node.lineno - 1, node.end_lineno))
        else:
            body_spans.append(statement_span(node, lines))
    imports = sorted({(order, text) for order, text, node in added.values()
                      if isinstance(node, (ast.Import, ast.ImportFrom))})
    others = sorted({(order, text) for order, text, node in added.values()
                     if not isinstance(node, (ast.Import, ast.ImportFrom))})
    last_import = max((i for i, node in enumerate(tree.body) if isinstance(node, (ast.Import, ast.ImportFrom))),
                      default=0 if ast.get_docstring(tree) is not None else None)  # else after the docstring
    at = 0
    for i, (start, end) in enumerate(body_spans):
        out.extend(lines[at:start])
        if i in replaced:
            out.extend(replaced[i].splitlines())
        else:
            out.extend(lines[start:end])
        at = end
        if i == last_import and imports:
            out.extend(text for _, text in imports)
    out.extend(lines[at:])
    if imports and last_import is None:
        out = [text for _, text in imports] + out
    while out and not out[-1].strip():
        out.pop()
    for _, text in others:
        out.extend(["", "", text])
    return "\n".join(out) + "\n", notes
