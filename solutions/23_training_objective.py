"""Lab 23 · The training objective

Concept:
    Everything a sampler does was fixed at training time: the model learned to predict one target from
    a noisy input, at timesteps drawn from one distribution, with a loss weighted per timestep. One
    training step of a denoiser (DDPM, Ho et al. 2020, Algorithm 1) is
        ε ~ N(0, I),  t ~ p(t),  x_t = √ᾱ_t·x₀ + √(1 − ᾱ_t)·ε,   loss = w(t)·‖model(x_t, t) − target‖²
    and of a rectified-flow transformer (SD3, Esser et al. 2024, §3)
        ε ~ N(0, I),  σ ~ p(σ),  x_σ = (1 − σ)·x₀ + σ·ε,          loss = w(σ)·‖model(x_σ, σ·T) − (ε − x₀)‖².
    The target is what the prediction type names: ε ("epsilon"), v = √ᾱ·ε − √(1 − ᾱ)·x₀
    ("v_prediction", Salimans & Ho 2022), x₀ itself ("sample"), or the flow's velocity ε − x₀. You will
    write the targets, Min-SNR-γ weighting (Hang et al. 2023), SD3's timestep densities and loss
    weightings, and both training steps' losses exactly as diffusers' training scripts compute them
    (examples/text_to_image/train_text_to_image.py, examples/dreambooth/train_dreambooth_sd3.py).

Mental model:
    - SNR(t) = ᾱ_t / (1 − ᾱ_t): signal power over noise power. It falls from ~10⁴ at t = 0 to ~0 at T − 1.
    - Uniform t with a plain MSE on ε over-trains the easy, nearly clean timesteps. Min-SNR-γ clips the
      weight at γ (the paper's 5): on x₀ the weight is min(SNR, γ); an ε error is an x₀ error times
      √SNR, so on ε the same weight reads min(SNR, γ)/SNR; on v, min(SNR, γ)/(SNR + 1).
    - SD3 shapes the same trade-off two ways, chosen by one `weighting_scheme` string:
        density (which σs are drawn):  "logit_normal": u = sigmoid(N(m, s));  "mode": u = 1 − u₀ −
            scale·(cos²(π·u₀/2) − 1 + u₀), u₀ uniform;  anything else: u uniform in [0, 1);
        weighting (how each σ's loss counts): "sigma_sqrt": σ⁻²;  "cosmap": 2 / (π·(1 − 2σ + 2σ²));
            anything else: 1.
      The drawn u picks an index into the scheduler's training ladder, i = ⌊u·T⌋, and the timestep
      and σ are the ladder's at i: with shift = 3 (SD3) that σ is not u.
    - The loss is a mean of per-sample means: the squared error averaged over each sample's elements,
      multiplied by that sample's weight, then averaged over the batch.
    - Every random number comes from one generator, in the scripts' order: the noise first (and the
      offset noise, when asked), then the timesteps (or u).

Traps:
    - The target of another prediction type: ε for a v model (or v for an ε model) trains a model the
      sampler will misread at every step.
    - Min-SNR weights without the prediction-type correction: min(SNR, γ) is the weight on an x₀ error;
      an ε error is √SNR times an x₀ error, so on ε the weight is min(SNR, γ)/SNR. Left uncorrected, a
      nearly clean timestep (SNR ~10⁴) counts ten thousand times too much.
    - v_prediction divides by SNR + 1, not by SNR: v = √ᾱ·ε − √(1 − ᾱ)·x₀ mixes both errors.
    - "sigma_sqrt" is σ⁻² (the weight of the σ-scaled loss), not √σ and not 1/√σ.
    - The timestep of a flow step is looked up, not computed: timesteps[⌊u·T⌋] and sigmas[⌊u·T⌋] of
      the shifted training ladder, not u·T and σ = u.
    - Noise and timesteps drawn from the wrong generator, in the wrong order, or the offset noise drawn
      at full size: the offset is one number per sample and channel, shape (B, C, 1, 1).
    - The mean taken over the wrong axes: weighting the batch's overall mean by the mean weight
      (mean(w)·mean(err²)) is not the mean of the weighted per-sample means.
    - Preconditioned outputs (precondition_outputs): the model's output becomes x̂₀ = x_σ − σ·out and the
      target becomes x₀; mixing the two halves (x̂₀ against ε − x₀) trains nothing sensible.

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names, and compute as
    wide as you like; the graders measure your error against exact float64 math (the same draws, a
    float64 copy of the same model) and accept anything about as close to it as diffusers' own answer.
    The scripts take every loss in float32 (model_pred.float(), target.float()); get_velocity rounds ᾱ
    to the latents' dtype before its square roots (float16 latents: ᾱ in float16), and compute_snr reads
    ᾱ in float32. Matching those roundings is optional: computing wider and casting once passes too.

Say it out loud:
    "A training step draws noise, then a timestep per sample, noises the clean latent there and asks the
    model for the target its prediction type names: ε, v, x₀, or the flow's ε − x₀. The loss is each
    sample's mean squared error times its weight, averaged over the batch: Min-SNR clips the x₀ weight at
    γ and divides by SNR for ε or SNR + 1 for v; SD3 draws σ from a logit-normal or mode density and
    weights by σ⁻² or cosmap, one scheme string choosing both."

Graded against: diffusers.training_utils (compute_snr, compute_density_for_timestep_sampling,
compute_loss_weighting_for_sd3), DDPMScheduler.get_velocity, FlowMatchEulerDiscreteScheduler's training
ladder, and the loss lines of train_text_to_image.py and train_dreambooth_sd3.py reproduced on a tiny
UNet2DConditionModel and a tiny SD3Transformer2DModel, on fresh seeded inputs. Refused while your code
runs: get_velocity in training_target, and the density and weighting of training_utils in their functions
and in flow_matching_loss. The losses may use scheduler.add_noise, get_velocity, compute_snr and your own
functions above.
Run: python -m pytest katas/23_training_objective.py
"""
import math

import torch


# ---- Worked example --------------------------------------------------------------------------------
def snr(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
    """SNR(t) = ᾱ_t / (1 − ᾱ_t) per sample, as diffusers.training_utils.compute_snr reads it:
    (√ᾱ_t / √(1 − ᾱ_t))², in float32.

    Args: alphas_cumprod (T,) float32; timesteps (B,) int64.  Returns: (B,) float32.
    """
    alpha = alphas_cumprod[timesteps].float() ** 0.5
    sigma = (1.0 - alphas_cumprod[timesteps].float()) ** 0.5
    return (alpha / sigma) ** 2


# ---- Your turn: what the model learns ---------------------------------------------------------------
def training_target(
    prediction_type: str,
    x0: torch.Tensor,
    noise: torch.Tensor,
    alphas_cumprod: torch.Tensor,
    timesteps: torch.Tensor,
) -> torch.Tensor:
    """The regression target of one training step, for each prediction type.

        "epsilon":       ε
        "v_prediction":  v = √ᾱ_t·ε − √(1 − ᾱ_t)·x₀       (one ᾱ_t per sample, broadcast)
        "sample":        x₀
        "flow":          ε − x₀                              (rectified flow: SD3, Flux)

    Graded against: the training scripts' target: noise, DDPMScheduler.get_velocity(x0, noise, t), x0,
    and train_dreambooth_sd3.py's noise − model_input
    Args:
        prediction_type: one of the four above
        x0:              (B, C, H, W) clean latents, float32 or float16
        noise:           ε, same shape and dtype
        alphas_cumprod:  (T,) float32 (unused by "epsilon", "sample" and "flow")
        timesteps:       (B,) int64 (the same)
    Returns: (B, C, H, W), dtype of x0.
    """
    # BEGIN SOLUTION: ε, x₀ or ε − x₀ as they are; v from the per-sample √ᾱ and √(1 − ᾱ), broadcast
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "sample":
        return x0
    if prediction_type == "flow":
        # The flow's velocity dx_σ/dσ for x_σ = (1 − σ)·x₀ + σ·ε: constant along the line.
        return noise - x0
    if prediction_type != "v_prediction":
        raise ValueError(f"unknown prediction_type {prediction_type!r}")
    # 1. One ᾱ per sample, in float32 (wider than float16 latents), shaped (B, 1, 1, 1).
    a = alphas_cumprod[timesteps].to(torch.float32).reshape(-1, *([1] * (x0.dim() - 1)))
    # 2. v = √ᾱ·ε − √(1 − ᾱ)·x₀, cast back once.
    v = a.sqrt() * noise.to(torch.float32) - (1 - a).sqrt() * x0.to(torch.float32)
    return v.to(x0.dtype)
    # END SOLUTION


def min_snr_weights(snr: torch.Tensor, snr_gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-γ loss weights (Hang et al. 2023, §3.4 and §4.2), one per sample.

        on x₀ ("sample"):      w = min(SNR, γ)
        on ε ("epsilon"):      w = min(SNR, γ) / SNR
        on v ("v_prediction"): w = min(SNR, γ) / (SNR + 1)

    Graded against: train_text_to_image.py's mse_loss_weights on compute_snr's SNR
    Args:
        snr:             (B,) float32, SNR(t) per sample (≥ 0; 0 at a zero-terminal-SNR last step, with v)
        snr_gamma:       γ > 0 (the paper: 5.0)
        prediction_type: "epsilon", "v_prediction" or "sample"
    Returns: (B,) float32.
    """
    # BEGIN SOLUTION: clip the SNR at γ, then divide by what the prediction type's error is scaled by
    clipped = torch.minimum(snr, torch.full_like(snr, snr_gamma))
    if prediction_type == "epsilon":
        # An ε error is an x₀ error times √SNR: its squared error carries an extra SNR.
        return clipped / snr
    if prediction_type == "v_prediction":
        # A v error is an x₀ error times √(SNR + 1).
        return clipped / (snr + 1)
    return clipped
    # END SOLUTION


def ddpm_training_loss(
    unet,
    scheduler,
    latents: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    generator: torch.Generator,
    snr_gamma: float | None = None,
    noise_offset: float = 0.0,
) -> torch.Tensor:
    """One training step's loss of a text-conditioned UNet, as train_text_to_image.py computes it.

    1. ε = randn(latents.shape) from `generator`, in the latents' dtype; with noise_offset > 0, add
       noise_offset · randn((B, C, 1, 1)) drawn next from the same generator.
    2. t = randint(0, T, (B,)) from `generator` (T = scheduler.config.num_train_timesteps).
    3. x_t = scheduler.add_noise(latents, ε, t); the target of scheduler.config.prediction_type (yours to
       compute: scheduler.add_noise and get_velocity, and your training_target, are all allowed here).
    4. pred = unet(x_t, t, encoder_hidden_states).sample.
    5. No snr_gamma: mean((pred − target)²) in float32. With snr_gamma: each sample's mean squared
       error times its Min-SNR-γ weight (SNR from the scheduler's ᾱ), averaged over the batch.

    Graded against: train_text_to_image.py's loss, reproduced with DDPMScheduler, compute_snr and the
    same draws; `generator` must be left where the script's draws leave it.
    Args:
        unet:                  a UNet2DConditionModel (tiny; its calls are counted)
        scheduler:             a DDPMScheduler (its config holds prediction_type and T)
        latents:               (B, C, H, W) x₀, float32
        encoder_hidden_states: (B, tokens, D) the text embeddings
        generator:             the torch.Generator every draw comes from
        snr_gamma:             None (plain MSE) or γ
        noise_offset:          0.0, or the offset noise's scale (e.g. 0.1)
    Returns: () float32, the loss.
    """
    # BEGIN SOLUTION: draw ε (and the offset), then t; noise, predict, compare with the target; weight per sample
    B = latents.shape[0]
    T = scheduler.config.num_train_timesteps
    kind = scheduler.config.prediction_type
    # 1. The draws, in the script's order.
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype)
    if noise_offset:
        # One offset per sample and channel: it shifts each channel's mean (brighter or darker images).
        noise = noise + noise_offset * torch.randn((B, latents.shape[1], 1, 1), generator=generator,
                                                   dtype=latents.dtype)
    timesteps = torch.randint(0, T, (B,), generator=generator).long()
    # 2. The forward process and the target.
    alphas_cumprod = scheduler.alphas_cumprod
    noisy = scheduler.add_noise(latents, noise, timesteps)
    target = training_target(kind, latents, noise, alphas_cumprod, timesteps)
    # 3. The model's prediction.
    pred = unet(noisy, timesteps, encoder_hidden_states).sample
    err = (pred.float() - target.float()) ** 2
    if snr_gamma is None:
        return err.mean()
    # 4. Per-sample means, weighted, then the batch mean.
    weights = min_snr_weights(snr(alphas_cumprod, timesteps), snr_gamma, kind)
    return (err.mean(dim=list(range(1, err.dim()))) * weights).mean()
    # END SOLUTION


# ---- Your turn: rectified flow, as SD3 trains it ----------------------------------------------------
def timestep_density(
    weighting_scheme: str,
    batch_size: int,
    generator: torch.Generator,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> torch.Tensor:
    """u ∈ (0, 1) per sample, the point of the training ladder a flow step trains at (SD3, §3.1).

        "logit_normal": u = sigmoid(n),  n ~ N(logit_mean, logit_std²)
        "mode":         u = 1 − u₀ − mode_scale·(cos²(π·u₀/2) − 1 + u₀),  u₀ ~ U[0, 1)
        anything else:  u = u₀ ~ U[0, 1)
    One draw of batch_size numbers from `generator` (torch.normal or torch.rand).

    Graded against: diffusers.training_utils.compute_density_for_timestep_sampling(..., generator=...)
    Returns: (batch_size,) float32.
    """
    # BEGIN SOLUTION: one draw of batch_size numbers, then the scheme's map onto (0, 1)
    if weighting_scheme == "logit_normal":
        n = torch.normal(mean=logit_mean, std=logit_std, size=(batch_size,), generator=generator)
        return torch.sigmoid(n)
    u = torch.rand((batch_size,), generator=generator)
    if weighting_scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u
    # END SOLUTION


def sd3_loss_weighting(weighting_scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    """The per-σ loss weight of SD3's training script.

        "sigma_sqrt": σ⁻²   (returned as float32)
        "cosmap":     2 / (π·(1 − 2σ + 2σ²))
        anything else: 1
    Graded against: diffusers.training_utils.compute_loss_weighting_for_sd3
    Args: sigmas (B, 1, 1, 1) in (0, 1], float32 or float16.
    Returns: the shape of sigmas; float32 for "sigma_sqrt", the dtype of sigmas otherwise.
    """
    # BEGIN SOLUTION: σ⁻² in float32, cosmap's 2/(π·bot), or ones
    if weighting_scheme == "sigma_sqrt":
        return sigmas.float() ** -2.0
    if weighting_scheme == "cosmap":
        bot = 1 - 2 * sigmas.float() + 2 * sigmas.float() ** 2
        return (2 / (math.pi * bot)).to(sigmas.dtype)
    return torch.ones_like(sigmas)
    # END SOLUTION


def flow_matching_loss(
    transformer,
    scheduler,
    latents: torch.Tensor,
    prompt_embeds: torch.Tensor,
    pooled_prompt_embeds: torch.Tensor,
    generator: torch.Generator,
    weighting_scheme: str = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    precondition_outputs: bool = False,
) -> torch.Tensor:
    """One training step's loss of an SD3 transformer, as train_dreambooth_sd3.py computes it.

    1. ε = randn(latents.shape) from `generator`; then u = timestep_density(weighting_scheme, B, ...)
       from the same generator.
    2. i = ⌊u·T⌋; t = scheduler.timesteps[i], σ = scheduler.sigmas[i] (the training ladder, shifted),
       σ shaped (B, 1, 1, 1) in the latents' dtype.
    3. x_σ = (1 − σ)·x₀ + σ·ε;  pred = transformer(hidden_states=x_σ, timestep=t,
       encoder_hidden_states=prompt_embeds, pooled_projections=pooled_prompt_embeds).sample.
    4. precondition_outputs: pred ← pred·(−σ) + x_σ and target x₀; else target ε − x₀.
    5. loss = mean over the batch of the per-sample mean of w(σ)·(pred − target)² (w: sd3_loss_weighting),
       in float32.

    Graded against: train_dreambooth_sd3.py's loss, reproduced with a FlowMatchEulerDiscreteScheduler
    (training ladder), compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3 and the same
    draws; `generator` must be left where the script's draws leave it.
    Args:
        transformer:          an SD3Transformer2DModel (tiny; its calls are counted)
        scheduler:            a FlowMatchEulerDiscreteScheduler, set_timesteps never called
        latents:              (B, C, H, W) x₀, float32
        prompt_embeds:        (B, tokens, D);  pooled_prompt_embeds: (B, P)
        generator:            the torch.Generator every draw comes from
        weighting_scheme, logit_mean, logit_std, mode_scale: as in timestep_density / sd3_loss_weighting
        precondition_outputs: whether the model's output is preconditioned to x̂₀ (EDM, §5)
    Returns: () float32, the loss.
    """
    # BEGIN SOLUTION: draw ε then u; look t and σ up on the ladder; noise linearly; target; weighted mean
    B = latents.shape[0]
    T = scheduler.config.num_train_timesteps
    # 1. The draws, in the script's order.
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype)
    u = timestep_density(weighting_scheme, B, generator, logit_mean, logit_std, mode_scale)
    # 2. The ladder's timestep and σ at ⌊u·T⌋ (shifted: with shift 3, σ is not u).
    index = (u * T).long()
    timesteps = scheduler.timesteps[index]
    sigmas = scheduler.sigmas[index].to(latents.dtype).reshape(-1, *([1] * (latents.dim() - 1)))
    # 3. The straight line from x₀ to ε, and the model's output there.
    noisy = (1.0 - sigmas) * latents + sigmas * noise
    pred = transformer(hidden_states=noisy, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                       pooled_projections=pooled_prompt_embeds).sample
    # 4. Preconditioned: the output read as x̂₀ = x_σ − σ·v, compared with x₀.
    if precondition_outputs:
        pred = pred * (-sigmas) + noisy
        target = latents
    else:
        target = training_target("flow", latents, noise, None, None)
    # 5. Weighted squared error, per-sample means, batch mean.
    weighting = sd3_loss_weighting(weighting_scheme, sigmas)
    err = (weighting.float() * (pred.float() - target.float()) ** 2).reshape(B, -1)
    return err.mean(dim=1).mean()
    # END SOLUTION
