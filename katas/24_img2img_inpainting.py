"""Lab 24 · Image-to-image and inpainting

Concept:
    Text-to-image starts from pure noise at the first timestep. Image-to-image (SDEdit, Meng et al.
    2022) starts part-way down: it encodes an image, noises it to a timestep chosen by `strength`, and
    runs only the rest of the schedule, so the result keeps the image's layout and repaints its
    details. Inpainting repaints only a masked region and must give back the rest. diffusers does it
    two ways, chosen by the UNet:
        a 9-channel inpainting UNet sees, every step, [latents, mask, masked-image latents] stacked on
        the channel axis (SD-inpainting's training);
        a plain 4-channel UNet denoises the whole latent, and after every step the known region
        (mask 0) is overwritten by the original latents noised to the next timestep (RePaint-style).
    You will write what StableDiffusionImg2ImgPipeline, StableDiffusion3Img2ImgPipeline and
    StableDiffusionInpaintPipeline do between the schedule and the UNet.

Mental model:
    - strength s ∈ [0, 1] is how much of the schedule is run: of n steps, the first n − k are skipped,
      k = int(n·s) in the SD pipelines. s = 1 runs everything (but from the noised image, not pure
      noise, in img2img); s → 0 runs nothing. The skipped steps are the noisiest ones.
    - The first kept timestep is where the image is noised: z_t = add_noise(z₀, ε, t_first) for DDPM-
      family schedulers, scale_noise (x_σ = σ·ε + (1 − σ)·z₀) for flow matching. The scheduler is told
      where it starts (set_begin_index) so that a stateful one (Euler) uses the right σ.
    - Encoding draws: vae.encode(x).latent_dist.sample(generator) takes its ε from the generator
      before the noise does. SD scales the latent by the VAE's scaling_factor; SD3 first subtracts its
      shift_factor.
    - The mask lives in pixels (1 = repaint). The UNet needs it at latent size (nearest-neighbour
      resize, no blur), and the masked image (pixels kept where mask < 0.5) encoded like any image.
      Under classifier-free guidance both are stacked twice, like the latents.
    - A 4-channel UNet's blend after step i: known = add_noise(z₀, ε, t_{i+1}) (the same ε as the
      start), latents = (1 − mask)·known + mask·latents; after the last step, z₀ itself.

Traps:
    - SD3's img2img rounds the other way: t_start = int(n − n·s) there (k = n − t_start), against
      k = int(n·s) in SD's; at n = 10, s = 0.75 that is 8 steps against 7. Float rounding shows too: at
      n = 25, s = 0.56, n·s is 14.000000000000002, so SD3 keeps 15. And n − n·s is not n·(1 − s): at
      n = 5, s = 0.8, 1 − 0.8 = 0.19999999999999996 and int(5·0.2) keeps 5 steps where SD3 keeps 4.
    - A second-order scheduler (Heun, order 2) has two timesteps per step: skip t_start·order.
    - Keeping the head of the schedule: img2img skips the noisiest steps and runs the tail,
      timesteps[t_start·order:]; and it counts steps, not timesteps (Heun has two per step).
    - Drawing the noise before the VAE's sample, or encoding with the mean (mode) instead of a sample.
    - SD3's latents are (z − shift_factor)·scaling_factor, not z·scaling_factor − shift_factor.
    - The masked image keeps the pixels where mask < 0.5 (the known region), not where mask is 1.
    - Resizing the mask bilinearly: F.interpolate's default, nearest, is what the pipeline feeds its UNet.
    - Scaling the 9-channel input after stacking it: scale_model_input scales the latents only (Euler
      divides by √(σ² + 1); the mask and the masked latents must not be).
    - The 4-channel blend at the current timestep instead of the next one, or noising the known region
      after the last step too (the result must end at z₀ there).

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names; compute as wide as
    you like. Everything here is float32; add_noise and scale_noise run in the latents' dtype, the blend
    is one multiply-add. An answer about as close to exact float64 math as diffusers' own passes.

Say it out loud:
    "Strength picks how much of the schedule to run: SD keeps int(n·s) steps, SD3 skips int(n − n·s).
    I encode the image with the generator, scale it (minus SD3's shift first), draw the noise and noise
    the latents to the first kept timestep. For inpainting the mask goes to latent size by nearest
    neighbour and the known pixels are encoded too; a 9-channel UNet gets latents, mask and masked
    latents stacked after scaling, a 4-channel one gets its known region put back, noised to the next
    timestep, after every step."

Graded against: StableDiffusionImg2ImgPipeline and StableDiffusion3Img2ImgPipeline (get_timesteps,
prepare_latents) with DDIM, Euler, Heun and FlowMatchEuler schedulers; StableDiffusionInpaintPipeline
(prepare_mask_latents, and whole runs with a 9-channel and a 4-channel tiny UNet recorded step by step),
on fresh seeded inputs.
Run: python -m pytest katas/24_img2img_inpainting.py
"""
import torch
import torch.nn.functional as F


# ---- Worked example --------------------------------------------------------------------------------
def vae_scale_factor(vae) -> int:
    """Pixels per latent pixel, per side: 2^(number of encoder blocks − 1), as the pipelines compute it."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


# ---- Your turn: image-to-image -------------------------------------------------------------------------
def img2img_timesteps(
    scheduler, num_inference_steps: int, strength: float, pipeline: str = "sd"
) -> tuple[torch.Tensor, int, int]:
    """The part of the schedule an image-to-image call runs.

        "sd":   k = min(int(n·strength), n),  t_start = max(n − k, 0)
        "sd3":  k = min(n·strength, n),       t_start = int(max(n − k, 0))
        timesteps = scheduler.timesteps[t_start·order:],  steps = n − t_start,  begin = t_start·order

    Graded against: StableDiffusionImg2ImgPipeline.get_timesteps ("sd") and
    StableDiffusion3Img2ImgPipeline.get_timesteps ("sd3"), after scheduler.set_timesteps(n)
    Args:
        scheduler:           set_timesteps(num_inference_steps) already called (its .timesteps, .order)
        num_inference_steps: n
        strength:            s ∈ [0, 1]
        pipeline:            "sd" or "sd3" (how k is rounded)
    Returns: (timesteps, steps, begin): the kept timesteps (a tail of scheduler.timesteps), how many
    denoising steps that is, and the index of the first kept timestep (what the pipeline passes to
    scheduler.set_begin_index; return it, do not call it).
    """
    # TODO: how many steps to keep (each pipeline rounds its own way), then skip the rest ×order
    raise NotImplementedError


def img2img_latents(vae, scheduler, image: torch.Tensor, timestep: torch.Tensor, generator: torch.Generator,
                    pipeline: str = "sd") -> torch.Tensor:
    """The starting latents of image-to-image: the image encoded, scaled, and noised to `timestep`.

    1. z = vae.encode(image).latent_dist.sample(generator)
    2. "sd": z·scaling_factor;  "sd3": (z − shift_factor)·scaling_factor   (vae.config)
    3. ε = randn(z.shape) from the same generator
    4. "sd": scheduler.add_noise(z, ε, timestep);  "sd3": scheduler.scale_noise(z, timestep, ε)

    Graded against: StableDiffusionImg2ImgPipeline.prepare_latents ("sd") and
    StableDiffusion3Img2ImgPipeline.prepare_latents ("sd3"); the generator must be left where they leave it.
    Args:
        vae:       an AutoencoderKL (tiny)
        scheduler: after set_timesteps and set_begin_index (as get_timesteps left it)
        image:     (B, 3, H, W) in [−1, 1], float32
        timestep:  (B,) the first kept timestep, once per sample
        generator: the torch.Generator both draws come from
        pipeline:  "sd" or "sd3"
    Returns: (B, C, H/f, W/f) float32.
    """
    # TODO: sample the encoder's distribution first, scale (SD3: shift first), then draw ε and noise
    raise NotImplementedError


# ---- Your turn: inpainting ------------------------------------------------------------------------------
def prepare_mask_latents(vae, image: torch.Tensor, mask: torch.Tensor, generator: torch.Generator,
                         do_classifier_free_guidance: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask at latent size and the masked image's latents, as a 9-channel UNet gets them.

        masked_image = image · (mask < 0.5)                          (pixels kept where the mask is 0)
        mask_latents = F.interpolate(mask, size=(H // f, W // f))   (nearest, F.interpolate's default)
        masked_image_latents = vae.encode(masked_image).latent_dist.sample(generator) · scaling_factor
        under CFG: each stacked twice along the batch, torch.cat([x, x])

    Graded against: StableDiffusionInpaintPipeline.prepare_mask_latents on __call__'s masked image
    Args:
        vae:   an AutoencoderKL (tiny; f = vae_scale_factor(vae))
        image: (B, 3, H, W) in [−1, 1];  mask: (B, 1, H, W) of 0.0 and 1.0 (1 = repaint)
        generator: the encoder's draw comes from it
        do_classifier_free_guidance: stack both twice
    Returns: (mask_latents (B or 2B, 1, H/f, W/f), masked_image_latents (B or 2B, C, H/f, W/f)), float32.
    """
    # TODO: keep the known pixels, encode them; bring the mask to latent size by nearest neighbour
    raise NotImplementedError


def inpaint_unet_input(latents: torch.Tensor, mask: torch.Tensor, masked_image_latents: torch.Tensor, scheduler,
                       t, do_classifier_free_guidance: bool) -> torch.Tensor:
    """What a 9-channel inpainting UNet gets at timestep t.

        x = torch.cat([latents] * 2) under CFG, else latents;  x = scheduler.scale_model_input(x, t)
        return torch.cat([x, mask, masked_image_latents], dim=1)

    Graded against: StableDiffusionInpaintPipeline's UNet input, recorded at every step of runs with a
    9-channel tiny UNet (DDIM and Euler; with and without guidance)
    Args:
        latents:              (B, 4, h, w) the current latents
        mask:                 (B or 2B, 1, h, w) and masked_image_latents (B or 2B, 4, h, w): from
                              prepare_mask_latents (already doubled under CFG)
        scheduler:            the pipeline's scheduler at this step (scale_model_input)
        t:                    the current timestep
    Returns: (B or 2B, 9, h, w).
    """
    # TODO: double for CFG, scale the latents alone, then stack latents, mask, masked latents
    raise NotImplementedError


def blend_known_region(latents: torch.Tensor, image_latents: torch.Tensor, noise: torch.Tensor, mask: torch.Tensor,
                       scheduler, timesteps: torch.Tensor, i: int) -> torch.Tensor:
    """A 4-channel UNet's inpainting, after scheduler.step at step i: put the known region back.

        known = image_latents                                       after the last step (i = len − 1)
        known = scheduler.add_noise(image_latents, noise, timesteps[i + 1:i + 2])   otherwise
        return (1 − mask)·known + mask·latents

    Graded against: StableDiffusionInpaintPipeline with a 4-channel tiny UNet, every step of its runs
    (DDIM and Euler; with and without guidance)
    Args:
        latents:       (B, 4, h, w) scheduler.step's output at step i
        image_latents: (B, 4, h, w) the encoded image (scaled);  noise: (B, 4, h, w) the start's ε
        mask:          (B, 1, h, w) at latent size, 1 = repaint (the first half under CFG)
        scheduler:     the pipeline's scheduler (add_noise);  timesteps: the kept timesteps;  i: this step
    Returns: (B, 4, h, w).
    """
    # TODO: the known region noised to where the loop goes next (clean after the last step), mixed in
    raise NotImplementedError
