"""Graded code runs alone: in the thread the runner called it from, and in no process of its own making.

Work done anywhere else escapes what the runner watches: torch's dispatch modes (the meters, the refused
attention kernel) belong to one thread, the answer-key lock's profile function to the thread it was set in,
and a child process has none of them. So, in the runner (which is thrown away after its check):

- processes are refused by the kernel: the sandbox's seccomp filter (engine/sandbox.py), installed before the
  learner's file is imported, answers fork, vfork, execve and a clone without CLONE_THREAD with EPERM; threads
  stay allowed, as torch and CUDA start their own;
- starting a Python thread is refused: by the lock where it sees the call (`thread_starters`: a clear verdict),
  and by the sandbox's audit hook wherever else it comes from;
- and every learner call reads the CPU time the runner's other threads spent during it (`OtherThreads`): a
  thread of torch's that the learner's code kept busy outside the call's view is a verdict too.
"""
from __future__ import annotations

import time

# The CPU time other threads may spend during a learner's call before it counts as work done elsewhere.
# Where the runner has no other thread (torch at one thread, no CUDA) the two clocks differ only by the
# microseconds between their reads; the smallest work worth moving (one tiny denoiser call) takes milliseconds.
OTHER_CPU_S = 0.0005

_process_time = time.process_time  # bound before any learner code runs
_thread_time = time.thread_time


def thread_starters() -> list:
    """The C functions every Python thread is started by (refused by the lock while learner code runs)."""
    import _thread

    names = ("start_new_thread", "start_new", "start_joinable_thread")  # the last: Python 3.13+
    return [getattr(_thread, name) for name in names if hasattr(_thread, name)]


_WATCH: list = []  # decided by `watch_threads` before the learner's file is imported: learner code cannot turn it off


def watch_threads(threads: int) -> None:
    """Read other threads' time in this runner where torch grades with one thread (set before any learner code)."""
    _WATCH[:] = [threads == 1]


class OtherThreads:
    """CPU seconds the process's other threads spent between `start()` and `spent()` (exited ones included)."""

    def __init__(self):
        import torch

        # Only where no thread of torch's own works beside the caller: one intra-op thread (as the runner was
        # opened; a learner's torch.set_num_threads does not change it), and no CUDA.
        self.watching = bool(_WATCH and _WATCH[0]) and not torch.cuda.is_initialized()
        self._process = self._thread = 0.0

    def start(self) -> None:
        self._process = _process_time()
        self._thread = _thread_time()

    def spent(self) -> float:
        mine = _thread_time() - self._thread
        return (_process_time() - self._process) - mine if self.watching else 0.0
