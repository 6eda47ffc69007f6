"""`kata see LAB`: the learner's own functions draw with the trained shapes model, beside diffusers.

    python -m diffusion_katas.engine.see LAB --root COURSE --out PNG [--solutions] [--seed N] [--steps N]

(`kata see` runs this in a subprocess: the commands import nothing of the engine.) The learner's code runs
in a runner process of its own, exactly as in grading (engine/runner.py), with the lab's reference
functions refused there; the reference pipeline, the comparison and the PNG stay in this process, where
learner code never ran. The picture has three rows of the same seed and class labels: diffusers' samples,
the learner's, and their absolute difference (×4, so a difference of ¼ is white).

Exit status: 0 the picture is written; 2 a function it needs is still TODO (it says which); 3 the lab has
no picture yet; 1 the learner's code failed otherwise (the error is shown) or the picture could not be made.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from diffusion_katas.core.course import Course
from diffusion_katas.engine import shapes

SCALE = 8  # each 16×16 sample is drawn 128×128
GAP = 4
DIFF_GAIN = 4.0
PIPELINE_CALLS = ("diffusers.pipelines.ddpm.pipeline_ddpm.DDPMPipeline.__call__",
                  "diffusers.pipelines.ddim.pipeline_ddim.DDIMPipeline.__call__")


@dataclass(frozen=True)
class Picture:
    """What `kata see` draws for one lab: the learner function it calls and the functions that needs."""

    function: str
    needs: tuple[str, ...]
    what: str


PICTURES = {
    "05_sampling_loop": Picture(
        "generate", ("initial_noise", "sampling_loop", "to_image"),
        "your generate() with DDIMScheduler (η = 0) on the trained shapes UNet, against DDIMPipeline"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kata see")
    parser.add_argument("lab")
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--solutions", action="store_true", help="draw with solutions/ instead of katas/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    course = Course.at(args.root)
    lab = course.resolve_lab(args.lab)
    picture = PICTURES.get(lab)
    if picture is None:
        print(f"kata see: no picture for {lab} yet; it draws for: {', '.join(sorted(PICTURES))}")
        return 3
    source = course.solution(lab) if args.solutions else course.kata(lab)
    if not source.is_file():
        print(f"kata see: {course.rel(source)} does not exist")
        return 1
    os.chdir(course.root)
    return draw_lab(course, lab, picture, source, args)


def draw_lab(course: Course, lab: str, picture: Picture, source: Path, args) -> int:
    import torch
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    from diffusion_katas.engine.runner import RemoteError, Runner, RunnerGone, decode

    torch.set_num_threads(int(os.environ.get("KATA_THREADS", "1")))
    labels = [0, 1, 2] * 2
    unet, scheduler = shapes.load()
    reference = shapes.ddim_sample(unet, scheduler.config, labels, args.seed, args.steps)
    inputs = dict(unet=shapes.with_labels(shapes.load()[0], labels),
                  scheduler=DDIMScheduler.from_config(scheduler.config), batch_size=len(labels),
                  num_inference_steps=args.steps, generator=torch.Generator().manual_seed(args.seed), eta=0.0)
    rel = course.rel(source)
    print(f"kata see {lab}: {picture.what}; seed {args.seed}, {args.steps} steps, labels "
          f"{', '.join(shapes.CLASSES[i] for i in labels)}; your code: {rel}")
    try:
        runner = Runner(source, f"_learner_{lab}", [], PIPELINE_CALLS, picture.function, args.timeout)
    except RunnerGone as gone:
        print(f"importing {rel} ended its process ({gone.how})")
        return 1
    try:
        opened = runner.open_reply
        if opened.get("kind") != "ok":
            print(f"{rel} does not import: {opened.get('type', '')}: {opened.get('message', '')}")
            return 1
        if picture.function not in opened.get("functions", ()):
            print(f"{rel} has no function `{picture.function}` (deleted or renamed?)")
            return 1
        try:
            reply = runner.call(picture.function, inputs)
        except RunnerGone as gone:
            print(f"your {picture.function} did not answer: {gone.how}")
            return 1
    finally:
        sys.stdout.write(runner.printed[-4000:])
        runner.close()
    if reply.get("kind") != "ok":
        return _explain_failure(RemoteError(reply) if reply.get("kind") == "raised" else None, reply, picture,
                                source, rel)
    mine = decode(reply.get("output"))
    if not isinstance(mine, torch.Tensor) or mine.shape != reference.shape:
        shape = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
        print(f"your {picture.function} returned {shape}; the picture needs a tensor shaped {tuple(reference.shape)}")
        return 1
    mine = mine.detach().float().cpu()
    diff = (mine - reference).abs()
    write_png(args.out, [reference, mine.clamp(0, 1), (diff * DIFF_GAIN).clamp(0, 1)],
              ["diffusers DDIMPipeline", f"yours ({picture.function})", f"|yours - diffusers| x{DIFF_GAIN:g}"])
    worst = diff.flatten(1).max(dim=1).values
    print(f"wrote {args.out}")
    print("  rows: diffusers' samples; yours from the same seed and labels; their absolute difference "
          f"(x{DIFF_GAIN:g}, white = 1/{DIFF_GAIN:g} or more)")
    seen = shapes.classify(mine.clamp(0, 1) * 2 - 1)
    print("  your samples read as: " + ", ".join(shapes.CLASSES[c] if c is not None else "no clear shape"
                                                   for c in seen))
    if torch.equal(mine, reference):
        print("  identical to diffusers, bit for bit")
    else:
        print(f"  max |difference| {float(diff.max()):.3g} (per sample: "
              + ", ".join(f"{float(w):.2g}" for w in worst) + ")")
    return 0


def _explain_failure(error, reply: dict, picture: Picture, source: Path, rel: str) -> int:
    if error is not None and error.is_a("NotImplementedError"):
        # the innermost frame in the learner's file is the function still to write
        mine = [f for f in error.frames if f and str(f[0]) == str(source)]
        name = str(mine[-1][2]) if mine else picture.function
        line = f":{mine[-1][1]}" if mine else ""
        print(f"`{name}` is still TODO ({rel}{line}). The picture draws with your {picture.function}(), which "
              f"uses {', '.join(picture.needs)}: write them (python -m pytest {rel} grades them), then run "
              "kata see again.")
        return 2
    if error is not None:
        where = "".join(f"\n    {f[0]}:{f[1]} in {f[2]}" for f in error.frames[-3:] if f)
        print(f"your {picture.function} raised {error.type_name}: {error.message}{where}")
        return 1
    print(f"your {picture.function} could not be run ({reply.get('kind')})")
    return 1


def write_png(path: Path, rows: list, titles: list[str]) -> None:
    """Rows of (B, 3, H, W) images in [0, 1], each under its title, as one PNG (Pillow, a diffusers dependency)."""
    import numpy as np
    from PIL import Image, ImageDraw

    title_h = 14
    b, _, h, w = rows[0].shape
    cell_w, cell_h = w * SCALE, h * SCALE
    width = GAP + b * (cell_w + GAP)
    height = len(rows) * (title_h + cell_h + GAP) + GAP
    canvas = Image.new("RGB", (width, height), (40, 40, 40))
    draw = ImageDraw.Draw(canvas)
    y = GAP
    for images, title in zip(rows, titles):
        draw.text((GAP, y), title, fill=(230, 230, 230))
        y += title_h
        for i, image in enumerate(images):
            pixels = (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
            tile = Image.fromarray(pixels, "RGB").resize((cell_w, cell_h), Image.NEAREST)
            canvas.paste(tile, (GAP + i * (cell_w + GAP), y))
        y += cell_h + GAP
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, format="PNG")


if __name__ == "__main__":
    sys.exit(main())
