"""The garbage collector in a grading run: off while the graders import, and what each lab file's grading leaves
alive frozen before the next file (torch's, diffusers' and the graders' modules are walked by no full collection)."""
import shutil

CONFTEST = '''
import gc
import json
from pathlib import Path

KEPT = []  # objects the first lab's checks leave alive (as the modules a grader imports lazily would be)
SEEN = {"collecting": [], "running": [], "frozen_at_setup": {}}


def pytest_collect_file(file_path, parent):
    SEEN["collecting"].append(gc.isenabled())


def pytest_runtest_call(item):
    SEEN["running"].append(gc.isenabled())
    if not KEPT:
        KEPT.extend([[i] for i in range(50000)])  # lists: tracked by the collector (dicts of ints are not)


import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_setup(item):  # after the file's own setup (SetupState), before the check runs
    lab = item.path.stem
    SEEN["frozen_at_setup"].setdefault(lab, gc.get_freeze_count())


def pytest_sessionfinish(session):
    Path("gc.json").write_text(json.dumps(SEEN))
'''


def _second_lab(toy) -> None:
    root = toy.pytester.path
    for folder in ("graders", "solutions", "katas"):
        shutil.copy(root / folder / "01_toy.py", root / folder / "02_toy.py")


def test_the_graders_import_with_the_collector_off_and_it_is_on_again_for_the_checks(toy):
    import json

    toy.pytester.makeconftest(CONFTEST)
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
    seen = json.loads((toy.pytester.path / "gc.json").read_text())
    assert seen["collecting"] and not any(seen["collecting"])
    assert seen["running"] and all(seen["running"])
    import gc

    assert gc.isenabled()  # and on again in the process after the run


def test_what_a_lab_file_left_alive_is_frozen_before_the_next_file_is_graded(toy):
    import json

    _second_lab(toy)
    toy.pytester.makeconftest(CONFTEST)
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    (toy.pytester.path / "katas" / "02_toy.py").write_text((toy.pytester.path / "katas" / "01_toy.py").read_text())
    result = toy.run("katas", "-p", "no:cacheprovider")
    assert result.ret == 0, result.stdout.str()
    frozen = json.loads((toy.pytester.path / "gc.json").read_text())["frozen_at_setup"]
    assert frozen["02_toy"] >= frozen["01_toy"] + 50000  # the first lab's 50,000 kept objects, out of sight
