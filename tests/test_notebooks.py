"""A lab as a notebook: notebooks/ derived from the katas, a notebook's code spliced into the kata file, and
grading from a cell, executed for real by nbclient in a Jupyter kernel (ipykernel).

The kernel tests run lab 01's notebook in a learner's copy of the course: untouched (every function TODO, read
from the file), solved (every check passes), with one wrong answer (its trap shown), and with a helper that
lives only in the kernel (the verdict is the one `python -m pytest` gives on the file). A README test runs the
notebook section's Colab set-up in a fresh venv: the course fetched with git and installed by the set-up cell.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from diffusion_katas.core import notebooks
from diffusion_katas.core.derive import derived_notebooks, drift

REPO = Path(__file__).resolve().parent.parent
LAB = "01_forward_noise"
TODO_FUNCTIONS = ["scaled_linear_betas", "cosine_betas", "alphas_cumprod", "add_noise", "velocity",
                  "rescale_zero_terminal_snr"]
KERNEL_LIMIT = 600  # seconds per cell: a grading of lab 01 takes 5-25 s, more on a loaded machine
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


# ---- the notebooks, derived ------------------------------------------------------------------------------
def test_every_lab_has_a_notebook_derived_from_its_kata_and_they_have_not_drifted():
    assert drift(REPO / "solutions", REPO / "katas", REPO / "notebooks") == []
    assert sorted(p.stem for p in (REPO / "notebooks").glob("*.ipynb")) == \
        sorted(p.stem for p in (REPO / "katas").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("name", sorted(derived_notebooks(REPO / "solutions")))
def test_a_labs_notebook_is_valid_and_holds_the_lesson_and_each_todo_function_in_a_cell_with_its_check(name):
    text = (REPO / "notebooks" / name).read_text(encoding="utf-8")
    notebook = nbformat.reads(text, as_version=4)
    nbformat.validate(notebook)
    lab = name[:-len(".ipynb")]
    kata = (REPO / "katas" / f"{lab}.py").read_text(encoding="utf-8")
    cells = notebook.cells
    assert cells[0].cell_type == "markdown" and cells[0].source.startswith(f"# Lab {lab[:2]} ")
    assert "**Concept.**" in cells[0].source and "**Traps.**" in cells[0].source
    assert f"%kata lab {lab[:2]}" in cells[2].source and "%load_ext diffusion_katas" in cells[2].source
    todo = [n.name for n in ast.parse(kata).body if notebooks.is_todo(n)]
    code = [c.source for c in cells if c.cell_type == "code"]
    for function in todo:  # its own cell, then the cell that checks it
        at = next(i for i, source in enumerate(code) if source.lstrip("# \n").startswith(f"def {function}(")
                  or re.search(rf"^def {function}\(", source, re.M))
        assert [n.name for n in ast.parse(code[at]).body if isinstance(n, ast.FunctionDef)] == [function]
        assert code[at + 1] == f"%kata check {function}"
    # every line of the kata's code is in exactly one cell (the docstring is the lesson)
    python = "\n".join(s for s in code if not s.startswith(("%kata", notebooks.COURSE_URL)))
    assert ast.dump(ast.parse(python)) == ast.dump(ast.Module(body=ast.parse(kata).body[1:], type_ignores=[]))
    assert code[-2:] == ["%kata check", "%kata progress"] or code[-3:] == ["%kata check", "%kata see",
                                                                           "%kata progress"]


def test_the_labs_with_a_see_cell_are_the_labs_kata_see_draws():
    from diffusion_katas.engine.see import PICTURES

    assert set(notebooks.PICTURED) == set(PICTURES)
    for lab in PICTURES:
        assert "%kata see" in (REPO / "notebooks" / f"{lab}.ipynb").read_text(encoding="utf-8")


# ---- the splice rule -------------------------------------------------------------------------------------
FILE = '''"""Lab 99 · A lab."""
import math

import torch


def given(x):
    return x + 1


def f(x):
    """Doc."""
    # TODO: write it
    raise NotImplementedError


def g(x):
    # TODO: and this
    raise NotImplementedError
'''


def test_a_cells_function_replaces_the_files_and_the_others_stay_as_they_are():
    text, notes = notebooks.splice(FILE, ["def f(x):\n    return 2 * x\n", "f(3)"], FILE)
    assert notes == []
    assert "def f(x):\n    return 2 * x\n" in text and "def g(x):\n    # TODO: and this\n" in text
    assert text.count("def ") == 3 and text.startswith('"""Lab 99')


def test_the_last_definition_a_cell_ran_wins_as_in_the_kernel():
    text, _ = notebooks.splice(FILE, ["def f(x):\n    return 1\n", "def f(x):\n    return 2\n"], FILE)
    assert "return 2" in text and "return 1" not in text


def test_a_helper_a_constant_and_an_import_the_code_uses_come_along_and_scratch_code_does_not():
    cells = ["import numpy as np\nSCALE = 3.0\n", "def _helper(x):\n    return np.asarray(x) * SCALE\n",
             "def f(x):\n    return _helper(x)\n", "x = 5\nprint(f(x))\nunused = 7\n"]
    text, notes = notebooks.splice(FILE, cells, FILE)
    assert notes == []
    tree = ast.parse(text)
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert names == ["given", "f", "g", "_helper"]
    assert "import numpy as np" in text.split("def given")[0]  # with the file's imports
    assert "SCALE = 3.0" in text and "unused" not in text and "print(" not in text
    # the spliced file runs: its names resolve at call time
    scope: dict = {}
    exec(compile(text, "lab.py", "exec"), scope)
    assert scope["f"](2) == 6.0


def test_a_stub_in_the_notebook_never_overwrites_code_written_in_the_file():
    mine = FILE.replace("    # TODO: write it\n    raise NotImplementedError\n", "    return x * 3\n", 1)
    stub = "def f(x):\n    \"\"\"Doc.\"\"\"\n    # TODO: write it\n    raise NotImplementedError\n"
    text, notes = notebooks.splice(mine, [stub], FILE)
    assert text == mine
    assert len(notes) == 1 and "still its TODO stub" in notes[0] and "%kata load f" in notes[0]


def test_a_name_only_the_kernel_knows_is_said_before_grading_and_a_cell_that_is_not_python_is_skipped():
    text, notes = notebooks.splice(FILE, ["this is not python", "def f(x):\n    return secret * x\n"], FILE)
    assert "return secret * x" in text
    assert len(notes) == 1 and "`secret`" in notes[0] and "NameError" in notes[0]


def test_an_import_goes_after_the_docstring_of_a_file_without_imports():
    source = '"""Doc."""\n\n\ndef f(x):\n    raise NotImplementedError\n'
    text, _ = notebooks.splice(source, ["import math\n", "def f(x):\n    return math.sqrt(x)\n"], source)
    assert text.startswith('"""Doc."""\nimport math\n')
    scope: dict = {}
    exec(compile(text, "lab.py", "exec"), scope)
    assert scope["f"](4.0) == 2.0


# ---- executed in a Jupyter kernel ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def learner_copy(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("notebook") / "course"
    done = subprocess.run([sys.executable, "-m", "diffusion_katas", "learner-copy", str(out), "--labs", "01",
                           "--root", str(REPO)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture
def course(learner_copy, tmp_path) -> Path:
    root = tmp_path / "course"
    shutil.copytree(learner_copy, root)
    return root


def solution_function(name: str) -> str:
    source = (REPO / "solutions" / f"{LAB}.py").read_text(encoding="utf-8")
    lines = source.splitlines()
    start, end = notebooks.function_span(ast.parse(source), lines, name)
    return "\n".join(line for line in lines[start:end] if "SOLUTION" not in line)


def execute(root: Path, change=None) -> nbformat.NotebookNode:
    """Run lab 01's notebook top to bottom in a real kernel (cwd: notebooks/), after `change(cells)`."""
    path = root / "notebooks" / f"{LAB}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    if change is not None:
        change(notebook.cells)
    NotebookClient(notebook, timeout=KERNEL_LIMIT, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    return notebook


def shown(cell) -> str:
    """What a cell showed as text (display_data and stream), errors included."""
    out = []
    for output in cell.get("outputs", []):
        if output.output_type == "error":
            out.append(f"{output.ename}: {output.evalue}")
        out.append(output.get("text") or output.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def check_cell(notebook, function: str | None = None):
    source = f"%kata check {function}" if function else "%kata check"
    return next(c for c in notebook.cells if c.cell_type == "code" and c.source == source)


def function_cell(cells, name: str):
    return next(c for c in cells if c.cell_type == "code" and re.search(rf"^def {name}\(", c.source, re.M))


def test_an_untouched_notebook_shows_every_function_todo_and_leaves_the_kata_file_as_it_was(course):
    before = (course / "katas" / f"{LAB}.py").read_bytes()
    notebook = execute(course)
    assert "Lab 01 · Forward noise process: katas/01_forward_noise.py" in shown(notebook.cells[2])
    for function in TODO_FUNCTIONS:
        text = shown(check_cell(notebook, function))
        assert f"TODO  {function}" in text and "hint 1 (nudge)" in text, text
    whole = shown(check_cell(notebook))
    assert "0/6 solved" in whole and all(f"TODO  {f}" in whole for f in TODO_FUNCTIONS), whole
    assert "01_forward_noise   0/6" in shown(notebook.cells[-1])
    table = next(o for o in notebook.cells[-1].outputs if "text/html" in o.get("data", {}))["data"]["text/html"]
    assert "<table class='kata-progress'>" in table and "<td>0/6</td>" in table
    assert (course / "katas" / f"{LAB}.py").read_bytes() == before


def test_a_notebook_solved_in_its_cells_passes_every_check_and_the_kata_file_holds_the_code(course):
    def solve(cells):
        for function in TODO_FUNCTIONS:
            function_cell(cells, function).source = solution_function(function)

    notebook = execute(course, solve)
    for function in TODO_FUNCTIONS:
        text = shown(check_cell(notebook, function))
        assert re.search(rf"^\s*passed\s+{function}$", text, re.M) and "saved the code you ran" in text, text
    # a function's check shows the whole lab: after the first, five are still TODO (the lab is not done)
    first = shown(check_cell(notebook, TODO_FUNCTIONS[0]))
    assert "1/6 solved" in first and "every function in this lab passes" not in first, first
    assert f"next: write `{TODO_FUNCTIONS[1]}` in its cell, then run `%kata check {TODO_FUNCTIONS[1]}`" in first
    whole = shown(check_cell(notebook))
    assert "6/6 solved" in whole and "every function in this lab passes" in whole, whole
    html = next(o for o in check_cell(notebook).outputs if "text/html" in o.get("data", {}))["data"]["text/html"]
    assert '<b style="color:#1a7f37">passed</b>' in html
    see = next(c for c in notebook.cells if c.cell_type == "code" and c.source == "%kata see")
    picture = next(o for o in see.outputs if "text/html" in o.get("data", {}))["data"]["text/html"]
    assert '<img src="data:image/png;base64,' in picture, shown(see)
    kata = (course / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    assert "raise NotImplementedError" not in kata
    plain = subprocess.run([sys.executable, "-m", "pytest", f"katas/{LAB}.py", "-q", "-p", "no:cacheprovider"],
                           cwd=course, capture_output=True, text=True, timeout=KERNEL_LIMIT)
    assert plain.returncode == 0, plain.stdout[-3000:]


def test_a_wrong_answer_in_a_cell_fails_with_its_trap_named(course):
    def wrong(cells):
        cell = function_cell(cells, "alphas_cumprod")
        cell.source = solution_function("alphas_cumprod")
        cell = function_cell(cells, "add_noise")
        cell.source = cell.source.replace(
            "    # TODO: pick ᾱ per sample in x0's dtype, take the square roots, broadcast, combine\n"
            "    raise NotImplementedError",
            "    a = alphas_cumprod.to(x0.dtype)[timesteps].view(-1, *([1] * (x0.ndim - 1)))\n"
            "    return a * x0 + (1 - a) * noise")

    notebook = execute(course, wrong)
    text = shown(check_cell(notebook, "add_noise"))
    assert "FAILED  add_noise" in text and "ᾱ_t used where √ᾱ_t belongs" in text, text
    html = next(o for o in check_cell(notebook, "add_noise").outputs
                if "text/html" in o.get("data", {}))["data"]["text/html"]
    assert '<b style="color:#cf222e">FAILED</b>' in html and "next: fix `add_noise` in its cell" in html
    assert "`%kata hint`" in text or "%kata hint --all" in text, text  # the notebook's words, not the terminal's


def test_what_only_the_kernel_holds_never_changes_the_verdict_pytest_gives_on_the_file(course):
    # The learner's add_noise calls a helper that exists only in the kernel (put on builtins by a cell, so no
    # source of it can be spliced): in the kernel it works; the grade is the file's, where it does not exist.
    def kernel_only(cells):
        function_cell(cells, "alphas_cumprod").source = solution_function("alphas_cumprod")
        cell = function_cell(cells, "add_noise")
        good = solution_function("add_noise")
        cell.source = "import builtins\nbuiltins.kernel_only_add_noise = lambda *a: None\n\n" + \
            good.replace("def add_noise(", "def _good_add_noise(") + "\n\n\n" + \
            "def add_noise(x0, noise, alphas_cumprod, timesteps):\n" \
            "    return kernel_only_add_noise(x0, noise, alphas_cumprod, timesteps)\n"

    notebook = execute(course, kernel_only)
    text = shown(check_cell(notebook, "add_noise"))
    assert "`kernel_only_add_noise`" in text and "NameError" in text and "FAILED  add_noise" in text, text
    report = course / "report.json"
    plain = subprocess.run([sys.executable, "-m", "pytest", f"katas/{LAB}.py", "-q", "-p", "no:cacheprovider",
                            "--kata-json", str(report)], cwd=course, capture_output=True, text=True,
                           timeout=KERNEL_LIMIT)
    data = json.loads(report.read_text(encoding="utf-8"))
    plain_status = {f["name"]: f["status"] for e in data["labs"] for f in e["functions"]}
    assert plain_status["add_noise"] == "failed" and plain_status["alphas_cumprod"] == "passed", plain.stdout
    whole = shown(check_cell(notebook))
    for name, status in plain_status.items():
        mark = {"failed": "FAILED", "todo": "TODO"}.get(status, status)
        assert re.search(rf"^\s*{mark}\s+{name}$", whole, re.M), (name, whole)


def test_a_functions_check_in_a_lab_never_graded_counts_its_other_stubs_as_todo(course):
    # No record of the lab at all (edited before the notebook opened): the check grades the function and still
    # shows the whole lab, its untouched functions TODO, never "every function passes".
    from diffusion_katas.commands.learner.notebook import Kata

    kata_file = course / "katas" / f"{LAB}.py"
    kata_file.write_text(kata_file.read_text(encoding="utf-8").replace(
        "    # TODO: space √β evenly (float32), then square\n    raise NotImplementedError",
        "    return torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps) ** 2"), encoding="utf-8")
    assert not (course / ".kata" / "last-grading.json").exists()
    verdict = Kata(LAB, root=course).check("scaled_linear_betas")
    assert re.search(r"^\s*passed\s+scaled_linear_betas$", verdict.text, re.M), verdict.text
    assert "1/6 solved" in verdict.text and "every function in this lab passes" not in verdict.text, verdict.text
    assert verdict.ok is False


# ---- the README's notebook section -----------------------------------------------------------------------
def readme_colab_cell() -> str:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## In a notebook", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)[0]


def test_the_readmes_notebook_section_shows_the_set_up_cell_every_notebook_opens_with():
    cell = readme_colab_cell()
    setup = notebooks.setup_cell("01")
    assert cell.strip() == setup.replace('COURSE = ""', 'COURSE = "https://github.com/OWNER/COURSE"').strip()


def test_a_fresh_runtime_gets_from_the_set_up_cell_to_a_graded_lab_01(tmp_path, fresh_venv):
    # Colab's case: the lab's notebook opened alone, in a runtime without the course. The set-up cell clones it
    # (here from a local git repository instead of GitHub) and installs it with pip (the dependencies this
    # environment already has, seen through fresh_venv), then grades lab 01 from its cells.
    if shutil.which("git") is None:
        pytest.skip("needs git")
    origin = tmp_path / "origin"  # what the instructor publishes, with the URL its notebooks fetch it from
    made = subprocess.run([sys.executable, "-m", "diffusion_katas", "learner-copy", str(origin), "--labs", "01",
                           "--root", str(REPO), "--course-url", origin.as_uri()], capture_output=True, text=True,
                          timeout=300)
    assert made.returncode == 0, made.stderr
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "course"]):
        subprocess.run(git + args, cwd=origin, check=True, capture_output=True, timeout=120)
    content = tmp_path / "content"
    content.mkdir()
    notebook = nbformat.read(origin / "notebooks" / f"{LAB}.ipynb", as_version=4)
    assert notebook.cells[2].source.startswith(f'COURSE = "{origin.as_uri()}"')
    function_cell(notebook.cells, "scaled_linear_betas").source = solution_function("scaled_linear_betas")
    spec = tmp_path / "kernels" / "kernels" / "fresh"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(fresh_venv), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "fresh venv", "language": "python"}))
    venv_bin = str(fresh_venv.parent)
    env = {"JUPYTER_PATH": str(tmp_path / "kernels"), "PATH": f"{venv_bin}{os.pathsep}{os.environ['PATH']}",
           # the build backend (setuptools) comes from this environment too: no download in a test
           "PIP_NO_BUILD_ISOLATION": "0", "PIP_NO_INDEX": "1", "PYTHONNOUSERSITE": "1"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        NotebookClient(notebook, timeout=KERNEL_LIMIT, kernel_name="fresh",
                       resources={"metadata": {"path": str(content)}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    setup = shown(notebook.cells[2])
    assert "Lab 01 · Forward noise process: katas/01_forward_noise.py" in setup, setup
    assert (content / "course" / "katas" / f"{LAB}.py").is_file()
    text = shown(check_cell(notebook, "scaled_linear_betas"))
    assert "passed  scaled_linear_betas" in text, text
    where = subprocess.run([str(fresh_venv), "-c", "import diffusion_katas; print(diffusion_katas.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "site-packages" in where.stdout, where.stdout + where.stderr  # installed, not the checkout's


# ---- what a learner sees ---------------------------------------------------------------------------------
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: the screenshot of a rendered verdict needs "
                                             "Debian's chromium (.ci/run installs it when it can)")
def test_chromium_renders_a_failing_verdict_with_its_trap_and_colours(course, tmp_path):
    from diffusion_katas.commands.learner.notebook import Kata
    from PIL import Image

    kata_file = course / "katas" / f"{LAB}.py"
    text = kata_file.read_text(encoding="utf-8")
    kata_file.write_text(text.replace("    # TODO: space √β evenly (float32), then square\n    raise NotImplementedError",
                                      "    return torch.linspace(beta_start, beta_end, num_train_timesteps)"))
    verdict = Kata(LAB, root=course).check("scaled_linear_betas")
    assert verdict.ok is False and "a linspace over β itself" in verdict.text
    page = tmp_path / "verdict.html"
    page.write_text(f"<!doctype html><meta charset=utf-8><body style='background:#fff'>{verdict._repr_html_()}",
                    encoding="utf-8")
    shot = tmp_path / "verdict.png"
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                           "--window-size=1000,700", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert shot.is_file(), done.stderr[-2000:]
    pixels = Image.open(shot).convert("RGB").tobytes()
    reds = sum(1 for i in range(0, len(pixels), 3) if pixels[i] > 180 and pixels[i + 1] < 80 and pixels[i + 2] < 80)
    assert reds > 20  # the FAILED mark, in its colour
