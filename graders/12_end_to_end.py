"""Grader for lab 12 · End-to-end inference trace: denoise, text_to_image, inference_trace.

Every expected value comes from one call of a tiny StableDiffusionPipeline (prompt_embeds and
negative_prompt_embeds; nothing downloaded). Hooks record what the pipeline's own components see:
prepare_latents' result and the generator's state after it, the UNet's inputs and outputs, what
scheduler.step receives, and the decoder's output.
"""
import copy
import functools

import torch
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler

from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import (DTYPES, EVERY_PIPELINE_CALL, SD_BETAS, PipelineRecorder, TrajectoryProbe,
                                           first_divergence, localizer, quiet_diffusers, seed_from)
from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import MODEL_FORWARD, TRACE_VALUES

SCHEDULERS = {
    "DDIM": lambda: DDIMScheduler(**SD_BETAS),
    # "leading" spacing: init_noise_sigma depends on set_timesteps (157.4 before, ~26 after)
    "Euler leading": lambda: EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="leading"),
}
PIPELINE_KEYS = ("diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.StableDiffusionPipeline.__call__",
                 EVERY_PIPELINE_CALL)  # any pipeline's loop is a route to this one


def _built_with_channels(channels: int):
    """tiny's UNet and x2 VAE with another latent width (SD3 and Flux use 16): the same configs, with
    in/out_channels and latent_channels changed. A pipeline reads the width from unet.config.in_channels."""
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

    unet_config = dict(tiny.unet_cond().config, in_channels=channels, out_channels=channels)
    vae_config = dict(tiny.vae().config, latent_channels=channels)
    return UNet2DConditionModel.from_config(unet_config).eval(), AutoencoderKL.from_config(vae_config).eval()


@functools.cache
def _models(dtype_name: str, channels: int = tiny.LATENT_CHANNELS):
    """The tiny UNet and VAE, built once per dtype (and latent width) from a fixed seed (the pipeline does
    not train them)."""
    state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    if channels == tiny.LATENT_CHANNELS:
        unet, vae = tiny.unet_cond(), tiny.vae()
    else:
        unet, vae = _built_with_channels(channels)
    torch.random.set_rng_state(state)
    if dtype_name == "float16":
        unet, vae = unet.half(), vae.half()  # nn.Module.half: ModelMixin.to logs a from_pretrained warning
    return unet.requires_grad_(False), vae.requires_grad_(False)


def record_run(case: dict, g: torch.Generator, output_type: str):
    """One pipeline call, recorded. Returns (pipe, inputs for the learner, record dict, output, seed)."""
    dtype = DTYPES[case.get("dtype", "float32")]
    unet, vae = _models(case.get("dtype", "float32"), case.get("latent_channels", tiny.LATENT_CHANNELS))
    pipe = tiny.sd_pipeline(SCHEDULERS[case["scheduler"]](), unet, vae)
    # The learner's scheduler: the pipeline's own (whose config __init__ rewrote), untouched by the run.
    learner_scheduler = copy.deepcopy(pipe.scheduler)
    B, height, width = case["batch"], case["height"], case["width"]
    prompt, negative = tiny.text_embeddings(B, g).to(dtype), tiny.text_embeddings(B, g).to(dtype)
    seed = seed_from(g)
    generator = torch.Generator().manual_seed(seed)
    rec, out = _run(pipe, unet, prompt, negative, height, width, case["steps"], case["guidance_scale"], generator,
                    output_type, guidance_rescale=case.get("guidance_rescale", 0.0), eta=case.get("eta", 0.0))
    inputs = dict(unet=unet, scheduler=learner_scheduler, prompt_embeds=prompt, negative_prompt_embeds=negative)
    return pipe, inputs, rec, out, seed


CASES = [
    dict(scheduler="DDIM", batch=1, height=16, width=16, steps=3, guidance_scale=7.5),
    dict(scheduler="DDIM", batch=2, height=16, width=24, steps=4, guidance_scale=5.0, eta=1.0, guidance_rescale=0.7),
    dict(scheduler="Euler leading", batch=2, height=16, width=16, steps=3, guidance_scale=7.5),
    dict(scheduler="DDIM", batch=2, height=16, width=16, steps=3, guidance_scale=4.0, dtype="float16", eta=0.5),
    # Latents 3 channels wide (SD's 4 is a config value: SD3 and Flux use 16): a hard-coded 4 fails here.
    dict(scheduler="Euler leading", batch=2, height=24, width=32, steps=4, guidance_scale=6.0, latent_channels=3),
]


def _run(pipe, unet, prompt, negative, height, width, steps, guidance_scale, generator, output_type, *,
         guidance_rescale=0.0, eta=0.0):
    """The pipeline called once, recorded: (record dict, output). PipelineRecorder sees the UNet and
    scheduler.step; x_T, the generator after it and the decoder's output are recorded here."""
    rec: dict = {}
    original_prepare = pipe.prepare_latents

    def prepare_latents(*args, **kwargs):
        latents = original_prepare(*args, **kwargs)
        rec["initial"] = latents.clone()
        rec["generator_after_prepare"] = generator.get_state()
        return latents

    def decoder_post(module, args, out):
        rec["decoded"] = out.clone()

    pipe.prepare_latents = prepare_latents
    hook = pipe.vae.decoder.register_forward_hook(decoder_post)
    try:
        with torch.no_grad(), quiet_diffusers(), PipelineRecorder(pipe, unet) as recorder:
            out = pipe(prompt_embeds=prompt, negative_prompt_embeds=negative, height=height, width=width,
                       num_inference_steps=steps, guidance_scale=guidance_scale, guidance_rescale=guidance_rescale,
                       eta=eta, generator=generator, output_type=output_type)
    finally:
        hook.remove()
    rec.update(steps=recorder.steps, final=recorder.final, generator=generator)  # the generator, after the run
    return rec, out

# ---- denoise -------------------------------------------------------------------------------------------
denoise = Kata(
    "denoise",
    hints=(
        "The loop owns nothing new: set the timesteps, then per t ask the scheduler how to scale, your "
        "guided_noise what the noise is, and the scheduler what comes next.",
        "scheduler.set_timesteps(n); for t in scheduler.timesteps: x_in = scheduler.scale_model_input(x, t); "
        "ε̂ = cfg.guided_noise(unet, x_in, t, c, c_∅, s, φ); x = scheduler.step(ε̂, t, x, eta=η, generator=g).prev_sample "
        "(pass only the arguments step accepts: step_kwargs).",
        "extra = step_kwargs(scheduler, generator, eta); for t in scheduler.timesteps: "
        "latents = scheduler.step(cfg.guided_noise(unet, scheduler.scale_model_input(latents, t), t, prompt_embeds, "
        "negative_prompt_embeds, guidance_scale, guidance_rescale), t, latents, **extra).prev_sample",
    ),
    answer_key=PIPELINE_KEYS,
)


@denoise.check("vs StableDiffusionPipeline latents", cases=CASES, tol=MODEL_FORWARD)
def _(case, g):
    pipe, inputs, rec, out, _seed = record_run(case, g, "latent")
    generator = torch.Generator()
    generator.set_state(rec["generator_after_prepare"])  # where the pipeline's generator stood at the loop
    probe = TrajectoryProbe(inputs["unet"], label=f"{type(inputs['unet']).__name__}(tiny, random weights)")
    inputs.update(unet=probe, latents=rec["initial"], num_inference_steps=case["steps"],
                  guidance_scale=case["guidance_scale"], generator=generator, eta=case.get("eta", 0.0),
                  guidance_rescale=case.get("guidance_rescale", 0.0))
    # A DDIM step with η > 0 draws from the generator: the loop must draw what the pipeline's did, no more.
    # A loop that ends wrong is told where it first left the pipeline's trajectory (the probe's record).
    return Scenario(inputs=inputs, expected=out.images, label=f"{case['scheduler']}, {case['steps']} steps",
                    generators_after={"generator": rec["generator"]}, on_mismatch=localizer(probe, rec["steps"]))


def _loop(unet, scheduler, latents, prompt_embeds, negative_prompt_embeds, num_inference_steps, guidance_scale,
          generator, eta, guidance_rescale, *, scale=True, extra=True, swapped=False, rescale=True,
          step_scaled=False):
    """The reference loop with switches for the traps, built on the pipeline's own math."""
    import inspect

    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg

    scheduler.set_timesteps(num_inference_steps)
    accepted = inspect.signature(scheduler.step).parameters
    kwargs = {k: v for k, v in (("eta", eta), ("generator", generator)) if k in accepted} if extra else {}
    for t in scheduler.timesteps:
        x = torch.cat([latents] * 2)
        x = scheduler.scale_model_input(x, t) if scale else x
        text = [prompt_embeds, negative_prompt_embeds] if swapped else [negative_prompt_embeds, prompt_embeds]
        u, c = unet(x, t, encoder_hidden_states=torch.cat(text)).sample.chunk(2)
        noise = u + guidance_scale * (c - u)
        if guidance_rescale > 0 and rescale:
            noise = rescale_noise_cfg(noise, c, guidance_rescale)
        latents = scheduler.step(noise, t, x.chunk(2)[0] if step_scaled else latents, **kwargs).prev_sample
    return latents


@denoise.trap("scale_model_input skipped",
              hint="Euler expects its input divided by √(σ²+1): always call scheduler.scale_model_input(latents, t) "
                   "before the UNet (for DDIM it changes nothing, which is why the bug hides).")
@torch.no_grad()
def _(**kw):
    return _loop(**kw, scale=False)


@denoise.trap("eta and generator not passed to scheduler.step",
              hint="DDIM with η > 0 adds noise each step: pass eta and the same generator (step_kwargs gives "
                   "exactly the arguments the scheduler's step accepts).")
@torch.no_grad()
def _(**kw):
    return _loop(**kw, extra=False)


@denoise.trap("the CFG batch's text ordered [positive, negative] (the halves swapped)",
              hint="The pipeline's batch is [unconditional, conditional]: torch.cat([negative_prompt_embeds, "
                   "prompt_embeds]), so noise.chunk(2) gives (ε_uncond, ε_text) in that order.")
@torch.no_grad()
def _(**kw):
    return _loop(**kw, swapped=True)


@denoise.trap("guidance_rescale ignored",
              hint="With guidance_rescale > 0 the guided noise is rescaled toward the text prediction's standard "
                   "deviation (rescale_noise_cfg, lab 04's guided_noise takes guidance_rescale): pass it on.")
@torch.no_grad()
def _(**kw):
    return _loop(**kw, rescale=False)


@denoise.trap("scheduler.step given the scaled model input instead of the latents",
              hint="scale_model_input makes the UNet's input only: step from the latents as they were, "
                   "scheduler.step(noise, t, latents). Euler's scaling divides by √(σ²+1); DDIM's changes nothing.")
@torch.no_grad()
def _(**kw):
    return _loop(**kw, step_scaled=True)


# ---- text_to_image -------------------------------------------------------------------------------------
text_to_image = Kata(
    "text_to_image",
    hints=(
        "Four stages: prepare (timesteps, then x_T), denoise, decode, postprocess; each one is a kata you wrote.",
        "set_timesteps(n); x_T = prepare_latents(B, unet.config.in_channels, H, W, vae_scale_factor(...), "
        "scheduler.init_noise_sigma, generator, prompt_embeds.dtype); x_0 = denoise(...); "
        "image = postprocess(decode_latents(vae, x_0), 'pt').",
        "scheduler.set_timesteps(num_inference_steps); latents = components.prepare_latents(prompt_embeds.shape[0], "
        "unet.config.in_channels, height, width, vae_lab.vae_scale_factor(vae.config.block_out_channels), "
        "float(scheduler.init_noise_sigma), generator, prompt_embeds.dtype); then denoise, decode_latents, postprocess",
    ),
    answer_key=PIPELINE_KEYS,
)


@text_to_image.check("vs StableDiffusionPipeline images", cases=CASES, tol=MODEL_FORWARD)
def _(case, g):
    pipe, inputs, rec, out, seed = record_run(case, g, "pt")
    inputs.update(vae=_models(case.get("dtype", "float32"), case.get("latent_channels", tiny.LATENT_CHANNELS))[1],
                  height=case["height"], width=case["width"], num_inference_steps=case["steps"],
                  guidance_scale=case["guidance_scale"], generator=torch.Generator().manual_seed(seed),
                  eta=case.get("eta", 0.0), guidance_rescale=case.get("guidance_rescale", 0.0))
    return Scenario(inputs=inputs, expected=out.images, label=f"{case['scheduler']}, {case['steps']} steps",
                    generators_after={"generator": rec["generator"]})


def _image(unet, vae, scheduler, prompt_embeds, negative_prompt_embeds, height, width, num_inference_steps,
           guidance_scale, generator, eta, guidance_rescale, *, sigma_before=False, decode_scaled=True,
           postprocess=True, clamp=True, factor=None, generator_to_loop=True):
    from diffusers.utils.torch_utils import randn_tensor

    sigma = float(scheduler.init_noise_sigma)  # before set_timesteps (the trap)
    scheduler.set_timesteps(num_inference_steps)
    sigma = sigma if sigma_before else float(scheduler.init_noise_sigma)
    f = factor or 2 ** (len(vae.config.block_out_channels) - 1)
    shape = (prompt_embeds.shape[0], unet.config.in_channels, height // f, width // f)
    latents = randn_tensor(shape, generator=generator, dtype=prompt_embeds.dtype) * sigma
    latents = _loop(unet, scheduler, latents, prompt_embeds, negative_prompt_embeds, num_inference_steps,
                    guidance_scale, generator if generator_to_loop else None, eta, guidance_rescale)
    z = latents / vae.config.scaling_factor if decode_scaled else latents
    image = vae.decode(z).sample
    if not postprocess:
        return image
    return (image * 0.5 + 0.5).clamp(0, 1) if clamp else image * 0.5 + 0.5


@text_to_image.trap("init_noise_sigma read before set_timesteps",
                    hint="Call scheduler.set_timesteps before prepare_latents: Euler's init_noise_sigma depends on the "
                         "timesteps (157.4 before, ~26 after, for 'leading' spacing).")
@torch.no_grad()
def _(**kw):
    return _image(**kw, sigma_before=True)


@text_to_image.trap("latents decoded without dividing by the VAE's scaling factor",
                    hint="The loop's latents are scaled by vae.config.scaling_factor; decode_latents divides it out.")
@torch.no_grad()
def _(**kw):
    return _image(**kw, decode_scaled=False)


@text_to_image.trap("the decoder's [−1, 1] output returned without postprocessing",
                    hint="output_type 'pt' images are in [0, 1]: x·0.5 + 0.5, clamped (postprocess).")
@torch.no_grad()
def _(**kw):
    return _image(**kw, postprocess=False)


@text_to_image.trap("the [−1, 1] → [0, 1] mapping not clamped",
                    hint="The decoder overshoots [−1, 1] a little: postprocess clamps x·0.5 + 0.5 to [0, 1].")
@torch.no_grad()
def _(**kw):
    return _image(**kw, clamp=False)


@text_to_image.trap("the VAE factor hard-coded to SD's 8",
                    hint="Pixels per latent depend on the VAE: vae_scale_factor from its block_out_channels "
                         "(8 for SD's VAE, 2 for this tiny one), as lab 06's vae_scale_factor computes.")
@torch.no_grad()
def _(**kw):
    return _image(**kw, factor=8)


@text_to_image.trap("the VAE factor one level too many (2 ** len(block_out_channels)): x_T a quarter the area",
                    hint="A VAE with L levels downsamples L − 1 times: vae_scale_factor = 2 ** (len(block_out_channels) "
                         "− 1) (8 for SD's four levels), as lab 06's vae_scale_factor computes.")
@torch.no_grad()
def _(**kw):
    return _image(**kw, factor=2 ** len(kw["vae"].config.block_out_channels))


@text_to_image.trap("the generator not handed on to denoise (DDIM's η > 0 noise drawn from the global RNG)",
                    hint="One generator drives the whole run: x_T and every noisy step. Pass generator (and eta) "
                         "on to denoise.")
@torch.no_grad()
def _(**kw):
    return _image(**kw, generator_to_loop=False)


# ---- inference_trace -----------------------------------------------------------------------------------
inference_trace = Kata(
    "inference_trace",
    hints=(
        "Generate exactly as text_to_image does, but written out so you can call boundary(name, tensor) "
        "where each tensor crosses: the conditioning, x_T, the first step's UNet input/output and guided noise, "
        "the final latents, the decoder's output and the image.",
        "conditioning = cat([c_∅, c]) (2B, L, D); x_T (B, 4, h, w); UNet input = scale(cat([x, x])) (2B, 4, h, w); "
        "UNet output (2B, 4, h, w); guided (B, 4, h, w); x_0 (B, 4, h, w); decoded (B, 3, H, W); image (B, 3, H, W).",
        "trace = [boundary('conditioning', cond), boundary('initial latents', latents)]; in the loop at i == 0: "
        "trace += [boundary('unet input', model_input), boundary('unet output', noise_pred), boundary('guided noise', guided)]; "
        "after it: 'final latents', 'decoded', 'image'",
    ),
    answer_key=PIPELINE_KEYS,
)


def _record(name, t):
    """The kata's boundary(): shape, dtype, device and the values in brief (min, max, mean in float32)."""
    values = t.detach().float()
    return {"boundary": name, "shape": tuple(t.shape), "dtype": str(t.dtype), "device": str(t.device),
            "min": float(values.min()), "max": float(values.max()), "mean": float(values.mean())}


def _records(rec, images):
    b = _record

    first = rec["steps"][0]
    return [b("conditioning", first.conditioning), b("initial latents", rec["initial"]),
            b("unet input", first.denoiser_input), b("unet output", first.denoiser_output),
            b("guided noise", first.step_input), b("final latents", rec["final"]),
            b("decoded", rec["decoded"]), b("image", images)]


@inference_trace.check("vs the pipeline's own boundaries", cases=[CASES[0], CASES[2], CASES[3], CASES[4]],
                       tol=TRACE_VALUES)
def _(case, g):
    case = dict(case, eta=0.0, guidance_rescale=0.0)
    pipe, inputs, rec, out, seed = record_run(case, g, "pt")
    # The records alone could be made up from the configs: the UNet is a remote probe, and the trace counts only
    # if the generation behind it ran (every UNet call the pipeline's, the generator drawn as the pipeline draws).
    probe = TrajectoryProbe(inputs["unet"], label=f"{type(inputs['unet']).__name__}(tiny, random weights)")
    inputs.update(unet=probe,
                  vae=_models(case.get("dtype", "float32"), case.get("latent_channels", tiny.LATENT_CHANNELS))[1],
                  height=case["height"], width=case["width"], num_inference_steps=case["steps"],
                  guidance_scale=case["guidance_scale"], generator=torch.Generator().manual_seed(seed))
    return Scenario(inputs=inputs, expected=_records(rec, out.images), label=f"{case['scheduler']}",
                    verify=_traced_a_real_run(probe, rec["steps"]), generators_after={"generator": rec["generator"]})


def _traced_a_real_run(probe: TrajectoryProbe, steps: list):
    """A Scenario.verify: the trace came with the generation it describes, its UNet calls the pipeline's."""

    def verify(out) -> None:
        found = first_divergence(probe, steps)
        if found is not None:
            raise KataFailure(
                f"  the trace must come from running the generation it describes, and that run differs from the "
                f"pipeline's: {found}", detail="the trace's generation is not the pipeline's")

    return verify


def _trace_trap(name: str, hint: str):
    """A trap on the trace: the right records of the same run (the pipeline called here, in the grader, on the
    same components and generator), with the decorated function's mistake applied to them."""

    def register(mistake):
        @inference_trace.trap(name, hint=hint)
        def _(**kw):
            unet = kw["unet"].denoiser if isinstance(kw["unet"], TrajectoryProbe) else kw["unet"]
            pipe = tiny.sd_pipeline(copy.deepcopy(kw["scheduler"]), unet, kw["vae"])
            rec, out = _run(pipe, unet, kw["prompt_embeds"], kw["negative_prompt_embeds"], kw["height"],
                            kw["width"], kw["num_inference_steps"], kw["guidance_scale"], kw["generator"], "pt")
            records = _records(rec, out.images)
            mistake(records, rec, out.images, kw)
            return records

        return mistake

    return register


@_trace_trap("the UNet input recorded before doubling the batch",
             hint="The UNet sees 2B samples: record model_input after torch.cat([latents, latents]).")
def _(records, rec, images, kw):
    first = rec["steps"][0].denoiser_input
    records[2] = _record("unet input", first[: first.shape[0] // 2])


@_trace_trap("the conditioning recorded as the prompt alone (B, L, D)",
             hint="The UNet attends to [negative; positive]: the conditioning boundary is (2B, L, D).")
def _(records, rec, images, kw):
    records[0] = _record("conditioning", kw["prompt_embeds"])


@_trace_trap("the image upcast to float32 (a float16 pipeline stays float16 to the image)",
             hint="Nothing in the pipeline widens a float16 run: the decoder's output and the image after "
                  "postprocessing stay in the latents' dtype (postprocess maps [−1, 1] to [0, 1] in the "
                  "input's dtype; it does not cast).")
def _(records, rec, images, kw):
    records[7] = _record("image", images.float())


@_trace_trap("the UNet input recorded before scale_model_input (the UNet sees it scaled)",
             hint="Record the tensor the UNet is called with: scheduler.scale_model_input(torch.cat([latents, "
                  "latents]), t). For DDIM that is the same tensor; for Euler it is divided by √(σ² + 1).")
def _(records, rec, images, kw):
    records[2] = _record("unet input", torch.cat([rec["initial"], rec["initial"]]))


@_trace_trap("the initial latents recorded before the init_noise_sigma scaling (the raw noise)",
             hint="x_T is the noise times the scheduler's init_noise_sigma (σ_max for Euler, 1 for DDIM): record "
                  "what prepare_latents returns, the tensor the loop starts from.")
def _(records, rec, images, kw):
    scheduler = copy.deepcopy(kw["scheduler"])
    scheduler.set_timesteps(kw["num_inference_steps"])
    records[1] = _record("initial latents", rec["initial"] / scheduler.init_noise_sigma)


@_trace_trap("the decoder's output recorded after postprocessing (it is in [−1, 1], the image in [0, 1])",
             hint="The 'decoded' boundary is what the VAE decoder returns, before postprocess maps [−1, 1] to "
                  "[0, 1]: its min is below 0.")
def _(records, rec, images, kw):
    records[6] = _record("decoded", images)


@_trace_trap("the guided noise recorded before guidance (the UNet's conditional half)",
             hint="Record what scheduler.step receives, ε_∅ + w·(ε_c − ε_∅), not the UNet's output for the prompt.")
def _(records, rec, images, kw):
    records[4] = _record("guided noise", rec["steps"][0].denoiser_output.chunk(2)[1])


@_trace_trap("the final latents recorded after ÷ scaling_factor (the decoder's input, not the loop's output)",
             hint="'final latents' is what the denoising loop ends with, before decode divides it by "
                  "vae.config.scaling_factor: record the loop's output itself.")
def _(records, rec, images, kw):
    records[5] = _record("final latents", rec["final"] / kw["vae"].config.scaling_factor)


@_trace_trap("the per-step records taken at the last step (overwritten every step), not the first",
             hint="The UNet input, its output and the guided noise are the FIRST step's: record them at i == 0 "
                  "only (later steps would overwrite them).")
def _(records, rec, images, kw):
    last = rec["steps"][-1]
    records[2:5] = [_record("unet input", last.denoiser_input), _record("unet output", last.denoiser_output),
                    _record("guided noise", last.step_input)]


@_trace_trap("records without their values (boundary() from an older copy of this lab)",
             hint="This lab's boundary() records each tensor's min, max and mean as well as its shape, dtype and "
                  "device: copy the worked example from the lesson over your file's older one.")
def _(records, rec, images, kw):
    for record in records:
        for key in ("min", "max", "mean"):
            del record[key]
