"""Can a runner use this GPU? Each layer of the runner's sandbox alone, then all of them, in a forked child that
starts CUDA by loading a CUDA tensor (as a GPU budget's inputs do), while another process holds a CUDA context
(as the grading process does).

    python scripts/gpu_runner_probe.py

One line per probe: ok, or the error. A diagnostic for scripts/gpu-check.sh; it changes nothing.
"""
from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "plugin"))


def probe(name: str, confine) -> None:
    import torch

    blob = pickle.dumps(torch.zeros(4))  # a CPU tensor's pickle: moved to CUDA in the child
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            confine()
            x = pickle.loads(blob).to("cuda")
            y = pickle.loads(pickle.dumps(x))  # a CUDA tensor's own pickle, as the grader sends one
            message = f"ok ({y.device}, {torch.cuda.get_device_name()})"
        except BaseException as exc:  # noqa: BLE001
            message = f"{type(exc).__name__}: {exc}"
            try:  # under the lock a traceback's frames are refused to this (non-library) file
                message += "\n" + "".join(traceback.format_exc().splitlines(True)[-6:])
            except BaseException:  # noqa: BLE001
                pass
        os.write(write, message.encode()[:8000])
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 8192):
        chunks.append(chunk)
    os.waitpid(pid, 0)
    print(f"{name:<44} {b''.join(chunks).decode(errors='replace')}", flush=True)


def main() -> int:
    import torch  # noqa: F401  (the warm parent has torch imported, CUDA not started)

    from diffusion_katas.core.spec import Kata
    from diffusion_katas.engine import sandbox
    from diffusion_katas.core.course import load_module
    from diffusion_katas.engine.runner_main import warm_locks

    grader = load_module(ROOT / "graders" / "11_memory.py", "diffusion_katas_grader_11")  # as the warm parent
    warm_locks(grader)
    kata = next(v for v in vars(grader).values() if isinstance(v, Kata) and v.name == "chunked_attention")

    holder = subprocess.Popen([sys.executable, "-c", "import torch, time; x = torch.zeros(1, device='cuda'); "
                               "print('holder ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
    print(holder.stdout.readline().strip(), flush=True)
    scratch = tempfile.mkdtemp(prefix="kata-probe-")
    sandbox.prepare(scratch, str(ROOT / "plugin"))
    plan = sandbox.plan()
    print(f"plan: box {plan.box}, landlock ABI {plan.landlock_abi}, devices {plan.devices}", flush=True)

    def layer(fn):
        def confine():
            status = sandbox.Status()
            fn(status)
            if status.missing:
                raise RuntimeError(f"layer not installed: {status.missing}")
        return confine

    probe("nothing (a plain fork)", lambda: None)
    probe("rlimits only", layer(lambda s: sandbox._limits(plan, s)))
    probe("seccomp only", layer(lambda s: (sandbox._no_new_privileges(), sandbox._seccomp(s))))
    if plan.box is not None:
        probe("mounts only", layer(lambda s: sandbox._mounts(plan, s)))
        probe("box user only", layer(lambda s: sandbox._become_box(plan.box, keep_read_search=False, status=s)))
    for env, label in ((dict(KATA_SANDBOX_USER="off", KATA_SANDBOX_LANDLOCK="off"), "enter(): no box, no landlock"),
                       (dict(KATA_SANDBOX_LANDLOCK="off"), "enter(): no landlock"),
                       ({}, "enter(): the whole sandbox")):
        def confine(env=env):
            os.environ.update(env)
            sandbox.prepare(scratch, str(ROOT / "plugin"))  # the plan again, as these settings make it
            status = sandbox.enter([])
            print(f"   ({label}: layers {status.layers}, missing {status.missing})", file=sys.stderr, flush=True)
        probe(label, confine)
    def lock(whole: bool, cuda_first: bool = False):
        def confine():
            from diffusion_katas.engine.isolation import CodeLock
            from diffusion_katas.engine.runner_main import _start_cuda

            if cuda_first:  # as a GPU check's runner does (engine/runner_main.py)
                _start_cuda()
            if whole:
                sandbox.prepare(scratch, str(ROOT / "plugin"))
                sandbox.enter([])
            code_lock = CodeLock(kata.answer_key, kata.name, kata.forbidden_ops, (), kata.answer_key_direct)
            code_lock.install()
            code_lock.arm(tuple(sandbox.plan().library_roots))
            sandbox.forget_ctypes()
        return confine

    probe("the lock and its audit hook only", lock(False))
    probe("enter() and the lock: a runner", lock(True))
    probe("CUDA started, then enter() and the lock", lock(True, cuda_first=True))
    holder.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
