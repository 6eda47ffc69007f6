"""Lab 04 · Classifier-free guidance

Concept:
    A text-conditioned denoiser can answer two questions about the same noisy latents: "what noise do
    you see, given the prompt?" (ε_c) and "what noise do you see, given no prompt?" (ε_u). One model
    answers both, because it was trained with the prompt dropped some of the time. Classifier-free
    guidance (Ho & Salimans 2022, eq. 6) starts from the unconditional answer and goes s times the way
    the prompt moves it:
        ε̂ = ε_u + s · (ε_c − ε_u)        s = guidance_scale
    The paper writes ε̂ = (1 + w)·ε_c − w·ε_u; that is the same thing with s = 1 + w. So s = 1 is the
    text prediction alone (no guidance), and s > 1 extrapolates past it. Guidance rescale (Lin et al.
    2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed", §3.4) then pulls the guided
    prediction's per-sample standard deviation back towards the text prediction's:
        ε̂_rescaled = φ · ε̂ · σ(ε_c)/σ(ε̂) + (1 − φ) · ε̂        φ = guidance_rescale

Mental model:
    - Both answers come from ONE batched denoiser call: the latents twice, (2B, C, h, w), and the
      conditioning stacked [negative; positive], (2B, L, D). Unconditional first is diffusers'
      convention; the (2B, ...) output is chunked back into (ε_u, ε_c) in the same order.
    - The "unconditional" half is whatever embedding fills it. With no negative prompt, Stable
      Diffusion encodes the empty prompt "" there (SDXL by default uses all-zero embeddings instead:
      force_zeros_for_empty_prompt). A negative prompt simply replaces it: guidance then pushes away
      from the negative prompt rather than from "no prompt".
    - A larger s follows the prompt more closely but gives less varied samples, and at large values
      oversaturated, over-contrasted images with artefacts. SD 1.x defaults to s = 7.5.
    - Rescale fixes the over-exposure: σ is taken per sample over every dimension but the batch.
      φ = 1 keeps only the rescaled prediction (can look flat), φ = 0 turns rescale off; the paper
      suggests 0.7.
    - The scheduler never sees the doubled batch: scheduler.step gets the (B, ...) guided prediction.
    - StableDiffusionPipeline guides only when guidance_scale > 1 (`do_classifier_free_guidance`).
      At s ≤ 1 it runs the text branch alone, one call of batch B, and skips rescale too.

Traps:
    - Branches swapped: ε_c + s·(ε_u − ε_c) steers AWAY from the prompt. The usual cause is building
      the conditioning batch text-first, or reading the chunks in the wrong order.
    - The paper's form with diffusers' scale: ε_c + s·(ε_c − ε_u) is one unit of guidance too many.
    - Dropping the base or the difference: ε_u + s·ε_c, s·(ε_c − ε_u), or ε_u + s·ε_c − ε_u (the
      parentheses around ε_c − ε_u forgotten).
    - Rescale with one σ over the whole batch: every sample must keep its own scale.
    - Rescale without the (1 − φ) mix, or with the ratio upside down (σ(ε̂)/σ(ε_c)).
    - Two denoiser calls of batch B instead of one of 2B: the same numbers to ~1e-6, twice the
      launches; the pipeline batches them.

Precision:
    The course's one policy (lab 01 states it): return the dtype of the predictions (the UNet's
    dtype), and compute as wide as you like. diffusers combines and rescales in the predictions' own
    dtype: float16 under a float16 UNet, where s·(ε_c − ε_u) at s = 12 is rounded to ~3 digits and
    rescale_noise_cfg's σ ratio in float16 too. The grader knows the exact answer on the same inputs
    (the same formulas in float64, and for guided_noise a float64 copy of the same UNet) and accepts
    anything about as close to it as diffusers' own answer: upcasting to float32 or float64 and
    casting once at the end passes, and so does diffusers' own order in the input dtype.

Say it out loud:
    "Every step I ask the same UNet twice in one batch: once with the negative (or empty) prompt,
    once with the real one, unconditional first. I split the answer, start from the unconditional
    prediction and move guidance_scale times along the difference to the conditional one. Optionally
    I rescale each sample's guided prediction back to the conditional one's standard deviation and
    blend by guidance_rescale. The scheduler steps with that single guided prediction."

Graded against: StableDiffusionPipeline.__call__ (the guided prediction it hands to scheduler.step,
recorded live over short DDIM and Euler runs of a tiny random-weight pipeline, float32 and float16)
and diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.rescale_noise_cfg.
Run: python -m pytest katas/04_classifier_free_guidance.py
"""
import torch


# ---- Worked example --------------------------------------------------------------------------------
def text_noise(
    unet: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor
) -> torch.Tensor:
    """One denoiser call conditioned on the prompt: what the pipeline does when guidance_scale ≤ 1.

    Args:
        unet:          a UNet2DConditionModel: unet(sample, timestep, encoder_hidden_states=...).sample
        latents:       (B, C, h, w) the denoiser's input this step (already scheduler-scaled)
        timestep:      0-dim tensor, the current entry of scheduler.timesteps
        prompt_embeds: (B, L, D) the text encoder's output, one row per sample
    Returns: (B, C, h, w) ε_c, in the UNet's dtype.
    """
    # Cross-attention reads the prompt through encoder_hidden_states; the timestep is broadcast over
    # the batch inside the UNet. `.sample` unwraps the UNet2DConditionOutput.
    return unet(latents, timestep, encoder_hidden_states=prompt_embeds).sample


# ---- Your turn -------------------------------------------------------------------------------------
def guidance_combine(
    noise_uncond: torch.Tensor, noise_text: torch.Tensor, guidance_scale: float
) -> torch.Tensor:
    """ε̂ = ε_u + s · (ε_c − ε_u): start at the unconditional prediction, move s times towards the text one.

    Graded against: the guided prediction StableDiffusionPipeline.__call__ passes to scheduler.step
    Args:
        noise_uncond:   (B, C, h, w) ε_u, the prediction with the negative (or empty) prompt
        noise_text:     (B, C, h, w) ε_c, the prediction with the prompt; same dtype
        guidance_scale: s (a Python float); 1.0 means no guidance
    Returns: (B, C, h, w), dtype of the inputs.
    """
    # BEGIN SOLUTION: start from the uncond prediction, add guidance_scale times (text − uncond)
    # Notation: noise_uncond -> ε_u, noise_text -> ε_c, guidance_scale -> s = 1 + w (Ho & Salimans' w).
    # (ε_c − ε_u) is the direction the prompt moves the prediction; s = 1 lands exactly on ε_c and
    # s > 1 goes past it. Written in this order it is bit for bit what the pipeline computes.
    return noise_uncond + guidance_scale * (noise_text - noise_uncond)
    # END SOLUTION


def rescale_guidance(
    noise_cfg: torch.Tensor, noise_text: torch.Tensor, guidance_rescale: float
) -> torch.Tensor:
    """Pull each sample's guided prediction back to the text prediction's std, blended by φ.

    ε̂' = φ · ε̂ · σ(ε_c)/σ(ε̂) + (1 − φ) · ε̂, with σ the standard deviation of each sample over all
    of its other dimensions (Lin et al. 2023, §3.4).
    Graded against: diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.rescale_noise_cfg,
    and the prediction StableDiffusionPipeline.__call__ passes to scheduler.step when guidance_rescale > 0
    Args:
        noise_cfg:        (B, ...) ε̂, the guided prediction (any number of trailing dims)
        noise_text:       (B, ...) ε_c, the text prediction; same shape and dtype
        guidance_rescale: φ in [0, 1]; 0 leaves noise_cfg as it is
    Returns: (B, ...), dtype of noise_cfg.
    """
    # BEGIN SOLUTION: per-sample std of both (dims 1…n, keepdim), rescale ε̂ by the ratio, mix with ε̂ by φ
    # Notation: noise_cfg -> ε̂ (x_cfg in the paper), noise_text -> ε_c (x_pos), guidance_rescale -> φ.
    # 1. one σ per sample: reduce over every dim but the batch, keep dims so (B, 1, 1, 1) broadcasts.
    #    torch.std's default (unbiased) estimator matches diffusers; the ratio cancels the choice anyway.
    dims = list(range(1, noise_cfg.ndim))
    std_text = noise_text.std(dim=dims, keepdim=True)  # (B, 1, ..., 1)
    std_cfg = noise_cfg.std(dim=dims, keepdim=True)  # (B, 1, ..., 1)
    # 2. guidance inflates the prediction's scale (s·(ε_c − ε_u) adds energy): undo that per sample.
    rescaled = noise_cfg * (std_text / std_cfg)
    # 3. fully rescaled images can look flat: blend back with the unrescaled guided prediction.
    return guidance_rescale * rescaled + (1 - guidance_rescale) * noise_cfg
    # END SOLUTION


def guided_noise(
    unet: torch.nn.Module,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor,
    guidance_scale: float,
    guidance_rescale: float = 0.0,
) -> torch.Tensor:
    """One guided denoiser prediction for one step, as StableDiffusionPipeline computes it.

    Both branches in ONE call of the denoiser on a batch of 2B (unconditional half first), then
    split, combine with `guidance_combine`, and rescale with `rescale_guidance` when
    guidance_rescale > 0. With guidance_scale ≤ 1 the pipeline does no guidance at all: one call of
    batch B on the prompt (see `text_noise`); calling it on 2B there is also accepted.

    Graded against: the guided prediction StableDiffusionPipeline.__call__ passes to scheduler.step,
    at every step of short DDIM and Euler runs; the denoiser you get counts its calls.
    Args:
        unet:                   a UNet2DConditionModel (call it as in `text_noise`)
        latents:                (B, C, h, w) the denoiser's input this step, ALREADY scaled by
                                scheduler.scale_model_input (identity for DDIM, ÷√(σ²+1) for Euler;
                                the scaling is per element, so scaling before or after doubling is the same)
        timestep:               0-dim tensor, the current entry of scheduler.timesteps
        prompt_embeds:          (B, L, D) the prompt's embeddings
        negative_prompt_embeds: (B, L, D) the negative (or empty) prompt's embeddings
        guidance_scale:         s; guidance happens only when s > 1
        guidance_rescale:       φ; 0 means no rescale
    Returns: (B, C, h, w) the guided prediction, in the UNet's dtype.
    """
    # BEGIN SOLUTION: double the latents, stack [negative; positive], one unet call, chunk, combine, rescale
    # Notation: latents -> z_t (scheduler-scaled), negative_prompt_embeds -> c_∅, prompt_embeds -> c,
    # guidance_scale -> s, guidance_rescale -> φ.
    # 0. No guidance at s ≤ 1: the pipeline skips the unconditional half and saves half the compute.
    if guidance_scale <= 1:
        return text_noise(unet, latents, timestep, prompt_embeds)
    # 1. one batch holding both questions: the same z_t twice, conditioning unconditional-first.
    latent_model_input = torch.cat([latents, latents])  # (2B, C, h, w)
    encoder_hidden_states = torch.cat([negative_prompt_embeds, prompt_embeds])  # (2B, L, D)
    # 2. a single forward: one launch per layer for both branches instead of two.
    noise_pred = unet(latent_model_input, timestep, encoder_hidden_states=encoder_hidden_states).sample
    # 3. split in the order the batch was built: first half ε_u, second half ε_c.
    noise_uncond, noise_text = noise_pred.chunk(2)  # (B, C, h, w) each
    # 4. extrapolate from ε_u towards (and past) ε_c.
    guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
    # 5. rescale against ε_c, the TEXT prediction (the pipeline skips this when φ = 0).
    if guidance_rescale > 0:
        guided = rescale_guidance(guided, noise_text, guidance_rescale)
    return guided
    # END SOLUTION
