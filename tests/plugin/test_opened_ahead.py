"""The next check's runner is opened while the check before it runs, where both grade the same kata file: its
fork and the import of the learner's file overlap the grading instead of following it. The next check reads it
as if it had opened it itself (its own time limit, its own import verdict), and a runner opened for a check that
never runs is closed at the end of the session (the toy project)."""
import pytest

# Notes each runner's opening and closing, with the kata function it is for, to runners.txt.
CONFTEST = '''
from pathlib import Path

from diffusion_katas.engine import runner

def note(line):  # in the test's folder (the patch outlives this file: it is made once per runner module)
    with (Path.cwd() / "runners.txt").open("a") as f:
        f.write(line + "\\n")


if not hasattr(runner.Runner, "_noting"):  # once, though each inline run imports this file again
    runner.Runner._noting = True
    _init, _close = runner.Runner.__init__, runner.Runner.close

    def _opened(self, source, module, grader_modules, answer_key, kata, *args, **kwargs):
        _init(self, source, module, grader_modules, answer_key, kata, *args, **kwargs)
        self._noted = kata
        note(f"open {kata}")

    def _closed(self):
        if not self.closed:
            note(f"close {self._noted}")
        _close(self)

    runner.Runner.__init__, runner.Runner.close = _opened, _closed
'''


@pytest.fixture
def noted(toy):
    toy.pytester.makeconftest(CONFTEST)
    return toy


def runners(toy) -> list[str]:
    path = toy.pytester.path / "runners.txt"
    return path.read_text().splitlines() if path.exists() else []


def most_open_at_once(lines: list[str]) -> int:
    now = most = 0
    for line in lines:
        now += 1 if line.startswith("open ") else -1
        most = max(most, now)
    return most


def test_the_next_checks_runner_is_opened_while_the_check_before_it_runs(noted):
    noted.kata(normalize="return x / x.norm()", stay_put="return x")
    noted.run("katas", "-k", "normalize or stay_put").assert_outcomes(passed=2)
    assert runners(noted) == ["open normalize", "open stay_put", "close normalize", "close stay_put"]


def test_a_runner_opened_for_a_check_that_never_runs_is_closed_when_the_run_stops(noted):
    noted.kata(normalize="return x", stay_put="return x")
    result = noted.run("katas", "-k", "normalize or stay_put", "-x")
    result.assert_outcomes(failed=1)
    assert sorted(runners(noted)) == ["close normalize", "close stay_put", "open normalize", "open stay_put"]


def test_a_budget_opens_its_own_runner_in_its_turn_and_nothing_is_opened_for_it_ahead(noted):
    noted.kata(double="return x * 2")
    noted.run("katas", "--kata-function", "double").assert_outcomes(passed=2)
    assert runners(noted) == ["open double", "close double", "open double", "close double"]
    assert most_open_at_once(runners(noted)) == 1


def test_a_check_whose_runner_was_opened_ahead_has_its_whole_time_limit_from_its_own_start(noted):
    noted.kata(normalize="return x / x.norm()", stay_put="return x")
    noted.run("katas", "-k", "normalize or stay_put").assert_outcomes(passed=2)  # the runners' warm parent started
    # 2 s, then 3 s, under a 4 s limit each: counted from when its runner was opened, stay_put would time out.
    noted.kata(normalize="time.sleep(2)\nreturn x / x.norm()", stay_put="time.sleep(3)\nreturn x")
    result = noted.run("katas", "-k", "normalize or stay_put", "--kata-timeout", "4")
    result.assert_outcomes(passed=2)
    assert runners(noted)[4:6] == ["open normalize", "open stay_put"]


def test_a_kata_file_that_fails_to_import_fails_each_check_opened_ahead_with_the_import_error(noted):
    path = noted.pytester.path / "katas" / "01_toy.py"
    noted.kata(normalize="return x / x.norm()", stay_put="return x")
    path.write_text(path.read_text() + "\nraise ValueError('broken at import')\n")
    result = noted.run("katas", "-k", "normalize or stay_put")
    result.assert_outcomes(failed=2)
    assert result.stdout.str().count("broken at import") >= 2
    assert runners(noted)[:2] == ["open normalize", "open stay_put"]
