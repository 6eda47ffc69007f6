"""The package: one import package, layered by role, silent outside a course, usable as a plain install.

Layers, bottom up; an import may only point down (or stay inside its own subpackage):
    core (0) <- engine (1) <- pytest_plugin (2);  core (0) <- commands (3)
The commands talk to pytest only through its subprocess and the results file, so they import the core
and nothing of the engine or the plugin. Graders (course content) use the core and the engine.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "plugin" / "diffusion_katas"
LAYERS = {"core": 0, "engine": 1, "pytest_plugin": 2, "commands": 3}
# What each layer may import from the package, besides itself.
ALLOWED = {"core": set(), "engine": {"core"}, "pytest_plugin": {"core", "engine"}, "commands": {"core"}}
STDLIB = set(sys.stdlib_module_names)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, *, top_level_only: bool = False) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in a file; with top_level_only, those that run at import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = module_name(path).split(".") if PACKAGE.parent in path.parents else [path.stem]
    package = here if path.name == "__init__.py" else here[:-1]
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            found.append((base, node.lineno))
            # `from diffusion_katas.commands import maintainer` imports the submodule too
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "diffusion_katas" and parts[1] in LAYERS else None


def test_the_package_layers_point_one_way():
    modules = package_modules()
    upward = []
    for name, path in modules.items():
        mine = layer(name)
        for target, line in imports_of(path):
            theirs = layer(target)
            if mine is None or theirs is None or theirs == mine:
                continue
            if theirs not in ALLOWED[mine]:
                upward.append(f"{path.relative_to(REPO)}:{line}: {mine} imports {target} ({theirs})")
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_the_learner_and_instructor_commands_do_not_import_each_other():
    crossings = []
    for name, path in package_modules().items():
        for side, other in (("learner", "instructor"), ("instructor", "learner")):
            if name.startswith(f"diffusion_katas.commands.{side}"):
                crossings += [f"{path.relative_to(REPO)}:{line}: {target}" for target, line in imports_of(path)
                              if target.startswith(f"diffusion_katas.commands.{other}")]
    assert not crossings, "\n".join(crossings)


def test_no_circle_among_the_package_modules():
    modules = package_modules()
    graph = {name: {t for t, _ in imports_of(path) if t in modules and t != name} for name, path in modules.items()}
    # a package's __init__ importing nothing, `a.b` importing `a` is the package, not a circle
    state: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_core_imports_only_the_standard_library_when_it_loads():
    heavy = []
    for name, path in package_modules().items():
        if layer(name) != "core":
            continue
        for target, line in imports_of(path, top_level_only=True):
            top = target.split(".")[0]
            if top not in STDLIB and top not in ("diffusion_katas", "__future__"):
                heavy.append(f"{path.relative_to(REPO)}:{line}: {target}")
    assert not heavy, "the core must stay pure:\n" + "\n".join(heavy)


def test_graders_use_only_the_core_and_the_engine():
    wrong = []
    for path in sorted((REPO / "graders").glob("[0-9][0-9]_*.py")):
        for target, line in imports_of(path):
            if layer(target) in ("pytest_plugin", "commands"):
                wrong.append(f"graders/{path.name}:{line}: {target}")
    assert not wrong, "\n".join(wrong)


def test_the_only_top_level_import_package_is_diffusion_katas(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    import zipfile

    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"diffusion_katas"}, tops
    entry_points = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "diffusion_katas = diffusion_katas.pytest_plugin.plugin" in entry_points
    assert "kata = diffusion_katas.commands.main:main" in entry_points


def test_pytest_outside_a_course_prints_nothing_of_ours(tmp_path):
    (tmp_path / "test_other.py").write_text("def test_it():\n    assert True\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "katas:" not in done.stdout and "kata progress" not in done.stdout


def test_the_plugin_can_be_turned_off_by_its_short_name():
    done = subprocess.run([sys.executable, "-m", "pytest", "katas/01_forward_noise.py", "-q", "-p", "no:diffusion_katas"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "katas: grading" not in done.stdout
    assert done.returncode == 5, done.stdout + done.stderr  # nothing is collected without the plugin


def test_kata_finds_the_course_from_a_subfolder():
    done = subprocess.run([sys.executable, "-m", "diffusion_katas", "explain", "01"], cwd=REPO / "katas",
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Lab 01 · Forward noise process" in done.stdout


def test_kata_outside_a_course_says_so(tmp_path):
    done = subprocess.run([sys.executable, "-m", "diffusion_katas", "progress"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "no diffusion-katas course at or above" in done.stderr and "Traceback" not in done.stderr


def kata(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffusion_katas", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)


def code_lines(lines) -> str:
    """Lines of code, as a run: stripped, blank and comment lines left out, inner whitespace collapsed."""
    import re

    return "\n".join(re.sub(r"\s+", " ", c.strip()) for c in lines if c.strip() and not c.strip().startswith("#"))


def assert_no_solution_in(folder: Path) -> None:
    """No file under `folder` holds a solution block of any lab (its lines of code, as a run)."""
    from diffusion_katas.core.derive import BEGIN, END

    blocks = []
    for solution in sorted((REPO / "solutions").glob("[0-9][0-9]_*.py")):
        inside = None
        for line in solution.read_text(encoding="utf-8").splitlines():
            if BEGIN.match(line):
                inside = []
            elif END.match(line):
                blocks.append((solution.name, code_lines(inside)))
                inside = None
            elif inside is not None:
                inside.append(line)
    assert len(blocks) > 50
    texts = {p: code_lines(p.read_text(encoding="utf-8", errors="replace").splitlines())
             for p in folder.rglob("*") if p.is_file()}
    for name, run in blocks:
        if "\n" not in run:  # a one-line answer is the last hint tier's, which the graders show on purpose
            continue
        found = [str(p.relative_to(folder)) for p, text in texts.items() if run in text]
        assert not found, f"a solution block of {name} is in {found}: {run[:200]}"


def test_a_learner_copy_grades_resets_and_explains_with_no_solutions_in_it(tmp_path):
    copy = tmp_path / "course"
    made = kata(REPO, "learner-copy", str(copy), "--labs", "01")
    assert made.returncode == 0, made.stderr
    assert not (copy / "solutions").exists()
    assert_no_solution_in(copy)
    assert (copy / "katas" / "01_forward_noise.py").read_text(encoding="utf-8") == \
        (REPO / "katas" / "01_forward_noise.py").read_text(encoding="utf-8")

    graded = subprocess.run([sys.executable, "-m", "pytest", "katas"], cwd=copy, capture_output=True,
                            text=True, timeout=600)
    assert graded.returncode == 1, graded.stdout + graded.stderr
    assert "katas: grading katas/" in graded.stdout and " todo" in graded.stdout and " failed" not in graded.stdout

    kata_file = copy / "katas" / "01_forward_noise.py"
    kata_file.write_text(kata_file.read_text(encoding="utf-8") + "\n# my edits\n", encoding="utf-8")
    reset = kata(copy, "reset", "01", "--yes")
    assert reset.returncode == 0, reset.stderr
    assert kata_file.read_text(encoding="utf-8") == (copy / "pristine" / "01_forward_noise.py").read_text(encoding="utf-8")
    assert list((copy / ".kata" / "backups").glob("01_forward_noise-*.py"))

    explained = kata(copy / "katas", "explain", "01", "--section", "traps")
    assert explained.returncode == 0 and "Traps:" in explained.stdout, explained.stderr


def test_a_learner_copy_installs_in_a_fresh_venv_with_its_readmes_line_and_grades_there(tmp_path, fresh_venv):
    # What a Classroom template or a workshop's USB stick holds: it installs on its own (its pyproject.toml, the
    # engine's source), and grades with the engine it carries, not the checkout's.
    copy = tmp_path / "course"
    made = kata(REPO, "learner-copy", str(copy), "--labs", "01")
    assert made.returncode == 0, made.stderr
    assert_no_solution_in(copy)
    assert (copy / "pyproject.toml").read_bytes() == (REPO / "pyproject.toml").read_bytes()
    readme = (copy / "README.md").read_text(encoding="utf-8")
    assert "python3 -m venv .venv" in readme and "python -m pip install -e . && python -m pytest katas" in readme

    python = fresh_venv
    venv = python.parent.parent
    # the README's line, but with the dependencies this environment already has (no downloads in a test)
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "."],
                          cwd=copy, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    where = subprocess.run([str(python), "-c", "import diffusion_katas; print(diffusion_katas.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert where.stdout.strip().startswith(str(copy / "plugin")), where.stdout + where.stderr

    graded = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=copy,
                            capture_output=True, text=True, timeout=600, env=env)
    assert graded.returncode == 1 and " todo" in graded.stdout and " failed" not in graded.stdout, graded.stdout
    # a learner's correct answers pass there
    kata_file = copy / "katas" / "01_forward_noise.py"
    kata_file.write_text((REPO / "solutions" / "01_forward_noise.py").read_text(encoding="utf-8"), encoding="utf-8")
    graded = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=copy,
                            capture_output=True, text=True, timeout=600, env=env)
    assert graded.returncode == 0 and "every visible check passes" in graded.stdout, graded.stdout
    progress = subprocess.run([str(venv / "bin" / "kata"), "progress"], cwd=copy, capture_output=True, text=True,
                              timeout=300, env=env)
    assert progress.returncode == 0 and "01_forward_noise   6/6" in progress.stdout, progress.stdout + progress.stderr


def test_a_learner_copy_made_outside_a_course_copies_the_checkout_the_package_is_installed_from(tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    made = kata(outside, "learner-copy", str(tmp_path / "course"), "--labs", "01")
    assert made.returncode == 0, made.stderr
    assert f"from the course this package is installed from ({REPO})" in made.stdout
    assert (tmp_path / "course" / "katas" / "01_forward_noise.py").is_file()


@pytest.mark.skipif(not shutil.which("git"), reason="needs git")
def test_a_plain_install_runs_from_a_course_checkout_never_from_site_packages(tmp_path, fresh_venv):
    """`pip install .` (not -e) into a venv that sees this environment's torch and diffusers: the commands and
    the plugin act on the course found from the working directory."""
    python = fresh_venv
    venv = python.parent.parent
    source = tmp_path / "source"
    skipped = shutil.ignore_patterns(".git", "*.egg-info", "__pycache__", ".kata", ".pytest_cache", "build", ".whl")

    def not_copied(folder, names):  # nor a virtual environment kept in the checkout (README: .venv)
        return set(skipped(folder, names)) | {n for n in names if Path(folder, n, "pyvenv.cfg").is_file()}

    shutil.copytree(REPO, source, ignore=not_copied)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    done = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(source)  # nothing may come from the folder it was built from
    site = subprocess.run([str(python), "-c", "import diffusion_katas, sys; print(diffusion_katas.__file__)"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert str(venv) in site.stdout, site.stdout + site.stderr
    assert sysconfig.get_paths()["purelib"] not in site.stdout

    env = dict(os.environ, PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    explained = subprocess.run([str(venv / "bin" / "kata"), "explain", "01"], cwd=REPO, capture_output=True,
                               text=True, timeout=300, env=env)
    assert explained.returncode == 0 and "Lab 01 · Forward noise process" in explained.stdout, explained.stderr
    graded = subprocess.run([str(python), "-m", "pytest", "katas/01_forward_noise.py", "-q", "-p", "no:cacheprovider"],
                            cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert graded.returncode == 1 and " todo" in graded.stdout and " failed" not in graded.stdout, graded.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    quiet = subprocess.run([str(python), "-m", "pytest"], cwd=empty, capture_output=True, text=True, timeout=300,
                           env=env)
    assert "katas: grading" not in quiet.stdout and "kata progress" not in quiet.stdout, quiet.stdout
