"""Lab 13 · Flow matching

Concept:
    Stable Diffusion 3 and Flux are not trained on DDPM's noise table. They use rectified flow
    (Liu et al. 2022; Esser et al. 2024, eq. 3): the noisy sample is a straight line between the
    clean latent x₀ and the noise ε,
        x_σ = (1 − σ)·x₀ + σ·ε,        σ ∈ [0, 1]   (σ = 1: pure noise, σ = 0: clean)
    and the model predicts the velocity of that line, v = dx_σ/dσ = ε − x₀. Sampling integrates
    dx/dσ = v from σ = 1 down to σ = 0 with plain Euler steps,
        x_next = x + (σ_next − σ)·v.
    The only design freedom left is *which* σs to visit: FlowMatchEulerDiscreteScheduler shifts a
    uniform ladder towards the noisy end, by a fixed `shift` (SD3: 3.0) or by a μ that grows with the
    image's token count (Flux: "dynamic shifting"). You will rebuild, from plain tensors, what
    `set_timesteps`, `time_shift`, the pipelines' `calculate_shift`, `scale_noise` and `step` compute.

Mental model:
    - One number per step: σ. There is no ᾱ table, no β, no √: signal weight 1 − σ, noise weight σ.
      The model is fed the timestep t = σ·T (T = num_train_timesteps = 1000), a float such as 892.8.
    - The shift. σ' = s·σ / (1 + (s − 1)·σ) keeps 0 and 1 fixed and pushes everything in between
      towards 1 (s > 1): in SNR terms ((1 − σ)/σ)², it divides the SNR by s². A large image has more
      pixels carrying the same signal, so it needs more steps at high noise: SD3 uses s = 3.
    - The ladder. set_timesteps(n) takes n evenly spaced σ from σ_max down to σ_min of the *training*
      ladder (σ_i = shift(i/T), i = T … 1, already shifted), shifts them, and appends the terminal 0:
        grid = linspace(1, shift(1/T), n);  sigmas = [shift(grid), 0];  timesteps = T·shift(grid)
      The lowest point is shifted twice (shift(1/T), then shifted again): that is what SD3 runs.
    - Dynamic shifting (Flux, use_dynamic_shifting=True). The shift depends on the resolution:
        tokens = (H/8/p)·(W/8/p)  (latent pixels, /p per side for the p×p patches; p = 2)
        μ = base_shift + (max_shift − base_shift)·(tokens − base_seq_len)/(max_seq_len − base_seq_len)
        "exponential":  σ' = e^μ / (e^μ + (1/σ − 1))        (the static shift with s = e^μ)
        "linear":       σ' = μ / (μ + (1/σ − 1))              (the static shift with s = μ)
      A 1024² Flux image has 64·64 = 4096 tokens, so μ = max_shift = 1.15 and s = e^1.15 ≈ 3.16.
    - One denoising loop, in the names of this lab:
        sigmas, timesteps = flow_sigmas(n, shift)               # or time_shift(μ, grid) + [0]
        x = randn(shape)                                        # σ = 1: the latent is pure noise
        for i, t in enumerate(timesteps):
            v = transformer(x, t)
            x = flow_euler_step(v, x, sigmas[i], sigmas[i + 1])
      and img2img / training noise a clean latent with scale_noise at the chosen timestep(s).

Traps:
    - The shift formula is for σ ∈ [0, 1]. Applied to the timestep t ∈ [0, 1000] it gives nonsense
      (t = 1000, s = 3: 3000/2001 ≈ 1.5, i.e. σ ≈ 0.0015 for the noisiest step).
    - The ladder has n + 1 entries: the last step goes from the last σ to 0, the clean latent.
    - μ is measured in tokens, not pixels: a 1024² image is 4096 tokens (after the VAE's 8× and the
      2×2 patches), not 1,048,576 pixels (μ ≈ 178, e^μ = inf) nor 16,384 latent pixels.
    - "exponential" means e^μ is the shift; "linear" uses μ itself. Swapping them changes every σ.
    - A flow model's output is a velocity, not ε: a DDIM-style update (x̂₀ = (x − σ·out)/(1 − σ),
      then re-noise to σ_next) divides by zero at σ = 1 and is wrong everywhere else.
    - The step is x + (σ_next − σ)·v with σ_next < σ: the step size is negative. Swapping the two σs
      walks back up the noise.
    - scale_noise weighs the *noise* by σ: x_t = σ·ε + (1 − σ)·x₀, with one σ per sample, read from that
      sample's timestep, not DDPM's √ᾱ·x₀ + √(1 − ᾱ)·ε and not Euler's x₀ + σ·ε (lab 03).

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names, and compute as
    wide as you like; the graders measure your error against exact float64 math and accept anything
    about as close to it as diffusers' own answer. diffusers builds the ladder in float64 (numpy) and
    casts it to float32; timesteps are the float32 σs times T. scale_noise runs in the sample's dtype
    (float16 latents: σ rounded to float16 first); step upcasts the latent to float32 but multiplies
    (σ_next − σ)·v in the model output's dtype. Computing any of these in float32 or float64 and
    casting once at the end is at least as exact, and passes.

Say it out loud:
    "Flow matching mixes clean latent and noise linearly, x_σ = (1 − σ)·x₀ + σ·ε; the model predicts
    the velocity ε − x₀ and each Euler step adds (σ_next − σ)·v. The σ ladder is a linspace shifted
    towards noise by sσ/(1 + (s − 1)σ), with s fixed (SD3: 3) or e^μ, where μ is linear in the image's
    token count (Flux). The model sees t = 1000·σ, and the ladder ends with σ = 0."

Graded against: diffusers FlowMatchEulerDiscreteScheduler (set_timesteps → sigmas and timesteps, with
shift and with dynamic shifting; time_shift, scale_noise, step over whole sampling runs) and the
Flux / SD3 pipelines' calculate_shift, on fresh seeded inputs.
Run: python -m pytest katas/13_flow_matching.py
"""
import math

import torch


# ---- Worked example --------------------------------------------------------------------------------
def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The static shift σ' = s·σ / (1 + (s − 1)·σ) (Esser et al. 2024, "resolution-dependent shifting").

    0 and 1 stay where they are; s > 1 pushes every σ in between towards 1 (more noise), s = 1 is the
    identity. SD3 uses s = 3.0: σ = 0.5 becomes 0.75.
    Args: sigma (any shape) in [0, 1]; shift s > 0.  Returns: the same shape and dtype.
    """
    return shift * sigma / (1 + (shift - 1) * sigma)


# ---- Your turn -------------------------------------------------------------------------------------
def flow_sigmas(
    num_inference_steps: int,
    shift: float = 1.0,
    num_train_timesteps: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The σ ladder and the timesteps of FlowMatchEulerDiscreteScheduler.set_timesteps(n), static shift.

    The training ladder is σ_i = shift(i/T) for i = T … 1, so it spans [shift(1/T), 1]. Inference takes
    n evenly spaced points over that span, shifts them (again), and appends the terminal 0:
        grid      = linspace(1, shift(1/T), n)          (n = 1: just [1])
        sigmas    = [shift(grid_0), …, shift(grid_{n−1}), 0]
        timesteps = T · sigmas[:n]
    with shift(σ) = s·σ/(1 + (s − 1)·σ), as in `shift_sigma`.

    Graded against: FlowMatchEulerDiscreteScheduler(shift=s, num_train_timesteps=T).set_timesteps(n)
    → (.sigmas, .timesteps)
    Args:
        num_inference_steps: n, how many denoising steps inference takes
        shift:               s (SD3: 3.0; 1.0 is no shift)
        num_train_timesteps: T
    Returns: (sigmas, timesteps): sigmas (n + 1,) float32, descending from 1 to 0; timesteps (n,) float32.
    """
    # TODO: span the (shifted) training range, shift the grid, append 0; timesteps = T·σ
    raise NotImplementedError


def resolution_mu(
    height: int,
    width: int,
    vae_scale_factor: int = 8,
    patch_size: int = 2,
    base_image_seq_len: int = 256,
    max_image_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """μ for dynamic shifting: linear in the image's token count, as the SD3 and Flux pipelines compute it.

    tokens = (height // vae_scale_factor // patch_size) · (width // vae_scale_factor // patch_size)
    μ is the line through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift) read at
    tokens (and extrapolated beyond them). Flux at 1024×1024: 64·64 = 4096 tokens, μ = 1.15.

    Graded against: calculate_shift(image_seq_len, base_seq_len, max_seq_len, base_shift, max_shift) of
    diffusers.pipelines.flux.pipeline_flux (SD3's pipeline holds a copy), at the token count
    StableDiffusion3Pipeline.__call__ reads off its latents.
    Args:
        height, width:         the image size in pixels (divisible by vae_scale_factor · patch_size)
        vae_scale_factor:      pixels per latent pixel, per side (8 for SD3 and Flux)
        patch_size:            latent pixels per token, per side (2 for SD3 and Flux)
        base_image_seq_len, max_image_seq_len, base_shift, max_shift: the scheduler config's line
    Returns: μ, a Python float.
    """
    # TODO: count tokens (pixels -> latent pixels -> patches), then read the line at that count
    raise NotImplementedError


def time_shift(mu: float, sigmas: torch.Tensor, time_shift_type: str = "exponential") -> torch.Tensor:
    """Dynamic (resolution-dependent) shifting of a σ grid by μ.

    "exponential":  σ' = e^μ / (e^μ + (1/σ − 1))      (= the static shift with s = e^μ)
    "linear":       σ' = μ / (μ + (1/σ − 1))          (= the static shift with s = μ)
    (diffusers' time_shift(mu, sigma, t) also raises (1/t − 1) to a power `sigma`; set_timesteps
    passes 1.0, so it drops out here.)

    Graded against: FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type=…)
    .set_timesteps(sigmas=grid, mu=μ) → .sigmas[:-1] (Flux's call, grid = linspace(1, 1/n, n)), and
    .time_shift(μ, 1.0, σ) on random float32 and float16 σs.
    Args:
        mu:              μ (from `resolution_mu`)
        sigmas:          (n,) the unshifted σ grid, values in (0, 1], float32 or float16
        time_shift_type: "exponential" (Flux, SD3) or "linear"
    Returns: (n,) the shifted σs, dtype of sigmas.
    """
    # TODO: the shift factor is e^μ (exponential) or μ (linear); σ' = s / (s + (1/σ − 1))
    raise NotImplementedError


def scale_noise(
    sample: torch.Tensor,
    noise: torch.Tensor,
    timestep: torch.Tensor,
    timesteps: torch.Tensor,
    sigmas: torch.Tensor,
) -> torch.Tensor:
    """The forward process of rectified flow: x_t = σ·ε + (1 − σ)·x₀, one σ per sample.

    Each sample's σ is the schedule's σ at the position of its timestep in the schedule's timesteps
    (timesteps[i] is sigmas[i]·T, so that is σ = sigmas[i]).

    Graded against: FlowMatchEulerDiscreteScheduler.scale_noise(sample, timestep, noise), on the training
    ladder and after set_timesteps (img2img's start)
    Args:
        sample:    (B, C, H, W) the clean latent x₀, float32 or float16
        noise:     (B, C, H, W) ε, dtype of sample
        timestep:  (B,) float32, each one of `timesteps`
        timesteps: (N,) float32, the scheduler's timesteps
        sigmas:    (N,) or (N + 1,) float32, the scheduler's σs (timesteps[i] ↔ sigmas[i])
    Returns: (B, C, H, W) x_t, dtype of sample.
    """
    # TODO: find each timestep's index, take its σ, broadcast it over (C, H, W), mix linearly
    raise NotImplementedError


def flow_euler_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
) -> torch.Tensor:
    """One Euler step of the flow ODE dx/dσ = v from σ to σ_next: x_next = x + (σ_next − σ)·v.

    The model output is the velocity v = ε − x₀ itself: no x̂₀, no ε, no division.

    Graded against: FlowMatchEulerDiscreteScheduler.step(...).prev_sample, at every timestep of sampling
    runs (and of an img2img run that starts part-way down the ladder)
    Args:
        model_output: (B, C, H, W) the transformer's velocity v, float32 or float16
        sample:       (B, C, H, W) the current latent x, dtype of model_output
        sigma:        () float32, σ_i = sigmas[i] (a 0-dim tensor, as in diffusers)
        sigma_next:   () float32, σ_{i+1} = sigmas[i + 1] (0 at the last step)
    Returns: (B, C, H, W) x_next, dtype of model_output.
    """
    # TODO: upcast, add (σ_next − σ)·v, cast back to the model's dtype
    raise NotImplementedError
