"""The course's dev check (rustlings' `dev check`): every solution passes every grader, every untouched
kata function is TODO, every graded function has hints and traps, and lab 01 stays cheap to import.

These run the real course in a subprocess, as a learner or instructor would.
"""
import ast
import importlib.util
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LABS = sorted(p.stem for p in (REPO / "solutions").glob("[0-9][0-9]_*.py"))


def grade(tmp_path, *args):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--kata-json", str(report), *args],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert report.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(report.read_text(encoding="utf-8"))


def graded_functions(lab):
    spec = importlib.util.spec_from_file_location(f"_course_{lab}", REPO / "graders" / f"{lab}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from diffusion_katas.core.spec import Kata

    return [v for v in vars(module).values() if isinstance(v, Kata)]


def solution_functions(lab):
    """Functions of a solution file that hold a solution block (the ones a learner writes)."""
    text = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
    tree = ast.parse(text)
    lines = text.splitlines()
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any("# BEGIN SOLUTION" in line for line in lines[node.lineno - 1:node.end_lineno])]


def cuda_skip(r: dict) -> bool:
    """A GPU-marked item skipped for want of CUDA: the one allowed skip."""
    return r["status"] == "skipped" and "CUDA not available" in r["message"]


def test_every_solution_passes_every_grader_and_scores_full_marks_on_gradescope(tmp_path):
    from diffusion_katas.core.results import validate_gradescope

    proc, data = grade(tmp_path, "--solutions", "--gradescope", str(tmp_path / "results.json"))
    bad = [f"{r['nodeid']}: {r['status']}\n{r['message']}" for r in data["results"]
           if r["status"] != "passed" and not cuda_skip(r)]
    assert not bad, f"seed {data['seed']}:\n" + "\n\n".join(bad)
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert {r["lab"] for r in data["results"]} == set(LABS)
    results = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    assert validate_gradescope(results) == []
    assert results["score"] == results["max_score"] == sum(k.points for lab in LABS for k in graded_functions(lab))


def test_every_untouched_kata_function_is_todo_and_none_passes_or_errors(tmp_path):
    proc, data = grade(tmp_path, "katas")
    summary = proc.stdout[proc.stdout.rindex("kata progress"):].splitlines()[1:]
    assert len(summary) > 22 and max(len(line) for line in summary) <= 100, "\n".join(summary)
    not_todo = [f"{r['nodeid']}: {r['status']}\n{r['message']}" for r in data["results"]
                if r["status"] != "todo" and not cuda_skip(r)]
    assert not not_todo, "\n\n".join(not_todo)
    assert proc.returncode == 1
    assert " error" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def test_every_gpu_budget_is_a_real_test_that_skips_here_with_the_reason(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the GPU budgets run for real")
    proc, data = grade(tmp_path, "katas/11_memory.py", "--solutions", "-m", "cuda", "-rs")
    assert data["results"] and all(cuda_skip(r) for r in data["results"]), data["results"]
    assert "CUDA not available" in proc.stdout


@pytest.mark.parametrize("lab", LABS)
def test_each_lab_grades_exactly_the_functions_its_solution_defines(lab):
    graded = [k.name for k in graded_functions(lab)]
    assert graded == solution_functions(lab), "grader and solution disagree on the kata functions"


@pytest.mark.parametrize("lab", LABS)
def test_an_untouched_labs_todo_stubs_are_read_without_grading_and_are_its_graded_functions(lab):
    from diffusion_katas.core.course import Course

    assert Course(REPO).untouched_todos(lab) == [k.name for k in graded_functions(lab)]


def test_a_function_edited_is_no_longer_an_untouched_stub_and_a_comment_changes_nothing(tmp_path):
    import shutil

    from diffusion_katas.core.course import Course

    lab = "01_forward_noise"
    for folder in ("katas", "graders", "solutions"):
        (tmp_path / folder).mkdir()
        shutil.copyfile(REPO / folder / f"{lab}.py", tmp_path / folder / f"{lab}.py")
    kata = tmp_path / "katas" / f"{lab}.py"
    text = kata.read_text(encoding="utf-8")
    first, second = [k.name for k in graded_functions(lab)][:2]
    start = text.index(f"def {first}(")
    stub = text.index("raise NotImplementedError", start)
    kata.write_text(text[:stub] + "# thinking...\n    " + text[stub:], encoding="utf-8")
    assert Course(tmp_path).untouched_todos(lab)[:2] == [first, second]
    kata.write_text(text[:stub] + "return None  # " + text[stub:], encoding="utf-8")
    assert Course(tmp_path).untouched_todos(lab)[0] == second
    kata.write_text(text + "\ndef oops(:\n", encoding="utf-8")
    assert Course(tmp_path).untouched_todos(lab) == []


def test_an_untouched_kata_file_is_graded_todo_without_a_runner_and_an_edited_one_opens_one(tmp_path):
    # Counted, not timed: a conftest makes every runner fail loudly. An untouched file (its ast the pristine one's,
    # nothing run at import) is all TODO without one; a file that runs code at import (lab 12 loads earlier labs)
    # and an edited file still open runners, and so meet the planted failure.
    import shutil

    for folder in ("katas", "graders", "solutions"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    shutil.copyfile(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "conftest.py").write_text(
        "from diffusion_katas.engine import runner\n"
        "def refuse(*args, **kwargs):\n"
        "    raise RuntimeError('a runner was started')\n"
        "runner.Runner.__init__ = refuse\n", encoding="utf-8")
    kata = tmp_path / "katas" / "04_classifier_free_guidance.py"
    kata.write_text(kata.read_text(encoding="utf-8").replace("raise NotImplementedError", "return None", 1),
                    encoding="utf-8")
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--kata-json", str(report),
                    "katas/01_forward_noise.py", "katas/04_classifier_free_guidance.py", "katas/12_end_to_end.py"],
                   cwd=tmp_path, capture_output=True, text=True, timeout=900)
    results = json.loads(report.read_text(encoding="utf-8"))["results"]
    by_lab = {lab: {r["status"] for r in results if r["lab"] == lab} for lab in
              ("01_forward_noise", "04_classifier_free_guidance", "12_end_to_end")}
    assert by_lab["01_forward_noise"] == {"todo"}, by_lab
    assert "failed" in by_lab["04_classifier_free_guidance"] and "failed" in by_lab["12_end_to_end"], by_lab


@pytest.mark.parametrize("lab", LABS)
def test_each_kata_function_has_three_hint_tiers_a_trap_and_an_answer_key_or_a_reason(lab):
    from diffusion_katas.engine.isolation import _targets

    for kata in graded_functions(lab):
        assert len(kata.hints) >= 3, f"{kata.name}: hints in tiers (nudge, math, near code)"
        assert kata.traps, f"{kata.name}: declare at least its commonest misconception"
        assert kata.checks and all(c.cases for c in kata.checks), kata.name
        assert kata.answer_key or kata.no_answer_key, \
            f"{kata.name}: lock the diffusers/peft callables it is graded against, or say why there are none"
        for path in kata.answer_key:  # each one names something that exists and can be called
            with warnings.catch_warnings():  # a family walks whole packages: their import-time deprecation notes
                warnings.simplefilter("ignore")
                members = _targets(path)
            assert members, f"{kata.name}: the answer-key family {path} names nothing in the installed library"
            for owner, attr, name in members:
                assert callable(getattr(owner, attr, None)) or isinstance(owner.__dict__.get(attr), property), \
                    f"{kata.name}: answer key {name} is not a callable of the installed library"


@pytest.mark.parametrize("lab", LABS)
def test_each_lab_docstring_carries_its_lesson_sections(lab):
    doc = ast.get_docstring(ast.parse((REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")))
    assert doc.splitlines()[0].startswith(f"Lab {lab[:2]} · ")
    for section in ("Concept:", "Mental model:", "Traps:", "Say it out loud:", "Graded against:", "Run:"):
        assert f"\n{section}" in doc, f"{lab}: missing {section}"


def test_grading_lab_01_imports_no_diffusers_models_pipelines_peft_or_transformers():
    script = (
        "import sys, pytest\n"
        "pytest.main(['-q', '-p', 'no:cacheprovider', 'katas/01_forward_noise.py', '--solutions'])\n"
        "heavy = sorted({m.split('.')[0] + ('.' + m.split('.')[1] if m.startswith('diffusers.') else '')\n"
        "    for m in sys.modules if m.startswith(('diffusers.models', 'diffusers.pipelines', 'peft',\n"
        "                                          'transformers', 'diffusers.loaders'))})\n"
        "print('HEAVY', heavy)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert "HEAVY []" in proc.stdout, proc.stdout[-2000:]
