"""`kata classroom`: a GitHub Classroom autograding workflow written from the graders, one test per lab.

The workflow runs in the learner's repository, so it grades with nothing that repository's files can change:
pytest reads no conftest.py (`--noconftest`) and no configuration but the workflow's own (`-c`
.github/kata-grading.ini, written beside it), and a first step checks that the grading files (the graders, that
ini, the project's pyproject.toml) are byte for byte the instructor's (SHA-256, recorded when the workflow was
written), or every lab scores 0. The workflow file itself lives in the learner's repository too: the README says
to list .github/, graders/ and pyproject.toml among the assignment's protected paths.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from diffusion_katas.commands.instructor.bundle import TORCH_CPU_INDEX
from diffusion_katas.commands.instructor.catalog import Catalog, InstructorError, number_text


def _yaml(text: str) -> str:
    """A YAML double-quoted scalar (JSON strings are valid YAML)."""
    return json.dumps(text, ensure_ascii=False)


INI = "kata-grading.ini"  # beside the workflow folder: .github/kata-grading.ini


def grading_ini(course, catalog: Catalog) -> str:
    """The pytest configuration the workflow grades with: the course's settings, katas/ and graders/ of the
    repository, the selected labs; nothing from the repository's own pyproject.toml or conftest.py."""
    from diffusion_katas.commands.instructor.catalog import read_pyproject
    from diffusion_katas.commands.instructor.submissions import ini_text

    options = dict(read_pyproject(course.root).get("tool", {}).get("pytest", {}).get("ini_options", {}))
    for key in ("testpaths", "pytest_plugins", "kata_dir", "kata_solutions_dir", "kata_graders_dir", "kata_labs",
                "addopts"):
        options.pop(key, None)
    options.update(testpaths=["katas"], kata_dir="katas", kata_solutions_dir="no-solutions-here",
                   kata_graders_dir="graders", kata_labs=list(catalog.labs))
    return ini_text(options, "# Written by `kata classroom`: the configuration the autograding workflow grades with.")


def grading_files(course, catalog: Catalog, ini_text: str) -> dict[str, str]:
    """SHA-256 of every file the grade depends on, by its path in the learner's repository."""
    digests = {f"graders/{lab}.py": hashlib.sha256(course.grader(lab).read_bytes()).hexdigest()
               for lab in catalog.labs}
    digests[f".github/{INI}"] = hashlib.sha256(ini_text.encode("utf-8")).hexdigest()
    pyproject = course.root / "pyproject.toml"
    if pyproject.is_file():
        digests["pyproject.toml"] = hashlib.sha256(pyproject.read_bytes()).hexdigest()
    return digests


def classroom_workflow(catalog: Catalog, python: str, timeout_minutes: int, digests: dict[str, str] | None = None) -> str:
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
    if digests:
        lines += [
            "    - name: Check the grading files are the instructor's",
            "      run: |",
            "        sha256sum --check --strict <<'EOF'",
            *[f"        {digest}  {path}" for path, digest in sorted(digests.items())],
            "        EOF",
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
            f"        command: python -m pytest --noconftest -p no:cacheprovider -c .github/{INI} --rootdir . "
            f"katas/{lab}.py",
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


def write_workflow(path: Path, catalog: Catalog, python: str, timeout_minutes: int, force: bool, course=None) -> None:
    """Write the workflow to `path` (and its pytest configuration beside the workflows folder), unless a different
    file is there (and not `force`)."""
    ini = grading_ini(course, catalog) if course is not None else None
    text = classroom_workflow(catalog, python, timeout_minutes,
                              grading_files(course, catalog, ini) if course is not None else None)
    ini_path = path.parent.parent / INI
    for target, content in ((path, text), (ini_path, ini)):
        if content is not None and target.exists() and target.read_text(encoding="utf-8") != content and not force:
            raise InstructorError(f"{target} exists and differs: pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    if ini is not None:
        ini_path.write_text(ini, encoding="utf-8")
