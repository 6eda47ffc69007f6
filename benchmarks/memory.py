"""Benchmark the memory lab's solutions against diffusers, and the cost of grading one kata.

    python benchmarks/memory.py [--sizes 24 48 96] [--runs 5]

Prints, in one run:
1. tiled VAE decode: the solution's tiled_decode vs diffusers' AutoencoderKL.tiled_decode vs untiled
   decode, peak live tensor bytes and FLOPs (deterministic counts: the same on every machine), on the
   x8 tiny VAE at several output sizes;
2. on a CUDA GPU (`--gpu`), the lab's GPU budgets as ratios to their references on the same GPU: tiled decode
   of an SD-sized float16 VAE at 1024² and 2048² (the solution, diffusers' tiled_decode, untiled decode and the
   two wrong-cost twins of tests/labs/test_budget_twins.py) and chunked attention over 16384 tokens (the
   solution, the naive softmax(QKᵀ)V, the twin that materialises the score matrix, and SDPA for scale), each
   time the median of `--runs` CUDA-event timings after 2 warm-ups, each peak the median of `--runs` runs;
3. the wall time of grading one kata file (`python -m pytest katas/01_forward_noise.py`, untouched and
   solved) and the whole course against the floor `python -c "import torch"`, median of several runs (wall clocks swing on shared machines:
   read the ratio, not the milliseconds).
This is a script, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def solution(lab: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{lab}", ROOT / "solutions" / f"{lab}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiled_decode_table(sizes: list[int]) -> list[str]:
    import torch

    from diffusion_katas.engine import tiny
    from diffusion_katas.engine.meters import flops, human, peak_bytes

    torch.set_num_threads(1)
    torch.manual_seed(0)
    mine = solution("11_memory").tiled_decode
    vae = tiny.vae(downsample=8, sample_size=64)  # tiles: 8 latents = 64 px, overlap 0.25
    rows = ["| output | method | peak live bytes | vs untiled | FLOPs | vs untiled |",
            "|---|---|---|---|---|---|"]
    for n in sizes:
        z = torch.randn(1, 4, n, n)
        methods = {
            "untiled decode": lambda: vae.decoder(vae.post_quant_conv(z)),
            "diffusers tiled_decode": lambda: vae.tiled_decode(z).sample,
            "solution tiled_decode": lambda: mine(vae, z, 8, 0.25),
        }
        measured = {name: (peak_bytes(fn)[0], flops(fn)[0]) for name, fn in methods.items()}
        base_bytes, base_flops = measured["untiled decode"]
        for name, (b, f) in measured.items():
            rows.append(f"| {n * 8}² | {name} | {human(b, 'bytes')} | {b / base_bytes:.2f}x | "
                        f"{human(f, 'FLOPs')} | {f / base_flops:.2f}x |")
    return rows


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpu_tables(runs: int) -> list[str]:
    """The `cuda` budgets' measurements on this machine's GPU, with the allowances the grader holds them to."""
    import copy
    import textwrap

    import torch
    import torch.nn.functional as F

    from diffusion_katas.engine.meters import cuda_peak_bytes, cuda_time_ms, human

    if not torch.cuda.is_available():
        return ["(no CUDA device here: the GPU budgets are measured on a GPU; docs/gpu-budgets.md has the figures)"]
    grader = _load(ROOT / "graders" / "11_memory.py", "_bench_grader_11")
    sys.path[:0] = [str(ROOT / "tests" / "labs"), str(ROOT / "tests")]
    twins = importlib.import_module("test_budget_twins")
    mine = solution("11_memory")

    def twin(body: str, signature: str):
        namespace = dict(vars(mine))
        exec(f"def twin({signature}):\n" + textwrap.indent(textwrap.dedent(body), "    "), namespace)
        return namespace["twin"]

    decode_args = "vae, latents, tile_latent_size, overlap_factor=0.25"
    whole_decoded_too = twin(twins.whole_decoded_too(), decode_args)
    float32_decode = twin(twins.float32_decode(), decode_args)
    full_scores = twin(twins.GPU_TWINS[2][3](), "query, key, value, chunk_size, attn_mask=None, scale=None")

    def median(measure, make) -> float:
        """Median of `runs` peaks, each of a fresh `make()` (a twin may convert its VAE in place)."""
        return statistics.median(measure(make()) for _ in range(runs))

    def measured_rows(label: str, methods: dict, time_allowed: float, peak_allowed: float) -> list[str]:
        """One row per method: its median time and peak, each as a ratio to the first method's (the reference)."""
        measured = {}
        for name, make in methods.items():
            with torch.no_grad():
                measured[name] = (cuda_time_ms(make(), warmup=2, runs=runs), median(cuda_peak_bytes, make))
            torch.cuda.empty_cache()
        ref_ms, ref_peak = next(iter(measured.values()))
        return [f"| {label} | {name} | {ms:.2f} ms | {ms / ref_ms:.2f}x | {time_allowed}x | {human(peak, 'bytes')} | "
                f"{peak / ref_peak:.2f}x | {peak_allowed}x |" for name, (ms, peak) in measured.items()]

    props = torch.cuda.get_device_properties(0)
    rows = [f"GPU: {props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA "
            f"{torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}",
            "", f"Times: median of {runs} CUDA-event timings after 2 warm-ups; peaks: median of {runs} runs.", "",
            "| budget | method | time | vs reference | allowed | peak CUDA memory | vs reference | allowed |",
            "|---|---|---|---|---|---|---|---|"]
    vae = grader._sd_vae_cuda()
    grader.configure_tiling(vae, 64, 0.25)
    for pixels in (1024, 2048):
        z = torch.randn((1, 4, pixels // 8, pixels // 8), generator=torch.Generator().manual_seed(0))
        z = z.to("cuda", torch.float16)
        methods = {  # name -> make(): a fresh callable (a fresh VAE copy where the method changes its VAE)
            "diffusers tiled_decode (reference)": lambda: (lambda: vae.tiled_decode(z).sample),
            "solution": lambda: (lambda: mine.tiled_decode(vae, z, 64, 0.25)),
            "untiled decode": lambda: (lambda: vae.decoder(vae.post_quant_conv(z))),
            "twin: the whole latent decoded too, kept to the end":
                lambda: (lambda: whole_decoded_too(vae, z, 64, 0.25)),
            "twin: a float32 decode of the float16 VAE":
                lambda: (lambda v=copy.deepcopy(vae): float32_decode(v, z, 64, 0.25)),
        }
        rows += measured_rows(f"tiled_decode {pixels}²", methods, grader.GPU_DECODE_TIME, grader.GPU_DECODE_PEAK)
    q, k, v = (torch.randn((1, 8, 16384, 64), generator=torch.Generator().manual_seed(i)).to("cuda", torch.float16)
               for i in range(3))
    methods = {
        "naive softmax(QKᵀ)V (reference)": lambda: (lambda: (q @ k.transpose(-2, -1) * 0.125).softmax(-1) @ v),
        "solution, chunks of 1024": lambda: (lambda: mine.chunked_attention(q, k, v, 1024)),
        "twin: the whole score matrix": lambda: (lambda: full_scores(q, k, v, 1024)),
        "F.scaled_dot_product_attention (for scale)": lambda: (lambda: F.scaled_dot_product_attention(q, k, v)),
    }
    rows += measured_rows("chunked_attention 16384 tokens", methods, grader.GPU_ATTENTION_TIME, grader.GPU_ATTENTION_PEAK)
    return rows


def wall(cmd: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def grading_time_table(runs: int) -> list[str]:
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    commands = [
        ("python -c \"import torch\"", [sys.executable, "-c", "import torch"], runs),
        ("python -m pytest katas/01_forward_noise.py (untouched: all TODO)", pytest + ["katas/01_forward_noise.py"], runs),
        ("python -m pytest katas/01_forward_noise.py --solutions", pytest + ["katas/01_forward_noise.py", "--solutions"], runs),
        ("python -m pytest --solutions (all twelve labs)", pytest + ["--solutions"], max(1, runs // 2)),
    ]
    rows = ["| command | median wall time | vs floor |", "|---|---|---|"]
    floor = None
    for label, cmd, n in commands:
        seconds = wall(cmd, n)
        floor = floor or seconds
        rows.append(f"| `{label}` | {seconds:.2f} s | {seconds / floor:.2f}x |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[24, 48, 96], help="latent sizes (x8 = pixels)")
    parser.add_argument("--runs", type=int, default=5, help="runs per wall-time median")
    parser.add_argument("--gpu", action="store_true", help="the GPU budgets' measurements (needs CUDA)")
    parser.add_argument("--gpu-only", action="store_true", help="the GPU measurements alone")
    args = parser.parse_args(argv)
    if args.gpu or args.gpu_only:
        print("GPU budgets (lab 11), as ratios to their references on the same GPU\n")
        print("\n".join(gpu_tables(max(args.runs, 5))), flush=True)
        if args.gpu_only:
            return 0
        print()
    print("Tiled VAE decode (x8 tiny VAE, tile 64 px, overlap 0.25, batch 1)\n")
    print("\n".join(tiled_decode_table(args.sizes)))
    print(f"\nGrading one kata (median of {args.runs})\n")
    print("\n".join(grading_time_table(args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
