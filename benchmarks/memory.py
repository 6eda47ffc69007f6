"""Benchmark the memory lab's solutions against diffusers, and the cost of grading one kata.

    python benchmarks/memory.py [--sizes 24 48 96] [--runs 5]

Prints, in one run:
1. tiled VAE decode: the solution's tiled_decode vs diffusers' AutoencoderKL.tiled_decode vs untiled
   decode, peak live tensor bytes and FLOPs (deterministic counts: the same on every machine), on the
   x8 tiny VAE at several output sizes;
2. the wall time of grading one kata file (`python -m pytest katas/01_forward_noise.py`, untouched and
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
    args = parser.parse_args(argv)
    print("Tiled VAE decode (x8 tiny VAE, tile 64 px, overlap 0.25, batch 1)\n")
    print("\n".join(tiled_decode_table(args.sizes)))
    print(f"\nGrading one kata (median of {args.runs})\n")
    print("\n".join(grading_time_table(args.runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
