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


def test_a_runner_that_has_ended_counts_as_ended_for_emptying_the_scratch_folder_and_still_says_how_it_ended():
    import os
    import signal
    import time

    from diffusion_katas.engine.runner_main import _none_running

    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    try:
        assert not _none_running({pid})  # alive: the folder it may be writing to stays
        os.kill(pid, signal.SIGKILL)
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(0.01)
        assert _none_running({pid})
    finally:
        if not _none_running({pid}):
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)  # not reaped by the check: the grader's `wait` still reads how it ended
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL



def test_a_fork_is_not_waited_for_and_its_pid_is_read_before_the_next_command(tmp_path, monkeypatch):
    from diffusion_katas.engine.runner import Zygote

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    parent = Zygote()
    try:
        first, first_sock = parent.fork()
        assert len(parent._forked) == 1  # sent; its answer not read yet
        second, second_sock = parent.fork()  # the first one's pid read before this was sent
        assert len(parent._forked) == 1
        assert parent._command({"op": "forget", "pid": 2**22 + 1}) == "ok"  # the second's read before this one
        assert not parent._forked
        assert 0 < first.pid != second.pid > 0
        for forked, sock in ((first, first_sock), (second, second_sock)):
            sock.close()  # a runner whose grader went away before opening anything ends
            assert parent._command({"op": "wait", "pid": forked.pid}).startswith("exit ")
    finally:
        parent.close()
