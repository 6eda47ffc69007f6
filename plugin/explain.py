"""Read a lab's lesson from the terminal: concept, mental model, traps, how to say it out loud.

    python -m plugin.explain            # list the labs
    python -m plugin.explain 04         # one lab, by number or by name (04_classifier_free_guidance)
    python -m plugin.explain 04 --section traps

The text comes from the lab's module docstring (solutions/ is the source; katas/ carries the same text),
so the terminal and the file never disagree. Reading it imports nothing heavy.
"""
from __future__ import annotations

import argparse
import ast
import re
import textwrap
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("Concept", "Mental model", "Traps", "Say it out loud", "Graded against", "Run")


def lab_files(kata_dir: Path = ROOT / "katas") -> list[Path]:
    return sorted(kata_dir.glob("[0-9][0-9]_*.py"))


def find_lab(name: str, kata_dir: Path = ROOT / "katas") -> Path:
    """A lab file from '4', '04', '04_classifier_free_guidance' or a unique part of its name."""
    files = lab_files(kata_dir)
    if name.isdigit():
        hits = [p for p in files if p.name.startswith(f"{int(name):02d}_")]
    else:
        hits = [p for p in files if p.stem == name] or [p for p in files if name in p.stem]
    if len(hits) != 1:
        known = ", ".join(p.stem for p in files)
        raise LookupError(f"no single lab matches {name!r}; the labs are: {known}")
    return hits[0]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugin.explain", description=__doc__.split("\n")[0])
    parser.add_argument("lab", nargs="?", help="lab number or name; omit to list the labs")
    parser.add_argument("--section", choices=[s.lower() for s in SECTIONS], help="print one section only")
    args = parser.parse_args(argv)
    if not args.lab:
        for path in lab_files():
            print(f"{path.stem:<32} {lesson(path)[0]}")
        return 0
    try:
        path = find_lab(args.lab)
    except LookupError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(render(path, args.section))
    return 0


if __name__ == "__main__":
    sys.exit(main())
