"""Budgets: judged once correct, 'over budget' as its own outcome, measured against allowed."""
import pytest


def test_a_correct_and_cheap_function_passes_its_budget(toy):
    toy.kata(double="return x * 2")
    result = toy.run("katas", "-m", "budget", "-v")
    result.stdout.fnmatch_lines(["*double?budget: one output-sized allocation? PASSED*"])


def test_a_correct_but_costly_function_is_over_budget_with_measured_and_allowed(toy):
    toy.kata(double="y = x + x\nreturn y * 1")
    result = toy.run("katas", "-m", "budget", "-v")
    result.stdout.fnmatch_lines([
        "*double?budget: one output-sized allocation? OVER BUDGET*",
        "*double · budget 'one output-sized allocation': correct, but over budget*",
        "*OVER peak live tensor bytes: measured 7.81 KiB, allowed 3.91 KiB (2.00x the allowance)*",
        "*allowance: the output alone: 4000 bytes*",
        "*1 over budget*",
    ])
    assert result.ret == 1


def test_a_budget_is_not_judged_until_the_function_is_correct(toy):
    toy.kata(double="return x * 3")
    result = toy.run("katas", "-m", "budget")
    result.stdout.fnmatch_lines(["*budget 'one output-sized allocation' of `double` is judged once `double` is "
                                 "correct; it fails check 'vs toyref.double' (see why with: *"])
    assert result.parseoutcomes() == {"waiting": 1, "deselected": 3}
    assert result.ret == 1


COUNTING = """
print("KATA-CALL")  # what the learner's code prints comes back with the check (-s shows it)
return x * 3
"""


def test_a_budget_of_a_wrong_function_waits_in_one_line_without_running_the_failing_check_again(toy):
    toy.kata(double=COUNTING)
    result = toy.run("katas", "-k", "double", "-p", "no:cacheprovider", "-s")
    out = result.stdout.str()
    assert result.parseoutcomes()["waiting"] == 1 and result.parseoutcomes()["failed"] == 1
    waiting = [line for line in out.splitlines() if "is judged once `double` is correct" in line]
    assert len(waiting) == 1 and "its failure is shown above" in waiting[0]
    assert "FAILED katas/01_toy.py::double[budget" not in out
    # the check failed on its first case; the budget called nothing (no second run, no second time-out)
    assert out.count("KATA-CALL") == 1


def test_budgets_selected_alone_run_their_functions_checks_once(toy):
    toy.kata(double=COUNTING)
    result = toy.run("katas", "-m", "budget", "-p", "no:cacheprovider", "-s")
    assert result.stdout.str().count("KATA-CALL") == 1


def test_the_progress_line_names_what_a_selection_left_out(toy):
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*1/1 *#  (of the lab's 3 functions: 2 not graded in this run)*",
                                 "*not graded in this run (deselected): 2 function(s) (`normalize`, `stay_put`)*",
                                 "*every graded check passes.*"])
    assert "every visible check passes" not in result.stdout.str()


def test_a_whole_lab_graded_has_no_note_on_its_progress_row(toy):
    toy.kata(double="return x * 2", normalize="return x / x.norm()", stay_put="return x")
    result = toy.run("katas")
    assert "not graded in this run" not in result.stdout.str()


def test_an_untouched_function_shows_its_budget_as_todo(toy):
    result = toy.run("katas", "-m", "budget")
    result.stdout.fnmatch_lines(["*1 todo*"])


def test_copying_the_inputs_is_not_charged_to_the_learner(toy):
    toy.kata(double="return x * 2")
    result = toy.run("katas", "-m", "budget")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("meter", ["peak_bytes", "flops"])
def test_the_deterministic_meters_give_the_same_figure_every_time(meter):
    import torch

    from diffusion_katas.engine import meters as budgets

    x = torch.randn(64, 64)
    fn = lambda: (x @ x).relu() @ x  # noqa: E731
    first = getattr(budgets, meter)(fn)[0]
    assert first > 0
    assert all(getattr(budgets, meter)(fn)[0] == first for _ in range(3))


def test_peak_bytes_counts_live_tensors_not_everything_ever_allocated():
    import torch

    from diffusion_katas.engine.meters import peak_bytes

    x = torch.randn(1024)  # 4 KiB, made before: not counted

    def two_at_a_time():
        a = x * 2
        for _ in range(5):
            a = a * 2  # the old `a` dies as the new one is made: two alive at most
        return a

    assert peak_bytes(two_at_a_time)[0] == 2 * x.nbytes


def test_verbose_runs_show_how_close_each_passing_budget_came_to_its_allowance(toy):
    toy.kata(double="return x * 2")
    result = toy.run("katas", "-m", "budget", "-v")
    result.stdout.fnmatch_lines(["*= budgets: measured of allowed =*",
                                 "*double · one output-sized allocation: peak live tensor bytes: * of * (*x)*"])
    assert "measured of allowed" not in toy.run("katas", "-m", "budget").stdout.str()


class _SimulatedGpu:
    """One CUDA stream on a simulated clock: the CPU spends `launch` seconds queueing each kernel, the GPU runs
    them in order, each from when it is queued or the one before it ends, whichever is later."""

    def __init__(self, launch: float, kernel: float):
        self.launch, self.kernel = launch, kernel
        self.cpu = 0.0  # what time.perf_counter reads
        self.gpu_free = 0.0  # when the GPU finishes what is queued

    def _queue(self, seconds: float) -> float:
        self.cpu += self.launch
        self.gpu_free = max(self.gpu_free, self.cpu) + seconds
        return self.gpu_free

    def work(self, kernels: int):
        for _ in range(kernels):
            self._queue(self.kernel)

    def patch(self, monkeypatch):
        import time

        import torch

        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = gpu.gpu_free if gpu.gpu_free > gpu.cpu else gpu.cpu

            def elapsed_time(self, end):
                return (end.at - self.at) * 1000

        def synchronize():
            gpu.cpu = max(gpu.cpu, gpu.gpu_free)

        def sleep(cycles):
            gpu._queue(cycles / 1e9)  # a 1 GHz spin

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
        monkeypatch.setattr(torch.cuda, "_sleep", sleep)
        monkeypatch.setattr(time, "perf_counter", lambda: gpu.cpu)
        from diffusion_katas.engine import meters

        monkeypatch.setattr(meters, "_SPIN_RATE", [])


@pytest.mark.parametrize("launch_us", [5, 30, 60])
def test_gpu_time_is_the_kernels_own_however_slowly_the_cpu_queues_them(monkeypatch, launch_us):
    # 290 launches of 36 µs kernels (lab 11's chunked attention, 16 blocks): with 30 or 60 µs of Python per launch
    # (the answer-key lock's modes in a runner) the CPU, not the GPU, would set a time taken around the launches
    from diffusion_katas.engine.meters import cuda_time_ms

    gpu = _SimulatedGpu(launch=launch_us * 1e-6, kernel=36e-6)
    gpu.patch(monkeypatch)
    measured = cuda_time_ms(lambda: gpu.work(290))
    assert measured == pytest.approx(290 * 36e-3, rel=0.01)


def test_gpu_time_without_a_spin_kernel_is_timed_around_the_launches_as_before(monkeypatch):
    import torch

    from diffusion_katas.engine.meters import cuda_time_ms

    gpu = _SimulatedGpu(launch=60e-6, kernel=36e-6)
    gpu.patch(monkeypatch)
    monkeypatch.delattr(torch.cuda, "_sleep")
    assert cuda_time_ms(lambda: gpu.work(290)) == pytest.approx(290 * 60e-3, rel=0.01)
