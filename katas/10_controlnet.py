"""Lab 10 · ControlNet conditioning

Concept:
    ControlNet adds spatial control (edges, pose, depth) to a frozen text-to-image UNet without
    touching its weights. A trainable copy of the UNet's encoder (down blocks + mid block) reads the
    noisy latent plus an embedded control image; each of its skip features passes through its own
    zero-initialised 1×1 convolution, and the results are added to the frozen UNet's skip connections
    and to its mid-block output (Zhang, Rao & Agrawala 2023, eq. 2):
        y_c = F(x; Θ) + Z(F(x + Z(c; Θ_z1); Θ_c); Θ_z2)
    F is the frozen block, Θ_c its trainable copy, Z a zero convolution, c the control image.

Mental model:
    - The base UNet is unchanged. ControlNet only hands it tensors: one residual per skip connection
      (conv_in's output, then every resnet and downsampler output: 12 for SD 1.5) plus one for the mid
      block. The control image reaches the base UNet only through those residuals.
    - Where they go: a down residual is added to its skip tensor, the one the matching up block
      concatenates later, not to the hidden state running down the encoder. The mid residual is added
      to the mid block's output, after the mid block has run.
    - Zero convolutions: every 1×1 output conv starts with zero weight and bias (so does the last conv
      of the control-image embedding), so a freshly built ControlNet adds exact zeros and the UNet's
      output is bitwise what it was without it. The gradient of a zero conv's weight is not 0
      (∂y/∂W = x), so training moves it away from zero.
    - conditioning_scale multiplies every residual: it sets how strong the control is. Guess mode
      instead uses a ladder, scale · logspace(−1, 0, n + 1): 0.1 on the shallowest skip, rising to
      1.0 on the mid block. Under classifier-free guidance, guess mode runs ControlNet on the
      conditional half only and adds zeros to the unconditional half.
    - Cost: a second encoder's weights stay in memory (about 360M parameters for an SD 1.5 ControlNet,
      next to the 860M-parameter UNet), and every denoising step runs that encoder once more.

Traps:
    - A down residual added to the running hidden state instead of the skip tensor.
    - The mid residual added to the mid block's input instead of its output.
    - Guess-mode scales reversed: the mid block gets 1.0 · scale and conv_in's skip gets 0.1 · scale,
      not the other way round.
    - conditioning_scale applied to the mid residual only; in guess mode it multiplies the whole ladder.
    - The residuals in the wrong order. They follow the skips in the order the down path makes them,
      shallowest first; the up blocks read them from the end.
    - Under CFG: the control image is duplicated for both halves. In guess mode the zeros go to the
      unconditional (first) half.

Precision:
    The course's one policy (lab 01 states it): return the dtype of the tensors you are given, and
    compute as wide as you like; every check also knows the exact answer on the same inputs (the same
    math in float64: the 1×1 convs, the residual scales, the mid block and the whole ControlNet + CFG
    step on float64 copies of the same models and scheduler tables) and accepts anything about as
    close to it as diffusers' own answer. diffusers builds the guess-mode ladder with a float32
    logspace and scales float16 residuals in float16; a ladder in float64, or scaling in float32 and
    casting once, passes. Adding the residuals is graded bit for bit: one addition of two tensors
    rounds the same however wide you compute it, so the UNet sees exactly what it would see.

Say it out loud:
    "ControlNet is a trainable copy of the UNet's encoder that sees the control image. Each of its
    skip features goes through a zero-initialised 1×1 conv and gets added to the matching skip
    connection of the frozen UNet; one more goes onto the mid block's output. Scale them all by
    conditioning_scale; in guess mode use a 0.1 → 1 ladder, run it on the conditional half only and
    give the unconditional half zeros. At init it adds exact zeros, so it starts from the base model."

Graded against: diffusers ControlNetModel.forward (zero convs, conditioning_scale, guess mode),
UNet2DConditionModel.forward (down_block_additional_residuals, mid_block_additional_residual) and
StableDiffusionControlNetPipeline (one ControlNet + CFG denoising step), on tiny random-weight models
built on the spot; the zero convolutions are randomised so that the residuals are not all zero.
Run: python -m pytest katas/10_controlnet.py
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:  # types only: the kata never runs diffusers code of its own
    from diffusers.models.controlnets.controlnet import ControlNetModel
    from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler
    from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler


# ---- Worked example --------------------------------------------------------------------------------
def count_control_residuals(layers_per_block: int, num_down_blocks: int) -> int:
    """How many down residuals a ControlNet returns: one per skip connection of the UNet.

    conv_in's output is the first skip. Each down block adds one skip per resnet, and every block
    but the last adds one more for its downsampler. SD 1.5 (2 layers, 4 blocks): 1 + 8 + 3 = 12.
    Guess mode spreads its ladder over these plus the mid residual: 13 scales for SD 1.5.
    """
    return 1 + layers_per_block * num_down_blocks + (num_down_blocks - 1)


# ---- Your turn -------------------------------------------------------------------------------------
def zero_conv(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """ControlNet's "zero convolution": a 1×1 conv, a linear map over channels at every pixel.

    y[b, o, h, w] = Σ_c weight[o, c, 0, 0] · features[b, c, h, w] + bias[o]
    Both weight and bias start at zero, so at init y is exactly 0 whatever the features are.
    Graded against: ControlNetModel.controlnet_down_blocks[i] and .controlnet_mid_block (nn.Conv2d,
    kernel 1), randomised and freshly initialised. Write it as a matrix product: F.conv2d and
    nn.Conv2d are locked while it is graded.
    Args:
        features: (B, C, H, W) a skip feature of the ControlNet's encoder, float32 or float16
        weight:   (C_out, C, 1, 1) same dtype
        bias:     (C_out,) same dtype
    Returns: (B, C_out, H, W), dtype of features.
    """
    # TODO: drop the 1×1 kernel dims, mix channels at every pixel (einsum), add the bias per output channel
    raise NotImplementedError


def scale_control_residuals(
    down_residuals: list[torch.Tensor],
    mid_residual: torch.Tensor,
    conditioning_scale: float,
    guess_mode: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Scale the ControlNet's residuals, as the last step of ControlNetModel.forward does.

    Normal mode: every residual × conditioning_scale.
    Guess mode:  s = logspace(−1, 0, n + 1) · conditioning_scale  (n = number of down residuals);
                 down_residuals[i] × s[i], mid_residual × s[n] (the last, largest one).
    Graded against: ControlNetModel.forward(..., conditioning_scale=, guess_mode=), given the raw
    residuals it returns at conditioning_scale=1.0.
    Args:
        down_residuals:     list of n tensors (B, C_i, H_i, W_i), shallowest skip first
        mid_residual:       (B, C_mid, H_mid, W_mid)
        conditioning_scale: how strongly the control image steers the UNet (1.0 = as trained)
        guess_mode:         use the 0.1 → 1 ladder instead of one flat scale
    Returns: (list of n scaled down residuals, scaled mid residual), dtypes unchanged.
    """
    # TODO: flat scale for everything, or a logspace ladder of n + 1 scales whose last entry goes to the mid residual
    raise NotImplementedError


def add_control_residuals(
    skip_samples: tuple[torch.Tensor, ...],
    mid_input: torch.Tensor,
    mid_block: Callable[[torch.Tensor], torch.Tensor],
    down_residuals: list[torch.Tensor],
    mid_residual: torch.Tensor,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """Finish the UNet's down path with ControlNet: what its up blocks receive.

    The UNet's down path has run: it made the skip tensors and the hidden state that enters the mid
    block. Add each down residual to its skip; run the mid block; add the mid residual to its output.
    Graded against: UNet2DConditionModel.forward(..., down_block_additional_residuals=,
    mid_block_additional_residual=), by recording what its up blocks are given.
    Args:
        skip_samples:   n tensors (B, C_i, H_i, W_i): conv_in's output, then each resnet and
                        downsampler output, in the order the down path made them
        mid_input:      (B, C_mid, h, w) the hidden state leaving the last down block
        mid_block:      the UNet's mid block, with the timestep embedding and the text already bound:
                        mid_block(h) -> (B, C_mid, h, w)
        down_residuals: n tensors, the same shapes as skip_samples, in the same order
        mid_residual:   (B, C_mid, h, w)
    Returns: (the n skip tensors the up blocks will concatenate, in down-path order;
              the hidden state entering the first up block).
    """
    # TODO: each down residual onto its own skip (new tensors, same order); the mid residual onto the mid block's output
    raise NotImplementedError


def controlnet_cfg_step(
    unet: UNet2DConditionModel,
    controlnet: ControlNetModel,
    scheduler: DDIMScheduler | EulerDiscreteScheduler,
    latents: torch.Tensor,
    timestep: torch.Tensor,
    prompt_embeds: torch.Tensor,
    negative_prompt_embeds: torch.Tensor,
    control_image: torch.Tensor,
    guidance_scale: float,
    conditioning_scale: float,
    guess_mode: bool,
) -> torch.Tensor:
    """One denoising step of StableDiffusionControlNetPipeline, with classifier-free guidance.

    ControlNet gives the residuals, the UNet predicts the noise for the unconditional and the
    conditional half in one batch, guidance combines them, the scheduler steps.
    Guess mode: run ControlNet on the conditional half only (latents and prompt_embeds) and give the
    unconditional half zero residuals.
    Graded against: StableDiffusionControlNetPipeline.__call__, step by step over its timesteps.
    Args:
        unet, controlnet, scheduler: the pipeline's models and its scheduler, DDIM or Euler (call them:
                        controlnet(x, t, encoder_hidden_states=, controlnet_cond=, conditioning_scale=,
                        guess_mode=, return_dict=False) -> (down residuals, mid residual);
                        unet(x, t, encoder_hidden_states=, down_block_additional_residuals=,
                        mid_block_additional_residual=).sample;
                        scheduler.scale_model_input(x, t), scheduler.step(noise, t, x).prev_sample)
        latents:        (B, 4, h, w) float32, unscaled (what models see goes through scale_model_input)
        timestep:       an entry of scheduler.timesteps (0-dim; int64 for DDIM, float32 for Euler)
        prompt_embeds, negative_prompt_embeds: (B, L, D)
        control_image:  (B, 3, 2h, 2w) in [0, 1], one per sample (the tiny ControlNet downsamples ×2)
        guidance_scale: CFG weight (> 1)
        conditioning_scale, guess_mode: as in scale_control_residuals (ControlNet applies them)
    Returns: (B, 4, h, w) the latents at the previous timestep.
    """
    # TODO: batch [uncond, cond]; ControlNet on both halves (image duplicated) or, in guess mode, on cond only with zeros for uncond; UNet with the residuals; CFG; scheduler.step
    raise NotImplementedError
