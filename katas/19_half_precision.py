"""Lab 19 · Precision: float16 vs bfloat16, and why the VAE decodes in float32

Concept:
    Half precision halves memory and doubles throughput, but the two 16-bit formats spend their bits
    differently. float16 has 5 exponent bits and 10 mantissa bits: a relative rounding error of at most
    2⁻¹¹ ≈ 4.9e-4, but nothing above 65504 (finfo(float16).max) and only subnormals below 6.1e-5.
    bfloat16 has float32's 8 exponent bits and 7 mantissa bits: float32's range (3.4e38) with a
    relative error of up to 2⁻⁸ ≈ 3.9e-3, eight times coarser. Which one holds a tensor better depends on
    its values. The classic casualty is Stable Diffusion's VAE decoder: its activations exceed 65504, so
    a float16 decode overflows to inf, the next GroupNorm turns inf into NaN, and the image comes out
    black. diffusers marks such VAEs with config.force_upcast=True, and the SDXL pipeline upcasts the VAE
    to float32 for the decode only, then puts it back to float16.

Mental model:
    - A cast rounds to the nearest representable value; a value beyond the largest finite one (plus half
      an ulp: 65520 for float16) becomes inf. Relative error |cast(x) − x| / |x| is the fair measure.
    - float16 wins on ordinary magnitudes (finer mantissa); bfloat16 wins when anything is above 65504
      (float16: inf) or below float16's normal range (float16 subnormals lose relative precision, down to
      total loss below 6e-8).
    - StableDiffusionXLPipeline's decode, in order:
        needs_upcasting = vae.dtype == float16 and vae.config.force_upcast
        if needs_upcasting: vae.to(float32); latents = latents.to(float32)
        image = vae.decode(latents / vae.config.scaling_factor).sample
        if needs_upcasting: vae.to(float16)          # the image stays float32
      The UNet still runs in float16; only the decode is widened.

Traps:
    - Picking the dtype by range alone: a tensor of tiny values fits float16's range yet loses most of
      its digits in float16's subnormals; bfloat16 keeps them to 3e-3.
    - "bfloat16 is always safer": for values inside float16's normal range it is 8× less exact.
    - Decoding in float16 although force_upcast is set: inf, then NaN, a black image.
    - Upcasting the latents but not the VAE (or the VAE but not the latents): a dtype mismatch in the
      first convolution (an error on CPU).
    - Forgetting the 1/scaling_factor before the decoder (lab 06), or casting the image back to float16.

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names, and compute as
    wide as you like. The dtype choice is a string compared exactly against real casts; the decode is
    compared against the VAE's own float32 decode, with a float64 shadow (the same VAE in float64).

Say it out loud:
    "float16 has the finer mantissa, bfloat16 the wider range: use float16 when every value sits in
    [6e-5, 65504], bfloat16 otherwise. A VAE with force_upcast overflows float16, so the pipeline decodes
    with the VAE and the latents in float32, divides by the scaling factor first, and puts the VAE back
    to float16 afterwards."

Graded against: real torch casts (x.to(float16), x.to(bfloat16)) and torch.finfo; AutoencoderKL.decode
on a tiny VAE whose weights are scaled so that float16 overflows, following
StableDiffusionXLPipeline.__call__'s needs_upcasting decode step.
Run: python -m pytest katas/19_half_precision.py
"""
import torch


# ---- Worked example --------------------------------------------------------------------------------
def max_relative_error(x: torch.Tensor, dtype: torch.dtype) -> float:
    """The largest |cast(x) − x| / |x| over x's nonzero entries when x is cast to `dtype` (inf if the
    cast overflows to inf or NaN; 0.0 if x is all zeros). Computed in float64."""
    wide = x.double()
    cast = x.to(dtype).double()
    if not torch.isfinite(cast).all():
        return float("inf")
    nonzero = wide != 0
    if not nonzero.any():
        return 0.0
    return float(((cast - wide).abs()[nonzero] / wide.abs()[nonzero]).max())


# ---- Your turn -------------------------------------------------------------------------------------
def half_dtype_for(x: torch.Tensor) -> str:
    """Which 16-bit float holds x better: "float16" or "bfloat16".

    Better = the smaller largest relative error over x's nonzero entries after a real cast (an entry that
    becomes inf or NaN is an infinite error); a tie (e.g. x all zeros) goes to "float16".

    Graded against: real casts x.to(torch.float16) and x.to(torch.bfloat16), and torch.finfo facts.
    Args:
        x: any shape, float32 or float64.
    Returns: "float16" or "bfloat16" (a str).
    """
    # TODO: cast to both, measure each cast's largest relative error, keep the smaller (ties: float16)
    raise NotImplementedError


def decode_latents(vae, latents: torch.Tensor) -> torch.Tensor:
    """Latents -> decoder output, the way StableDiffusionXLPipeline decodes (its needs_upcasting step).

    If the VAE is float16 and vae.config.force_upcast is True, decode with the VAE and the latents in
    float32, then put the VAE back to float16 (the image stays float32). Otherwise decode in the VAE's
    dtype. Either way the latents are divided by vae.config.scaling_factor first.

    Graded against: AutoencoderKL.decode following StableDiffusionXLPipeline.__call__'s decode step, on
    tiny VAEs (one with weights scaled so that float16 overflows).
    Args:
        vae:     an AutoencoderKL (eval mode), float16 or float32.
        latents: (B, 4, h, w) scaled latents in the VAE's dtype.
    Returns: (B, 3, H, W) decoder output in [−1, 1]-ish: float32 when upcast, else the VAE's dtype.
        The VAE is left in the dtype it came in.
    """
    # TODO: upcast VAE and latents to float32 when float16 + force_upcast; divide by scaling_factor; decode; VAE back to float16
    raise NotImplementedError
