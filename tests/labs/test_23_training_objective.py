"""Lab 23: wrong-but-plausible implementations fail, and the commonest ones are named."""
from pathlib import Path

from expect import Fails

LAB = "23_training_objective"
REPO = Path(__file__).resolve().parents[2]


def target_body(v="a.sqrt() * noise.float() - (1 - a).sqrt() * x0.float()", flow="noise - x0", eps="noise",
                sample="x0", cast=".to(x0.dtype)") -> str:
    """A body for training_target with one line swapped for a wrong one."""
    return f"""
    if prediction_type == "epsilon":
        return {eps}
    if prediction_type == "sample":
        return {sample}
    if prediction_type == "flow":
        return {flow}
    a = alphas_cumprod[timesteps].float().reshape(-1, *([1] * (x0.dim() - 1)))
    return ({v}){cast}
    """


def weights_body(clip="torch.minimum(snr, torch.full_like(snr, snr_gamma))", eps="w / snr", v="w / (snr + 1)",
                 sample="w") -> str:
    """A body for min_snr_weights with one line swapped for a wrong one."""
    return f"""
    w = {clip}
    if prediction_type == "epsilon":
        return {eps}
    if prediction_type == "v_prediction":
        return {v}
    return {sample}
    """


def ddpm_body(draws="noise_first", offset_shape="(B, latents.shape[1], 1, 1)", t="torch.randint(0, T, (B,), generator=generator)",
              target="training_target(kind, latents, noise, scheduler.alphas_cumprod, t)",
              weights="min_snr_weights(snr(scheduler.alphas_cumprod, t), snr_gamma, kind)",
              reduce="(err.mean(dim=(1, 2, 3)) * w).mean()", plain="err.mean()") -> str:
    """A body for ddpm_training_loss with one line swapped for a wrong one."""
    noise = """
    noise = torch.randn(latents.shape, generator=generator)
    if noise_offset:
        noise = noise + noise_offset * torch.randn({offset_shape}, generator=generator)""".format(offset_shape=offset_shape)
    timesteps = f"\n    t = {t}"
    return f"""
    B, T, kind = latents.shape[0], scheduler.config.num_train_timesteps, scheduler.config.prediction_type
    {(noise + timesteps) if draws == "noise_first" else (timesteps + noise)}
    noisy = scheduler.add_noise(latents, noise, t)
    target = {target}
    err = (unet(noisy, t, encoder_hidden_states).sample.float() - target.float()) ** 2
    if snr_gamma is None:
        return {plain}
    w = {weights}
    return {reduce}
    """


def density_body(normal="torch.normal(mean=logit_mean, std=logit_std, size=(batch_size,), generator=generator)",
                 squash="torch.sigmoid(n)", mode="1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)") -> str:
    """A body for timestep_density with one line swapped for a wrong one."""
    return f"""
    if weighting_scheme == "logit_normal":
        n = {normal}
        return {squash}
    u = torch.rand((batch_size,), generator=generator)
    if weighting_scheme == "mode":
        return {mode}
    return u
    """


def weighting_body(sqrt="sigmas.float() ** -2.0", cosmap="(2 / (math.pi * (1 - 2 * s + 2 * s ** 2))).to(sigmas.dtype)",
                   other="torch.ones_like(sigmas)") -> str:
    """A body for sd3_loss_weighting with one line swapped for a wrong one."""
    return f"""
    s = sigmas.float()
    if weighting_scheme == "sigma_sqrt":
        return {sqrt}
    if weighting_scheme == "cosmap":
        return {cosmap}
    return {other}
    """


def flow_body(draws="noise_first", lookup="scheduler.timesteps[index], scheduler.sigmas[index]",
              mix="(1 - sigmas) * latents + sigmas * noise", precondition="precondition_outputs",
              target="noise - latents", weight="sd3_loss_weighting(weighting_scheme, sigmas)",
              reduce="(w.float() * err).reshape(B, -1).mean(1).mean()", after_pred="pass") -> str:
    """A body for flow_matching_loss with one line swapped for a wrong one (`after_pred`: a line run on the output
    before the precondition branch)."""
    noise = "\n    noise = torch.randn(latents.shape, generator=generator)"
    density = "\n    u = timestep_density(weighting_scheme, B, generator, logit_mean, logit_std, mode_scale)"
    return f"""
    B, T = latents.shape[0], scheduler.config.num_train_timesteps
    {(noise + density) if draws == "noise_first" else (density + noise)}
    index = (u * T).long()
    t, sigmas = {lookup}
    sigmas = sigmas.reshape(-1, 1, 1, 1)
    noisy = {mix}
    pred = transformer(hidden_states=noisy, timestep=t, encoder_hidden_states=prompt_embeds,
                       pooled_projections=pooled_prompt_embeds).sample
    {after_pred}
    if {precondition}:
        pred = pred * (-sigmas) + noisy
        target = latents
    else:
        target = {target}
    w = {weight}
    err = (pred.float() - target.float()) ** 2
    return {reduce}
    """


MUTANTS = [
    ("training_target",  # ᾱ shaped (1, B, 1, 1): over the channels (runs where B = C)
     """
     if prediction_type == "epsilon":
         return noise
     if prediction_type == "sample":
         return x0
     if prediction_type == "flow":
         return noise - x0
     a = alphas_cumprod.float()[timesteps].view(1, -1, 1, 1)
     return (a.sqrt() * noise.float() - (1 - a).sqrt() * x0.float()).to(x0.dtype)
     """, "ᾱ broadcast over the channels"),
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("training_target", target_body(v="noise", flow="noise", sample="noise"), "ε returned whatever the prediction type"),
    ("training_target", target_body(v="(1 - a).sqrt() * x0.float() - a.sqrt() * noise.float()"),
     "v with the sign flipped"),
    ("training_target", target_body(v="a.sqrt() * x0.float() - (1 - a).sqrt() * noise.float()"),
     "v with x₀ and ε swapped"),
    ("training_target", target_body(v="a * noise.float() - (1 - a) * x0.float()"), "v without the square roots"),
    ("training_target", target_body(v="(1 - a).sqrt() * noise.float() - a.sqrt() * x0.float()"),
     "v with the coefficients swapped"),
    ("training_target", target_body(flow="x0 - noise"), "the flow target reversed: x₀ − ε"),
    ("training_target",  # the x₀ target for "sample" read as ε − x₀ (the flow's)
     target_body(sample="noise - x0"), Fails("wrong", "values differ")),
    ("training_target",  # v left in float32 for float16 latents
     target_body(cast=""), Fails("wrong", "has dtype")),
    ("training_target",  # one ᾱ for the whole batch (the first sample's)
     target_body(v="a[:1].sqrt() * noise.float() - (1 - a[:1]).sqrt() * x0.float()"), Fails("wrong", "values differ")),
    ("min_snr_weights", weights_body(eps="w", v="w"), "min(SNR, γ) without the prediction-type correction"),
    ("min_snr_weights", weights_body(v="w / snr"), "ε's correction on v"),
    ("min_snr_weights", weights_body(eps="w / (snr + 1)"), "v's correction on ε"),
    ("min_snr_weights", weights_body(clip="torch.maximum(snr, torch.full_like(snr, snr_gamma))"),
     "max(SNR, γ) instead of min"),
    ("min_snr_weights", weights_body(clip="torch.full_like(snr, snr_gamma)"), "γ in place of min(SNR, γ)"),
    ("min_snr_weights", weights_body(sample="w / snr"), "'sample' divided by SNR like ε"),
    ("min_snr_weights", weights_body(v="w / snr * (snr / (snr + 1))"), "v's weight as ε's times SNR/(SNR + 1)"),
    ("min_snr_weights",  # the clip at γ applied after the division (min(1, γ/SNR) on ε): right only where SNR ≥ γ
     weights_body(eps="torch.clamp(snr_gamma / snr, max=1.0)", v="torch.clamp(snr_gamma / (snr + 1), max=1.0)"),
     Fails("wrong", "values differ")),
    ("ddpm_training_loss", ddpm_body(draws="timesteps_first"), "timesteps drawn before the noise"),
    ("ddpm_training_loss", ddpm_body(offset_shape="latents.shape"), "the offset noise drawn at full size"),
    ("ddpm_training_loss", ddpm_body(t="torch.randint(1, T + 1, (B,), generator=generator).clamp_max(T - 1)"),
     "timesteps drawn from 1 to T instead of 0 to T − 1"),
    ("ddpm_training_loss", ddpm_body(target="noise"), "the ε target for a v model"),
    ("ddpm_training_loss", ddpm_body(weights="torch.minimum(snr(scheduler.alphas_cumprod, t), "
                                             "torch.full((B,), snr_gamma))"),
     "Min-SNR weights without the prediction-type correction"),
    ("ddpm_training_loss", ddpm_body(reduce="err.mean() * w.mean()"), "the weights applied to the batch's overall mean"),
    ("ddpm_training_loss",  # the plain MSE summed instead of averaged
     ddpm_body(plain="err.sum()"), Fails("wrong", "values differ")),
    ("ddpm_training_loss",  # the loss per sample, not reduced to one number
     ddpm_body(plain="err.mean(dim=(1, 2, 3))", reduce="err.mean(dim=(1, 2, 3)) * w"), Fails("wrong", "shape")),
    ("timestep_density", density_body(squash="n"), "logit-normal without the sigmoid"),
    ("timestep_density",
     density_body(normal="torch.normal(mean=logit_mean, std=logit_std ** 2, size=(batch_size,), generator=generator)"),
     "logit_std read as the variance"),
    ("timestep_density", density_body().replace("torch.rand((batch_size,), generator=generator)",
                                                "torch.rand((batch_size,))"),
     "the uniform draws from the global RNG"),
    ("timestep_density", density_body(normal="torch.randn((batch_size,), generator=generator)"),
     "logit_mean and logit_std ignored"),
    ("timestep_density", density_body(mode="1 - u - mode_scale * (torch.cos(math.pi * u / 2) - 1 + u)"),
     "mode with cos(π·u/2), not its square"),
    ("timestep_density", density_body(mode="1 - u - mode_scale * (torch.cos(math.pi * u) ** 2 - 1 + u)"),
     "mode with cos²(π·u)"),
    ("timestep_density",  # the mode formula without the leading 1 − u (u read from the other end)
     density_body(mode="u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)"), Fails("wrong", "values differ")),
    ("timestep_density",  # logit-normal drawn twice (a throwaway draw first): the generator moves on too far
     density_body(normal="(torch.randn((batch_size,), generator=generator), "
                         "torch.normal(mean=logit_mean, std=logit_std, size=(batch_size,), generator=generator))[1]"),
     Fails("wrong", "values differ")),
    ("sd3_loss_weighting", weighting_body(sqrt="s.sqrt()"), "'sigma_sqrt' read as √σ"),
    ("sd3_loss_weighting", weighting_body(sqrt="s ** -0.5"), "'sigma_sqrt' read as 1/√σ"),
    ("sd3_loss_weighting", weighting_body(sqrt="1 / s"), "σ⁻¹ for 'sigma_sqrt'"),
    ("sd3_loss_weighting",  # a blind learner's: 2 / math.pi * bot (precedence)
     weighting_body(cosmap="(2 / math.pi * (1 - 2 * s + 2 * s ** 2)).to(sigmas.dtype)"), "cosmap as 2 / π · bot"),
    ("sd3_loss_weighting", weighting_body(cosmap="(2 / (1 - 2 * s + 2 * s ** 2)).to(sigmas.dtype)"),
     "cosmap without the π"),
    ("sd3_loss_weighting", weighting_body(other="s ** -2.0"), "σ⁻² for every scheme but cosmap"),
    ("sd3_loss_weighting", weighting_body(cosmap="(2 / (math.pi * (1 - 2 * s + s ** 2))).to(sigmas.dtype)"),
     "cosmap's denominator read as (1 − σ)²"),
    ("sd3_loss_weighting",  # σ⁻² left in σ's dtype (diffusers returns it as float32)
     weighting_body(sqrt="sigmas ** -2.0"), Fails("wrong", "has dtype")),
    ("flow_matching_loss", flow_body(lookup="u * T, u"), "the ladder not looked up"),
    ("flow_matching_loss", flow_body(draws="u_first"), "u drawn before the noise"),
    ("flow_matching_loss", flow_body(target="latents - noise"), "the target reversed: x₀ − ε"),
    ("flow_matching_loss", flow_body(mix="sigmas * latents + (1 - sigmas) * noise"), "σ and 1 − σ swapped"),
    ("flow_matching_loss", flow_body(precondition="False"), "precondition_outputs ignored"),
    ("flow_matching_loss", flow_body(weight="torch.ones_like(sigmas)"), "the loss weighting left out"),
    ("flow_matching_loss", flow_body(precondition="False",
                                     after_pred="pred = pred * (-sigmas) + noisy if precondition_outputs else pred"),
     "x̂₀ compared with ε − x₀"),
    ("flow_matching_loss", flow_body(target="latents if precondition_outputs else noise - latents",
                                     precondition="False"), "the raw output compared with x₀"),
    ("flow_matching_loss", flow_body(reduce="err.mean() * w.float().mean()"),
     "the weights applied to the batch's overall mean"),
    ("flow_matching_loss",  # σ read as 1 − u (the ladder runs from noise to clean), the timestep as (1 − u)·T
     flow_body(lookup="(1 - u) * T, 1 - u"), Fails("wrong", "values differ")),
    ("flow_matching_loss", flow_body(lookup="scheduler.timesteps[index], u"), "σ = u, though the timestep is the ladder's"),
    ("flow_matching_loss", flow_body(lookup="scheduler.timesteps[(u * (T - 1)).long()], "
                                            "scheduler.sigmas[(u * (T - 1)).long()]"), "the ladder index ⌊u·(T − 1)⌋"),
    ("ddpm_training_loss",  # the offset added to the noise the UNet sees, not to the target
     """
    B, T, kind = latents.shape[0], scheduler.config.num_train_timesteps, scheduler.config.prediction_type
    eps = torch.randn(latents.shape, generator=generator)
    noise = eps + noise_offset * torch.randn((B, latents.shape[1], 1, 1), generator=generator) if noise_offset else eps
    t = torch.randint(0, T, (B,), generator=generator)
    noisy = scheduler.add_noise(latents, noise, t)
    target = training_target(kind, latents, eps, scheduler.alphas_cumprod, t)
    err = (unet(noisy, t, encoder_hidden_states).sample.float() - target.float()) ** 2
    if snr_gamma is None:
        return err.mean()
    w = min_snr_weights(snr(scheduler.alphas_cumprod, t), snr_gamma, kind)
    return (err.mean(dim=(1, 2, 3)) * w).mean()
    """, "the target built from the noise before the offset was added"),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("training_target",
     target_body(v="a.double().sqrt() * noise.double() - (1 - a.double()).sqrt() * x0.double()"),
     "v in float64, cast once (closer to exact math than get_velocity, which rounds ᾱ to float16 first)"),
    ("training_target",
     """
     if prediction_type == "v_prediction":
         a = alphas_cumprod.to(x0.dtype)[timesteps] ** 0.5
         b = (1 - alphas_cumprod.to(x0.dtype)[timesteps]) ** 0.5
         return a.view(-1, 1, 1, 1) * noise - b.view(-1, 1, 1, 1) * x0
     return {"epsilon": noise, "sample": x0, "flow": noise - x0}[prediction_type]
     """,
     "get_velocity's own order, in the latents' dtype"),
    ("min_snr_weights",
     weights_body(clip="snr.clamp(max=snr_gamma)", eps="(w.double() / snr.double()).float()",
                  v="(w.double() / (snr.double() + 1)).float()"),
     "clamp for min, the division in float64 and cast once"),
    ("ddpm_training_loss",
     ddpm_body(reduce="(torch.nn.functional.mse_loss(unet(noisy, t, encoder_hidden_states).sample.float(), "
                      "target.float(), reduction='none').mean(dim=(1, 2, 3)) * w).mean()",
               plain="torch.nn.functional.mse_loss(unet(noisy, t, encoder_hidden_states).sample, target)"),
     "torch's mse_loss (the model called a second time: the same values)"),
    ("timestep_density",
     density_body(normal="torch.randn((batch_size,), generator=generator) * logit_std + logit_mean"),
     "randn scaled and shifted: the same draw as torch.normal, within a float32 ulp"),
    ("timestep_density",
     density_body(squash="1 / (1 + torch.exp(-n))",
                  mode="1 - u - mode_scale * ((1 + torch.cos(math.pi * u)) / 2 - 1 + u)"),
     "the sigmoid written out; cos²(x/2) as (1 + cos x)/2"),
    ("sd3_loss_weighting",
     weighting_body(sqrt="1 / (s * s)", cosmap="(2 / (math.pi * ((1 - s) ** 2 + s ** 2))).to(sigmas.dtype)"),
     "1/σ² and (1 − σ)² + σ² (the same polynomial)"),
    ("flow_matching_loss",
     flow_body(lookup="scheduler.timesteps[index], scheduler.timesteps[index] / T"),
     "σ = t/T on the training ladder (timesteps are σ·T there)"),
]


def test_calling_diffusers_density_inside_the_loss_is_refused(grade_mutant):
    graded = grade_mutant(LAB, "flow_matching_loss", flow_body().replace(
        "u = timestep_density(weighting_scheme, B, generator, logit_mean, logit_std, mode_scale)",
        "from diffusers.training_utils import compute_density_for_timestep_sampling as density\n"
        "    u = density(weighting_scheme, B, logit_mean, logit_std, mode_scale, generator=generator)"))
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_calling_get_velocity_of_another_scheduler_is_refused_too(grade_mutant):
    graded = grade_mutant(LAB, "training_target", """
        from diffusers.schedulers.scheduling_ddim import DDIMScheduler
        if prediction_type != "v_prediction":
            return {"epsilon": noise, "sample": x0, "flow": noise - x0}[prediction_type]
        s = DDIMScheduler(num_train_timesteps=alphas_cumprod.shape[0])
        s.alphas_cumprod = alphas_cumprod
        return s.get_velocity(x0, noise, timesteps)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
