"""Lab 07 · Pipeline components

Concept:
    A diffusers pipeline is not a model: it is a short program wiring models together. Stable
    Diffusion's has a tokenizer and text encoder (CLIP: prompt -> (B, 77, 768) embeddings for SD 1.x),
    a UNet (predicts the noise in a latent, given t and the embeddings), a scheduler (owns the
    timesteps and the noise scale, and turns each prediction into the next latent) and a VAE
    (latents <-> pixels), plus optional parts (safety_checker, feature_extractor, image_encoder).
    `__call__` is the glue, always in this order: default size -> check_inputs -> encode_prompt ->
    retrieve_timesteps -> prepare_latents -> denoising loop -> vae.decode -> postprocess.
    The loop starts from pure noise drawn in latent space and scaled for the scheduler:
        x_T = σ_init · ε,  ε ~ N(0, I),  shape (B·n, C, H/f, W/f)
    (B prompts, n images per prompt, C latent channels, f the VAE's scale factor).

Mental model:
    - Components are separate objects listed in `pipe.components`; each can be swapped (a new
      scheduler is one keyword away) because the glue only asks each for what it knows.
    - Each component answers one question: the scheduler knows the starting noise scale
      (`init_noise_sigma`: 1 for DDPM/DDIM; σ_max ≈ 14.6 for Euler on SD's schedule, or
      √(σ_max² + 1) with "leading" timestep spacing), the VAE knows f,
      the UNet knows its latent channels (`in_channels`) and its native size (`sample_size`).
    - The effective batch is prompts × num_images_per_prompt. Each prompt's embeddings are repeated
      in place (p0, p0, p1, p1), and the noise has one sample per image.
    - One generator draws the whole batch at once. A list of generators gives image i its own
      generator (so image i can be reproduced alone), and must hold exactly one per image.
    - Inputs are checked before any model runs: check_inputs rejects a height or width that is not a
      multiple of 8 (hard-coded for Stable Diffusion, whatever the VAE).
    - Latents passed in (to replay a run) are not drawn again: only moved and scaled by init_noise_sigma.

Traps:
    - Forgetting init_noise_sigma: harmless with DDIM (it is 1), wrong with Euler, where x_T must have
      standard deviation σ_max, not 1.
    - Sizing the latents with the image size (no // vae_scale_factor), or swapping height and width.
    - A generator list: drawing everything from the first generator, or accepting a list of one for
      a larger batch (diffusers raises a ValueError).
    - Tiling the embeddings (p0, p1, p0, p1) instead of repeating each prompt: the batch is ordered
      prompt by prompt, so image i would be denoised towards another prompt.
    - Checking divisibility by vae_scale_factor: Stable Diffusion's rule is 8.
    - Drawing new noise, or skipping the scaling, when latents are given.

Precision:
    The course's one policy (lab 01 states it): return the dtype asked for, and compute as wide as you
    like. The noise itself is not arithmetic: draw it in `dtype` from the generator(s) exactly as
    diffusers does (randn_tensor: one call for one generator, one (1, C, h, w) call per generator of a
    list): a float32 draw cast to float16 is other numbers (on a CPU, the last block of 16 where C·h·w is no
    multiple of 16) and leaves the generator elsewhere. The one multiplication, ε·σ_init,
    diffusers does in the latents' dtype; the grader also knows it in exact float64 math and accepts an
    answer about as close to that as diffusers' own, so multiplying in float64 and casting passes.
    Each generator must also be left where diffusers leaves it: draw nothing more, nothing less.

Say it out loud:
    "A pipeline is a graph of components plus glue. The glue checks the size, encodes the prompt and
    repeats it per image, asks the scheduler for timesteps, then prepares the latents: shape batch ×
    latent channels × H/f × W/f, Gaussian noise from the caller's generator (or one generator per
    image), times the scheduler's init_noise_sigma. Then the loop, then the VAE decodes."

Graded against: diffusers StableDiffusionPipeline (check_inputs, encode_prompt, prepare_latents),
on tiny random-weight components with Euler and DDIM schedulers, on fresh seeded inputs.
Run: python -m pytest katas/07_pipeline_components.py
"""
from __future__ import annotations

import torch


# ---- Worked example: the default image size -----------------------------------------------------------
def default_size(height: int | None, width: int | None, unet_sample_size: int,
                 vae_scale_factor: int) -> tuple[int, int]:
    """The (height, width) StableDiffusionPipeline.__call__ uses (its step 0).

    The UNet's sample_size is counted in latent pixels, so the native image size is
    sample_size · f (64 · 8 = 512 for SD 1.5). If either side is missing, both are reset.
    """
    if not height or not width:
        height = width = unet_sample_size * vae_scale_factor
    return height, width


# ---- Your turn: the glue of __call__ -------------------------------------------------------------------
def input_error(
    height: int,
    width: int,
    vae_scale_factor: int,
    batch_size: int,
    generator: torch.Generator | list[torch.Generator] | None,
) -> str | None:
    """What is wrong with this request, or None if StableDiffusionPipeline would accept it.

    The pipeline raises ValueError(message) in two places before its loop: check_inputs (is the
    image size allowed?) and prepare_latents (does a list of generators hold one per image?). Here
    you return the message instead of raising it, so the grader can compare decisions; any
    non-empty message is fine.

    Args:
        height, width:    requested image size in pixels.
        vae_scale_factor: the pipeline's VAE factor f (2 for the tiny VAE, 8 for SD's).
        batch_size:       the effective batch, prompts × num_images_per_prompt.
        generator:        one torch.Generator, a list of them, or None.
    Returns: a str describing the problem, or None.
    Graded against: StableDiffusionPipeline.check_inputs and StableDiffusionPipeline.prepare_latents
    (whether they raise).
    """
    # BEGIN SOLUTION: a message where check_inputs (size) or prepare_latents (generator list) would raise, else None
    # 1. check_inputs: Stable Diffusion's size rule is a hard-coded 8 (its VAE's factor), whatever
    #    this pipeline's VAE is; the latents are then height // f by width // f.
    if height % 8 != 0 or width % 8 != 0:
        return f"height and width must be divisible by 8, got {height} and {width}"
    # 2. prepare_latents: a list means one generator per image, so its length must equal the
    #    effective batch. A list of one is not special-cased here: it fails for batch_size > 1.
    if isinstance(generator, list) and len(generator) != batch_size:
        return f"{len(generator)} generators for a batch of {batch_size}: pass one generator per image"
    return None
    # END SOLUTION


def repeat_per_prompt(prompt_embeds: torch.Tensor, num_images_per_prompt: int) -> torch.Tensor:
    """Each prompt's embeddings repeated num_images_per_prompt times, in place: (p0, p0, p1, p1).

    Args:
        prompt_embeds:          (B, L, D) text embeddings, one row per prompt, float32.
        num_images_per_prompt:  n, how many images each prompt makes.
    Returns: (B·n, L, D), rows ordered prompt by prompt.
    Graded against: StableDiffusionPipeline.encode_prompt(prompt_embeds=..., num_images_per_prompt=n)
    """
    # BEGIN SOLUTION: repeat along the token axis, then view as (B·n, L, D), so the copies of one prompt sit together
    # Notation: B prompts, L tokens, D embedding width, n images per prompt.
    batch, tokens, _ = prompt_embeds.shape
    # 1. (B, L, D) -> (B, n·L, D): the n copies of prompt b follow each other inside row b ...
    repeated = prompt_embeds.repeat(1, num_images_per_prompt, 1)
    # 2. ... so splitting each row into n rows of L tokens gives p0, p0, …, p1, p1, … (diffusers'
    #    order; repeat_interleave(n, dim=0) is the same thing). repeat(n, 1, 1) would tile instead.
    return repeated.view(batch * num_images_per_prompt, tokens, -1)
    # END SOLUTION


def prepare_latents(
    batch_size: int,
    num_channels_latents: int,
    height: int,
    width: int,
    vae_scale_factor: int,
    init_noise_sigma: float,
    generator: torch.Generator | list[torch.Generator] | None,
    dtype: torch.dtype,
    latents: torch.Tensor | None = None,
) -> torch.Tensor:
    """The starting latents x_T = σ_init · ε of the denoising loop (step 5 of __call__).

    Args:
        batch_size:           effective batch, prompts × num_images_per_prompt.
        num_channels_latents: the UNet's in_channels (4 for SD).
        height, width:        image size in pixels (multiples of 8).
        vae_scale_factor:     f; the latents are (height // f, width // f).
        init_noise_sigma:     the scheduler's init_noise_sigma, as a float.
        generator:            a torch.Generator (draws the whole batch), a list of batch_size
                              generators (one draw of (1, C, h, w) each), or None (global RNG).
        dtype:                dtype to draw the noise in (float32 or float16).
        latents:              (B, C, h, w) latents to start from instead of drawing; only scaled.
    Returns: (batch_size, num_channels_latents, height // f, width // f).
    Raises: ValueError if a generator list's length is not batch_size (graded in input_error).
    Graded against: StableDiffusionPipeline.prepare_latents (which draws with randn_tensor).
    """
    # BEGIN SOLUTION: latent shape; noise from the generator(s) in dtype unless latents are given; × init_noise_sigma
    # Notation: ε -> noise, σ_init -> init_noise_sigma, f -> vae_scale_factor.
    # 1. Latent-space shape: the UNet never sees pixels.
    shape = (batch_size, num_channels_latents, int(height) // vae_scale_factor, int(width) // vae_scale_factor)
    if isinstance(generator, list) and len(generator) != batch_size:
        raise ValueError(f"got {len(generator)} generators for a batch of {batch_size}: pass one per image")
    if latents is None:
        # 2. ε ~ N(0, I), drawn in the requested dtype. A list gives sample i its own generator, so
        #    image i is reproducible on its own (a list of one is the same as a single generator).
        if isinstance(generator, list) and len(generator) > 1:
            noise = torch.cat([torch.randn((1, *shape[1:]), generator=gen, dtype=dtype) for gen in generator])
        else:
            gen = generator[0] if isinstance(generator, list) else generator
            noise = torch.randn(shape, generator=gen, dtype=dtype)
    else:
        # 2'. Given latents are used as they are (only moved to the device in diffusers).
        noise = latents
    # 3. The scheduler decides how loud the starting noise is: σ_init = 1 for DDPM/DDIM (variance
    #    preserving), about σ_max for Euler-type schedulers, whose x_t = x_0 + σ_t·ε is mostly noise
    #    of standard deviation σ_max at the first step.
    return noise * init_noise_sigma
    # END SOLUTION
