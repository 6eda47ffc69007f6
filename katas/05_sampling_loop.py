"""Lab 05 · The sampling loop

Concept:
    Generation is a loop, and the loop is the whole inference trace. Draw pure noise x_T, ask the
    scheduler for its list of timesteps, then for each timestep t call the denoiser once and let the
    scheduler turn its prediction into the next, slightly cleaner sample. Finally map [-1, 1] to [0, 1].
        x_T ~ N(0, I);  for t in τ_1 > τ_2 > … > τ_n:  x ← step(ε_θ(x, t), t, x; z);  image = clamp(x/2 + ½, 0, 1)
    DDPM sampling is Algorithm 2 of Ho et al. 2020; DDIM's update is eq. 12 of Song et al. 2021, whose
    noise scale σ is set by η (eq. 16): η = 0 is deterministic, η = 1 is DDPM-like.

Mental model:
    - scheduler.set_timesteps(n) decides the loop: n timesteps, from noisy (t near T) towards clean
      (t near 0). n is also the cost: one UNet forward per timestep, so 50 steps cost ~5x what 10
      steps cost.
    - The denoiser (here a UNet2DModel) is called exactly once per timestep, with the current sample
      and that timestep t (a value such as 900), not the loop counter.
    - The sample x is the state. Each iteration replaces it with scheduler.step(...).prev_sample.
      Nothing else carries over between iterations.
    - One torch.Generator drives all the randomness: first the initial noise, then the fresh noise that
      DDPM (every step except t = 0) and DDIM with η > 0 (every step) add. Same seed, same image.
    - The pipelines run the loop under torch.no_grad(): inference keeps no autograd graph.
    - DDPM and DDIM start from plain N(0, I) (init_noise_sigma = 1) and their scale_model_input is the
      identity. Euler-type schedulers scale both, from sigmas that set_timesteps computes (with Stable
      Diffusion's "leading" spacing and steps_offset=1, init_noise_sigma drops from 157.4 to 26.0 after
      set_timesteps(5)), so latent pipelines call set_timesteps before they scale the initial noise.
    - Anything that changes the prediction (classifier-free guidance, ControlNet residuals) attaches
      inside this loop, between the UNet call and the scheduler step. Later labs plug in there.

Traps:
    - The loop is not a progress bar: iterating range(n) passes 0, 1, 2, … where the model and the
      scheduler expect the timesteps 900, 800, …, 0.
    - A scheduler keeps the timesteps of its last set_timesteps call. Forget to call it and you run
      whatever schedule a previous generation left behind.
    - Calling the UNet twice per step (say, once for a preview) doubles the cost and changes nothing.
    - scheduler.step without generator= draws its noise from the global RNG: the image is no longer
      reproducible from the seed, and differs from the pipeline's.
    - DDIM's eta is a step argument: forget to pass it on and every run is η = 0.
    - Clamping belongs to the very end. Clamping x to [-1, 1] inside the loop changes every later step.
    - The pipeline draws the initial noise for the whole batch in one torch.randn call. One call per
      image gives other numbers in general (torch's CPU sampler fills blocks of 16 values, so the two
      agree only when C·H·W happens to be a multiple of 16).
    - Changing the timesteps (n, or timestep_spacing) changes the image and the cost, not just speed.

Precision:
    The exception to the course's policy (lab 01 states it), on purpose: initial_noise, sampling_loop
    and generate are graded bit for bit, with no allowance against exact math. This lab is about
    reproducibility: the same generator, drawn from in the same order, and the pipeline's own UNet
    and scheduler give the pipeline's numbers exactly, in float32 and float16 alike; a loop doing any
    other arithmetic is another loop. So keep the noise in the UNet's dtype and do no math of your own
    between the components. The generator is checked too: once the values are right, it must be left
    where the pipeline leaves it (no extra draws, none missing). to_image is one formula and follows
    the policy: (x/2 + ½).clamp(0, 1) computed wider and cast back passes (it is graded against
    exact float64 math as well).

Say it out loud:
    "set_timesteps fixes the loop: n timesteps, noisy to clean, and n UNet calls. I draw the whole
    batch of noise from the generator, then per timestep I call the UNet once on the current sample
    and pass its prediction, t, the sample and the same generator to scheduler.step; prev_sample is
    the new state. Only after the last step do I map x/2 + ½ into [0, 1]. Guidance and control would
    change the prediction inside that loop."

Graded against: diffusers DDPMPipeline and DDIMPipeline (η 0, ½ and 1; float32 and float16; leading,
linspace and trailing spacing) bit for bit, the initial draw they feed their UNet, and
VaeImageProcessor.postprocess, on fresh seeded inputs. The UNet you are given counts its calls.
Run: python -m pytest katas/05_sampling_loop.py
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # type names only: the grader hands you the real objects
    from diffusers.models.unets.unet_2d import UNet2DModel
    from diffusers.schedulers.scheduling_utils import SchedulerMixin


# ---- Worked example --------------------------------------------------------------------------------
def loop_timesteps(scheduler: SchedulerMixin, num_inference_steps: int) -> list[int]:
    """The timesteps a sampling loop of `num_inference_steps` steps visits, in order.

    set_timesteps(n) writes them into scheduler.timesteps (a 1-D int64 tensor, noisy to clean) and the
    scheduler keeps them until the next call. With DDPMScheduler's default "leading" spacing over 1000
    training steps, n = 10 gives [900, 800, …, 100, 0]; DDIMScheduler(timestep_spacing="trailing") at
    n = 7 gives [999, 856, 713, 570, 428, 285, 142]. The loop length, and its cost in UNet calls, is
    len(scheduler.timesteps) == n.
    """
    scheduler.set_timesteps(num_inference_steps)
    return scheduler.timesteps.tolist()


# ---- Your turn -------------------------------------------------------------------------------------
def initial_noise(
    batch_size: int, channels: int, size: int, generator: torch.Generator, dtype: torch.dtype
) -> torch.Tensor:
    """x_T: the pure Gaussian noise a pixel-space pipeline starts from.

    Graded against: the first sample DDPMPipeline / DDIMPipeline feed their UNet
    (diffusers.utils.torch_utils.randn_tensor).
    Args:
        batch_size, channels, size: the shape (B, C, size, size); a pipeline reads C and size from
                                    unet.config.in_channels and unet.config.sample_size
        generator:                  the torch.Generator that will also drive the loop
        dtype:                      the UNet's dtype (unet.dtype), float32 or float16
    Returns: (B, C, size, size) standard normal noise in `dtype`.
    """
    # TODO: one torch.randn call for the whole batch, from the generator, in the given dtype
    raise NotImplementedError


def sampling_loop(
    unet: UNet2DModel,
    scheduler: SchedulerMixin,
    noise: torch.Tensor,
    num_inference_steps: int,
    generator: torch.Generator,
    eta: float | None = None,
) -> torch.Tensor:
    """Run the denoising loop from x_T = noise down to x_0, exactly as the DDPM/DDIM pipelines do.

    Graded against: DDPMPipeline.__call__ and DDIMPipeline.__call__ (the sample before its final clamp).
    Args:
        unet:                a UNet2DModel: unet(x, t).sample is its prediction (ε̂ for the default
                             prediction_type="epsilon"; the scheduler knows which), shaped like x
        scheduler:           a DDPMScheduler or DDIMScheduler; it may still hold the timesteps of an
                             earlier run
        noise:               (B, C, H, W) x_T, from initial_noise, in unet.dtype
        num_inference_steps: n, the number of steps (and UNet calls)
        generator:           the same generator that drew `noise`; scheduler.step draws from it
        eta:                 DDIM's η, passed on to scheduler.step; None for schedulers without one (DDPM)
    Returns: (B, C, H, W) x_0 in noise.dtype, not clamped (values may leave [-1, 1]).
    """
    # TODO: set_timesteps(n); for each t in scheduler.timesteps: one UNet call, then x = step(...).prev_sample
    raise NotImplementedError


def to_image(sample: torch.Tensor) -> torch.Tensor:
    """Map the model's [-1, 1] range to image range [0, 1], as output_type="pt" returns it.

    Graded against: DDPMPipeline / DDIMPipeline(output_type="pt").images and
    VaeImageProcessor.postprocess(output_type="pt").
    Args: sample (B, C, H, W), any float dtype.  Returns: (B, C, H, W), same dtype, values in [0, 1].
    """
    # TODO: rescale x/2 + 0.5, then clamp to [0, 1]
    raise NotImplementedError


def generate(
    unet: UNet2DModel,
    scheduler: SchedulerMixin,
    batch_size: int,
    num_inference_steps: int,
    generator: torch.Generator,
    eta: float | None = None,
) -> torch.Tensor:
    """The whole pipeline: initial noise, sampling loop, output stage. Use your three functions.

    Graded against: DDPMPipeline.__call__ / DDIMPipeline.__call__ with output_type="pt".
    Args:
        unet, scheduler, num_inference_steps, generator, eta: as for sampling_loop
        batch_size: B, the number of images
    Returns: (B, C, S, S) images in [0, 1] in unet.dtype, with C = unet.config.in_channels and
    S = unet.config.sample_size.
    """
    # TODO: shape and dtype from the UNet, then initial_noise -> sampling_loop -> to_image, one generator
    raise NotImplementedError
