"""The runners' warm parent: graders it is asked to load while pytest still collects (one request at a time on its
stream socket) never leave a grading waiting for an answer that cannot come."""
import shutil


def test_a_run_of_several_labs_grades_them_all_while_the_warm_parent_loads_their_graders(toy):
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    root = toy.pytester.path
    for n in ("02", "03", "04"):  # the same toy lab under other numbers: four graders collected back to back
        shutil.copy(root / "graders" / "01_toy.py", root / "graders" / f"{n}_toy.py")
        shutil.copy(root / "solutions" / "01_toy.py", root / "solutions" / f"{n}_toy.py")
        shutil.copy(root / "katas" / "01_toy.py", root / "katas" / f"{n}_toy.py")
    result = toy.pytester.runpytest_subprocess("katas", "-m", "not budget", "--kata-no-warm", timeout=240)
    result.assert_outcomes(passed=4 * 3, deselected=4)


def test_the_warm_parent_removes_its_scratch_folder_and_ends_when_the_grader_closes_it(tmp_path, monkeypatch):
    from diffusion_katas.engine.runner import Zygote

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the runners' scratch folder is made there (runner_environment)
    parent = Zygote()
    try:
        assert parent._command({"op": "forget", "pid": -1}) == "ok"  # up, its folder made
        assert [p.name[:13] for p in tmp_path.iterdir()] == ["kata-runners-"]
    finally:
        parent.close()
    assert parent.process.returncode == 0
    assert list(tmp_path.iterdir()) == []
