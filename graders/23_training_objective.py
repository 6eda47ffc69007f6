"""Grader for lab 23 · The training objective: targets, Min-SNR-γ, SD3's densities and weightings, two losses.

References. The targets, the SNR and SD3's density and weighting are diffusers' own (DDPMScheduler.get_velocity,
diffusers.training_utils). The two losses are the loss lines of diffusers' training scripts
(examples/text_to_image/train_text_to_image.py, examples/dreambooth/train_dreambooth_sd3.py), which are not
part of the library: `script_ddpm_loss` and `script_flow_loss` below reproduce them line for line on the
library's own pieces (scheduler.add_noise, get_velocity, compute_snr, F.mse_loss; the FlowMatchEulerDiscrete
training ladder, compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3), with every draw taken
from the generator the learner gets (the scripts draw from the global RNG; the order is theirs). The models
are a tiny UNet2DConditionModel and a tiny SD3Transformer2DModel (engine/tiny.py), called through a counting
probe that runs in this process.

diffusers.training_utils imports the pipelines package (~4 s): it is imported when a check or trap first
needs it, never at collection.

Precision: every float check carries its float64 shadow (Scenario.exact): the same formula on the same
inputs in float64, and for the losses the same draws through a float64 copy of the same model. diffusers'
get_velocity rounds ᾱ to the latents' dtype before its square roots; compute_loss_weighting_for_sd3 computes
cosmap in σ's dtype. An answer about as close to exact math as diffusers' own passes, so computing wider and
casting once is right everywhere. float16 σs below 0.005 are not drawn for "sigma_sqrt": σ⁻² would overflow
float16 (diffusers' own answer is then inf).
"""
import copy
import functools
import math

import torch
import torch.nn.functional as F
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import MODEL_FORWARD, STEP_MATH
from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import DTYPES, DenoiserProbe, seed_from

DDPM = "diffusers.schedulers.scheduling_ddpm.DDPMScheduler"
TRAINING_UTILS = "diffusers.training_utils"
DENSITY = f"{TRAINING_UTILS}.compute_density_for_timestep_sampling"
WEIGHTING = f"{TRAINING_UTILS}.compute_loss_weighting_for_sd3"


def training_utils():
    from diffusers import training_utils as module

    return module


def ddpm(schedule: str = "scaled_linear", T: int = 1000, prediction_type: str = "epsilon") -> DDPMScheduler:
    """SD's training schedule ("scaled_linear"), DDPM's ("linear"), or SD's rescaled to zero terminal SNR."""
    if schedule == "linear":
        return DDPMScheduler(num_train_timesteps=T, beta_schedule="linear", prediction_type=prediction_type)
    return DDPMScheduler(num_train_timesteps=T, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                         prediction_type=prediction_type, rescale_betas_zero_snr=schedule == "zero_snr")


def _per_sample(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return values.reshape(-1, *([1] * (like.dim() - 1)))


def _timesteps(case: dict, T: int, g: torch.Generator) -> torch.Tensor:
    t = torch.randint(0, T, (case["batch"],), generator=g)
    if case.get("last"):  # the last training step: SNR 0 on a zero-terminal-SNR schedule
        t[0] = T - 1
    return t


# ---- training_target ------------------------------------------------------------------------------------
training_target = Kata(
    "training_target",
    hints=(
        "Each prediction type names what the model's output should equal: the noise, the velocity, the clean "
        "sample, or (rectified flow) the velocity of the straight line from x₀ to ε.",
        "epsilon: ε;  sample: x₀;  flow: ε − x₀;  v_prediction: √ᾱ_t·ε − √(1 − ᾱ_t)·x₀ with one ᾱ_t per sample, "
        "shaped (B, 1, 1, 1).",
        "a = alphas_cumprod[timesteps].float().reshape(-1, 1, 1, 1); "
        "return (a.sqrt() * noise.float() - (1 - a).sqrt() * x0.float()).to(x0.dtype)",
    ),
    answer_key=(f"{DDPM}.get_velocity",),
)

TARGET_CASES = [
    dict(prediction_type="epsilon", batch=3, dtype="float32"),
    dict(prediction_type="v_prediction", batch=4, dtype="float32"),
    dict(prediction_type="v_prediction", batch=3, dtype="float16"),
    dict(prediction_type="v_prediction", batch=4, dtype="float32", schedule="linear", T=500),
    dict(prediction_type="v_prediction", batch=3, dtype="float32", schedule="zero_snr", last=True),
    dict(prediction_type="sample", batch=3, dtype="float16"),
    dict(prediction_type="flow", batch=3, dtype="float32"),
    dict(prediction_type="flow", batch=2, dtype="float16"),
]


def exact_target(kind: str, x0, noise, alphas_cumprod, timesteps):
    x0, noise = x0.double(), noise.double()
    if kind == "epsilon":
        return noise
    if kind == "sample":
        return x0
    if kind == "flow":
        return noise - x0
    a = _per_sample(alphas_cumprod.double()[timesteps], x0)
    return a.sqrt() * noise - (1 - a).sqrt() * x0


@training_target.check("vs the training scripts' target (get_velocity for v)", cases=TARGET_CASES, tol=STEP_MATH)
def _(case, g):
    kind, dtype, T = case["prediction_type"], DTYPES[case["dtype"]], case.get("T", 1000)
    s = ddpm(case.get("schedule", "scaled_linear"), T, "v_prediction" if kind == "v_prediction" else "epsilon")
    x0 = torch.randn((case["batch"], 4, 8, 8), generator=g).to(dtype)
    noise = torch.randn(x0.shape, generator=g).to(dtype)
    t = _timesteps(case, T, g)
    if kind == "v_prediction":
        expected = s.get_velocity(x0.clone(), noise.clone(), t.clone())
    elif kind == "flow":
        expected = noise - x0  # train_dreambooth_sd3.py: target = noise - model_input
    else:
        expected = (noise if kind == "epsilon" else x0).clone()
    return Scenario(inputs=dict(prediction_type=kind, x0=x0, noise=noise, alphas_cumprod=s.alphas_cumprod.clone(),
                                timesteps=t),
                    expected=expected, exact=exact_target(kind, x0, noise, s.alphas_cumprod, t),
                    label=f"{kind}, timesteps {t.tolist()}")


def _target(kind, x0, noise, alphas_cumprod, timesteps, v):
    if kind == "epsilon":
        return noise
    if kind == "sample":
        return x0
    if kind == "flow":
        return noise - x0
    a = _per_sample(alphas_cumprod.float()[timesteps], x0)
    return v(a, noise.float(), x0.float()).to(x0.dtype)


@training_target.trap("ᾱ broadcast over the channels (view(1, -1, 1, 1)), not over the batch",
                      hint="One ᾱ_t per sample: shape it (B, 1, 1, 1) so it multiplies sample b's whole latent. Shaped "
                           "(1, B, 1, 1) it multiplies channel b of every sample (it runs only where B = C).")
def _(prediction_type, x0, noise, alphas_cumprod, timesteps):
    if prediction_type != "v_prediction" or x0.shape[0] != x0.shape[1]:
        return _target(prediction_type, x0, noise, alphas_cumprod, timesteps,
                       lambda a, e, x: a.sqrt() * e - (1 - a).sqrt() * x)
    a = alphas_cumprod.float()[timesteps].view(1, -1, 1, 1)
    return (a.sqrt() * noise.float() - (1 - a).sqrt() * x0.float()).to(x0.dtype)


@training_target.trap("ε returned whatever the prediction type (the target of another prediction type)",
                      hint="The target is what the model is asked to predict: ε only for 'epsilon'; v = √ᾱ·ε − "
                           "√(1 − ᾱ)·x₀ for 'v_prediction', x₀ for 'sample', ε − x₀ for 'flow'.")
def _(prediction_type, x0, noise, alphas_cumprod, timesteps):
    return noise


@training_target.trap("v with the sign flipped: √(1 − ᾱ)·x₀ − √ᾱ·ε",
                      hint="v = √ᾱ_t·ε − √(1 − ᾱ_t)·x₀: the noise term is positive (near t = 0, where ᾱ → 1, v → +ε).")
def _(prediction_type, x0, noise, alphas_cumprod, timesteps):
    return _target(prediction_type, x0, noise, alphas_cumprod, timesteps,
                   lambda a, e, x: (1 - a).sqrt() * x - a.sqrt() * e)


@training_target.trap("v with x₀ and ε swapped: √ᾱ·x₀ − √(1 − ᾱ)·ε",
                      hint="√ᾱ_t goes with ε and √(1 − ᾱ_t) with x₀ in v (the rotation of add_noise's pair).")
def _(prediction_type, x0, noise, alphas_cumprod, timesteps):
    return _target(prediction_type, x0, noise, alphas_cumprod, timesteps,
                   lambda a, e, x: a.sqrt() * x - (1 - a).sqrt() * e)


@training_target.trap("v with the coefficients swapped: √(1 − ᾱ)·ε − √ᾱ·x₀",
                      hint="√ᾱ_t weighs ε and √(1 − ᾱ_t) weighs x₀: near t = 0 (ᾱ → 1) v is ε, near t = T "
                           "(ᾱ → 0) it is −x₀. v = √ᾱ_t·ε − √(1 − ᾱ_t)·x₀.")
def _(prediction_type, x0, noise, alphas_cumprod, timesteps):
    return _target(prediction_type, x0, noise, alphas_cumprod, timesteps,
                   lambda a, e, x: (1 - a).sqrt() * e - a.sqrt() * x)


@training_target.trap("v without the square roots: ᾱ·ε − (1 − ᾱ)·x₀",
                      hint="The coefficients are √ᾱ_t and √(1 − ᾱ_t): their squares add to 1, as in add_noise.")
def _(prediction_type, x0, noise, alphas_cumprod, timesteps):
    return _target(prediction_type, x0, noise, alphas_cumprod, timesteps, lambda a, e, x: a * e - (1 - a) * x)


@training_target.trap("the flow target reversed: x₀ − ε",
                      hint="x_σ = (1 − σ)·x₀ + σ·ε moves from x₀ (σ = 0) to ε (σ = 1): its velocity dx/dσ is ε − x₀.")
def _(prediction_type, x0, noise, alphas_cumprod, timesteps):
    if prediction_type == "flow":
        return x0 - noise
    return _target(prediction_type, x0, noise, alphas_cumprod, timesteps,
                   lambda a, e, x: a.sqrt() * e - (1 - a).sqrt() * x)


# ---- min_snr_weights -------------------------------------------------------------------------------------
min_snr_weights = Kata(
    "min_snr_weights",
    hints=(
        "Clip the SNR at γ: that is the weight on an x₀ error. An ε or v error is an x₀ error scaled by the "
        "SNR: divide it back out.",
        "w = min(SNR, γ);  epsilon: w / SNR;  v_prediction: w / (SNR + 1);  sample: w.",
        "w = torch.minimum(snr, torch.full_like(snr, snr_gamma)); "
        "return w / snr if prediction_type == 'epsilon' else w / (snr + 1) if prediction_type == 'v_prediction' else w",
    ),
    no_answer_key="the training scripts compute the weights inline (train_text_to_image.py); the library's "
                  "compute_snr gives only the SNR, which is this function's input",
)

SNR_CASES = [
    dict(prediction_type="epsilon", snr_gamma=5.0, batch=8),
    dict(prediction_type="v_prediction", snr_gamma=5.0, batch=8, schedule="zero_snr", last=True),
    dict(prediction_type="sample", snr_gamma=5.0, batch=6),
    dict(prediction_type="epsilon", snr_gamma=1.0, batch=6, schedule="linear", T=500),
    dict(prediction_type="v_prediction", snr_gamma=20.0, batch=6),
    dict(prediction_type="sample", snr_gamma=0.5, batch=5, schedule="zero_snr", last=True),
]


def script_weights(snr: torch.Tensor, snr_gamma: float, kind: str, timesteps: torch.Tensor) -> torch.Tensor:
    """train_text_to_image.py's mse_loss_weights, line for line."""
    weights = torch.stack([snr, snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
    if kind == "epsilon":
        weights = weights / snr
    elif kind == "v_prediction":
        weights = weights / (snr + 1)
    return weights


@min_snr_weights.check("vs train_text_to_image.py's weights on compute_snr, both sides of γ", cases=SNR_CASES,
                       tol=STEP_MATH)
def _(case, g):
    T, gamma, kind = case.get("T", 1000), case["snr_gamma"], case["prediction_type"]
    s = ddpm(case.get("schedule", "scaled_linear"), T, kind if kind != "sample" else "epsilon")
    every = training_utils().compute_snr(s, torch.arange(T))
    above, below = (every > gamma).nonzero().flatten(), (every < gamma).nonzero().flatten()
    half = case["batch"] // 2  # SNR above γ (clipped) and below it (not), in a random order
    pick = torch.cat([above[torch.randint(0, len(above), (half,), generator=g)],
                      below[torch.randint(0, len(below), (case["batch"] - half,), generator=g)]])
    t = pick[torch.randperm(len(pick), generator=g)]
    if case.get("last"):
        t[0] = T - 1
    snr = training_utils().compute_snr(s, t)
    exact = torch.minimum(snr.double(), torch.full_like(snr.double(), gamma))
    exact = _divided(exact, snr.double(), kind)
    return Scenario(inputs=dict(snr=snr.clone(), snr_gamma=gamma, prediction_type=kind),
                    expected=script_weights(snr, gamma, kind, t), exact=exact,
                    label=f"{kind}, γ = {gamma:g}, SNR {[float(f'{v:.4g}') for v in snr.tolist()]}")


def _weights(snr, snr_gamma, prediction_type, clip, divide):
    w = clip(snr, torch.full_like(snr, snr_gamma))
    return divide(w, snr, prediction_type)


def _divided(w, snr, kind):
    return w / snr if kind == "epsilon" else w / (snr + 1) if kind == "v_prediction" else w


@min_snr_weights.trap("min(SNR, γ) without the prediction-type correction",
                      hint="min(SNR, γ) is the weight on an x₀ error. On ε divide it by SNR, on v by SNR + 1: "
                           "otherwise each timestep counts SNR times too much (~10⁴ at the clean end).")
def _(snr, snr_gamma, prediction_type):
    return _weights(snr, snr_gamma, prediction_type, torch.minimum, lambda w, s, k: w)


@min_snr_weights.trap("ε's correction on v (÷ SNR instead of ÷ (SNR + 1))",
                      hint="A v error is an x₀ error times √(SNR + 1): divide by SNR + 1 for 'v_prediction'.")
def _(snr, snr_gamma, prediction_type):
    return _weights(snr, snr_gamma, prediction_type, torch.minimum,
                    lambda w, s, k: w / s if k in ("epsilon", "v_prediction") else w)


@min_snr_weights.trap("v's correction on ε (÷ (SNR + 1) instead of ÷ SNR)",
                      hint="An ε error is an x₀ error times √SNR: divide by SNR for 'epsilon' (SNR + 1 is v's).")
def _(snr, snr_gamma, prediction_type):
    return _weights(snr, snr_gamma, prediction_type, torch.minimum,
                    lambda w, s, k: w / (s + 1) if k in ("epsilon", "v_prediction") else w)


@min_snr_weights.trap("max(SNR, γ) instead of min",
                      hint="Min-SNR clips the weight from above: min(SNR, γ), so no timestep counts more than γ.")
def _(snr, snr_gamma, prediction_type):
    return _weights(snr, snr_gamma, prediction_type, torch.maximum, _divided)


@min_snr_weights.trap("γ in place of min(SNR, γ) (the clip forgotten)",
                      hint="The weight is min(SNR, γ): γ only where SNR ≥ γ, the SNR itself below it.")
def _(snr, snr_gamma, prediction_type):
    return _weights(snr, snr_gamma, prediction_type, lambda s, gamma: gamma, _divided)


@min_snr_weights.trap("'sample' divided by SNR like ε (only 'v_prediction' given its own correction)",
                      hint="min(SNR, γ) is already the weight on an x₀ error: 'sample' (the model predicts x₀) takes it "
                           "as it is; only ε (÷ SNR) and v (÷ (SNR + 1)) are corrected.")
def _(snr, snr_gamma, prediction_type):
    return _weights(snr, snr_gamma, prediction_type, torch.minimum,
                    lambda w, s, k: w / (s + 1) if k == "v_prediction" else w / s)


@min_snr_weights.trap("v's weight as ε's times SNR/(SNR + 1): 0/0 at SNR = 0",
                      hint="min(SNR, γ)/SNR · SNR/(SNR + 1) is min(SNR, γ)/(SNR + 1) only where SNR > 0: at zero "
                           "terminal SNR it is 0/0 = NaN. Divide min(SNR, γ) by SNR + 1 directly.")
def _(snr, snr_gamma, prediction_type):
    w = torch.minimum(snr, torch.full_like(snr, snr_gamma))
    if prediction_type == "v_prediction":
        return w / snr * (snr / (snr + 1))
    return _divided(w, snr, prediction_type)


# ---- ddpm_training_loss ----------------------------------------------------------------------------------
ddpm_training_loss = Kata(
    "ddpm_training_loss",
    hints=(
        "Follow the script: draw the noise (and the offset noise), then a timestep per sample, noise the "
        "latents, ask the UNet, and compare with the target of the scheduler's prediction type.",
        "ε = randn(shape, g) [+ offset·randn((B, C, 1, 1), g)];  t = randint(0, T, (B,), g);  "
        "x_t = scheduler.add_noise(x₀, ε, t);  pred = unet(x_t, t, c).sample;  no γ: mean((pred − target)²); "
        "γ: mean over the batch of (per-sample mean of (pred − target)²) · min_snr_weights(snr(ᾱ, t), γ, type).",
        "err = (pred.float() - target.float()) ** 2; return err.mean() if snr_gamma is None else "
        "(err.mean(dim=(1, 2, 3)) * min_snr_weights(snr(scheduler.alphas_cumprod, t), snr_gamma, "
        "scheduler.config.prediction_type)).mean()",
    ),
    no_answer_key="the loss is computed inline by diffusers' training scripts, which are not part of the library; "
                  "the pieces it is made of (add_noise, get_velocity, compute_snr) are the lab's to use",
)

LOSS_CASES = [
    dict(prediction_type="epsilon", batch=2),
    dict(prediction_type="v_prediction", batch=3, snr_gamma=5.0),
    dict(prediction_type="epsilon", batch=3, snr_gamma=5.0, noise_offset=0.1),
    dict(prediction_type="v_prediction", batch=4, snr_gamma=1.0, schedule="zero_snr", noise_offset=0.05),
    dict(prediction_type="epsilon", batch=2, schedule="linear", T=500, noise_offset=0.1),
    dict(prediction_type="v_prediction", batch=2),
]
COUNTED_UNET = "UNet2DConditionModel (tiny, random weights; calls counted)"


def script_ddpm_loss(unet, scheduler, latents, encoder_hidden_states, generator, snr_gamma=None, noise_offset=0.0):
    """train_text_to_image.py's training step, from the noise draw to the loss (its draws from `generator`)."""
    noise = torch.randn(latents.shape, generator=generator, dtype=latents.dtype)
    if noise_offset:
        noise += noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), generator=generator)
    bsz = latents.shape[0]
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (bsz,), generator=generator).long()
    noisy_latents = scheduler.add_noise(latents, noise, timesteps)
    if scheduler.config.prediction_type == "epsilon":
        target = noise
    else:
        target = scheduler.get_velocity(latents, noise, timesteps)
    model_pred = unet(noisy_latents, timesteps, encoder_hidden_states, return_dict=False)[0]
    if snr_gamma is None:
        return F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    snr = training_utils().compute_snr(scheduler, timesteps)
    weights = script_weights(snr, snr_gamma, scheduler.config.prediction_type, timesteps)
    loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
    loss = loss.mean(dim=list(range(1, len(loss.shape)))) * weights
    return loss.mean()


def exact_ddpm_loss(unet64, scheduler, latents, encoder_hidden_states, seed, snr_gamma, noise_offset):
    """The same step in float64 (the same draws, a float64 copy of the UNet)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(latents.shape, generator=g, dtype=latents.dtype).double()
    if noise_offset:
        noise = noise + noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1), generator=g).double()
    t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), generator=g)
    a = _per_sample(scheduler.alphas_cumprod.double()[t], latents)
    x0 = latents.double()
    noisy = a.sqrt() * x0 + (1 - a).sqrt() * noise
    kind = scheduler.config.prediction_type
    target = noise if kind == "epsilon" else a.sqrt() * noise - (1 - a).sqrt() * x0
    with torch.no_grad():
        pred = unet64(noisy, t, encoder_hidden_states.double()).sample
    err = (pred - target) ** 2
    if snr_gamma is None:
        return err.mean()
    a = scheduler.alphas_cumprod.double()[t]
    snr = a / (1 - a)
    w = torch.minimum(snr, torch.full_like(snr, snr_gamma))
    w = w / snr if kind == "epsilon" else w / (snr + 1)
    return (err.mean(dim=(1, 2, 3)) * w).mean()


@ddpm_training_loss.check("vs train_text_to_image.py's loss (the same draws from the generator)", cases=LOSS_CASES,
                          tol=MODEL_FORWARD)
def _(case, g):
    s = ddpm(case.get("schedule", "scaled_linear"), case.get("T", 1000), case["prediction_type"])
    unet = tiny.unet_cond().requires_grad_(False)
    B = case["batch"]
    latents = torch.randn((B, tiny.LATENT_CHANNELS, 8, 8), generator=g)
    text = tiny.text_embeddings(B, g)
    seed = seed_from(g)
    reference = torch.Generator().manual_seed(seed)
    gamma, offset = case.get("snr_gamma"), case.get("noise_offset", 0.0)
    with torch.no_grad():
        expected = script_ddpm_loss(unet, copy.deepcopy(s), latents.clone(), text.clone(), reference, gamma, offset)
    exact = exact_ddpm_loss(copy.deepcopy(unet).double(), s, latents, text, seed, gamma, offset)
    return Scenario(inputs=dict(unet=DenoiserProbe(unet, label=COUNTED_UNET), scheduler=copy.deepcopy(s),
                                latents=latents, encoder_hidden_states=text,
                                generator=torch.Generator().manual_seed(seed), snr_gamma=gamma, noise_offset=offset),
                    expected=expected, exact=exact, generators_after={"generator": reference},
                    label=f"{case['prediction_type']}, snr_gamma={gamma}, noise_offset={offset:g}, "
                          f"T={s.config.num_train_timesteps}")


def _ddpm_loss(unet, scheduler, latents, encoder_hidden_states, generator, snr_gamma=None, noise_offset=0.0, *,
               timesteps_first=False, offset_shape=None, offset=True, t_from=0, eps_target=False, plain_min=False,
               mean_of_means=False, target_without_offset=False):
    """The step with one misconception switched on (for traps); all off is the script."""
    B, T = latents.shape[0], scheduler.config.num_train_timesteps
    kind = scheduler.config.prediction_type

    def draw_t():
        return torch.randint(t_from, T + t_from, (B,), generator=generator)

    t = draw_t() if timesteps_first else None
    noise = torch.randn(latents.shape, generator=generator)
    plain = noise
    if noise_offset and offset:
        shape = latents.shape if offset_shape == "full" else (B, latents.shape[1], 1, 1)
        noise = noise + noise_offset * torch.randn(shape, generator=generator)
    t = draw_t() if t is None else t
    t = t.clamp_max(T - 1)
    noisy = scheduler.add_noise(latents, noise, t)
    aimed = plain if target_without_offset else noise
    target = aimed if kind == "epsilon" or eps_target else scheduler.get_velocity(latents, aimed, t)
    err = (unet(noisy, t, encoder_hidden_states).sample.float() - target.float()) ** 2
    if snr_gamma is None:
        return err.mean()
    snr = training_utils().compute_snr(scheduler, t)
    w = script_weights(snr, snr_gamma, "sample" if plain_min else kind, t)
    if mean_of_means:
        return err.mean() * w.mean()
    return (err.mean(dim=(1, 2, 3)) * w).mean()


def _ddpm_trap(name: str, hint: str, **bug):
    @ddpm_training_loss.trap(name, hint=hint)
    def _(unet, scheduler, latents, encoder_hidden_states, generator, snr_gamma=None, noise_offset=0.0):
        return _ddpm_loss(unet, scheduler, latents, encoder_hidden_states, generator, snr_gamma, noise_offset, **bug)


_ddpm_trap("timesteps drawn before the noise",
           "Draw in the script's order from the one generator: the noise (and the offset noise) first, then the "
           "timesteps. Another order gives other numbers to both.", timesteps_first=True)
_ddpm_trap("the offset noise drawn at full size (B, C, H, W), not (B, C, 1, 1)",
           "The offset is one number per sample and channel: noise_offset · randn((B, C, 1, 1)), broadcast over "
           "the pixels. It shifts each channel's mean; full-size noise is just more noise.", offset_shape="full")
_ddpm_trap("noise_offset ignored",
           "With noise_offset > 0 add noise_offset · randn((B, C, 1, 1)) to the noise, drawn right after it.",
           offset=False)
_ddpm_trap("the target built from the noise before the offset was added",
           "The offset is part of the noise: x_t = add_noise(x₀, ε + offset, t), and the target is that same noise "
           "(or its v). The model cannot predict a noise it was not given.", target_without_offset=True)
_ddpm_trap("timesteps drawn from 1 to T instead of 0 to T − 1",
           "randint(0, T, (B,)) draws 0 … T − 1: the schedule's indices. 1 … T skips t = 0 and indexes past "
           "the table's end.", t_from=1)
_ddpm_trap("the ε target for a v model (the target of another prediction type)",
           "The target is the scheduler's prediction type: for 'v_prediction' it is v = √ᾱ·ε − √(1 − ᾱ)·x₀ "
           "(scheduler.get_velocity), not ε.", eps_target=True)
_ddpm_trap("Min-SNR weights without the prediction-type correction",
           "min(SNR, γ) weighs an x₀ error; on ε divide it by SNR, on v by SNR + 1 (min_snr_weights).",
           plain_min=True)
_ddpm_trap("the weights applied to the batch's overall mean: mean(w)·mean(err²)",
           "Weight each sample's own mean squared error, then average over the batch: "
           "mean_b(w_b · mean(err²_b)) differs from mean(w)·mean(err²) whenever the weights differ.",
           mean_of_means=True)


# ---- timestep_density ------------------------------------------------------------------------------------
timestep_density = Kata(
    "timestep_density",
    hints=(
        "One draw of batch_size numbers: a normal one for 'logit_normal' (then squash it into (0, 1)), a uniform "
        "one otherwise (then, for 'mode', bend it towards the middle).",
        "logit_normal: sigmoid(normal(logit_mean, logit_std));  mode: u = rand, 1 − u − s·(cos²(π·u/2) − 1 + u);  "
        "else: rand.",
        "u = torch.rand((batch_size,), generator=generator); "
        "return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)  # 'mode'",
    ),
    answer_key=(DENSITY,),
)

DENSITY_CASES = [
    dict(weighting_scheme="logit_normal", batch_size=8, logit_mean=0.0, logit_std=1.0),
    dict(weighting_scheme="logit_normal", batch_size=16, logit_mean=-0.5, logit_std=1.5),
    dict(weighting_scheme="mode", batch_size=8, mode_scale=1.29),
    dict(weighting_scheme="mode", batch_size=12, mode_scale=0.5),
    dict(weighting_scheme="none", batch_size=8),
    dict(weighting_scheme="sigma_sqrt", batch_size=6),
    dict(weighting_scheme="cosmap", batch_size=6, logit_mean=0.3, logit_std=0.8),  # set, and unused: uniform
]
DENSITY_DEFAULTS = dict(logit_mean=0.0, logit_std=1.0, mode_scale=1.29)


def exact_density(scheme, batch_size, seed, logit_mean, logit_std, mode_scale):
    g = torch.Generator().manual_seed(seed)
    if scheme == "logit_normal":
        z = torch.randn((batch_size,), generator=g).double()  # the standard normal under torch.normal's draw
        return torch.sigmoid(logit_mean + logit_std * z)
    u = torch.rand((batch_size,), generator=g).double()
    if scheme == "mode":
        return 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    return u


@timestep_density.check("vs compute_density_for_timestep_sampling (the same generator)", cases=DENSITY_CASES,
                        tol=STEP_MATH)
def _(case, g):
    args = {**DENSITY_DEFAULTS, **{k: v for k, v in case.items() if k in DENSITY_DEFAULTS}}
    seed = seed_from(g)
    reference = torch.Generator().manual_seed(seed)
    expected = training_utils().compute_density_for_timestep_sampling(
        weighting_scheme=case["weighting_scheme"], batch_size=case["batch_size"], generator=reference, **args)
    exact = exact_density(case["weighting_scheme"], case["batch_size"], seed, **args)
    return Scenario(inputs=dict(weighting_scheme=case["weighting_scheme"], batch_size=case["batch_size"],
                                generator=torch.Generator().manual_seed(seed), **args),
                    expected=expected, exact=exact, generators_after={"generator": reference},
                    label=f"{case['weighting_scheme']}, " + ", ".join(f"{k}={v:g}" for k, v in args.items()))


def _density(weighting_scheme, batch_size, generator, logit_mean, logit_std, mode_scale, *, sigmoid=True,
             standard=False, squared=True, half_angle=True, uniform_always=False, std_squared=False,
             global_uniform=False):
    if weighting_scheme == "logit_normal" and not uniform_always:
        mean, std = (0.0, 1.0) if standard else (logit_mean, logit_std ** 2 if std_squared else logit_std)
        n = torch.normal(mean=mean, std=std, size=(batch_size,), generator=generator)
        return torch.sigmoid(n) if sigmoid else n
    u = torch.rand((batch_size,)) if global_uniform else torch.rand((batch_size,), generator=generator)
    if weighting_scheme == "mode" and not uniform_always:
        c = torch.cos(math.pi * u / (2 if half_angle else 1))
        return 1 - u - mode_scale * ((c ** 2 if squared else c) - 1 + u)
    return u


def _density_trap(name: str, hint: str, **bug):
    @timestep_density.trap(name, hint=hint)
    def _(weighting_scheme, batch_size, generator, logit_mean=0.0, logit_std=1.0, mode_scale=1.29):
        return _density(weighting_scheme, batch_size, generator, logit_mean, logit_std, mode_scale, **bug)


_density_trap("logit-normal without the sigmoid (the normal draw itself)",
              "u must lie in (0, 1): it is a point of the ladder. Squash the normal draw: u = sigmoid(n).",
              sigmoid=False)
_density_trap("logit_mean and logit_std ignored (a standard normal)",
              "Draw n ~ N(logit_mean, logit_std²): torch.normal(mean=logit_mean, std=logit_std, size=(B,), "
              "generator=generator).", standard=True)
_density_trap("mode with cos(π·u/2), not its square",
              "The mode density bends u by s·(cos²(π·u/2) − 1 + u): the cosine is squared.", squared=False)
_density_trap("mode with cos²(π·u) (the half angle lost)",
              "The angle is π·u/2 (a quarter turn over u ∈ [0, 1]): cos²(π·u/2).", half_angle=False)
_density_trap("logit_std read as the variance (std = logit_std²)",
              "logit_std is the normal's standard deviation: torch.normal(mean=logit_mean, std=logit_std, ...).",
              std_squared=True)
_density_trap("the uniform draws from the global RNG (generator= not passed to torch.rand)",
              "Every draw comes from the generator the script hands over: torch.rand((B,), generator=generator); "
              "the global RNG is another stream, and the generator is left undrawn.", global_uniform=True)
_density_trap("uniform u whatever the scheme",
              "The scheme picks the density: a logit-normal draw for 'logit_normal', the bent uniform for 'mode', a "
              "plain uniform for every other scheme.", uniform_always=True)


# ---- sd3_loss_weighting ----------------------------------------------------------------------------------
sd3_loss_weighting = Kata(
    "sd3_loss_weighting",
    hints=(
        "Two schemes weight the loss, every other one leaves it alone: 'sigma_sqrt' is the inverse square of σ, "
        "'cosmap' a bump from the cosine map's derivative.",
        "sigma_sqrt: σ⁻² (float32);  cosmap: 2 / (π·(1 − 2σ + 2σ²));  else: ones_like(σ).",
        "if weighting_scheme == 'sigma_sqrt': return sigmas.float() ** -2.0",
    ),
    answer_key=(WEIGHTING,),
)

WEIGHT_CASES = [
    dict(weighting_scheme="sigma_sqrt", batch=8, dtype="float32"),
    dict(weighting_scheme="sigma_sqrt", batch=6, dtype="float16"),
    dict(weighting_scheme="cosmap", batch=8, dtype="float32"),
    dict(weighting_scheme="cosmap", batch=6, dtype="float16"),
    dict(weighting_scheme="logit_normal", batch=5, dtype="float32"),
    dict(weighting_scheme="mode", batch=5, dtype="float16"),
    dict(weighting_scheme="none", batch=4, dtype="float32"),
]


def exact_weighting(scheme: str, sigmas: torch.Tensor) -> torch.Tensor:
    s = sigmas.double()
    if scheme == "sigma_sqrt":
        return s ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * s + 2 * s ** 2))
    return torch.ones_like(s)


@sd3_loss_weighting.check("vs compute_loss_weighting_for_sd3 on the training ladder's σs", cases=WEIGHT_CASES,
                          tol=STEP_MATH)
def _(case, g):
    ladder = FlowMatchEulerDiscreteScheduler(shift=3.0).sigmas
    if case["dtype"] == "float16":  # σ⁻² of σ < 0.004 overflows float16 (diffusers itself gives inf)
        ladder = ladder[ladder > 0.005]
    sigmas = ladder[torch.randint(0, len(ladder), (case["batch"],), generator=g)]
    sigmas = sigmas.reshape(-1, 1, 1, 1).to(DTYPES[case["dtype"]])
    expected = training_utils().compute_loss_weighting_for_sd3(case["weighting_scheme"], sigmas.clone())
    return Scenario(inputs=dict(weighting_scheme=case["weighting_scheme"], sigmas=sigmas), expected=expected,
                    exact=exact_weighting(case["weighting_scheme"], sigmas),
                    label=f"{case['weighting_scheme']}, σ {[float(f'{v:.4g}') for v in sigmas.flatten().tolist()]}")


def _weighting(weighting_scheme, sigmas, *, sigma_sqrt=lambda s: s ** -2.0, cosmap_pi=math.pi, always=False,
               square_of_one_minus=False):
    s = sigmas.float()
    if weighting_scheme == "sigma_sqrt" or (always and weighting_scheme != "cosmap"):
        return sigma_sqrt(s)
    if weighting_scheme == "cosmap":
        bottom = (1 - s) ** 2 if square_of_one_minus else 1 - 2 * s + 2 * s ** 2
        return (2 / (cosmap_pi * bottom)).to(sigmas.dtype)
    return torch.ones_like(sigmas)


@sd3_loss_weighting.trap("'sigma_sqrt' read as √σ",
                         hint="The name is the script's: the weight is σ⁻² (sigmas ** -2.0), the weight that turns the "
                              "velocity loss into a loss on σ-scaled errors; not √σ.")
def _(weighting_scheme, sigmas):
    return _weighting(weighting_scheme, sigmas, sigma_sqrt=lambda s: s.sqrt())


@sd3_loss_weighting.trap("'sigma_sqrt' read as 1/√σ",
                         hint="The weight is σ⁻² (sigmas ** -2.0), not σ^(−1/2).")
def _(weighting_scheme, sigmas):
    return _weighting(weighting_scheme, sigmas, sigma_sqrt=lambda s: s ** -0.5)


@sd3_loss_weighting.trap("σ⁻¹ for 'sigma_sqrt'",
                         hint="The weight is σ⁻², the inverse square: sigmas ** -2.0.")
def _(weighting_scheme, sigmas):
    return _weighting(weighting_scheme, sigmas, sigma_sqrt=lambda s: 1 / s)


@sd3_loss_weighting.trap("cosmap without the π: 2 / (1 − 2σ + 2σ²)",
                         hint="cosmap is 2 / (π·(1 − 2σ + 2σ²)): the π normalises it (its integral over σ is 1).")
def _(weighting_scheme, sigmas):
    return _weighting(weighting_scheme, sigmas, cosmap_pi=1.0)


@sd3_loss_weighting.trap("cosmap as 2 / π · bot (the bottom multiplied, not divided by)",
                         hint="2 / math.pi * bot is (2/π)·bot: Python reads / and * left to right. The weight is "
                              "2 / (math.pi * bot), the bottom under the fraction.")
def _(weighting_scheme, sigmas):
    if weighting_scheme != "cosmap":
        return _weighting(weighting_scheme, sigmas)
    s = sigmas.float()
    return (2 / math.pi * (1 - 2 * s + 2 * s ** 2)).to(sigmas.dtype)


@sd3_loss_weighting.trap("cosmap's denominator read as (1 − σ)² = 1 − 2σ + σ²",
                         hint="The bottom is 1 − 2σ + 2σ² = σ² + (1 − σ)², which never reaches 0; (1 − σ)² does at "
                              "σ = 1, and the weight blows up at the noisy end.")
def _(weighting_scheme, sigmas):
    return _weighting(weighting_scheme, sigmas, square_of_one_minus=True)


@sd3_loss_weighting.trap("σ⁻² for every scheme but cosmap (the density's schemes weighted too)",
                         hint="Only 'sigma_sqrt' and 'cosmap' weight the loss: 'logit_normal', 'mode' and 'none' shape "
                              "which σs are drawn (timestep_density) and weigh every σ's loss by 1.")
def _(weighting_scheme, sigmas):
    return _weighting(weighting_scheme, sigmas, always=True)


# ---- flow_matching_loss ----------------------------------------------------------------------------------
flow_matching_loss = Kata(
    "flow_matching_loss",
    hints=(
        "Follow the SD3 script: the noise, then u (timestep_density), the ladder's timestep and σ at ⌊u·T⌋, the "
        "straight line to the noise, the transformer, the target (ε − x₀, or x₀ when the output is "
        "preconditioned), and the weighted per-sample means.",
        "i = (u·T).long(); t = scheduler.timesteps[i]; σ = scheduler.sigmas[i] (B, 1, 1, 1); x = (1 − σ)·x₀ + σ·ε; "
        "pred = transformer(hidden_states=x, timestep=t, encoder_hidden_states=c, pooled_projections=p).sample; "
        "precondition: pred = pred·(−σ) + x, target x₀; else target ε − x₀; "
        "loss = mean_b(mean(w(σ)·(pred − target)²)).",
        "w = sd3_loss_weighting(weighting_scheme, sigmas); "
        "return (w.float() * (pred.float() - target.float()) ** 2).reshape(B, -1).mean(1).mean()",
    ),
    # its density and weighting are this lab's own functions: diffusers' are refused here too
    answer_key=(DENSITY, WEIGHTING),
)

FLOW_CASES = [
    dict(weighting_scheme="logit_normal", batch=2),
    dict(weighting_scheme="mode", batch=3, mode_scale=1.29, precondition_outputs=True),
    dict(weighting_scheme="mode", batch=2, mode_scale=0.8),
    dict(weighting_scheme="sigma_sqrt", batch=3),
    dict(weighting_scheme="cosmap", batch=2, precondition_outputs=True),
    dict(weighting_scheme="none", batch=3, shift=1.0),
    dict(weighting_scheme="logit_normal", batch=4, logit_mean=0.5, logit_std=0.7, precondition_outputs=True),
]
COUNTED_TRANSFORMER = "SD3Transformer2DModel (tiny, random weights; calls counted)"


def script_sigmas(scheduler, timesteps, n_dim=4, dtype=torch.float32):
    """train_dreambooth_sd3.py's get_sigmas: each timestep looked up in the schedule's timesteps."""
    sigmas = scheduler.sigmas.to(dtype=dtype)
    schedule_timesteps = scheduler.timesteps
    step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
    sigma = sigmas[step_indices].flatten()
    while len(sigma.shape) < n_dim:
        sigma = sigma.unsqueeze(-1)
    return sigma


def script_flow_loss(transformer, scheduler, latents, prompt_embeds, pooled_prompt_embeds, generator,
                     weighting_scheme, logit_mean, logit_std, mode_scale, precondition_outputs):
    """train_dreambooth_sd3.py's training step, from the noise draw to the loss (its draws from `generator`)."""
    tu = training_utils()
    model_input = latents
    noise = torch.randn(model_input.shape, generator=generator, dtype=model_input.dtype)
    bsz = model_input.shape[0]
    u = tu.compute_density_for_timestep_sampling(weighting_scheme=weighting_scheme, batch_size=bsz,
                                                 logit_mean=logit_mean, logit_std=logit_std, mode_scale=mode_scale,
                                                 generator=generator)
    indices = (u * scheduler.config.num_train_timesteps).long()
    timesteps = scheduler.timesteps[indices]
    sigmas = script_sigmas(scheduler, timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
    noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
    model_pred = transformer(hidden_states=noisy_model_input, timestep=timesteps, encoder_hidden_states=prompt_embeds,
                             pooled_projections=pooled_prompt_embeds, return_dict=False)[0]
    if precondition_outputs:
        model_pred = model_pred * (-sigmas) + noisy_model_input
    weighting = tu.compute_loss_weighting_for_sd3(weighting_scheme=weighting_scheme, sigmas=sigmas)
    target = model_input if precondition_outputs else noise - model_input
    loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1), 1)
    return loss.mean()


def exact_flow_loss(transformer64, scheduler, latents, prompt_embeds, pooled, seed, weighting_scheme, logit_mean,
                    logit_std, mode_scale, precondition_outputs):
    """The same step in float64: the same draws, a float64 copy of the transformer, σ widened."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(latents.shape, generator=g, dtype=latents.dtype)
    u = training_utils().compute_density_for_timestep_sampling(
        weighting_scheme=weighting_scheme, batch_size=latents.shape[0], logit_mean=logit_mean, logit_std=logit_std,
        mode_scale=mode_scale, generator=g)
    index = (u * scheduler.config.num_train_timesteps).long()
    t = scheduler.timesteps[index]
    sigmas = _per_sample(scheduler.sigmas[index].double(), latents)
    x0, noise = latents.double(), noise.double()
    noisy = (1 - sigmas) * x0 + sigmas * noise
    with torch.no_grad():
        pred = transformer64(hidden_states=noisy, timestep=t.double(), encoder_hidden_states=prompt_embeds.double(),
                             pooled_projections=pooled.double()).sample
    if precondition_outputs:
        pred = pred * (-sigmas) + noisy
    target = x0 if precondition_outputs else noise - x0
    w = exact_weighting(weighting_scheme, sigmas)
    return (w * (pred - target) ** 2).reshape(latents.shape[0], -1).mean(1).mean()


@functools.cache
def _ladder(shift: float) -> FlowMatchEulerDiscreteScheduler:
    return FlowMatchEulerDiscreteScheduler(shift=shift)


@flow_matching_loss.check("vs train_dreambooth_sd3.py's loss (the same draws from the generator)", cases=FLOW_CASES,
                          tol=MODEL_FORWARD)
def _(case, g):
    scheduler = copy.deepcopy(_ladder(case.get("shift", 3.0)))
    transformer = tiny.sd3_transformer().requires_grad_(False)
    B = case["batch"]
    latents = torch.randn((B, tiny.LATENT_CHANNELS, 8, 8), generator=g)
    prompt = tiny.text_embeddings(B, g)
    pooled = torch.randn((B, tiny.POOLED_DIM), generator=g)
    args = dict(weighting_scheme=case["weighting_scheme"], logit_mean=case.get("logit_mean", 0.0),
                logit_std=case.get("logit_std", 1.0), mode_scale=case.get("mode_scale", 1.29),
                precondition_outputs=case.get("precondition_outputs", False))
    seed = seed_from(g)
    reference = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        expected = script_flow_loss(transformer, copy.deepcopy(scheduler), latents.clone(), prompt.clone(),
                                    pooled.clone(), reference, **args)
    exact = exact_flow_loss(copy.deepcopy(transformer).double(), scheduler, latents, prompt, pooled, seed, **args)
    return Scenario(inputs=dict(transformer=DenoiserProbe(transformer, label=COUNTED_TRANSFORMER), scheduler=scheduler,
                                latents=latents, prompt_embeds=prompt, pooled_prompt_embeds=pooled,
                                generator=torch.Generator().manual_seed(seed), **args),
                    expected=expected, exact=exact, generators_after={"generator": reference},
                    label=f"{args['weighting_scheme']}, shift {scheduler.config.shift:g}, "
                          f"precondition_outputs={args['precondition_outputs']}")


def _flow_loss(transformer, scheduler, latents, prompt_embeds, pooled_prompt_embeds, generator, weighting_scheme,
               logit_mean, logit_std, mode_scale, precondition_outputs, *, u_first=False, sigma_is_u=False,
               reversed_target=False, ignore_precondition=False, unweighted=False, mean_of_means=False,
               swapped_mix=False, precondition_mix=None, sigma_only_is_u=False, index_over=0):
    """The step with one misconception switched on (for traps); all off is the script."""
    B, T = latents.shape[0], scheduler.config.num_train_timesteps

    def draw_u():
        return _density(weighting_scheme, B, generator, logit_mean, logit_std, mode_scale)

    u = draw_u() if u_first else None
    noise = torch.randn(latents.shape, generator=generator)
    u = draw_u() if u is None else u
    index = (u * (T - index_over)).long()
    if sigma_is_u:
        t, sigmas = u * T, _per_sample(u, latents)
    else:
        t, sigmas = scheduler.timesteps[index], _per_sample(u if sigma_only_is_u else scheduler.sigmas[index], latents)
    noisy = sigmas * latents + (1 - sigmas) * noise if swapped_mix else (1 - sigmas) * latents + sigmas * noise
    pred = transformer(hidden_states=noisy, timestep=t, encoder_hidden_states=prompt_embeds,
                       pooled_projections=pooled_prompt_embeds).sample
    precondition = precondition_outputs and not ignore_precondition
    if precondition and precondition_mix != "target":
        pred = pred * (-sigmas) + noisy
    velocity = latents - noise if reversed_target else noise - latents
    target = velocity if not precondition or precondition_mix == "output" else latents
    w = torch.ones_like(sigmas) if unweighted else _weighting(weighting_scheme, sigmas)
    err = (pred.float() - target.float()) ** 2
    if mean_of_means:
        return err.mean() * w.float().mean()
    return (w.float() * err).reshape(B, -1).mean(1).mean()


def _flow_trap(name: str, hint: str, **bug):
    @flow_matching_loss.trap(name, hint=hint)
    def _(transformer, scheduler, latents, prompt_embeds, pooled_prompt_embeds, generator,
          weighting_scheme="logit_normal", logit_mean=0.0, logit_std=1.0, mode_scale=1.29, precondition_outputs=False):
        return _flow_loss(transformer, scheduler, latents, prompt_embeds, pooled_prompt_embeds, generator,
                          weighting_scheme, logit_mean, logit_std, mode_scale, precondition_outputs, **bug)


_flow_trap("the ladder not looked up: timestep u·T and σ = u",
           "u picks an index of the training ladder, i = ⌊u·T⌋; the timestep and σ are the ladder's at i "
           "(scheduler.timesteps[i], scheduler.sigmas[i]). The ladder runs from noise to clean and is shifted "
           "(shift 3: σ ≠ u, not even 1 − u).", sigma_is_u=True)
_flow_trap("σ = u, though the timestep is the ladder's",
           "The ladder is shifted (shift 3): its σ at index ⌊u·T⌋ is not u. Look both up at the same index: "
           "scheduler.timesteps[i] and scheduler.sigmas[i].", sigma_only_is_u=True)
_flow_trap("the ladder index ⌊u·(T − 1)⌋ instead of ⌊u·T⌋",
           "The script indexes the ladder at (u · num_train_timesteps).long(): T, not T − 1 (u < 1 keeps it in range).",
           index_over=1)
_flow_trap("u drawn before the noise",
           "Draw in the script's order from the one generator: the noise first, then u.", u_first=True)
_flow_trap("the target reversed: x₀ − ε",
           "x_σ = (1 − σ)·x₀ + σ·ε: its velocity dx/dσ is ε − x₀, the target of a velocity model.",
           reversed_target=True)
_flow_trap("σ and 1 − σ swapped in the noisy input",
           "σ is the noise level: x_σ = (1 − σ)·x₀ + σ·ε (σ = 1: pure noise).", swapped_mix=True)
_flow_trap("precondition_outputs ignored",
           "With precondition_outputs the output is read as x̂₀ = x_σ − σ·out (pred·(−σ) + x_σ) and compared with "
           "x₀, not with ε − x₀.", ignore_precondition=True)
_flow_trap("x̂₀ compared with ε − x₀ (the output preconditioned, the target not)",
           "Preconditioning changes both halves: the output becomes x̂₀ = pred·(−σ) + x_σ and the target becomes x₀. "
           "x̂₀ against the velocity ε − x₀ compares two different things.", precondition_mix="output")
_flow_trap("the raw output compared with x₀ (the target preconditioned, the output not)",
           "With precondition_outputs, first turn the output into x̂₀ = pred·(−σ) + x_σ, then compare it with x₀.",
           precondition_mix="target")
_flow_trap("the loss weighting left out",
           "Multiply the squared error by sd3_loss_weighting(weighting_scheme, σ) before the means ('sigma_sqrt' "
           "and 'cosmap' weight; the other schemes weigh by 1).", unweighted=True)
_flow_trap("the weights applied to the batch's overall mean: mean(w)·mean(err²)",
           "Weight each element by its sample's w(σ), take each sample's mean, then the batch mean.",
           mean_of_means=True)
