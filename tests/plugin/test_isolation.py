"""Learner code runs in a runner process of its own: it cannot reach the grader, and every way a call can
end is a verdict while the run goes on (the toy project, no diffusers)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest


def test_reading_the_expected_value_through_gc_or_frames_is_refused_and_finds_nothing_anyway(toy):
    toy.kata(double="""
        import gc
        for o in gc.get_objects():
            if type(o).__name__ == "Scenario":
                return o.expected
        return x
    """, normalize="""
        import inspect
        frame = inspect.currentframe().f_back
        while frame is not None:
            for value in frame.f_locals.values():
                if type(value).__name__ == "Scenario":
                    return value.expected
            frame = frame.f_back
        return x
    """, stay_put="""
        try:
            import gc, sys
            for o in gc.get_objects():
                assert type(o).__name__ != "Scenario", "the expected value is in the runner"
        except PermissionError:
            pass
        return x
    """)
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*raised Refused: graded code cannot walk the interpreter's objects (gc.get_objects)*"])
    result.stdout.fnmatch_lines(["*raised Refused: graded code cannot take frames (sys._getframe)*"])
    result.assert_outcomes(passed=1, failed=2)  # stay_put: refused, caught, and there was nothing to find


def test_a_patch_of_the_comparison_does_not_change_the_verdict(toy):
    toy.kata(double="""
        import diffusion_katas.engine.comparison as comparison
        comparison.mismatch = lambda *args, **kwargs: ""
        comparison.matches = lambda *args, **kwargs: True
        return x
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*output values differ*"])
    result.assert_outcomes(failed=1)
    assert result.parseoutcomes()["waiting"] == 1  # double's budget waits on its failing check


def test_a_patch_of_torch_in_one_function_does_not_reach_the_next_check(toy):
    toy.kata(double="""
        torch.Tensor.norm = lambda self, *args, **kwargs: torch.tensor(1.0)
        torch.sqrt = lambda t: t
        return x * 2
    """, normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas")
    result.assert_outcomes(passed=4, failed=0)


def test_keyboard_interrupt_and_system_exit_in_learner_code_are_verdicts_and_the_run_goes_on(toy):
    toy.kata(double="raise KeyboardInterrupt", normalize="raise SystemExit(0)", stay_put="return x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*your function raised KeyboardInterrupt*"])
    result.stdout.fnmatch_lines(["*your function raised SystemExit*"])
    result.assert_outcomes(passed=1, failed=2)
    assert result.parseoutcomes()["waiting"] == 1  # double's budget waits on its failing check
    assert "interrupted" not in result.stdout.str()


def test_os_exit_and_a_segfault_end_only_the_runner(toy):
    toy.kata(double="import os\nos._exit(0)", normalize="import faulthandler\nfaulthandler._sigsegv()",
             stay_put="return x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*ended without answering (it exited with status 0)*"])
    result.stdout.fnmatch_lines(["*ended without answering (killed by signal 11 (SIGSEGV))*"])
    result.assert_outcomes(passed=1, failed=2)
    assert result.parseoutcomes()["waiting"] == 1  # double's budget waits on its failing check
    assert result.ret == 1


def test_a_runner_terminated_by_its_own_code_dies_of_the_signal_and_the_next_check_still_runs(toy):
    toy.kata(double="import os, signal\nos.kill(os.getpid(), signal.SIGTERM)", stay_put="return x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*ended without answering (killed by signal 15 (SIGTERM))*"])
    assert result.parseoutcomes()["passed"] == 1  # stay_put, graded after it in a runner of its own


def test_code_that_exits_at_import_fails_each_function_with_the_reason(toy):
    (toy.pytester.path / "katas" / "01_toy.py").write_text(
        '"""Lab 01 · Toy lab"""\nimport os\nos._exit(0)\n')
    result = toy.run("katas/01_toy.py")
    result.stdout.fnmatch_lines(["*importing katas/01_toy.py ended the process that imports it (it exited with status 0)*"])
    result.assert_outcomes(failed=4)  # the budget fails with the file
    assert result.ret == 1


def test_a_syntax_error_named_on_the_command_line_is_graded_not_a_collection_error(toy):
    (toy.pytester.path / "katas" / "01_toy.py").write_text('"""Lab 01 · Toy lab"""\ndef double(x:\n')
    result = toy.run("katas/01_toy.py")
    result.stdout.fnmatch_lines(["*katas/01_toy.py does not parse*line 2*"])
    result.assert_outcomes(failed=4, errors=0)  # the budget fails with the file


def test_a_flood_of_output_is_captured_and_capped(toy):
    toy.kata(stay_put="print('x' * 5_000_000)\nreturn x")
    result = toy.run("katas", "--kata-function", "stay_put", "-rA")
    result.assert_outcomes(passed=1)
    assert "output capped" in result.stdout.str()
    assert len(result.stdout.str()) < 100_000


def test_the_answer_key_is_closed_by_code_captured_references_and_siblings_included(toy):
    toy.kata(double="""
        return toyref.twice(x)
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*`double` called toyref.double, which is the answer key*"])
    toy.kata(double="""
        import importlib.util
        spec = importlib.util.spec_from_file_location("toyref_copy", toyref.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        return copy.double(x)
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*`double` called toyref.double, which is the answer key*"])


def test_a_captured_reference_to_the_answer_key_is_refused(toy):
    path = toy.pytester.path / "katas" / "01_toy.py"
    path.write_text('"""Lab 01 · Toy lab"""\nimport torch\nimport toyref\n\n'
                    "def double(x, _answer=toyref.double):\n    return _answer(x)\n\n"
                    "def normalize(x):\n    raise NotImplementedError\n\n"
                    "def stay_put(x):\n    raise NotImplementedError\n")
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*is the answer key this kata is graded against*"])
    result.assert_outcomes(failed=1)
    assert result.parseoutcomes()["waiting"] == 1  # double's budget waits on its failing check


def test_catching_the_refusal_and_going_on_still_fails(toy):
    toy.kata(double="""
        try:
            return toyref.double(x)
        except Exception:
            return toyref.double(x)
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*is the answer key this kata is graded against*"])


def test_a_missing_kata_file_is_graded_as_missing_never_dropped(toy):
    (toy.pytester.path / "katas" / "01_toy.py").unlink()
    result = toy.run("katas", "--kata-json", "report.json")
    result.stdout.fnmatch_lines(["*katas/01_toy.py is missing*"])
    result.assert_outcomes(failed=4)  # a missing file fails the budget too: nothing to wait for
    report = json.loads((toy.pytester.path / "report.json").read_text())
    assert {r["reason"] for r in report["results"]} == {"missing file"}


def test_hidden_checks_run_after_every_visible_one(toy):
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas", "--kata-hidden-seed", "5", "-v")
    lines = [line for line in result.stdout.lines if "PASSED" in line]
    first_hidden = next(i for i, line in enumerate(lines) if "hidden" in line)
    assert all("hidden" in line for line in lines[first_hidden:])


def test_an_interrupted_run_says_so_in_its_summary_and_its_report(toy):
    toy.kata(double="import time\ntime.sleep(60)\nreturn x * 2")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # SIGINT may be ignored in a test runner started in the background; the learner's shell has it.
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "katas", "--kata-json", "report.json", "-p",
                             "no:cacheprovider"], cwd=toy.pytester.path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = ""
    while "katas/01_toy.py" not in seen:  # grading has begun: the first kata file's line is out
        seen += proc.stdout.read(1)
    time.sleep(2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    out = seen + out
    assert proc.returncode == 2, out
    assert "the run was interrupted" in out and "every visible check passes" not in out
    report = json.loads((toy.pytester.path / "report.json").read_text())
    assert report["interrupted"] is True


# Graded code runs alone (engine/alone.py): work in another thread or process escapes the meters, the refused
# operators and the lock, so a correct-valued function that hides its cost there must not pass its budget.
WASTE = "junk = [torch.ones(1000) for _ in range(50)]"  # 50x the budget's one output-sized allocation


def test_a_thread_started_in_a_graded_call_is_refused_even_when_the_refusal_is_caught(toy):
    toy.kata(double=f"""
        import threading
        out = []
        def work():
            {WASTE}
            out.append(x * 2)
        try:
            worker = threading.Thread(target=work)
            worker.start()
            worker.join()
        except RuntimeError:
            work()
        return out[0]
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*`double` started a thread. Graded code runs in the thread that calls it*"])
    result.assert_outcomes(failed=1)  # the values are right, and the budget never counts what the thread did


def test_a_correct_valued_twin_that_hides_its_cost_in_a_thread_pool_is_not_under_budget(toy):
    toy.kata(double=f"""
        from concurrent.futures import ThreadPoolExecutor
        def work():
            {WASTE}
            return x * 2
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(work).result()
    """)
    result = toy.run("katas", "--kata-function", "double", "--kata-json", "report.json")
    result.stdout.fnmatch_lines(["*started a thread*"])
    report = json.loads((toy.pytester.path / "report.json").read_text())
    assert not any(r["status"] == "passed" for r in report["results"] if r["function"] == "double")


def test_a_thread_started_at_import_is_refused_there(toy):
    path = toy.pytester.path / "katas" / "01_toy.py"
    path.write_text('"""Lab 01 · Toy lab"""\nimport queue, threading\nimport torch\n\n'
                    "jobs, answers = queue.Queue(), queue.Queue()\n\n"
                    "def _serve():\n"
                    "    while True:\n"
                    "        x = jobs.get()\n"
                    "        answers.put(x * 2)  # work the call's meters would never see\n\n"
                    "threading.Thread(target=_serve, daemon=True).start()\n\n"
                    "def double(x):\n    jobs.put(x)\n    return answers.get()\n\n"
                    "def normalize(x):\n    return x / x.norm()\n\n"
                    "def stay_put(x):\n    return x\n")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*importing katas/01_toy.py failed at line 12: NotAlone: the kata file, at import, "
                                 "started a thread*"])
    result.assert_outcomes(failed=4)  # an import error: the budget fails with the file


def test_graded_code_cannot_start_a_process_in_a_call_or_at_import(toy):
    toy.kata(double="""
        import subprocess, sys
        answer = subprocess.run([sys.executable, "-c", "print(2)"], capture_output=True, text=True)
        return x * int(answer.stdout)
    """, normalize="""
        import os
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        return x / x.norm()
    """, stay_put="return x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*Operation not permitted*graded code cannot start processes*"])
    result.assert_outcomes(passed=1, failed=2)
    path = toy.pytester.path / "katas" / "01_toy.py"
    path.write_text("import os\nif os.fork() == 0:\n    os._exit(0)\n" + path.read_text())
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*graded code cannot start processes*"])
    result.assert_outcomes(failed=4)  # an import error: the budget fails with the file


# A remote model (a grader class marked `kata_remote`, as DenoiserProbe is) runs in the grader's process: the
# runner gets a stand-in, so the model cannot be called uncounted and its counts cannot be rewritten.
REMOTE_GRADER = '''
import torch

from diffusion_katas.core.spec import Kata, KataFailure, Measurement, Scenario
from diffusion_katas.core.tolerances import Tol


class Counted:
    """x ↦ 2x, counting its calls; a second call in one check is a failure."""

    kata_remote = True

    def __init__(self):
        self.calls = 0
        self.scale = 2.0

    def remote_view(self):
        return dict(label="Counted(x -> 2x; calls counted)", config={"scale": 2.0})

    def __call__(self, x):
        self.calls += 1
        if self.calls > 1:
            raise KataFailure(f"  the model was called {self.calls} times; one call is the lesson")
        return x * self.scale


apply = Kata("apply", hints=("call it once",), no_answer_key="a toy")


@apply.check("one call", tol=Tol(1e-6, 0.0, "toy"))
def _(case, g):
    x = torch.randn(3, generator=g)
    return Scenario(inputs=dict(model=Counted(), x=x), expected=x * 2)


@apply.budget("one call")
def _(learner, g):
    model = Counted()
    learner(model=model, x=torch.randn(3, generator=g))
    return [Measurement("model calls", model.calls, 1, "calls", "one call")]
'''


def _remote_lab(toy, body: str) -> None:
    import textwrap

    (toy.pytester.path / "graders" / "02_remote.py").write_text(REMOTE_GRADER)
    body = textwrap.indent(textwrap.dedent(body).strip(), "    ")
    (toy.pytester.path / "katas" / "02_remote.py").write_text(
        f'"""Lab 02 · Remote"""\nimport gc\nimport torch\n\n\ndef apply(model, x):\n{body}\n')


def test_a_remote_model_is_called_from_the_runner_and_counted_in_the_grader(toy):
    _remote_lab(toy, "assert model.scale == 2.0 and 'Counted' in repr(model)\nreturn model(x)")
    result = toy.run("katas/02_remote.py")
    result.assert_outcomes(passed=2)


def test_a_remote_model_cannot_be_reached_around_its_count(toy):
    _remote_lab(toy, """
        try:
            found = [o for o in gc.get_objects() if type(o).__name__ == "Counted"]
            assert not found, "the grader's model is here, to be called uncounted"
        except PermissionError:  # the sandbox refuses the walk; there would be nothing to find anyway
            pass
        assert not hasattr(model, "calls")  # the stand-in holds no count to read or rewrite
        return model(x)
    """)
    result = toy.run("katas/02_remote.py")
    result.assert_outcomes(passed=2)


def test_a_remote_model_refuses_inputs_far_beyond_its_size_and_the_run_goes_on(toy):
    _remote_lab(toy, """
        try:
            model(torch.zeros(2**23))  # 32 MiB for the grader's process to take in
        except ValueError as exc:
            assert "MiB of tensors in one call" in str(exc), exc
        return model(x)  # the refused call was not counted: this one is the first
    """)
    result = toy.run("katas/02_remote.py")
    result.assert_outcomes(passed=2)


def test_a_remote_models_own_check_fails_the_call_even_when_the_learner_catches_it(toy):
    _remote_lab(toy, """
        model.calls = 0  # a write to the stand-in: the grader's count is not here
        first = model(x)
        try:
            model(x)
        except Exception:
            pass
        return first
    """)
    result = toy.run("katas/02_remote.py")
    result.stdout.fnmatch_lines(["*the model was called 2 times; one call is the lesson*"])
    result.assert_outcomes(failed=1)


def test_a_memory_blow_up_fails_its_check_and_the_run_goes_on(toy):
    toy.kata(double="""
        held = [torch.ones(2**26) for _ in range(8)]  # 2 GiB, 256 MiB at a time
        return x * 2
    """, normalize="held = b'x' * 2**31\nreturn x / x.norm()", stay_put="return x")
    result = toy.run("katas", "--kata-memory", "0.5")
    result.stdout.fnmatch_lines(["*can't allocate memory*the runner's memory limit: 0.5 GiB beyond its own*"])
    result.stdout.fnmatch_lines(["*your function raised MemoryError*"])
    result.assert_outcomes(passed=1, failed=2)


def test_numpy_in_a_learners_function_is_no_work_in_another_thread(toy):
    toy.kata(double="""
        import numpy as np
        a = np.random.rand(600, 600)
        for _ in range(5):
            a = np.tanh(a @ a)  # BLAS: threaded by default, one thread in the runner
        return x * 2
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.assert_outcomes(passed=2)


def test_a_memory_limit_that_is_no_number_or_not_positive_is_a_usage_error(toy):
    result = toy.run("katas", "--kata-memory", "0")
    result.stderr.fnmatch_lines(["*--kata-memory takes a positive number of GiB, got 0*"])
    assert result.ret == 4
    toy.pytester.makeini("[pytest]\nkata_graders_dir = graders\nkata_memory = lots\n")
    result = toy.run("katas")
    result.stderr.fnmatch_lines(["*kata_memory must be a number of GiB, got 'lots' from the config file*"])
    assert result.ret == 4


def test_switching_off_torchs_modes_in_a_call_fails_it_and_printing_a_tensor_does_not(toy):
    toy.kata(double="""
        from torch.utils._python_dispatch import _disable_current_modes
        print(x)  # torch's own printing switches the modes off for itself: allowed
        with _disable_current_modes():  # the meters and the refused operators, gone for what runs here
            junk = [torch.ones(1000) for _ in range(50)]
            return x * 2
    """, normalize="torch._C._pop_torch_dispatch_stack()\nreturn x / x.norm()", stay_put="print(x)\nreturn x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*`double` switched off torch's dispatch modes (_disable_current_modes)*"])
    result.assert_outcomes(passed=1, failed=2)


def test_the_rng_state_a_call_gets_is_fresh_entropy_and_torch_threads_are_reset(toy):
    import zlib

    path = toy.pytester.path / "katas" / "01_toy.py"
    toy.kata(double="print('SEEN', torch.initial_seed(), torch.randn(1).item())\n"
                    "assert torch.get_num_threads() == 1, torch.get_num_threads()\nreturn x * 2")
    path.write_text(path.read_text().replace("import toyref\n", "import toyref\ntorch.set_num_threads(2)\n", 1))
    result = toy.run("katas", "--kata-function", "double", "--kata-seed", "7", "-s")
    result.assert_outcomes(passed=2)
    seen = [line.split("SEEN", 1)[1].split() for line in result.stdout.lines if "SEEN" in line]
    check_seed = (7 + zlib.crc32(b"01_toy:double:vs toyref.double")) % 2**31
    assert len(seen) >= 3 and len({s for s, _ in seen}) == len(seen), seen  # a new state for every call
    assert not {int(s) for s, _ in seen} & {7, check_seed, check_seed ^ 0x5EED}


def test_shared_memory_counts_against_the_memory_limit(toy):
    toy.kata(double="""
        import mmap, os
        views = []
        for _ in range(32):  # 32 x 48 MiB of shared memory (each file under the runner's 64 MiB file cap)
            fd = os.memfd_create("kata-test-blow-up")
            os.ftruncate(fd, 48 * 2**20)
            views.append(mmap.mmap(fd, 48 * 2**20, mmap.MAP_SHARED))  # not the data segment: the address space
        return x * 2
    """)
    result = toy.run("katas", "--kata-function", "double", "--kata-memory", "0.5")
    result.stdout.fnmatch_lines(["*Cannot allocate memory (the runner's memory limit: 0.5 GiB beyond its own*"])
    result.assert_outcomes(failed=1)


def _lab_02(toy, grader: str, body: str) -> None:
    """A second toy lab: `grader` as graders/02_remote.py, and katas/02_remote.py's apply(model, x) with `body`."""
    (toy.pytester.path / "graders" / "02_remote.py").write_text(grader)
    (toy.pytester.path / "katas" / "02_remote.py").write_text(
        f'"""Lab 02 · Remote"""\n\n\ndef apply(model, x):\n    {body}\n')


# A check whose inputs the runner cannot rebuild (a GPU's tensors where CUDA does not start there, say): the
# runner's failure, said as such, before any learner code ran; never a crash of the learner's function.
def identity_grader(classes: str, model: str) -> str:
    """A toy lab-02 grader: one identity check whose `model` input is an instance of `model`, defined in `classes`
    (an input that breaks the grader's own work around the call)."""
    return ("import torch\n\nfrom diffusion_katas.core.spec import Kata, Scenario\n"
            "from diffusion_katas.core.tolerances import Tol\n\n" + classes + textwrap.dedent(f"""

        apply = Kata("apply", hints=("return x",), no_answer_key="a toy")


        @apply.check("identity", tol=Tol(1e-6, 0.0, "toy"))
        def _(case, g):
            x = torch.randn(3, generator=g)
            return Scenario(inputs=dict(model={model}(), x=x), expected=x)
        """))


UNLOADABLE_GRADER = identity_grader('''
def _refuse_here():
    raise RuntimeError("this input cannot be rebuilt in a runner")


class Unloadable:
    def __reduce__(self):
        return (_refuse_here, ())
''', "Unloadable")


def test_inputs_the_runner_cannot_load_are_the_runners_failure_not_the_learners(toy):
    _lab_02(toy, UNLOADABLE_GRADER, "return x")
    result = toy.run("katas/02_remote.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the check's inputs could not be loaded in the runner: RuntimeError: this input "
                                 "cannot be rebuilt in a runner*"])
    assert "the process running your function ended" not in result.stdout.str()


def test_runners_ask_nvml_whether_cuda_exists_so_a_fork_can_still_start_it(monkeypatch):
    # A CUDA driver started in the warm parent (torch.cuda.is_available() at an import) cannot be used in a runner
    # forked from it: "Cannot re-initialize CUDA in forked subprocess", seen on an H100 (docs/gpu-budgets.md).
    from diffusion_katas.engine.runner import runner_environment

    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert runner_environment()["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")  # an explicit choice is kept
    assert runner_environment()["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"


CUDA_GRADER = '''
import pytest
import torch

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import Tol

apply = Kata("apply", hints=("return 2x",), no_answer_key="a toy")


@apply.check("on the GPU", tol=Tol(1e-6, 0.0, "toy"), marks=(pytest.mark.cuda,))
def _(case, g):
    x = torch.randn(3, generator=g).to("cuda")
    return Scenario(inputs=dict(model=None, x=x), expected=x * 2)
'''


@pytest.mark.cuda
def test_a_gpu_check_runs_in_a_sandboxed_runner_that_takes_cuda_tensors(toy):
    # The runner starts CUDA before its sandbox closes (the driver writes its threads' names under /proc, which
    # Landlock refuses), after a warm parent that never started it (engine/runner.py, engine/runner_main.py).
    _lab_02(toy, CUDA_GRADER, "assert x.is_cuda\n    return x * 2")
    result = toy.run("katas/02_remote.py", "-m", "cuda")
    result.assert_outcomes(passed=1)


def test_dicts_lists_and_plain_values_changed_in_place_are_named_not_only_tensors():
    import math

    import torch

    from diffusion_katas.engine.isolation import changed_inputs, fresh

    inputs = dict(cache={"residual": torch.ones(2), "step": 3, "done": False}, history=[torch.zeros(1), 0.5],
                  nan_entry={"x": math.nan}, scale=7.5)
    given, pristine = fresh(inputs), fresh(inputs)
    assert changed_inputs(given, pristine) == []  # untouched, NaN included
    given["cache"]["step"] = 4
    given["cache"]["extra"] = 1
    given["history"].append(torch.ones(1))
    assert changed_inputs(given, pristine) == ["cache", "history"]  # keys added / a list grown: the container
    given, pristine = fresh(inputs), fresh(inputs)
    given["cache"]["step"] = 4
    given["cache"]["residual"] = torch.zeros(2)  # replaced by another tensor with other values
    given["history"][1] = "half"
    assert changed_inputs(given, pristine) == ["cache['residual']", "cache['step']", "history[1]"]


UNCOPYABLE_GRADER = identity_grader('''
class Stateful:
    """Scheduler-shaped (the runner copies schedulers before each call), and its copy breaks."""

    config = {}

    def set_timesteps(self, n):
        pass

    def step(self, *args):
        pass

    def __deepcopy__(self, memo):
        raise RuntimeError("this scheduler cannot be copied")
''', "Stateful")


def test_the_graders_own_work_around_a_call_failing_is_never_the_learners_crash(toy):
    _lab_02(toy, UNCOPYABLE_GRADER, "return x")
    result = toy.run("katas/02_remote.py")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*the check's inputs could not be copied: RuntimeError: this scheduler cannot be "
                                 "copied*"])
    assert "your function raised" not in result.stdout.str()


def test_a_calls_inputs_go_to_the_runner_with_their_storages_as_bytes_and_come_back_equal():
    import io
    import pickle
    import pickletools

    import torch

    from diffusion_katas.engine.runner import Sent, _Outbound

    module = torch.nn.Linear(5, 3).to(torch.float16)
    x = torch.randn(4, 6)[:, 1:]  # a view: its storage offset and strides travel too
    buffer = io.BytesIO()
    _Outbound(buffer, {}).dump(dict(module=module, x=x, flags=torch.tensor([True, False])))
    names = {arg for op, arg, _ in pickletools.genops(buffer.getvalue()) if op.name in ("STACK_GLOBAL", "GLOBAL")
             or isinstance(arg, str)}
    assert "typed_storage" in names and "_load_from_bytes" not in names  # no torch.save file per storage
    back = Sent(buffer.getvalue(), {}).inputs()
    assert torch.equal(back["x"], x) and back["x"].stride() == x.stride()
    assert back["module"].weight.dtype == torch.float16 and torch.equal(back["module"].weight, module.weight)
    assert torch.equal(back["flags"], torch.tensor([True, False]))
    assert pickle.loads(buffer.getvalue())["x"].sum() == x.sum()  # a plain unpickler reads it, as the runner does
