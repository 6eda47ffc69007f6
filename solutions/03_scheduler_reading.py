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
    # BEGIN SOLUTION: build the ascending grid each spacing describes, round half to even, reverse
    # Notation: n -> num_inference_steps, T -> num_train_timesteps.
    n, T = num_inference_steps, num_train_timesteps
    if timestep_spacing == "leading":
        # 1. Integer spacing T//n from 0 up: n = 7 gives 0, 142, …, 852, so the noisiest timestep
        #    is (n−1)·(T//n), not T−1. The offset moves the whole grid (SD 1.x: 981, …, 1 at n = 50).
        timesteps = (torch.arange(n, dtype=torch.int64) * (T // n)).flip(0)
        return timesteps + steps_offset
    if timestep_spacing == "trailing":
        # 2. Float spacing T/n counted down from T, rounded, then −1: the first timestep is T−1,
        #    the pure-noise end the model was trained on. Computed in float64, as numpy does.
        timesteps = (T - torch.arange(n, dtype=torch.float64) * (T / n)).round() - 1
        return timesteps.to(torch.int64)
    if timestep_spacing == "linspace":
        # 3. n evenly spaced points over [0, T−1], both ends included, rounded half to even
        #    (torch.round, like numpy's), then reversed so the noisiest timestep comes first.
        timesteps = torch.linspace(0, T - 1, n, dtype=torch.float64).round().flip(0)
        return timesteps.to(torch.int64)
    raise ValueError(f"unknown timestep_spacing {timestep_spacing!r}")
    # END SOLUTION


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
    # BEGIN SOLUTION: reuse inference_timesteps as float32, except linspace, which is not rounded
    if timestep_spacing == "linspace":
        # Euler never indexes a table with t: it interpolates σ, so a fractional t is fine.
        # float64 linspace cast to float32 is what np.linspace(..., dtype=np.float32) computes.
        T = num_train_timesteps
        return torch.linspace(0, T - 1, num_inference_steps, dtype=torch.float64).flip(0).to(torch.float32)
    return inference_timesteps(num_inference_steps, num_train_timesteps, timestep_spacing,
                               steps_offset).to(torch.float32)
    # END SOLUTION


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
    # BEGIN SOLUTION: ᾱ floored at 2**-24; σ table; interpolate it at t in float64 (or log-linear); cast; append the final σ
    # Notation: table -> σ_k at integer k; lo/hi -> the neighbouring grid points; w -> t − ⌊t⌋.
    T = alphas_cumprod.shape[0]
    # 0. ᾱ = 0 (zero terminal SNR) would give σ = ∞: diffusers sets that entry to 2**-24 instead.
    alphas_cumprod = alphas_cumprod.clamp(min=2**-24)
    # 1. The table at integer timesteps, in float32 (diffusers builds it from the float32 ᾱ).
    table32 = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5  # (T,)
    table = table32.to(torch.float64)
    if interpolation_type == "linear":
        # 2. Linear interpolation between the two neighbouring table entries (np.interp's rule).
        #    At t = T−1 both neighbours are T−1 and the weight is 0.
        t = timesteps.to(torch.float64)  # (n,)
        lo = t.floor().clamp(0, T - 1).to(torch.int64)
        hi = (lo + 1).clamp(max=T - 1)
        w = t - lo.to(torch.float64)
        sigmas = (table[hi] - table[lo]) * w + table[lo]  # (n,)
    elif interpolation_type == "log_linear":
        # 2'. n + 1 points evenly spaced in log σ from σ_max = σ_{T−1} to σ_min = σ_0; the timesteps
        #     play no part (diffusers' float32 torch.linspace of the float32 logs, then exp).
        n = timesteps.shape[0]
        sigmas = torch.linspace(float(table32[-1].log()), float(table32[0].log()), n + 1).exp().to(torch.float64)
    else:
        raise ValueError(f"unknown interpolation_type {interpolation_type!r}")
    # 3. The end of the last step: σ = 0, the clean sample ("zero"), or σ_0 ("sigma_min").
    if final_sigmas_type == "zero":
        last = sigmas.new_zeros(1)
    elif final_sigmas_type == "sigma_min":
        last = table[:1]
    else:
        raise ValueError(f"unknown final_sigmas_type {final_sigmas_type!r}")
    return torch.cat([sigmas, last]).to(torch.float32)
    # END SOLUTION


def init_noise_sigma(sigmas: torch.Tensor, timestep_spacing: str) -> float:
    """The std of the starting latent: multiply randn by this before the first step.

    σ_max for "linspace" and "trailing"; √(σ_max² + 1) for "leading". In Euler's parametrisation
    x = x_0 + σ·ε, so unit-variance data plus noise of std σ has std √(σ² + 1); diffusers uses that
    exact value for "leading" and keeps σ_max (0.2% smaller at σ ≈ 14.6) for the other two.

    Graded against: EulerDiscreteScheduler(...).init_noise_sigma
    Args: sigmas (n + 1,) float32 from `euler_sigmas`; timestep_spacing as configured.
    Returns: a Python float (diffusers' property answers a 0-dim tensor: take the number out with float()).
    """
    # BEGIN SOLUTION: take the largest σ; for "leading" return √(σ_max² + 1), otherwise σ_max
    sigma_max = float(sigmas.max())
    if timestep_spacing in ("linspace", "trailing"):
        return sigma_max
    return (sigma_max**2 + 1) ** 0.5
    # END SOLUTION


def euler_scale_model_input(sample: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """What the denoiser is fed: the Euler latent scaled back to unit variance, x / √(σ² + 1).

    Graded against: EulerDiscreteScheduler.scale_model_input at every timestep of a schedule
    Args:
        sample: (B, C, H, W) the current latent x, float32 or float16
        sigma:  () float32, σ of the current step: sigmas[i] (a 0-dim tensor, as in diffusers)
    Returns: (B, C, H, W), dtype of sample.
    """
    # BEGIN SOLUTION: divide by √(σ² + 1)
    # x = x_0 + σ·ε has variance 1 + σ²; the UNet was trained on √ᾱ·x_0 + √(1−ᾱ)·ε, which is
    # exactly x/√(σ² + 1) because √ᾱ = 1/√(σ² + 1).
    return sample / ((sigma**2 + 1) ** 0.5)
    # END SOLUTION


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
    # BEGIN SOLUTION: upcast x, get x̂_0 from the prediction type, derivative, step by σ_next − σ, cast
    # Notation: x -> sample (Euler's latent x = x_0 + σ·ε); x0 -> x̂_0; d -> dx/dσ; dt -> σ_next − σ.
    # 1. Work in float32 even for float16 latents: σ reaches ~15 and the update subtracts close numbers.
    x = sample.to(torch.float32)
    # 2. x̂_0 from the model output, as the model's prediction_type says.
    if prediction_type == "epsilon":
        x0 = x - sigma * model_output
    elif prediction_type == "v_prediction":
        # v was defined on the unit-scale latent x/√(σ²+1): x̂_0 = √ᾱ·(x/√(σ²+1)) − √(1−ᾱ)·v
        # with √ᾱ = 1/√(σ² + 1) and √(1 − ᾱ) = σ/√(σ² + 1).
        x0 = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)
    elif prediction_type == "sample":
        # the model predicted the clean sample itself: no conversion.
        x0 = model_output
    else:
        raise ValueError(f"unknown prediction_type {prediction_type!r}")
    # 3. The probability-flow ODE dx/dσ = (x − x̂_0)/σ, one Euler step of size σ_next − σ (< 0).
    d = (x - x0) / sigma
    dt = sigma_next - sigma
    x_next = x + d * dt
    # 4. Back to the model's dtype, as diffusers does.
    return x_next.to(model_output.dtype)
    # END SOLUTION
