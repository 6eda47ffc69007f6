"""The one trained model of the course: a tiny class-conditional UNet2DModel that draws coloured shapes.

Every other model in the course is random-weight; this one is trained (scripts/train_tiny.py, minutes on a
CPU) on images this module draws itself, so a learner's own sampler can draw something recognisable
(`kata see`). Nothing is downloaded: the data is procedural and the weights ship in the package
(engine/weights/tiny-shapes/, loaded with `UNet2DModel.from_pretrained` on that local folder).

The data: 16×16 RGB in [-1, 1], a black background and one filled shape (class 0 circle, 1 square,
2 triangle) in one of four saturated colours, at a random size and place. Class index 3 is the null class
(labels dropped to it 10% of the time in training), so classifier-free guidance has something to do.
"""
from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

WEIGHTS = Path(__file__).resolve().parent / "weights" / "tiny-shapes"
SIZE = 16
CLASSES = ("circle", "square", "triangle")
NULL_CLASS = len(CLASSES)
# red, green, blue, yellow in [-1, 1]
PALETTE = ((1.0, -1.0, -1.0), (-1.0, 1.0, -1.0), (-1.0, -1.0, 1.0), (1.0, 1.0, -1.0))
# The fixed-seed sample recorded with the weights (info.json and reference_sample.safetensors).
REFERENCE = dict(seed=0, steps=25, labels=(0, 1, 2, 0, 1, 2))


# ---- the data ------------------------------------------------------------------------------------------
def draw(labels, generator):
    """(B, 3, 16, 16) images in [-1, 1] of the shapes named by `labels` (B ints in 0..2), at random sizes,
    places and colours drawn from `generator`."""
    import torch

    labels = torch.as_tensor(labels, dtype=torch.long)
    b = labels.numel()
    r = 3.0 + 3.0 * torch.rand(b, generator=generator)  # half-size 3..6 pixels
    cx = r + (SIZE - 2 * r) * torch.rand(b, generator=generator)
    cy = r + (SIZE - 2 * r) * torch.rand(b, generator=generator)
    colour = torch.randint(len(PALETTE), (b,), generator=generator)
    y, x = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    x, y = x[None], y[None]  # (1, H, W)
    dx, dy = x - cx[:, None, None], y - cy[:, None, None]
    rr = r[:, None, None]
    circle = dx**2 + dy**2 <= rr**2
    square = (dx.abs() <= 0.85 * rr) & (dy.abs() <= 0.85 * rr)
    # apex at the top, base at the bottom: the half-width grows from 0 to r over the height 2r
    triangle = (dy.abs() <= rr) & (dx.abs() <= (dy + rr) / 2)
    masks = torch.stack([circle, square, triangle])  # (3, B, H, W)
    mask = masks[labels, torch.arange(b)]  # (B, H, W)
    rgb = torch.tensor(PALETTE)[colour]  # (B, 3)
    return torch.where(mask[:, None], rgb[:, :, None, None], torch.tensor(-1.0))


def stands_out(images) -> list[tuple[float, float]]:
    """Per image in [0, 1]: (the fraction of bright pixels, the brightness gap between them and the rest),
    brightness being the largest channel: one saturated shape on a dark background has both well above 0."""
    found = []
    for image in images.float():
        v = image.max(dim=0).values
        bright = v > 0.6
        gap = float(v[bright].mean() - v[~bright].mean()) if 0 < int(bright.sum()) < v.numel() else 0.0
        found.append((float(bright.float().mean()), gap))
    return found


def classify(images) -> list[int | None]:
    """The shape class each image in [-1, 1] shows; None when no single shape stands out of the background.

    The shape is the largest 4-connected region brighter than the midpoint between the image's dark and
    bright levels (brightness: the largest channel), which leaves the model's background speckle out. Then:
    a triangle (apex up) holds far less of its area in the top half of its bounding box than in the bottom
    half; a square fills the corners of its bounding box, a circle does not."""
    import torch

    found = []
    for image in images.float():
        v = image.max(dim=0).values
        low, high = float(v.flatten().quantile(0.2)), float(v.flatten().quantile(0.95))
        if high - low < 0.5:  # nothing stands out
            found.append(None)
            continue
        region = _largest_region(v > (low + high) / 2)
        count = int(region.sum())
        if count < 6 or count > 0.8 * region.numel():
            found.append(None)
            continue
        rows, cols = torch.nonzero(region.any(dim=1)).flatten(), torch.nonzero(region.any(dim=0)).flatten()
        box = region[int(rows.min()):int(rows.max()) + 1, int(cols.min()):int(cols.max()) + 1].float()
        h, w = box.shape
        top, bottom = float(box[: h // 2].sum()), float(box[(h + 1) // 2:].sum())
        if top < 0.6 * bottom:
            found.append(2)
            continue
        k = max(1, min(h, w) // 5)  # the four corner patches, a fifth of the side each
        corners = torch.stack([box[:k, :k].mean(), box[:k, -k:].mean(), box[-k:, :k].mean(), box[-k:, -k:].mean()])
        found.append(1 if float(corners.mean()) > 0.3 else 0)
    return found


def _largest_region(mask):
    """The largest 4-connected region of a 2-D bool mask, as a mask."""
    import torch

    seen = torch.zeros_like(mask)
    best = torch.zeros_like(mask)
    h, w = mask.shape
    for start in torch.nonzero(mask).tolist():
        if seen[start[0], start[1]]:
            continue
        region, stack = [], [tuple(start)]
        seen[start[0], start[1]] = True
        while stack:
            y, x = stack.pop()
            region.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        if len(region) > int(best.sum()):
            best = torch.zeros_like(mask)
            for y, x in region:
                best[y, x] = True
    return best


# ---- the model -----------------------------------------------------------------------------------------
def new_unet():
    """The architecture, untrained: two resolutions, no attention (~0.4 M parameters)."""
    from diffusers.models.unets.unet_2d import UNet2DModel

    return UNet2DModel(
        sample_size=SIZE, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32, 64),
        norm_num_groups=8, down_block_types=("DownBlock2D",) * 3, up_block_types=("UpBlock2D",) * 3,
        num_class_embeds=len(CLASSES) + 1,
    )


def load(folder: Path | None = None):
    """(unet, scheduler) from the shipped folder, with the real diffusers classes, in eval mode."""
    folder = WEIGHTS if folder is None else folder
    from diffusers.models.unets.unet_2d import UNet2DModel
    from diffusers.schedulers.scheduling_ddpm import DDPMScheduler

    import torch

    # stored in float16 (half the bytes); computed in float32
    unet = UNet2DModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
    scheduler = DDPMScheduler.from_pretrained(folder)
    return unet, scheduler


def with_labels(unet, labels):
    """`unet` answering `unet(x, t)` as the class-conditional model of `labels` (one per sample): a forward
    pre-hook fills in class_labels, so a sampler written for an unconditional UNet (lab 05) drives it
    unchanged, and the pipelines see the real UNet2DModel. The hook pickles (it crosses to the runner)."""
    import torch

    unet.register_forward_pre_hook(functools.partial(_fill_labels, torch.as_tensor(labels)), with_kwargs=True)
    return unet


def _fill_labels(labels, module, args, kwargs):
    if kwargs.get("class_labels") is None and (len(args) < 3 or args[2] is None):
        batch = (args[0] if args else kwargs["sample"]).shape[0]
        kwargs = {**kwargs, "class_labels": labels.repeat(-(-batch // len(labels)))[:batch]}
    return args, kwargs


def ddim_sample(unet, scheduler_config, labels, seed: int, steps: int):
    """diffusers' own DDIMPipeline (η = 0) on `unet` conditioned on `labels`: (B, 3, 16, 16) in [0, 1]."""
    import torch
    from diffusers.pipelines.ddim.pipeline_ddim import DDIMPipeline
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    pipe = DDIMPipeline(unet=with_labels(unet, labels), scheduler=DDIMScheduler.from_config(scheduler_config))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(batch_size=len(labels), generator=torch.Generator().manual_seed(seed), num_inference_steps=steps,
                   output_type="pt")
    unet._forward_pre_hooks.clear()
    return out.images


def sample_hash(images) -> str:
    """sha256 of the images as float32 bytes (first 16 hex digits)."""
    return hashlib.sha256(images.float().contiguous().numpy().tobytes()).hexdigest()[:16]


def info(folder: Path | None = None) -> dict:
    folder = WEIGHTS if folder is None else folder
    return json.loads((folder / "info.json").read_text(encoding="utf-8"))


# ---- training ------------------------------------------------------------------------------------------
CHECKPOINT = 25  # the step whose weights info.json fingerprints: a test retrains this far and compares


def fingerprint(model) -> list[float]:
    """A few numbers that move with every weight: per parameter tensor, its float64 sum and sum of squares."""
    import torch

    with torch.no_grad():
        return [round(float(v), 9) for p in model.parameters() for v in (p.double().sum(), p.double().square().sum())]


def train(folder: Path | None, steps: int, batch: int = 32, lr: float = 2e-3, seed: int = 0, threads: int = 1,
          log=print, stop_after: int | None = None):
    """Train the model with the DDPM ε objective on fresh procedural batches, keep an EMA of its weights and
    save the EMA (safetensors) with the DDPM scheduler's config, a fixed-seed sample and info.json.

    With `stop_after=k`: stop after k steps of the same run (the learning-rate schedule still spans `steps`)
    and return the fingerprint of the trained weights, saving nothing: what tests retrain."""
    import time

    import torch
    from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
    from safetensors.torch import save_file

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    unet = new_unet().train()
    ema = new_unet().eval()
    ema.load_state_dict(unet.state_dict())
    scheduler = DDPMScheduler(num_train_timesteps=1000)
    a_bar = scheduler.alphas_cumprod
    opt = torch.optim.AdamW(unet.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    start = time.monotonic()
    for step in range(steps):
        labels = torch.randint(len(CLASSES), (batch,), generator=g)
        x0 = draw(labels, g)
        dropped = torch.rand(batch, generator=g) < 0.1
        cond = torch.where(dropped, torch.full_like(labels, NULL_CLASS), labels)
        t = torch.randint(1000, (batch,), generator=g)
        eps = torch.randn(x0.shape, generator=g)
        ab = a_bar[t].view(-1, 1, 1, 1)
        xt = ab.sqrt() * x0 + (1 - ab).sqrt() * eps
        loss = torch.nn.functional.mse_loss(unet(xt, t, class_labels=cond).sample, eps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for pe, p in zip(ema.parameters(), unet.parameters()):
                pe.lerp_(p, 1 - decay)
        if step + 1 == CHECKPOINT:
            early = {"step": CHECKPOINT, "loss": round(loss.item(), 6), "fingerprint": fingerprint(unet)}
        if stop_after is not None and step + 1 == stop_after:
            return fingerprint(unet)
        if step % 250 == 0 or step == steps - 1:
            log(f"step {step:5d}  loss {loss.item():.4f}  {time.monotonic() - start:6.0f} s")
    seconds = time.monotonic() - start
    folder.mkdir(parents=True, exist_ok=True)
    ema.half().save_pretrained(folder)  # safetensors, float16: half the bytes
    scheduler.save_pretrained(folder)
    shipped, _ = load(folder)  # the sample is what the shipped weights draw
    images = ddim_sample(shipped, scheduler.config, list(REFERENCE["labels"]), REFERENCE["seed"], REFERENCE["steps"])
    save_file({"images": images.contiguous()}, str(folder / "reference_sample.safetensors"))
    found = classify(images * 2 - 1)
    record = {
        "command": f"python3 scripts/train_tiny.py --steps {steps} --batch {batch} --lr {lr} --seed {seed} "
                   f"--threads {threads}",
        "steps": steps, "batch": batch, "lr": lr, "seed": seed, "threads": threads,
        "train_seconds": round(seconds, 1),
        "parameters": sum(p.numel() for p in shipped.parameters()),
        "weights_bytes": (folder / "diffusion_pytorch_model.safetensors").stat().st_size,
        "final_loss": round(loss.item(), 4),
        "checkpoint": early,
        "reference_sample": {**REFERENCE, "labels": list(REFERENCE["labels"]), "pipeline": "DDIMPipeline eta=0",
                             "sha256_16": sample_hash(images), "classified": found},
        "torch": torch.__version__,
    }
    (folder / "info.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
