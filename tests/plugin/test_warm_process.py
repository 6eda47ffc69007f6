"""What a warm grading process (`kata watch`) keeps between gradings, and what it hides from the collector.

Speed is measured by benchmarks/feedback.py; these tests pin the deterministic mechanisms behind it.
"""
import gc

import pytest

from diffusion_katas.core.course import Course

RECORDER = '''
import gc

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


def test_a_run_without_katas_freezes_nothing(pytester: pytest.Pytester):
    pytester.makeconftest(RECORDER)
    pytester.makepyfile(test_plain="def test_one():\n    assert True\n")
    recorder = pytester.inline_run("-p", "no:cacheprovider")
    conftest = next(p for p in recorder.getcalls("pytest_plugin_registered")
                    if getattr(p.plugin, "FREEZE", None) is not None).plugin
    assert conftest.FREEZE == [0]
