"""Derive katas/ from solutions/: every solution block becomes a TODO that raises NotImplementedError.

In a solution file a block reads

    # BEGIN SOLUTION: square a linspace over √β
    ... the solution, with its why-comments ...
    # END SOLUTION

and in the derived kata file it becomes

    # TODO: square a linspace over √β
    raise NotImplementedError

`kata derive` rewrites katas/, and notebooks/ from the katas (core/notebooks.py: the same lab as Jupyter cells);
`kata derive --check` only reports drift (a test runs the same check). Everything outside the markers is copied
as it is: one source of truth.
"""
from __future__ import annotations

import re
from pathlib import Path

BEGIN = re.compile(r"^(?P<indent>\s*)# BEGIN SOLUTION(?::\s*(?P<todo>.*))?$")
END = re.compile(r"^\s*# END SOLUTION\s*$")


class MarkerError(ValueError):
    pass


def strip_solutions(text: str, name: str = "<solution>") -> str:
    """The kata text for a solution text."""
    out: list[str] = []
    inside = None
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        begin = BEGIN.match(line.rstrip("\n"))
        if begin:
            if inside is not None:
                raise MarkerError(f"{name}:{number}: BEGIN SOLUTION inside the block opened at line {inside}")
            inside = number
            indent = begin["indent"]
            todo = (begin["todo"] or "write this function (see the docstring)").strip()
            out.append(f"{indent}# TODO: {todo}\n{indent}raise NotImplementedError\n")
        elif END.match(line.rstrip("\n")):
            if inside is None:
                raise MarkerError(f"{name}:{number}: END SOLUTION without BEGIN SOLUTION")
            inside = None
        elif inside is None:
            out.append(line)
    if inside is not None:
        raise MarkerError(f"{name}:{inside}: BEGIN SOLUTION is never closed")
    return "".join(out)


def derived(solutions_dir: Path) -> dict[str, str]:
    """File name -> kata text, for every lab file in solutions/."""
    return {p.name: strip_solutions(p.read_text(encoding="utf-8"), str(p))
            for p in sorted(solutions_dir.glob("[0-9][0-9]_*.py"))}


def derived_notebooks(solutions_dir: Path) -> dict[str, str]:
    """Notebook file name -> its JSON text, for every lab file in solutions/ (from the kata it derives)."""
    from diffusion_katas.core.notebooks import PICTURED, lab_notebook

    return {name[:-3] + ".ipynb": lab_notebook(text, name[:-3], picture=name[:-3] in PICTURED)
            for name, text in derived(solutions_dir).items()}


def drift(solutions_dir: Path, kata_dir: Path, notebook_dir: Path | None = None) -> list[str]:
    """Kata files (and notebooks, given their folder) that differ from what the solutions derive (missing,
    stale or extra)."""
    problems = _drift(derived(solutions_dir), kata_dir, "[0-9][0-9]_*.py", solutions_dir)
    if notebook_dir is not None:
        problems += _drift(derived_notebooks(solutions_dir), notebook_dir, "[0-9][0-9]_*.ipynb", solutions_dir)
    return problems


def _drift(want: dict[str, str], folder: Path, pattern: str, solutions_dir: Path) -> list[str]:
    have = {p.name for p in folder.glob(pattern)}
    source = {n: n.rsplit(".", 1)[0] + ".py" for n in want}
    problems = [f"{folder.name}/{n} is missing" for n in want if n not in have]
    problems += [f"{folder.name}/{n} has no solution" for n in sorted(have - set(want))]
    problems += [f"{folder.name}/{n} differs from what {solutions_dir.name}/{source[n]} derives"
                 for n in want if n in have and (folder / n).read_text(encoding="utf-8") != want[n]]
    return problems
