"""Grader for lab 06 · VAE latent space: the scale factor, encode and decode, postprocessing.

References are live diffusers code on tiny random-weight VAEs (plugin/tiny.py): AutoencoderKL,
StableDiffusionPipeline (its vae_scale_factor, and a whole call for decode), the inpaint pipeline's
_encode_vae_image, retrieve_latents and VaeImageProcessor.

Two workarounds live here (the framework has no hook for them yet; the numpy one ends the file):
- numpy outputs ("np", uint8): diffusion_katas.engine.comparison handles tensors, not arrays, so those scenarios compare in
  their `verify` (array -> tensor, then diffusion_katas.engine.comparison.mismatch) and name the kata's traps themselves.
- "sampled without the generator": the learner's draw comes from the global RNG, so each encode
  scenario hands over a global RNG state (Scenario.global_rng), from which the plugin runs the traps: that
  trap's draw is the learner's.

Precision: every float scenario also carries the float64 shadow of diffusers' answer (Scenario.exact):
a float64 copy of the same VAE (copy.deepcopy(vae).double()) on the widened inputs, the posterior sample
taken with diffusers' own draw ε (in the VAE's dtype) widened; the denormalize x·0.5 + 0.5 in float64.
An answer at most 2× as far from it as diffusers' own (+ 2 ulps) passes: upcasting float16 to float32,
decoding a float16 VAE's latents divided by s in float32, or postprocessing a float16 image in float32
for "np". to_uint8 accepts, pixel by pixel, diffusers' level or the level exact math rounds to.
"""
import copy
import types

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import retrieve_latents
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_inpaint import (
    StableDiffusionInpaintPipeline,
)
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusion_katas.engine import tiny
from diffusion_katas.engine.comparison import describe, mismatch
from diffusion_katas.engine.helpers import (DTYPES, EVERY_PIPELINE_CALL, IMAGE_POSTPROCESSING, PIPELINES,
                                           PipelineRecorder, fresh_rng_state, quiet_diffusers, seed_from)
from diffusion_katas.engine.isolation import fresh
from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import EXACT, STEP_MATH, VAE_FORWARD, VAE_HALF, Tol

SD15, SDXL = 0.18215, 0.13025  # the scaling factors of Stable Diffusion 1.x's VAE and SDXL's VAE
PIPELINE_PATH = "diffusers.pipelines.stable_diffusion"


def make_vae(downsample: int, scaling_factor: float = SD15, dtype: str = "float32") -> AutoencoderKL:
    vae = tiny.vae(downsample)
    vae.register_to_config(scaling_factor=scaling_factor)
    return vae.half() if dtype == "float16" else vae


def vae_with_blocks(n: int) -> AutoencoderKL:
    channels = (4, 8, 8, 16, 16)[-n:]
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=tiny.LATENT_CHANNELS, block_out_channels=channels,
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        layers_per_block=1, norm_num_groups=4, sample_size=32,
    ).eval()


# ---- vae_scale_factor -------------------------------------------------------------------------------
vae_scale_factor = Kata(
    "vae_scale_factor",
    hints=(
        "Count the halvings: each encoder block ends in a stride-2 downsampler, except the last one.",
        "f = 2^(n − 1) for n = len(block_out_channels): 4 blocks (Stable Diffusion) give 8.",
        "return 2 ** (len(block_out_channels) - 1)",
    ),
    # the pipelines compute it inline in __init__ from vae.config.block_out_channels: building one is a route, as
    # the modular pipelines' vae_scale_factor property is
    answer_key=(f"{PIPELINES}:*Pipeline*.__init__", f"{PIPELINES}:*.vae_scale_factor",
                "diffusers.modular_pipelines.**:*.vae_scale_factor"),
)


@vae_scale_factor.check("vs StableDiffusionPipeline.vae_scale_factor",
                        cases=[dict(blocks=n) for n in (1, 2, 3, 4, 5)], tol=EXACT)
def _(case, g):
    vae = vae_with_blocks(case["blocks"])
    pipe = tiny.sd_pipeline(EulerDiscreteScheduler(), vae_model=vae)
    return Scenario(inputs=dict(block_out_channels=tuple(vae.config.block_out_channels)),
                    expected=pipe.vae_scale_factor)


@vae_scale_factor.check("vs the encoder's real downsampling", cases=[dict(blocks=n) for n in (2, 3, 4)],
                        tol=EXACT)
def _(case, g):
    vae = vae_with_blocks(case["blocks"])
    with torch.no_grad():
        latent = vae.encode(torch.randn(1, 3, 32, 32, generator=g)).latent_dist.mode()
    return Scenario(inputs=dict(block_out_channels=tuple(vae.config.block_out_channels)),
                    expected=32 // latent.shape[-1], label=f"a 32×32 image encodes to {latent.shape[-1]}×"
                                                           f"{latent.shape[-2]}")


@vae_scale_factor.trap("one halving per block, the last block counted too (2 ** len)",
                       hint="The last encoder block has no downsampler: n blocks halve H and W n − 1 times.")
def _(block_out_channels):
    return 2 ** len(block_out_channels)


@vae_scale_factor.trap("2·(n − 1) instead of 2^(n − 1)",
                       hint="Each downsampling block halves H and W again: the factors multiply, 2·2·… = 2^(n − 1). "
                            "2·(n − 1) agrees only for 2 and 3 blocks.")
def _(block_out_channels):
    return 2 * (len(block_out_channels) - 1)


@vae_scale_factor.trap("2·n (twice the number of blocks) instead of 2^(n − 1)",
                       hint="Each downsampling block halves H and W: the factors multiply, 2^(n − 1) for n blocks "
                            "(the last block has no downsampler). 2·n is 8 only for SD's four blocks.")
def _(block_out_channels):
    return 2 * len(block_out_channels)


@vae_scale_factor.trap("2 ** (the number of distinct widths): repeated widths counted once",
                       hint="Count the blocks, not the distinct widths: SD's (128, 256, 512, 512) has 4 blocks and 3 "
                            "downsamplers (f = 8, where 3 distinct widths give 8 by luck); (8, 8, 16, 16) has 4 blocks, "
                            "f = 8, not 4.")
def _(block_out_channels):
    return 2 ** len(set(block_out_channels))


@vae_scale_factor.trap("one halving per change of width (repeated widths not downsampled)",
                       hint="Every block but the last downsamples, whether or not its width changes: SD's (128, 256, "
                            "512, 512) halves three times (f = 8), not two.")
def _(block_out_channels):
    return 2 ** sum(a != b for a, b in zip(block_out_channels, block_out_channels[1:]))


@vae_scale_factor.trap("a hard-coded 8",
                       hint="8 is Stable Diffusion's VAE; compute f from the config so any VAE works.")
def _(block_out_channels):
    return 8


# ---- encode_latents ---------------------------------------------------------------------------------
ENCODE_CASES = [
    dict(vae="x2", shape=(2, 3, 32, 32), scaling_factor=SD15, dtype="float32"),
    dict(vae="x8", shape=(1, 3, 64, 48), scaling_factor=SDXL, dtype="float32"),
    dict(vae="x2", shape=(3, 3, 24, 40), scaling_factor=SD15, dtype="float16"),
]


def encode_scenario(case, g, sample_posterior: bool, with_generator: bool = True) -> Scenario:
    vae = make_vae(int(case["vae"][1:]), case["scaling_factor"], case["dtype"])
    images = (torch.rand(case["shape"], generator=g) * 2 - 1).to(DTYPES[case["dtype"]])
    seed = seed_from(g)
    drawn = torch.Generator().manual_seed(seed)  # the reference's generator: its state after the call
    with torch.no_grad():
        if sample_posterior:
            owner = types.SimpleNamespace(vae=vae)  # the method only reads self.vae
            expected = StableDiffusionInpaintPipeline._encode_vae_image(owner, images.clone(), generator=drawn)
        else:
            expected = retrieve_latents(vae.encode(images.clone()), sample_mode="argmax") * vae.config.scaling_factor
        # the shadow: a float64 VAE's posterior, sampled with diffusers' own draw ε widened
        posterior = vae64(vae).encode(images.double()).latent_dist
        z = posterior.mean
        if sample_posterior:
            eps = randn_tensor(z.shape, generator=torch.Generator().manual_seed(seed), dtype=vae.dtype)
            z = z + posterior.std * eps.double()
        exact = z * vae.config.scaling_factor
    state = fresh_rng_state()  # the learner's call (and the traps) start from it: a draw without `generator=` is named
    generator = torch.Generator().manual_seed(seed) if with_generator else None
    return Scenario(
        inputs=dict(vae=vae, images=images, generator=generator, sample_posterior=sample_posterior),
        expected=expected, exact=exact, label=f"scaling_factor {case['scaling_factor']}",
        generators_after={"generator": drawn} if with_generator else None, global_rng=state)


def vae64(vae):
    """A float64 copy of the VAE: the shadow's model."""
    return copy.deepcopy(vae).double()


encode_latents = Kata(
    "encode_latents",
    hints=(
        "vae.encode(images) gives a distribution, not a tensor: take a sample or its mode, then scale.",
        "z = s·(μ + σ·ε) with ε from `generator`, or z = s·μ; s = vae.config.scaling_factor.",
        "posterior = vae.encode(images).latent_dist; "
        "z = posterior.sample(generator) if sample_posterior else posterior.mode(); "
        "return z * vae.config.scaling_factor",
    ),
    answer_key=(f"{PIPELINE_PATH}.pipeline_stable_diffusion_inpaint.StableDiffusionInpaintPipeline._encode_vae_image",
                f"{PIPELINE_PATH}.pipeline_stable_diffusion_inpaint.retrieve_latents",
                f"{PIPELINE_PATH}.pipeline_stable_diffusion_img2img.retrieve_latents",
                f"{PIPELINE_PATH}.pipeline_stable_diffusion_img2img.StableDiffusionImg2ImgPipeline.prepare_latents",
                f"{PIPELINES}:retrieve_latents", f"{PIPELINES}:*Pipeline*._encode_vae_image",
                f"{PIPELINES}:*Pipeline*.prepare_latents"),  # every pipeline that encodes an image
)


@encode_latents.check("vs _encode_vae_image, sampled", cases=ENCODE_CASES, tol=VAE_FORWARD)
def _(case, g):
    return encode_scenario(case, g, sample_posterior=True)


@encode_latents.check("vs retrieve_latents(argmax) · s, the mode",
                      cases=[dict(ENCODE_CASES[0], generator=True), dict(ENCODE_CASES[1], generator=False),
                             dict(ENCODE_CASES[2], generator=False)], tol=VAE_FORWARD)
def _(case, g):
    return encode_scenario(case, g, sample_posterior=False, with_generator=case["generator"])


def _posterior(vae, images):
    return vae.encode(images).latent_dist


def _sampled_posterior(vae, images, sample_posterior):
    """The posterior, for a trap whose mistake is in how a sample is drawn (none where the mode was asked for)."""
    if not sample_posterior:
        raise LookupError("only meaningful for a sampled scenario")
    return _posterior(vae, images)


@encode_latents.trap("the scaling factor forgotten",
                     hint="The UNet works on unit-variance latents: multiply by vae.config.scaling_factor.")
def _(vae, images, generator=None, sample_posterior=True):
    p = _posterior(vae, images)
    return p.sample(generator) if sample_posterior else p.mode()


@encode_latents.trap("divided by the scaling factor (that is the decode side)",
                     hint="Encoding multiplies by the scaling factor; decoding divides it back out.")
def _(vae, images, generator=None, sample_posterior=True):
    p = _posterior(vae, images)
    return (p.sample(generator) if sample_posterior else p.mode()) / vae.config.scaling_factor


@encode_latents.trap("ε scaled by the variance, not the standard deviation: μ + σ²·ε",
                     hint="A sample of N(μ, σ²) is μ + σ·ε: latent_dist.std, not latent_dist.var (or sample(generator)).")
def _(vae, images, generator=None, sample_posterior=True):
    p = _sampled_posterior(vae, images, sample_posterior)
    eps = randn_tensor(p.mean.shape, generator=generator, device=p.mean.device, dtype=p.mean.dtype)
    return (p.mean + p.var * eps) * vae.config.scaling_factor


@encode_latents.trap("ε drawn in float64: other numbers than diffusers' draw in the VAE's dtype",
                     hint="The same generator gives other numbers in another dtype: draw ε as diffusers does, in the "
                          "posterior's dtype (latent_dist.sample(generator)), then compute as wide as you like.")
def _(vae, images, generator=None, sample_posterior=True):
    p = _sampled_posterior(vae, images, sample_posterior)
    eps = torch.randn(p.mean.shape, generator=generator, device=p.mean.device, dtype=torch.float64)
    return ((p.mean.double() + p.std.double() * eps) * vae.config.scaling_factor).to(images.dtype)


@encode_latents.trap("the scaling factor applied to μ only: s·μ + σ·ε",
                     hint="Scale the whole sample: (μ + σ·ε)·s. The noise is part of the latent the UNet sees, and "
                          "it must be on the same unit-variance scale.")
def _(vae, images, generator=None, sample_posterior=True):
    p = _sampled_posterior(vae, images, sample_posterior)
    eps = randn_tensor(p.mean.shape, generator=generator, device=p.mean.device, dtype=p.mean.dtype)
    return p.mean * vae.config.scaling_factor + p.std * eps


@encode_latents.trap("a hard-coded 0.18215",
                     hint="0.18215 is Stable Diffusion 1.x's factor; this VAE's is vae.config.scaling_factor.")
def _(vae, images, generator=None, sample_posterior=True):
    p = _posterior(vae, images)
    return (p.sample(generator) if sample_posterior else p.mode()) * SD15


@encode_latents.trap("the mode taken when a sample was asked for",
                     hint="sample_posterior=True means a draw μ + σ·ε: latent_dist.sample(generator).")
def _(vae, images, generator=None, sample_posterior=True):
    return _posterior(vae, images).mode() * vae.config.scaling_factor


@encode_latents.trap("a sample drawn when the mode was asked for",
                     hint="sample_posterior=False means the deterministic mode μ: latent_dist.mode().")
def _(vae, images, generator=None, sample_posterior=True):
    # without a generator, a draw from the global RNG: traps start from the state the learner's call started from
    return _posterior(vae, images).sample(generator) * vae.config.scaling_factor


@encode_latents.trap("sampled without the generator (from the global RNG)",
                     hint="Pass the generator: latent_dist.sample(generator). Without it ε comes from the global "
                          "RNG, and the same seed no longer gives the same latents.")
def _(vae, images, generator=None, sample_posterior=True):
    return _sampled_posterior(vae, images, sample_posterior).sample() * vae.config.scaling_factor


# ---- decode_latents ---------------------------------------------------------------------------------
decode_latents = Kata(
    "decode_latents",
    hints=(
        "The loop's latents carry the scaling factor the encoder put in: take it out, then decode.",
        "x̂ = D(z / s) with s = vae.config.scaling_factor; decode() returns an object whose .sample is x̂.",
        "return vae.decode(latents / vae.config.scaling_factor).sample",
    ),
    answer_key=(f"{PIPELINE_PATH}.pipeline_stable_diffusion.StableDiffusionPipeline.decode_latents",
                f"{PIPELINES}:*Pipeline*.decode_latents", EVERY_PIPELINE_CALL),
)


def decode_scenario(case, g) -> Scenario:
    vae = make_vae(int(case["vae"][1:]), case["scaling_factor"], case["dtype"])
    latents = torch.randn(case["shape"], generator=g).to(DTYPES[case["dtype"]])
    with torch.no_grad():  # the line in StableDiffusionPipeline.__call__ that turns latents into pixels
        expected = vae.decode(latents.clone() / vae.config.scaling_factor, return_dict=False)[0]
    return Scenario(inputs=dict(vae=vae, latents=latents), expected=expected, exact=decode_shadow(vae, latents),
                    label=f"scaling_factor {case['scaling_factor']}")


@decode_latents.check("vs the pipeline's decode step",
                      cases=[dict(vae="x2", shape=(2, 4, 16, 16), scaling_factor=SD15, dtype="float32"),
                             dict(vae="x8", shape=(1, 4, 8, 12), scaling_factor=SDXL, dtype="float32")],
                      tol=VAE_FORWARD)
def _(case, g):
    return decode_scenario(case, g)


@decode_latents.check("vs the pipeline's decode step, float16",
                      cases=[dict(vae="x2", shape=(3, 4, 12, 8), scaling_factor=SD15, dtype="float16"),
                             dict(vae="x8", shape=(2, 4, 8, 8), scaling_factor=SDXL, dtype="float16")],
                      tol=VAE_HALF)
def _(case, g):
    return decode_scenario(case, g)


@decode_latents.check("vs StableDiffusionPipeline, end to end",
                      cases=[dict(vae="x2", batch=2), dict(vae="x8", batch=1)], tol=VAE_FORWARD)
def _(case, g):
    # A whole (2-step) pipeline call: the recorder keeps the final latents (the last scheduler.step output).
    pipe = tiny.sd_pipeline(EulerDiscreteScheduler(), vae_model=make_vae(int(case["vae"][1:])))
    seen = {}  # PipelineRecorder records the denoiser, not the VAE: a hook of our own keeps the decoder's output
    hook = pipe.vae.decoder.register_forward_hook(lambda m, args, out: seen.__setitem__("pixels", out.clone()))
    try:
        with PipelineRecorder(pipe, pipe.unet) as rec, quiet_diffusers():
            pipe(prompt_embeds=tiny.text_embeddings(case["batch"], g), guidance_scale=1.0, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(seed_from(g)), output_type="pt")
    finally:
        hook.remove()
    return Scenario(inputs=dict(vae=pipe.vae, latents=rec.final), expected=seen["pixels"],
                    exact=decode_shadow(pipe.vae, rec.final),
                    label="the final latents of a 2-step StableDiffusionPipeline call")


@torch.no_grad()
def decode_shadow(vae, latents):
    """D(z / s) by a float64 copy of the VAE on the widened latents."""
    return vae64(vae).decode(latents.double() / vae.config.scaling_factor).sample


def _decoded(vae, latents, scale):
    return vae.decode(latents * scale).sample


@decode_latents.trap("multiplied by the scaling factor instead of dividing",
                     hint="The encoder multiplied by s; the decoder needs it divided back out: latents / s.")
def _(vae, latents):
    return _decoded(vae, latents, vae.config.scaling_factor)


@decode_latents.trap("the decoder's output clamped to [−1, 1]",
                     hint="decode_latents returns what the decoder makes, overshoot included; clamping belongs to "
                          "postprocess, after the shift to [0, 1].")
def _(vae, latents):
    return _decoded(vae, latents, 1 / vae.config.scaling_factor).clamp(-1, 1)


@decode_latents.trap("the scaling factor not undone",
                     hint="Divide the latents by vae.config.scaling_factor before decoding.")
def _(vae, latents):
    return _decoded(vae, latents, 1.0)


@decode_latents.trap("a hard-coded 0.18215",
                     hint="Each VAE has its own factor: divide by vae.config.scaling_factor.")
def _(vae, latents):
    return vae.decode(latents / SD15).sample


@decode_latents.trap("postprocessed to [0, 1] already",
                     hint="Return the decoder's raw output (about [−1, 1]); postprocess is its own step.")
def _(vae, latents):
    return (vae.decode(latents / vae.config.scaling_factor).sample * 0.5 + 0.5).clamp(0, 1)


# ---- postprocess and to_uint8: shared inputs ----------------------------------------------------------
def decoder_like(shape, dtype: str, g) -> torch.Tensor:
    """Images as a decoder leaves them: about [−1, 1], a good share overshooting it."""
    return (torch.randn(shape, generator=g) * 0.8).to(DTYPES[dtype])


PROCESSOR = VaeImageProcessor(vae_scale_factor=8)
PROCESSOR_PATH = "diffusers.image_processor.VaeImageProcessor"

postprocess = Kata(
    "postprocess",
    hints=(
        "Undo the encoder-side normalization 2x − 1, keep the result inside [0, 1]; numpy wants channels last.",
        "pt: clamp(x·0.5 + 0.5, 0, 1) in the input's dtype; np: the same, permuted to (B, H, W, 3), "
        "float32, as numpy.",
        "x = (images * 0.5 + 0.5).clamp(0, 1); return x if output_type == 'pt' else "
        "x.cpu().permute(0, 2, 3, 1).float().numpy()",
    ),
    answer_key=(f"{PROCESSOR_PATH}.postprocess", f"{PROCESSOR_PATH}.denormalize", f"{PROCESSOR_PATH}.pt_to_numpy",
                *IMAGE_POSTPROCESSING),
)


@postprocess.check("vs VaeImageProcessor.postprocess",
                   cases=[dict(output_type="pt", shape=(2, 3, 16, 16), dtype="float32"),
                          dict(output_type="pt", shape=(1, 3, 8, 24), dtype="float16"),
                          dict(output_type="np", shape=(3, 3, 8, 24), dtype="float32"),
                          dict(output_type="np", shape=(2, 3, 16, 16), dtype="float16")], tol=STEP_MATH)
def _(case, g):
    images = decoder_like(case["shape"], case["dtype"], g)
    inputs = dict(images=images, output_type=case["output_type"])
    expected = PROCESSOR.postprocess(images.clone(), output_type=case["output_type"])
    exact = denormalize_shadow(images)
    if case["output_type"] == "np":
        return array_scenario(postprocess, inputs, expected, STEP_MATH, "output_type 'np'",
                              exact=exact.permute(0, 2, 3, 1))
    return Scenario(inputs=inputs, expected=expected, exact=exact, label="output_type 'pt'")


def denormalize_shadow(images):
    """(x·0.5 + 0.5).clamp(0, 1) in float64."""
    return (images.double() * 0.5 + 0.5).clamp(0, 1)


@postprocess.trap("(x + 1)/2 without the clamp",
                  hint="The decoder overshoots [−1, 1]; clamp the result to [0, 1].")
def _(images, output_type="pt"):
    x = (images + 1) / 2
    return x if output_type == "pt" else x.cpu().permute(0, 2, 3, 1).float().numpy()


@postprocess.trap("clamped to [0, 1] before the shift",
                  hint="Shift first (x·0.5 + 0.5), then clamp: clamping the raw output cuts off all of [−1, 0].")
def _(images, output_type="pt"):
    x = images.clamp(0, 1) * 0.5 + 0.5
    return x if output_type == "pt" else x.cpu().permute(0, 2, 3, 1).float().numpy()


@postprocess.trap("'np' left channels first (B, 3, H, W)",
                  hint="numpy images are channels last: permute(0, 2, 3, 1) before .numpy().")
def _(images, output_type="pt"):
    x = (images * 0.5 + 0.5).clamp(0, 1)
    return x if output_type == "pt" else x.cpu().float().numpy()


@postprocess.trap("'np' channels last with H and W swapped (permute(0, 3, 2, 1))",
                  hint="(B, 3, H, W) → (B, H, W, 3) is permute(0, 2, 3, 1): H stays before W.")
def _(images, output_type="pt"):
    x = (images * 0.5 + 0.5).clamp(0, 1)
    return x if output_type == "pt" else x.cpu().permute(0, 3, 2, 1).float().numpy()


@postprocess.trap("'np' left in float16",
                  hint="The 'np' output is always float32: .float() before .numpy().")
def _(images, output_type="pt"):
    x = (images * 0.5 + 0.5).clamp(0, 1)
    return x if output_type == "pt" else x.cpu().permute(0, 2, 3, 1).numpy()


to_uint8 = Kata(
    "to_uint8",
    hints=(
        "Postprocess to [0, 1] channels last, then map [0, 1] onto the 256 levels 0 … 255 by rounding.",
        "pixels = round(255 · clamp(x·0.5 + 0.5, 0, 1)), laid out (B, H, W, 3), as uint8.",
        "x = (images * 0.5 + 0.5).clamp(0, 1).cpu().permute(0, 2, 3, 1).float().numpy(); "
        "return (x * 255).round().astype('uint8')",
    ),
    answer_key=(f"{PROCESSOR_PATH}.postprocess", f"{PROCESSOR_PATH}.numpy_to_pil",
                f"{PROCESSOR_PATH}.pt_to_numpy", f"{PROCESSOR_PATH}.denormalize", *IMAGE_POSTPROCESSING),
)


@to_uint8.check("vs VaeImageProcessor.postprocess, pil",
                cases=[dict(shape=(2, 3, 16, 16), dtype="float32"), dict(shape=(3, 3, 24, 8), dtype="float32"),
                       dict(shape=(1, 3, 16, 24), dtype="float16")], tol=EXACT)
def _(case, g):
    images = decoder_like(case["shape"], case["dtype"], g)
    pils = PROCESSOR.postprocess(images.clone(), output_type="pil")
    expected = np.stack([np.asarray(im) for im in pils])  # the pixels the PIL images hold, (B, H, W, 3)
    # exact math's levels: a pixel may round either way where diffusers' float16 rounding crossed a .5
    exact = (denormalize_shadow(images).permute(0, 2, 3, 1).numpy() * 255).round().astype("uint8")
    return array_scenario(to_uint8, dict(images=images), expected, EXACT, "", exact=exact)


def _unit_nhwc(images):
    return (images * 0.5 + 0.5).clamp(0, 1).cpu().permute(0, 2, 3, 1).float().numpy()


@to_uint8.trap("truncated instead of rounded",
               hint="astype('uint8') drops the fraction (254.7 -> 254); round first, as diffusers does.")
def _(images):
    return (_unit_nhwc(images) * 255).astype("uint8")


@to_uint8.trap("no clamp, so overshooting values wrap around",
               hint="Clamp to [0, 1] before scaling: 1.1·255 = 280 does not fit in a uint8 and wraps.")
def _(images):
    with np.errstate(all="ignore"):
        x = (images * 0.5 + 0.5).cpu().permute(0, 2, 3, 1).float().numpy()
        return (x * 255).round().astype(np.int64).astype("uint8")


@to_uint8.trap("scaled by 256 (then clipped to 255) instead of 255",
               hint="[0, 1] maps onto 0 … 255: multiply by 255 and round. ×256 puts every level one step up from "
                    "the middle and needs a clip to keep 1.0 in range.")
def _(images):
    return np.clip(np.round(_unit_nhwc(images) * 256.0), 0, 255).astype("uint8")


@to_uint8.trap("left channels first (B, 3, H, W)",
               hint="PIL and numpy images are channels last: permute(0, 2, 3, 1).")
def _(images):
    return ((images * 0.5 + 0.5).clamp(0, 1).cpu().float().numpy() * 255).round().astype("uint8")


# ---- numpy outputs: compared in `verify`, traps named there (after the katas: used at run time) -----
class _CheckedInVerify:
    """The `expected` of a numpy scenario: its verify already compared the array, so this equals it."""

    __array_ufunc__ = None  # makes `ndarray == self` defer to __eq__ below instead of broadcasting

    def __eq__(self, other):
        return True

    def __repr__(self):
        return "the array checked above"


def array_problem(out, expected: np.ndarray, tol: Tol, exact=None) -> str | None:
    """Why the numpy array `out` is not `expected` (None when it is), in diffusion_katas.engine.comparison's words.

    `exact`: float arrays, the float64 shadow (a tensor, as Scenario.exact); uint8 arrays, the levels exact
    math rounds to (an ndarray): a pixel equal to either diffusers' level or that one passes."""
    if isinstance(out, torch.Tensor):
        return (f"output should be a numpy.ndarray of shape {expected.shape}, dtype {expected.dtype}; got "
                f"{describe(out)} (convert with .cpu().numpy())")
    if not isinstance(out, np.ndarray):
        return f"output should be a numpy.ndarray of shape {expected.shape}, got {describe(out)}"
    if out.shape != expected.shape:
        hint = ""
        if out.ndim == 4 and out.shape == (expected.shape[0], expected.shape[3], *expected.shape[1:3]):
            hint = " (channels first: numpy images are channels last, (B, H, W, 3); permute(0, 2, 3, 1))"
        return f"output has shape {out.shape}; expected {expected.shape}{hint}"
    if out.dtype != expected.dtype:
        return f"output has dtype {out.dtype}; expected {expected.dtype}"
    if isinstance(exact, np.ndarray):
        out, exact = np.where(out == exact, expected, out), None
    return mismatch(torch.from_numpy(np.array(out)), torch.from_numpy(np.array(expected)), tol, exact=exact)


def array_scenario(kata: Kata, inputs: dict, expected: np.ndarray, tol: Tol, label: str, exact=None) -> Scenario:
    def verify(out):
        problem = array_problem(out, expected, tol, exact)
        if problem is None:
            return
        lines = [f"  {problem}"]
        for trap in kata.traps:  # the same rule as the plugin: the learner matches it, the reference does not
            try:
                wrong = trap.fn(**fresh(inputs))
            except Exception:
                continue
            if array_problem(out, wrong, tol) is None and array_problem(wrong, expected, tol, exact) is not None:
                lines.append(f"  trap: {trap.name}\n    {trap.hint}")
                break
        raise KataFailure("\n".join(lines))

    return Scenario(inputs=inputs, expected=_CheckedInVerify(), label=label, verify=verify)
