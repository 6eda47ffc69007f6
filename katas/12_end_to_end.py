"""Lab 12 · End-to-end inference trace

Concept:
    A text-to-image call is a short program: load the components, prepare the conditions and the
    starting latents, run the denoising loop (scheduler + denoiser + guidance), decode the latents to
    pixels. Tracing the state through it — its shape, dtype, device and range at every boundary — is
    how you find where a pipeline wrapper hides work, memory or a dtype change.

Mental model:
    - load: the components exist (UNet, VAE, scheduler; the text encoder's output is given here).
    - prepare: set_timesteps first (Euler's init_noise_sigma depends on it), then x_T = σ_init·ε of
      shape (B, 4, H/8, W/8) from the generator; the conditioning is [negative; positive], (2B, L, D).
    - loop: for each t: scale the latents for the scheduler, one batched UNet call on 2B, guidance,
      scheduler.step with its extra arguments (eta, generator) → the next latents (B, 4, h, w).
    - decode: z/scaling_factor through the VAE decoder → (B, 3, H, W) in [−1, 1] → [0, 1].
    This lab is built from your own katas: guided_noise (lab 04), vae_scale_factor, decode_latents and
    postprocess (lab 06), prepare_latents (lab 07). If one of them is still TODO, so is this lab.

Traps:
    - Treating the UNet as the whole model: the scheduler and the VAE decide the output as much as the
      UNet. Decoding the final latents without dividing by the VAE's scaling_factor gives a wrong image
      from a right loop.
    - prepare_latents before set_timesteps: with Euler's "leading" spacing init_noise_sigma changes
      (157.4 before, 26.0 after, for 5 steps), so x_T is scaled wrongly.
    - scale_model_input skipped: harmless for DDIM (the identity), wrong for Euler (÷√(σ²+1)).
    - eta and generator not passed to scheduler.step: DDIM with η > 0 then draws other noise.
    - The trace's dtypes: a float16 pipeline keeps float16 all the way to the image; the decoder's
      output is in [−1, 1], not [0, 1], until postprocessing.

Precision:
    The course's one policy (lab 01 states it) holds piece by piece in the labs this one is built from:
    guidance (04), decoding (06) and the initial latents (07) are each graded against exact float64
    math there. This lab is the exception, on purpose: the whole loop is graded against the pipeline's
    own run (within 1e-5, float16 within its own tolerance), with no float64 shadow. Its work is the
    same UNet and VAE called in the pipeline's order, and the stochastic steps (DDIM with η > 0) draw
    their noise in the latents' dtype from your generator, so a float64 run would draw other numbers,
    not the exact answer. The generator must end where the pipeline's ended: no extra or missing draws.

Say it out loud:
    "Prompt embeddings become a (2B, L, D) conditioning batch, negative first. The scheduler sets the
    timesteps and the starting noise scale; x_T is (B, 4, H/8, W/8). Each step scales the latents,
    runs the UNet once on 2B, combines the halves with the guidance scale and lets the scheduler step,
    drawing noise from the same generator. After the last step the VAE decodes z/0.18215 to
    (B, 3, H, W) pixels in [−1, 1], mapped to [0, 1]."

Graded against: a tiny StableDiffusionPipeline called with prompt_embeds and negative_prompt_embeds
(output_type "latent" and "pt"), bit for bit, with DDIM (η 0 and 1) and Euler; and the shapes, dtypes,
devices and values (min, max, mean) the pipeline's own UNet, scheduler and VAE see, recorded by hooks.
Run: python -m pytest katas/12_end_to_end.py
"""
import importlib.util
import inspect
import sys
from pathlib import Path

import torch


# ---- Given: your earlier katas --------------------------------------------------------------------------
def earlier(lab: str):
    """Your own file of an earlier lab, which sits next to this one (katas/ or solutions/)."""
    path = Path(__file__).with_name(f"{lab}.py")
    name = f"_earlier_{path.parent.name}_{lab}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


cfg = earlier("04_classifier_free_guidance")  # guided_noise
vae_lab = earlier("06_vae_latents")  # vae_scale_factor, decode_latents, postprocess
components = earlier("07_pipeline_components")  # prepare_latents


# ---- Worked example ----------------------------------------------------------------------------------
def boundary(name: str, tensor: torch.Tensor) -> dict:
    """One line of a trace: what crosses a boundary, as shape, dtype and device, and its values in brief (the
    smallest, the largest and the mean, in float32): enough to see the decoder's [−1, 1] become [0, 1], or a
    tensor recorded before a step that changes it (the scaled UNet input, the guided noise)."""
    values = tensor.detach().float()
    return {"boundary": name, "shape": tuple(tensor.shape), "dtype": str(tensor.dtype), "device": str(tensor.device),
            "min": float(values.min()), "max": float(values.max()), "mean": float(values.mean())}


def step_kwargs(scheduler, generator, eta: float) -> dict:
    """The extra arguments a scheduler's step accepts: eta (DDIM only) and generator (the stochastic ones)."""
    accepted = inspect.signature(scheduler.step).parameters
    return {k: v for k, v in (("eta", eta), ("generator", generator)) if k in accepted}


# ---- Your turn ---------------------------------------------------------------------------------------
def denoise(
    unet,
    scheduler,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor,
    num_inference_steps: int,
    guidance_scale: float,
    generator: torch.Generator | None = None,
    eta: float = 0.0,
    guidance_rescale: float = 0.0,
) -> torch.Tensor:
    """The denoising loop of StableDiffusionPipeline: x_T → x_0 in latent space.

    For each t of scheduler.timesteps (after set_timesteps(num_inference_steps)): scale the latents
    with scheduler.scale_model_input, get the guided prediction with YOUR lab-04 `cfg.guided_noise`,
    and step with scheduler.step(..., **step_kwargs(scheduler, generator, eta)).prev_sample.
    Graded against: StableDiffusionPipeline(..., output_type="latent"), starting from its own x_T.
    Args:
        unet: UNet2DConditionModel;  scheduler: the pipeline's scheduler (DDIM or Euler)
        latents: (B, 4, h, w) x_T, already scaled by init_noise_sigma
        prompt_embeds, negative_prompt_embeds: (B, L, D)
        generator: the generator the pipeline drew x_T from (DDIM with η > 0 draws from it again)
    Returns: (B, 4, h, w) the final latents.
    """
    # TODO: set_timesteps; per t: scale_model_input, cfg.guided_noise, scheduler.step with step_kwargs
    raise NotImplementedError


def text_to_image(
    unet,
    vae,
    scheduler,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float,
    generator: torch.Generator | None = None,
    eta: float = 0.0,
    guidance_rescale: float = 0.0,
) -> torch.Tensor:
    """StableDiffusionPipeline.__call__ with prompt embeddings, from config to pixels.

    prepare (set_timesteps, then YOUR `components.prepare_latents` with the scheduler's
    init_noise_sigma, the UNet's in_channels and YOUR `vae_lab.vae_scale_factor`) → `denoise` → YOUR
    `vae_lab.decode_latents` → YOUR `vae_lab.postprocess(..., "pt")`.
    Graded against: StableDiffusionPipeline(..., output_type="pt").images
    Returns: (B, 3, height, width) in [0, 1], in the prompt embeddings' dtype.
    """
    # TODO: set_timesteps, prepare_latents (lab 07), denoise, decode_latents and postprocess (lab 06)
    raise NotImplementedError


def inference_trace(
    unet,
    vae,
    scheduler,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor,
    height: int,
    width: int,
    num_inference_steps: int,
    guidance_scale: float,
    generator: torch.Generator | None = None,
) -> list[dict]:
    """The same generation as `text_to_image`, traced: a `boundary(...)` record at each boundary.

    In this order (first denoising step only for the per-step boundaries):
        "conditioning"   the UNet's encoder_hidden_states      (2B, L, D)
        "initial latents" x_T from prepare_latents              (B, 4, h, w)
        "unet input"     the UNet's sample, doubled and scaled  (2B, 4, h, w)
        "unet output"    the UNet's prediction for both halves  (2B, 4, h, w)
        "guided noise"   what scheduler.step receives           (B, 4, h, w)
        "final latents"  after the last step                    (B, 4, h, w)
        "decoded"        the VAE decoder's output               (B, 3, H, W)
        "image"          after postprocessing                   (B, 3, H, W)
    Graded against: the shapes, dtypes, devices and values StableDiffusionPipeline's own UNet, scheduler and
    VAE see in the same call (recorded by hooks), and the images.
    Returns: the list of 8 records.
    """
    # TODO: run the generation step by step, calling boundary(...) where each tensor crosses
    raise NotImplementedError
