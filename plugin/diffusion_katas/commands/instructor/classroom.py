"""`kata classroom`: a GitHub Classroom autograding workflow written from the graders, one test per lab."""
from __future__ import annotations

import json
from pathlib import Path

from diffusion_katas.commands.instructor.bundle import TORCH_CPU_INDEX
from diffusion_katas.commands.instructor.catalog import Catalog, InstructorError, number_text


def _yaml(text: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(text, ensure_ascii=False)


def classroom_workflow(catalog: Catalog, python: str, timeout_minutes: int) -> str:
    ids = {lab: "lab-" + lab.replace("_", "-") for lab in catalog.labs}
    lines = [
        "# GitHub Classroom autograding, written by `kata classroom` from the graders: one test per lab.",
        "# A lab's test earns its max-score (the sum of its graders' Kata.points) when",
        "# `python -m pytest katas/NN_lab.py` exits 0, that is when every kata function of the lab passes.",
        "name: Autograding Tests",
        "'on':",
        "- push",
        "- repository_dispatch",
        "permissions:",
        "  checks: write",
        "  actions: read",
        "  contents: read",
        "jobs:",
        "  run-autograding-tests:",
        "    runs-on: ubuntu-latest",
        "    if: github.actor != 'github-classroom[bot]'",
        "    steps:",
        "    - name: Checkout code",
        "      uses: actions/checkout@v4",
        "    - name: Set up Python",
        "      uses: actions/setup-python@v5",
        "      with:",
        f"        python-version: '{python}'",
        "    - name: Install the pinned dependencies",
        f"      run: python -m pip install --extra-index-url {TORCH_CPU_INDEX} -e .",
    ]
    for lab in catalog.labs:
        title = catalog.titles.get(lab, lab)
        lines += [
            f"    - name: {_yaml(title)}",
            f"      id: {ids[lab]}",
            "      uses: classroom-resources/autograding-command-grader@v1",
            "      with:",
            f"        test-name: {_yaml(title)}",
            "        setup-command: ''",
            f"        command: python -m pytest katas/{lab}.py",
            f"        timeout: {timeout_minutes}",
            f"        max-score: {number_text(catalog.points(lab))}",
        ]
    lines += [
        "    - name: Autograding Reporter",
        "      uses: classroom-resources/autograding-grading-reporter@v1",
        "      env:",
        *[f"        {ids[lab].upper()}_RESULTS: \"${{{{steps.{ids[lab]}.outputs.result}}}}\"" for lab in catalog.labs],
        "      with:",
        f"        runners: {','.join(ids[lab] for lab in catalog.labs)}",
    ]
    return "\n".join(lines) + "\n"


def write_workflow(path: Path, catalog: Catalog, python: str, timeout_minutes: int, force: bool) -> None:
    """Write the workflow to `path`, unless a different file is there (and not `force`)."""
    text = classroom_workflow(catalog, python, timeout_minutes)
    if path.exists() and path.read_text(encoding="utf-8") != text and not force:
        raise InstructorError(f"{path} exists and differs: pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
