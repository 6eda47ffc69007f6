"""Lab 01 · Forward noise process

Concept:
    Training needs noisy inputs with a known answer. The forward process makes them in closed form:
    x_t = √ᾱ_t · x_0 + √(1 − ᾱ_t) · ε  (DDPM, Ho et al. 2020, eq. 4), where ᾱ_t = ∏_{s≤t} (1 − β_s).
    Everything a scheduler does later is read off this one table of ᾱ_t.

Mental model:
    - A beta schedule is a list of T small variances β_t; its only job is to produce ᾱ_t.
    - ᾱ_t falls from ~1 (clean) to ~0 (pure noise). The signal keeps √ᾱ_t, the noise gets √(1 − ᾱ_t):
      the squares add to 1, so a unit-variance x_0 stays unit-variance.
    - The model is trained to predict a target built from (x_0, ε): ε itself, or the velocity
      v = √ᾱ_t·ε − √(1 − ᾱ_t)·x_0 (Salimans & Ho 2022), which stays finite when ᾱ_t → 0.

Traps:
    - ᾱ_t used where √ᾱ_t belongs: x_t = ᾱ·x_0 + (1 − ᾱ)·ε does not keep the variance at 1.
    - "scaled_linear" is a linspace over √β, squared; it is not a linspace over β.
    - Per-sample timesteps: ᾱ[t] has shape (B,) and must broadcast over (B, C, H, W).
    - float16 samples in add_noise and velocity: diffusers casts ᾱ to the sample's dtype *before*
      taking square roots; computing in float32 and casting at the end lands up to 3e-2 away. This is
      the one place the course grades where the cast goes (see Precision).
    - Rescaling to zero terminal SNR by shifting √ᾱ alone (ᾱ_0 moves too), or on ᾱ instead of √ᾱ.
      The rescale makes ᾱ_{T−1} exactly 0, so ε-prediction at the last step divides by zero; that is
      why it is paired with v-prediction.

Precision:
    One policy for the whole course. "Returns: … dtype of x0" names the dtype of the answer, not of
    every operation: computing wider (Python floats or float64 for a schedule, float32 for float16
    tensors) and casting once at the end is right. The graders measure your error against exact
    float64 math and accept any answer about as close to it as diffusers' own, a more accurate one
    included (a float64 rescale_zero_terminal_snr is closer to exact math than diffusers' float32 one,
    whose cancellation near the tail costs it 7e-6). Never compute *narrower* than diffusers (float16
    where it upcasts). The one place that grades where the cast goes is this lab's add_noise and
    velocity on float16 samples: diffusers casts ᾱ to float16 before the square roots, and the noisy
    sample a pipeline trains on carries that rounding; a trap names the float32-then-cast answer as
    more accurate than diffusers, not as a wrong formula.

Say it out loud:
    "The schedule gives ᾱ_t; a noisy sample is √ᾱ_t of the clean one plus √(1 − ᾱ_t) of fresh noise,
    one coefficient pair per sample, broadcast over channels and pixels. The training target is ε or
    v, built from the same two tensors."

Graded against: diffusers DDPMScheduler (betas, alphas_cumprod, add_noise, get_velocity),
betas_for_alpha_bar and rescale_zero_terminal_snr, on fresh seeded inputs.
Run: python -m pytest katas/01_forward_noise.py
"""
import math

import torch


# ---- Worked example --------------------------------------------------------------------------------
def linear_betas(beta_start: float, beta_end: float, num_train_timesteps: int) -> torch.Tensor:
    """β_t evenly spaced from beta_start to beta_end: the original DDPM schedule.

    Returns: (T,) float32. Same as DDPMScheduler(beta_schedule="linear").betas.
    """
    return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)


# ---- Your turn -------------------------------------------------------------------------------------
def scaled_linear_betas(beta_start: float, beta_end: float, num_train_timesteps: int) -> torch.Tensor:
    """β_t = (linspace(√beta_start, √beta_end, T)_t)²: the Stable Diffusion (latent diffusion) schedule.

    Graded against: DDPMScheduler(beta_schedule="scaled_linear").betas
    Returns: (T,) float32.
    """
    # BEGIN SOLUTION: space √β evenly (float32), then square
    # The schedule is linear in √β, so β grows quadratically: gentler noise early on than "linear".
    return torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float32) ** 2
    # END SOLUTION


def cosine_betas(num_train_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    """The "squaredcos_cap_v2" schedule (Nichol & Dhariwal 2021, eq. 17).

    f(t) = cos(((t + 0.008) / 1.008) · π/2)²,  β_i = min(1 − f((i+1)/T) / f(i/T), max_beta).
    Graded against: diffusers.schedulers.scheduling_ddpm.betas_for_alpha_bar
    Returns: (T,) float32.
    """
    # BEGIN SOLUTION: define f, then one β per step from the ratio of consecutive f values, capped
    # Notation: f -> ᾱ(t) of the paper, on t ∈ [0, 1]; the small offset s = 0.008 keeps β_0 from being ~0.
    def f(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    # Python floats (float64) throughout, cast once at the end, as diffusers does. The cap matters at
    # the last step, where f(1) = 0 would make β = 1.
    betas = [min(1 - f((i + 1) / num_train_timesteps) / f(i / num_train_timesteps), max_beta)
             for i in range(num_train_timesteps)]
    return torch.tensor(betas, dtype=torch.float32)
    # END SOLUTION


def alphas_cumprod(betas: torch.Tensor) -> torch.Tensor:
    """ᾱ_t = ∏_{s≤t} (1 − β_s).

    Graded against: DDPMScheduler(...).alphas_cumprod
    Args: betas (T,) float32.  Returns: (T,) float32.
    """
    # BEGIN SOLUTION: α = 1 − β, then a running product over the time axis
    return torch.cumprod(1.0 - betas, dim=0)
    # END SOLUTION


def add_noise(
    x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """x_t = √ᾱ_t · x_0 + √(1 − ᾱ_t) · ε, one timestep per sample.

    Graded against: DDPMScheduler.add_noise
    Args:
        x0:             (B, C, H, W) clean samples (any number of trailing dims), float32 or float16
        noise:          same shape and dtype as x0
        alphas_cumprod: (T,) float32
        timesteps:      (B,) int64, one per sample
    Returns: (B, C, H, W), dtype of x0.
    """
    # BEGIN SOLUTION: pick ᾱ per sample in x0's dtype, take the square roots, broadcast, combine
    # 1. the table in the sample's dtype first: in float16 the rounding of √ᾱ is part of the answer.
    abar = alphas_cumprod.to(device=x0.device, dtype=x0.dtype)[timesteps]  # (B,)
    # 2. the two coefficients, shaped (B, 1, 1, 1) to broadcast over everything but the batch.
    shape = (-1,) + (1,) * (x0.dim() - 1)
    sqrt_abar = (abar**0.5).reshape(shape)
    sqrt_one_minus_abar = ((1 - abar) ** 0.5).reshape(shape)
    # 3. variance preserving: (√ᾱ)² + (√(1−ᾱ))² = 1.
    return sqrt_abar * x0 + sqrt_one_minus_abar * noise
    # END SOLUTION


def velocity(
    x0: torch.Tensor, noise: torch.Tensor, alphas_cumprod: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """The v-prediction target v_t = √ᾱ_t · ε − √(1 − ᾱ_t) · x_0 (Salimans & Ho 2022, §4).

    Graded against: DDPMScheduler.get_velocity
    Args and shapes as for `add_noise`.  Returns: (B, C, H, W), dtype of x0.
    """
    # BEGIN SOLUTION: the same coefficients as add_noise, rotated: ε gets √ᾱ, x_0 gets −√(1−ᾱ)
    abar = alphas_cumprod.to(device=x0.device, dtype=x0.dtype)[timesteps]
    shape = (-1,) + (1,) * (x0.dim() - 1)
    sqrt_abar = (abar**0.5).reshape(shape)
    sqrt_one_minus_abar = ((1 - abar) ** 0.5).reshape(shape)
    # v is x_t's direction rotated by 90°: at ᾱ → 0 it becomes −x_0, so it stays informative.
    return sqrt_abar * noise - sqrt_one_minus_abar * x0
    # END SOLUTION


def rescale_zero_terminal_snr(betas: torch.Tensor) -> torch.Tensor:
    """Rescale betas so the last step is pure noise (Lin et al. 2023, Algorithm 1).

    Shift √ᾱ so its last value is 0, scale it so its first value is unchanged, then convert back
    to betas. Graded against: diffusers.schedulers.scheduling_ddpm.rescale_zero_terminal_snr
    Args: betas (T,) float32.  Returns: (T,) float32 with betas[-1] == 1.
    """
    # BEGIN SOLUTION: betas -> √ᾱ, shift and scale √ᾱ, then undo the square and the cumprod
    # 1. betas -> √ᾱ
    sqrt_abar = torch.cumprod(1.0 - betas, dim=0).sqrt()
    first, last = sqrt_abar[0].clone(), sqrt_abar[-1].clone()
    # 2. shift so the last timestep has zero signal (SNR = ᾱ/(1−ᾱ) = 0) ...
    sqrt_abar = sqrt_abar - last
    # 3. ... and scale so the first timestep keeps its old value.
    sqrt_abar = sqrt_abar * (first / (first - last))
    # 4. undo the square, then the cumulative product: α_t = ᾱ_t / ᾱ_{t−1}.
    abar = sqrt_abar**2
    alphas = torch.cat([abar[0:1], abar[1:] / abar[:-1]])
    return 1 - alphas
    # END SOLUTION
