"""Grader for lab 04 · Classifier-free guidance: combine, rescale, and one batched guided prediction.

Every expected value comes from diffusers itself. Most are recorded live from a short run of a tiny
random-weight StableDiffusionPipeline: a PipelineRecorder (hooks on the UNet, a wrapper around
scheduler.step) and a wrapper around the pipeline module's rescale_noise_cfg capture what the pipeline
fed the UNet, what it got back, and the guided prediction it handed to the scheduler.
rescale_noise_cfg is also called directly.

Precision: every scenario also carries the float64 shadow of diffusers' answer (Scenario.exact): the
combine ε_u + s·(ε_c − ε_u) and diffusers' own rescale_noise_cfg on the same inputs widened to float64,
and for guided_noise a float64 copy of the same UNet (copy.deepcopy(unet).double()) asked the same
questions on the widened latents and embeddings. An answer at most 2× as far from it as diffusers' own
(+ 2 ulps) passes: a combine or rescale computed in float32 or float64 and cast once, float16 included.
"""
import copy

import torch
from diffusers.guiders.classifier_free_guidance import ClassifierFreeGuidance
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion as sd_module
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.utils import logging as diffusers_logging

from diffusion_katas.engine import tiny
from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import MODEL_FORWARD, STEP_MATH
from diffusion_katas.engine.helpers import (DTYPES, EVERY_PIPELINE_CALL, PIPELINES, SD_BETAS, DenoiserProbe, PipelineRecorder, quiet_diffusers,
                                            seed_from)

# Captured at import, before any answer-key lock can replace the module attribute.
reference_rescale = sd_module.rescale_noise_cfg

SCHEDULERS = {
    # "leading" spacing (+ the steps_offset=1 the pipeline sets): t = 667, 334, 1 for 3 steps.
    "DDIM": lambda: DDIMScheduler(**SD_BETAS),
    # "trailing" starts at t = 999, the noisiest input.
    "DDIM trailing": lambda: DDIMScheduler(**SD_BETAS, timestep_spacing="trailing"),
    # Euler's linspace timesteps run 999 … 0, and the pipeline divides the UNet input by √(σ²+1).
    "Euler": lambda: EulerDiscreteScheduler(**SD_BETAS),
}
# Where learners would reach for the reference: the SD module, its SDXL copy, and the guiders.
RESCALE_KEYS = (
    "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.rescale_noise_cfg",
    "diffusers.pipelines.stable_diffusion_xl.pipeline_stable_diffusion_xl.rescale_noise_cfg",
    "diffusers.guiders.guider_utils.rescale_noise_cfg",
    "diffusers.guiders.classifier_free_guidance.rescale_noise_cfg",
    # every pipeline's and guider's copy, however it is written
    f"{PIPELINES}:rescale_noise_cfg", "diffusers.guiders.**:rescale_noise_cfg",
)
PIPELINE_KEYS = (
    "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.StableDiffusionPipeline.__call__",
    "diffusers.guiders.classifier_free_guidance.ClassifierFreeGuidance.forward",
    # every pipeline's own combine (inline in __call__) and every guider's (a guider's forward combines the branches)
    EVERY_PIPELINE_CALL, "diffusers.guiders.**:*Guidance*.forward", "diffusers.guiders.**:*Guidance*.__call__",
    f"{PIPELINES}:*._apply_perturbed_attention_guidance",
)


# ---- recording a pipeline run -----------------------------------------------------------------------
def pipeline_run(case: dict, g: torch.Generator):
    """Run the tiny SD pipeline once and record every step.

    Returns (steps, unet, prompt_embeds, negative_prompt_embeds, rescales). steps are PipelineRecorder's:
    t (the timestep the UNet got), denoiser_input (the latents as the UNet saw them: doubled when guiding,
    already scheduler-scaled), denoiser_output, step_input (the model_output scheduler.step received).
    rescales[i] = (noise_cfg, noise_pred_text, guidance_rescale) when the pipeline rescaled at step i.
    """
    dtype = DTYPES[case.get("dtype", "float32")]
    unet = tiny.unet_cond().requires_grad_(False)
    if dtype == torch.float16:
        unet = unet.half()  # nn.Module.half: ModelMixin.to would log a from_pretrained warning
    pipe = tiny.sd_pipeline(SCHEDULERS[case["scheduler"]](), unet, tiny.vae())
    B = case["batch"]
    prompt_embeds = tiny.text_embeddings(B, g).to(dtype)
    negative_prompt_embeds = tiny.text_embeddings(B, g).to(dtype)
    seed = seed_from(g)

    rescales: dict[int, tuple] = {}

    def recording_rescale(noise_cfg, noise_pred_text, guidance_rescale=0.0):
        rescales[len(rec.steps) - 1] = (noise_cfg.clone(), noise_pred_text.clone(), guidance_rescale)
        return reference_rescale(noise_cfg, noise_pred_text, guidance_rescale=guidance_rescale)

    sd_module.rescale_noise_cfg = recording_rescale
    try:
        with PipelineRecorder(pipe, unet) as rec, quiet_diffusers():
            pipe(prompt_embeds=prompt_embeds.clone(), negative_prompt_embeds=negative_prompt_embeds.clone(),
                 guidance_scale=case["guidance_scale"], guidance_rescale=case.get("guidance_rescale", 0.0),
                 num_inference_steps=case.get("steps", 3), height=16, width=16, output_type="latent",
                 generator=torch.Generator().manual_seed(seed))
    finally:
        sd_module.rescale_noise_cfg = reference_rescale
    assert all(s.step_input is not None for s in rec.steps), "the pipeline called the UNet without stepping"
    return rec.steps, unet, prompt_embeds, negative_prompt_embeds, rescales


def step_label(i: int, steps: list, case: dict) -> str:
    t = steps[i].t
    t = t.item() if isinstance(t, torch.Tensor) else t
    return f"step {i + 1}/{len(steps)}, t={t:g}, guidance_scale={case['guidance_scale']}"


# ---- guidance_combine ---------------------------------------------------------------------------------
guidance_combine = Kata(
    "guidance_combine",
    hints=(
        "Start from the unconditional prediction and move towards the text prediction; "
        "guidance_scale says how far (1 = exactly to it, more = past it).",
        "ε̂ = ε_u + s·(ε_c − ε_u). (Ho & Salimans write (1 + w)·ε_c − w·ε_u: diffusers' s is their 1 + w.)",
        "return noise_uncond + guidance_scale * (noise_text - noise_uncond)",
    ),
    answer_key=PIPELINE_KEYS,
)


@guidance_combine.check(
    "vs StableDiffusionPipeline, every step",
    cases=[dict(scheduler="DDIM", batch=1, guidance_scale=7.5),
           dict(scheduler="Euler", batch=2, guidance_scale=3.0),
           dict(scheduler="DDIM trailing", batch=3, guidance_scale=12.0, dtype="float16"),
           dict(scheduler="DDIM", batch=2, guidance_scale=1.0)],
    tol=STEP_MATH)
def _(case, g):
    steps, unet, prompt_embeds, negative_prompt_embeds, _ = pipeline_run(case, g)
    scenarios = []
    for i, s in enumerate(steps):
        label = step_label(i, steps, case)
        if case["guidance_scale"] > 1:
            noise_uncond, noise_text = s.denoiser_output.chunk(2)  # the pipeline's own split
        else:
            # At guidance_scale ≤ 1 the pipeline runs the text branch alone and steps with it; ask the
            # same UNet the unconditional question on the same input to have both branches.
            noise_text = s.denoiser_output
            with torch.no_grad():
                noise_uncond = unet(s.denoiser_input, s.t, encoder_hidden_states=negative_prompt_embeds).sample
            label += " (no guidance: the pipeline steps with ε_c itself)"
        scenarios.append(Scenario(
            inputs=dict(noise_uncond=noise_uncond.clone(), noise_text=noise_text.clone(),
                        guidance_scale=case["guidance_scale"]),
            expected=s.step_input, exact=combine_shadow(noise_uncond, noise_text, case["guidance_scale"]),
            label=label))
    return scenarios


def combine_shadow(noise_uncond, noise_text, guidance_scale):
    """ε_u + s·(ε_c − ε_u) in float64: the pipeline's combine, widened."""
    u = noise_uncond.double()
    return u + guidance_scale * (noise_text.double() - u)


@guidance_combine.check(
    "vs ClassifierFreeGuidance, scales below, at and above 1",
    # The formula holds for every s: the guider applies it unless s == 1 (where it returns ε_c, the same
    # thing). Only StableDiffusionPipeline skips guidance for s ≤ 1, by not running the unconditional
    # branch at all: that is guided_noise's business, not the combine's.
    cases=[dict(shape=(2, 4, 5, 7), guidance_scale=0.5),
           dict(shape=(3, 4, 6, 6), guidance_scale=0.0),
           dict(shape=(1, 3, 9, 5), guidance_scale=1.0),
           dict(shape=(2, 16, 4, 6), guidance_scale=2.5),
           dict(shape=(2, 4, 5, 7), guidance_scale=0.25, dtype="float16")],
    tol=STEP_MATH)
def _(case, g):
    dtype = DTYPES[case.get("dtype", "float32")]
    noise_text = torch.randn(case["shape"], generator=g)
    noise_uncond = (noise_text + 0.5 * torch.randn(case["shape"], generator=g)).to(dtype)
    noise_text = noise_text.to(dtype)
    level = diffusers_logging.get_verbosity()  # every guider logs "Guiders are currently an experimental feature"
    diffusers_logging.set_verbosity_error()
    try:
        guider = ClassifierFreeGuidance(guidance_scale=case["guidance_scale"])
    finally:
        diffusers_logging.set_verbosity(level)
    expected = guider.forward(noise_text.clone(), noise_uncond.clone()).pred
    return Scenario(inputs=dict(noise_uncond=noise_uncond, noise_text=noise_text,
                                guidance_scale=case["guidance_scale"]),
                    expected=expected, exact=combine_shadow(noise_uncond, noise_text, case["guidance_scale"]),
                    label=f"guidance_scale={case['guidance_scale']}")


@guidance_combine.trap("no guidance below s = 1: ε_c returned instead of ε_u + s·(ε_c − ε_u)",
                       hint="The combine is the formula for every s: at 0 < s < 1 it lands between ε_u and ε_c, "
                            "at s = 0 on ε_u. Only the pipeline skips guidance at s ≤ 1, by never asking the "
                            "unconditional question (guided_noise).")
def _(noise_uncond, noise_text, guidance_scale):
    return noise_text.clone() if guidance_scale <= 1 else noise_uncond + guidance_scale * (noise_text - noise_uncond)


@guidance_combine.trap("branches swapped: ε_c + s·(ε_u − ε_c)",
                       hint="The base is the UNCONDITIONAL prediction; guidance moves from it towards the "
                            "text prediction: ε_u + s·(ε_c − ε_u). Swapped, it steers away from the prompt.")
def _(noise_uncond, noise_text, guidance_scale):
    return noise_text + guidance_scale * (noise_uncond - noise_text)


@guidance_combine.trap("the paper's form ε_c + s·(ε_c − ε_u) with diffusers' scale",
                       hint="Ho & Salimans' (1 + w)·ε_c − w·ε_u = ε_c + w·(ε_c − ε_u) uses w = s − 1. With "
                            "diffusers' guidance_scale s, start from ε_u: ε_u + s·(ε_c − ε_u).")
def _(noise_uncond, noise_text, guidance_scale):
    return noise_text + guidance_scale * (noise_text - noise_uncond)


@guidance_combine.trap("ε_u + s·ε_c (the difference ε_c − ε_u is missing)",
                       hint="Guidance scales the DIFFERENCE the prompt makes, ε_c − ε_u, not ε_c itself.")
def _(noise_uncond, noise_text, guidance_scale):
    return noise_uncond + guidance_scale * noise_text


@guidance_combine.trap("s·(ε_c − ε_u) without the ε_u base",
                       hint="The difference is a direction; add it to the unconditional prediction: ε_u + s·(ε_c − ε_u).")
def _(noise_uncond, noise_text, guidance_scale):
    return guidance_scale * (noise_text - noise_uncond)


@guidance_combine.trap("ε_u + s·ε_c − ε_u (parentheses missing: only the text branch is scaled)",
                       hint="Without parentheses ε_u cancels and you return s·ε_c. Write s * (ε_c − ε_u).")
def _(noise_uncond, noise_text, guidance_scale):
    return noise_uncond + guidance_scale * noise_text - noise_uncond


@guidance_combine.trap("(1 − s)·ε_u + s·ε_c: equal in exact math, but float16 cancels two large terms",
                       hint="At s = 12 both terms are ~12× the answer and float16 rounds each to ~3 digits "
                            "before they cancel. ε_u + s·(ε_c − ε_u) scales the small difference instead; "
                            "it is also what the pipeline computes.")
def _(noise_uncond, noise_text, guidance_scale):
    return (1 - guidance_scale) * noise_uncond + guidance_scale * noise_text


# ---- rescale_guidance ----------------------------------------------------------------------------------
rescale_guidance = Kata(
    "rescale_guidance",
    hints=(
        "Give each guided sample the standard deviation of its text prediction, then blend that with "
        "the guided prediction by guidance_rescale.",
        "σ per sample over dims 1…n (keepdim); rescaled = ε̂·σ(ε_c)/σ(ε̂); "
        "result = φ·rescaled + (1 − φ)·ε̂.",
        "dims = list(range(1, noise_cfg.ndim)); r = noise_cfg * (noise_text.std(dim=dims, keepdim=True) "
        "/ noise_cfg.std(dim=dims, keepdim=True)); "
        "return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg",
    ),
    answer_key=RESCALE_KEYS + PIPELINE_KEYS,
)


@rescale_guidance.check(
    "vs rescale_noise_cfg",
    cases=[dict(shape=(4, 4, 8, 8), guidance_rescale=0.7),
           dict(shape=(2, 4, 16, 16), guidance_rescale=1.0),
           dict(shape=(3, 64, 16), guidance_rescale=0.3),  # a transformer's (B, tokens, D) prediction
           dict(shape=(2, 3, 5, 7), guidance_rescale=0.0),  # φ = 0: noise_cfg itself
           dict(shape=(3, 4, 8, 8), guidance_rescale=0.7, dtype="float16")],
    tol=STEP_MATH)
def _(case, g):
    dtype = DTYPES[case.get("dtype", "float32")]
    shape, B = case["shape"], case["shape"][0]
    per_sample = (B,) + (1,) * (len(shape) - 1)
    # Predictions at different scales per sample, and a guided one inflated by a per-sample scale s:
    # one σ for the whole batch is then clearly wrong.
    scale = torch.empty(per_sample).uniform_(0.5, 2.0, generator=g)
    noise_text = scale * torch.randn(shape, generator=g)
    noise_uncond = noise_text + 0.5 * scale * torch.randn(shape, generator=g)
    s = torch.empty(per_sample).uniform_(2.0, 12.0, generator=g)
    noise_cfg = noise_uncond + s * (noise_text - noise_uncond)
    noise_cfg, noise_text = noise_cfg.to(dtype), noise_text.to(dtype)
    return Scenario(
        inputs=dict(noise_cfg=noise_cfg, noise_text=noise_text, guidance_rescale=case["guidance_rescale"]),
        expected=reference_rescale(noise_cfg.clone(), noise_text.clone(), guidance_rescale=case["guidance_rescale"]),
        exact=reference_rescale(noise_cfg.double(), noise_text.double(), guidance_rescale=case["guidance_rescale"]))


@rescale_guidance.check(
    "vs StableDiffusionPipeline, rescale on",
    cases=[dict(scheduler="DDIM", batch=2, guidance_scale=7.5, guidance_rescale=0.7),
           dict(scheduler="Euler", batch=3, guidance_scale=5.0, guidance_rescale=0.5, dtype="float16")],
    tol=STEP_MATH)
def _(case, g):
    steps, *_, rescales = pipeline_run(case, g)
    scenarios = []
    for i, s in enumerate(steps):
        noise_cfg, noise_text, phi = rescales[i]  # what the pipeline handed to rescale_noise_cfg
        scenarios.append(Scenario(
            inputs=dict(noise_cfg=noise_cfg, noise_text=noise_text, guidance_rescale=phi),
            expected=s.step_input, exact=reference_rescale(noise_cfg.double(), noise_text.double(), phi),
            label=step_label(i, steps, case) + f", guidance_rescale={phi}"))
    return scenarios


def _std(x, dims):
    return x.std(dim=dims, keepdim=True)


def _per_sample_dims(x):
    return list(range(1, x.ndim))


@rescale_guidance.trap("one σ for the whole batch instead of one per sample",
                       hint="Reduce over every dim but the batch (dims 1…n, keepdim=True): each sample "
                            "keeps its own scale, σ has shape (B, 1, 1, 1).")
def _(noise_cfg, noise_text, guidance_rescale):
    r = noise_cfg * (noise_text.std() / noise_cfg.std())
    return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg


@rescale_guidance.trap("σ per sample AND channel (dims 2…n) instead of per sample",
                       hint="diffusers takes one σ per sample over ALL its other dims: range(1, ndim).")
def _(noise_cfg, noise_text, guidance_rescale):
    dims = list(range(2, noise_cfg.ndim))
    r = noise_cfg * (_std(noise_text, dims) / _std(noise_cfg, dims))
    return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg


@rescale_guidance.trap("the rescaled prediction returned without the φ blend",
                       hint="Blend: φ·rescaled + (1 − φ)·noise_cfg. φ = 1 keeps only the rescaled "
                            "prediction, φ = 0 none of it.")
def _(noise_cfg, noise_text, guidance_rescale):
    dims = _per_sample_dims(noise_cfg)
    return noise_cfg * (_std(noise_text, dims) / _std(noise_cfg, dims))


@rescale_guidance.trap("φ·rescaled + noise_cfg (the (1 − φ) weight is missing)",
                       hint="The two weights add to 1: φ·rescaled + (1 − φ)·noise_cfg.")
def _(noise_cfg, noise_text, guidance_rescale):
    dims = _per_sample_dims(noise_cfg)
    return guidance_rescale * noise_cfg * (_std(noise_text, dims) / _std(noise_cfg, dims)) + noise_cfg


@rescale_guidance.trap("blended with noise_text instead of noise_cfg",
                       hint="The (1 − φ) part is the guided prediction noise_cfg itself, not the text one.")
def _(noise_cfg, noise_text, guidance_rescale):
    dims = _per_sample_dims(noise_cfg)
    r = noise_cfg * (_std(noise_text, dims) / _std(noise_cfg, dims))
    return guidance_rescale * r + (1 - guidance_rescale) * noise_text


@rescale_guidance.trap("the ratio upside down: σ(ε̂)/σ(ε_c)",
                       hint="Rescale TOWARDS the text prediction's scale: multiply by σ(noise_text)/σ(noise_cfg).")
def _(noise_cfg, noise_text, guidance_rescale):
    dims = _per_sample_dims(noise_cfg)
    r = noise_cfg * (_std(noise_cfg, dims) / _std(noise_text, dims))
    return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg


@rescale_guidance.trap("the φ blend weights swapped: (1 − φ)·rescaled + φ·noise_cfg",
                       hint="φ is the weight of the RESCALED prediction: φ·rescaled + (1 − φ)·noise_cfg "
                            "(torch.lerp(noise_cfg, rescaled, φ), the start first).")
def _(noise_cfg, noise_text, guidance_rescale):
    dims = _per_sample_dims(noise_cfg)
    r = noise_cfg * (_std(noise_text, dims) / _std(noise_cfg, dims))
    return (1 - guidance_rescale) * r + guidance_rescale * noise_cfg


@rescale_guidance.trap("σ over dims (1, 2, 3): four dimensions assumed (a transformer's (B, L, C) has three)",
                       hint="Reduce over every dim but the batch, whatever their number: "
                            "dim=list(range(1, x.ndim)).")
def _(noise_cfg, noise_text, guidance_rescale):
    r = noise_cfg * (noise_text.std(dim=(1, 2, 3), keepdim=True) / noise_cfg.std(dim=(1, 2, 3), keepdim=True))
    return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg


# ---- guided_noise ---------------------------------------------------------------------------------------
COUNTED_UNET = "UNet2DConditionModel(tiny, random weights; calls counted)"  # the probe's repr in messages


def one_batched_call(counter: DenoiserProbe, B: int, guidance_scale: float):
    """A Scenario.verify: exactly one denoiser call, on 2B samples (or on B when there is no guidance)."""

    def verify(_output):
        seen = counter.batch_sizes
        allowed = [2 * B] if guidance_scale > 1 else [B, 2 * B]
        if len(seen) == 1 and seen[0] in allowed:
            return
        calls = f"{len(seen)} call{'s' if len(seen) != 1 else ''}"
        sizes = f" with batch sizes {seen}" if seen else ""
        if guidance_scale > 1:
            want = (f"exactly one call on the doubled batch of {2 * B} (2·B, B = {B}): both branches in one "
                    "forward, latents torch.cat([latents, latents]) and conditioning "
                    "torch.cat([negative_prompt_embeds, prompt_embeds]), then .chunk(2).")
        else:
            want = (f"one call: at guidance_scale ≤ 1 the pipeline runs the text branch alone on batch {B} "
                    f"(one call on {2 * B} is accepted too).")
        trap = ""
        if guidance_scale > 1 and seen == [B, B]:  # the two branches asked one after the other
            trap = ("\n  trap: one denoiser call per branch (two calls of batch B), not one on the doubled batch\n"
                    "    The pipeline asks both questions in one forward: it halves the calls, and the UNet sees the "
                    "same batch (2B) it was measured on.")
        raise KataFailure(f"  `guided_noise` made {calls} to the denoiser{sizes} for one step; expected {want}{trap}")

    return verify


guided_noise = Kata(
    "guided_noise",
    hints=(
        "Ask both questions in one batch: the latents twice, the negative embeddings first and the prompt "
        "embeddings second. Then split the output in the same order and use your two functions above.",
        "x = cat([z, z]); c = cat([c_neg, c_pos]); ε = unet(x, t, encoder_hidden_states=c).sample; "
        "ε_u, ε_c = ε.chunk(2); ε̂ = guidance_combine(ε_u, ε_c, s); if φ > 0: rescale_guidance(ε̂, ε_c, φ). "
        "At s ≤ 1 the pipeline skips guidance: text_noise(...) alone.",
        "noise = unet(torch.cat([latents] * 2), timestep, encoder_hidden_states=torch.cat("
        "[negative_prompt_embeds, prompt_embeds])).sample; noise_uncond, noise_text = noise.chunk(2)",
    ),
    answer_key=PIPELINE_KEYS + RESCALE_KEYS,
)


@guided_noise.check(
    "vs StableDiffusionPipeline, every step",
    cases=[dict(scheduler="DDIM", batch=1, guidance_scale=7.5),
           dict(scheduler="DDIM trailing", batch=2, guidance_scale=5.0, guidance_rescale=0.7),
           dict(scheduler="Euler", batch=2, guidance_scale=7.5),
           dict(scheduler="Euler", batch=1, guidance_scale=4.0, guidance_rescale=0.5, dtype="float16"),
           dict(scheduler="DDIM", batch=2, guidance_scale=1.0),
           dict(scheduler="Euler", batch=2, guidance_scale=0.5, guidance_rescale=0.7)],
    tol=MODEL_FORWARD)
def _(case, g):
    steps, unet, prompt_embeds, negative_prompt_embeds, _ = pipeline_run(case, g)
    B, gs = case["batch"], case["guidance_scale"]
    shadow = guided_shadow(unet, prompt_embeds, negative_prompt_embeds, gs, case.get("guidance_rescale", 0.0))
    scenarios = []
    for i, s in enumerate(steps):
        counter = DenoiserProbe(unet, label=COUNTED_UNET)
        scenarios.append(Scenario(
            inputs=dict(unet=counter, latents=s.denoiser_input[:B].clone(), timestep=s.t,
                        prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                        guidance_scale=gs, guidance_rescale=case.get("guidance_rescale", 0.0)),
            expected=s.step_input, exact=shadow(s.denoiser_input[:B], s.t),
            label=step_label(i, steps, case)
            + (", latents already ÷√(σ²+1)" if case["scheduler"] == "Euler" else ""),
            verify=one_batched_call(counter, B, gs)))
    return scenarios


def guided_shadow(unet, prompt_embeds, negative_prompt_embeds, guidance_scale, guidance_rescale):
    """The pipeline's guided prediction from a float64 copy of the same UNet, on widened inputs."""
    unet64 = copy.deepcopy(unet).double()
    pos, neg = prompt_embeds.double(), negative_prompt_embeds.double()

    @torch.no_grad()
    def shadow(latents, t):
        x = latents.double()
        if guidance_scale <= 1:
            return unet64(x, t, encoder_hidden_states=pos).sample
        both = unet64(torch.cat([x, x]), t, encoder_hidden_states=torch.cat([neg, pos])).sample
        noise_uncond, noise_text = both.chunk(2)
        guided = combine_shadow(noise_uncond, noise_text, guidance_scale)
        return reference_rescale(guided, noise_text, guidance_rescale) if guidance_rescale > 0 else guided

    return shadow


def _branches(unet, latents, timestep, first, second):
    out = unet(torch.cat([latents, latents]), timestep, encoder_hidden_states=torch.cat([first, second])).sample
    return out.chunk(2)


@guided_noise.trap("conditioning batch built text-first (or chunks read in the wrong order)",
                   hint="diffusers puts the unconditional half FIRST: encoder_hidden_states = "
                        "torch.cat([negative_prompt_embeds, prompt_embeds]), and .chunk(2) gives "
                        "(uncond, text) in that order.")
def _(unet, latents, timestep, prompt_embeds, negative_prompt_embeds, guidance_scale, guidance_rescale=0.0):
    noise_text, noise_uncond = _branches(unet, latents, timestep, negative_prompt_embeds, prompt_embeds)
    guided = noise_uncond + guidance_scale * (noise_text - noise_uncond)
    if guidance_rescale > 0:
        guided = reference_rescale(guided, noise_text, guidance_rescale)
    return guided


@guided_noise.trap("the latents doubled sample by sample ([x0, x0, x1, x1, …]) against prompts stacked "
                   "[negatives; positives]",
                   hint="The batch halves must line up: torch.cat([latents, latents]) ([x0, x1, …, x0, x1, …]) next to "
                        "torch.cat([negative_prompt_embeds, prompt_embeds]). repeat_interleave pairs sample 0 with "
                        "two negatives once the batch has two or more samples.")
def _(unet, latents, timestep, prompt_embeds, negative_prompt_embeds, guidance_scale, guidance_rescale=0.0):
    if guidance_scale <= 1:
        return unet(latents, timestep, encoder_hidden_states=prompt_embeds).sample
    out = unet(latents.repeat_interleave(2, dim=0), timestep,
               encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample
    noise_uncond, noise_text = out.chunk(2)
    guided = noise_uncond + guidance_scale * (noise_text - noise_uncond)
    if guidance_rescale > 0:
        guided = reference_rescale(guided, noise_text, guidance_rescale)
    return guided


@guided_noise.trap("guidance_rescale ignored",
                   hint="When guidance_rescale > 0, pass the guided prediction and the TEXT prediction to "
                        "rescale_guidance before returning.")
def _(unet, latents, timestep, prompt_embeds, negative_prompt_embeds, guidance_scale, guidance_rescale=0.0):
    noise_uncond, noise_text = _branches(unet, latents, timestep, negative_prompt_embeds, prompt_embeds)
    return noise_uncond + guidance_scale * (noise_text - noise_uncond)


@guided_noise.trap("rescaled towards the unconditional prediction's σ",
                   hint="Rescale matches the TEXT prediction's standard deviation: "
                        "rescale_guidance(guided, noise_text, guidance_rescale).")
def _(unet, latents, timestep, prompt_embeds, negative_prompt_embeds, guidance_scale, guidance_rescale=0.0):
    noise_uncond, noise_text = _branches(unet, latents, timestep, negative_prompt_embeds, prompt_embeds)
    guided = noise_uncond + guidance_scale * (noise_text - noise_uncond)
    if guidance_rescale > 0:
        guided = reference_rescale(guided, noise_uncond, guidance_rescale)
    return guided


@guided_noise.trap("guidance applied at guidance_scale ≤ 1 (the pipeline guides only when s > 1)",
                   hint="StableDiffusionPipeline guides only when guidance_scale > 1 (do_classifier_free_guidance): "
                        "at s ≤ 1 it runs the text branch alone and returns ε_c (text_noise), with no rescale. "
                        "At s = 1 guiding happens to give the same numbers; at s = 0.5 it does not.")
def _(unet, latents, timestep, prompt_embeds, negative_prompt_embeds, guidance_scale, guidance_rescale=0.0):
    noise_uncond, noise_text = _branches(unet, latents, timestep, negative_prompt_embeds, prompt_embeds)
    guided = noise_uncond + guidance_scale * (noise_text - noise_uncond)
    if guidance_rescale > 0:
        guided = reference_rescale(guided, noise_text, guidance_rescale)
    return guided


@guided_noise.trap("the text prediction alone (no guidance applied)",
                   hint="With guidance_scale > 1 combine both halves: ε_u + s·(ε_c − ε_u).")
def _(unet, latents, timestep, prompt_embeds, negative_prompt_embeds, guidance_scale, guidance_rescale=0.0):
    return _branches(unet, latents, timestep, negative_prompt_embeds, prompt_embeds)[1]


# ---- budget --------------------------------------------------------------------------------------------
@guided_noise.budget("one batched denoiser call per step")
def _(learner, g):
    from diffusion_katas.core.spec import Measurement

    B, steps = 2, 4
    counter = DenoiserProbe(tiny.unet_cond().requires_grad_(False), label=COUNTED_UNET)
    prompt, negative = tiny.text_embeddings(B, g), tiny.text_embeddings(B, g)
    for t in torch.linspace(999, 1, steps).long():
        latents = torch.randn((B, tiny.LATENT_CHANNELS, 8, 8), generator=g)
        learner(unet=counter, latents=latents, timestep=t, prompt_embeds=prompt,
                negative_prompt_embeds=negative, guidance_scale=7.5, guidance_rescale=0.0)
    return [
        Measurement(f"denoiser calls over {steps} guided steps", counter.calls, steps, "calls",
                    "one call per step: both branches ride in one batch of 2B (the UNet's cost per step "
                    "is set by its calls; two calls of B pay the launch and weight traffic twice)"),
        Measurement("smallest batch the denoiser saw", min(counter.batch_sizes, default=0), 2 * B, "",
                    f"every call carries the doubled batch of 2B = {2 * B}", at_least=True),
    ]
