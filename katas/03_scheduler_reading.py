"""Lab 03 · Scheduler reading

Concept:
    A scheduler is the time axis and the update rule of inference, written down as configuration.
    Training used all T timesteps of a noise table ᾱ_t; inference visits only n of them, in an order
    that `set_timesteps(n)` chooses from `timestep_spacing` and `steps_offset`. Euler (Karras et al.
    2022, Algorithm 1) then walks down a ladder of noise levels
        σ_t = √((1 − ᾱ_t)/ᾱ_t),   x_{i+1} = x_i + (σ_{i+1} − σ_i) · (x_i − x̂_0)/σ_i
    where x̂_0 is the clean sample the model's output implies. You will rebuild, from plain tensors,
    what `set_timesteps`, `init_noise_sigma`, `scale_model_input` and `step` compute.

Mental model:
    - Two schedules, one table. The training schedule is ᾱ_t for every t in 0 … T−1. The inference
      schedule is a short, descending list of timesteps picked from that range (Lin et al. 2023,
      Table 2): "leading" = multiples of T//n (+ steps_offset), "trailing" = counted back from T−1
      in steps of T/n, "linspace" = n evenly spaced points from T−1 down to 0.
    - DDIM and DDPM round those timesteps to int64. Euler keeps them as float32 and does not round
      "linspace": 832.5 is a legal Euler timestep, and its σ is read between two table entries.
    - Euler's latent is not DDPM's. Dividing x_t = √ᾱ·x_0 + √(1 − ᾱ)·ε by √ᾱ gives
      x = x_0 + σ·ε with σ = √((1 − ᾱ)/ᾱ): unit-scale clean data plus noise of std σ (≈14.6 at
      t = 999 for Stable Diffusion). Hence three conversions:
        start:   latents = randn · init_noise_sigma          (std of x at the first step, ≈ σ_max)
        model:   model_input = x / √(σ² + 1)                  (back to the unit scale it was trained on)
        update:  x ← x + (σ_next − σ) · (x − x̂_0)/σ           (σ_next < σ: the step is negative)
    - One denoising loop, in the names of this lab:
        timesteps = euler_timesteps(n);  sigmas = euler_sigmas(alphas_cumprod, timesteps)
        x = randn(shape) * init_noise_sigma(sigmas, spacing)
        for i, t in enumerate(timesteps):
            out = model(euler_scale_model_input(x, sigmas[i]), t)
            x = euler_step(out, x, sigmas[i], sigmas[i + 1], prediction_type)

Traps:
    - A scheduler is not a loop counter: `for t in range(n)` feeds the model timesteps 0 … n−1, which
      are the wrong noise levels. The model must see the timesteps the scheduler chose.
    - The inference schedule is not the training schedule: 50 steps visit 50 of the 1000 trained
      timesteps spread over the whole range by the spacing, not the first 50 counted down from T−1
      (999, 998, …, 950 stops at almost pure noise); ᾱ (and so σ) comes from the training table.
    - "leading" uses the integer spacing T//n, so it usually starts well below T−1 (n = 7: 852, …, 0);
      "trailing" uses T/n and starts at T−1 (999, 856, …, 142). steps_offset shifts "leading" only.
    - Forgetting to reverse: inference runs from noisy (large t) to clean (small t).
    - Rounding Euler's "linspace" timesteps, or interpolating ᾱ instead of σ between table entries.
    - The σ ladder has n + 1 entries: the last one is 0, the clean end of the last step.
    - scale_model_input divides by √(σ² + 1): not by σ, not a multiplication.
    - The model's output means what `prediction_type` says: treating a v-prediction (or an x̂_0
      prediction, "sample") as ε gives a wrong x̂_0 at every step.
    - σ from ᾱ = 0: a zero-terminal-SNR table (lab 01's rescale) ends at ᾱ = 0, and √((1 − ᾱ)/ᾱ)
      is ∞ there; the whole run is then NaN. diffusers floors that ᾱ at 2**-24, so σ_max ≈ 4096.
    - final_sigmas_type="sigma_min" ends the ladder at σ_0 (the smallest trained σ), not 0: the last
      step stops short of the clean sample. "log_linear" interpolation spaces n + 1 σs evenly in
      log σ between σ_{T−1} and σ_0 and ignores the timesteps (then the final σ: n + 2 entries).

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names, and compute as
    wide as you like; the graders measure your error against exact float64 math and accept anything
    about as close to it as diffusers' own answer. Euler's step must not run narrower than float32
    (float16 cannot resolve x − x̂_0 at large σ: that is a trap), but float64 is fine: at σ = 4096
    (zero terminal SNR, v-prediction) it is closer to exact math than diffusers' float32 step.
    The 2**-24 floor is a value, not a rounding: σ_max = √((1 − 2**-24)/2**-24) must come out ≈ 4096
    (float32 computes it to 1 ulp), and "log_linear" ladders are graded against the same geometric
    ladder in float64 (diffusers' float32 linspace of log σ is a few ulps from it).

Say it out loud:
    "set_timesteps turns the training range 0 … T−1 into n descending timesteps according to the
    spacing config; Euler reads a σ for each from √((1 − ᾱ)/ᾱ), ending at 0. The latent starts at
    std init_noise_sigma, is divided by √(σ² + 1) before the UNet, and each step moves it along
    (x − x̂_0)/σ by σ_next − σ, where x̂_0 comes from ε or v as the model config says."

Graded against: diffusers DDIMScheduler and DDPMScheduler (set_timesteps → timesteps) and
EulerDiscreteScheduler (timesteps, sigmas, init_noise_sigma, scale_model_input, step over every
timestep), on fresh seeded inputs.
Run: python -m pytest katas/03_scheduler_reading.py
"""
import torch


# ---- Worked example --------------------------------------------------------------------------------
def training_sigmas(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The noise level σ_t = √((1 − ᾱ_t)/ᾱ_t) of every training timestep, t = 0 … T−1.

    x_t/√ᾱ_t = x_0 + σ_t·ε: σ_t is the std of the noise once the signal is scaled back to 1.
    It rises from ~0.03 at t = 0 to ~14.6 at t = 999 for Stable Diffusion's schedule.
    Args: alphas_cumprod (T,) float32.  Returns: (T,) float32, computed in float32 as diffusers does.
    """
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


# ---- Your turn -------------------------------------------------------------------------------------
def inference_timesteps(
    num_inference_steps: int,
    num_train_timesteps: int = 1000,
    timestep_spacing: str = "leading",
    steps_offset: int = 0,
) -> torch.Tensor:
    """The n timesteps a DDIM/DDPM sampler visits, noisiest first (Lin et al. 2023, Table 2).

    "leading":  (n−1)·(T//n), …, T//n, 0, each + steps_offset
    "trailing": round(T − i·T/n) − 1 for i = 0 … n−1   (starts at T−1; steps_offset is ignored)
    "linspace": round(T−1 − i·(T−1)/(n−1)) for i = 0 … n−1   (ends at 0; steps_offset is ignored)
    Rounding is half to even (round(832.5) = 832), as numpy and torch.round do.

    Graded against: DDIMScheduler(...).set_timesteps(n) → .timesteps, and DDPMScheduler's.
    Args:
        num_inference_steps: n, how many denoising steps inference takes
        num_train_timesteps: T, the length of the training schedule
        timestep_spacing:    "leading", "trailing" or "linspace"
        steps_offset:        added to every "leading" timestep (Stable Diffusion 1.x uses 1)
    Returns: (n,) int64, descending.
    """
    # TODO: build the ascending grid each spacing describes, round half to even, reverse
    raise NotImplementedError


def euler_timesteps(
    num_inference_steps: int,
    num_train_timesteps: int = 1000,
    timestep_spacing: str = "linspace",
    steps_offset: int = 0,
) -> torch.Tensor:
    """The timesteps EulerDiscreteScheduler visits: the same grids, as float32, linspace unrounded.

    "leading" and "trailing" give the same values as `inference_timesteps`; "linspace" keeps its
    fractions (n = 7: 999, 832.5, 666, 499.5, 333, 166.5, 0). Euler's default spacing is "linspace".

    Graded against: EulerDiscreteScheduler(...).set_timesteps(n) → .timesteps
    Args: as for `inference_timesteps`.  Returns: (n,) float32, descending.
    """
    # TODO: reuse inference_timesteps as float32, except linspace, which is not rounded
    raise NotImplementedError


def euler_sigmas(
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
    interpolation_type: str = "linear",
    final_sigmas_type: str = "zero",
) -> torch.Tensor:
    """Euler's σ ladder: σ(t) at each inference timestep, linearly interpolated, then a final σ.

    σ(t) = σ_⌊t⌋ + (t − ⌊t⌋)·(σ_{⌊t⌋+1} − σ_⌊t⌋), with σ_k = √((1 − ᾱ_k)/ᾱ_k) the table of
    `training_sigmas`. Interpolate σ, not ᾱ; in float64 (as numpy's interp), cast to float32 at the end.
    A zero-terminal-SNR table has ᾱ_{T−1} = 0 and σ = ∞ there: diffusers reads it as ᾱ = 2**-24
    (float16's smallest subnormal), so σ_max = √(2**24 − 1) ≈ 4096.
    interpolation_type="log_linear" ignores the timesteps: n + 1 values evenly spaced in log σ from
    σ_{T−1} down to σ_0 (diffusers computes them in float32), and the final σ after them (n + 2 in all).
    final_sigmas_type: "zero" ends the ladder at 0 (the clean sample), "sigma_min" at σ_0.

    Graded against: EulerDiscreteScheduler(...).set_timesteps(n) → .sigmas
    Args:
        alphas_cumprod:     (T,) float32, the training schedule ᾱ (its last entry may be 0)
        timesteps:          (n,) float32, descending, values in [0, T−1] (from `euler_timesteps`)
        interpolation_type: "linear" (the default) or "log_linear"
        final_sigmas_type:  "zero" (the default) or "sigma_min"
    Returns: (n + 1,) float32: σ(timesteps[0]), …, σ(timesteps[n−1]), then 0 or σ_0
             ((n + 2,) for "log_linear").
    """
    # TODO: ᾱ floored at 2**-24; σ table; interpolate it at t in float64 (or log-linear); cast; append the final σ
    raise NotImplementedError


def init_noise_sigma(sigmas: torch.Tensor, timestep_spacing: str) -> float:
    """The std of the starting latent: multiply randn by this before the first step.

    σ_max for "linspace" and "trailing"; √(σ_max² + 1) for "leading". In Euler's parametrisation
    x = x_0 + σ·ε, so unit-variance data plus noise of std σ has std √(σ² + 1); diffusers uses that
    exact value for "leading" and keeps σ_max (0.2% smaller at σ ≈ 14.6) for the other two.

    Graded against: EulerDiscreteScheduler(...).init_noise_sigma
    Args: sigmas (n + 1,) float32 from `euler_sigmas`; timestep_spacing as configured.
    Returns: a Python float (diffusers' property answers a 0-dim tensor: take the number out with float()).
    """
    # TODO: take the largest σ; for "leading" return √(σ_max² + 1), otherwise σ_max
    raise NotImplementedError


def euler_scale_model_input(sample: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """What the denoiser is fed: the Euler latent scaled back to unit variance, x / √(σ² + 1).

    Graded against: EulerDiscreteScheduler.scale_model_input at every timestep of a schedule
    Args:
        sample: (B, C, H, W) the current latent x, float32 or float16
        sigma:  () float32, σ of the current step: sigmas[i] (a 0-dim tensor, as in diffusers)
    Returns: (B, C, H, W), dtype of sample.
    """
    # TODO: divide by √(σ² + 1)
    raise NotImplementedError


def euler_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """One Euler step from σ to σ_next (Karras et al. 2022, Algorithm 1, without churn).

    x̂_0 = x − σ·ε                                  (prediction_type="epsilon")
    x̂_0 = x/(σ² + 1) − σ/√(σ² + 1) · v             (prediction_type="v_prediction")
    x̂_0 = the model output itself                   (prediction_type="sample")
    d = (x − x̂_0)/σ,   x_next = x + (σ_next − σ)·d

    Graded against: EulerDiscreteScheduler.step(...).prev_sample, at every timestep of a schedule
    Args:
        model_output:    (B, C, H, W) the denoiser's output (ε, v or x̂_0), float32 or float16
        sample:          (B, C, H, W) the current latent x (not the scaled model input)
        sigma:           () float32, σ_i = sigmas[i] (a 0-dim tensor, as in diffusers)
        sigma_next:      () float32, σ_{i+1} = sigmas[i + 1] (0 at the last step)
        prediction_type: "epsilon", "v_prediction" or "sample", as the model was trained
    Returns: (B, C, H, W) x_next, dtype of model_output.
    """
    # TODO: upcast x, get x̂_0 from the prediction type, derivative, step by σ_next − σ, cast
    raise NotImplementedError
