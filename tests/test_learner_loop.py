"""The learner's loop around grading: the last-grading record every run of katas/ writes, hint tiers earned
by failed attempts, `kata progress` from the record, resetting one function, output piped into `head`.

Courses are temporary copies of lab 01 (and of lab 01 again under another lab name, so that two labs grade
quickly). Grading runs pytest in a subprocess, as a learner does (5-20 s a run on a loaded machine); the
tests that need a graded course share one module fixture and copy it.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from diffusion_katas.commands.learner import cli as learner
from diffusion_katas.commands.main import main
from diffusion_katas.core import record
from diffusion_katas.core.course import Course

REPO = Path(__file__).resolve().parent.parent
LAB = "01_forward_noise"
AGAIN = "02_again"  # lab 01's kata and grader under a second lab name
FIRST = "scaled_linear_betas"
SECOND = "cosine_betas"
LINEAR_IN_BETA = "return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)"
LIMIT = 300  # seconds for one grading run


def make_course(path: Path) -> Path:
    """Labs 01_forward_noise and 02_again (the same lab), with katas/, solutions/ and graders/."""
    for folder in ("katas", "solutions", "graders"):
        (path / folder).mkdir(parents=True, exist_ok=True)
        for lab in (LAB, AGAIN):
            shutil.copy(REPO / folder / f"{LAB}.py", path / folder / f"{lab}.py")
    return path


def env() -> dict:
    out = dict(os.environ)
    out["PYTHONUNBUFFERED"] = "1"
    out.pop("KATA_HIDDEN_SEED", None)
    return out


def pytest_in(root: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -m pytest ARGS` in the course folder: a learner's plain run."""
    return subprocess.run([sys.executable, "-m", "pytest", *args, "--rootdir", str(root)], cwd=root,
                          capture_output=True, text=True, encoding="utf-8", env=env(), timeout=LIMIT)


def kata(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diffusion_katas", *args, "--root", str(root)], capture_output=True,
                          text=True, encoding="utf-8", env=env(), timeout=LIMIT)


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def write_wrong(root: Path, lab: str, function: str = FIRST, body: str = LINEAR_IN_BETA) -> None:
    """Replace the TODO stub of `function` with `body`."""
    path = root / "katas" / f"{lab}.py"
    text = path.read_text(encoding="utf-8")
    start = text.index(f"def {function}(")
    stub = text.index("raise NotImplementedError", start)
    path.write_text(text[:stub] + body + text[stub + len("raise NotImplementedError"):], encoding="utf-8")


def saved(root: Path) -> dict:
    return json.loads((root / ".kata" / "last-grading.json").read_text(encoding="utf-8"))


def copy(root: Path, to: Path) -> Path:
    shutil.copytree(root, to)  # copy2: mtimes kept, so the record still matches the files
    return to


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """A course after `pytest katas` (both labs TODO), then `pytest katas/02_again.py` with its first
    function wrong: the record as a learner's plain runs leave it."""
    root = make_course(tmp_path_factory.mktemp("loop"))
    first = pytest_in(root, "katas", "-q")
    assert first.returncode != 0 and "todo" in first.stdout, first.stdout + first.stderr
    after_first = saved(root)
    write_wrong(root, AGAIN)
    second = pytest_in(root, f"katas/{AGAIN}.py", "-q")
    assert "1 failed" in second.stdout, second.stdout + second.stderr
    return root, after_first


# ---- the record ------------------------------------------------------------------------------------------
def test_every_plain_pytest_run_merges_its_labs_into_the_last_grading_record(two_runs):
    root, after_first = two_runs
    data = saved(root)
    assert [e["lab"] for e in after_first["labs"]] == [LAB, AGAIN]
    assert after_first["last_run"]["labs"] == [LAB, AGAIN]
    labs = {e["lab"]: e for e in data["labs"]}
    assert data["last_run"]["labs"] == [AGAIN]
    # lab 01 was not graded again: its entry is the first run's, as it was
    assert labs[LAB] == next(e for e in after_first["labs"] if e["lab"] == LAB)
    assert dict((f["name"], f["status"]) for f in labs[AGAIN]["functions"])[FIRST] == "failed"
    assert labs[AGAIN]["complete"] and set(labs[AGAIN]["files"]) == {f"katas/{AGAIN}.py", f"graders/{AGAIN}.py"}
    assert data["failed_gradings"] == {f"{AGAIN}::{FIRST}": 1}  # a TODO is not a failed attempt
    assert any(r["lab"] == AGAIN and r["function"] == FIRST and "trap: a linspace over β itself" in r["message"]
               for r in data["results"])


def test_hint_after_plain_pytest_points_at_the_lab_that_run_graded(two_runs, tmp_path, capsys):
    root = copy(two_runs[0], tmp_path / "c")
    code, out, err = run(capsys, "hint", "--root", str(root))
    assert code == 0, err
    assert out.startswith(f"{AGAIN} · `{FIRST}` (FAILED when last graded)")


def test_a_solutions_run_leaves_the_record_alone(tmp_path):
    root = make_course(tmp_path)
    done = pytest_in(root, "katas", "--solutions", "-q", "--kata-function", "alphas_cumprod")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (root / ".kata" / "last-grading.json").exists()


def test_a_run_of_some_functions_updates_only_those_and_marks_a_changed_lab_stale():
    declared = {LAB: {"f": {"c1", "c2"}, "g": {"c1"}}}
    full = {"seed": 1, "labs": [{"lab": LAB, "title": "T"}], "results": [
        {"lab": LAB, "function": "f", "check": "c1", "status": "todo"},
        {"lab": LAB, "function": "f", "check": "c2", "status": "todo"},
        {"lab": LAB, "function": "g", "check": "c1", "status": "failed"}]}
    files = {LAB: {"katas/x.py": {"mtime_ns": 1, "size": 2, "sha256": "a"}}}
    first = record.merge(None, full, declared, files, now="t1")
    assert first["labs"][0]["files"] == files[LAB] and first["failed_gradings"] == {f"{LAB}::g": 1}

    only_f = {"seed": 2, "labs": [], "results": [
        {"lab": LAB, "function": "f", "check": "c1", "status": "passed"},
        {"lab": LAB, "function": "f", "check": "c2", "status": "passed"}]}
    same_files = record.merge(first, only_f, declared, files, now="t2")
    entry = same_files["labs"][0]
    assert [(f["name"], f["status"]) for f in entry["functions"]] == [("f", "passed"), ("g", "failed")]
    assert entry["files"] == files[LAB] and not entry["complete"]

    edited = {LAB: {"katas/x.py": {"mtime_ns": 5, "size": 3, "sha256": "b"}}}
    assert record.merge(first, only_f, declared, edited, now="t2")["labs"][0]["files"] is None


def test_an_over_budget_grading_uses_up_no_correctness_tier():
    declared = {LAB: {"f": {"c", "budget: peak bytes"}}}
    over = {"seed": 1, "labs": [], "results": [
        {"lab": LAB, "function": "f", "check": "c", "status": "passed"},
        {"lab": LAB, "function": "f", "check": "budget: peak bytes", "status": "over budget"}]}
    data = record.merge(None, over, declared, {})
    assert data["failed_gradings"] == {}
    assert data["labs"][0]["functions"] == [{"name": "f", "status": "over budget"}]


# ---- hint tiers ------------------------------------------------------------------------------------------
def test_a_hint_tier_comes_after_a_failed_grading_since_the_one_before(two_runs, tmp_path, capsys):
    root = copy(two_runs[0], tmp_path / "c")

    def hint(*extra):
        code, out, err = run(capsys, "hint", FIRST, "--lab", AGAIN, "--root", str(root), *extra)
        assert code == 0, err
        return out

    first = hint()
    assert "hint 1 (nudge)" in first and "hint 2 (" not in first
    assert "hint 2 of 3 comes after your next failed attempt" in first and "kata hint --all" in first
    assert "hint 2 (" not in hint()  # asking again earns nothing

    graded = pytest_in(root, f"katas/{AGAIN}.py", "-q", "--kata-function", FIRST)  # one more failed attempt
    assert "1 failed" in graded.stdout, graded.stdout + graded.stderr
    assert saved(root)["failed_gradings"][f"{AGAIN}::{FIRST}"] == 2
    second = hint()
    assert "hint 2 (the math)" in second and "hint 3 (" not in second
    assert "hint 3 (" not in hint()

    everything = hint("--all")  # for the stuck
    assert "hint 3 (near code)" in everything and "every hint" in everything
    remembered = json.loads((root / ".kata" / "hints.json").read_text(encoding="utf-8"))
    assert remembered[f"{AGAIN}::{FIRST}"]["shown"] == 3


def test_kata_hint_goes_on_from_the_tiers_the_failure_messages_showed(two_runs, tmp_path, capsys):
    # one record for both: after failures whose messages showed tiers 2 and 3, `kata hint` shows them too
    root = copy(two_runs[0], tmp_path / "c")
    for tier in (2, 3):
        graded = pytest_in(root, f"katas/{AGAIN}.py", "-q", "--kata-function", FIRST)
        assert f"hint {tier} (" in graded.stdout and f"hint {tier + 1} (" not in graded.stdout, graded.stdout
    code, out, err = run(capsys, "hint", FIRST, "--lab", AGAIN, "--root", str(root))
    assert code == 0, err
    assert "hint 3 (near code)" in out


def test_a_file_that_does_not_import_shows_and_spends_no_hint_tier_and_says_where(two_runs, tmp_path, capsys):
    root = copy(two_runs[0], tmp_path / "c")
    before = saved(root)["failed_gradings"]
    kata_file = root / "katas" / f"{AGAIN}.py"
    text = kata_file.read_text(encoding="utf-8")
    for broken in (text + "\ndef half_typed(:\n", text + "\nundefined_name + 1\n"):  # a syntax error, a NameError
        kata_file.write_text(broken, encoding="utf-8")
        graded = pytest_in(root, f"katas/{AGAIN}.py", "-q")
        assert "does not parse" in graded.stdout or "importing katas/" in graded.stdout, graded.stdout
        assert " at line " in graded.stdout and "hint 1 (" not in graded.stdout, graded.stdout
        assert saved(root)["failed_gradings"] == before
    kata_file.write_text(text, encoding="utf-8")
    code, out, err = run(capsys, "hint", FIRST, "--lab", AGAIN, "--root", str(root))
    assert code == 0 and "hint 1 (nudge)" in out and "hint 2 (" not in out, out + err


def test_tiers_are_per_function(two_runs, tmp_path, capsys):
    root = copy(two_runs[0], tmp_path / "c")
    data = saved(root)
    data["failed_gradings"][f"{AGAIN}::{SECOND}"] = 5  # failures of another function earn nothing here
    (root / ".kata" / "last-grading.json").write_text(json.dumps(data), encoding="utf-8")
    for _ in range(2):
        code, out, _ = run(capsys, "hint", FIRST, "--lab", LAB, "--root", str(root))
        assert code == 0 and "hint 1 (nudge)" in out and "hint 2 (" not in out


# ---- progress --------------------------------------------------------------------------------------------
def test_progress_answers_from_the_record_and_grades_again_only_the_lab_that_changed(two_runs, tmp_path, capsys,
                                                                                    monkeypatch):
    root = copy(two_runs[0], tmp_path / "c")
    before = saved(root)
    with monkeypatch.context() as m:
        m.setattr(learner, "grade", lambda *a, **k: pytest.fail("nothing changed: progress must not grade"))
        code, out, err = run(capsys, "progress", "--root", str(root))
        assert code == 0, err
        assert "no kata file changed since, nothing graded again" in " ".join(out.split())  # the header wraps
        rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ")}
        assert "0/6" in rows[LAB] and f"next: {FIRST} (TODO)" in rows[LAB]
        assert f"next: {FIRST} (FAILED)" in rows[AGAIN]
        kata_file = root / "katas" / f"{LAB}.py"
        os.utime(kata_file, ns=(kata_file.stat().st_atime_ns, kata_file.stat().st_mtime_ns + 10**9))
        code, out, err = run(capsys, "progress", "--root", str(root))  # saved again, unchanged: still nothing
        assert code == 0 and "nothing graded again" in " ".join(out.split()), err

    write_wrong(root, LAB)
    done = kata(root, "progress")
    assert done.returncode == 0, done.stderr
    assert f"graded {LAB} again" in " ".join(done.stdout.split())
    after = saved(root)
    assert after["last_run"]["labs"] == [LAB]  # the one lab that changed, and only it, was graded
    labs = {e["lab"]: e for e in after["labs"]}
    assert labs[AGAIN] == next(e for e in before["labs"] if e["lab"] == AGAIN)
    assert dict((f["name"], f["status"]) for f in labs[LAB]["functions"])[FIRST] == "failed"
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert f"next: {FIRST} (FAILED)" in rows[LAB]


# ---- reset one function ----------------------------------------------------------------------------------
def test_reset_of_one_function_restores_it_and_leaves_the_others_as_they_are(tmp_path, capsys):
    root = make_course(tmp_path)
    pristine = (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    write_wrong(root, LAB, FIRST, LINEAR_IN_BETA + "  # first")
    write_wrong(root, LAB, SECOND, "return torch.zeros(num_train_timesteps)  # second")
    mine = (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")

    code, out, err = run(capsys, "reset", "01", FIRST, "--yes", "--root", str(root))

    assert code == 0, err
    now = (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    assert "# first" not in now and "return torch.zeros(num_train_timesteps)  # second" in now
    assert f"`{FIRST}` is TODO again" in out
    backups = list((root / ".kata" / "backups").glob(f"{LAB}-*.py"))
    assert [b.read_text(encoding="utf-8") for b in backups] == [mine]
    code, _, _ = run(capsys, "reset", "01", SECOND, "--yes", "--root", str(root))
    assert code == 0
    assert (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8") == pristine


def test_reset_of_a_deleted_function_puts_it_back_where_it_was(tmp_path, capsys):
    root = make_course(tmp_path)
    path = root / "katas" / f"{LAB}.py"
    pristine = path.read_text(encoding="utf-8")
    start, end = pristine.index(f"def {SECOND}("), pristine.index("def alphas_cumprod(")
    path.write_text(pristine[:start] + pristine[end:], encoding="utf-8")

    code, _, err = run(capsys, "reset", "01", SECOND, "--yes", "--root", str(root))

    assert code == 0, err
    assert path.read_text(encoding="utf-8") == pristine


def test_reset_of_a_function_the_lab_does_not_have_names_its_functions(tmp_path, capsys):
    root = make_course(tmp_path)
    code, _, err = run(capsys, "reset", "01", "scaled_betas", "--yes", "--root", str(root))
    assert code == 2 and f"its functions are: linear_betas, {FIRST}, {SECOND}" in err
    assert not (root / ".kata").exists()


# ---- piped into head -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [("explain", "01"), ("explain",), ("progress", "--cached"), ("hint",),
                                  ("derive", "--check"), ("--help",)])
def test_no_command_ends_in_a_traceback_when_the_reader_of_its_output_has_gone(two_runs, tmp_path, args):
    """`kata explain 01 | head`: the reader left before we wrote (the read end is closed at once)."""
    root = copy(two_runs[0], tmp_path / "c")
    if args[0] == "derive":  # a maintainer's command: the katas and notebooks as derived
        done = subprocess.run([sys.executable, "-m", "diffusion_katas", "derive", "--root", str(root)],
                              capture_output=True, text=True, env=env(), timeout=120)
        assert done.returncode == 0, done.stderr
    command = [sys.executable, "-m", "diffusion_katas", *args] + (["--root", str(root)] if args[0] != "--help" else [])
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    proc.stdout.close()
    err = proc.stderr.read().decode("utf-8", "replace")
    assert proc.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_derive_check_still_reports_drift_in_its_exit_code_when_the_reader_of_its_output_has_gone(two_runs, tmp_path):
    root = copy(two_runs[0], tmp_path / "c")
    shutil.copy(REPO / "katas" / f"{LAB}.py", root / "katas" / f"{AGAIN}.py")
    (root / "katas" / f"{LAB}.py").write_text("# drifted\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "diffusion_katas", "derive", "--check", "--root", str(root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    proc.stdout.close()
    err = proc.stderr.read().decode("utf-8", "replace")
    assert proc.wait(timeout=60) == 1, err
    assert "Traceback" not in err, err


@pytest.mark.skipif(shutil.which("head") is None or shutil.which("bash") is None, reason="needs bash and head")
def test_kata_progress_piped_into_head_prints_its_first_lines_and_no_traceback(two_runs):
    root = two_runs[0]
    done = subprocess.run(["bash", "-c", f'"{sys.executable}" -m diffusion_katas progress --root "{root}" | head -2'],
                          capture_output=True, text=True, encoding="utf-8", env=env(), timeout=60)
    assert done.returncode == 0
    assert done.stdout.startswith("kata progress · from the last grading") and len(done.stdout.splitlines()) == 2
    assert "Traceback" not in done.stderr, done.stderr


# ---- set-up ----------------------------------------------------------------------------------------------
def test_the_readme_shows_the_default_and_the_cpu_only_install_lines_with_the_autograders_cpu_index():
    from diffusion_katas.commands.instructor.bundle import TORCH_CPU_INDEX

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    commands = [line for line in first_block if line and not line.startswith("#")]
    assert commands == ["python3 -m venv .venv && . .venv/bin/activate",  # in a venv of its own, first
                        "python -m pip install -e . && python -m pytest katas",
                        'python -m pip install -e ".[test]" && python -m pytest tests']
    lines = [line for line in readme.splitlines() if line.startswith("python -m pip install")]
    assert any(line.startswith(f"python -m pip install --extra-index-url {TORCH_CPU_INDEX} -e .") for line in lines)
    # what CI runs is README command B, in a fresh venv
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "python3 -m venv" in ci and commands[2] in ci


def test_the_readme_is_short_links_only_what_exists_and_every_command_in_it_parses():
    import re
    import shlex

    from diffusion_katas.commands.main import build_parser

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150  # reference material lives in docs/
    for link in re.findall(r"\]\(([^)#]+)\)", readme):
        assert (REPO / link).is_file(), link
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    plugin_options = set(re.findall(r'"(--[a-z-]+)"', (REPO / "plugin" / "diffusion_katas" / "pytest_plugin" /
                                                         "plugin.py").read_text(encoding="utf-8")))
    kata_lines = [line for line in lines if line.startswith("kata ")]
    assert len(kata_lines) >= 10
    for line in kata_lines:  # [optional parts] as given; a bad subcommand or option exits
        build_parser().parse_args(shlex.split(line.replace("[", "").replace("]", ""))[1:])
    for line in lines:
        if "-m pytest" in line:
            assert {o for o in re.findall(r"(--[a-z-]+)", line) if o.startswith(("--kata", "--solutions"))} \
                <= plugin_options, line
