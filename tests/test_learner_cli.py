"""The learner's `kata` commands (watch, progress, hint, reset, explain), run against a copy of one lab.

Each test copies lab 01's kata, solution and grader into a temporary course and passes --root (or runs
from inside it). Grading runs pytest in a subprocess, as a learner's
`kata` does (about 5-20 s a run on a loaded machine), so the tests that grade share their runs.
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diffusion_katas.commands.learner import cli as learner
from diffusion_katas.core.course import Course
from diffusion_katas.commands.main import main

REPO = Path(__file__).resolve().parent.parent
LAB = "01_forward_noise"
FIRST = "scaled_linear_betas"  # the lab's first graded function
# A wrong body for FIRST that the grader names as a trap: a linspace over β itself.
LINEAR_IN_BETA = "return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)"
GRADING_LIMIT = 300  # seconds; a grading run takes 5-20 s


def make_root(path: Path) -> Path:
    """A course holding lab 01 only: katas/, solutions/ and graders/."""
    for folder in ("katas", "solutions", "graders"):
        (path / folder).mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / folder / f"{LAB}.py", path / folder / f"{LAB}.py")
    return path


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kata(*args: str) -> subprocess.CompletedProcess:
    """`kata ARGS` in a subprocess, as a learner types it."""
    return subprocess.run([sys.executable, "-m", "diffusion_katas", *args], capture_output=True, text=True,
                          encoding="utf-8", env=subprocess_env(), timeout=GRADING_LIMIT)


def run(capsys, *args: str) -> tuple[int, str, str]:
    """`kata ARGS` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def get_first_function_wrong(root: Path) -> None:
    path = root / "katas" / f"{LAB}.py"
    text = path.read_text(encoding="utf-8")
    start = text.index(f"def {FIRST}(")
    stub = text.index("raise NotImplementedError", start)
    path.write_text(text[:stub] + LINEAR_IN_BETA + text[stub + len("raise NotImplementedError"):], encoding="utf-8")


class Terminal(io.StringIO):
    """A stdin that says it is a terminal, holding the learner's answer."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """A root with lab 01 and a lab whose kata file does not parse, after one `kata progress`."""
    root = make_root(tmp_path_factory.mktemp("graded"))
    shutil.copy(REPO / "graders" / f"{LAB}.py", root / "graders" / "02_broken.py")
    (root / "katas" / "02_broken.py").write_text('"""Lab 02 · Broken"""\ndef oops(:\n', encoding="utf-8")
    done = kata("progress", "--root", str(root))
    return root, done


# ---- watch -----------------------------------------------------------------------------------------------
def test_watch_once_shows_each_functions_status_the_next_step_and_the_first_failure(tmp_path, capsys):
    root = make_root(tmp_path)
    get_first_function_wrong(root)

    code, out, err = run(capsys, "watch", "--once", "--root", str(root))

    assert code == 0, err
    assert f"graded katas/{LAB}.py once · seed" in out
    assert "watching" not in out and "Ctrl-C" not in out  # --once watches nothing
    assert "0/6 solved" in out
    assert re.search(rf"FAILED\s+{FIRST}", out)
    assert re.search(r"TODO\s+add_noise", out)
    assert f"next: fix `{FIRST}` in katas/{LAB}.py" in out
    # the next tier comes with the next failed grading, as `kata hint` itself says (not from `kata hint` now)
    assert "hint 1 (nudge): " in out and "hint 2 of 3 comes with your next failed grading" in out
    code, hint_out, _ = run(capsys, "hint", "--root", str(root))
    assert "hint 1 (nudge)" in hint_out and "hint 2 (" not in hint_out
    assert f"why `{FIRST}` is FAILED" in out and "trap: a linspace over β itself" in out
    assert "\033[2J" not in out  # the screen is cleared only on a terminal
    assert (root / ".kata" / "last-grading.json").is_file()  # written by the grading run itself


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
def test_watch_grades_again_after_the_kata_file_changes_and_stops_cleanly_on_ctrl_c(tmp_path):
    root = make_root(tmp_path)
    # SIGINT may be ignored in a test runner started in the background; the learner's shell has it.
    watcher = subprocess.Popen(
        [sys.executable, "-m", "diffusion_katas", "watch", "01", "--interval", "0.2", "--root", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8", env=subprocess_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(watcher.stdout), daemon=True).start()

    def wait_for(pattern: str) -> None:
        deadline = time.monotonic() + GRADING_LIMIT
        while not re.search(pattern, "".join(seen)):
            assert watcher.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n" + "".join(seen)
            time.sleep(0.1)

    try:
        wait_for(r"0/6 solved[\s\S]*waiting for a change")
        shutil.copy(root / "solutions" / f"{LAB}.py", root / "katas" / f"{LAB}.py")
        wait_for(r"6/6 solved[\s\S]*waiting for a change")
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=60) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    out = "".join(seen)
    assert out.count("watching katas/01_forward_noise.py (") == 2
    assert "every function in this lab passes" in out
    assert "stopped watching." in out


def assert_the_record_knows_the_lab_as_it_is(root: Path, some: dict) -> None:
    """After a watch's save: the record holds the lab as graded now, not as changed since (`kata progress` would
    grade it again, `kata report` would say so)."""
    from diffusion_katas.core import record
    from diffusion_katas.core.course import Course

    course = Course(root)
    entry = record.entry(record.load(course), LAB)
    assert entry is not None and not record.lab_changed(course, entry), entry
    assert some.items() <= {f["name"]: f["status"] for f in entry["functions"]}.items(), entry


@pytest.mark.skipif(sys.platform == "win32", reason="sends SIGINT")
def test_after_a_save_watch_regrades_only_the_functions_whose_code_changed_and_the_whole_lab_before_a_pass(tmp_path):
    root = make_root(tmp_path)
    path = root / "katas" / f"{LAB}.py"
    watcher = subprocess.Popen(
        [sys.executable, "-m", "diffusion_katas", "watch", "01", "--interval", "0.2", "--root", str(root)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, encoding="utf-8", env=subprocess_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(watcher.stdout), daemon=True).start()

    def wait_for(pattern: str, after: int = 0) -> int:
        deadline = time.monotonic() + GRADING_LIMIT
        while not re.search(pattern, "".join(seen)[after:]):
            assert watcher.poll() is None, "".join(seen)
            assert time.monotonic() < deadline, f"no {pattern!r} in:\n" + "".join(seen)[after:]
            time.sleep(0.1)
        return len("".join(seen))

    try:
        mark = wait_for(r"0/6 solved[\s\S]*waiting for a change")
        get_first_function_wrong(root)
        mark = wait_for(r"graded `scaled_linear_betas` \(the other functions' code is unchanged[\s\S]*"
                        r"FAILED +scaled_linear_betas[\s\S]*waiting for a change", mark)
        assert f"--kata-function" not in "".join(seen)
        assert_the_record_knows_the_lab_as_it_is(root, {FIRST: "failed", "add_noise": "todo"})
        path.write_text(path.read_text(encoding="utf-8").replace(f"def {FIRST}(", f"# a comment\ndef {FIRST}(", 1),
                        encoding="utf-8")
        mark = wait_for(r"no code changed since the last grading[\s\S]*waiting for a change", mark)
        assert_the_record_knows_the_lab_as_it_is(root, {FIRST: "failed", "add_noise": "todo"})
        shutil.copy(root / "solutions" / f"{LAB}.py", path)
        wait_for(rf"grading katas/{LAB}.py\.\.\.[\s\S]*6/6 solved[\s\S]*every function in this lab passes", mark)
    finally:
        watcher.kill()
        watcher.wait()


def test_watching_notices_a_save_by_delete_and_create(tmp_path):
    path = tmp_path / "kata.py"
    path.write_text("x = 1\n")
    before = learner.signature(path)

    def save_like_an_editor():
        time.sleep(0.3)
        path.unlink()
        time.sleep(0.1)
        path.write_text("x = 22\n")

    threading.Thread(target=save_like_an_editor, daemon=True).start()
    start = time.monotonic()
    learner.wait_for_change(path, before, interval=0.05)
    assert time.monotonic() - start < 10
    assert path.read_text() == "x = 22\n"


def test_with_watchfiles_the_size_and_mtime_are_still_checked_where_no_event_arrives(tmp_path):
    class NoEvents:  # watchfiles on NFS: only timeouts, never an event
        def watch(self, *paths, watch_filter, rust_timeout, yield_on_timeout):
            assert yield_on_timeout and rust_timeout == 50
            assert watch_filter(2, str(path)) and not watch_filter(2, str(tmp_path / "other.py"))
            while True:
                time.sleep(rust_timeout / 1000)
                yield set()

    path = tmp_path / "kata.py"
    path.write_text("x = 1\n")
    before = learner.signature(path)
    threading.Timer(0.3, lambda: path.write_text("x = 333\n")).start()
    start = time.monotonic()
    learner.wait_for_change(path, before, interval=0.05, events=NoEvents())
    assert time.monotonic() - start < 10
    assert learner.signature(path) != before


def test_watch_names_the_labs_when_the_lab_does_not_exist(tmp_path, capsys):
    code, _, err = run(capsys, "watch", "99", "--once", "--root", str(make_root(tmp_path)))
    assert code == 2
    assert f"the labs are: {LAB}" in err


# ---- progress --------------------------------------------------------------------------------------------
def test_progress_prints_every_lab_with_its_solved_count_and_next_todo(graded):
    root, done = graded
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.startswith("  ")}
    assert set(rows) == {LAB, "02_broken"}
    assert "0/6" in rows[LAB] and f"next: {FIRST} (TODO)" in rows[LAB]
    assert "katas/02_broken.py does not parse" in rows["02_broken"]  # a lab that fails to import still shows
    assert f"next: write `{FIRST}` in katas/{LAB}.py" in done.stdout
    saved = json.loads((root / ".kata" / "last-grading.json").read_text(encoding="utf-8"))
    assert [entry["lab"] for entry in saved["labs"]] == ["01_forward_noise", "02_broken"]


def test_progress_cached_prints_the_last_report_without_grading(graded, capsys, monkeypatch):
    root, done = graded
    monkeypatch.setattr(learner, "grade", lambda *a, **k: pytest.fail("--cached must not grade"))

    code, out, err = run(capsys, "progress", "--cached", "--root", str(root))

    assert code == 0, err
    assert "last grading, saved" in out
    table = [line for line in out.splitlines() if line.startswith("  ")]
    assert table == [line for line in done.stdout.splitlines() if line.startswith("  ")]


def test_progress_on_an_untouched_lab_reads_its_todos_and_grades_nothing_until_a_function_is_written(
        tmp_path, capsys, monkeypatch):
    root = make_root(tmp_path)
    monkeypatch.setattr(learner, "grade", lambda *a, **k: pytest.fail("an untouched lab must not be graded"))
    code, out, err = run(capsys, "progress", "--root", str(root))
    assert code == 0, err
    assert "1 untouched lab(s) read as TODO, nothing graded" in out
    assert re.search(rf"{LAB}\s+0/6\s+\.{{6}}\s+next: {FIRST} \(TODO\)", out), out
    code, out, err = run(capsys, "hint", "--root", str(root))
    assert code == 0 and f"{LAB} · `{FIRST}`" in out, err
    # a comment is not code: still untouched
    kata_file = root / "katas" / f"{LAB}.py"
    kata_file.write_text(kata_file.read_text(encoding="utf-8") + "\n# my notes\n", encoding="utf-8")
    assert run(capsys, "progress", "--root", str(root))[0] == 0
    # a function written: the lab is graded
    get_first_function_wrong(root)
    calls = []
    monkeypatch.setattr(learner, "grade", lambda *a, **k: calls.append(a) or pytest.fail("graded"))
    with pytest.raises(pytest.fail.Exception, match="graded"):
        run(capsys, "progress", "--root", str(root))
    assert calls and calls[0][1:] == (f"katas/{LAB}.py", "--continue-on-collection-errors")


def test_progress_cached_before_any_grading_says_how_to_get_a_report(tmp_path, capsys):
    code, _, err = run(capsys, "progress", "--cached", "--root", str(make_root(tmp_path)))
    assert code == 1
    assert "run `kata progress`" in err


# ---- hint ------------------------------------------------------------------------------------------------
def test_hint_shows_the_first_tier_and_the_next_only_after_a_failed_attempt(graded, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(graded[0], root)
    outputs = [run(capsys, "hint", "--root", str(root)) for _ in range(2)] + [run(capsys, "hint", "--all", "--root",
                                                                                 str(root))]

    assert all(code == 0 for code, _, _ in outputs)
    first, second, everything = (out for _, out, _ in outputs)
    assert f"{LAB} · `{FIRST}` (TODO when last graded)" in first
    assert "hint 1 (nudge): " in first and "hint 2 (" not in first
    assert "hint 2 of 3 comes after your next failed attempt" in first
    assert second == first  # asking again is not an attempt (tests/test_learner_loop.py grades one)
    assert "hint 2 (the math)" in everything and "hint 3 (near code): " in everything and "every hint" in everything
    remembered = json.loads((root / ".kata" / "hints.json").read_text(encoding="utf-8"))
    assert remembered[f"{LAB}::{FIRST}"]["shown"] == 3


def test_watch_remembers_the_hint_tiers_of_the_failure_it_shows_and_only_those(tmp_path, capsys):
    from diffusion_katas.commands.learner.watch import remember_shown

    course = Course(make_root(tmp_path))
    remember_shown(course, LAB, FIRST, "add_noise · check ...\n  hint 1 (nudge): a\n  hint 2 (the math): b\n")
    remember_shown(course, LAB, "cosine_betas", "a message whose hints were cut off")
    remembered = json.loads(course.hints_path.read_text(encoding="utf-8"))
    assert remembered == {f"{LAB}::{FIRST}": {"shown": 2, "failures": 0}}
    code, out, _ = run(capsys, "hint", FIRST, "--lab", LAB, "--root", str(course.root))
    assert code == 0 and "hint 2 (the math)" in out and "hint 3 (" not in out


def test_hint_for_a_named_function_finds_its_lab_without_a_report(tmp_path, capsys):
    root = make_root(tmp_path)
    code, out, err = run(capsys, "hint", "add_noise", "--root", str(root))
    assert code == 0, err
    assert f"{LAB} · `add_noise`" in out and "hint 1 (nudge): " in out

    code, _, err = run(capsys, "hint", "add_nose", "--lab", "01", "--root", str(root))
    assert code == 2
    assert "its functions are: scaled_linear_betas, cosine_betas" in err


def test_hint_given_a_lab_number_shows_that_labs_current_todo(tmp_path, capsys):
    root = make_root(tmp_path)
    for lab in ("01", LAB):
        code, out, err = run(capsys, "hint", lab, "--root", str(root))
        assert code == 0, err
        assert f"{LAB} · `{FIRST}`" in out and "hint 1 (nudge): " in out


def test_hint_for_a_function_two_labs_grade_asks_for_the_lab(graded, tmp_path, capsys):
    root = tmp_path / "root"
    shutil.copytree(graded[0], root)  # 02_broken is graded by a copy of lab 01's grader
    code, _, err = run(capsys, "hint", "add_noise", "--root", str(root))
    assert code == 2
    assert "name the lab" in err

    code, out, _ = run(capsys, "hint", "add_noise", "--lab", "01", "--root", str(root))
    assert code == 0 and f"{LAB} · `add_noise`" in out


def test_hint_texts_are_the_ones_the_graders_declare():
    """Hints are read from the grader's source without importing it; the import gives the same."""
    from diffusion_katas.core.course import load_module
    from diffusion_katas.core.spec import Kata

    for path in sorted((REPO / "graders").glob("[0-9][0-9]_*.py")):
        name = f"_learner_test_{path.stem}"
        try:
            module = load_module(path, name)
        finally:
            sys.modules.pop(name, None)
        declared = {v.name: tuple(v.hints) for v in vars(module).values() if isinstance(v, Kata)}
        assert learner.grader_hints(Course(REPO), path.stem) == declared, path.stem


# ---- reset -----------------------------------------------------------------------------------------------
def test_reset_asks_first_and_keeps_the_file_when_the_answer_is_no(tmp_path, capsys, monkeypatch):
    root = make_root(tmp_path)
    get_first_function_wrong(root)
    mine = (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", Terminal("n\n"))

    code, out, _ = run(capsys, "reset", "01", "--root", str(root))

    assert code == 1
    assert f"Reset katas/{LAB}.py ? Your version is kept in .kata/backups/{LAB}-" in out and "[y/N]" in out
    assert (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8") == mine
    assert not (root / ".kata" / "backups").exists()


def test_reset_restores_the_pristine_kata_and_keeps_a_backup_when_the_answer_is_yes(tmp_path, capsys,
                                                                                  monkeypatch):
    root = make_root(tmp_path)
    get_first_function_wrong(root)
    mine = (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", Terminal("y\n"))

    code, out, _ = run(capsys, "reset", "forward_noise", "--root", str(root))

    assert code == 0
    assert (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8") == (REPO / "katas" / f"{LAB}.py").read_text(
        encoding="utf-8")
    backups = list((root / ".kata" / "backups").glob(f"{LAB}-*.py"))
    assert len(backups) == 1 and backups[0].read_text(encoding="utf-8") == mine
    assert f"your version: .kata/backups/{backups[0].name}" in out


def test_reset_refuses_without_a_terminal_unless_given_yes(tmp_path, capsys, monkeypatch):
    root = make_root(tmp_path)
    get_first_function_wrong(root)
    mine = (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # piped input is not a terminal

    code, _, err = run(capsys, "reset", "01", "--root", str(root))
    assert code == 1
    assert "no terminal to ask you on" in err and "--yes" in err
    assert (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8") == mine

    code, _, _ = run(capsys, "reset", "01", "--yes", "--root", str(root))
    assert code == 0
    assert "raise NotImplementedError" in (root / "katas" / f"{LAB}.py").read_text(encoding="utf-8")
    assert [p.read_text(encoding="utf-8") for p in (root / ".kata" / "backups").iterdir()] == [mine]

    code, out, _ = run(capsys, "reset", "01", "--yes", "--root", str(root))
    assert code == 0 and "already pristine" in out  # nothing to back up the second time
    assert len(list((root / ".kata" / "backups").iterdir())) == 1


# ---- explain and usage -----------------------------------------------------------------------------------
def test_explain_prints_the_lesson_or_one_section_of_it(tmp_path, capsys):
    root = make_root(tmp_path)
    code, out, _ = run(capsys, "explain", "01", "--root", str(root))
    assert code == 0
    assert out.startswith("Lab 01 · Forward noise process\n")
    assert "Concept:" in out and "Say it out loud:" in out

    code, out, _ = run(capsys, "explain", "1", "--section", "traps", "--root", str(root))
    assert code == 0
    assert "Traps:" in out and "Concept:" not in out


def test_explain_of_an_unknown_lab_lists_the_labs(tmp_path, capsys):
    code, _, err = run(capsys, "explain", "42", "--root", str(make_root(tmp_path)))
    assert code == 2
    assert f"the labs are: {LAB}" in err


def test_a_bad_command_prints_the_usage_and_the_commands():
    done = kata("frobnicate")
    assert done.returncode == 2
    assert "usage: kata" in done.stderr
    assert all(name in done.stderr for name in ("watch", "progress", "hint", "reset", "explain"))


def test_bare_kata_prints_its_help_and_kata_version_its_version():
    from importlib import metadata

    done = kata()
    assert done.returncode == 0, done.stderr
    assert "usage: kata" in done.stdout and all(name in done.stdout for name in ("watch", "progress", "hint"))
    done = kata("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"kata (diffusion-katas) {metadata.version('diffusion-katas')}"


def test_a_save_during_a_grading_undoes_what_it_wrote_and_grades_the_lab_again(tmp_path, capsys):
    # Each check imports the kata file afresh: a grading that saw two versions counts for nothing.
    from diffusion_katas.commands.running import Grading
    from diffusion_katas.core.course import Course

    root = make_root(tmp_path)
    course = Course(root)
    course.record_path.parent.mkdir(parents=True, exist_ok=True)
    course.record_path.write_text('{"before": true}')
    kata_file = course.kata(LAB)
    seen = []  # per grading: the kata file, the record and whether a hints file was there, as it started

    class Warm:
        def grade(self, *args):
            seen.append((kata_file.read_text(encoding="utf-8"), course.record_path.read_text(),
                         course.hints_path.exists()))
            course.record_path.write_text(f'{{"grading": {len(seen)}}}')
            course.hints_path.write_text('{"tiers": "spent"}')
            if len(seen) == 1:  # the learner saves while the first grading runs
                kata_file.write_text(seen[0][0] + "\n# saved again\n", encoding="utf-8")
            return Grading({"labs": []}, "", 1, 0.1)

    grading = learner.graded_as_saved(Warm(), course, LAB, f"katas/{LAB}.py")
    assert len(seen) == 2 and grading.report == {"labs": []}
    assert "changed while it was graded: grading it again" in capsys.readouterr().out
    # the second grading saw the new file, and the record and tiers as they were before the mixed one
    assert seen[1] == (seen[0][0] + "\n# saved again\n", '{"before": true}', False)
    assert course.record_path.read_text() == '{"grading": 2}'  # what the second grading wrote stays


def test_watch_shows_what_the_code_printed_under_the_verdict(tmp_path, capsys):
    root = make_root(tmp_path)
    path = root / "katas" / f"{LAB}.py"
    text = path.read_text(encoding="utf-8")
    stub = text.index("raise NotImplementedError", text.index(f"def {FIRST}("))
    path.write_text(text[:stub] + 'print("my betas:", beta_start, beta_end)\n    ' + LINEAR_IN_BETA
                    + text[stub + len("raise NotImplementedError"):], encoding="utf-8")
    code, out, err = run(capsys, "watch", "--once", "--root", str(root))
    assert code == 0, err
    assert re.search(r"---- what your code printed ----\nmy betas: 0\.000\d+ 0\.0\d+", out), out


def test_after_a_solved_lab_watch_names_the_next_lab_not_yet_solved(tmp_path):
    from diffusion_katas.commands.learner.watch import next_unsolved_lab
    from diffusion_katas.core import record
    from diffusion_katas.core.course import Course

    root = make_root(tmp_path)
    for lab in ("02_copy", "03_copy"):
        for folder in ("katas", "solutions", "graders"):
            shutil.copy(REPO / folder / f"{LAB}.py", root / folder / f"{lab}.py")
    course = Course(root)
    data = record.empty()
    data["labs"] = [{"lab": lab, "functions": [{"name": "f", "status": status}]}
                    for lab, status in ((LAB, "passed"), ("02_copy", "passed"), ("03_copy", "todo"))]
    record.write(course, data)
    assert next_unsolved_lab(course, LAB) == "03_copy"
    assert next_unsolved_lab(course, "03_copy") is None  # every other lab solved
    data["labs"][2]["functions"][0]["status"] = "passed"
    record.write(course, data)
    assert next_unsolved_lab(course, LAB) is None
    data["labs"][0]["functions"][0]["status"] = "failed"
    record.write(course, data)
    assert next_unsolved_lab(course, "03_copy") == LAB  # from the first lab again
