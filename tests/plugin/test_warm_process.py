"""What a warm grading process (`kata watch`) keeps between gradings, and what it hides from the collector.

Speed is measured by benchmarks/feedback.py; these tests pin the deterministic mechanisms behind it.
"""
import gc
import textwrap

import pytest

from diffusion_katas.core.course import Course

RECORDER = '''
import gc
import textwrap

FREEZE = []


def pytest_runtest_call(item):
    FREEZE.append(gc.get_freeze_count())
'''


def test_a_grader_file_is_loaded_once_per_process_and_again_only_when_its_content_changes(toy):
    root = toy.pytester.path
    first = Course(root, graders=root / "graders").graders_of("01_toy")
    again = Course(root, graders=root / "graders").graders_of("01_toy")
    assert [id(k) for k in again] == [id(k) for k in first]  # a new session, the same Kata objects

    grader = root / "graders" / "01_toy.py"
    grader.write_text(grader.read_text() + "\n# an edit\n")
    edited = Course(root, graders=root / "graders").graders_of("01_toy")
    assert [k.name for k in edited] == [k.name for k in first]
    assert all(a is not b for a, b in zip(edited, first))


def test_what_was_imported_before_grading_is_hidden_from_the_collector_during_a_run_and_only_then(toy):
    toy.pytester.makeconftest(RECORDER)
    toy.kata(double="return x * 2")
    assert gc.get_freeze_count() == 0
    recorder = toy.pytester.inline_run("katas", "-p", "no:cacheprovider")
    conftest = next(p for p in recorder.getcalls("pytest_plugin_registered")
                    if getattr(p.plugin, "FREEZE", None) is not None).plugin
    assert conftest.FREEZE and min(conftest.FREEZE) > 1000, conftest.FREEZE  # torch & co. are frozen
    assert gc.get_freeze_count() == 0  # and given back to the collector when the session ends


AT_EXIT = '''
import atexit
import gc
from pathlib import Path


def _note():  # registered before the plugin's own: runs after it
    Path(__file__).with_name("frozen_at_exit.txt").write_text(str(gc.get_freeze_count()))


atexit.register(_note)
'''


def test_what_is_alive_when_a_grading_process_ends_is_frozen_so_the_interpreter_does_not_walk_it(toy):
    toy.pytester.makeconftest(AT_EXIT)
    toy.kata(double="return x * 2")
    toy.pytester.runpytest_subprocess("katas", "-p", "no:cacheprovider", "--kata-no-warm", timeout=240)
    assert int((toy.pytester.path / "frozen_at_exit.txt").read_text()) > 1000  # torch & co. (unfrozen at cleanup)


def test_a_run_without_katas_freezes_nothing(pytester: pytest.Pytester):
    pytester.makeconftest(RECORDER)
    pytester.makepyfile(test_plain="def test_one():\n    assert True\n")
    recorder = pytester.inline_run("-p", "no:cacheprovider")
    conftest = next(p for p in recorder.getcalls("pytest_plugin_registered")
                    if getattr(p.plugin, "FREEZE", None) is not None).plugin
    assert conftest.FREEZE == [0]


# ---- built references kept between gradings (--kata-reuse-builds, which the warm grader passes) -------------
KEPT_GRADER = '''
import pathlib

import torch

from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import Tol

TOL = Tol(1e-6, 0.0, "toy tolerance for tests")
LOG = pathlib.Path(__file__).parent.parent / "builds.log"
SHARED = torch.nn.Module()  # one object the grader configures per case, as lab 11 configures its VAE's tiling


class Counter:  # a probe: remote, so its count is the grader's own
    kata_remote = True

    def __init__(self):
        self.calls = 0

    def remote_view(self):
        return dict(label="a counter")

    def __call__(self):
        self.calls += 1


scale = Kata("scale", hints=("one", "two", "three"), no_answer_key="toy")


@scale.check("x times the box's factor", cases=[dict(k=2.0), dict(k=3.0), dict(k=5.0)], tol=TOL)
def _(case, g):
    with LOG.open("a") as log:
        log.write(f"{case['k']}\\n")
    SHARED.k = case["k"]
    x = torch.randn(4, generator=g)
    counter = Counter()

    def once(out):
        if counter.calls != 1:
            raise KataFailure(f"the counter was ticked {counter.calls} times, once is right")

    return Scenario(inputs=dict(box=SHARED, x=x, counter=counter), expected=x * case["k"], verify=once)


@scale.trap("added the factor", hint="Scale is a product.")
def _(box, x, counter):
    return x + box.k
'''


def _kept_course(toy, body: str):
    root = toy.pytester.path
    (root / "graders" / "01_toy.py").write_text(KEPT_GRADER)
    (root / "katas" / "01_toy.py").write_text(
        '"""Lab 01 · Toy lab"""\nimport torch\n\n\ndef scale(box, x, counter):\n'
        + textwrap.indent(textwrap.dedent(body).strip(), "    ") + "\n")
    return root / "builds.log"


def _builds(log) -> list[str]:
    return log.read_text().split() if log.exists() else []


def test_a_warm_process_builds_each_case_once_and_grades_every_save_against_what_it_built(toy):
    log = _kept_course(toy, "counter()\nreturn x * box.k")
    args = ("katas", "-p", "no:cacheprovider", "--kata-seed", "7", "--kata-reuse-builds")
    toy.pytester.inline_run(*args).assertoutcome(passed=1)
    assert _builds(log) == ["2.0", "3.0", "5.0"]
    # the kept inputs are the inputs as built (the shared box holds 5.0 now, each case gets its own factor
    # back) and the probe starts from what it held after the build (ticked once per grading, not once more)
    toy.pytester.inline_run(*args).assertoutcome(passed=1)
    assert _builds(log) == ["2.0", "3.0", "5.0"]
    _kept_course(toy, "counter()\nreturn x + box.k")
    result = toy.pytester.runpytest(*args)
    result.stdout.fnmatch_lines(["*trap: added the factor*"])
    assert _builds(log) == ["2.0", "3.0", "5.0"]


def test_without_the_option_every_grading_builds_its_cases_again(toy):
    log = _kept_course(toy, "counter()\nreturn x * box.k")
    for _ in range(2):
        toy.pytester.inline_run("katas", "-p", "no:cacheprovider", "--kata-seed", "7").assertoutcome(passed=1)
    assert _builds(log) == ["2.0", "3.0", "5.0"] * 2


def test_a_learner_drawing_from_the_global_rng_changes_nothing_the_grader_builds(toy):
    log = _kept_course(toy, "counter()\nreturn x * box.k")
    args = ("katas", "-p", "no:cacheprovider", "--kata-seed", "7", "--kata-reuse-builds")
    toy.pytester.inline_run(*args).assertoutcome(passed=1)
    # the call starts from a global RNG state of fresh entropy and the grader's own goes on as if it had not
    # happened: the kept builds of cases 2 and 3 are still the ones this seed builds
    _kept_course(toy, "counter()\ntorch.randn(3)\nreturn x * box.k")
    toy.pytester.inline_run(*args).assertoutcome(passed=1)
    assert _builds(log) == ["2.0", "3.0", "5.0"]


def test_the_runners_warm_parent_imports_the_library_modules_a_file_names_and_nothing_else(tmp_path, monkeypatch):
    import sys

    from diffusion_katas.engine import runner_main

    (tmp_path / "not_a_library.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    named = tmp_path / "grader.py"
    named.write_text(
        "import not_a_library\n"
        "ANSWER = ('diffusers.schedulers.scheduling_sasolver.SASolverScheduler.step',)\n"
        "def build():\n"
        "    from diffusers.schedulers.scheduling_tcd import TCDScheduler\n")
    for name in ("diffusers.schedulers.scheduling_sasolver", "diffusers.schedulers.scheduling_tcd"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    runner_main.warm_imports(str(named))
    # an answer-key path's module and an import inside a function: each runner forked after this has them,
    # instead of importing them itself after its fork, once per check
    assert "diffusers.schedulers.scheduling_sasolver" in sys.modules
    assert "diffusers.schedulers.scheduling_tcd" in sys.modules
    assert "not_a_library" not in sys.modules and not (tmp_path / "ran").exists()  # read, never run


# ---- a TODO stub is TODO before anything is built for it -----------------------------------------------------
@pytest.mark.parametrize("body", ["raise NotImplementedError", 'raise NotImplementedError("write it")'])
def test_an_untouched_todo_stub_is_todo_without_building_a_reference(toy, body):
    log = _kept_course(toy, body)
    result = toy.pytester.runpytest("katas", "-p", "no:cacheprovider", "--kata-seed", "7")
    result.stdout.fnmatch_lines(["*1 todo*"])
    assert _builds(log) == []


@pytest.mark.parametrize("top, body", [
    ("", "counter()\nraise NotImplementedError"),  # does something first
    ("NotImplementedError = ValueError\n", "raise NotImplementedError"),  # not the builtin one
])
def test_a_function_that_is_not_only_the_stub_is_graded_as_it_runs(toy, top, body):
    log = _kept_course(toy, body)
    kata = toy.pytester.path / "katas" / "01_toy.py"
    kata.write_text(kata.read_text().replace("import torch\n", "import torch\n" + top, 1))
    toy.pytester.runpytest("katas", "-p", "no:cacheprovider", "--kata-seed", "7")
    assert _builds(log) == ["2.0"]  # built, then called: its own raise decides the verdict


def test_a_warm_parent_that_ended_unnoticed_is_replaced_and_the_checks_still_run(toy, monkeypatch):
    # Killed between two gradings (out of memory, say) and not yet reaped: the next runner finds its pipe broken,
    # starts another warm parent once, and the grading goes on.
    from diffusion_katas.engine.runner import Zygote

    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    assert toy.run("katas").ret == 0
    dead = Zygote.shared()
    dead.process.kill()
    dead.process.wait()
    monkeypatch.setattr(dead.process, "poll", lambda: None)  # it still looks alive
    assert toy.run("katas").ret == 0
    assert Zygote.shared() is not dead and Zygote.shared().process.returncode is None
