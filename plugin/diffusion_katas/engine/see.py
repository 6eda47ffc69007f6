"""`kata see LAB`: the learner's own functions draw with the trained shapes model, beside diffusers.

    python -m diffusion_katas.engine.see LAB --root COURSE --out PNG [--solutions] [--seed N] [--steps N]

(`kata see` runs this in a subprocess: the commands import nothing of the engine.) The learner's code runs
in a runner process of its own, exactly as in grading (engine/runner.py), with the lab's reference
functions refused there; the reference, the comparison and the PNG stay in this process, where learner code
never ran. What each lab draws (PICTURES):

- 01: the learner's ᾱ_t and log-SNR curves of the three β schedules over diffusers' (DDPMScheduler), and one
  shapes image noised by the learner's add_noise at six timesteps, beside diffusers' and their difference.
- 02: a DDIM run of the trained model (η = 0) stepped by the learner's ddim_step: diffusers' samples, the
  learner's and their difference; then one sample's x̂₀ over the steps (diffusers' pred_original_sample and the
  learner's predict_x0 on the learner's own trajectory) and their difference.
- 05: the learner's generate() against DDIMPipeline: diffusers' samples, the learner's, their difference.
- 15: the 2-D toy set (engine/toy2d.py): the learner's edm_sample carries Gaussian noise onto two moons with the
  ideal EDM network for them, beside diffusers' EDMEulerScheduler loop from the same noise, as scatter plots.

Differences are drawn ×4, so a difference of ¼ is white.

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
DIFF_TITLE = f"|yours - diffusers| x{DIFF_GAIN:g}   (black: the same; white: 1/{DIFF_GAIN:g} or more apart)"
PIPELINE_CALLS = ("diffusers.pipelines.ddpm.pipeline_ddpm.DDPMPipeline.__call__",
                  "diffusers.pipelines.ddim.pipeline_ddim.DDIMPipeline.__call__")


@dataclass(frozen=True)
class Picture:
    """What `kata see` draws for one lab: the learner function it calls (the first of `needs`, for messages),
    the functions that needs, and what the picture shows."""

    function: str
    needs: tuple[str, ...]
    what: str
    draw: str  # the drawing function of this module


PICTURES = {
    "01_forward_noise": Picture(
        "add_noise", ("linear_betas", "scaled_linear_betas", "cosine_betas", "alphas_cumprod", "add_noise"),
        "your β schedules as ᾱ_t and log-SNR curves over DDPMScheduler's, and your add_noise on a shapes image",
        "draw_schedules"),
    "02_denoising_step": Picture(
        "ddim_step", ("predict_x0", "ddim_step"),
        "your ddim_step driving the trained shapes UNet (η = 0), against DDIMScheduler.step; x̂₀ over the steps",
        "draw_ddim_steps"),
    "15_karras_edm": Picture(
        "edm_sample", ("edm_model_inputs", "edm_denoised", "edm_euler_step", "edm_sample"),
        "your edm_sample carrying noise onto the two-moons toy set (its ideal EDM network), against "
        "EDMEulerScheduler", "draw_moons"),
    "23_training_objective": Picture(
        "sd3_loss_weighting", ("min_snr_weights", "sd3_loss_weighting", "timestep_density"),
        "your loss weights over t and σ and your timestep densities, over the training scripts' (Min-SNR-γ on "
        "compute_snr, compute_loss_weighting_for_sd3, compute_density_for_timestep_sampling)", "draw_weights"),
    "24_img2img_inpainting": Picture(
        "blend_known_region", ("img2img_timesteps", "blend_known_region"),
        "your img2img_timesteps and blend_known_region inpainting the trained shapes UNet's masked images "
        "(DDIM, strength 0.8), against the pipeline's own blend", "draw_inpainting"),
    "05_sampling_loop": Picture(
        "generate", ("initial_noise", "sampling_loop", "to_image"),
        "your generate() with DDIMScheduler (η = 0) on the trained shapes UNet, against DDIMPipeline",
        "draw_generate"),
}


class Stop(Exception):
    """The picture cannot be made: the exit status and what to print."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


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
    todo = [f for f in course.untouched_todos(lab) if f in picture.needs] if not args.solutions else []
    if todo:  # read from the file (still its TODO stub), before anything is imported or run
        rel = course.rel(source)
        print(f"kata see {lab}: `{todo[0]}` is still TODO ({rel}). The picture draws with your "
              f"{', '.join(picture.needs)}: write them (python -m pytest {rel} grades them), then run kata see again.")
        return 2
    os.chdir(course.root)
    return draw_lab(course, lab, picture, source, args)


class Learner:
    """The learner's kata file in a runner process of its own: call(function, **inputs) -> its output."""

    def __init__(self, course: Course, lab: str, picture: Picture, source: Path, timeout: float):
        from diffusion_katas.engine.runner import Runner, RunnerGone

        self.picture, self.source, self.rel = picture, source, course.rel(source)
        answer_key = tuple(PIPELINE_CALLS)
        try:
            answer_key += tuple(path for kata in course.graders_of(lab) for path in kata.answer_key)
        except Exception:  # noqa: BLE001  (no grader to read: the pipelines alone are refused)
            pass
        try:
            self.runner = Runner(source, f"_learner_{lab}", [], answer_key, picture.function, timeout, memory=4 * 2**30)
        except RunnerGone as gone:
            raise Stop(1, f"importing {self.rel} ended its process ({gone.how})") from None
        opened = self.runner.open_reply
        if opened.get("kind") != "ok":
            self.close()
            raise Stop(1, f"{self.rel} does not import: {opened.get('type', '')}: {opened.get('message', '')}")
        self.functions = opened.get("functions", ())

    def call(self, function: str, **inputs):
        from diffusion_katas.engine.runner import RemoteError, RunnerGone, decode

        if function not in self.functions:
            raise Stop(1, f"{self.rel} has no function `{function}` (deleted or renamed?)")
        try:
            reply = self.runner.call(function, inputs)
        except RunnerGone as gone:
            raise Stop(1, f"your {function} did not answer: {gone.how}") from None
        if reply.get("kind") != "ok":
            error = RemoteError(reply) if reply.get("kind") == "raised" else None
            raise Stop(*_failure(error, reply, function, self.picture, self.source, self.rel))
        return decode(reply.get("output"))

    def close(self) -> None:
        sys.stdout.write(self.runner.printed[-4000:])
        self.runner.close()


def draw_lab(course: Course, lab: str, picture: Picture, source: Path, args) -> int:
    import torch

    torch.set_num_threads(int(os.environ.get("KATA_THREADS", "1")))
    print(f"kata see {lab}: {picture.what}; seed {args.seed}; your code: {course.rel(source)}")
    try:
        learner = Learner(course, lab, picture, source, args.timeout)
    except Stop as stop:
        print(stop)
        return stop.code
    try:
        blocks, notes = globals()[picture.draw](learner, args)
    except Stop as stop:
        print(stop)
        return stop.code
    finally:
        learner.close()
    compose_png(args.out, blocks)
    print(f"wrote {args.out}")
    for line in notes:
        print("  " + line)
    return 0


def _tensor(value, function: str, shape) -> "torch.Tensor":
    import torch

    if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(shape):
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise Stop(1, f"your {function} returned {got}; the picture needs a tensor shaped {tuple(shape)}")
    return value.detach().float().cpu()


def _compared(reference, mine) -> list[str]:
    diff = (mine - reference).abs()
    if diff.numel() and bool(torch_equal(mine, reference)):
        return ["identical to diffusers, bit for bit"]
    worst = diff.flatten(1).max(dim=1).values
    if len(worst) > 8:  # a cloud of points, not a row of images: how many are off, not each one
        off = int((worst > 1e-3).sum())
        return [f"max |difference| {float(diff.max()):.3g}; {off} of {len(worst)} samples differ by more than 1e-3"]
    return [f"max |difference| {float(diff.max()):.3g} (per image: " + ", ".join(f"{float(w):.2g}" for w in worst) + ")"]


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)


# ---- 01: schedules ---------------------------------------------------------------------------------------
def draw_schedules(learner: Learner, args):
    import torch
    from diffusers.schedulers.scheduling_ddpm import DDPMScheduler

    T = 1000
    schedules = [("linear", dict(beta_schedule="linear", beta_start=1e-4, beta_end=0.02),
                  "linear_betas", dict(beta_start=1e-4, beta_end=0.02, num_train_timesteps=T)),
                 ("scaled_linear", dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012),
                  "scaled_linear_betas", dict(beta_start=0.00085, beta_end=0.012, num_train_timesteps=T)),
                 ("cosine", dict(beta_schedule="squaredcos_cap_v2"), "cosine_betas", dict(num_train_timesteps=T))]
    abar, series_abar, series_snr, notes = {}, [], [], []
    for (name, config, function, kwargs), colour in zip(schedules, CURVE_COLOURS):
        theirs = DDPMScheduler(num_train_timesteps=T, **config).alphas_cumprod.double()
        betas = _tensor(learner.call(function, **kwargs), function, (T,))
        mine = _tensor(learner.call("alphas_cumprod", betas=betas), "alphas_cumprod", (T,)).double()
        abar[name] = theirs
        for series, f in ((series_abar, lambda a: a), (series_snr, _log_snr)):
            series += [(f(theirs), colour, f"{name} (diffusers)", False), (f(mine), colour, f"{name} (yours)", True)]
        worst = float((mine - theirs).abs().max())
        notes.append(f"{name}: max |your ᾱ − diffusers' ᾱ| {worst:.3g}"
                     + (" (the curves coincide)" if worst < 1e-5 else ""))
    # one image of each shape, noised at six timesteps with the trained model's (linear) table
    g = torch.Generator().manual_seed(args.seed)
    x0 = shapes.draw([0], g).repeat(6, 1, 1, 1)
    noise = torch.randn(x0.shape, generator=g)
    timesteps = torch.tensor([0, 100, 250, 500, 750, 999])
    table = DDPMScheduler(num_train_timesteps=T, beta_schedule="linear").alphas_cumprod
    theirs = DDPMScheduler(num_train_timesteps=T, beta_schedule="linear").add_noise(x0, noise, timesteps)
    mine = _tensor(learner.call("add_noise", x0=x0, noise=noise, alphas_cumprod=table, timesteps=timesteps),
                   "add_noise", x0.shape)
    show = [(theirs / 2 + 0.5).clamp(0, 1), (mine / 2 + 0.5).clamp(0, 1)]
    blocks = [("plots", [("alpha_bar_t over t (solid: diffusers, dotted: yours)", series_abar, (0.0, 1.0)),
                         ("log SNR = log(alpha_bar / (1 - alpha_bar)) over t", series_snr, (-14.0, 10.0))]),
              ("images", [*show, ((mine - theirs).abs() / 2 * DIFF_GAIN).clamp(0, 1)],
               ["DDPMScheduler.add_noise at t = 0, 100, 250, 500, 750, 999", "your add_noise (same x0, noise, table)",
                DIFF_TITLE])]
    notes = ["curves: ᾱ_t and log SNR of the linear, scaled_linear and cosine schedules (T = 1000); yours dotted "
             "over diffusers' solid line"] + notes + [
        "images: one shapes image noised by add_noise with the linear table (the trained model's), the same noise "
        "at each t: by t = 999 nothing of the shape is left"] + _compared(theirs / 2, mine / 2)
    return blocks, notes


def _log_snr(abar):
    return (abar / (1 - abar)).log()


# ---- 02: DDIM steps --------------------------------------------------------------------------------------
def draw_ddim_steps(learner: Learner, args):
    import torch
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    labels = [0, 1, 2] * 2
    unet, scheduler = shapes.load()
    unet = shapes.with_labels(unet, labels)
    ddim = DDIMScheduler.from_config(scheduler.config)
    ddim.set_timesteps(args.steps)
    config = ddim.config
    start = torch.randn((len(labels), 3, shapes.SIZE, shapes.SIZE), generator=torch.Generator().manual_seed(args.seed))
    theirs, mine = start.clone(), start.clone()
    picks = sorted({round(i * (args.steps - 1) / 5) for i in range(6)})
    their_x0, my_x0 = [], []
    with torch.no_grad():
        for i, t in enumerate(ddim.timesteps):
            out = ddim.step(unet(theirs, t).sample, t, theirs, eta=0.0)
            eps = unet(mine, t).sample
            if i in picks:
                their_x0.append(out.pred_original_sample[0])
                my_x0.append(_tensor(learner.call("predict_x0", model_output=eps, sample=mine,
                                                  alpha_prod_t=ddim.alphas_cumprod[int(t)],
                                                  prediction_type=config.prediction_type),
                                     "predict_x0", mine.shape)[0])
            theirs = out.prev_sample
            mine = _tensor(learner.call("ddim_step", model_output=eps, timestep=int(t), sample=mine,
                                        alphas_cumprod=ddim.alphas_cumprod, num_inference_steps=args.steps, eta=0.0,
                                        prediction_type=config.prediction_type, clip_sample=config.clip_sample,
                                        set_alpha_to_one=config.set_alpha_to_one, thresholding=config.thresholding),
                           "ddim_step", mine.shape)
    image = lambda x: (x / 2 + 0.5).clamp(0, 1)  # noqa: E731  (DDIMPipeline's own postprocessing)
    ref, yours = image(theirs), image(mine)
    ref_x0, yours_x0 = image(torch.stack(their_x0)), image(torch.stack(my_x0))
    steps = ", ".join(str(p + 1) for p in picks)
    blocks = [("images", [ref, yours, ((yours - ref).abs() * DIFF_GAIN).clamp(0, 1),
                          ref_x0, yours_x0, ((yours_x0 - ref_x0).abs() * DIFF_GAIN).clamp(0, 1)],
               ["DDIMScheduler.step, eta 0", "your ddim_step (the same UNet, seed and labels)",
                DIFF_TITLE, f"diffusers' x0 prediction of sample 1 at steps {steps}",
                "your predict_x0 on your own trajectory", DIFF_TITLE])]
    seen = shapes.classify(yours * 2 - 1)
    notes = ["rows 1-3: the final samples (labels " + ", ".join(shapes.CLASSES[i] for i in labels) + ")",
             f"rows 4-6: how the x0 prediction of sample 1 sharpens over {args.steps} steps",
             "your samples read as: " + ", ".join(shapes.CLASSES[c] if c is not None else "no clear shape" for c in seen)]
    return blocks, notes + _compared(ref, yours)


# ---- 05: generate ----------------------------------------------------------------------------------------
def draw_generate(learner: Learner, args):
    import torch
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    labels = [0, 1, 2] * 2
    unet, scheduler = shapes.load()
    reference = shapes.ddim_sample(unet, scheduler.config, labels, args.seed, args.steps)
    print(f"  {args.steps} steps, labels {', '.join(shapes.CLASSES[i] for i in labels)}")
    mine = _tensor(learner.call("generate", unet=shapes.with_labels(shapes.load()[0], labels),
                                scheduler=DDIMScheduler.from_config(scheduler.config), batch_size=len(labels),
                                num_inference_steps=args.steps, generator=torch.Generator().manual_seed(args.seed),
                                eta=0.0), "generate", reference.shape)
    diff = (mine - reference).abs()
    blocks = [("images", [reference, mine.clamp(0, 1), (diff * DIFF_GAIN).clamp(0, 1)],
               ["diffusers DDIMPipeline", "yours (generate)", DIFF_TITLE])]
    seen = shapes.classify(mine.clamp(0, 1) * 2 - 1)
    notes = ["rows: diffusers' samples; yours from the same seed and labels; their absolute difference "
             f"(x{DIFF_GAIN:g}, white = 1/{DIFF_GAIN:g} or more)",
             "your samples read as: " + ", ".join(shapes.CLASSES[c] if c is not None else "no clear shape"
                                                  for c in seen)]
    return blocks, notes + _compared(reference, mine)


# ---- 24: inpainting with the trained shapes model --------------------------------------------------------
def draw_inpainting(learner: Learner, args):
    import torch
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint import StableDiffusionInpaintPipeline
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    labels, strength = [1, 1, 1, 0, 0, 2], 0.8
    unet, config = shapes.load()
    unet = shapes.with_labels(unet, labels)
    g = torch.Generator().manual_seed(args.seed)
    x0 = shapes.draw(labels, g)
    noise = torch.randn(x0.shape, generator=g)
    mask = torch.zeros((len(labels), 1, shapes.SIZE, shapes.SIZE))
    mask[..., shapes.SIZE // 2:] = 1.0  # repaint the right half
    runs = {}
    for who in ("diffusers", "yours"):
        s = DDIMScheduler.from_config(config.config)
        s.set_timesteps(args.steps)
        if who == "diffusers":  # the pipelines' get_timesteps, on a stand-in self
            timesteps, _ = StableDiffusionInpaintPipeline.get_timesteps(type("P", (), {"scheduler": s})(), args.steps,
                                                                       strength, "cpu")
        else:
            kept = learner.call("img2img_timesteps", scheduler=s, num_inference_steps=args.steps, strength=strength,
                                pipeline="sd")
            if not (isinstance(kept, tuple) and len(kept) == 3 and isinstance(kept[0], torch.Tensor)):
                raise Stop(1, "your img2img_timesteps returned no (timesteps, steps, begin) triple")
            timesteps = kept[0]
        x = s.add_noise(x0, noise, timesteps[:1].repeat(len(labels)))
        for i, t in enumerate(timesteps):
            with torch.no_grad():
                x = s.step(unet(x, t).sample, t, x).prev_sample
            if who == "diffusers":  # StableDiffusionInpaintPipeline.__call__'s blend for a 4-channel UNet
                known = s.add_noise(x0, noise, torch.tensor([timesteps[i + 1]])) if i < len(timesteps) - 1 else x0
                x = (1 - mask) * known + mask * x
            else:
                x = _tensor(learner.call("blend_known_region", latents=x, image_latents=x0, noise=noise, mask=mask,
                                         scheduler=s, timesteps=timesteps, i=i), "blend_known_region", x0.shape)
        runs[who] = ((x / 2 + 0.5).clamp(0, 1))
    unet._forward_pre_hooks.clear()
    theirs, mine = runs["diffusers"], runs["yours"]
    shown = (x0 / 2 + 0.5) * (1 - mask) + 0.5 * mask  # the known half, grey where the model paints
    blocks = [("images", [shown, theirs, mine, ((mine - theirs).abs() * DIFF_GAIN).clamp(0, 1)],
               ["the known left half (grey: to repaint)", "diffusers' blend, every step", "yours (blend_known_region)",
                DIFF_TITLE])]
    seen = shapes.classify(mine * 2 - 1)
    notes = [f"{len(labels)} shapes images ({', '.join(shapes.CLASSES[c] for c in labels)}), the right half masked, "
             f"repainted by the trained UNet over the last {strength:g} of a {args.steps}-step DDIM schedule",
             "your completions read as: " + ", ".join(shapes.CLASSES[c] if c is not None else "no clear shape"
                                                      for c in seen)]
    return blocks, notes + _compared(theirs, mine)


# ---- 23: loss weights and timestep densities ----------------------------------------------------------------
DENSITY_DRAWS = 20000


def draw_weights(learner: Learner, args):
    import torch
    from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
    from diffusers.training_utils import (compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3,
                                          compute_snr)

    T, gamma = 1000, 5.0
    t = torch.arange(T)
    snr = compute_snr(DDPMScheduler(num_train_timesteps=T, beta_start=0.00085, beta_end=0.012,
                                    beta_schedule="scaled_linear"), t)
    notes, by_t, by_sigma, density = [], [], [], []

    def add(series, name, theirs, mine, colour):
        series += [(theirs, colour, f"{name} (diffusers)", False), (mine, colour, f"{name} (yours)", True)]
        notes.append(f"{name}: max |yours − the scripts'| {float((mine - theirs).abs().max()):.3g}")

    for kind, colour in zip(("epsilon", "v_prediction", "sample"), CURVE_COLOURS):
        theirs = torch.stack([snr, gamma * torch.ones_like(t)], dim=1).min(dim=1)[0]  # train_text_to_image.py
        theirs = theirs / snr if kind == "epsilon" else theirs / (snr + 1) if kind == "v_prediction" else theirs
        mine = _tensor(learner.call("min_snr_weights", snr=snr.clone(), snr_gamma=gamma, prediction_type=kind),
                       "min_snr_weights", (T,))
        add(by_t, kind, theirs.double().log10(), mine.double().log10(), colour)
    sigmas = torch.linspace(0.01, 1.0, 400).reshape(-1, 1, 1, 1)
    for scheme, colour in zip(("sigma_sqrt", "cosmap", "none"), CURVE_COLOURS):
        theirs = compute_loss_weighting_for_sd3(scheme, sigmas.clone()).flatten()
        mine = _tensor(learner.call("sd3_loss_weighting", weighting_scheme=scheme, sigmas=sigmas.clone()),
                       "sd3_loss_weighting", sigmas.shape).flatten()
        add(by_sigma, scheme, theirs.double().log10(), mine.double().log10(), colour)
    for scheme, colour in zip(("logit_normal", "mode", "none"), CURVE_COLOURS):
        args_ = dict(logit_mean=0.0, logit_std=1.0, mode_scale=1.29)
        theirs = compute_density_for_timestep_sampling(scheme, DENSITY_DRAWS, generator=torch.Generator().manual_seed(
            args.seed), **args_)
        mine = _tensor(learner.call("timestep_density", weighting_scheme=scheme, batch_size=DENSITY_DRAWS,
                                    generator=torch.Generator().manual_seed(args.seed), **args_),
                       "timestep_density", (DENSITY_DRAWS,))
        histogram = [torch.histc(u.double(), bins=50, min=0.0, max=1.0) / DENSITY_DRAWS * 50 for u in (theirs, mine)]
        add(density, scheme, *histogram, colour)
    # (the picture's font is ASCII: gamma and sigma spelled out)
    blocks = [("plots", [("log10 Min-SNR-gamma weight over t (gamma = 5, SD's schedule)", by_t, (-4.0, 1.0)),
                         ("log10 SD3 loss weight over sigma", by_sigma, (-0.5, 4.0), ("sigma = 0.01", "sigma = 1")),
                         (f"density of u ({DENSITY_DRAWS} draws, seed {args.seed})", density, (0.0, 3.5),
                          ("u = 0", "u = 1"))])]
    notes = ["left: the weight each timestep's loss gets under Min-SNR-γ, on ε, v and x₀ (log10): the clean end "
             "(t = 0, SNR ~10⁴) is weighted down hardest on ε",
             "middle: SD3's per-σ weights (log10): σ⁻² explodes at the clean end, cosmap is a gentle bump",
             "right: where u (the point of the training ladder) falls: logit-normal and mode favour the middle"] + notes
    return blocks, notes


# ---- 15: the 2-D toy set ------------------------------------------------------------------------------------
def draw_moons(learner: Learner, args):
    import torch
    from diffusers.schedulers.scheduling_edm_euler import EDMEulerScheduler

    from diffusion_katas.engine import toy2d

    network = toy2d.MoonsEDMNetwork()
    scheduler = EDMEulerScheduler(sigma_min=0.002, sigma_max=80.0, sigma_data=toy2d.SIGMA_DATA, rho=7.0)
    scheduler.set_timesteps(args.steps)
    count = 256
    start = torch.randn((count, 2, 1, 1), generator=torch.Generator().manual_seed(args.seed)) * scheduler.sigmas[0]
    theirs = start.clone()
    with torch.no_grad():
        for t in scheduler.timesteps:
            theirs = scheduler.step(network(scheduler.scale_model_input(theirs, t), t), t, theirs).prev_sample
    mine = _tensor(learner.call("edm_sample", network=network, sample=start.clone(), sigmas=scheduler.sigmas.clone(),
                                sigma_data=toy2d.SIGMA_DATA, prediction_type="epsilon"), "edm_sample", start.shape)
    data = network.points.float()
    theirs, mine = theirs.reshape(count, 2), mine.reshape(count, 2)
    grey, orange, blue = (110, 110, 110), (240, 140, 60), (90, 180, 240)
    bounds = (-2.0, 2.0)
    blocks = [("scatter", [
        ("the data: two moons (grey)", [(data, grey, 3, "the data")], bounds),
        (f"diffusers' EDMEulerScheduler, {args.steps} steps",
         [(data, grey, 2, "the data"), (theirs, orange, 2, "diffusers' samples")], bounds),
        ("your edm_sample, the same noise", [(data, grey, 2, "the data"), (mine, blue, 2, "your samples")],
         bounds)])]
    distance = ((mine[:, None, :].double() - network.points[None]) ** 2).sum(-1).min(dim=1).values.sqrt()
    notes = [f"{count} points from the same Gaussian noise at σ = 80, sampled onto the ideal EDM network of the grey "
             "cloud (its exact denoiser, which carries every sample onto one of the data points): a right sampler "
             "lands on the moons",
             f"your samples' median distance to the nearest data point: {float(distance.median()):.3g} "
             f"(diffusers': {float(((theirs[:, None, :].double() - network.points[None]) ** 2).sum(-1).min(dim=1).values.sqrt().median()):.3g})"]
    return blocks, notes + _compared(theirs, mine)


def _failure(error, reply: dict, function: str, picture: Picture, source: Path, rel: str) -> tuple[int, str]:
    if error is not None and error.is_a("NotImplementedError"):
        # the innermost frame in the learner's file is the function still to write
        mine = [f for f in error.frames if f and str(f[0]) == str(source)]
        name = str(mine[-1][2]) if mine else function
        line = f":{mine[-1][1]}" if mine else ""
        return 2, (f"`{name}` is still TODO ({rel}{line}). The picture draws with your "
                   f"{', '.join(picture.needs)}: write them (python -m pytest {rel} grades them), then run kata see "
                   "again.")
    if error is not None:
        where = "".join(f"\n    {f[0]}:{f[1]} in {f[2]}" for f in error.frames[-3:] if f)
        return 1, f"your {function} raised {error.type_name}: {error.message}{where}"
    return 1, f"your {function} could not be run ({reply.get('kind')})"


# ---- drawing ---------------------------------------------------------------------------------------------
CURVE_COLOURS = ((240, 120, 80), (90, 180, 240), (150, 220, 100))
PLOT_W, PLOT_H, TITLE_H = 420, 220, 14


def compose_png(path: Path, blocks: list) -> None:
    """One PNG of blocks, top to bottom: ("images", rows, titles) as write_png draws them, ("plots", panels)
    side by side, each panel (title, [(values, colour, label, dotted), ...], (ymin, ymax))."""
    from PIL import Image

    parts = []
    for block in blocks:
        draw = {"images": lambda b: _image_rows(*b[1:]), "plots": lambda b: _plots(b[1]),
                "scatter": lambda b: _scatter(b[1])}[block[0]]
        parts.append(draw(block))
    width = max(p.width for p in parts)
    canvas = Image.new("RGB", (width, sum(p.height for p in parts)), (40, 40, 40))
    y = 0
    for part in parts:
        canvas.paste(part, (0, y))
        y += part.height
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path, format="PNG")


def _plots(panels):
    from PIL import Image, ImageDraw

    canvas = Image.new("RGB", (GAP + len(panels) * (PLOT_W + GAP), TITLE_H + PLOT_H + 2 * GAP + 12), (40, 40, 40))
    draw = ImageDraw.Draw(canvas)
    for i, panel in enumerate(panels):
        title, series, (lo, hi) = panel[:3]
        # the x axis: over t by default, or the panel's own ends ("σ = 0.01", "σ = 1")
        left, right = panel[3] if len(panel) > 3 else ("t = 0", f"t = {len(series[0][0]) - 1}")
        x0, y0 = GAP + i * (PLOT_W + GAP), GAP + TITLE_H
        draw.text((x0, GAP), title, fill=(230, 230, 230))
        draw.rectangle([x0, y0, x0 + PLOT_W, y0 + PLOT_H], outline=(120, 120, 120), fill=(25, 25, 25))
        draw.text((x0 + 2, y0 + PLOT_H + 1), left, fill=(160, 160, 160))
        draw.text((x0 + PLOT_W - 6 * len(right) - 6, y0 + PLOT_H + 1), right, fill=(160, 160, 160))
        draw.text((x0 + 2, y0 + 1), f"{hi:g}", fill=(160, 160, 160))
        draw.text((x0 + 2, y0 + PLOT_H - 12), f"{lo:g}", fill=(160, 160, 160))
        legend = {}  # one entry per colour: the curve's name, then what solid and dotted mean
        for values, colour, label, dotted in series:
            legend.setdefault(colour, label.split(" (")[0])
            n = len(values)
            points = [(x0 + PLOT_W * k / max(n - 1, 1),
                       y0 + PLOT_H * (1 - (min(max(float(v), lo), hi) - lo) / (hi - lo)))
                      for k, v in enumerate(values.tolist()) if v == v]  # NaN left out
            if dotted:
                for k in range(0, len(points), 12):
                    draw.line(points[k:k + 6], fill=tuple(min(255, c + 15) for c in colour), width=3)
            else:
                draw.line(points, fill=tuple(c // 2 for c in colour), width=6)
        _legend(draw, x0 + PLOT_W - LEGEND_W, y0 + 4, [(colour, name) for colour, name in legend.items()]
                + [(None, "solid: diffusers"), (None, "dotted: yours")])
    return canvas


LEGEND_W = 130


def _legend(draw, x: float, y: float, entries) -> None:
    """A legend box at (x, y): a swatch of each colour and its name (an entry without a colour is a note)."""
    draw.rectangle([x, y, x + LEGEND_W - 4, y + 12 * len(entries) + 4], fill=(45, 45, 45), outline=(90, 90, 90))
    for k, (colour, name) in enumerate(entries):
        top = y + 3 + 12 * k
        if colour is not None:
            draw.rectangle([x + 4, top + 3, x + 16, top + 8], fill=colour)
        draw.text((x + 20, top), name, fill=(200, 200, 200))


def _scatter(panels):
    """Square scatter panels side by side, each (title, [(points (N, 2), colour, radius, name), ...], (lo, hi)),
    with a legend of the names."""
    from PIL import Image, ImageDraw

    side = 300
    canvas = Image.new("RGB", (GAP + len(panels) * (side + GAP), TITLE_H + side + 2 * GAP), (40, 40, 40))
    draw = ImageDraw.Draw(canvas)
    for i, (title, layers, (lo, hi)) in enumerate(panels):
        x0, y0 = GAP + i * (side + GAP), GAP + TITLE_H
        draw.text((x0, GAP), title, fill=(230, 230, 230))
        draw.rectangle([x0, y0, x0 + side, y0 + side], outline=(120, 120, 120), fill=(25, 25, 25))
        for points, colour, radius, _name in layers:
            for px, py in points.tolist():
                if not (lo <= px <= hi and lo <= py <= hi):
                    continue  # off the panel (a sampler gone wrong): the terminal's numbers still count it
                cx = x0 + (px - lo) / (hi - lo) * side
                cy = y0 + (1 - (py - lo) / (hi - lo)) * side
                draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=colour)
        _legend(draw, x0 + side - LEGEND_W, y0 + 4, [(colour, name) for _, colour, _, name in layers])
    return canvas


def _image_rows(rows, titles):
    """Rows of (B, 3, H, W) images in [0, 1], each under its title."""
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
    return canvas


def write_png(path: Path, rows: list, titles: list[str]) -> None:
    """Rows of (B, 3, H, W) images in [0, 1], each under its title, as one PNG (Pillow, a diffusers dependency)."""
    compose_png(path, [("images", rows, titles)])

if __name__ == "__main__":
    sys.exit(main())
