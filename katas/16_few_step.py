"""Lab 16 · Few-step distillation

Concept:
    A 50-step sampler is a teacher; a distilled model is a student that jumps most of the way in one
    call. Two families ship in diffusers, and both run 1–8 steps without classifier-free guidance:
    - Latent Consistency Models (Luo et al. 2023, arXiv 2310.04378, on Song et al. 2023's consistency
      models, arXiv 2303.01469, §3 "Parameterization"). The model is trained so that f(x_t, t) lands
      on the clean latent from ANY point of the teacher's trajectory. diffusers' LCMScheduler
      parametrises it with consistency boundary conditions,
          f(x, t) = c_skip(t)·x + c_out(t)·x̂₀(x, t),
          c_skip = σ_d² / ((s·t)² + σ_d²),   c_out = s·t / √((s·t)² + σ_d²),   σ_d = 0.5, s = 10
      so f(x, 0) = x exactly (c_skip = 1, c_out = 0). Multistep sampling alternates: denoise with f,
      then re-noise the estimate to the next (smaller) timestep with fresh noise, x = √ᾱ'·f + √(1 − ᾱ')·z.
    - Adversarial diffusion distillation (SD-Turbo, SDXL-Turbo; Sauer et al. 2023). The model is an
      ordinary ε-predicting UNet run by an ordinary scheduler: SD-Turbo ships EulerDiscreteScheduler
      with timestep_spacing="trailing", and is called with guidance_scale=0.0 and 1–4 steps.
    You will rebuild LCMScheduler.set_timesteps, its boundary scalings and its step, the trailing σ
    ladder SD-Turbo runs on, and the few-step loop of StableDiffusionPipeline at guidance ≤ 1.

Mental model:
    - The LCM ladder is a ladder on a ladder. Distillation used only original_inference_steps = 50
      timesteps, every k = T // 50 = 20: t = 19, 39, …, 999 (k·i − 1, i = 1 … 50). Inference takes n of
      those 50, evenly spaced by index from the top: n = 4 → 999, 759, 499, 259. Never a timestep the
      student was not trained on, and never 0 (the ladder stops at k − 1).
    - The boundary scalings are almost an identity: with s = 10, c_out(259) = 1 − 1.9e-8. They are there
      for the math (f(x, 0) = x makes the consistency loss well posed), and they matter near t = 0 or
      with a small timestep_scaling.
    - One LCM step: x̂₀ from the model output (ε, v or x₀, as in lab 02), denoised = c_skip·x + c_out·x̂₀,
      then prev = √ᾱ_next·denoised + √(1 − ᾱ_next)·z with z drawn from the generator. The last step
      returns denoised and draws nothing: one-step LCM is deterministic.
    - "Next timestep" is the next entry of the ladder (759 after 999), not t − T/n as in DDIM.
    - The few-step loop: no CFG batch. StableDiffusionPipeline guides only when guidance_scale > 1;
      at 0 (SD-Turbo) or 1 (LCM-LoRA) it calls the UNet once per step on the prompt alone. The cost of
      a 1-step model is one forward: doubling the batch for a guidance that is switched off doubles it.
    - What the model sees at one step: trailing spacing starts at t = T − 1 = 999, σ = 14.6 (pure noise,
      which is where a one-step model starts). Leading spacing would give t = 1 (steps_offset) and
      linspace t = 0: a "denoise" of an image that is already clean.

Traps:
    - The LCM ladder built with DDIM's leading spacing (750, 500, 250, 0 for n = 4) or spread over all T
      timesteps (trailing: 999, 749, 499, 249): the student only knows the 50 distillation timesteps.
    - c_skip and c_out swapped: f(x, t) ≈ x at every noisy t, i.e. no denoising at all.
    - timestep_scaling forgotten: c_skip(t) 100× too large (it shows at small t).
    - Re-noising after the last step: the sample you return is noisy again, and the generator has
      drawn once too often (every later draw shifts).
    - Guidance applied at guidance_scale 0: ε_u + 0·(ε_c − ε_u) is the UNCONDITIONAL prediction, and the
      doubled batch costs two forwards per step.
    - The Turbo loop without init_noise_sigma: Euler's initial latent is σ_max·z (×14.6), and the UNet
      input is x/√(σ² + 1) (scale_model_input). LCM's are 1 and x: the scheduler owns both.

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names and compute as
    wide as you like; the graders measure your error against exact float64 math and accept anything
    about as close to it as diffusers' own answer. diffusers computes the boundary scalings in Python
    floats, the LCM step in the model output's dtype (0-dim float32 ᾱ times float16 tensors stays
    float16) with the noise drawn in that dtype, and the Euler σ table in float32, interpolated in
    float64 and cast back. Computing the step in float32 for float16 inputs and casting once is right;
    the noise must come from the generator. diffusers draws it in the output's dtype; from a CPU
    generator that gives the same values as drawing float32 and casting (checked: bit for bit), from a
    CUDA one it need not, so draw in the output's dtype to be safe everywhere.

Say it out loud:
    "An LCM jumps from any noisy latent to the clean one: f = c_skip·x + c_out·x̂₀, with c_skip =
    σ_d²/((10t)² + σ_d²) and c_out = 10t/√((10t)² + σ_d²), so f(x, 0) = x. It runs on the 50 timesteps it
    was distilled on (k = 20: 999, 979, …, 19) and samples n of them by index; between steps it
    re-noises the estimate to the next one, except after the last. SD-Turbo is a plain Euler sampler on
    trailing timesteps, so one step starts at t = 999. Both run without CFG: one UNet call per step."

Graded against: diffusers LCMScheduler (set_timesteps with original_inference_steps and T ≠ 1000,
get_scalings_for_boundary_condition_discrete, step over whole ladders with ε / v / sample prediction
and the generator's state afterwards), EulerDiscreteScheduler(timestep_spacing="trailing")
.set_timesteps (SD-Turbo's scheduler config), and StableDiffusionPipeline(guidance_scale ≤ 1) with
the SD-Turbo and LCM schedulers, on fresh seeded inputs; budget: one UNet call per step, batch B.
Run: python -m pytest katas/16_few_step.py
"""
from __future__ import annotations

import torch


# ---- Worked example --------------------------------------------------------------------------------
def sigma_table(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The variance-exploding σ of every training timestep: σ_t = √((1 − ᾱ_t)/ᾱ_t) (lab 03).

    x_t/√ᾱ_t = x₀ + σ_t·ε: Euler schedulers walk this σ. Stable Diffusion's table runs from 0.029
    (t = 0) to 14.61 (t = 999).
    Args: alphas_cumprod (T,) float32.  Returns: (T,) float32.
    """
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


# ---- Your turn -------------------------------------------------------------------------------------
def lcm_timesteps(
    num_inference_steps: int,
    original_inference_steps: int = 50,
    num_train_timesteps: int = 1000,
) -> torch.Tensor:
    """LCMScheduler.set_timesteps(n): n timesteps picked from the distillation ladder.

    The distillation ladder has original_inference_steps (N) rungs, k = T // N apart:
        origin = [k·1 − 1, k·2 − 1, …, k·N − 1]             (T = 1000, N = 50: 19, 39, …, 999)
    Inference reverses it (noisiest first) and keeps n rungs evenly spaced by index:
        index_j = floor(j·N/n), j = 0 … n − 1;  timesteps = reversed(origin)[index]
    (n = 4: indices 0, 12, 25, 37 → 999, 759, 499, 259). diffusers takes that floor of a float linspace, which
    lands one index lower at a few (N, n), N = 30, n = 22 the first; the graded cases avoid them.

    Graded against: LCMScheduler(num_train_timesteps=T, original_inference_steps=N).set_timesteps(n)
    → .timesteps
    Args:
        num_inference_steps:      n (1 … N)
        original_inference_steps: N, the number of timesteps the model was distilled on
        num_train_timesteps:      T
    Returns: (n,) int64, descending.
    """
    # TODO: the N-rung ladder k·i − 1 (k = T // N), reversed, then n rungs evenly spaced by index
    raise NotImplementedError


def boundary_scalings(timestep: int, timestep_scaling: float = 10.0) -> tuple[float, float]:
    """The consistency boundary conditions (c_skip, c_out) of LCMScheduler at a discrete timestep.

    With σ_d = 0.5 (σ_data, fixed in diffusers) and the scaled timestep τ = timestep_scaling · t:
        c_skip = σ_d² / (τ² + σ_d²),      c_out = τ / √(τ² + σ_d²)
    At t = 0: c_skip = 1, c_out = 0, so f(x, 0) = c_skip·x + c_out·x̂₀ = x.

    Graded against: LCMScheduler(timestep_scaling=s).get_scalings_for_boundary_condition_discrete(t)
    Args:
        timestep:         t, an int in [0, T)
        timestep_scaling: s (diffusers' default 10.0)
    Returns: (c_skip, c_out), Python floats.
    """
    # TODO: τ = s·t; c_skip = σ_d²/(τ² + σ_d²), c_out = τ/√(τ² + σ_d²), with σ_d = 0.5
    raise NotImplementedError


def lcm_step(
    model_output: torch.Tensor,
    timestep: int,
    sample: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
    generator: torch.Generator,
    prediction_type: str = "epsilon",
    timestep_scaling: float = 10.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LCMScheduler.step: x̂₀, the boundary-condition denoised value, then re-noise to the next rung.

        x̂₀       = (x − √(1 − ᾱ_t)·ε)/√ᾱ_t  |  √ᾱ_t·x − √(1 − ᾱ_t)·v  |  the output itself ("sample")
        denoised = c_skip(t)·x + c_out(t)·x̂₀                     (boundary_scalings)
        prev     = √ᾱ_next·denoised + √(1 − ᾱ_next)·z,  z ~ N(0, I) from generator (diffusers: in the output's dtype)
    where t_next is the entry after t in `timesteps`. At the last entry prev = denoised, and nothing is
    drawn from the generator.

    Graded against: LCMScheduler.step(model_output, t, sample, generator=…) → (prev_sample, denoised),
    at every timestep of set_timesteps(n), and the generator's state afterwards
    Args:
        model_output:     (B, C, H, W) the UNet's output, float32 or float16
        timestep:         t, an int, one of `timesteps`
        sample:           (B, C, H, W) x_t, dtype of model_output
        alphas_cumprod:   (T,) float32 ᾱ
        timesteps:        (n,) int64, the LCM ladder (lcm_timesteps)
        generator:        the torch.Generator for z
        prediction_type:  "epsilon", "v_prediction" or "sample"
        timestep_scaling: s of the boundary scalings
    Returns: (prev_sample, denoised), both (B, C, H, W) in the dtype of model_output.
    """
    # TODO: x̂₀ by prediction type; denoised = c_skip·x + c_out·x̂₀; re-noise to the next rung unless last
    raise NotImplementedError


def turbo_schedule(num_inference_steps: int, alphas_cumprod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SD-Turbo's schedule: EulerDiscreteScheduler(timestep_spacing="trailing").set_timesteps(n).

    Trailing spacing counts back from the end of training: t_j = round(T − j·T/n) − 1, j = 0 … n − 1
    (n = 1: [999]; n = 4: 999, 749, 499, 249). Each σ is the σ table (sigma_table) read at t_j, and the
    ladder ends with σ = 0.

    Graded against: EulerDiscreteScheduler(SD betas, timestep_spacing="trailing", steps_offset=1)
    .set_timesteps(n) → (.timesteps, .sigmas): the scheduler config SD-Turbo ships
    Args:
        num_inference_steps: n (1–4 for SD-Turbo)
        alphas_cumprod:      (T,) float32 ᾱ
    Returns: (timesteps, sigmas): timesteps (n,) float32, descending from T − 1; sigmas (n + 1,) float32,
    ending with 0.
    """
    # TODO: t_j = round(T − j·T/n) − 1; σ_j = the σ table at t_j; append σ = 0
    raise NotImplementedError


def few_step_sample(
    unet,
    scheduler,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor,
    guidance_scale: float,
    num_inference_steps: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """The denoising loop of StableDiffusionPipeline for a few-step model, from unit noise to x₀.

    The pipeline guides only when guidance_scale > 1. At 0 (SD-Turbo) or 1 (LCM-LoRA) it calls the UNet
    once per step with the prompt alone; above 1 it runs both branches in ONE batch of 2B
    (negative first) and combines ε_u + s·(ε_c − ε_u). Around that: set the scheduler's timesteps, scale
    the initial latents by scheduler.init_noise_sigma, scale each UNet input with
    scheduler.scale_model_input, and step with the generator.

    Graded against: StableDiffusionPipeline(..., prompt_embeds, negative_prompt_embeds, guidance_scale,
    num_inference_steps, generator, latents=latents, output_type="latent"), with SD-Turbo's
    EulerDiscreteScheduler (trailing) and with LCMScheduler; budget: one UNet call per step, batch B
    when guidance_scale ≤ 1.
    Args:
        unet:                   UNet2DConditionModel: unet(x, t, encoder_hidden_states=…).sample
        scheduler:              a fresh scheduler (EulerDiscreteScheduler or LCMScheduler)
        latents:                (B, 4, h, w) float32, unit-variance noise (before init_noise_sigma)
        prompt_embeds:          (B, L, D) text embeddings
        negative_prompt_embeds: (B, L, D) the negative prompt's embeddings (used only when guiding)
        guidance_scale:         s (0 for SD-Turbo, 1 for LCM-LoRA, > 1 guides)
        num_inference_steps:    n (1–8)
        generator:              the torch.Generator for the scheduler's noise
    Returns: (B, 4, h, w) the final latents (what output_type="latent" returns).
    """
    # TODO: set_timesteps; x = latents·init_noise_sigma; per t: one UNet call (2B only if s > 1), step
    raise NotImplementedError
