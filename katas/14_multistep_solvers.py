"""Lab 14 · Multistep solvers

Concept:
    Deterministic sampling solves an ODE: the probability-flow ODE that carries noise at t = T to data
    at t = 0. DPM-Solver++ (Lu et al. 2022, arXiv 2211.01095) writes it in λ = log(α/σ), the half
    log-SNR, with the model's prediction as a data estimate x̂_0. The linear part of the ODE is then
    solved exactly and only one integral is approximated:
        x_t = (σ_t/σ_s)·x_s + σ_t·∫_{λ_s}^{λ_t} e^λ·x̂_0(x_λ, λ) dλ,   α = √ᾱ, σ = √(1 − ᾱ)
    Hold x̂_0 constant over the step and the integral is α_t·(1 − e^{−h}), h = λ_t − λ_s: the
    first-order update, which is DDIM with η = 0. Let x̂_0 vary linearly in λ, with the slope read from
    the previous step's x̂_0, and the update is second order: DPM-Solver++(2M), the "DPM++ 2M" of most
    Stable Diffusion front ends and DPMSolverMultistepScheduler's default (solver_order=2).
        first order:  x_t = (σ_t/σ_s0)·x − α_t·(e^{−h} − 1)·m0
        2M midpoint:  x_t = (σ_t/σ_s0)·x − α_t·(e^{−h} − 1)·m0 − ½·α_t·(e^{−h} − 1)·(m0 − m1)/r0,
                      r0 = h_0/h,  h_0 = λ_s0 − λ_s1
    where m0 = x̂_0 at this step (noise level s0), m1 = x̂_0 one step earlier (s1).

Mental model:
    - λ is the clock of the solver: it rises from about −2.7 at t = 999 (Stable Diffusion's table) to
      about 3.5 at t = 0, and +∞ at clean data (σ = 0). Steps are measured in λ (h), not in t.
    - Multistep means one denoiser call per step, as DDIM: the second order comes from remembering
      the previous x̂_0, never from a second call (single-step solvers such as Heun call twice).
    - The history is what makes it second order, and it has edges. The first step has no history: it
      is first order. The last step, onto σ = 0 (final_sigmas_type="zero", the default), has λ_t = +∞:
      h = ∞, r0 = 0, and the 2M formula gives ∞ or NaN, so diffusers steps there with first order,
      which lands exactly on x̂_0. With lower_order_final (default True) and fewer than 15 steps the
      last step is first order also when it ends at σ_min, for stability with few steps.
    - DPM-Solver++ integrates the data prediction: the denoiser's ε is converted to
      x̂_0 = (x − σ·ε)/α first, and the history holds x̂_0, not ε.
    - diffusers stores σ as the variance-exploding σ = √((1 − ᾱ)/ᾱ) (scheduler.sigmas) and gets back
      α = 1/√(σ² + 1) and σ·α (_sigma_to_alpha_sigma_t): the same α_t and σ_t as from ᾱ, up to rounding.
    - Order is measurable: on a smooth problem, halve every step and a solver of order p makes its
      error 2^p times smaller. DDIM (first order) halves it; 2M quarters it.

Traps:
    - λ from ᾱ instead of √ᾱ: log(ᾱ/(1 − ᾱ)) is 2λ, so h doubles and e^{−h} is squared.
    - h = λ_s − λ_t: the sign flipped (λ grows as noise goes: h > 0 for every denoising step).
    - The history in the wrong order: diffusers keeps model_outputs oldest first, so m0 (this step)
      is model_outputs[-1] and m1 (the previous step) is model_outputs[-2].
    - A second-order first step: with no history there is nothing to take a slope from (using the
      current x̂_0 twice gives h_0 = 0, r0 = 0 and D1 = 0/0 = NaN).
    - lower_order_final ignored: a second-order last step onto σ = 0 is ∞/NaN; onto σ_min with fewer
      than 15 steps it is finite, and not diffusers' answer.
    - ε used where x̂_0 belongs: DPM-Solver++ updates are written for the data prediction (the
      noise-prediction DPM-Solver update is another formula: (α_t/α_s)·x − σ_t·(e^h − 1)·ε).
    - A "second-order" solver that only ever takes first-order steps matches diffusers at the first
      step and looks plausible everywhere; its convergence order gives it away.

Precision:
    The course's one policy (lab 01 states it): the answer has the dtype diffusers returns, and an
    answer at most 2× as far from exact float64 math as diffusers' own (+ 2 ulps) is right. diffusers
    computes x̂_0 in the model output's dtype, then upcasts the sample to float32 for the update ("to
    avoid precision issues") and casts the result back, so the float16 loop keeps float16 samples
    between steps. Computing an update in float64 (or float32 for float16 inputs) and casting once at
    the end is right; the denoiser must still get the sample in its own dtype, as a float16 UNet would.

Say it out loud:
    "DPM-Solver++ walks in λ = log(α/σ). Each step turns ε into x̂_0, then moves from s to t with the
    exact linear part, σ_t/σ_s times x, plus α_t(1 − e^{−h}) times x̂_0: that is DDIM. The 2M solver
    adds a slope term, ½·α_t(1 − e^{−h})·(m0 − m1)/r0, built from the x̂_0 it kept from the previous step,
    so it costs one denoiser call per step and is second order. The first step has no history and
    the step onto σ = 0 (or the last of fewer than 15 steps) is taken first order. Halve the steps
    and its error falls 4×, where DDIM's falls 2×."

Graded against: diffusers DPMSolverMultistepScheduler (algorithm_type="dpmsolver++", solver_order=2,
solver_type="midpoint", epsilon prediction, Stable Diffusion's scaled_linear betas): its lambda_t table
and the λ of its step sigmas, convert_model_output, dpm_solver_first_order_update,
multistep_dpm_solver_second_order_update at every step of set_timesteps(n), and whole loops of
scheduler.step driven by the same denoiser (the ideal ε-prediction of Gaussian data), float32 and
float16; and the ★ convergence order of your loop against the exact solution of that ODE.
Run: python -m pytest katas/14_multistep_solvers.py
"""
from __future__ import annotations

from typing import Callable

import torch


# ---- Worked example --------------------------------------------------------------------------------
def alpha_sigma(alpha_prod: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(α, σ) = (√ᾱ, √(1 − ᾱ)): the signal and noise scales of x = α·x_0 + σ·ε (not graded).

    diffusers' DPMSolverMultistepScheduler reaches the same pair from its σ_VE = √((1 − ᾱ)/ᾱ) table:
    α = 1/√(σ_VE² + 1), σ = σ_VE·α (_sigma_to_alpha_sigma_t). At clean data ᾱ = 1: α = 1, σ = 0.
    Args: alpha_prod: ᾱ, any shape (a 0-dim float32 tensor in this lab).  Returns: (α, σ), same shape.
    """
    return alpha_prod**0.5, (1 - alpha_prod) ** 0.5


# ---- Your turn -------------------------------------------------------------------------------------
def dpm_lambda(alpha_prod: torch.Tensor) -> torch.Tensor:
    """λ = log(α/σ) = log √ᾱ − log √(1 − ᾱ): half the log signal-to-noise ratio, the solver's clock.

    Graded against: DPMSolverMultistepScheduler(...).lambda_t (the training table) and the λ its
    updates compute from scheduler.sigmas (λ = +∞ at σ = 0).
    Args:
        alpha_prod: ᾱ, any shape, float32 (1.0 at clean data)
    Returns: λ, same shape and dtype (+inf where ᾱ = 1).
    """
    # TODO: log α − log σ with α = √ᾱ and σ = √(1 − ᾱ)
    raise NotImplementedError


def data_prediction(model_output: torch.Tensor, sample: torch.Tensor, alpha_prod_t: torch.Tensor) -> torch.Tensor:
    """x̂_0 = (x_t − σ_t·ε̂)/α_t: what DPM-Solver++ integrates, from an ε-prediction.

    Graded against: DPMSolverMultistepScheduler.convert_model_output (algorithm_type="dpmsolver++",
    prediction_type="epsilon") at every step of set_timesteps(n).
    Args:
        model_output: (B, C, H, W) the denoiser's ε̂ at this step, float32 or float16
        sample:       (B, C, H, W) x_t, same dtype
        alpha_prod_t: 0-dim float32 tensor, ᾱ_t of this step
    Returns: (B, C, H, W) x̂_0, dtype of model_output.
    """
    # TODO: solve x_t = α_t·x_0 + σ_t·ε for x_0
    raise NotImplementedError


def first_order_update(
    x0_pred: torch.Tensor, sample: torch.Tensor, alpha_prod_s: torch.Tensor, alpha_prod_t: torch.Tensor
) -> torch.Tensor:
    """One first-order DPM-Solver++ step from noise level s to t (DDIM with η = 0, in λ).

    h = λ_t − λ_s;   x_t = (σ_t/σ_s)·x_s − α_t·(e^{−h} − 1)·x̂_0

    Graded against: DPMSolverMultistepScheduler.dpm_solver_first_order_update, as step() calls it (the
    sample upcast to float32, the result cast back), at every step of set_timesteps(n), the last one
    onto σ = 0 (ᾱ_t = 1) included.
    Args:
        x0_pred:      (B, C, H, W) x̂_0 at s (from data_prediction), float32 or float16
        sample:       (B, C, H, W) x_s, same dtype
        alpha_prod_s: 0-dim float32 tensor, ᾱ at s (the current step)
        alpha_prod_t: 0-dim float32 tensor, ᾱ at t (the step's target; 1.0 for clean data)
    Returns: (B, C, H, W) x_t, dtype of sample.
    """
    # TODO: α, σ and λ at both ends; h; the σ ratio times x plus α_t(1 − e^{−h}) times x̂_0
    raise NotImplementedError


def second_order_update(
    model_outputs: list[torch.Tensor],
    sample: torch.Tensor,
    alpha_prods: list[torch.Tensor],
    alpha_prod_t: torch.Tensor,
) -> torch.Tensor:
    """One DPM-Solver++(2M) step ("midpoint") from s0 to t, using x̂_0 at s0 and at the step before, s1.

    m0, m1 = x̂_0 at s0 (this step), x̂_0 at s1 (the previous step)
    h = λ_t − λ_s0;  h_0 = λ_s0 − λ_s1;  r0 = h_0/h;  D0 = m0;  D1 = (m0 − m1)/r0
    x_t = (σ_t/σ_s0)·x − α_t·(e^{−h} − 1)·D0 − ½·α_t·(e^{−h} − 1)·D1

    Graded against: DPMSolverMultistepScheduler.multistep_dpm_solver_second_order_update (solver_type=
    "midpoint"), as step() calls it, at every step of set_timesteps(n) that has a previous step.
    Args:
        model_outputs: [x̂_0 at s1, x̂_0 at s0], OLDEST FIRST, as diffusers' scheduler.model_outputs;
                       each (B, C, H, W), float32 or float16
        sample:        (B, C, H, W) x at s0, same dtype
        alpha_prods:   [ᾱ at s1, ᾱ at s0], the same order; 0-dim float32 tensors
        alpha_prod_t:  0-dim float32 tensor, ᾱ at the target t
    Returns: (B, C, H, W) x_t, dtype of sample.
    """
    # TODO: λ at s1, s0 and t; h, h_0 and r0; D0 and D1 from the newest two x̂_0; the midpoint update
    raise NotImplementedError


def dpm_solver_sample(
    denoiser: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    sample: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
    lower_order_final: bool = True,
    final_sigmas_type: str = "zero",
) -> torch.Tensor:
    """The DPM-Solver++(2M) sampling loop: one denoiser call per timestep, x̂_0 history, order 1 or 2.

    Step i goes from timesteps[i] to timesteps[i + 1]; the last step goes to clean data (ᾱ = 1) when
    final_sigmas_type is "zero", to ᾱ = alphas_cumprod[0] when it is "sigma_min".
    First order: at i = 0 (no history), and at the last step when final_sigmas_type == "zero" or
    (lower_order_final and len(timesteps) < 15). Second order everywhere else.

    Graded against: a loop of DPMSolverMultistepScheduler.step(denoiser(x, t), t, x) over
    scheduler.timesteps (algorithm_type="dpmsolver++", solver_order=2), and by its convergence order.
    Args:
        denoiser:          denoiser(x, t) -> ε̂, same shape and dtype as x; call it once per timestep
        sample:            (B, C, H, W) x at timesteps[0] (pure noise), float32 or float16
        alphas_cumprod:    (T,) float32, the training table ᾱ
        timesteps:         (n,) int64, scheduler.timesteps after set_timesteps(n), noisiest first
        lower_order_final: diffusers' flag: first order at the last step when n < 15
        final_sigmas_type: "zero" (end at σ = 0, clean data) or "sigma_min" (end at ᾱ[0])
    Returns: (B, C, H, W) the final sample, dtype of sample.
    """
    # TODO: per timestep: ε̂ → x̂_0, keep the history, pick order 1 or 2, update
    raise NotImplementedError
