"""Graded code runs alone: in the thread the runner called it from, and in no process of its own making.

Work done anywhere else escapes what the runner watches: torch's dispatch modes (the meters, the refused
attention kernel) belong to one thread, the answer-key lock's profile hook to the threads `threading`
starts, and a child process has none of them. So, in the runner (which is thrown away after its check):

- processes are refused by the kernel: a seccomp filter, installed before the learner's file is imported,
  answers fork, vfork, execve and a clone without CLONE_THREAD with EPERM (clone3, whose flags a filter
  cannot read, answers ENOSYS, and the C library falls back to clone); threads stay allowed, as torch and
  CUDA start their own;
- starting a thread is refused by the lock while learner code runs (`THREAD_STARTERS`: `threading.Thread`
  and `concurrent.futures` start theirs there);
- and every learner call reads the CPU time the runner's other threads spent during it (`OtherThreads`): a
  thread started at import, or in a way the lock does not see, that worked during the call is a verdict.
"""
from __future__ import annotations

import errno
import time

# The CPU time other threads may spend during a learner's call before it counts as work done elsewhere.
# Where the runner has no other thread (torch at one thread, no CUDA) the two clocks differ only by the
# microseconds between their reads; the smallest work worth moving (one tiny denoiser call) takes milliseconds.
OTHER_CPU_S = 0.0005

_process_time = time.process_time  # bound before any learner code runs
_thread_time = time.thread_time

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_*
_SYSCALLS = {  # clone, clone3, seccomp, and those refused outright
    "x86_64": dict(clone=56, clone3=435, seccomp=317, refused=(57, 58, 59, 322)),  # fork vfork execve execveat
    "aarch64": dict(clone=220, clone3=435, seccomp=277, refused=(221, 281)),  # execve execveat
}
_CLONE_THREAD = 0x00010000


def _program(machine: str) -> list[tuple[int, int, int, int]]:
    """The classic-BPF filter as (code, jump if true, jump if false, k) rows, over struct seccomp_data
    (nr at offset 0, arch at 4, args[0] at 16)."""
    numbers = _SYSCALLS[machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    rows = [(load, 0, 0, 4), (jeq, 1, 0, _ARCH[machine]), (ret, 0, 0, eperm),  # another ABI: refused
            (load, 0, 0, 0)]
    if machine == "x86_64":
        rows += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # the x32 numbering
    for number in numbers["refused"]:
        rows += [(jeq, 0, 1, number), (ret, 0, 0, eperm)]
    rows += [(jeq, 0, 1, numbers["clone3"]), (ret, 0, 0, enosys),
             (jeq, 0, 3, numbers["clone"]), (load, 0, 0, 16), (jset, 1, 0, _CLONE_THREAD), (ret, 0, 0, eperm),
             (ret, 0, 0, allow)]
    return rows


_INSTALLED: list = []  # whether this process runs under the filter (a refused fork's note says so only then)
_PREPARED: list = []  # (libc, program, seccomp's number): built once in the warm parent, used by each runner


def prepare() -> bool:
    """Build the filter and find libc, once (the warm parent does it, so a runner only installs)."""
    import ctypes
    import platform

    if _PREPARED:
        return True
    machine = platform.machine()
    if machine not in _ARCH:
        return False

    class Row(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Row))]

    rows = _program(machine)
    table = (Row * len(rows))(*[Row(*row) for row in rows])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    _PREPARED[:] = [libc, Program(len(rows), table), table, _SYSCALLS[machine]["seccomp"]]
    return True


def deny_new_processes() -> bool:
    """Install the filter in this process (every thread of it, for good). False where it cannot be (not Linux,
    another architecture, a kernel without seccomp): the runner then goes on without it."""
    import ctypes

    if not prepare():
        return False
    libc, program, _table, seccomp = _PREPARED
    try:
        if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS: what lets an unprivileged process filter
            return False
        # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC): every thread, or prctl for this one
        installed = (libc.syscall(seccomp, 1, 1, ctypes.byref(program)) == 0
                     or libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0)  # PR_SET_SECCOMP, MODE_FILTER
    except (OSError, AttributeError):
        return False
    _INSTALLED[:] = [installed]
    return installed


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


def refused_process_note(exc: BaseException) -> str:
    """What to add to a PermissionError that came from starting a process under the filter."""
    if _INSTALLED and _INSTALLED[0] and isinstance(exc, PermissionError) and exc.errno == errno.EPERM:
        return (" (graded code cannot start processes: a child's work would escape the meters and the answer-key "
                "lock. Compute in your function itself)")
    return ""
