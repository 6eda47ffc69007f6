"""Grader for lab 24 · Image-to-image and inpainting: strength's timesteps, the starting latents, the mask
latents, the 9-channel UNet input and the 4-channel blend.

References are the pipelines' own code on tiny models (engine/tiny.py): get_timesteps and prepare_latents of
StableDiffusionImg2ImgPipeline and StableDiffusion3Img2ImgPipeline (they read only self.scheduler and
self.vae, so they run on a stand-in `self`), prepare_mask_latents of a tiny StableDiffusionInpaintPipeline,
and whole inpainting runs of that pipeline with a 9-channel and a 4-channel UNet, recorded step by step
(`record_inpainting`): what the UNet got, what scheduler.step returned, the latents after the blend, and
the scheduler's state at each point (a stateful Euler scheduler is handed to the learner as the pipeline had
it there).

Precision: every float check carries its float64 shadow (Scenario.exact): the encoder's mean and std from a
float64 copy of the same VAE with the same float32 draws widened, the noising through a float64 twin of
the same scheduler (engine/helpers.float64_twin), the blend's multiply-add in float64.
"""
import copy
import types

import torch
import torch.nn.functional as F
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import StableDiffusionImg2ImgPipeline
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint import StableDiffusionInpaintPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from diffusers.schedulers.scheduling_heun_discrete import HeunDiscreteScheduler

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import EXACT, MODEL_FORWARD, STEP_MATH
from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import PIPELINES, SD_BETAS, float64_twin, quiet_diffusers, seed_from

EVERY_CALL = f"{PIPELINES}:*Pipeline*.__call__"
SD3_SHIFT_FACTOR, SD3_SCALING = 0.0609, 1.5305  # SD3's VAE config
SD_SCALING = 0.18215


def _sd3_img2img():
    # importing the SD3 pipeline module pulls in transformers' T5 and CLIP classes: only when a check needs it
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3_img2img import (
        StableDiffusion3Img2ImgPipeline)

    return StableDiffusion3Img2ImgPipeline


def make_scheduler(name: str):
    """DDIM, Euler and Heun (order 2) on SD's β ladder; flow matching with SD3's shift."""
    if name == "FlowMatch":
        return FlowMatchEulerDiscreteScheduler(shift=3.0)
    return {"DDIM": DDIMScheduler, "Euler": EulerDiscreteScheduler, "Heun": HeunDiscreteScheduler}[name](**SD_BETAS)


def pipeline_class(pipeline: str):
    return _sd3_img2img() if pipeline == "sd3" else StableDiffusionImg2ImgPipeline


def make_vae(case: dict):
    """A tiny VAE (factor 2, or 4 with "x4"), with SD's scaling factor, or SD3's scaling and shift."""
    config = dict(scaling_factor=SD3_SCALING, shift_factor=SD3_SHIFT_FACTOR) if case.get("pipeline") == "sd3" \
        else dict(scaling_factor=SD_SCALING)
    return tiny.vae(4 if case.get("vae") == "x4" else 2, **config).requires_grad_(False)


def images(batch: int, size: tuple, g: torch.Generator) -> torch.Tensor:
    """Pixel images in [−1, 1], as the pipelines' image processors hand them to the VAE."""
    return torch.rand((batch, 3, *size), generator=g) * 2 - 1


def exact_encode(vae, image: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """The encoder's sample in float64: a float64 copy of the VAE's mean and std, the same float32 draw widened."""
    with torch.no_grad():
        dist = copy.deepcopy(vae).double().encode(image.double()).latent_dist
    eps = torch.randn(dist.mean.shape, generator=g, dtype=torch.float32).double()
    return dist.mean + dist.std * eps


def _short(t: torch.Tensor) -> str:
    values = [float(f"{v:.5g}") for v in t.tolist()]
    return str(values) if len(values) <= 6 else f"[{values[0]}, {values[1]}, …, {values[-1]}] ({len(values)})"


# ---- img2img_timesteps ----------------------------------------------------------------------------------
img2img_timesteps = Kata(
    "img2img_timesteps",
    hints=(
        "strength is the share of the schedule to run, from the noisy end skipped: count the steps kept the "
        "way each pipeline rounds, then return the tail of scheduler.timesteps (two timesteps per step for Heun).",
        "sd: k = min(int(n·s), n), t_start = max(n − k, 0);  sd3: t_start = int(max(n − min(n·s, n), 0));  "
        "begin = t_start·order;  (timesteps[begin:], n − t_start, begin).",
        "t_start = max(n - min(int(n * strength), n), 0)  # sd; begin = t_start * scheduler.order; "
        "return scheduler.timesteps[begin:], n - t_start, begin",
    ),
    answer_key=(f"{PIPELINES}:*Pipeline*.get_timesteps", EVERY_CALL),
)

TIMESTEP_CASES = [
    dict(scheduler="DDIM", n=10, strength=0.75, pipeline="sd"),
    dict(scheduler="DDIM", n=25, strength=0.56, pipeline="sd"),  # 25·0.56 = 14.000000000000002: 14 kept
    dict(scheduler="Euler", n=8, strength=0.5, pipeline="sd"),
    dict(scheduler="Heun", n=6, strength=0.6, pipeline="sd"),  # order 2: 11 timesteps
    dict(scheduler="DDIM", n=5, strength=1.0, pipeline="sd"),
    dict(scheduler="Euler", n=12, strength=0.3, pipeline="sd"),
    dict(scheduler="FlowMatch", n=10, strength=0.75, pipeline="sd3"),
    dict(scheduler="FlowMatch", n=25, strength=0.56, pipeline="sd3"),  # int(25 − 14.000000000000002): 15 kept
    dict(scheduler="FlowMatch", n=5, strength=0.8, pipeline="sd3"),  # int(n·(1 − s)) = int(0.999…) keeps 5, not 4
    dict(scheduler="FlowMatch", n=6, strength=1.0, pipeline="sd3"),
    dict(scheduler="FlowMatch", n=7, strength=0.45, pipeline="sd3"),
]


@img2img_timesteps.check("vs the img2img pipelines' get_timesteps", cases=TIMESTEP_CASES, tol=EXACT)
def _(case, g):
    s = make_scheduler(case["scheduler"])
    s.set_timesteps(case["n"])
    learner_scheduler = copy.deepcopy(s)
    owner = types.SimpleNamespace(scheduler=s)  # get_timesteps reads (and sets) only self.scheduler
    timesteps, steps = pipeline_class(case["pipeline"]).get_timesteps(owner, case["n"], case["strength"], "cpu")
    return Scenario(inputs=dict(scheduler=learner_scheduler, num_inference_steps=case["n"], strength=case["strength"],
                                pipeline=case["pipeline"]),
                    # the index of the first kept timestep: what set_begin_index gets, where the scheduler has it
                    expected=(timesteps.clone(), steps, len(s.timesteps) - len(timesteps)),
                    label=f"{case['scheduler']} (order {s.order}), {steps} of {case['n']} steps kept")


def _kept(scheduler, n, t_start, *, order=True, head=False, count_timesteps=False, begin_unordered=False,
          steps=None):
    begin = t_start * (scheduler.order if order else 1)
    timesteps = scheduler.timesteps[:len(scheduler.timesteps) - begin] if head else scheduler.timesteps[begin:]
    count = steps if steps is not None else len(timesteps) if count_timesteps else n - t_start
    return timesteps, count, t_start if begin_unordered else begin


def _sd_start(n, strength):
    return max(n - min(int(n * strength), n), 0)


def _sd3_start(n, strength):
    return int(max(n - min(n * strength, n), 0))


def _start(pipeline, n, strength):
    return _sd3_start(n, strength) if pipeline == "sd3" else _sd_start(n, strength)


@img2img_timesteps.trap("k rounded the other way (the other pipeline's rule, or round())",
                        hint="SD keeps k = int(n·s) steps (truncated); SD3 truncates the start instead, "
                             "t_start = int(n − n·s), which keeps one more step whenever n·s is not whole "
                             "(n = 10, s = 0.75: SD 7, SD3 8). round() agrees with one or the other, never both.")
def _(scheduler, num_inference_steps, strength, pipeline="sd"):
    other = "sd" if pipeline == "sd3" else "sd3"
    return _kept(scheduler, num_inference_steps, _start(other, num_inference_steps, strength))


@img2img_timesteps.trap("the scheduler's order ignored (t_start timesteps skipped, not t_start·order)",
                        hint="A second-order scheduler (Heun) has `order` timesteps per step: skip t_start·order "
                             "of them, and set_begin_index gets that index too.")
def _(scheduler, num_inference_steps, strength, pipeline="sd"):
    return _kept(scheduler, num_inference_steps, _start(pipeline, num_inference_steps, strength), order=False)


@img2img_timesteps.trap("the head of the schedule kept (the noisiest steps run, the last skipped)",
                        hint="img2img skips the noisiest steps: keep the tail, scheduler.timesteps[t_start·order:].")
def _(scheduler, num_inference_steps, strength, pipeline="sd"):
    return _kept(scheduler, num_inference_steps, _start(pipeline, num_inference_steps, strength), head=True)


@img2img_timesteps.trap("steps counted as timesteps (len of the kept timesteps)",
                        hint="The step count is n − t_start; with Heun every step has two timesteps, so the kept "
                             "timesteps are twice as many (less one).")
def _(scheduler, num_inference_steps, strength, pipeline="sd"):
    return _kept(scheduler, num_inference_steps, _start(pipeline, num_inference_steps, strength),
                 count_timesteps=True)


@img2img_timesteps.trap("SD3's t_start as int(n·(1 − s)) (1 − s rounds: n·(1 − s) is not n − n·s)",
                        hint="SD3 computes t_start = int(max(n − n·s, 0)): n·s first, then the difference. "
                             "n·(1 − s) rounds 1 − s first (1 − 0.8 = 0.19999999999999996), and int() of 0.99…98 "
                             "is 0, not 1: one more step kept than the pipeline's.")
def _(scheduler, num_inference_steps, strength, pipeline="sd"):
    n = num_inference_steps
    t_start = int(max(n * (1 - strength), 0)) if pipeline == "sd3" else _sd_start(n, strength)
    return _kept(scheduler, n, t_start)


@img2img_timesteps.trap("begin_index returned as t_start, not t_start·order",
                        hint="The third value is the index of the first kept timestep in scheduler.timesteps: with "
                             "Heun (order 2) that is t_start·order, the same index the slice starts at.")
def _(scheduler, num_inference_steps, strength, pipeline="sd"):
    return _kept(scheduler, num_inference_steps, _start(pipeline, num_inference_steps, strength),
                 begin_unordered=True)


@img2img_timesteps.trap("the step count as int(n·s) (SD's k), not n − t_start",
                        hint="The steps that run are n − t_start: for SD that is k = int(n·s), but SD3 truncates "
                             "t_start instead, which keeps one more step whenever n·s is not whole.")
def _(scheduler, num_inference_steps, strength, pipeline="sd"):
    n = num_inference_steps
    return _kept(scheduler, n, _start(pipeline, n, strength), steps=min(int(n * strength), n))


# ---- img2img_latents ------------------------------------------------------------------------------------
img2img_latents = Kata(
    "img2img_latents",
    hints=(
        "Encode (sampling the posterior with the generator), bring the latent to the denoiser's scale, then draw "
        "the noise from the same generator and noise the latent to the start timestep.",
        "z = vae.encode(image).latent_dist.sample(generator);  sd: z·s;  sd3: (z − shift)·s;  ε = randn(z.shape, "
        "generator);  sd: scheduler.add_noise(z, ε, t);  sd3: scheduler.scale_noise(z, t, ε).",
        "z = vae.encode(image).latent_dist.sample(generator) * vae.config.scaling_factor; "
        "noise = torch.randn(z.shape, generator=generator); return scheduler.add_noise(z, noise, timestep)  # sd",
    ),
    answer_key=(f"{PIPELINES}:*Pipeline*.prepare_latents", f"{PIPELINES}:*Pipeline*._encode_vae_image", EVERY_CALL),
)

LATENT_CASES = [
    dict(scheduler="DDIM", n=10, strength=0.6, batch=2, pipeline="sd"),
    dict(scheduler="Euler", n=8, strength=0.75, batch=1, pipeline="sd", size=(16, 24)),
    dict(scheduler="DDIM", n=6, strength=1.0, batch=2, pipeline="sd", vae="x4"),
    dict(scheduler="FlowMatch", n=10, strength=0.7, batch=2, pipeline="sd3"),
    dict(scheduler="FlowMatch", n=5, strength=0.5, batch=1, pipeline="sd3", size=(16, 24)),
]


@img2img_latents.check("vs the img2img pipelines' prepare_latents (the same generator)", cases=LATENT_CASES,
                       tol=MODEL_FORWARD)
def _(case, g):
    vae, s = make_vae(case), make_scheduler(case["scheduler"])
    s.set_timesteps(case["n"])
    owner = types.SimpleNamespace(scheduler=s, vae=vae)  # get_timesteps and prepare_latents read only these
    cls = pipeline_class(case["pipeline"])
    timesteps, _ = cls.get_timesteps(owner, case["n"], case["strength"], "cpu")
    B = case["batch"]
    image = images(B, case.get("size", (16, 16)), g)
    timestep = timesteps[:1].repeat(B)
    seed = seed_from(g)
    learner_scheduler = copy.deepcopy(s)
    reference = torch.Generator().manual_seed(seed)
    with torch.no_grad(), quiet_diffusers():
        expected = cls.prepare_latents(owner, image.clone(), timestep, B, 1, torch.float32, "cpu", reference)
    z = exact_encode(vae, image, (draws := torch.Generator().manual_seed(seed)))
    if case["pipeline"] == "sd3":
        z = (z - SD3_SHIFT_FACTOR) * SD3_SCALING
        noise = torch.randn(z.shape, generator=draws).double()
        sigma = s.sigmas[s.begin_index].double()
        exact = sigma * noise + (1 - sigma) * z
    else:
        z = z * SD_SCALING
        noise = torch.randn(z.shape, generator=draws).double()
        exact = float64_twin(s).add_noise(z, noise, timestep)
    return Scenario(inputs=dict(vae=vae, scheduler=learner_scheduler, image=image, timestep=timestep,
                                generator=torch.Generator().manual_seed(seed), pipeline=case["pipeline"]),
                    expected=expected, exact=exact, generators_after={"generator": reference},
                    label=f"{case['pipeline']}, {case['scheduler']}, strength {case['strength']}, "
                          f"t = {float(timestep[0]):.6g}")


def _latents(vae, scheduler, image, timestep, generator, pipeline="sd", *, noise_first=False, mode=False,
             unscaled=False, shift_after=False, no_shift=False, divided=False, swapped=False):
    """prepare_latents with one misconception switched on (for traps)."""
    dist = vae.encode(image).latent_dist
    noise = torch.randn(dist.mean.shape, generator=generator) if noise_first else None
    z = dist.mode() if mode else dist.sample(generator)
    s, shift = vae.config.scaling_factor, (vae.config.shift_factor or 0.0)
    if unscaled:
        z = z - shift if pipeline == "sd3" else z
    elif pipeline == "sd3":
        z = z * s if no_shift else (z * s - shift if shift_after else (z - shift) * s)
    else:
        z = z / s if divided else z * s
    noise = torch.randn(z.shape, generator=generator) if noise is None else noise
    if swapped:
        return scheduler.scale_noise(noise, timestep, z) if pipeline == "sd3" else scheduler.add_noise(noise, z, timestep)
    return scheduler.scale_noise(z, timestep, noise) if pipeline == "sd3" else scheduler.add_noise(z, noise, timestep)


def _latent_trap(name: str, hint: str, **bug):
    @img2img_latents.trap(name, hint=hint)
    def _(vae, scheduler, image, timestep, generator, pipeline="sd"):
        with torch.no_grad():
            return _latents(vae, copy.deepcopy(scheduler), image, timestep, generator, pipeline, **bug)


_latent_trap("the noise drawn before the encoder's sample",
             "latent_dist.sample(generator) draws first (its ε), then the noise: one generator, the pipeline's order.",
             noise_first=True)
_latent_trap("the encoder's mean (latent_dist.mode()) instead of a sample",
             "img2img samples the posterior with the generator: vae.encode(image).latent_dist.sample(generator) "
             "(retrieve_latents' default), not its mode.", mode=True)
_latent_trap("the VAE's scaling_factor forgotten",
             "The denoiser works on scaled latents: multiply by vae.config.scaling_factor after encoding.",
             unscaled=True)
_latent_trap("SD3's shift after the scaling: z·scaling_factor − shift_factor",
             "SD3 shifts first, then scales: (z − shift_factor)·scaling_factor.", shift_after=True)
_latent_trap("the latents divided by scaling_factor (the decoder's way)",
             "Encoding multiplies by vae.config.scaling_factor; dividing by it is what the decoder's input does.",
             divided=True)
_latent_trap("the latent and the noise swapped in add_noise / scale_noise",
             "add_noise(original_samples, noise, timesteps) and scale_noise(sample, timestep, noise): the latent "
             "goes first in add_noise, the noise in the middle; scale_noise takes the timestep second.", swapped=True)
_latent_trap("SD3's shift_factor ignored",
             "SD3's VAE is shifted: (z − vae.config.shift_factor)·vae.config.scaling_factor.", no_shift=True)


# ---- prepare_mask_latents -------------------------------------------------------------------------------
prepare_mask_latents = Kata(
    "prepare_mask_latents",
    hints=(
        "Two inputs for the 9-channel UNet: the mask shrunk to the latents' size without blurring it, and the "
        "known part of the image (where the mask is 0) encoded like any image. Double both under guidance.",
        "masked = image·(mask < 0.5);  m = F.interpolate(mask, size=(H // f, W // f));  "
        "z = vae.encode(masked).latent_dist.sample(generator)·scaling_factor;  CFG: cat([m, m]), cat([z, z]).",
        "mask_latents = F.interpolate(mask, size=(H // f, W // f)); masked_latents = "
        "vae.encode(image * (mask < 0.5)).latent_dist.sample(generator) * vae.config.scaling_factor",
    ),
    answer_key=(f"{PIPELINES}:*Pipeline*.prepare_mask_latents", f"{PIPELINES}:*Pipeline*._encode_vae_image",
                EVERY_CALL),
)

MASK_CASES = [
    dict(batch=2, size=(16, 16), cfg=True),
    dict(batch=1, size=(16, 24), cfg=False),
    dict(batch=2, size=(32, 32), cfg=True, vae="x4"),
    dict(batch=3, size=(24, 16), cfg=False, vae="x4"),
]


def random_masks(batch: int, size: tuple, g: torch.Generator) -> torch.Tensor:
    """One rectangle to repaint per sample (1 inside), its edges at odd pixels: a blurring resize shows."""
    H, W = size
    mask = torch.zeros((batch, 1, H, W))
    for b in range(batch):
        top = int(torch.randint(1, H // 2, (1,), generator=g)) | 1
        left = int(torch.randint(1, W // 2, (1,), generator=g)) | 1
        mask[b, :, top:top + H // 2, left:left + W // 3 + 1] = 1.0
    return mask


def inpaint_pipeline(vae, unet=None, scheduler=None) -> StableDiffusionInpaintPipeline:
    with quiet_diffusers():
        pipe = StableDiffusionInpaintPipeline(
            vae=vae, text_encoder=None, tokenizer=None, unet=unet if unet is not None else tiny.unet_cond(),
            scheduler=scheduler if scheduler is not None else DDIMScheduler(**SD_BETAS), safety_checker=None,
            feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@prepare_mask_latents.check("vs StableDiffusionInpaintPipeline.prepare_mask_latents", cases=MASK_CASES,
                            tol=MODEL_FORWARD)
def _(case, g):
    vae = make_vae(case)
    pipe = inpaint_pipeline(vae)
    B, (H, W) = case["batch"], case["size"]
    image, mask = images(B, (H, W), g), random_masks(B, (H, W), g)
    seed = seed_from(g)
    reference = torch.Generator().manual_seed(seed)
    masked_image = image * (mask < 0.5)  # StableDiffusionInpaintPipeline.__call__
    with torch.no_grad():
        expected = pipe.prepare_mask_latents(mask.clone(), masked_image, B, H, W, torch.float32, "cpu", reference,
                                             case["cfg"])
    f = pipe.vae_scale_factor
    exact_mask = F.interpolate(mask.double(), size=(H // f, W // f))
    exact_latents = exact_encode(vae, masked_image, torch.Generator().manual_seed(seed)) * SD_SCALING
    if case["cfg"]:
        exact_mask, exact_latents = torch.cat([exact_mask] * 2), torch.cat([exact_latents] * 2)
    return Scenario(inputs=dict(vae=vae, image=image, mask=mask, generator=torch.Generator().manual_seed(seed),
                                do_classifier_free_guidance=case["cfg"]),
                    expected=(expected[0].clone(), expected[1].clone()), exact=(exact_mask, exact_latents),
                    generators_after={"generator": reference},
                    label=f"{B}×{H}×{W}, VAE factor {f}, guidance {'on' if case['cfg'] else 'off'}")


def _mask_latents(vae, image, mask, generator, do_classifier_free_guidance, *, keep_masked=False, mode="nearest",
                  no_double=False, unscaled=False, inverted=False, interleaved=False):
    f = 2 ** (len(vae.config.block_out_channels) - 1)
    H, W = image.shape[-2:]
    masked = image * (mask >= 0.5) if keep_masked else image * (mask < 0.5)
    m = F.interpolate(mask, size=(H // f, W // f), mode=mode)
    m = 1 - m if inverted else m
    z = vae.encode(masked).latent_dist.sample(generator) * (1.0 if unscaled else vae.config.scaling_factor)
    if do_classifier_free_guidance and not no_double:
        if interleaved:
            m, z = m.repeat_interleave(2, dim=0), z.repeat_interleave(2, dim=0)
        else:
            m, z = torch.cat([m] * 2), torch.cat([z] * 2)
    return m, z


def _mask_trap(name: str, hint: str, **bug):
    @prepare_mask_latents.trap(name, hint=hint)
    def _(vae, image, mask, generator, do_classifier_free_guidance):
        with torch.no_grad():
            return _mask_latents(vae, image, mask, generator, do_classifier_free_guidance, **bug)


_mask_trap("the masked image keeps the region to repaint (image·mask)",
           "The UNet is shown what it must keep: the pixels where the mask is 0, image·(mask < 0.5); the region to "
           "repaint is zeroed.", keep_masked=True)
_mask_trap("the mask resized bilinearly (blurred edges)",
           "F.interpolate(mask, size=...) with its default mode, nearest, keeps the mask 0 or 1 at latent size; "
           "bilinear blurs its edges.", mode="bilinear")
_mask_trap("the mask inverted at latent size (1 − mask)",
           "The mask keeps its meaning in latent space: 1 = repaint.", inverted=True)
_mask_trap("mask and masked latents not doubled under guidance",
           "Under classifier-free guidance the UNet sees 2B samples: torch.cat([x] * 2) for the mask and the masked "
           "image's latents too.", no_double=True)
_mask_trap("doubled image by image (repeat_interleave), not batch after batch",
           "The UNet's batch is [unconditional batch, conditional batch]: torch.cat([x] * 2) puts the whole batch "
           "twice, in order; repeat_interleave(2) pairs each image with itself.", interleaved=True)
_mask_trap("the masked image's latents not scaled",
           "Encode the masked image like any image: its sample times vae.config.scaling_factor.", unscaled=True)


# ---- inpainting runs, recorded --------------------------------------------------------------------------
INPAINT_CASES = [
    dict(scheduler="DDIM", batch=1, steps=4, strength=1.0, guidance_scale=7.5),
    dict(scheduler="Euler", batch=2, steps=4, strength=0.75, guidance_scale=5.0),
    dict(scheduler="DDIM", batch=2, steps=5, strength=0.6, guidance_scale=1.0),  # no guidance
    dict(scheduler="Euler", batch=1, steps=3, strength=1.0, guidance_scale=1.0, size=(16, 24)),
]


def _snapshot(scheduler, skip=("scale_model_input", "step")):
    """A copy of a scheduler's state now (without the recording wrappers set on it)."""
    twin = object.__new__(type(scheduler))
    twin.__dict__ = copy.deepcopy({k: v for k, v in scheduler.__dict__.items() if k not in skip})
    return twin


def record_inpainting(case: dict, g: torch.Generator, channels: int) -> dict:
    """A StableDiffusionInpaintPipeline run with a `channels`-channel tiny UNet, recorded: the start (latents, noise,
    image latents), the mask latents, the kept timesteps, and per step the scheduler's state and input before
    scale_model_input, the UNet's input, and scheduler.step's output with the state after it; the final latents."""
    import functools

    vae = tiny.vae(2, scaling_factor=SD_SCALING).requires_grad_(False)
    unet = tiny.unet_cond(in_channels=channels).requires_grad_(False)
    pipe = inpaint_pipeline(vae, unet, make_scheduler(case["scheduler"]))
    B, (H, W) = case["batch"], case.get("size", (16, 16))
    image = images(B, (H, W), g) / 2 + 0.5  # the pipeline's image processor takes [0, 1]
    mask = random_masks(B, (H, W), g)
    prompt, negative = tiny.text_embeddings(B, g), tiny.text_embeddings(B, g)
    rec: dict = {"scale_inputs": [], "before_scale": [], "unet_inputs": [], "step_outputs": [], "after_step": []}
    s = pipe.scheduler
    scale, step = s.scale_model_input, s.step
    originals = {name: getattr(pipe, name) for name in ("prepare_latents", "prepare_mask_latents", "get_timesteps")}

    def recording_scale(sample, timestep=None):
        rec["scale_inputs"].append(sample.clone())
        rec["before_scale"].append(_snapshot(s))
        return scale(sample, timestep)

    @functools.wraps(step)
    def recording_step(model_output, timestep, sample, *args, **kwargs):
        out = step(model_output, timestep, sample, *args, **kwargs)
        rec["step_outputs"].append((out[0] if isinstance(out, tuple) else out.prev_sample).clone())
        rec["after_step"].append(_snapshot(s))
        return out

    def keep(name):
        def wrapped(*args, **kwargs):
            out = originals[name](*args, **kwargs)
            rec[name] = tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in out)
            return out
        return wrapped

    s.scale_model_input, s.step = recording_scale, recording_step
    for name in originals:
        setattr(pipe, name, keep(name))
    hook = unet.register_forward_pre_hook(lambda module, args, kwargs: rec["unet_inputs"].append(
        (args[0] if args else kwargs["sample"]).clone()), with_kwargs=True)
    try:
        with torch.no_grad(), quiet_diffusers():
            out = pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, image=image, mask_image=mask,
                       height=H, width=W, strength=case["strength"], num_inference_steps=case["steps"],
                       guidance_scale=case["guidance_scale"], generator=torch.Generator().manual_seed(seed_from(g)),
                       output_type="latent")
    finally:
        hook.remove()
        del s.scale_model_input, s.step
    rec.update(final=out.images.clone(), batch=B, cfg=case["guidance_scale"] > 1, timesteps=rec["get_timesteps"][0])
    return rec


def _step_label(case, i, n):
    return f"{case['scheduler']}, step {i + 1}/{n}, guidance {'on' if case['guidance_scale'] > 1 else 'off'}"


# ---- inpaint_unet_input ---------------------------------------------------------------------------------
inpaint_unet_input = Kata(
    "inpaint_unet_input",
    hints=(
        "The 9-channel UNet reads the noisy latents, the mask and the masked image's latents side by side on the "
        "channel axis; only the noisy latents go through the scheduler's input scaling.",
        "x = cat([latents]·2) under CFG;  x = scheduler.scale_model_input(x, t);  cat([x, mask, masked], dim=1).",
        "x = torch.cat([latents] * 2) if do_classifier_free_guidance else latents; "
        "return torch.cat([scheduler.scale_model_input(x, t), mask, masked_image_latents], dim=1)",
    ),
    answer_key=(EVERY_CALL,),
)


@inpaint_unet_input.check("vs StableDiffusionInpaintPipeline's 9-channel UNet input, every step",
                          cases=INPAINT_CASES, tol=STEP_MATH)
def _(case, g):
    rec = record_inpainting(case, g, 9)
    B, cfg = rec["batch"], rec["cfg"]
    mask, masked = rec["prepare_mask_latents"]
    scenarios = []
    n = len(rec["timesteps"])
    for i, t in enumerate(rec["timesteps"]):
        latents = rec["scale_inputs"][i][:B]
        state = rec["before_scale"][i]
        twin = float64_twin(state)
        x = torch.cat([latents.double()] * 2) if cfg else latents.double()
        exact = torch.cat([twin.scale_model_input(x, t), mask.double(), masked.double()], dim=1)
        scenarios.append(Scenario(
            inputs=dict(latents=latents.clone(), mask=mask.clone(), masked_image_latents=masked.clone(),
                        scheduler=_snapshot(state), t=t.clone(), do_classifier_free_guidance=cfg),
            expected=rec["unet_inputs"][i], exact=exact, label=_step_label(case, i, n)))
    return scenarios


def _unet_input(latents, mask, masked_image_latents, scheduler, t, do_classifier_free_guidance, *, scale_all=False,
                order=("x", "mask", "masked"), no_double=False, unscaled=False):
    x = torch.cat([latents] * 2) if do_classifier_free_guidance and not no_double else latents
    if unscaled:
        return torch.cat([x, mask[:len(x)], masked_image_latents[:len(x)]], dim=1)
    if scale_all:
        return scheduler.scale_model_input(torch.cat([x, mask[:len(x)], masked_image_latents[:len(x)]], dim=1), t)
    parts = dict(x=scheduler.scale_model_input(x, t), mask=mask[:len(x)], masked=masked_image_latents[:len(x)])
    return torch.cat([parts[p] for p in order], dim=1)


@inpaint_unet_input.trap("the whole 9-channel stack scaled (mask and masked latents too)",
                         hint="scale_model_input is for the noisy latents (Euler divides them by √(σ² + 1)): scale "
                              "them first, then stack the mask and the masked latents as they are.")
def _(latents, mask, masked_image_latents, scheduler, t, do_classifier_free_guidance):
    return _unet_input(latents, mask, masked_image_latents, copy.deepcopy(scheduler), t, do_classifier_free_guidance,
                       scale_all=True)


@inpaint_unet_input.trap("the channels in another order (the masked latents before the mask)",
                         hint="The inpainting UNet was trained on [latents (4), mask (1), masked image latents (4)], "
                              "in that order along dim 1.")
def _(latents, mask, masked_image_latents, scheduler, t, do_classifier_free_guidance):
    return _unet_input(latents, mask, masked_image_latents, copy.deepcopy(scheduler), t, do_classifier_free_guidance,
                       order=("x", "masked", "mask"))


@inpaint_unet_input.trap("scheduler.scale_model_input skipped",
                         hint="The latents go through scheduler.scale_model_input(x, t) before stacking (Euler "
                              "divides them by √(σ² + 1); DDIM returns them as they are, which is why it can hide).")
def _(latents, mask, masked_image_latents, scheduler, t, do_classifier_free_guidance):
    return _unet_input(latents, mask, masked_image_latents, copy.deepcopy(scheduler), t, do_classifier_free_guidance,
                       unscaled=True)


@inpaint_unet_input.trap("the latents not doubled under guidance",
                         hint="Under classifier-free guidance the UNet runs both branches in one batch: "
                              "torch.cat([latents] * 2) first (the mask latents already come doubled).")
def _(latents, mask, masked_image_latents, scheduler, t, do_classifier_free_guidance):
    return _unet_input(latents, mask, masked_image_latents, copy.deepcopy(scheduler), t, do_classifier_free_guidance,
                       no_double=True)


# ---- blend_known_region ---------------------------------------------------------------------------------
blend_known_region = Kata(
    "blend_known_region",
    hints=(
        "After each step, overwrite the region you must keep (mask 0) with the original latents carrying as much "
        "noise as the loop has left: the noise of the next timestep, none after the last step.",
        "known = image_latents if i is the last step, else scheduler.add_noise(image_latents, noise, "
        "timesteps[i + 1:i + 2]);  (1 − mask)·known + mask·latents.",
        "known = image_latents if i == len(timesteps) - 1 else scheduler.add_noise(image_latents, noise, "
        "timesteps[i + 1:i + 2]); return (1 - mask) * known + mask * latents",
    ),
    answer_key=(EVERY_CALL,),
)


@blend_known_region.check("vs StableDiffusionInpaintPipeline with a 4-channel UNet, every step", cases=INPAINT_CASES,
                          tol=STEP_MATH)
def _(case, g):
    rec = record_inpainting(case, g, 4)
    B, cfg = rec["batch"], rec["cfg"]
    _, noise, image_latents = rec["prepare_latents"]
    mask = rec["prepare_mask_latents"][0]
    init_mask = mask.chunk(2)[0] if cfg else mask
    timesteps = rec["timesteps"]
    n = len(timesteps)
    scenarios = []
    for i in range(n):
        after = rec["after_step"][i]
        expected = rec["scale_inputs"][i + 1][:B] if i < n - 1 else rec["final"]
        known = image_latents.double()
        if i < n - 1:
            known = float64_twin(after).add_noise(known, noise.double(), timesteps[i + 1:i + 2])
        exact = (1 - init_mask.double()) * known + init_mask.double() * rec["step_outputs"][i].double()
        scenarios.append(Scenario(
            inputs=dict(latents=rec["step_outputs"][i].clone(), image_latents=image_latents.clone(),
                        noise=noise.clone(), mask=init_mask.clone(), scheduler=_snapshot(after),
                        timesteps=timesteps.clone(), i=i),
            expected=expected, exact=exact, label=_step_label(case, i, n)))
    return scenarios


def _blend(latents, image_latents, noise, mask, scheduler, timesteps, i, *, at=1, last_noised=False, inverted=False):
    known = image_latents
    j = min(i + at, len(timesteps) - 1)
    if i < len(timesteps) - 1 or last_noised:
        known = scheduler.add_noise(image_latents, noise, timesteps[j:j + 1])
    m = 1 - mask if inverted else mask
    return (1 - m) * known + m * latents


@blend_known_region.trap("the known region noised to the current timestep, not the next",
                         hint="scheduler.step has just moved the latents to t_{i+1}: the known region must carry "
                              "that much noise, add_noise(image_latents, noise, timesteps[i + 1:i + 2]).")
def _(latents, image_latents, noise, mask, scheduler, timesteps, i):
    # (Euler's add_noise reads its σ from the step index after the first step, not from the timestep: there this
    # mistake gives the right answer; DDIM's shows it)
    return _blend(latents, image_latents, noise, mask, copy.deepcopy(scheduler), timesteps, i, at=0)


@blend_known_region.trap("the known region put back clean one step early (at the last step but one)",
                         hint="Only after the LAST step (i == len(timesteps) − 1) is the loop at t = 0; after the "
                              "step before, it is at the last timestep, and the known region carries its noise.")
def _(latents, image_latents, noise, mask, scheduler, timesteps, i):
    n = len(timesteps)
    if i == n - 2:
        return (1 - mask) * image_latents + mask * latents
    return _blend(latents, image_latents, noise, mask, copy.deepcopy(scheduler), timesteps, i)


@blend_known_region.trap("the known region noised after the last step too",
                         hint="After the last step the loop is at t = 0: put back image_latents itself, unnoised.")
def _(latents, image_latents, noise, mask, scheduler, timesteps, i):
    return _blend(latents, image_latents, noise, mask, copy.deepcopy(scheduler), timesteps, i, last_noised=True)


@blend_known_region.trap("the mask inverted (the region to repaint overwritten)",
                         hint="mask 1 = repaint: keep the new latents there, mask·latents, and put the known latents "
                              "where the mask is 0, (1 − mask)·known.")
def _(latents, image_latents, noise, mask, scheduler, timesteps, i):
    return _blend(latents, image_latents, noise, mask, copy.deepcopy(scheduler), timesteps, i, inverted=True)
