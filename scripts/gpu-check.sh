#!/usr/bin/env bash
# The GPU budgets on a real GPU, in one run (docs/gpu-budgets.md):
#   1. the machine: GPU, driver, compute mode, torch, CUDA, cuDNN, the GPU's device files;
#   2. the project installed (wheels from .whl/ with --no-index where nothing can be fetched);
#   3. scripts/gpu_runner_probe.py: a forked runner starts CUDA under each layer of the sandbox;
#   4. `python -m pytest -m cuda --solutions -v`: every GPU budget passes for the solutions, graded through the
#      sandboxed runner as any learner's code is;
#      then the whole course with --solutions, as a learner on a GPU runs it;
#   5. `benchmarks/memory.py --gpu-only --runs 7`: the ratios the allowances are calibrated from;
#   6. `python -m pytest -m cuda tests`: the GPU budgets' wrong-cost twins are rejected (tests/labs/
#      test_budget_twins.py), a toy GPU check passes in a sandboxed runner (tests/plugin/test_isolation.py);
#   (the sandbox's own tests passed on the H100's kernel: `python -m pytest tests/plugin/test_sandbox.py`.)
# What breaks a runner outside a learner's call is written to OUT/runner.log (KATA_RUNNER_LOG).
#
#   bash scripts/gpu-check.sh [OUT]        (logs in OUT, default ./gpu-check; a summary on stdout)
# About 7 minutes on an H100 (16 cores); eight logs at most.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-${OUT:-gpu-check}}")
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

step() {  # step NAME LIMIT_S COMMAND...: its log in OUT/NAME.log, its tail and exit status here
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    echo "== $name: exit $rc in $((SECONDS - start)) s"
    tail -n "${TAIL:-12}" "$out/$name.log"
    return $rc
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,compute_mode --format=csv,noheader
    ls -l /dev/nvidia* 2>&1
    uname -r
    "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, 'CUDA', torch.version.cuda,
'cuDNN', torch.backends.cudnn.version(), torch.cuda.is_available() and torch.cuda.get_device_name())"
} >"$out/env.log" 2>&1
cat "$out/env.log"

install_project() {
    if compgen -G "${WHEELS:-.whl}/*.whl" >/dev/null; then
        "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "${WHEELS:-.whl}"/*.whl || return
    fi
    "$py" -m pip install -q --no-index --no-deps --no-build-isolation --disable-pip-version-check -e . || return
    "$py" -c "import diffusers, peft, diffusion_katas; print('diffusers', diffusers.__version__, 'peft', peft.__version__)"
}
export py
export -f install_project
step install 120 bash -c install_project || exit 1

PYTORCH_NVML_BASED_CUDA_CHECK=1 TAIL=20 step probe 90 "$py" scripts/gpu_runner_probe.py
export KATA_RUNNER_LOG=$out/runner.log
pytest=("$py" -m pytest -p no:cacheprovider -rs)
TAIL=20 step solutions 240 "${pytest[@]}" -m cuda --solutions -v
# the whole course as a learner on a GPU runs it: every grader imported by the warm parent before lab 11's GPU
# checks fork from it (an import that starts CUDA there would break them)
TAIL=12 step course 400 "${pytest[@]}" --solutions -q
TAIL=25 step benchmark 200 "$py" benchmarks/memory.py --gpu-only --runs 7
TAIL=20 step tests 300 "${pytest[@]}" -m cuda -v tests
exit 0
