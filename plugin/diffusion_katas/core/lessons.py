"""A lab's lesson, read from its module docstring: concept, mental model, traps, precision (the
course's precision policy, where a lab states it), how to say it out loud.

The text comes from the lab file (solutions/ is the source; katas/ carries the same text), so the
terminal and the file never disagree. Reading it imports nothing heavy.
"""
from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

SECTIONS = ("Concept", "Mental model", "Traps", "Precision", "Say it out loud", "Graded against", "Run")


def lesson(path: Path) -> tuple[str, dict[str, str]]:
    """(title, {section: text}) from a lab file's docstring; headings are lines ending in ':'."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or path.stem
    title, *rest = doc.splitlines()
    sections: dict[str, str] = {}
    current = None
    for line in rest:
        heading = re.match(r"^(%s):\s*(.*)$" % "|".join(map(re.escape, SECTIONS)), line)
        if heading:
            current = heading.group(1)
            sections[current] = heading.group(2)
        elif current:
            sections[current] += "\n" + line
    return title.strip(), {k: v.strip("\n") for k, v in sections.items()}


def render(path: Path, only: str | None = None) -> str:
    title, sections = lesson(path)
    out = [title, "=" * len(title)]
    for name in SECTIONS:
        if name in sections and (only is None or name.lower() == only.lower()):
            body = sections[name]
            if "\n" in body or len(body) > 60:
                first, _, more = body.partition("\n")
                text = textwrap.dedent(first.strip() + "\n" + textwrap.dedent(more)).strip("\n")
                out += ["", f"{name}:", textwrap.indent(text, "  ")]
            else:
                out += ["", f"{name}: {body}"]
    return "\n".join(out)
