"""Train the course's one trained model: the tiny class-conditional shapes UNet behind `kata see`.

    python3 scripts/train_tiny.py            # the shipped weights: 2000 steps, batch 32, one thread, ~14 min on a loaded machine

It draws its own data (diffusion_katas/engine/shapes.py: 16×16 circles, squares and triangles in four
colours; nothing is downloaded), trains a diffusers UNet2DModel with the DDPM ε objective from fixed seeds
and saves the EMA weights (safetensors), the scheduler config, a fixed-seed DDIM sample and info.json
(command, steps, time, size, the sample's hash) into plugin/diffusion_katas/engine/weights/tiny-shapes/.
tests/test_trained_model.py checks the shipped folder against what it records.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "plugin"))

from diffusion_katas.engine import shapes  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (fixed: results depend on it)")
    parser.add_argument("--out", type=Path, default=shapes.WEIGHTS)
    args = parser.parse_args()
    record = shapes.train(args.out, args.steps, args.batch, args.lr, args.seed, args.threads,
                          log=lambda line: print(line, flush=True))
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
