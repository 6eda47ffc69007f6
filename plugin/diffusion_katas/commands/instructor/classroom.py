"""`kata classroom`: a GitHub Classroom autograding workflow written from the graders, one test per kata function.

The workflow runs in the learner's repository (a template made from `kata learner-copy`), so it grades with
nothing that repository's files can change. Its first step, before anything from the repository runs, checks
that the grading files (the graders, the engine's source in plugin/, the project's pyproject.toml, the pytest
configuration .github/kata-grading.ini written beside the workflow) are byte for byte the instructor's (SHA-256,
recorded when the workflow was written), or no test runs and nothing is awarded. The project is installed as a
wheel (not editable: no folder of the repository goes on Python's path), and pytest runs isolated (`python -I`:
the working directory is not on the path either, so a `pytest.py` or `diffusion_katas/` of the repository's
cannot stand in), reads no conftest.py (`--noconftest`) and no configuration but the workflow's own (`-c`).

One grading step grades every lab once and writes its report (--kata-json) to a fresh folder; then each kata
function is a test of its own, worth its points, that passes when the report says the function passes: partial
credit by function. The workflow file itself lives in the learner's repository too: the README says to list
.github/, graders/, plugin/ and pyproject.toml among the assignment's protected paths.
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


RESULTS = ".kata-grade/results.json"  # the grading step's report, in a folder it empties first


def engine_files(course) -> dict[str, bytes]:
    """The engine's source as the learner's repository holds it (plugin/diffusion_katas, as `kata learner-copy`
    writes it), by path; empty where the course does not carry it."""
    package = course.root / "plugin" / "diffusion_katas"
    if not package.is_dir():
        return {}
    return {p.relative_to(course.root).as_posix(): p.read_bytes() for p in sorted(package.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def grading_files(course, catalog: Catalog, ini_text: str) -> dict[str, str]:
    """SHA-256 of every file the grade depends on, by its path in the learner's repository."""
    digests = {f"graders/{lab}.py": hashlib.sha256(course.grader(lab).read_bytes()).hexdigest()
               for lab in catalog.labs}
    digests[f".github/{INI}"] = hashlib.sha256(ini_text.encode("utf-8")).hexdigest()
    pyproject = course.root / "pyproject.toml"
    if pyproject.is_file():
        digests["pyproject.toml"] = hashlib.sha256(pyproject.read_bytes()).hexdigest()
    digests.update({path: hashlib.sha256(data).hexdigest() for path, data in engine_files(course).items()})
    return digests


def test_id(lab: str, function: str) -> str:
    return f"{lab}-{function}".replace("_", "-")


def classroom_workflow(catalog: Catalog, python: str, timeout_minutes: int, digests: dict[str, str] | None = None) -> str:
    tests = [(f.lab, f.name, f.points) for f in catalog.all_functions()]
    ids = {(lab, name): test_id(lab, name) for lab, name, _ in tests}
    lines = [
        "# GitHub Classroom autograding, written by `kata classroom` from the graders: one test per kata function.",
        "# One step grades every lab once; then each function's test earns its max-score (its grader's",
        "# Kata.points) when that grading says the function passes.",
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
    ]
    if digests:
        lines += [  # before anything of the repository's runs (installing it runs its build)
            "    - name: Check the grading files are the instructor's",
            "      run: |",
            "        sha256sum --check --strict --quiet <<'EOF'",
            *[f"        {digest}  {path}" for path, digest in sorted(digests.items())],
            "        EOF",
        ]
    lines += [
        "    - name: Install the course (a wheel, with the pinned dependencies)",
        f"      run: python -m pip install --extra-index-url {TORCH_CPU_INDEX} .",
        "    - name: Grade every lab once",
        f"      timeout-minutes: {min(360, timeout_minutes * max(1, len(catalog.labs)))}",
        "      run: |",
        f"        rm -rf {RESULTS.rsplit('/', 1)[0]} && mkdir {RESULTS.rsplit('/', 1)[0]}",
        f"        python -I -m pytest --noconftest -p no:cacheprovider -c .github/{INI} --rootdir . katas "
        f"--kata-json {RESULTS} || true",
    ]
    for lab, name, points in tests:
        title = f"{catalog.titles.get(lab, lab).split(' · ')[0]} · {name}"
        lines += [
            f"    - name: {_yaml(title)}",
            f"      id: {ids[lab, name]}",
            "      uses: classroom-resources/autograding-command-grader@v1",
            "      with:",
            f"        test-name: {_yaml(title)}",
            "        setup-command: ''",
            f"        command: python -I -m diffusion_katas classroom-result {RESULTS} {lab} {name}",
            "        timeout: 1",
            f"        max-score: {number_text(points)}",
        ]
    lines += [
        "    - name: Autograding Reporter",
        "      uses: classroom-resources/autograding-grading-reporter@v1",
        "      env:",
        *[f"        {i.upper()}_RESULTS: \"${{{{steps.{i}.outputs.result}}}}\"" for i in ids.values()],
        "      with:",
        f"        runners: {','.join(ids.values())}",
    ]
    return "\n".join(lines) + "\n"


def classroom_result(path: Path, lab: str, function: str, out=print) -> int:
    """A function's test in the workflow: 0 when the grading's report says it passes, else 1, with what failed."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        functions = {(entry["lab"], f["name"]): f["status"] for entry in report["labs"] for f in entry["functions"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        out(f"no grading report at {path} ({exc.__class__.__name__}): the grading step did not finish")
        return 1
    status = functions.get((lab, function))
    if status is None:
        out(f"{lab}::{function} was not graded")
        return 1
    out(f"{lab}::{function}: {status}")
    for result in report.get("results", []):
        if result.get("lab") == lab and result.get("function") == function and result.get("status") != "passed":
            out(f"  {result.get('check')}: {result.get('status')}  {str(result.get('message', ''))[:300]}")
    return 0 if status == "passed" else 1


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
