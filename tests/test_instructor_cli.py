"""The instructor commands of `kata`: class, gradescope-bundle, classroom.

The class is graded once (module fixture) and the tests read its tables: eight made-up submissions on
lab 01 only, graded two at a time, each in its own process, with a 45 s wall-clock limit. One copies the
solution; the others are the bad inputs a class brings: a syntax error, an import of a missing module, a
deleted function, an empty folder, an endless loop, os._exit(0) at import, and a segfault at import.
"""
from __future__ import annotations

import ast
import csv
import functools
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from diffusion_katas.commands import main as cli
from diffusion_katas.commands.instructor import cli as instructor

REPO = Path(__file__).resolve().parent.parent
LAB = "01_forward_noise"
SOLUTION = (REPO / "solutions" / f"{LAB}.py").read_text(encoding="utf-8")
KATA = (REPO / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
WALL_CLOCK = 45

# The same rules as tests/plugin/test_results.py (Gradescope's results.json specification).
TOP_LEVEL = {"score", "max_score", "execution_time", "output", "output_format", "test_output_format",
             "test_name_format", "visibility", "stdout_visibility", "extra_data", "tests", "leaderboard"}
PER_TEST = {"score", "max_score", "status", "name", "name_format", "number", "output", "output_format",
            "tags", "visibility", "extra_data"}
VISIBILITY = {"hidden", "after_due_date", "after_published", "visible"}


def assert_valid_gradescope(data: dict) -> None:
    assert set(data) <= TOP_LEVEL, set(data) - TOP_LEVEL
    assert isinstance(data["score"], (int, float))
    assert isinstance(data["tests"], list) and data["tests"]
    assert data["visibility"] in VISIBILITY and data["stdout_visibility"] in VISIBILITY
    for test in data["tests"]:
        assert set(test) <= PER_TEST, set(test) - PER_TEST
        assert isinstance(test["name"], str) and test["name"]
        assert 0 <= test["score"] <= test["max_score"]
        assert test["status"] in ("passed", "failed")
        assert test["visibility"] in VISIBILITY
        assert isinstance(test["output"], str)
    assert abs(data["score"] - sum(t["score"] for t in data["tests"])) < 1e-9
    assert instructor.validate_gradescope(data) == []


@functools.lru_cache(maxsize=None)
def grader_functions(lab: str) -> tuple[tuple[str, float], ...]:
    """(function, points) as the lab's grader declares them, read independently of the instructor commands."""
    from diffusion_katas.core.course import load_module
    from diffusion_katas.core.spec import Kata

    module = load_module(REPO / "graders" / f"{lab}.py", f"_test_instructor_{lab}")
    return tuple((v.name, v.points) for v in vars(module).values() if isinstance(v, Kata))


def without_function(source: str, name: str) -> str:
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = source.splitlines(keepends=True)
    start = (fn.decorator_list[0].lineno if fn.decorator_list else fn.lineno) - 1
    return "".join(lines[:start] + lines[fn.end_lineno:])


def with_body(source: str, name: str, body: str) -> str:
    tree = ast.parse(source)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
    lines = source.splitlines(keepends=True)
    return "".join(lines[:fn.body[0].lineno - 1]) + body + "".join(lines[fn.end_lineno:])


def at_import(source: str, code: str) -> str:
    return source.replace("import math\n", f"import math\n{code}\n", 1)


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    subs = root / "submissions"
    files = {
        # first, so that its 45 s run overlaps the others
        "frank_hangs": with_body(SOLUTION, "add_noise",
                                 "    import subprocess\n"
                                 "    try:\n"
                                 "        subprocess.Popen(['sleep', '600'])\n"
                                 "    except PermissionError:  # the runner may start no process\n"
                                 "        pass\n"
                                 "    else:  # a process that could outlive the check: no hang, a wrong value instead\n"
                                 "        return x0\n"
                                 # SIGALRM blocked: like a hang inside C code that never returns to
                                 # Python, pytest-timeout's signal never reaches it
                                 "    import signal\n"
                                 "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})\n"
                                 "    while True:\n"
                                 "        pass\n"),
        "alice_correct/katas": SOLUTION,  # the katas/ subfolder layout
        "bob_syntax_error": KATA + "\ndef oops(:\n    pass\n",
        "carol_missing_module": at_import(KATA, "import not_a_real_module_xyz"),
        "dave_deleted_function": without_function(SOLUTION, "add_noise"),
        "gina_os_exit": at_import(SOLUTION, "import os\nos._exit(0)"),
        "hank_segfault": at_import(SOLUTION, "import faulthandler\nfaulthandler._sigsegv()"),
    }
    for where, text in files.items():
        (subs / where).mkdir(parents=True)
        (subs / where / f"{LAB}.py").write_text(text, encoding="utf-8")
    (subs / "erin_empty").mkdir()
    order = ["frank_hangs", "alice_correct", "bob_syntax_error", "carol_missing_module", "dave_deleted_function",
             "erin_empty", "gina_os_exit", "hank_segfault"]
    out = root / "out"
    code = cli.main(["class", *[str(subs / name) for name in order], "--out", str(out), "--labs", LAB,
                     "--jobs", "2", "--timeout", str(WALL_CLOCK), "--seed", "7",
                     "--kata-timeout", "10"])  # pytest-timeout's SIGALRM cannot stop frank: the wall clock must
    assert code == 0
    data = json.loads((out / "class.json").read_text(encoding="utf-8"))
    learners = {entry["learner"]: entry for entry in data["learners"]}
    return {"out": out, "data": data, "learners": learners, "order": order}


def statuses(entry: dict) -> dict[str, str]:
    return {f["function"]: f["status"] for f in entry["functions"]}


def test_the_class_table_lists_every_submission_in_order_with_the_graders_points(graded_class):
    functions = grader_functions(LAB)
    total = sum(points for _, points in functions)
    assert [e["learner"] for e in graded_class["data"]["learners"]] == graded_class["order"]
    assert graded_class["data"]["max_score"] == total
    for entry in graded_class["data"]["learners"]:
        assert entry["max_score"] == total
        assert [f["function"] for f in entry["functions"]] == [name for name, _ in functions]


def test_the_correct_submission_scores_full_marks_from_its_report(graded_class):
    alice = graded_class["learners"]["alice_correct"]
    assert alice["outcome"] == "graded" and alice["reason"] == ""
    assert alice["score"] == alice["max_score"]
    assert set(statuses(alice).values()) == {"passed"}


def test_a_syntax_error_scores_zero_with_the_line_that_does_not_parse(graded_class):
    bob = graded_class["learners"]["bob_syntax_error"]
    assert bob["score"] == 0 and set(statuses(bob).values()) == {"failed"}
    assert f"katas/{LAB}.py does not parse" in bob["reason"] and "at line" in bob["reason"]


def test_an_import_of_a_missing_module_scores_zero_with_the_module_named(graded_class):
    carol = graded_class["learners"]["carol_missing_module"]
    assert carol["score"] == 0 and set(statuses(carol).values()) == {"failed"}
    assert "ModuleNotFoundError" in carol["reason"] and "not_a_real_module_xyz" in carol["reason"]


def test_a_deleted_function_loses_only_its_own_points(graded_class):
    dave = graded_class["learners"]["dave_deleted_function"]
    points = dict(grader_functions(LAB))
    assert dave["score"] == dave["max_score"] - points["add_noise"]
    assert statuses(dave)["add_noise"] == "failed"
    assert {s for f, s in statuses(dave).items() if f != "add_noise"} == {"passed"}
    assert "has no function `add_noise` (deleted or renamed?)" in dave["reason"]


def test_an_empty_folder_scores_zero_as_missing_files(graded_class):
    erin = graded_class["learners"]["erin_empty"]
    assert erin["score"] == 0 and erin["outcome"] == "missing file"
    assert erin["reason"] == "empty submission folder"
    assert set(statuses(erin).values()) == {"missing file"}
    assert erin["passes"] == []  # nothing to grade: no child was started


def test_a_hang_in_c_code_costs_only_its_function_and_it_could_start_no_process_to_outlive_it(graded_class):
    # the runner's wall clock ends the hang (SIGALRM blocked, as in C code), the rest is graded
    frank = graded_class["learners"]["frank_hangs"]
    points = dict(grader_functions(LAB))
    assert frank["outcome"] == "graded" and frank["score"] == frank["max_score"] - points["add_noise"]
    assert statuses(frank)["add_noise"] == "failed"
    # a time-out, not a wrong value: `sleep 600` was refused (engine/sandbox.py's seccomp filter)
    assert "add_noise: timed out (per-check limit)" in frank["reason"]


def test_os_exit_at_import_scores_zero_with_the_reason_although_the_process_exited_with_status_0(graded_class):
    gina = graded_class["learners"]["gina_os_exit"]
    assert gina["score"] == 0 and gina["outcome"] == "graded"
    assert set(statuses(gina).values()) == {"failed"}
    assert "ended the process that imports it (it exited with status 0)" in gina["reason"]


def test_a_segfault_at_import_scores_zero_with_the_signal_named(graded_class):
    hank = graded_class["learners"]["hank_segfault"]
    assert hank["score"] == 0 and hank["outcome"] == "graded"
    assert "SIGSEGV" in hank["reason"]


def test_per_check_pass_rates_count_the_whole_class(graded_class):
    rows = {(r["function"], r["check"]): r for r in graded_class["data"]["checks"]}
    assert len(rows) == len(grader_functions(LAB))  # one check per function in lab 01
    for (function, _check), row in rows.items():
        assert row["learners"] == 8
        # alice; dave and frank but for add_noise (frank's hang costs only add_noise)
        assert row["passed"] == (1 if function == "add_noise" else 3)
        assert row["pass_rate"] == round(row["passed"] / 8, 4)
    with open(graded_class["out"] / "checks.csv", newline="", encoding="utf-8") as f:
        assert len(list(csv.DictReader(f))) == len(rows)


def test_the_csv_and_markdown_tables_carry_the_same_scores_and_reasons(graded_class):
    with open(graded_class["out"] / "class.csv", newline="", encoding="utf-8") as f:
        table = {row["learner"]: row for row in csv.DictReader(f)}
    md = (graded_class["out"] / "class.md").read_text(encoding="utf-8")
    assert "## Pass rate per check" in md
    for name, entry in graded_class["learners"].items():
        row = table[name]
        assert float(row["score"]) == entry["score"] and row["outcome"] == entry["outcome"]
        assert row["reason"] == entry["reason"]
        assert row[f"{LAB}::add_noise"] == statuses(entry)["add_noise"]
        assert f"| {name} | {entry['score']:g}/{entry['max_score']:g} | {entry['outcome']} |" in md


def test_every_learner_gets_a_valid_gradescope_file_with_the_class_score(graded_class):
    for name, entry in graded_class["learners"].items():
        data = json.loads((graded_class["out"] / "gradescope" / f"{name}.json").read_text(encoding="utf-8"))
        assert_valid_gradescope(data)
        assert data["score"] == entry["score"]
        assert data["max_score"] == entry["max_score"]
        if entry["outcome"] != "graded":
            assert entry["reason"] in data["output"]
            assert all(t["status"] == "failed" and entry["reason"] in t["output"] for t in data["tests"])


def test_a_missing_lab_file_scores_zero_and_gpu_budgets_run_in_a_serial_pass(tmp_path):
    sub = tmp_path / "ivy" / "katas"
    sub.mkdir(parents=True)
    shutil.copyfile(REPO / "katas" / "11_memory.py", sub / "11_memory.py")  # has `cuda` budgets; no lab 02
    out = tmp_path / "out"
    assert cli.main(["class", str(tmp_path / "ivy"), "--out", str(out), "--labs", "02,11",
                     "--timeout", "120", "--seed", "3"]) == 0
    ivy = json.loads((out / "class.json").read_text(encoding="utf-8"))["learners"][0]
    import torch

    # The cuda pass runs only where CUDA is: elsewhere its items count as skipped, with a note.
    assert [p["marker"] for p in ivy["passes"]] == (["not cuda", "cuda"] if torch.cuda.is_available()
                                                     else ["not cuda"])
    lab02 = [f for f in ivy["functions"] if f["lab"] == "02_denoising_step"]
    assert lab02 and {f["status"] for f in lab02} == {"missing file"}
    assert "02_denoising_step.py: missing file" in ivy["reason"]
    assert {f["status"] for f in ivy["functions"] if f["lab"] == "11_memory"} == {"todo"}
    checks = json.loads((out / "class.json").read_text(encoding="utf-8"))["checks"]
    gpu = [r for r in checks if r["cuda"]]
    assert gpu, "lab 11 declares GPU budgets"
    if not torch.cuda.is_available():
        assert all(r["skipped"] == 1 for r in gpu)  # run in the cuda pass, skipped: CUDA not available
    data = json.loads((out / "gradescope" / "ivy.json").read_text(encoding="utf-8"))
    assert_valid_gradescope(data)
    assert data["score"] == 0
    missing = [t for t in data["tests"] if t["name"].startswith("Lab 02")]
    assert missing and all("missing file" in t["output"] for t in missing)


def test_a_hidden_seed_typed_on_the_command_line_is_refused_with_the_way_to_give_it(tmp_path, capsys):
    assert cli.main(["class", str(tmp_path), "--out", str(tmp_path / "o"), "--labs", LAB,
                     "--hidden-seed", "4711"]) == 2
    err = capsys.readouterr().err
    assert "never given on the command line" in err and "--hidden-seed-file" in err
    short = tmp_path / "seed.txt"
    short.write_text("4711\n")
    assert cli.main(["gradescope-bundle", "--out", str(tmp_path / "a.zip"), "--labs", LAB,
                     "--hidden-seed-file", str(short)]) == 0
    assert "can be guessed from the hidden inputs" in capsys.readouterr().err


def test_bad_command_lines_are_reported_not_raised(tmp_path, capsys):
    assert cli.main(["class", str(tmp_path), "--out", str(tmp_path / "o"), "--labs", "no_such_lab"]) == 2
    assert "no single lab matches 'no_such_lab'" in capsys.readouterr().err
    assert cli.main(["class", str(tmp_path), "--out", str(tmp_path / "o"), "--jobs", "0"]) == 2
    not_a_folder = tmp_path / "submission.zip"
    not_a_folder.write_bytes(b"PK")
    assert cli.main(["class", str(not_a_folder), "--out", str(tmp_path / "o"), "--labs", LAB]) == 0
    entry = json.loads((tmp_path / "o" / "class.json").read_text(encoding="utf-8"))["learners"][0]
    assert entry["score"] == 0 and entry["reason"] == f"not a folder: {not_a_folder}" and entry["passes"] == []


# ---- submissions that attack the grading ------------------------------------------------------------------------
GRADER_WRITE = """\
import pathlib, re, sysconfig
for _target in (pathlib.Path(__file__).resolve().parent.parent / "pytest.ini",
                pathlib.Path(sysconfig.get_paths()["purelib"]) / "kata_planted.pth"):
    try:
        _target.write_text("import os; os._exit(0)\\n")  # a .pth runs in every later Python of this install
    except OSError:
        pass
try:
    _ini = (pathlib.Path(__file__).resolve().parent.parent / "pytest.ini").read_text()
    _grader = pathlib.Path(re.search(r"kata_graders_dir = (.*)", _ini).group(1).strip()) / "01_forward_noise.py"
    _grader.write_text(_grader.read_text() + "\\nraise RuntimeError('sabotage')\\n")
except OSError:
    pass
"""
SIBLINGS_DELETED = """\
import pathlib, shutil
_me = pathlib.Path(__file__).resolve().parent.parent
try:
    for _other in _me.parent.iterdir():
        if _other != _me:
            shutil.rmtree(_other, ignore_errors=True)
except OSError:
    pass
"""
KILL_ALL = """\
import os, signal
for _pid in range(max(2, os.getppid() - 400), os.getppid() + 400):  # siblings, their runners, the class itself
    if _pid != os.getpid():
        try:
            os.kill(_pid, signal.SIGKILL)
        except OSError:
            pass
"""
COPY_CLASSMATE = """\
    import pathlib
    mine = pathlib.Path(__file__).resolve().parent.parent
    theirs = mine.parent / "alice_correct" / "katas" / "01_forward_noise.py"
    namespace = {}
    exec(theirs.read_text(), namespace)  # refused: the box reads its own project only
    return namespace["add_noise"](x0, noise, timesteps, alphas_cumprod)
"""
SEED_HUNT = """\
    import os, pathlib
    needle = str(73735000 + 173).encode()  # not spelled out: this file itself is searched too
    found = []
    try:
        pids = list(filter(str.isdigit, os.listdir("/proc")))
    except PermissionError:  # no process list in the sandbox: guess the pids around the warm parent's
        pids = [str(p) for p in range(max(1, os.getppid() - 300), os.getppid() + 300)]
    for pid in pids:
        for what in ("cmdline", "environ"):
            try:
                if needle in pathlib.Path(f"/proc/{pid}/{what}").read_bytes():
                    found.append(f"/proc/{pid}/{what}")
            except OSError:
                pass
    project = pathlib.Path(__file__).resolve().parent.parent
    for path in project.rglob("*"):
        try:
            if path.is_file() and needle in path.read_bytes():
                found.append(str(path))
        except OSError:
            pass
    if found:
        raise RuntimeError("the hidden seed is readable at " + ", ".join(found))
    a = alphas_cumprod.to(x0.dtype)[timesteps].reshape(-1, *[1] * (x0.dim() - 1))
    return a ** 0.5 * x0 + (1 - a) ** 0.5 * noise
"""
ADD_NOISE_CHECK = "vs DDPMScheduler.add_noise"


def course_copy(root: Path) -> Path:
    """A course of its own (graders and pyproject), so that an attack on a grader never reaches the repo's."""
    course = root / "course"
    course.mkdir()
    shutil.copyfile(REPO / "pyproject.toml", course / "pyproject.toml")
    for folder in ("graders", "katas", "solutions"):
        shutil.copytree(REPO / folder, course / folder, ignore=shutil.ignore_patterns("__pycache__"))
    return course


def test_submissions_that_attack_the_grading_reach_nothing_and_cost_only_themselves(tmp_path, capsys):
    import sysconfig

    course = course_copy(tmp_path)
    subs = tmp_path / "submissions"
    files = {"alice_correct": SOLUTION, "ian_writes_the_grader": at_import(SOLUTION, GRADER_WRITE),
             "jack_deletes_siblings": at_import(SOLUTION, SIBLINGS_DELETED),
             "kim_hunts_the_hidden_seed": with_body(SOLUTION, "add_noise", SEED_HUNT),
             "lea_kills_everyone": at_import(SOLUTION, KILL_ALL),
             "max_copies_a_classmate": with_body(SOLUTION, "add_noise", COPY_CLASSMATE)}
    for name, text in files.items():
        (subs / name).mkdir(parents=True)
        (subs / name / f"{LAB}.py").write_text(text, encoding="utf-8")
    grader = (course / "graders" / f"{LAB}.py").read_bytes()
    secret = tmp_path / "hidden-seed.txt"
    secret.write_text("73735173\n")
    out = tmp_path / "out"
    assert cli.main(["class", *[str(subs / n) for n in files], "--out", str(out), "--labs", LAB, "--jobs", "2",
                     "--seed", "11", "--hidden-seed-file", str(secret), "--root", str(course)]) == 0
    printed = capsys.readouterr().out
    assert (course / "graders" / f"{LAB}.py").read_bytes() == grader
    assert not (tmp_path.parent / "kata_planted.pth").exists()
    assert not (__import__("pathlib").Path(sysconfig.get_paths()["purelib"]) / "kata_planted.pth").exists()
    learners = {e["learner"]: e for e in json.loads((out / "class.json").read_text())["learners"]}
    full = sum(p for _, p in grader_functions(LAB))
    # nothing reached another submission, the grading or the class: every one is graded as its own code deserves
    for name in ("alice_correct", "ian_writes_the_grader", "jack_deletes_siblings", "kim_hunts_the_hidden_seed",
                 "lea_kills_everyone"):
        assert learners[name]["score"] == full and learners[name]["outcome"] == "graded", learners[name]
    assert learners["max_copies_a_classmate"]["score"] < full  # the copy was refused: add_noise fails
    assert "grading files were changed" not in printed and "again, alone" not in printed


def test_a_hidden_case_file_with_an_unknown_check_or_an_invalid_case_stops_before_anyone_is_graded(tmp_path,
                                                                                                     capsys):
    cases = tmp_path / "hidden.json"
    cases.write_text(json.dumps({f"{LAB}::add_noise::no such check": [{}],
                                 f"{LAB}::no_such_function::x": [{}],
                                 f"{LAB}::add_noise::{ADD_NOISE_CHECK}": [{"dtype": "float16", "colour": 3},
                                                                          {"dtype": "not a dtype"}]}))
    out = tmp_path / "out"
    assert cli.main(["class", str(tmp_path), "--out", str(out), "--labs", LAB, "--hidden-cases", str(cases)]) == 2
    err = capsys.readouterr().err
    assert "4 problem(s), stopped before grading anyone" in err
    assert "no such check" in err and "no such function" in err
    assert "unknown parameter(s) colour" in err and "the grader cannot build it" in err
    assert not out.exists()


# ---- Gradescope bundle -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    path = tmp_path_factory.mktemp("bundle") / "autograder.zip"
    assert cli.main(["gradescope-bundle", "--out", str(path), "--labs", "01,02", "--timeout", "120"]) == 0
    return path


def autograder_root(tmp_path: Path, bundle: Path, submission: dict[str, str]) -> Path:
    """Gradescope's layout: source/ (the unzipped bundle), submission/, results/, run_autograder."""
    root = tmp_path / "autograder"
    with zipfile.ZipFile(bundle) as z:
        z.extractall(root / "source")
    shutil.copyfile(root / "source" / "run_autograder", root / "run_autograder")
    (root / "submission").mkdir()
    (root / "results").mkdir()
    for name, text in submission.items():
        (root / "submission" / name).write_text(text, encoding="utf-8")
    return root


def run_autograder(root: Path, python: str = sys.executable) -> subprocess.CompletedProcess:
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), KATA_PYTHON=python)
    return subprocess.run(["bash", str(root / "run_autograder")], env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_bundle_ships_the_project_and_pinned_setup_but_no_solutions(bundle):
    with zipfile.ZipFile(bundle) as z:
        names = set(z.namelist())
        setup = z.read("setup.sh").decode()
        run = z.read("run_autograder").decode()
        assert (z.getinfo("run_autograder").external_attr >> 16) & 0o111
    assert {"setup.sh", "run_autograder", "project/pyproject.toml",
            "project/plugin/diffusion_katas/pytest_plugin/plugin.py", "project/graders/01_forward_noise.py",
            "project/graders/02_denoising_step.py", "project/autograder.json"} <= names
    assert not any(n.startswith("project/solutions/") or "__pycache__" in n for n in names)
    assert "project/graders/03_scheduler_reading.py" not in names  # only the selected labs
    for pin in ("torch==2.13.0", "diffusers==0.42.1", "peft==0.21.2", "transformers==5.23.0", "accelerate",
                "numpy", "pytest", "pytest-timeout"):
        assert pin in setup
    assert 'pip install --no-deps -e "$SOURCE/project"' in setup
    assert "pip" not in run and "install" not in run.replace("installs nothing", "")


def test_run_autograder_grades_a_submission_into_results_json(tmp_path, bundle):
    root = autograder_root(tmp_path, bundle, {f"{LAB}.py": without_function(SOLUTION, "add_noise"),
                                              "02_denoising_step.py": (REPO / "katas" / "02_denoising_step.py")
                                              .read_text(encoding="utf-8")})
    (root / "results" / "results.json").write_text('{"score": 999, "tests": []}')  # a planted result
    done = run_autograder(root)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((root / "results" / "results.json").read_text(encoding="utf-8"))
    assert_valid_gradescope(data)
    lab01, lab02 = grader_functions(LAB), grader_functions("02_denoising_step")
    assert data["max_score"] == sum(p for _, p in lab01 + lab02)
    assert data["score"] == sum(p for name, p in lab01 if name != "add_noise")
    tests = {t["name"].rsplit(" · ", 1)[1]: t for t in data["tests"]}
    assert set(tests) == {name for name, _ in lab01 + lab02}
    assert tests["add_noise"]["status"] == "failed" and "has no function `add_noise`" in tests["add_noise"]["output"]
    assert all(tests[name]["status"] == "failed" and "TODO" in tests[name]["output"] for name, _ in lab02)
    assert (root / "source" / "project" / "katas" / f"{LAB}.py").is_file()  # copied into the bundled project


def test_run_autograder_scores_a_kata_file_that_exits_at_import_zero_with_the_reason(tmp_path, bundle):
    root = autograder_root(tmp_path, bundle, {f"{LAB}.py": at_import(SOLUTION, "import os\nos._exit(0)")})
    done = run_autograder(root)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((root / "results" / "results.json").read_text(encoding="utf-8"))
    assert_valid_gradescope(data)
    lab01 = [t for t in data["tests"] if t["name"].startswith("Lab 01")]
    assert data["score"] == 0 and lab01
    assert all(t["score"] == 0 and "ended the process that imports it" in t["output"] for t in lab01)


def test_the_bundles_hidden_seed_is_in_no_option_and_its_file_is_gone_before_the_submission_runs(tmp_path):
    cases = tmp_path / "hidden.json"
    cases.write_text(json.dumps({f"{LAB}::add_noise::{ADD_NOISE_CHECK}": [{"shape": [3, 5, 7], "dtype": "float16", "schedule": "linear"}]}))
    path = tmp_path / "autograder.zip"
    secret = tmp_path / "hidden-seed.txt"
    secret.write_text("73735173\n")
    assert cli.main(["gradescope-bundle", "--out", str(path), "--labs", LAB, "--timeout", "120",
                     "--hidden-seed-file", str(secret), "--hidden-cases", str(cases)]) == 0
    with zipfile.ZipFile(path) as z:
        assert "73735173" not in z.read("project/autograder.json").decode()
        assert "project/hidden.json" in z.namelist()
    root = autograder_root(tmp_path, path, {f"{LAB}.py": with_body(SOLUTION, "add_noise", SEED_HUNT)})
    done = run_autograder(root)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (root / "source" / "project" / "hidden.json").exists()
    data = json.loads((root / "results" / "results.json").read_text(encoding="utf-8"))
    assert_valid_gradescope(data)
    hidden = [t for t in data["tests"] if t["name"].endswith("(hidden checks)")]
    assert hidden and all(t["status"] == "passed" for t in hidden), data["tests"]
    assert data["score"] == data["max_score"], [t["output"] for t in data["tests"] if t["status"] != "passed"]


FORGE_RESULTS = """\
import json, pathlib
_root = pathlib.Path(__file__).resolve().parents[3]  # autograder/source/project/katas/NN.py -> autograder/
for _target in (_root / "results" / "results.json", _root / "source" / "project" / "graders" / "01_forward_noise.py"):
    try:
        _target.write_text(json.dumps({"score": 100.0, "output": "forged", "tests": []}))
    except OSError:
        pass
"""


def test_a_submission_cannot_write_the_autograders_results_or_graders(tmp_path, bundle):
    root = autograder_root(tmp_path, bundle, {f"{LAB}.py": at_import(KATA, FORGE_RESULTS)})
    done = run_autograder(root)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((root / "results" / "results.json").read_text(encoding="utf-8"))
    assert_valid_gradescope(data)
    assert data["score"] == 0 and "forged" not in json.dumps(data)  # every function TODO, as graded
    assert "forged" not in (root / "source" / "project" / "graders" / "01_forward_noise.py").read_text()


def test_run_autograder_still_writes_a_zero_score_when_its_own_program_fails(tmp_path, bundle):
    root = autograder_root(tmp_path, bundle, {f"{LAB}.py": SOLUTION})
    done = run_autograder(root, python="false")
    assert done.returncode == 0
    data = json.loads((root / "results" / "results.json").read_text(encoding="utf-8"))
    assert data["score"] == 0 and data["tests"] == [] and "exited with status 1" in data["output"]


# ---- GitHub Classroom ----------------------------------------------------------------------------------------------
def workflow_steps(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text(encoding="utf-8"))["jobs"]["run-autograding-tests"]["steps"]


def test_the_classroom_workflow_has_one_test_per_kata_function_worth_its_points(tmp_path):
    assert cli.main(["classroom", "--out", str(tmp_path / ".github")]) == 0
    path = tmp_path / ".github" / "workflows" / "classroom.yml"
    workflow = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert workflow["name"] == "Autograding Tests"
    assert workflow["on"] == ["push", "repository_dispatch"]
    assert workflow["permissions"] == {"checks": "write", "actions": "read", "contents": "read"}
    job = workflow["jobs"]["run-autograding-tests"]
    assert job["runs-on"] == "ubuntu-latest"
    steps = job["steps"]
    assert steps[0]["uses"] == "actions/checkout@v4"
    names = [s.get("name") for s in steps]
    # the check comes before anything of the repository's runs: installing it runs its build
    check = names.index("Check the grading files are the instructor's")
    install = next(i for i, s in enumerate(steps) if "pip install" in s.get("run", ""))
    grade = next(i for i, s in enumerate(steps) if "--kata-json" in s.get("run", ""))
    assert check < install < grade
    assert " -e " not in steps[install]["run"]  # a wheel: no folder of the repository on Python's path
    assert "python -I -m pytest --noconftest" in steps[grade]["run"] and "|| true" in steps[grade]["run"]
    tests = [s for s in steps if s.get("uses") == "classroom-resources/autograding-command-grader@v1"]
    labs = [p.stem for p in sorted((REPO / "graders").glob("[0-9][0-9]_*.py"))]
    expected = [(lab, function, points) for lab in labs for function, points in grader_functions(lab)]
    assert [t["with"]["command"] for t in tests] == [
        f"python -I -m diffusion_katas classroom-result .kata-grade/results.json {lab} {function}"
        for lab, function, _ in expected]
    assert [t["with"]["max-score"] for t in tests] == [points for _, _, points in expected]
    assert all(t["with"]["test-name"].endswith(f" · {function}") for t, (_, function, _) in zip(tests, expected))
    run = steps[check]["run"]
    assert "sha256sum --check --strict" in run and all(f"graders/{lab}.py" in run for lab in labs)
    assert "plugin/diffusion_katas/engine/runner.py" in run and "pyproject.toml" in run
    reporter = steps[-1]
    assert reporter["uses"] == "classroom-resources/autograding-grading-reporter@v1"
    ids = [t["id"] for t in tests]
    assert len(set(ids)) == len(ids)
    assert reporter["with"]["runners"] == ",".join(ids)
    assert reporter["env"] == {f"{i.upper()}_RESULTS": f"${{{{steps.{i}.outputs.result}}}}" for i in ids}
    # written again unchanged: fine; a different file is kept unless --force
    assert cli.main(["classroom", "--out", str(tmp_path / ".github")]) == 0
    assert (tmp_path / ".github" / "kata-grading.ini").is_file()
    path.write_text("# mine\n")
    assert cli.main(["classroom", "--out", str(tmp_path / ".github")]) == 2
    assert cli.main(["classroom", "--out", str(tmp_path / ".github"), "--force"]) == 0


def test_the_classroom_workflow_run_in_a_learner_copy_gives_credit_by_function_whatever_the_repository_holds(
        tmp_path, fresh_venv):
    # The workflow's own commands, run in order as the Classroom runner runs them, in a template made by
    # `kata learner-copy` (with the workflow committed to it), in a fresh venv. The one change: the install step's
    # dependencies come from this environment (no downloads in a test).
    import os
    import subprocess

    repo = tmp_path / "template"
    assert subprocess.run([sys.executable, "-m", "diffusion_katas", "learner-copy", str(repo), "--labs", LAB,
                           "--root", str(REPO)], capture_output=True, timeout=300).returncode == 0
    assert cli.main(["classroom", "--out", str(repo / ".github"), "--labs", LAB, "--root", str(repo)]) == 0
    steps = workflow_steps(repo / ".github" / "workflows" / "classroom.yml")
    env = dict(os.environ, PATH=f"{fresh_venv.parent}{os.pathsep}{os.environ['PATH']}")

    def run(command):
        return subprocess.run(["bash", "-c", command], cwd=repo, capture_output=True, text=True, timeout=600,
                              env=env)

    # the learner: every function right but velocity (redefined as a TODO at the end of the file)
    (repo / "katas" / f"{LAB}.py").write_text(SOLUTION + "\n\ndef velocity(*args, **kwargs):\n"
                                              "    raise NotImplementedError\n", encoding="utf-8")
    # and what a learner's repository can hold besides: a conftest.py that passes everything, a pytest.py and a
    # diffusion_katas/ that stand in for the real ones, a sitecustomize.py, a report claiming full marks
    (repo / "conftest.py").write_text("def pytest_collection_modifyitems(items):\n    items.clear()\n")
    (repo / "pytest.py").write_text("raise SystemExit(0)\n")
    (repo / "diffusion_katas").mkdir()
    (repo / "diffusion_katas" / "__init__.py").write_text("raise SystemExit(0)\n")
    (repo / "diffusion_katas" / "__main__.py").write_text("raise SystemExit(0)\n")
    for folder in (repo, repo / "plugin"):
        (folder / "sitecustomize.py").write_text("raise SystemExit(0)\n")
    (repo / ".kata-grade").mkdir()
    (repo / ".kata-grade" / "results.json").write_text(json.dumps({"labs": [{"lab": LAB, "functions": [
        {"name": name, "status": "passed"} for name, _ in grader_functions(LAB)]}]}))

    awarded = {}
    for step in steps[2:-1]:
        if "run" in step:
            command = step["run"]
            if "pip install" in command:  # this environment's dependencies; the project itself as a wheel
                command = "python -m pip install -q --no-deps --no-build-isolation ."
            done = run(command)
            assert done.returncode == 0, (step["name"], done.stdout[-3000:], done.stderr[-3000:])
        else:
            done = run(step["with"]["command"])
            awarded[step["with"]["test-name"].split(" · ")[-1]] = step["with"]["max-score"] * (done.returncode == 0)
    expected = {name: points * (name != "velocity") for name, points in grader_functions(LAB)}
    assert awarded == expected

    # a grading file changed: the check fails, before anything is installed or graded
    with open(repo / "plugin" / "diffusion_katas" / "engine" / "comparison.py", "a") as engine:
        engine.write("\n# the learner's edit\n")
    with open(repo / "pyproject.toml", "a") as pyproject:
        pyproject.write("\n# the learner's edit\n")
    check = next(s for s in steps if s.get("name") == "Check the grading files are the instructor's")["run"]
    checked = run(check)
    assert checked.returncode != 0
    assert "comparison.py: FAILED" in checked.stdout and "pyproject.toml: FAILED" in checked.stdout


def test_a_classroom_result_without_a_report_or_for_an_ungraded_function_awards_nothing(tmp_path, capsys):
    assert cli.main(["classroom-result", str(tmp_path / "missing.json"), LAB, "velocity"]) == 1
    assert "did not finish" in capsys.readouterr().out
    report = tmp_path / "results.json"
    report.write_text(json.dumps({"labs": [{"lab": LAB, "functions": [{"name": "velocity", "status": "failed"}]}],
                                  "results": [{"lab": LAB, "function": "velocity", "check": "vs x",
                                               "status": "failed", "message": "worst element 3.0"}]}))
    assert cli.main(["classroom-result", str(report), LAB, "velocity"]) == 1
    assert "vs x: failed  worst element 3.0" in capsys.readouterr().out
    assert cli.main(["classroom-result", str(report), LAB, "add_noise"]) == 1
    assert "was not graded" in capsys.readouterr().out
