"""The runner's sandbox: what learner code can reach, decided by the kernel wherever it can be.

Every runner (the process forked per check from the warm parent, engine/runner_main.py) enters it before
the learner's file is imported, and never leaves it. It is all in this one file so that a reviewer can
read it end to end. The layers, each where the platform has it (`Status` says which were on):

1. **A user of its own** (where grading runs as root: Gradescope, an instructor grading a class on a
   server, CI). The runner switches to a box uid and gid that no account has (`BOX_BASE` + the warm
   parent's pid, so concurrent gradings never share one), with no supplementary groups and no capability
   but, where Landlock confines its reads, CAP_DAC_READ_SEARCH (so it can read the Python it runs from in
   a folder closed to others, such as /root/.pyenv). Where the kernel lets it, it also gets a mount
   namespace of its own: /proc remounted so that it shows only the box's own processes, every other
   mount read-only, and its scratch folder a small tmpfs that vanishes with it.
2. **Landlock** (Linux 5.13 and later, any user, no privilege): files open for reading only below the
   allow-list (`Plan`: the Python installation, the package, the graders, the learner's own folder, the
   system's libraries and a few named files of /etc, /proc and /dev); nothing is written anywhere but the
   scratch folder and a few device files; TCP is refused (ABI 4); signals and abstract unix sockets
   cannot leave the runner (ABI 6).
3. **seccomp** (Linux, any user): no new process (fork, vfork, execve, clone without CLONE_THREAD), no
   ptrace or process_vm_*, signals only to itself, sockets only of the unix family, no mount, namespace,
   bpf, perf, keyring, io_uring or open_by_handle_at, no change of user or session.
4. **rlimits**: no core file, a file size cap (also what the runner's captured output may grow to), a
   descriptor cap, and in a box a thread cap.
5. **An audit hook** (PEP 578, any platform, cannot be removed once added), armed just before the
   learner's file is imported: `sys.setprofile`/`settrace` refused to everyone from then on (the
   answer-key lock is a profile function installed with it, engine/isolation.py, and `sys.getprofile`
   answers None); ctypes, `gc`'s object walks, frames (`sys._getframe`,
   `tb_frame`, `gi_frame`, ...) and new code objects refused to learner code, so nothing leads to the lock's
   state, which lives in closures only the profile slot and the hook hold.

Learner code is code whose file is not the installed libraries', the package's or the graders' (the kata
files, and anything compiled from a string).

What this holds, and what it does not (a process's own memory is its own): README, "What the grader
trusts", and tests/plugin/test_sandbox.py.
"""
from __future__ import annotations

import errno
import os
import sys
from dataclasses import dataclass, field

BOX_BASE = 1_800_000_000  # box uid/gid = BOX_BASE + the warm parent's pid (no account has one up there)
CLASS_BOXES = BOX_BASE + 10_000_000  # boxes a class grading hands out (KATA_BOX): a range of their own
FILE_SIZE_CAP = 64 * 2**20  # bytes one file may grow to (the runner's captured output included)
DESCRIPTOR_CAP = 1024
BOX_THREAD_CAP = 512  # RLIMIT_NPROC counts threads per real uid: only the box's own, so only in a box
SCRATCH_TMPFS = "size=64m,nr_inodes=4096,mode=0700"  # the scratch folder's size in a mount namespace


# ---- what the runner may read (computed once in the warm parent) --------------------------------------------
# /etc holds secrets (shadow, ssh host keys): only the files a Python process reads at run time.
ETC_FILES = ("ld.so.cache", "ld.so.conf", "localtime", "timezone", "passwd", "group", "nsswitch.conf", "hosts",
             "os-release", "mime.types", "gai.conf", "host.conf")
PROC_FILES = ("cpuinfo", "meminfo", "stat", "loadavg", "uptime", "version", "filesystems", "sys", "driver")
DEVICE_FILES = ("null", "zero", "full", "random", "urandom", "tty")  # read and written (write to /dev/null...)
GPU_DEVICE_PREFIXES = ("nvidia", "dri", "kfd")  # CUDA and ROCm talk to these
SYSTEM_TREES = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/sys", "/opt/rocm", "/nix/store")


def _python_trees() -> set[str]:
    """The folders Python and its installed packages are read from."""
    import site
    import sysconfig

    trees = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    for key in ("stdlib", "platstdlib", "purelib", "platlib", "include", "platinclude"):
        try:
            trees.add(sysconfig.get_path(key))
        except KeyError:
            pass
    try:
        trees.update(site.getsitepackages())
        trees.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    return {t for t in trees if t}


def _mapped_trees() -> set[str]:
    """Folders of the shared libraries this process has loaded (a conda or nix torch keeps its own)."""
    found = set()
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/") and not path.startswith(("/proc", "/dev", "/memfd")) and " (deleted)" not in path:
                    found.add(os.path.dirname(path))
    except OSError:
        pass
    return found


def _loaded_files(allowed: set[str]) -> set[str]:
    """The files of loaded modules that lie outside `allowed` (a library imported from the project root, such as
    the tests' stand-in for diffusers): those files alone, never their folder (a course root holds solutions/)."""
    files = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path) and not _below(path, allowed):
            if os.path.basename(path) == "__init__.py":
                files.add(os.path.dirname(path))  # a package: its folder (its submodules load lazily)
            else:
                files.add(path)
    return files


def _below(path: str, roots) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


@dataclass
class Plan:
    """What every runner of one warm parent is allowed, prepared there once."""

    reads: list[str] = field(default_factory=list)  # folders and files opened for reading (and mapping)
    devices: list[str] = field(default_factory=list)  # device files read and written
    scratch: str = ""  # the one folder written
    box: int | None = None  # the box uid/gid where the grading runs as root, else None
    landlock_abi: int = 0
    library_roots: tuple[str, ...] = ()  # whose code is not learner code
    opened: list[tuple[int, bool]] = field(default_factory=list)  # (O_PATH fd, a folder?) of reads and devices


_PLAN: list[Plan] = []
_STATUS: list = []  # the layers this runner entered (Status), for the notes on refusals


def prepare(scratch: str, package_dir: str, extra_reads: list[str] = (), library_paths: tuple[str, ...] = ()) -> Plan:
    """The warm parent's part, once: the allow-list, the box, the scratch folder (created here). `library_paths`:
    the folders the interpreter imported libraries from as it started (a .pth file's additions among them: a
    venv that reads another environment's packages), read and trusted as the Python trees are."""
    import resource  # noqa: F401  (imported here so that a runner does not read it after it is confined)

    python = _python_trees() | {p for p in library_paths if os.path.isdir(p)}
    library = python | {package_dir}
    reads = set(library) | {t for t in SYSTEM_TREES if os.path.isdir(t)} | _mapped_trees()
    reads |= {os.path.join("/etc", name) for name in ETC_FILES if os.path.exists(os.path.join("/etc", name))}
    reads |= {os.path.join("/proc", name) for name in PROC_FILES if os.path.exists(os.path.join("/proc", name))}
    reads |= set(extra_reads)
    reads |= _loaded_files(reads)
    devices = [os.path.join("/dev", name) for name in DEVICE_FILES if os.path.exists(os.path.join("/dev", name))]
    try:
        devices += [os.path.join("/dev", name) for name in sorted(os.listdir("/dev"))
                    if name.startswith(GPU_DEVICE_PREFIXES)]
    except OSError:
        pass
    box = box_id() if _can_change_user() else None
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    if box is not None:
        os.chown(scratch, box, box)
    plan = Plan(sorted(r for r in reads if os.path.exists(r)), devices, scratch, box, _landlock_abi(),
                tuple(sorted(library | {"<frozen"})))
    if plan.landlock_abi:  # opened once here: each runner inherits them and only adds its own few (and /proc's
        # files, opened in the runner: a box mounts its own /proc, whose files are not these)
        kept = [r for r in plan.reads if not _below(r, ("/proc",))]
        plan.opened = [(fd, is_dir) for fd, is_dir in map(_opened, kept) if fd is not None]
        plan.reads = [r for r in plan.reads if _below(r, ("/proc",))]
    for old in _PLAN:
        for fd, _ in old.opened:
            os.close(fd)
    _PLAN[:] = [plan]
    return plan


def _opened(path: str) -> tuple[int | None, bool]:
    try:
        return os.open(path, os.O_PATH | os.O_CLOEXEC), os.path.isdir(path)
    except OSError:
        return None, False


def box_id() -> int:
    """This grading's box: the one `kata class` or the autograder assigned (KATA_BOX, a number unique among the
    gradings running at once; its kata folder opened to it: `open_to_box`), or one of the warm parent's own."""
    given = os.environ.get("KATA_BOX", "")
    return CLASS_BOXES + int(given) if given.isdigit() and int(given) < 10_000_000 else BOX_BASE + os.getpid()


def open_to_box(folder) -> None:
    """Where a grading child was given a box (KATA_BOX, by `kata class` or the autograder) and runs as root: let
    that box read the submission's kata folder and nothing beside it, by the file system's own permissions (what
    holds where Landlock does not): the folder's group is the box's, folders 0750 and files 0640 (read, not
    written), and the folders above it may be entered (0711) but not listed."""
    from pathlib import Path

    if not os.environ.get("KATA_BOX", "").isdigit() or not _can_change_user():
        return
    gid = box_id()
    folder = Path(folder)
    for path in [folder, *folder.rglob("*")]:
        try:
            os.chown(path, 0, gid, follow_symlinks=False)
            if not path.is_symlink():
                path.chmod(0o750 if path.is_dir() else 0o640)
        except OSError:
            pass
    for parent in folder.parents:
        if parent == parent.parent or parent.stat().st_mode & 0o001:
            break
        parent.chmod(parent.stat().st_mode | 0o711)


def plan() -> Plan | None:
    return _PLAN[0] if _PLAN else None


def _can_change_user() -> bool:
    return hasattr(os, "setresuid") and os.geteuid() == 0 and os.environ.get("KATA_SANDBOX_USER", "on") != "off"


# ---- entering it (in the runner, after its fork, before any learner code) ----------------------------------
@dataclass
class Status:
    layers: list[str] = field(default_factory=list)  # what was entered: "box", "mounts", "landlock 7", ...
    missing: list[str] = field(default_factory=list)  # what could not be, with the reason

    def on(self, layer: str) -> bool:
        return any(entry.split()[0] == layer for entry in self.layers)


def enter(reads: list[str]) -> Status:
    """Confine this process for good: its user, mounts, file system view, system calls and limits. `reads` are
    this runner's own readable paths beyond the plan's (the learner's folder, the graders)."""
    status = Status()
    plan = _PLAN[0] if _PLAN else None
    if plan is None or not sys.platform.startswith("linux"):
        status.missing.append("the sandbox (not Linux)" if plan is not None else "the sandbox (not prepared)")
        _STATUS[:] = [status]
        return status
    if plan.box is not None:
        _mounts(plan, status)
    readable = [r for r in reads if os.path.exists(r)] + list(plan.reads)  # what the plan did not open
    landlock = _landlock_ready(plan, readable, status)
    if plan.box is not None:
        _become_box(plan.box, keep_read_search=landlock is not None, status=status)
    _limits(plan, status)
    _no_new_privileges()
    if landlock is not None:
        _landlock_restrict(landlock, plan, status)
    _seccomp(status)
    _STATUS[:] = [status]
    return status


def status() -> Status | None:
    return _STATUS[0] if _STATUS else None


def _mounts(plan: Plan, status: Status) -> None:
    """A mount namespace of its own (root only): /proc showing only the box's processes, every mount read-only,
    the scratch folder a fresh small tmpfs; and SysV IPC of its own. Skipped, with the reason, where the kernel
    refuses (a container without CAP_SYS_ADMIN): Landlock and the box's own uid then do the work. (No network
    namespace: the seccomp filter already refuses every socket but a unix one, for any user, for less.)"""
    libc = _libc()
    CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
    MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x8, 0x4000, 0x40000
    if libc.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        status.missing.append(f"mounts (unshare: {os.strerror(_errno())})")
        return
    if libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        status.missing.append(f"mounts (private: {os.strerror(_errno())})")
        return
    read_only = _read_only_everywhere(libc)
    box = plan.box
    proc_ok = libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=invisible") == 0 \
        or libc.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=2") == 0
    options = f"{SCRATCH_TMPFS},uid={box},gid={box}".encode()
    scratch_ok = libc.mount(b"tmpfs", plan.scratch.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, options) == 0
    status.layers.append("mounts" + ("" if read_only else " (not read-only)") + ("" if proc_ok else " (full /proc)")
                         + ("" if scratch_ok else " (scratch on disk)"))


def _read_only_everywhere(libc) -> bool:
    """Every mount read-only, recursively (mount_setattr, Linux 5.12+)."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                    ("userns_fd", ctypes.c_uint64)]

    AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
    attr = MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    return libc.syscall(_SYSCALLS[_machine()]["mount_setattr"], AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                        ctypes.sizeof(attr)) == 0


def _become_box(box: int, keep_read_search: bool, status: Status) -> None:
    """The box's uid and gid, no groups, and no capability but CAP_DAC_READ_SEARCH where Landlock bounds what it
    reads (without Landlock it would open every file: then none, and only what others may read is readable)."""
    import ctypes

    libc = _libc()
    PR_SET_KEEPCAPS, CAP_DAC_READ_SEARCH = 8, 2
    libc.prctl(PR_SET_KEEPCAPS, 1, 0, 0, 0)
    os.setgroups([])
    os.setresgid(box, box, box)
    os.setresuid(box, box, box)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    kept = (1 << CAP_DAC_READ_SEARCH) if keep_read_search else 0
    data = (Data * 2)(Data(kept, kept, 0), Data(0, 0, 0))
    capset = libc.syscall(_SYSCALLS[_machine()]["capset"], ctypes.byref(Header(0x20080522, 0)), data)  # v3
    libc.prctl(PR_SET_KEEPCAPS, 0, 0, 0, 0)
    if os.getuid() != box or os.getgid() != box or capset != 0:
        raise OSError("the runner could not become its box user")
    status.layers.append(f"box {box}" + (" (reads through Landlock)" if kept else ""))


def _limits(plan: Plan, status: Status) -> None:
    import resource

    caps = [(resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, FILE_SIZE_CAP), (resource.RLIMIT_NOFILE, DESCRIPTOR_CAP)]
    if plan.box is not None:
        caps.append((resource.RLIMIT_NPROC, BOX_THREAD_CAP))
    for which, cap in caps:
        try:
            soft, hard = resource.getrlimit(which)
            cap = cap if hard == resource.RLIM_INFINITY else min(cap, hard)
            resource.setrlimit(which, (min(cap, soft) if soft != resource.RLIM_INFINITY else cap, cap))
        except (OSError, ValueError):
            status.missing.append(f"rlimit {which}")
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the file size cap a write fails (EFBIG), it does not kill
    status.layers.append("rlimits")


def _no_new_privileges() -> None:
    _libc().prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: what lets an unprivileged process use Landlock and seccomp


# ---- Landlock --------------------------------------------------------------------------------------------------
_FS_EXECUTE, _FS_WRITE_FILE, _FS_READ_FILE, _FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FS_TRUNCATE, _FS_IOCTL_DEV = 1 << 14, 1 << 15
_FILE_RIGHTS = _FS_EXECUTE | _FS_WRITE_FILE | _FS_READ_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV


def _landlock_abi() -> int:
    if not sys.platform.startswith("linux") or _machine() not in _SYSCALLS or \
            os.environ.get("KATA_SANDBOX_LANDLOCK", "on") == "off":
        return 0
    try:
        abi = _libc().syscall(_SYSCALLS[_machine()]["landlock_create_ruleset"], None, 0, 1)  # ..._VERSION
    except (OSError, AttributeError):
        return 0
    return max(abi, 0)


def _handled_fs(abi: int) -> int:
    rights = (1 << 13) - 1  # ABI 1: execute ... make_sym
    if abi >= 2:
        rights |= 1 << 13  # refer
    if abi >= 3:
        rights |= _FS_TRUNCATE
    if abi >= 5:
        rights |= _FS_IOCTL_DEV
    return rights


def _landlock_ready(plan: Plan, readable: list[str], status: Status):
    """A ruleset with this runner's rules, built while the paths can still be opened; restricted later."""
    import ctypes

    if plan.landlock_abi < 1:
        status.missing.append("landlock (not in this kernel)" if os.environ.get("KATA_SANDBOX_LANDLOCK") != "off"
                              else "landlock (KATA_SANDBOX_LANDLOCK=off)")
        return None
    abi = plan.landlock_abi
    numbers = _SYSCALLS[_machine()]
    libc = _libc()

    class RulesetAttr(ctypes.Structure):
        _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                    ("scoped", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    handled = _handled_fs(abi)
    attr = RulesetAttr(handled, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)  # TCP bind+connect; signal+unix
    size = ctypes.sizeof(attr) if abi >= 6 else (16 if abi >= 4 else 8)
    ruleset = libc.syscall(numbers["landlock_create_ruleset"], ctypes.byref(attr), size, 0)
    if ruleset < 0:
        status.missing.append(f"landlock (create: {os.strerror(_errno())})")
        return None

    def add(fd: int, is_dir: bool, rights: int) -> None:
        rule = PathBeneath((rights if is_dir else rights & _FILE_RIGHTS) & handled, fd)
        libc.syscall(numbers["landlock_add_rule"], ruleset, 1, ctypes.byref(rule), 0)  # RULE_PATH_BENEATH

    def allow(path: str, rights: int) -> None:
        fd, is_dir = _opened(path)
        if fd is not None:
            try:
                add(fd, is_dir, rights)
            finally:
                os.close(fd)

    read = _FS_READ_FILE | _FS_READ_DIR | _FS_EXECUTE
    for fd, is_dir in plan.opened:  # the plan's own, opened once in the warm parent
        add(fd, is_dir, read)
    for path in readable:
        allow(path, read)
    allow(f"/proc/{os.getpid()}", read)  # its own /proc/self, nobody else's
    for path in plan.devices:
        allow(path, _FS_READ_FILE | _FS_WRITE_FILE | _FS_TRUNCATE | _FS_IOCTL_DEV)
    allow(plan.scratch, handled)
    for fd, _ in plan.opened:  # nothing of the warm parent's is left open in the runner
        os.close(fd)
    return ruleset


def _landlock_restrict(ruleset: int, plan: Plan, status: Status) -> None:
    libc = _libc()
    restricted = libc.syscall(_SYSCALLS[_machine()]["landlock_restrict_self"], ruleset, 0) == 0
    os.close(ruleset)
    if not restricted:
        status.missing.append(f"landlock (restrict: {os.strerror(_errno())})")
        return
    status.layers.append(f"landlock {plan.landlock_abi}")


# ---- seccomp ---------------------------------------------------------------------------------------------------
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}  # AUDIT_ARCH_*
_SYSCALLS = {
    "x86_64": dict(
        clone=56, clone3=435, socket=41, socketpair=53, kill=62, rt_sigqueueinfo=129, tgkill=234, tkill=200,
        rt_tgsigqueueinfo=297, mount_setattr=442, capset=126, landlock_create_ruleset=444, landlock_add_rule=445,
        landlock_restrict_self=446,
        refused=dict(fork=57, vfork=58, execve=59, execveat=322, ptrace=101, process_vm_readv=310,
                     process_vm_writev=311, pidfd_open=434, pidfd_getfd=438, pidfd_send_signal=424, setsid=112,
                     setpgid=109, mount=165, umount2=166, pivot_root=155, chroot=161, unshare=272, setns=308,
                     open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                     mount_setattr=442, bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425,
                     io_uring_enter=426, io_uring_register=427, keyctl=250, add_key=248, request_key=249,
                     open_by_handle_at=304, name_to_handle_at=303, setuid=105, setgid=106, setreuid=113,
                     setregid=114, setresuid=117, setresgid=119, setgroups=116, setfsuid=122, setfsgid=123,
                     capset=126, kcmp=312)),
    "aarch64": dict(
        clone=220, clone3=435, socket=198, socketpair=199, kill=129, rt_sigqueueinfo=138, tgkill=131, tkill=130,
        rt_tgsigqueueinfo=240, mount_setattr=442, capset=91, landlock_create_ruleset=444, landlock_add_rule=445,
        landlock_restrict_self=446,
        refused=dict(execve=221, execveat=281, ptrace=117, process_vm_readv=270, process_vm_writev=271,
                     pidfd_open=434, pidfd_getfd=438, pidfd_send_signal=424, setsid=157, setpgid=154, mount=40,
                     umount2=39, pivot_root=41, chroot=51, unshare=97, setns=268, open_tree=428, move_mount=429,
                     fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, bpf=280,
                     perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426,
                     io_uring_register=427, keyctl=219, add_key=217, request_key=218, open_by_handle_at=265,
                     name_to_handle_at=264, setuid=146, setgid=144, setreuid=145, setregid=143, setresuid=147,
                     setresgid=149, setgroups=159, setfsuid=151, setfsgid=152, capset=91, kcmp=272)),
}
_CLONE_THREAD, _AF_UNIX = 0x00010000, 1
_PROCESS_SYSCALLS = ("fork", "vfork", "execve", "execveat")  # a refusal of these gets the note below


def filter_rows(machine: str, pid: int) -> list[tuple[int, int, int, int]]:
    """The classic-BPF program as (code, jump if true, jump if false, k) rows, over struct seccomp_data (nr at
    offset 0, arch at 4, the low word of args[0] at 16). Jumps are written to labels and resolved here."""
    numbers = _SYSCALLS[machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
    rows: list = [(load, 0, 0, 4), (jeq, 0, "deny", _ARCH[machine]), (load, 0, 0, 0)]  # another ABI: refused
    if machine == "x86_64":
        rows.append((jge, "deny", 0, 0x40000000))  # the x32 numbering
    rows += [(jeq, "deny", 0, number) for number in numbers["refused"].values()]
    rows += [(jeq, "enosys", 0, numbers["clone3"]),  # its flags are behind a pointer: ENOSYS, libc falls back to clone
             (jeq, "clone", 0, numbers["clone"]),
             (jeq, "unix", 0, numbers["socket"]), (jeq, "unix", 0, numbers["socketpair"]),
             (jeq, "kill", 0, numbers["kill"]), (jeq, "kill", 0, numbers["rt_sigqueueinfo"]),
             (jeq, "self", 0, numbers["tgkill"]), (jeq, "self", 0, numbers["rt_tgsigqueueinfo"]),
             (jeq, "self", 0, numbers["tkill"]),
             (ret, 0, 0, allow),
             "clone", (load, 0, 0, 16), (jset, "allow", "deny", _CLONE_THREAD),
             "unix", (load, 0, 0, 16), (jeq, "allow", "deny", _AF_UNIX),
             "kill", (load, 0, 0, 16), (jeq, "allow", 0, 0),  # kill(0, …): its own process group
             "self", (load, 0, 0, 16), (jeq, "allow", "deny", pid),
             "allow", (ret, 0, 0, allow),
             "deny", (ret, 0, 0, eperm),
             "enosys", (ret, 0, 0, enosys)]
    labels, at = {}, 0
    for row in rows:
        if isinstance(row, str):
            labels[row] = at
        else:
            at += 1
    out, at = [], 0
    for row in rows:
        if isinstance(row, str):
            continue
        code, jt, jf, k = row
        jt = labels[jt] - at - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - at - 1 if isinstance(jf, str) else jf
        assert 0 <= jt < 256 and 0 <= jf < 256, "a jump past the 8-bit offset"
        out.append((code, jt, jf, k))
        at += 1
    return out


_SECCOMP: list = []  # whether this process runs under the filter (a refused fork's note is added only then)


def _seccomp(status: Status) -> None:
    import ctypes

    machine = _machine()
    if machine not in _SYSCALLS:
        status.missing.append(f"seccomp (no table for {machine})")
        return

    class Row(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Row))]

    rows = filter_rows(machine, os.getpid())
    table = (Row * len(rows))(*[Row(*row) for row in rows])
    program = Program(len(rows), table)
    libc = _libc()
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC): every thread, or prctl for this one
    installed = (libc.syscall(317 if machine == "x86_64" else 277, 1, 1, ctypes.byref(program)) == 0
                 or libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0)
    _SECCOMP[:] = [installed]
    if installed:
        status.layers.append("seccomp")
    else:
        status.missing.append(f"seccomp ({os.strerror(_errno())})")


def refused_process_note(exc: BaseException) -> str:
    """What to add to a PermissionError that came from starting a process under the filter."""
    if _SECCOMP and _SECCOMP[0] and isinstance(exc, PermissionError) and exc.errno == errno.EPERM:
        return (" (graded code cannot start processes: a child's work would escape the meters and the answer-key "
                "lock. Compute in your function itself)")
    return ""


def file_size_note(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        return f" (a file the runner writes, its printed output included, is capped at {FILE_SIZE_CAP // 2**20} MiB)"
    return ""


# ---- the audit hook -----------------------------------------------------------------------------------------------
class Refused(PermissionError):
    """What the audit hook raises: learner code reached for something the sandbox keeps from it."""


# Modules whose functions only hand on what their caller asked for (inspect.currentframe is sys._getframe): a
# request through them is judged by who made it.
_PASS_THROUGH_MODULES = ("inspect", "traceback", "functools", "types", "operator", "ctypes", "dis")
_FRAME_ATTRS = frozenset({"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"})
_JUDGED = frozenset({"sys._getframe", "sys._getframemodulename", "sys._current_frames", "sys._current_exceptions",
                     "gc.get_objects", "gc.get_referrers", "gc.get_referents", "code.__new__", "function.__new__",
                     "object.__getattr__", "object.__setattr__", "object.__delattr__", "compile"})
_ALWAYS = frozenset({"sys.setprofile", "sys.settrace", "sys.monitoring.register_callback", "sys._setprofileallthreads",
                     "sys._settraceallthreads", "_thread.start_new_thread"})  # the last two: Python 3.12+, 3.13+


def untrusted_code(library_roots: tuple[str, ...], learner_files: frozenset[str]):
    """Whether a code object is learner code: a kata file's, or any whose file is not below the libraries', the
    package's or the graders' roots (code compiled from a string included). Read once per code object."""
    roots = tuple(r.rstrip("/") + "/" for r in library_roots if not r.startswith("<"))
    # a folder that holds a kata file is never a library's, whatever path leads to it
    roots = tuple(r for r in roots if not any(f.startswith(r) for f in learner_files)) + ("<frozen ",)
    import operator

    name_of = operator.attrgetter("co_qualname" if sys.version_info >= (3, 11) else "co_name")
    known: dict = {}  # in buckets by qualified name: id() is an audited call, a code object's hash reads it all

    def untrusted(code) -> bool:
        for seen in known.get(name_of(code), ()):
            if seen[0] is code:
                return seen[1]
        name = code.co_filename
        verdict = name in learner_files or not name.startswith(roots)
        known.setdefault(name_of(code), []).append((code, verdict))
        return verdict

    untrusted.roots = roots
    return untrusted


def arm(profile, window, untrusted, window_code, pending: list) -> None:
    """Add the audit hook that keeps the answer-key lock (engine/isolation.py) on, for the rest of this process:
    `profile` is this thread's profile function inside the lock's windows (from the outermost window's open to its
    close: learner code runs only there), which only `window_code` (the lock's own caller of learner code) may
    open and close; `window(op, detail)` gets them and answers how many are open. `sys.setprofile`/`settrace` are
    refused to everyone (CPython's own unsetting of a profile function that raised included: `pending` holds the
    lock's refusal, which that unsetting then raises instead), and `sys.getprofile`/`gettrace` answer None, so
    nothing the learner's code can call hands it the lock or its state."""

    pass_through = set()
    for name in _PASS_THROUGH_MODULES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            pass_through.add(os.path.dirname(path) + "/" if name == "ctypes" else path)
    pass_through = tuple(pass_through)
    roots = untrusted.roots
    getframe = sys._getframe
    setprofile = sys.setprofile
    busy = [False]

    def asker(frame):
        """The frame that asked: the innermost one outside the pass-through modules."""
        while frame is not None and frame.f_code.co_filename.startswith(pass_through):
            frame = frame.f_back
        return frame

    def hook(event, args):
        if busy[0]:
            return
        if event in _ALWAYS:
            if event == "sys.setprofile" and pending[0] is not None:
                # CPython unsets a profile function that raised, through this event: refusing it keeps the lock
                # on, and raising the lock's own refusal keeps it the error the learner's code sees.
                exc, pending[0] = pending[0], None
                raise exc
            raise Refused(_ALWAYS_TEXT.get(event, f"graded code cannot use {event}"))
        if event == "kata.lock":
            busy[0] = True
            try:
                if getframe(1).f_code is not window_code:
                    raise Refused("graded code cannot open or close the answer-key lock's window")
                # the lock runs while learner code does (the outermost window's open to its close), and costs
                # nothing in between: the runner's own work (unpickling the inputs, say) is not profiled
                setprofile(profile if window(*args) > 0 else None)
            finally:
                busy[0] = False
            return
        if event not in _JUDGED and not event.startswith("ctypes."):
            return
        if event == "object.__getattr__" and (len(args) < 2 or args[1] not in _FRAME_ATTRS):
            return
        if event in ("object.__setattr__", "object.__delattr__") and (len(args) < 2 or args[1] != "__code__"):
            return
        busy[0] = True
        try:
            who = asker(getframe(1))
            if who is None or not untrusted(who.f_code):
                return
            if event == "compile" and not (len(args) > 1 and isinstance(args[1], (str, bytes))
                                           and os.fsdecode(args[1]).startswith(roots)):
                return  # compiling code of its own is fine; only passing it off as a library's file is not
        finally:
            busy[0] = False
        raise Refused(_judged_text(event, args))

    sys.addaudithook(hook)
    sys.getprofile = sys.gettrace = lambda: None  # the lock is nobody's to hold
    import logging

    logging.currentframe = lambda: None  # logging's caller lookup, without a frame (findCaller copes with None)


_ALWAYS_TEXT = {
    "sys.setprofile": "graded code cannot set a profile function: the answer-key lock is one, and it stays",
    "sys.settrace": "graded code cannot set a trace function: it would see the grader's frames",
    "_thread.start_new_thread": "graded code cannot start a thread: work in another thread escapes the meters and "
                                "the answer-key lock. Compute in your function itself",
    "sys.monitoring.register_callback": "graded code cannot register monitoring callbacks: they would see the "
                                        "grader's frames",
}


def _judged_text(event: str, args) -> str:
    if event.startswith("ctypes."):
        return "graded code cannot use ctypes: raw memory and C functions reach around the grading"
    if event.startswith("gc."):
        return f"graded code cannot walk the interpreter's objects ({event}): the grader's are not yours to read"
    if event == "compile":
        return "graded code cannot compile code under a library's file name"
    if event in ("object.__setattr__", "object.__delattr__"):
        return "graded code cannot replace a function's code (__code__)"
    if event in ("code.__new__", "function.__new__"):
        return f"graded code cannot build code or function objects by hand ({event})"
    what = args[1] if event == "object.__getattr__" and len(args) > 1 else event
    return f"graded code cannot take frames ({what}): they lead to the grader's own"


# ---- small helpers -------------------------------------------------------------------------------------------------
_LIBC: list = []


def _libc():
    import ctypes

    if not _LIBC:
        _LIBC.append(ctypes.CDLL(None, use_errno=True))
    return _LIBC[0]


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


def _machine() -> str:
    import platform

    return platform.machine()


def forget_ctypes() -> None:
    """Drop this module's handle on the C library before learner code runs (it would call any C function)."""
    _LIBC.clear()
