"""Lab 02 · Denoising step

Concept:
    A sampler repeats one reverse update: the network looks at the noisy x_t and the timestep t and
    returns a *prediction about x_t* (the noise ε in it, the velocity v, or the clean sample x_0),
    and the scheduler turns that prediction into x_{t_prev} with fixed math. The network never
    outputs the next image. Every scheduler first converts the prediction into an estimate x̂_0 (and
    the matching ε̂), then moves: DDIM re-noises x̂_0 down to the previous noise level
    (Song et al. 2021, eq. 12), DDPM samples the Gaussian posterior q(x_{t_prev} | x_t, x̂_0)
    (Ho et al. 2020, eq. 6-7).

Mental model:
    - The state is the latent x_t, shape (B, C, H, W). The model output has the same shape but means
      whatever the scheduler's `prediction_type` says: "epsilon", "v_prediction" or "sample". The
      weights do not tell you which; the config does.
    - x_t = √ᾱ_t·x_0 + √(1 − ᾱ_t)·ε ties the three together: know any one of ε, v, x_0 (plus x_t) and
      you know the other two. x̂_0 and ε̂ are two views of the same split of x_t.
    - With n inference steps the update jumps from t to prev_t = t − T//n, not to t − 1. Both ends
      read ᾱ from the training table; the step's own α_t = ᾱ_t/ᾱ_prev covers the whole stride.
      Past the end of the table (prev_t < 0) the target is the clean sample: ᾱ_prev = 1.
    - Randomness: DDPM adds σ_t·z at every step but t = 0; DDIM adds η·σ_t·z, so η = 0 is a
      deterministic sampler and η = 1 has DDPM's noise level.

Traps:
    - The model output is not pixels and not x_{t−1}: for "epsilon" it is noise, for "v_prediction"
      a mix of noise and signal. Feeding it to the wrong formula gives garbage of the right shape.
    - ᾱ_t used where √ᾱ_t belongs when solving x_t = √ᾱ_t·x_0 + √(1 − ᾱ_t)·ε for x_0.
    - v is not ε: x̂_0 = √ᾱ_t·x_t − √(1 − ᾱ_t)·v, a rotation, not a division.
    - DDIM's previous timestep is t − T//n (even with "trailing" spacing, where the next entry of
      the schedule can be one off), and at the last step ᾱ_prev = 1, not alphas_cumprod[prev_t]
      (a negative index silently wraps to the end of the table in Python).
    - clip_sample defaults to True in DDPMScheduler and DDIMScheduler: x̂_0 is clamped to [−1, 1].
      DDIM keeps the *unclipped* ε̂ for the direction term (use_clipped_model_output=False).
    - DDPM with a strided schedule: α_t = ᾱ_t/ᾱ_prev, not 1 − β_t of the training schedule.
    - Noise: std, not variance; drawn with the caller's generator as
      randn(model_output.shape, generator=..., dtype=model_output.dtype); none at DDPM's t = 0;
      DDIM draws one whenever η > 0, even at the last step where σ = 0.
    - Dynamic thresholding (Imagen; thresholding=True, which replaces clip_sample) picks one threshold
      per sample, not one for the batch: s_b = the p-quantile of |x̂_0[b]|, clamped to
      [1, sample_max_value], then clamp to [−s_b, s_b] *and divide by s_b*. The quantile is of the
      absolute values; without the floor at 1 a quiet sample would be blown up to ±1.
    - set_alpha_to_one=False: the last DDIM step lands on ᾱ_0 (not 1), so it keeps a little noise.
    - variance_type="fixed_large" is σ_t² = β_t of the stride (1 − ᾱ_t/ᾱ_prev), not β_t of the
      training table; "fixed_small_log" is the same σ_t as "fixed_small", written via exp/log.

Precision:
    The course's one policy (lab 01 states it): "dtype of model_output" is the dtype of the answer;
    computing wider and casting once is right, and is graded against exact float64 math. Two places
    where it beats diffusers here: float16 x̂_0 at t = 999, where diffusers' float16 rounding is
    multiplied by 1/√ᾱ_t ≈ 14.6 (upcasting to float32 and casting back is more accurate); and DDPM's
    β_t = 1 − ᾱ_t/ᾱ_prev, which float32 resolves to only ~3e-5 of its value when ᾱ_t ≈ ᾱ_prev
    (T = 25, t = 1 → 0), where float64 or Python-float coefficients (.item(), math.sqrt) are exact.
    Writing it in the input's dtype, as diffusers does, passes too.
    Thresholding runs in float32 at least (torch.quantile takes no float16; diffusers upcasts too)
    and casts back; the quantile interpolates between order statistics, so a float64 answer differs
    from diffusers' by float32 rounding only, and is graded against the float64 shadow like the rest.

Say it out loud:
    "The UNet predicts the noise in x_t (or v, or x_0, per the scheduler config), not the next
    image. The scheduler converts that into an estimate of the clean sample, clips it, and moves to
    the previous timestep T//n steps earlier: DDIM puts x̂_0 back at noise level ᾱ_prev along the
    predicted noise direction, plus η-scaled fresh noise; DDPM samples the Gaussian posterior between
    x̂_0 and x_t. Past the first timestep ᾱ is 1: the last step lands on x̂_0 itself."

Graded against: diffusers DDIMScheduler.step (pred_original_sample and prev_sample) and
DDPMScheduler.step, at every timestep of set_timesteps(n), on fresh seeded inputs, with their options
(set_alpha_to_one, variance_type, thresholding); DDPMScheduler._threshold_sample.
Run: python -m pytest katas/02_denoising_step.py
"""
from typing import Any

import torch


# ---- Worked examples -------------------------------------------------------------------------------
def denoise_once(model: Any, scheduler: Any, sample: torch.Tensor, t: int, **conditioning) -> torch.Tensor:
    """One reverse update as every diffusers pipeline's loop body writes it (not graded).

    model: a UNet (returns an object with `.sample`); scheduler: any diffusers scheduler.
    sample: (B, C, H, W) latents x_t.  Returns: (B, C, H, W) latents x_{t_prev}.
    """
    model_input = scheduler.scale_model_input(sample, t)  # identity for DDPM/DDIM, ÷√(σ²+1) for Euler
    model_output = model(model_input, t, **conditioning).sample  # ε, v or x_0: a prediction, not x_{t_prev}
    return scheduler.step(model_output, t, sample).prev_sample  # the scheduler owns the update rule


def predict_epsilon(
    model_output: torch.Tensor, sample: torch.Tensor, alpha_prod_t: torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """ε̂: the noise in x_t implied by the model's prediction (used by DDIM's direction term).

    Same math as diffusers' DDIMScheduler.step (the `pred_epsilon` it computes), before any clipping.
    Args: model_output, sample (B, C, H, W); alpha_prod_t 0-dim float32 (ᾱ_t).  Returns: (B, C, H, W).
    """
    beta_prod_t = 1 - alpha_prod_t  # 1 − ᾱ_t
    if prediction_type == "epsilon":
        return model_output  # the model predicted the noise itself
    if prediction_type == "v_prediction":
        # v = √ᾱ·ε − √(1−ᾱ)·x_0 and x_t = √ᾱ·x_0 + √(1−ᾱ)·ε: rotate back to get ε.
        return (alpha_prod_t**0.5) * model_output + (beta_prod_t**0.5) * sample
    if prediction_type == "sample":
        # the model predicted x_0: solve x_t = √ᾱ·x_0 + √(1−ᾱ)·ε for ε.
        return (sample - alpha_prod_t ** (0.5) * model_output) / beta_prod_t ** (0.5)
    raise ValueError(f"prediction_type must be 'epsilon', 'v_prediction' or 'sample', got {prediction_type!r}")


# ---- Your turn -------------------------------------------------------------------------------------
def predict_x0(
    model_output: torch.Tensor, sample: torch.Tensor, alpha_prod_t: torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """x̂_0: the clean sample implied by the model's prediction, before any clipping.

    epsilon:      x̂_0 = (x_t − √(1 − ᾱ_t)·ε̂) / √ᾱ_t        (DDPM paper, eq. 15)
    v_prediction: x̂_0 = √ᾱ_t·x_t − √(1 − ᾱ_t)·v              (Salimans & Ho 2022)
    sample:       x̂_0 = the model output itself

    Graded against: DDIMScheduler.step(...).pred_original_sample with clip_sample=False
    Args:
        model_output:    (B, C, H, W) the network's output, float32 or float16
        sample:          (B, C, H, W) the noisy x_t it was given, same dtype
        alpha_prod_t:    0-dim float32 tensor, ᾱ_t = alphas_cumprod[t]
        prediction_type: "epsilon", "v_prediction" or "sample" (the scheduler config says which)
    Returns: (B, C, H, W), dtype of model_output.
    """
    # TODO: one formula per prediction_type; √ᾱ_t and √(1 − ᾱ_t) are the coefficients
    raise NotImplementedError


def dynamic_threshold(
    pred_original_sample: torch.Tensor, dynamic_thresholding_ratio: float = 0.995, sample_max_value: float = 1.0
) -> torch.Tensor:
    """Imagen's dynamic thresholding of x̂_0 (Saharia et al. 2022, §2.3): a per-sample clamp, then a rescale.

    For each sample b: s_b = the `dynamic_thresholding_ratio` quantile of |x̂_0[b]| over all its
    C·H·W values, clamped to [1, sample_max_value];  x̂_0[b] ← clamp(x̂_0[b], −s_b, s_b) / s_b.
    With s_b = 1 that is plain clipping to [−1, 1]; with s_b > 1 saturated values are pulled inwards.
    The quantile interpolates linearly between order statistics (torch.quantile's default).

    Graded against: DDPMScheduler._threshold_sample (DDIMScheduler's is the same code)
    Args:
        pred_original_sample:       (B, C, H, W) x̂_0, float32 or float16
        dynamic_thresholding_ratio: the quantile p in (0, 1) (diffusers' default 0.995)
        sample_max_value:           the largest threshold s may take (≥ 1 to ever rescale)
    Returns: (B, C, H, W), dtype of pred_original_sample.
    """
    # TODO: flatten each sample; s = quantile of |x̂0| per sample, clamped to [1, max]; clamp to ±s, ÷ s
    raise NotImplementedError


def ddim_step(
    model_output: torch.Tensor,
    timestep: int,
    sample: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    num_inference_steps: int,
    eta: float = 0.0,
    generator: torch.Generator | None = None,
    prediction_type: str = "epsilon",
    clip_sample: bool = True,
    set_alpha_to_one: bool = True,
    thresholding: bool = False,
    dynamic_thresholding_ratio: float = 0.995,
    sample_max_value: float = 1.0,
) -> torch.Tensor:
    """One DDIM update x_t -> x_{prev_t} (Song et al. 2021, eq. 12 and 16).

    prev_t = t − T//n;  ᾱ_prev = alphas_cumprod[prev_t], or (prev_t < 0) 1 if set_alpha_to_one else ᾱ_0
    σ_t = η·√((1 − ᾱ_prev)/(1 − ᾱ_t)·(1 − ᾱ_t/ᾱ_prev))
    x_prev = √ᾱ_prev·x̂_0 + √(1 − ᾱ_prev − σ_t²)·ε̂ + σ_t·z,   z drawn only when η > 0

    Graded against: DDIMScheduler.step(...).prev_sample (use_clipped_model_output=False) at every
    timestep of set_timesteps(num_inference_steps), with set_alpha_to_one and thresholding on and off.
    Args:
        model_output:        (B, C, H, W) the network's prediction at `timestep`, float32 or float16
        timestep:            t, an entry of the schedule (int)
        sample:              (B, C, H, W) x_t, same dtype as model_output
        alphas_cumprod:      (T,) float32, the training table ᾱ
        num_inference_steps: n, the number of steps the sampler runs
        eta:                 η ≥ 0, the share of DDPM's noise to add (0: deterministic)
        generator:           the torch.Generator to draw z from when η > 0
        prediction_type:     "epsilon", "v_prediction" or "sample"
        clip_sample:         clamp x̂_0 to [−1, 1] (the scheduler default)
        set_alpha_to_one:    past the start of the table ᾱ_prev = 1 (True, the default) or ᾱ_0 (False)
        thresholding:        dynamic thresholding of x̂_0 (`dynamic_threshold`) instead of clip_sample
        dynamic_thresholding_ratio, sample_max_value: its quantile and its largest threshold
    Returns: (B, C, H, W) x_{prev_t}, dtype of model_output.
    """
    # TODO: prev_t and both ᾱ; x̂0 and ε̂; threshold or clip x̂0; σ from η; combine; add σ·z when η > 0
    raise NotImplementedError


def ddpm_step(
    model_output: torch.Tensor,
    timestep: int,
    sample: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    prev_timestep: int,
    generator: torch.Generator | None = None,
    prediction_type: str = "epsilon",
    clip_sample: bool = True,
    variance_type: str = "fixed_small",
    thresholding: bool = False,
    dynamic_thresholding_ratio: float = 0.995,
    sample_max_value: float = 1.0,
) -> torch.Tensor:
    """One DDPM ancestral update: a draw from q(x_{prev_t} | x_t, x̂_0) (Ho et al. 2020, eq. 6-7).

    ᾱ_prev = alphas_cumprod[prev_t], or 1 if prev_t < 0;  α_t = ᾱ_t/ᾱ_prev;  β_t = 1 − α_t
    μ = √ᾱ_prev·β_t/(1 − ᾱ_t)·x̂_0 + √α_t·(1 − ᾱ_prev)/(1 − ᾱ_t)·x_t
    x_prev = μ + σ_t·z, no z at t = 0;  σ_t² = (1 − ᾱ_prev)/(1 − ᾱ_t)·β_t  ("fixed_small", the
    posterior's own variance; "fixed_small_log" is the same σ_t, taken as exp(½·log σ_t²)),
    or σ_t² = β_t  ("fixed_large", the DDPM paper's other choice, an upper bound)

    Graded against: DDPMScheduler.step(...).prev_sample at every timestep of set_timesteps(n), for
    each variance_type and with thresholding on and off; prev_timestep is the next entry of the
    schedule (−1 after the last).
    Args:
        model_output:    (B, C, H, W) the network's prediction at `timestep`, float32 or float16
        timestep:        t, an entry of the schedule (int)
        sample:          (B, C, H, W) x_t, same dtype as model_output
        alphas_cumprod:  (T,) float32, the training table ᾱ
        prev_timestep:   the timestep this step lands on; −1 after the last step (int)
        generator:       the torch.Generator to draw z from
        prediction_type: "epsilon", "v_prediction" or "sample"
        clip_sample:     clamp x̂_0 to [−1, 1] (the scheduler default)
        variance_type:   "fixed_small" (the default), "fixed_small_log" or "fixed_large"
        thresholding:    dynamic thresholding of x̂_0 (`dynamic_threshold`) instead of clip_sample
        dynamic_thresholding_ratio, sample_max_value: its quantile and its largest threshold
    Returns: (B, C, H, W) x_{prev_t}, dtype of model_output.
    """
    # TODO: ᾱ at both ends; α_t = ᾱ_t/ᾱ_prev; x̂0 (thresholded or clipped); posterior mean; + std·z if t > 0
    raise NotImplementedError
