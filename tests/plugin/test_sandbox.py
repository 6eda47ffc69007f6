"""The runner's sandbox (engine/sandbox.py), probed as a determined learner would: each test is a hole of a class
(write somewhere a later process reads, read what is not yours, reach another process, the network, the secret
environment, the lock's own machinery, the grader's resources) and shows it closed, on the toy project.

The sessions and CI run as root, so the privileged path (a box user of its own, a mount namespace) is the one
tested here for real; where a test needs root it says so and skips without it.
"""
import json
import os
import sys
import sysconfig

import pytest

from diffusion_katas.engine import sandbox

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the box user exists only where grading runs as root")


def _refusals(toy, attempts: str, ok: str = "") -> list[str]:
    """Run `attempts` (lines that each append to `got` what happened) in the learner's `double`; the verdicts."""
    toy.kata(double=f"""
        import os
        got = []
        def attempt(name, action):
            try:
                action()
                got.append(name + ": done")
            except OSError as exc:
                got.append(name + ": refused " + type(exc).__name__)
        {attempts}
        print("GOT" + repr(got))
        return x * 2
    """)
    result = toy.run("katas", "--kata-function", "double", "-s")
    line = next(line for line in result.stdout.lines if "GOT" in line)
    return eval(line.split("GOT", 1)[1])  # noqa: S307  (our own repr of a list of strings)


@ROOT_ONLY
def test_graded_code_runs_as_a_box_user_with_no_groups_where_grading_runs_as_root(toy):
    toy.kata(double="""
        import os
        print("IDS", os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
        return x * 2
    """)
    result = toy.run("katas", "--kata-function", "double", "-s")
    line = next(line for line in result.stdout.lines if "IDS" in line)
    uid, euid, gid, groups = line.split("IDS", 1)[1].split(None, 3)
    assert int(uid) == int(euid) == int(gid) > sandbox.BOX_BASE and groups.strip() == "[]"


def test_graded_code_writes_nowhere_but_its_scratch_folder(toy):
    site = sysconfig.get_paths()["purelib"]
    root = toy.pytester.path
    targets = {"a .pth in site-packages": os.path.join(site, "kata_planted.pth"),
               "a .pyc beside the graders": str(root / "graders" / "__pycache__" / "planted.pyc"),
               "a conftest.py in the project": str(root / "conftest.py"),
               "its own kata file": str(root / "katas" / "01_toy.py"),
               "/tmp": "/tmp/kata-planted", "/dev/shm": "/dev/shm/kata-planted",
               "the home folder": os.path.expanduser("~/kata-planted")}
    lines = "\n        ".join(f"attempt({name!r}, lambda: open({path!r}, 'a').write('planted'))"
                                for name, path in targets.items())
    got = _refusals(toy, lines + "\n        import tempfile\n"
                           "        attempt('the scratch folder', lambda: tempfile.TemporaryFile().write(b'ok'))")
    # refused by Landlock (PermissionError) or, in a box, by the read-only mounts first (OSError: EROFS)
    assert [entry.split(": ")[1].split()[0] for entry in got] == ["refused"] * len(targets) + ["done"], got
    for name, path in targets.items():
        assert not os.path.exists(path) or not open(path).read().endswith("planted"), name


def test_graded_code_reads_no_solution_no_other_folder_and_no_secret_file(toy, tmp_path_factory):
    other = tmp_path_factory.mktemp("classmate") / "01_toy.py"
    other.write_text("# a classmate's answer\n")
    root = toy.pytester.path
    targets = {"the solutions": str(root / "solutions" / "01_toy.py"), "a classmate's folder": str(other),
               "the project's config": str(root / "tox.ini"), "/etc/shadow": "/etc/shadow",
               "the grader's environment": f"/proc/{os.getpid()}/environ",
               "the warm parent's memory": "/proc/PPID/mem", "the process list": "/proc"}
    lines = "\n        ".join(
        f"attempt({name!r}, lambda: os.listdir({path!r}) if {path!r} == '/proc' else "
        f"open({path!r}.replace('PPID', str(os.getppid())), 'rb').read(1))" for name, path in targets.items())
    got = _refusals(toy, lines + "\n        attempt('its own kata file', lambda: open(__file__).read())")
    # refused by Landlock (PermissionError), or not even there for a box (/proc shows its own processes only)
    assert [entry.split(": ")[1].split()[0] for entry in got] == ["refused"] * len(targets) + ["done"], got


def test_graded_code_can_signal_nobody_but_itself_and_the_run_goes_on(toy):
    toy.kata(double="""
        import os, signal
        for pid in (os.getppid(), 1, os.getppid() - 1):
            try:
                os.kill(pid, signal.SIGKILL)
            except PermissionError:
                pass
            else:
                raise AssertionError(f"signalled {pid}")
        return x * 2
    """, normalize="import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", stay_put="return x")
    result = toy.run("katas")
    result.stdout.fnmatch_lines(["*ended without answering (killed by signal 9 (SIGKILL))*"])
    result.assert_outcomes(passed=3, failed=1)  # the warm parent and the grader outlived every attempt


def test_graded_code_has_no_network_and_no_new_process(toy):
    got = _refusals(toy, """import socket, subprocess
        attempt('an IPv4 socket', lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        attempt('an IPv6 socket', lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM))
        attempt('a netlink socket', lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW))
        attempt('a process', lambda: subprocess.run(['true']))
        attempt('a unix socket pair', lambda: socket.socketpair())""")
    assert got[:4] == ["an IPv4 socket: refused PermissionError", "an IPv6 socket: refused PermissionError",
                       "a netlink socket: refused PermissionError", "a process: refused PermissionError"], got
    assert got[4] == "a unix socket pair: done"


def test_the_runners_environment_carries_no_secret_of_the_graders(toy, monkeypatch):
    for name in ("GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "MY_API_KEY", "PGPASSWORD"):
        monkeypatch.setenv(name, "s3cr3t-value")
    toy.kata(double="""
        import os
        leaked = [k for k, v in os.environ.items() if "s3cr3t" in v]
        assert not leaked, leaked
        return x * 2
    """)
    result = toy.pytester.runpytest_subprocess("katas", "--kata-function", "double")  # a fresh warm parent
    result.assert_outcomes(passed=2)


def test_the_lock_cannot_be_switched_off_reached_or_driven_by_hand(toy):
    toy.kata(double="""
        import sys
        for attempt in (lambda: sys.setprofile(None), lambda: sys.settrace(lambda *a: None),
                        lambda: sys.audit("kata.lock", "close", [])):
            try:
                attempt()
            except PermissionError:
                pass
            else:
                raise AssertionError("not refused")
        assert sys.getprofile() is None and sys.gettrace() is None  # nothing hands out the lock or its state
        return toyref.double(x)  # still the answer key
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*`double` called toyref.double, which is the answer key*"])


def test_a_refusal_caught_leaves_the_lock_on_for_the_rest_of_the_call_and_the_next(toy):
    toy.kata(double="""
        for _ in range(2):
            try:
                toyref.double(x)
            except Exception as exc:
                assert "answer key" in str(exc), exc
            else:
                raise AssertionError("the second call went through")
        return x * 2
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.stdout.fnmatch_lines(["*`double` called toyref.double, which is the answer key*"])
    result.assert_outcomes(failed=1)


def test_ctypes_new_code_and_the_runners_own_code_are_out_of_reach(toy):
    toy.kata(double="""
        import ctypes
        from diffusion_katas.engine import isolation
        for name, attempt in (("ctypes", lambda: ctypes.CDLL(None).getpid()),
                              ("ctypes memory", lambda: ctypes.c_int.from_address(id(x))),
                              ("replacing the lock's code", lambda: setattr(isolation._window, "__code__",
                                                                            (lambda *a: None).__code__)),
                              ("a code object by hand", lambda: isolation._window.__code__.replace(co_name="w"))):
            try:
                attempt()
            except PermissionError:
                pass
            else:
                raise AssertionError(name + " was not refused")
        return x * 2
    """)
    result = toy.run("katas", "--kata-function", "double")
    result.assert_outcomes(passed=2)


def test_a_reply_that_claims_to_be_huge_is_refused_before_it_is_read(toy):
    toy.kata(double="""
        import os, stat, struct
        for fd in range(3, 64):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.write(fd, struct.pack("!Q", 2**40) + b"x" * 4096)  # a terabyte, it says
            except OSError:
                pass
        import time
        time.sleep(60)
    """)
    result = toy.run("katas", "--kata-function", "double", "--kata-timeout", "50")
    result.stdout.fnmatch_lines(["*it sent a reply of 1,099,511,627,776 bytes (at most 64 MiB are read), which is not a "
                                 "reply; the runner was ended*"])
    assert "timed out" not in result.stdout.str()


def test_a_forged_reply_is_checked_and_copies_nothing_onto_the_graders_objects(toy):
    from test_isolation import _remote_lab

    _remote_lab(toy, """
        import io, os, stat, struct
        first = model(x)
        model(x)  # a second call: the grader's own count fails the check
        buffer = io.BytesIO()
        torch.save({"kind": "ok", "output": first, "state": {"model": {"calls": 1}},
                    "rng_after": torch.zeros(3, dtype=torch.uint8)}, buffer)  # what the grader once copied back
        for fd in range(3, 64):
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.write(fd, struct.pack("!Q", len(buffer.getvalue())) + buffer.getvalue())
            except OSError:
                pass
        return first
    """)
    result = toy.run("katas/02_remote.py")
    result.stdout.fnmatch_lines(["*the model was called 2 times; one call is the lesson*"])
    result.assert_outcomes(failed=1)


def test_a_replys_kept_state_flag_is_read_only_as_a_literal_true():
    from diffusion_katas.engine.runner import checked_reply

    assert checked_reply({"kind": "ok", "state_kept": True})["state_kept"] is True
    assert checked_reply({"kind": "raised", "state_kept": True})["state_kept"] is True
    for forged in (1, "yes", [True], {"kind": "ok"}, None):
        assert "state_kept" not in checked_reply({"kind": "ok", "state_kept": forged})
    assert "state_kept" not in checked_reply({"kind": "import_error", "state_kept": True})


def test_printing_past_the_file_size_cap_fails_the_call_and_leaves_the_disk_alone(toy):
    toy.kata(double="""
        import sys
        chunk = "x" * 2**20
        for _ in range(96):  # 96 MiB: past the runner's 64 MiB cap on any one file, its captured output included
            sys.stdout.write(chunk)
        sys.stdout.flush()
        return x * 2
    """, stay_put="return x")
    result = toy.run("katas", "-k", "double or stay_put")
    result.stdout.fnmatch_lines(["*File too large (a file the runner writes, its printed output included, is capped "
                                 "at 64 MiB)*"])
    result.assert_outcomes(passed=1, failed=1)
    assert len(result.stdout.str()) < 200_000


def test_the_box_status_names_every_layer_entered_here(toy):
    toy.kata(double="""
        from diffusion_katas.engine import sandbox
        status = sandbox.status()
        print("LAYERS", status.layers, status.missing)
        return x * 2
    """)
    result = toy.run("katas", "--kata-function", "double", "-s")
    line = next(line for line in result.stdout.lines if "LAYERS" in line)
    for layer in ("rlimits", "seccomp") + (("landlock",) if sandbox._landlock_abi() else ()) + \
            (("box", "mounts") if os.geteuid() == 0 else ()):
        assert f"'{layer}" in line, line


def test_a_hidden_checks_results_carry_nothing_the_learners_code_wrote(toy, tmp_path):
    toy.kata(double="""
        if x.numel() == 7:
            raise ValueError("LEAKED-" + str(torch.initial_seed()))
        return x * 2
    """)
    cases = tmp_path / "hidden.json"
    cases.write_text(json.dumps({"01_toy::double::vs toyref.double": [{"n": 7}]}))
    report = tmp_path / "report.json"
    toy.run("katas", "--kata-hidden-seed", "a long secret of the instructor's", "--kata-hidden-cases", str(cases),
            "--kata-json", str(report))
    hidden = [r for r in json.loads(report.read_text())["results"] if r["hidden"]]
    assert hidden and "LEAKED" not in json.dumps(hidden)
    assert any(r["status"] == "failed" for r in hidden)


def test_a_hidden_checks_seed_is_keyed_by_the_secret_and_leads_to_no_other():
    from diffusion_katas.pytest_plugin.session import hidden_check_seed

    a = hidden_check_seed("secret one", "01_toy", "double", "vs toyref.double")
    assert a == hidden_check_seed("secret one", "01_toy", "double", "vs toyref.double")  # the same for everyone
    assert a != hidden_check_seed("secret two", "01_toy", "double", "vs toyref.double")
    assert a != hidden_check_seed("secret one", "01_toy", "double", "another check")
    assert 0 <= a < 2**31


def test_the_seccomp_program_jumps_where_it_says(monkeypatch):
    # every refused system call ends in EPERM, clone3 in ENOSYS; a thread's clone, a unix socket and a signal to
    # oneself are allowed: the program read row by row, as the kernel would
    for machine in sandbox._SYSCALLS:
        rows = sandbox.filter_rows(machine, pid=4242)
        numbers = sandbox._SYSCALLS[machine]

        def run(nr, arg0=0, arch=sandbox._ARCH[machine]):
            data = {0: nr, 4: arch, 16: arg0}
            acc, pc = 0, 0
            while True:
                code, jt, jf, k = rows[pc]
                if code == 0x20:
                    acc = data[k]
                    pc += 1
                elif code == 0x06:
                    return k
                else:
                    taken = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
                    pc += 1 + (jt if taken else jf)

        allow, eperm = 0x7FFF0000, 0x00050001
        assert run(numbers["refused"]["execve"]) == eperm
        assert run(numbers["refused"]["ptrace"]) == eperm
        assert run(numbers["clone3"]) == 0x00050000 | 38
        assert run(numbers["clone"], 0x00010000 | 0x100) == allow  # CLONE_THREAD | CLONE_VM
        assert run(numbers["clone"], 0x11) == eperm  # a fork by clone
        assert run(numbers["socket"], 1) == allow and run(numbers["socket"], 2) == eperm
        assert run(numbers["kill"], 4242) == allow and run(numbers["kill"], 0) == allow
        assert run(numbers["kill"], 1) == eperm and run(numbers["kill"], 0xFFFFFFFF) == eperm
        assert run(numbers["tgkill"], 4242) == allow and run(numbers["tgkill"], 77) == eperm
        assert run(0) == allow  # read(2), and everything else
        assert run(0, arch=0x40000003) == eperm  # another ABI


# ---- as an ordinary user (a learner's laptop, an instructor's server account): no box, the same confinement -----
NOBODY = 65534


def _as_nobody(command: list[str], cwd, env: dict, timeout: float = 300):
    """Run `command` as an unprivileged user. Where this Python lies below a folder others cannot enter (root's
    home, as pyenv puts it), it runs in a mount namespace of its own in which that folder is an open tmpfs holding
    just the way to the interpreter (the test's view of a machine whose Python an ordinary user can run)."""
    import shlex
    import stat
    import subprocess

    needed = {os.path.realpath(sys.executable), os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix),
              os.path.realpath(os.path.dirname(sandbox.__file__))}
    blockers = sorted({str(a) for path in needed for a in __import__("pathlib").Path(path).parents
                       if a != a.parent and not os.stat(a).st_mode & stat.S_IXOTH}, key=len)
    script = []
    if blockers:
        top = blockers[0]
        children = sorted({os.path.relpath(path, top).split(os.sep)[0] for path in needed if path.startswith(top + "/")})
        stash = f"/tmp/kata-stash-{os.getpid()}"
        script.append(f"mkdir -p {stash}")
        for child in children:
            script.append(f"mkdir -p {stash}/{child} && mount --bind {shlex.quote(top)}/{child} {stash}/{child}")
        script.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(top)}")
        for child in children:
            script.append(f"mkdir -p {shlex.quote(top)}/{child} && mount --bind {stash}/{child} {shlex.quote(top)}/{child}")
    script.append("exec setpriv --reuid=%d --regid=%d --clear-groups %s" % (NOBODY, NOBODY, shlex.join(command)))
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", " && ".join(script)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@ROOT_ONLY
def test_as_an_ordinary_user_graded_code_is_confined_the_same_way_without_a_box(toy, tmp_path_factory):
    import shutil
    import stat
    import subprocess

    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("setpriv and unshare (util-linux) are not installed here")
    home = tmp_path_factory.mktemp("laptop")
    for folder in (home, *home.parents):  # a folder an ordinary user can enter, as a learner's home is theirs
        if folder == folder.parent:
            break
        folder.chmod(folder.stat().st_mode | stat.S_IXOTH)
    project = home / "course"
    shutil.copytree(toy.pytester.path, project)
    for path in [project, *project.rglob("*")]:
        os.chown(path, NOBODY, NOBODY)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "PYTHONPATH": str(project),
           "PYTHONDONTWRITEBYTECODE": "1"}
    probe = _as_nobody([sys.executable, "-c", "import subprocess, sys, torch, diffusion_katas.engine.runner; "
                                              "subprocess.run([sys.executable, '-c', 'import torch'], check=True)"],
                       project, env)
    if probe.returncode != 0:
        pytest.skip(f"this Python or the package cannot be read by an unprivileged user here: {probe.stderr[-300:]}")
    (project / "secret.txt").write_text("the user's own file, beside the course\n")
    os.chown(project / "secret.txt", NOBODY, NOBODY)
    (project / "katas" / "01_toy.py").write_text('''"""Lab 01 · Toy lab"""
import os, signal, torch


def double(x):
    assert os.getuid() == %d, os.getuid()  # no box: the user's own uid
    for attempt in (lambda: open(os.path.join(os.path.dirname(__file__), "..", "secret.txt")).read(),
                    lambda: open(os.path.join(os.path.dirname(__file__), "planted.py"), "w"),
                    lambda: os.kill(os.getppid(), signal.SIGKILL),
                    lambda: open("/proc/%%d/cmdline" %% os.getppid()).read()):
        try:
            attempt()
        except OSError:
            continue
        raise AssertionError("not refused")
    return x * 2


def normalize(x):
    return x / x.norm()


def stay_put(x):
    return x
''' % NOBODY)
    os.chown(project / "katas" / "01_toy.py", NOBODY, NOBODY)
    done = _as_nobody([sys.executable, "-m", "pytest", "katas", "-p", "no:cacheprovider", "-q"], project, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert not (project / "katas" / "planted.py").exists()
    if sandbox._landlock_abi() == 0:
        pytest.skip("no Landlock in this kernel: the ordinary user's confinement is seccomp and rlimits only")


def test_code_below_a_library_folder_is_trusted_unless_that_folder_holds_a_kata_file(tmp_path):
    # A venv that reads another environment's packages through a .pth file imports libraries from a folder
    # outside its prefix: the runner trusts the folders it started with. But a folder that holds a kata file
    # (a course put on the path) is the learner's, and so is every module beside the kata.
    from diffusion_katas.engine import sandbox

    libs, course = tmp_path / "libs", tmp_path / "course"
    kata = str(course / "katas" / "01_forward_noise.py")
    untrusted = sandbox.untrusted_code((str(libs), str(course)), frozenset({kata}))

    def code(filename):
        return compile("pass", filename, "exec")

    assert not untrusted(code(str(libs / "torch" / "serialization.py")))
    assert untrusted(code(kata))
    assert untrusted(code(str(course / "katas" / "helpers.py")))
    assert untrusted(code(str(tmp_path / "elsewhere.py")))
    assert untrusted(code("<string>"))
