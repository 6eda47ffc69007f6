"""Lab 19 · Precision: float16 vs bfloat16, why the VAE decodes in float32, and 8-bit GGUF weights

Concept:
    Half precision halves memory and doubles throughput, but the two 16-bit formats spend their bits
    differently. float16 has 5 exponent bits and 10 mantissa bits: a relative rounding error of at most
    2⁻¹¹ ≈ 4.9e-4, but nothing above 65504 (finfo(float16).max) and only subnormals below 6.1e-5.
    bfloat16 has float32's 8 exponent bits and 7 mantissa bits: float32's range (3.4e38) with a
    relative error of up to 2⁻⁸ ≈ 3.9e-3, eight times coarser. Which one holds a tensor better depends on
    its values. The classic casualty is Stable Diffusion's VAE decoder: its activations exceed 65504, so
    a float16 decode overflows to inf, the next GroupNorm turns inf into NaN, and the image comes out
    black. diffusers marks such VAEs with config.force_upcast=True, and the SDXL pipeline upcasts the VAE
    to float32 for the decode only, then puts it back to float16. Below 16 bits, weights are stored
    quantized: GGUF's Q8_0 (the llama.cpp format diffusers loads Flux and SD3 checkpoints from) keeps each
    block of 32 weights as one float16 scale and 32 int8 integers, 8.5 bits a weight, and diffusers
    dequantizes them on the fly in each layer's forward.

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
    - Q8_0, per block of 32 consecutive values of a row (ggml-quants.c, gguf.quants.Q8_0):
        d = max|x| / 127 (float32);  q = roundf(x · (1/d)), 0 where d = 0;  stored: d as float16 (2 bytes), q as int8
      34 bytes per 32 values. Dequantized: x̂ = d·q, in float16 (diffusers' dequantize_blocks_Q8_0).
      The largest value of a block maps to ±127 exactly; everything else is off by at most d/2.

Traps:
    - Picking the dtype by range alone: a tensor of tiny values fits float16's range yet loses most of
      its digits in float16's subnormals; bfloat16 keeps them to 3e-3. And the range [6.1e-5, 65504] as a
      rule misses both edges: up to 65519 rounds to 65504 (finite), and one value below 6.1e-5 among
      ordinary ones costs float16 less than bfloat16 costs every value.
    - "bfloat16 is always safer": for values inside float16's normal range it is 8× less exact.
    - Decoding in float16 although force_upcast is set: inf, then NaN, a black image.
    - Upcasting the latents but not the VAE (or the VAE but not the latents): a dtype mismatch in the
      first convolution (an error on CPU).
    - Forgetting the 1/scaling_factor before the decoder (lab 06), or casting the image back to float16.
    - Q8_0 with one scale per row (or per tensor) instead of per 32-value block: one large weight crushes
      the resolution of every other weight it shares a scale with.
    - Q8_0 rounding: ggml rounds half away from zero (C's roundf); torch.round rounds half to even.
      And it divides by the float32 d before storing d as float16: dividing by the float16-rounded d
      gives other integers wherever the rounding moved d (small blocks, whose d is subnormal in float16).
      It multiplies by the float32 reciprocal 1/d: x / d rounds otherwise a hair from a half-integer, and
      floor(|s| + 0.5) rounds s just below ½ up to 1 (the sum lands in a coarser binade).
    - Reading the quants as uint8: a negative weight's byte 0xFF is −1 as int8 and 255 as uint8.

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names, and compute as
    wide as you like. The dtype choice is a string compared exactly against real casts; the decode is
    compared against the VAE's own float32 decode, with a float64 shadow (the same VAE in float64).
    Q8_0 is a file format: quantize_q8_0 must write gguf's bytes exactly (bit for bit is the lesson here;
    multiply by the float32 reciprocal as ggml does, since x/d can land one integer off at a rounding
    boundary); dequantize_q8_0 is judged against diffusers' float16 result and exact d·q.

Say it out loud:
    "float16 has the finer mantissa, bfloat16 the wider range: cast to both and keep the one with the
    smaller worst relative error. That is float16 for ordinary magnitudes, bfloat16 once a value reaches
    65520 (float16's inf) or most of them sink into float16's subnormals; a rule of ranges alone misses
    the edges (65504 to 65519 still rounds to 65504, one tiny value among ordinary ones costs float16
    less than bfloat16's coarse mantissa costs every value). A VAE with force_upcast overflows float16, so the pipeline decodes
    with the VAE and the latents in float32, divides by the scaling factor first, and puts the VAE back
    to float16 afterwards."

Graded against: real torch casts (x.to(float16), x.to(bfloat16)) and torch.finfo; AutoencoderKL.decode
on a tiny VAE whose weights are scaled so that float16 overflows, following
StableDiffusionXLPipeline.__call__'s needs_upcasting decode step; gguf.quants.quantize (Q8_0) and diffusers'
dequantize_gguf_tensor on a GGUFParameter.
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


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """GGUF's Q8_0: every block of 32 consecutive values of a row as one float16 scale and 32 int8 quants.

        d = max|x_block| / 127 (float32);  q = roundf(x · (1/d)) (q = 0 where d = 0; roundf: half away from zero)
        block bytes = [d as float16 (2 bytes, little-endian), q as int8 (32 bytes)]

    Graded against: gguf.quants.quantize(x, GGMLQuantizationType.Q8_0), bit for bit (the format's bytes).
    Args:
        x: (rows, cols) float32, cols a multiple of 32.
    Returns: (rows, cols // 32 · 34) uint8, the row's blocks one after the other.
    """
    # TODO: per 32-value block d = max|x|/127; q = roundf(x·(1/d)); bytes = float16 d then int8 q
    raise NotImplementedError


def dequantize_q8_0(data: torch.Tensor) -> torch.Tensor:
    """Q8_0 bytes back to weights: x̂ = d·q per block, in float16.

    Graded against: diffusers' dequantize_gguf_tensor on a GGUFParameter(data, quant_type=Q8_0)
    (dequantize_blocks_Q8_0), which multiplies the float16 scale by the int8 quants and keeps float16.
    Args:
        data: (rows, n_bytes) uint8, n_bytes a multiple of 34 (as `quantize_q8_0` writes them).
    Returns: (rows, n_bytes // 34 · 32) float16.
    """
    # TODO: split each 34-byte block into its float16 scale and int8 quants; multiply
    raise NotImplementedError
