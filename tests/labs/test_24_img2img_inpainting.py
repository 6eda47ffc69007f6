"""Lab 24: wrong-but-plausible implementations fail, and the commonest ones are named."""
from pathlib import Path

from expect import Fails

LAB = "24_img2img_inpainting"
REPO = Path(__file__).resolve().parents[2]


def timesteps_body(sd="max(n - min(int(n * strength), n), 0)", sd3="int(max(n - min(n * strength, n), 0))",
                   begin="t_start * scheduler.order", kept="scheduler.timesteps[begin:]", steps="n - t_start") -> str:
    """A body for img2img_timesteps with one line swapped for a wrong one."""
    return f"""
    n = num_inference_steps
    t_start = {sd3} if pipeline == "sd3" else {sd}
    begin = {begin}
    return {kept}, {steps}, begin
    """


def latents_body(order="sample_first", sample="vae.encode(image).latent_dist.sample(generator)",
                 sd3="(z - vae.config.shift_factor) * vae.config.scaling_factor", sd="z * vae.config.scaling_factor",
                 noised="scheduler.scale_noise(z, timestep, noise) if pipeline == 'sd3' "
                        "else scheduler.add_noise(z, noise, timestep)") -> str:
    """A body for img2img_latents with one line swapped for a wrong one."""
    if order == "sample_first":
        draws = f"z = {sample}\n    noise = torch.randn(z.shape, generator=generator)"
    else:  # the noise's shape read from the encoder's mean, then the noise drawn first
        draws = (f"shape = vae.encode(image).latent_dist.mean.shape\n    noise = torch.randn(shape, generator=generator)"
                 f"\n    z = {sample}")
    return f"""
    {draws}
    z = {sd3} if pipeline == "sd3" else {sd}
    return {noised}
    """


def mask_body(masked="image * (mask < 0.5)", resize="F.interpolate(mask, size=(H // f, W // f))",
              scale="vae.config.scaling_factor", double="do_classifier_free_guidance") -> str:
    """A body for prepare_mask_latents with one line swapped for a wrong one."""
    return f"""
    f = vae_scale_factor(vae)
    H, W = image.shape[-2:]
    m = {resize}
    z = vae.encode({masked}).latent_dist.sample(generator) * {scale}
    if {double}:
        m, z = torch.cat([m] * 2), torch.cat([z] * 2)
    return m, z
    """


def input_body(double="torch.cat([latents] * 2) if do_classifier_free_guidance else latents",
               stack="torch.cat([scheduler.scale_model_input(x, t), mask, masked_image_latents], dim=1)") -> str:
    """A body for inpaint_unet_input with one line swapped for a wrong one."""
    return f"""
    x = {double}
    return {stack}
    """


def blend_body(known="scheduler.add_noise(image_latents, noise, timesteps[i + 1:i + 2])",
               last="i < len(timesteps) - 1", mix="(1 - mask) * known + mask * latents") -> str:
    """A body for blend_known_region with one line swapped for a wrong one."""
    return f"""
    known = image_latents
    if {last}:
        known = {known}
    return {mix}
    """


MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("img2img_timesteps", timesteps_body(sd3="max(n - min(int(n * strength), n), 0)"), "k rounded the other way"),
    ("img2img_timesteps", timesteps_body(sd="int(max(n - min(n * strength, n), 0))"), "k rounded the other way"),
    ("img2img_timesteps", timesteps_body(sd="max(n - min(round(n * strength), n), 0)"), "k rounded the other way"),
    ("img2img_timesteps", timesteps_body(begin="t_start"), "the scheduler's order ignored"),
    ("img2img_timesteps", timesteps_body(kept="scheduler.timesteps[:len(scheduler.timesteps) - begin]"),
     "the head of the schedule kept"),
    ("img2img_timesteps", timesteps_body(steps="len(scheduler.timesteps) - begin"), "steps counted as timesteps"),
    ("img2img_timesteps",  # SD3's start as int(n·(1 − s)): 1 − 0.8 = 0.19999999999999996, so n = 5 keeps 5, not 4
     timesteps_body(sd3="int(n * (1 - strength))"), "SD3's t_start as int(n·(1 − s))"),
    ("img2img_timesteps",  # the slice right, the index returned without the order
     timesteps_body(begin="t_start", kept="scheduler.timesteps[t_start * scheduler.order:]"),
     "begin_index returned as t_start, not t_start·order"),
    ("img2img_timesteps",  # SD's k as the step count for SD3 too
     timesteps_body(steps="min(int(n * strength), n)"), "the step count as int(n·s)"),
    ("img2img_timesteps",  # the kept steps' count returned where the index belongs
     """
     n = num_inference_steps
     t_start = int(max(n - min(n * strength, n), 0)) if pipeline == "sd3" else max(n - min(int(n * strength), n), 0)
     return scheduler.timesteps[t_start * scheduler.order:], n - t_start, n - t_start
     """, Fails("wrong", "")),
    ("img2img_latents", latents_body(order="noise_first"), "the noise drawn before the encoder's sample"),
    ("img2img_latents", latents_body(sample="vae.encode(image).latent_dist.mode()"),
     "the encoder's mean (latent_dist.mode()) instead of a sample"),
    ("img2img_latents", latents_body(sd="z"), "the VAE's scaling_factor forgotten"),
    ("img2img_latents", latents_body(sd3="z * vae.config.scaling_factor - vae.config.shift_factor"),
     "SD3's shift after the scaling"),
    ("img2img_latents", latents_body(sd3="z * vae.config.scaling_factor"), "SD3's shift_factor ignored"),
    ("img2img_latents",  # the latents divided by the scaling factor (the decoder's direction)
     latents_body(sd="z / vae.config.scaling_factor"), "the latents divided by scaling_factor"),
    ("img2img_latents",  # the latent and the noise in each other's place
     latents_body(noised="scheduler.scale_noise(noise, timestep, z) if pipeline == 'sd3' "
                         "else scheduler.add_noise(noise, z, timestep)"),
     "the latent and the noise swapped in add_noise / scale_noise"),
    ("prepare_mask_latents", mask_body(masked="image * mask"), "the masked image keeps the region to repaint"),
    ("prepare_mask_latents", mask_body(resize="F.interpolate(mask, size=(H // f, W // f), mode='bilinear')"),
     "the mask resized bilinearly"),
    ("prepare_mask_latents", mask_body(resize="1 - F.interpolate(mask, size=(H // f, W // f))"),
     "the mask inverted at latent size"),
    ("prepare_mask_latents", mask_body(double="False"), "mask and masked latents not doubled under guidance"),
    ("prepare_mask_latents", mask_body(scale="1.0"), "the masked image's latents not scaled"),
    ("prepare_mask_latents", mask_body().replace("torch.cat([m] * 2), torch.cat([z] * 2)",
                                                 "m.repeat_interleave(2, dim=0), z.repeat_interleave(2, dim=0)"),
     "doubled image by image (repeat_interleave)"),
    ("prepare_mask_latents",  # the mask left at pixel size
     mask_body(resize="mask"), Fails("wrong", "shape")),
    ("inpaint_unet_input",
     input_body(stack="scheduler.scale_model_input(torch.cat([x, mask, masked_image_latents], dim=1), t)"),
     "the whole 9-channel stack scaled"),
    ("inpaint_unet_input",
     input_body(stack="torch.cat([scheduler.scale_model_input(x, t), masked_image_latents, mask], dim=1)"),
     "the channels in another order"),
    ("inpaint_unet_input",
     input_body(double="latents", stack="torch.cat([scheduler.scale_model_input(x, t), mask[:len(x)], "
                                         "masked_image_latents[:len(x)]], dim=1)"),
     "the latents not doubled under guidance"),
    ("inpaint_unet_input",  # the scaling skipped (right for DDIM, whose scale_model_input returns its input)
     input_body(stack="torch.cat([x, mask, masked_image_latents], dim=1)"), "scheduler.scale_model_input skipped"),
    ("blend_known_region", blend_body(last="True", known="scheduler.add_noise(image_latents, noise, "
                                                         "timesteps[min(i + 1, len(timesteps) - 1):][:1])"),
     "the known region noised after the last step too"),
    ("blend_known_region", blend_body(mix="mask * known + (1 - mask) * latents"), "the mask inverted"),
    ("blend_known_region", blend_body(last="i < len(timesteps) - 2"),
     "the known region put back clean one step early"),
    ("blend_known_region", blend_body(known="scheduler.add_noise(image_latents, noise, timesteps[i:i + 1])"),
     "the known region noised to the current timestep"),
    ("blend_known_region",  # the new latents ignored where the model should paint (known everywhere)
     blend_body(mix="known + 0 * latents"), Fails("wrong", "values differ")),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("img2img_timesteps",
     """
     import math
     n = num_inference_steps
     keep = math.floor(n * strength) if pipeline == "sd" else n - int(n - n * strength)
     t_start = n - min(keep, n)
     return scheduler.timesteps[t_start * scheduler.order:], n - t_start, t_start * scheduler.order
     """,
     "the kept count first, then the start (floor is int for the non-negative n·s)"),
    ("img2img_latents",
     """
     dist = vae.encode(image).latent_dist
     z = dist.mean + dist.std * torch.randn(dist.mean.shape, generator=generator)
     shift = vae.config.shift_factor if pipeline == "sd3" else 0.0
     z = (z - shift) * vae.config.scaling_factor
     noise = torch.randn(z.shape, generator=generator)
     return scheduler.scale_noise(z, timestep, noise) if pipeline == "sd3" else scheduler.add_noise(z, noise, timestep)
     """,
     "the posterior sampled by hand: μ + σ·ε with the same draw"),
    ("prepare_mask_latents",
     mask_body(masked="torch.where(mask >= 0.5, torch.zeros_like(image), image)",
               resize="F.interpolate(mask, scale_factor=1 / f, mode='nearest')"),
     "torch.where for the masked image, and a scale factor instead of a size"),
    ("blend_known_region",
     blend_body(mix="known + mask * (latents - known)"),
     "the blend as known + mask·(latents − known)"),
]


def test_another_pipelines_get_timesteps_is_refused_as_the_answer_key(grade_mutant):
    graded = grade_mutant(LAB, "img2img_timesteps", """
        import types
        from diffusers.pipelines.controlnet.pipeline_controlnet_img2img import StableDiffusionControlNetImg2ImgPipeline
        timesteps, steps = StableDiffusionControlNetImg2ImgPipeline.get_timesteps(
            types.SimpleNamespace(scheduler=scheduler), num_inference_steps, strength, "cpu")
        return timesteps, steps, len(scheduler.timesteps) - len(timesteps)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_the_inpainting_pipelines_own_mask_latents_are_refused(grade_mutant):
    graded = grade_mutant(LAB, "prepare_mask_latents", """
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint import (
            StableDiffusionInpaintPipeline as P)
        import types
        owner = types.SimpleNamespace(vae=vae, vae_scale_factor=vae_scale_factor(vae))
        owner._encode_vae_image = lambda image, generator: P._encode_vae_image(owner, image, generator)
        H, W = image.shape[-2:]
        return P.prepare_mask_latents(owner, mask, image * (mask < 0.5), image.shape[0], H, W, image.dtype, "cpu",
                                      generator, do_classifier_free_guidance)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
