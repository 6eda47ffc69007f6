"""Lab 15 · Karras and EDM

Concept:
    Karras et al. 2022 ("Elucidating the Design Space of Diffusion-Based Generative Models", EDM,
    arXiv 2206.00364) take every sampler apart into choices that can be made separately. Two of them
    reach far beyond their paper, and diffusers implements both:
    1. Which noise levels to visit. The ρ-ladder (eq. 5) spaces n noise levels evenly in σ^{1/ρ}:
           σ_i = (σ_max^{1/ρ} + i/(n − 1)·(σ_min^{1/ρ} − σ_max^{1/ρ}))^ρ,   i = 0 … n − 1,   then σ_n = 0
       ρ = 7 crowds the steps at low noise, where detail is decided. This is "Karras sigmas" in every
       Stable Diffusion front end (use_karras_sigmas=True) and EDMEulerScheduler's own ladder.
    2. What the network sees and predicts (table 1, "preconditioning"). With the data's standard
       deviation σ_data, the denoiser D(x; σ) wraps the raw network F:
           D(x; σ) = c_skip(σ)·x + c_out(σ)·F(c_in(σ)·x; c_noise(σ))
           c_skip = σ_data²/(σ² + σ_data²)     c_out = σ·σ_data/√(σ² + σ_data²)
           c_in   = 1/√(σ² + σ_data²)           c_noise = ¼·ln σ
       so F's input and its training target both have unit variance at every σ.
    The sampler is then Euler on the probability-flow ODE dx/dσ = (x − D(x; σ))/σ in the variance-
    exploding parametrisation x = x₀ + σ·ε (the same x as lab 03's Euler):
           x_next = x + (σ_next − σ)·(x − D(x; σ))/σ

Mental model:
    - One number per step: σ, from about 80 (EDM) or 14.6 (Stable Diffusion's table) down to 0.
    - A model trained on a discrete table (Stable Diffusion: t = 0 … 999) only knows its own σ_t. A
      Karras σ falls between two of them, so EulerDiscreteScheduler feeds the model a *fractional*
      timestep, interpolated linearly in log σ between the two table entries around it:
           t = j + (ln σ − ln σ_j)/(ln σ_{j+1} − ln σ_j),   σ_j ≤ σ < σ_{j+1}   (clamped to [0, T − 1])
      The ends of the ladder default to the ends of that table: σ_min = σ_0, σ_max = σ_{T−1}, with
      σ_t = √((1 − ᾱ_t)/ᾱ_t) (see `training_sigmas`). ρ is fixed at 7 there.
    - An EDM model (EDMEulerScheduler) is trained on continuous σ: it is fed c_noise = ¼·ln σ instead
      of a timestep, and its timesteps *are* those c_noise values.
    - One EDM denoising loop, in the names of this lab (`edm_sample` is its loop):
          sigmas = karras_sigmas(n, 0.002, 80.0, 7.0)             # (n + 1,), ends with 0
          x = sigmas[0] · randn(shape)                            # x = σ_0·ε
          for i in range(n):
              x_in, c_noise = edm_model_inputs(x, sigmas[i].expand(B), σ_data)
              F = net(x_in, c_noise[0])                           # one network call per step
              x = edm_euler_step(F, x, sigmas[i], sigmas[i + 1], σ_data, prediction_type)
    - With σ_data = 1, the preconditioning is lab 03's Euler: c_in = 1/√(σ² + 1) is its
      scale_model_input, and the v_prediction x̂₀ = x/(σ² + 1) − σ/√(σ² + 1)·v is its v formula.

Traps:
    - ρ goes on the interpolation, not on the ends: interpolate σ^{1/ρ} linearly, then raise to ρ.
      Interpolating σ^ρ and taking the ρ-th root puts nearly every step at high noise.
    - The ladder runs from σ_max *down* to σ_min (i = 0 is the noisiest step), and has n + 1 entries:
      the last step goes to σ = 0, the clean sample.
    - The ramp is i/(n − 1) (linspace(0, 1, n)), so σ_min is the last nonzero σ; i/n never reaches it.
    - σ → t is interpolated in log σ. Linear interpolation in σ, rounding to an integer timestep, or
      reading the table in the wrong direction (σ_t grows with t) all feed the model the wrong noise level.
      Outside the table t is clamped to 0 or T − 1: an index j left at −1 reads the table's last entry
      (Python wraps negative indices), and one at T − 1 has no entry T above it.
    - c_in = 1/σ or 1/√(σ² + 1) forgets σ_data; c_noise = σ or ln σ is not what an EDM model was trained
      to read (¼·ln σ).
    - c_skip and c_out swapped: at large σ the skip weight must vanish (the input is almost pure noise)
      and c_out → σ_data.
    - v_prediction flips the sign of c_out in EDMEulerScheduler; everything else is the same.

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names, compute as wide as
    you like; an answer at most 2× as far from exact float64 math as diffusers' own (+ 2 ulps) passes.
    diffusers builds both ladders in float64 and casts to float32; _sigma_to_t interpolates in float64
    on float32 log σ tables; precondition_inputs multiplies the sample by a 0-dim float32 c_in (float16
    samples stay float16); step upcasts the sample to float32, so x̂₀ is float32, but multiplies
    c_out·F in the model output's dtype, and casts the result back to it.

Say it out loud:
    "Karras sigmas are evenly spaced in σ^{1/7} from σ_max down to σ_min, then a 0. A model trained on
    a discrete table gets a fractional timestep, interpolated in log σ. An EDM model is preconditioned:
    it sees x/√(σ² + σ_data²) and ¼·ln σ, and its output is mixed back as
    D = σ_data²/(σ² + σ_data²)·x + σ·σ_data/√(σ² + σ_data²)·F. Euler then steps x + (σ_next − σ)·(x − D)/σ."

Graded against: diffusers EulerDiscreteScheduler(use_karras_sigmas=True).set_timesteps (sigmas and
timesteps) and set_timesteps(sigmas=…), EDMEulerScheduler (set_timesteps, precondition_inputs,
precondition_noise, precondition_outputs, step over whole runs with s_churn = 0, and the whole loop with
scale_model_input and an ideal network of Gaussian data), on fresh seeded inputs.
Run: python -m pytest katas/15_karras_edm.py
"""
import torch


# ---- Worked example --------------------------------------------------------------------------------
def training_sigmas(alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """The σ of each training timestep, in the variance-exploding parametrisation: σ_t = √((1 − ᾱ_t)/ᾱ_t).

    x_t/√ᾱ_t = x₀ + σ_t·ε: the same noisy sample, scaled so that the signal keeps weight 1. σ_t grows
    with t: Stable Diffusion's table runs from 0.0292 (t = 0) to 14.61 (t = 999).
    Args: alphas_cumprod (T,) float32.  Returns: (T,) float32, ascending in t.
    """
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


# ---- Your turn -------------------------------------------------------------------------------------
def karras_sigmas(
    num_inference_steps: int,
    sigma_min: float,
    sigma_max: float,
    rho: float = 7.0,
) -> torch.Tensor:
    """The Karras ρ-ladder (Karras et al. 2022, eq. 5), with the terminal σ = 0 appended.

        σ_i = (σ_max^{1/ρ} + i/(n − 1)·(σ_min^{1/ρ} − σ_max^{1/ρ}))^ρ,   i = 0 … n − 1;   σ_n = 0
    (n = 1: just [σ_max, 0]).

    Graded against: EulerDiscreteScheduler(use_karras_sigmas=True).set_timesteps(n).sigmas (ρ = 7, σ_min
    and σ_max the ends of its training table or its config) and EDMEulerScheduler(sigma_min, sigma_max,
    rho).set_timesteps(n).sigmas
    Args:
        num_inference_steps: n
        sigma_min:           the smallest nonzero σ of the ladder (EDM: 0.002)
        sigma_max:           the largest σ, where sampling starts (EDM: 80.0)
        rho:                 ρ (EDM: 7.0; 1.0 is a linear ladder)
    Returns: (n + 1,) float32, descending from σ_max to σ_min, then 0.
    """
    # BEGIN SOLUTION: interpolate σ^{1/ρ} linearly from σ_max down to σ_min, raise to ρ, append 0
    # Notation: n -> num_inference_steps; ramp -> i/(n − 1).
    # 1. The ramp i/(n − 1), in float64 as diffusers builds it (linspace(0, 1, n): [0] for n = 1).
    ramp = torch.linspace(0, 1, num_inference_steps, dtype=torch.float64)  # (n,)
    # 2. The ends in σ^{1/ρ}, where the ladder is evenly spaced.
    min_inv_rho = sigma_min ** (1 / rho)
    max_inv_rho = sigma_max ** (1 / rho)
    # 3. Back to σ: raise the evenly spaced values to ρ; cast once to float32.
    sigmas = ((max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho).to(torch.float32)  # (n,)
    # 4. The terminal σ = 0: the last step lands on the clean sample.
    return torch.cat([sigmas, sigmas.new_zeros(1)])
    # END SOLUTION


def sigma_to_t(sigmas: torch.Tensor, train_sigmas: torch.Tensor) -> torch.Tensor:
    """The fractional timestep of each σ: linear interpolation in log σ over the training table.

    train_sigmas[j] is the σ of training timestep j (ascending in j). For σ_j ≤ σ < σ_{j+1}:
        t = j + (ln σ − ln σ_j)/(ln σ_{j+1} − ln σ_j)
    clamped to [0, T − 1]: a σ below the table gives t = 0, one above it t = T − 1.

    Graded against: EulerDiscreteScheduler(use_karras_sigmas=True).set_timesteps(n).timesteps (from its
    own σs) and EulerDiscreteScheduler.set_timesteps(sigmas=…).timesteps (any σs, in and out of the table)
    Args:
        sigmas:       (n,) float32, the σs to convert (positive)
        train_sigmas: (T,) float32, the training table's σs, ascending (`training_sigmas`)
    Returns: (n,) float32 fractional timesteps.
    """
    # BEGIN SOLUTION: locate each log σ between two table entries, interpolate the index, clamp
    # 1. Work in log σ, in float64 (the table's log σ is ascending, as its σ is).
    log_table = train_sigmas.to(torch.float64).log()  # (T,)
    log_sigma = sigmas.to(torch.float64).log()  # (n,)
    T = log_table.shape[0]
    # 2. The entry at or below each σ: j = (how many table entries are ≤ σ) − 1, kept in [0, T − 2]
    #    so that j + 1 is an entry too.
    low = (torch.searchsorted(log_table, log_sigma, right=True) - 1).clamp(0, T - 2)  # (n,)
    high = low + 1
    # 3. How far between the two entries, in log σ; outside the table w is clamped to 0 or 1.
    w = ((log_sigma - log_table[low]) / (log_table[high] - log_table[low])).clamp(0, 1)
    # 4. The same fraction of the way from index j to j + 1.
    return (low + w).to(torch.float32)
    # END SOLUTION


def edm_model_inputs(
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_data: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an EDM network is fed: the scaled sample c_in·x and the noise label c_noise.

        c_in = 1/√(σ² + σ_data²)        c_noise = ¼·ln σ
    One σ per sample.

    Graded against: EDMEulerScheduler(sigma_data=…).precondition_inputs(sample, σ) (each sample with its
    own 0-dim σ, as scale_model_input calls it) and .precondition_noise(σ)
    Args:
        sample:     (B, C, H, W) the noisy sample x, float32 or float16
        sigma:      (B,) float32, each sample's σ > 0
        sigma_data: σ_data, the data's standard deviation (EDM: 0.5)
    Returns: (c_in·x of shape (B, C, H, W), dtype of sample;  c_noise of shape (B,), float32).
    """
    # BEGIN SOLUTION: c_in from σ and σ_data, broadcast per sample; c_noise = ¼·ln σ
    # 1. c_in in float64, one per sample, shaped (B, 1, 1, 1) to broadcast over (C, H, W).
    s = sigma.to(torch.float64)
    c_in = (1 / (s**2 + sigma_data**2) ** 0.5).reshape(-1, *([1] * (sample.dim() - 1)))
    # 2. Scale, and return the sample's dtype (a float16 network takes float16 inputs).
    scaled = (sample.to(torch.float64) * c_in).to(sample.dtype)
    # 3. The noise label: a quarter of the natural log of σ.
    c_noise = (0.25 * s.log()).to(torch.float32)
    return scaled, c_noise
    # END SOLUTION


def edm_denoised(
    sample: torch.Tensor,
    model_output: torch.Tensor,
    sigma: torch.Tensor,
    sigma_data: float = 0.5,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """The EDM denoiser's output D = c_skip·x + c_out·F (x̂₀), one σ per sample.

        c_skip = σ_data²/(σ² + σ_data²)
        c_out  = σ·σ_data/√(σ² + σ_data²)      ("epsilon"; "v_prediction": −σ·σ_data/√(σ² + σ_data²))

    Graded against: EDMEulerScheduler(sigma_data=…, prediction_type=…).precondition_outputs(sample, F, σ),
    called as step calls it (the sample upcast to float32, each sample with its own 0-dim σ)
    Args:
        sample:          (B, C, H, W) the noisy sample x, float32 or float16
        model_output:    (B, C, H, W) the raw network output F, dtype of sample
        sigma:           (B,) float32, each sample's σ > 0
        sigma_data:      σ_data (EDM: 0.5)
        prediction_type: "epsilon" or "v_prediction"
    Returns: (B, C, H, W) x̂₀, float32.
    """
    # BEGIN SOLUTION: c_skip and c_out from σ and σ_data (c_out's sign from the prediction type), mix
    # 1. The coefficients in float64, one per sample, shaped (B, 1, 1, 1).
    s = sigma.to(torch.float64).reshape(-1, *([1] * (sample.dim() - 1)))
    c_skip = sigma_data**2 / (s**2 + sigma_data**2)
    c_out = s * sigma_data / (s**2 + sigma_data**2) ** 0.5
    if prediction_type == "v_prediction":
        c_out = -c_out
    elif prediction_type != "epsilon":
        raise ValueError(f"unknown prediction_type {prediction_type!r}")
    # 2. Skip connection plus scaled network output, cast once to float32.
    denoised = c_skip * sample.to(torch.float64) + c_out * model_output.to(torch.float64)
    return denoised.to(torch.float32)
    # END SOLUTION


def edm_euler_step(
    model_output: torch.Tensor,
    sample: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    sigma_data: float = 0.5,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """One Euler step of the EDM probability-flow ODE, from σ to σ_next (EDMEulerScheduler, s_churn = 0).

        D = c_skip·x + c_out·F   (as in `edm_denoised`, which takes one σ per sample: σ.expand(B))
        d = (x − D)/σ            (dx/dσ)
        x_next = x + (σ_next − σ)·d

    Graded against: EDMEulerScheduler(sigma_min, sigma_max, rho, sigma_data, prediction_type).step(F, t, x)
    .prev_sample, at every step of whole sampling runs
    Args:
        model_output:    (B, C, H, W) the raw network output F, float32 or float16
        sample:          (B, C, H, W) the current sample x, dtype of model_output
        sigma:           () float32, σ_i (a 0-dim tensor, as scheduler.sigmas[i])
        sigma_next:      () float32, σ_{i+1} (0 at the last step)
        sigma_data:      σ_data (EDM: 0.5)
        prediction_type: "epsilon" or "v_prediction"
    Returns: (B, C, H, W) x_next, dtype of model_output.
    """
    # BEGIN SOLUTION: x̂₀ from the preconditioned output, the ODE slope (x − x̂₀)/σ, one Euler step
    # 1. x̂₀, with σ repeated for every sample of the batch.
    batch = sample.shape[0]
    denoised = edm_denoised(sample, model_output, sigma.reshape(1).expand(batch), sigma_data, prediction_type)
    # 2. The slope dx/dσ and the step, in float64 (the step size σ_next − σ is negative).
    x = sample.to(torch.float64)
    s, s_next = sigma.to(torch.float64), sigma_next.to(torch.float64)
    derivative = (x - denoised.to(torch.float64)) / s
    x_next = x + (s_next - s) * derivative
    # 3. Back to the model's dtype.
    return x_next.to(model_output.dtype)
    # END SOLUTION


def edm_sample(
    network,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    sigma_data: float = 0.5,
    prediction_type: str = "epsilon",
) -> torch.Tensor:
    """A whole EDM sampling run: precondition, call the network once per step, take the Euler step.

    For i = 0 … n − 1:
        x_in, c_noise = c_in(σ_i)·x, ¼·ln σ_i        (`edm_model_inputs`)
        F = network(x_in, c_noise)                   (c_noise: a 0-dim float32 tensor)
        x = edm_euler_step(F, x, σ_i, σ_{i+1}, …)
    and the last step lands on σ_n = 0.

    Graded against: the loop an EDM pipeline runs with EDMEulerScheduler (scale_model_input, the network
    called with scheduler.timesteps[i], which are the c_noise values, then step), on a network that is the
    ideal denoiser of Gaussian data; it counts its calls.
    Args:
        network:         callable (x_in (B, C, H, W) in the sample's dtype, c_noise () float32) -> F, same
                         shape and dtype as x_in
        sample:          (B, C, H, W) the starting sample at σ_0 = sigmas[0] (x = σ_0·ε), float32 or float16
        sigmas:          (n + 1,) float32, the ladder (`karras_sigmas`), ending with 0
        sigma_data:      σ_data (EDM: 0.5)
        prediction_type: "epsilon" or "v_prediction"
    Returns: (B, C, H, W) the final sample at σ = 0, dtype of sample.
    """
    # BEGIN SOLUTION: per rung: scale the input and the noise label, call the network once, take one Euler step
    x, batch = sample, sample.shape[0]
    for i in range(len(sigmas) - 1):
        # 1. What the network sees at σ_i: the scaled sample and its noise label (one σ for the batch).
        x_in, c_noise = edm_model_inputs(x, sigmas[i].reshape(1).expand(batch), sigma_data)
        # 2. One network call per step.
        model_output = network(x_in, c_noise[0])
        # 3. The Euler step to σ_{i+1}, back in the sample's dtype.
        x = edm_euler_step(model_output, x, sigmas[i], sigmas[i + 1], sigma_data, prediction_type)
    return x
    # END SOLUTION
