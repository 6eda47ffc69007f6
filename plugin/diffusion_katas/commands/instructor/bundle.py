"""`kata gradescope-bundle` and the autograde entry point: a Gradescope autograder zip, and what it runs.

The bundle holds setup.sh (installs the pinned dependencies and the bundled project), run_autograder
(calls `python3 -m diffusion_katas autograde`) and project/ (the package, the selected graders and
autograder.json). A submission is graded as `kata class` grades one (classgrade.py).
"""
from __future__ import annotations

import json
import random
import shlex
import tempfile
import time
import zipfile
from pathlib import Path

from diffusion_katas.commands.instructor.catalog import Catalog, number_text, read_pyproject
from diffusion_katas.core.course import Course
from diffusion_katas.commands.instructor.children import Grading, cuda_pass, cuda_present, first_pass, needs_cuda_pass
from diffusion_katas.commands.instructor.classgrade import tampered
from diffusion_katas.commands.instructor.guard import Guard
from diffusion_katas.commands.instructor.hidden import Hidden
from diffusion_katas.commands.running import write_json
from diffusion_katas.core.results import validate_gradescope
from diffusion_katas.commands.instructor.scoring import conclude, zero_gradescope
from diffusion_katas.commands.instructor.submissions import lay_out

DEFAULT_AUTOGRADER_TIMEOUT = 600.0
MANIFEST = "autograder.json"
HIDDEN = "hidden.json"  # the hidden seed and cases; `kata autograde` deletes it before grading
# Pinned at bundle time from pyproject.toml's [project].dependencies; this list is the fallback.
FALLBACK_DEPENDENCIES = ("torch==2.13.0", "diffusers==0.42.1", "peft==0.21.2", "transformers==5.23.0",
                         "accelerate", "numpy", "pytest", "pytest-timeout")
# The graders run on the CPU: take torch's CPU wheels (the default Linux wheel pulls in CUDA libraries).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"

SETUP_SH = """\
#!/usr/bin/env bash
# Gradescope runs this once, when it builds the autograder image: it installs the pinned dependencies
# and the bundled project. run_autograder installs nothing.
set -euo pipefail
SOURCE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
if ! command -v python3 >/dev/null 2>&1 || ! python3 -m pip --version >/dev/null 2>&1; then
  apt-get update && apt-get install -y python3 python3-pip
fi
export PIP_BREAK_SYSTEM_PACKAGES=1  # images whose system Python is marked externally managed
# CPU wheels of torch: the graders run on the CPU, and the default Linux wheel pulls in CUDA libraries.
python3 -m pip install --extra-index-url {index} {dependencies}
python3 -m pip install --no-deps -e "$SOURCE/project"
"""

RUN_AUTOGRADER = """\
#!/usr/bin/env bash
# Gradescope runs this for every submission (as /autograder/run_autograder). It installs nothing
# (setup.sh did). It copies the kata files of $AUTOGRADER_ROOT/submission into the bundled project's
# katas/, grades them with `python3 -m pytest katas ... --gradescope <random path>` in a
# child process under a wall-clock limit (`kata autograde`), and writes
# $AUTOGRADER_ROOT/results/results.json from what that child reported: a child that crashes, hangs or
# writes nothing scores 0 with the reason. AUTOGRADER_ROOT defaults to /autograder (set it to test this).
set -u
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PROJECT="$ROOT/source/project"
PYTHON="${KATA_PYTHON:-python3}"
RESULTS="$ROOT/results/results.json"
mkdir -p "$ROOT/results"
rm -f "$RESULTS"  # only what this run writes counts
cd "$PROJECT" || exit 1
PYTHONPATH="$PROJECT/plugin${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m diffusion_katas autograde \\
  --project "$PROJECT" --submission "$ROOT/submission" --results "$RESULTS"
status=$?
if [ ! -s "$RESULTS" ]; then
  cat > "$RESULTS" <<EOF
{"score": 0, "output": "Not graded: the autograder failed (its grading program exited with status $status and wrote no results). Please tell your instructor.", "visibility": "visible", "stdout_visibility": "hidden", "tests": []}
EOF
fi
exit 0
"""


def bundle_dependencies(course: Course) -> list[str]:
    deps = read_pyproject(course.root).get("project", {}).get("dependencies")
    return list(deps) if deps else list(FALLBACK_DEPENDENCIES)


def bundle_files(course: Course, labs: list[str]) -> list[tuple[str, Path]]:
    """(name in the zip, file): the project an autograder needs: the package and the selected labs'
    graders. Not solutions/: grading katas never reads them."""
    root = course.root
    files = [(f"project/{name}", root / name) for name in ("pyproject.toml", "README.md", "conftest.py")
             if (root / name).is_file()]
    package = [p for p in sorted((root / "plugin").rglob("*")) if p.is_file()]
    graders = [course.grader(lab) for lab in labs]
    for path in package + graders:
        rel = path.relative_to(root)
        if "__pycache__" in rel.parts or path.suffix in (".pyc", ".pyo") or ".egg-info" in str(rel):
            continue
        files.append((f"project/{rel.as_posix()}", path))
    return files


def bundle_options(args) -> list[str]:
    """The grading options the bundle's children get (from autograder.json), the seed aside. The hidden
    seed and cases are not options: they live in hidden.json until `kata autograde` reads and deletes it."""
    options = []
    if args.kata_timeout is not None:
        options += ["--kata-timeout", f"{args.kata_timeout:g}"]
    if args.hidden_output:
        options += ["--kata-hidden-output", args.hidden_output]
    return options


def write_bundle(out: Path, course: Course, catalog: Catalog, args, hidden: Hidden | None = None) -> None:
    """Write the autograder zip for the catalog's labs."""
    manifest = {"labs": catalog.labs, "timeout": args.timeout, "pytest_args": bundle_options(args),
                "catalog": catalog.to_json()}
    setup = SETUP_SH.format(index=TORCH_CPU_INDEX,
                            dependencies=" ".join(shlex.quote(d) for d in bundle_dependencies(course)))
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as bundle:
        def add(name: str, data: bytes, mode: int = 0o644) -> None:
            info = zipfile.ZipInfo(name, date_time=time.localtime()[:6])
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            bundle.writestr(info, data)

        add("setup.sh", setup.encode(), 0o755)
        add("run_autograder", RUN_AUTOGRADER.encode(), 0o755)
        for name, path in bundle_files(course, catalog.labs):
            add(name, path.read_bytes())
        add(f"project/{MANIFEST}", json.dumps(manifest, indent=2, ensure_ascii=False).encode())
        if hidden:
            add(f"project/{HIDDEN}", hidden.secret(), 0o600)


def take_hidden(project: Path) -> Hidden:
    """The hidden seed and cases of the bundle, read into memory and their file deleted, before any
    submission code runs (Gradescope runs it as the same user: a file left there could be read)."""
    path = project / HIDDEN
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Hidden()
    path.unlink()
    return Hidden.from_secret(data)


def autograde(project: Path, submission: Path, results: Path) -> int:
    """Grade one Gradescope submission (run_autograder calls this) and write results.json."""
    project = project.resolve()
    results.parent.mkdir(parents=True, exist_ok=True)
    try:
        manifest = json.loads((project / MANIFEST).read_text(encoding="utf-8"))
        catalog = Catalog.from_json(manifest["catalog"])
    except (OSError, ValueError, KeyError) as exc:
        write_json(results, {"score": 0.0, "output": f"Not graded: the autograder bundle is broken ({exc}).",
                             "visibility": "visible", "stdout_visibility": "hidden", "tests": []})
        return 1
    hidden = take_hidden(project)
    seed = random.SystemRandom().randrange(1, 10**6)
    with tempfile.TemporaryDirectory(prefix="kata-autograde-") as tmp:
        grading = Grading(catalog, ["--kata-seed", str(seed), *manifest.get("pytest_args", [])],
                          float(manifest.get("timeout", DEFAULT_AUTOGRADER_TIMEOUT)), Path(tmp),
                          secret=hidden.secret(), cuda=cuda_present())
        prep = lay_out("submission", submission, project, project / "pyproject.toml", catalog)
        guard = Guard([project])  # the package, the graders, pytest settings, the copied kata files
        changed: list[str] = []
        try:
            runs = [r for r in [first_pass(prep, grading)] if r is not None]
            changed = guard.check_and_restore()
            if runs and not changed and needs_cuda_pass(prep, runs[0], grading):
                runs.append(cuda_pass(prep, grading))
                changed = guard.check_and_restore()
        finally:
            grading.children.kill_all()
        if changed:
            graded = tampered(prep, catalog, changed[0], runs[0] if runs else None)
        else:
            graded = conclude(prep, runs, catalog, cuda_skipped=not grading.cuda and bool(prep.present))
    data = graded.gradescope
    if validate_gradescope(data):
        data = zero_gradescope(catalog, "the grader's results were not a valid Gradescope file: "
                               + "; ".join(validate_gradescope(data)))
    write_json(results, data)
    print(f"graded with seed {seed}: {number_text(graded.score)}/{number_text(graded.max_score)} "
          f"({graded.outcome})" + (f": {graded.reason}" if graded.reason else ""))
    for run in runs:
        print(f"--- pass -m {run.marker!r}: exit code {run.returncode}, {run.seconds:.1f} s\n{run.output_tail}")
    return 0
