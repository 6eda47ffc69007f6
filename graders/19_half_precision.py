"""Grader for lab 19 · Precision: float16 vs bfloat16 (real casts), and the force_upcast VAE decode.

half_dtype_for is graded against real torch casts: the reference casts the case's tensor to both dtypes
and measures each cast's largest relative error in float64 (a string answer, compared exactly).

decode_latents is graded against AutoencoderKL.decode on tiny VAEs, following the decode step of
StableDiffusionXLPipeline.__call__ (needs_upcasting = vae.dtype == float16 and config.force_upcast; the
VAE and the latents to float32; latents / scaling_factor; decode; the VAE back to float16). That step is
inline in __call__, so the grader replays its four lines around the live decoder (running the whole
pipeline would cost a text encoder and a UNet for nothing). One VAE has its decoder's conv_in scaled by
3e4, so float16 activations pass 65504 (inf, then NaN after GroupNorm) while float32 stays finite.
Precision: every decode carries a float64 shadow (the same VAE in float64); the float16 decode (no
force_upcast) is judged with VAE_HALF.
"""
import copy

import torch

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import EXACT, VAE_FORWARD, VAE_HALF
from diffusion_katas.engine import tiny

# ---- half_dtype_for ---------------------------------------------------------------------------------
half_dtype_for = Kata(
    "half_dtype_for",
    hints=(
        "Cast x to each 16-bit dtype for real and see how much each cast loses, relative to each value.",
        "err(d) = max over x ≠ 0 of |x.to(d) − x| / |x| (inf if the cast gives inf/NaN); float16 if "
        "err(float16) ≤ err(bfloat16). Range alone misses tiny values (float16 subnormals below 6.1e-5).",
        "f16, bf16 = max_relative_error(x, torch.float16), max_relative_error(x, torch.bfloat16); "
        "return 'float16' if f16 <= bf16 else 'bfloat16'",
    ),
    no_answer_key="graded on real casts and torch.finfo: diffusers has no function that chooses a dtype to lock",
)


def _values(kind: str, g: torch.Generator, dtype: str) -> torch.Tensor:
    x = torch.randn(3, 17, generator=g, dtype=torch.float64)
    if kind == "unit":  # ordinary activations: float16's finer mantissa wins
        pass
    elif kind == "large":  # one value beyond 65504: float16 overflows
        x[1, 3] = 7.0e4
    elif kind == "tiny":  # all in float16's subnormal range: fits float16's max, loses its digits
        x = x * 1e-6
    elif kind == "just_below_inf":  # 65510 rounds to 65504 in float16 (not inf): float16 still wins
        x[0, 0] = 65510.0
    elif kind == "wide_but_normal":  # 1e-3 … 6e4: inside float16's normal range
        x = x.sign() * torch.logspace(-3, 4.7, x.numel(), dtype=torch.float64).view_as(x)
    elif kind == "zeros":
        x = torch.zeros(4, 4, dtype=torch.float64)
    return x.to(getattr(torch, dtype))


DTYPE_CASES = [dict(kind=k, dtype=d) for k in ("unit", "large", "tiny", "just_below_inf", "wide_but_normal")
               for d in ("float32", "float64")] + [dict(kind="zeros", dtype="float32")]


def _rel(x: torch.Tensor, dtype: torch.dtype) -> float:
    wide, cast = x.double(), x.to(dtype).double()
    if not torch.isfinite(cast).all():
        return float("inf")
    nz = wide != 0
    return float(((cast - wide).abs()[nz] / wide.abs()[nz]).max()) if nz.any() else 0.0


@half_dtype_for.check("vs real casts to float16 and bfloat16", cases=DTYPE_CASES, tol=EXACT)
def _(case, g):
    x = _values(case["kind"], g, case["dtype"])
    f16, bf16 = _rel(x, torch.float16), _rel(x, torch.bfloat16)
    assert torch.finfo(torch.float16).max == 65504.0 and torch.finfo(torch.bfloat16).bits == 16
    return Scenario(inputs=dict(x=x), expected="float16" if f16 <= bf16 else "bfloat16",
                    label=f"{case['kind']} {case['dtype']}: float16 err {f16:.2g}, bfloat16 err {bf16:.2g}")


@half_dtype_for.trap("chosen by range alone (float16 whenever max|x| ≤ 65504)",
                     hint="Range is half the story: values below 6.1e-5 are float16 subnormals and keep only "
                          "a few bits (1e-7 keeps one). Compare the relative errors of the two casts.")
def _(x):
    return "float16" if float(x.abs().max()) <= torch.finfo(torch.float16).max else "bfloat16"


@half_dtype_for.trap("always bfloat16 (the wider range is always safer)",
                     hint="bfloat16 has 7 mantissa bits to float16's 10: on ordinary values its rounding "
                          "error is 8× larger. Pick it only when float16 would overflow or underflow.")
def _(x):
    return "bfloat16"


@half_dtype_for.trap("always float16 (more mantissa bits is always better)",
                     hint="A value above 65504 becomes inf in float16 (65520 and up round to inf): an "
                          "infinite error. bfloat16 reaches 3.4e38.")
def _(x):
    return "float16"


# ---- decode_latents ---------------------------------------------------------------------------------
decode_latents = Kata(
    "decode_latents",
    hints=(
        "Copy the SDXL pipeline's decode: a float16 VAE whose config says force_upcast is decoded in "
        "float32, and put back to float16 afterwards.",
        "up = vae.dtype == float16 and vae.config.force_upcast; if up: VAE and latents to float32; "
        "image = vae.decode(latents / scaling_factor).sample; if up: vae back to float16; the image stays "
        "float32.",
        "up = vae.dtype == torch.float16 and vae.config.force_upcast; if up: vae.to(dtype=torch.float32); "
        "latents = latents.float(); image = vae.decode(latents / vae.config.scaling_factor).sample; "
        "if up: vae.to(dtype=torch.float16); return image",
    ),
    no_answer_key="the SDXL pipeline upcasts inline in __call__ (four lines, no function of their own), and the "
                  "whole pipeline cannot be run from a VAE and latents; vae.decode itself is what the learner calls",
)


def make_vae(*, overflow: bool, force_upcast: bool, scaling_factor: float, dtype: str):
    """A tiny AutoencoderKL (seeded weights); overflow=True scales the decoder's conv_in by 3e4 so that
    float16 activations pass 65504 while float32 ones stay finite."""
    vae = tiny.vae(8).eval()
    vae.register_to_config(force_upcast=force_upcast, scaling_factor=scaling_factor)
    if overflow:
        with torch.no_grad():
            vae.decoder.conv_in.weight.mul_(3e4)
            vae.decoder.conv_in.bias.mul_(3e4)
    return vae.half() if dtype == "float16" else vae


def reference_decode(vae, latents):
    """StableDiffusionXLPipeline.__call__'s decode step around the live decoder."""
    needs_upcasting = vae.dtype == torch.float16 and vae.config.force_upcast
    if needs_upcasting:
        vae.to(dtype=torch.float32)
        latents = latents.to(next(iter(vae.post_quant_conv.parameters())).dtype)
    latents = latents / vae.config.scaling_factor
    with torch.no_grad():
        image = vae.decode(latents, return_dict=False)[0]
    if needs_upcasting:
        vae.to(dtype=torch.float16)
    return image


def shadow_decode(vae, latents):
    """The same decode in float64: the float64 shadow."""
    wide = copy.deepcopy(vae).double()
    with torch.no_grad():
        return wide.decode(latents.double() / vae.config.scaling_factor).sample


UPCAST_CASES = [
    dict(overflow=True, force_upcast=True, scaling_factor=0.13025, dtype="float16", batch=2),  # SDXL's VAE
    dict(overflow=True, force_upcast=True, scaling_factor=0.18215, dtype="float16", batch=1),
    dict(overflow=True, force_upcast=True, scaling_factor=0.13025, dtype="float32", batch=2),  # already wide
    dict(overflow=False, force_upcast=False, scaling_factor=0.18215, dtype="float32", batch=2),
]
HALF_CASES = [dict(overflow=False, force_upcast=False, scaling_factor=0.13025, dtype="float16", batch=2),
              dict(overflow=False, force_upcast=False, scaling_factor=0.18215, dtype="float16", batch=1, hw=(6, 10))]


def _scenario(case, g):
    vae = make_vae(overflow=case["overflow"], force_upcast=case["force_upcast"],
                   scaling_factor=case["scaling_factor"], dtype=case["dtype"])
    latents = torch.randn(case["batch"], 4, *case.get("hw", (8, 8)), generator=g).to(getattr(torch, case["dtype"]))
    expected = reference_decode(copy.deepcopy(vae), latents.clone())
    assert torch.isfinite(expected).all()
    label = f"{case['dtype']} VAE, force_upcast={case['force_upcast']}, scaling_factor {case['scaling_factor']}"
    return Scenario(inputs=dict(vae=vae, latents=latents), expected=expected,
                    exact=shadow_decode(vae, latents),
                    label=label)


@decode_latents.check("vs the SDXL pipeline's decode step (force_upcast)", cases=UPCAST_CASES, tol=VAE_FORWARD)
def _(case, g):
    return _scenario(case, g)


@decode_latents.check("vs the SDXL pipeline's decode step (float16, no upcast)", cases=HALF_CASES, tol=VAE_HALF)
def _(case, g):
    return _scenario(case, g)


@decode_latents.trap("decoded in float16 although force_upcast is set",
                     hint="This VAE's activations pass 65504, float16's largest value: inf, then NaN after "
                          "GroupNorm. When vae.dtype is float16 and vae.config.force_upcast is True, move the "
                          "VAE and the latents to float32 for the decode.",
                     nonfinite=True)  # its signature is the overflow itself: an image with no finite pixel
def _(vae, latents):
    with torch.no_grad():
        return vae.decode(latents / vae.config.scaling_factor).sample


@decode_latents.trap("image cast back to float16",
                     hint="The pipeline puts the VAE back to float16, not the image: the decoded image stays "
                          "float32 (its postprocessing works in float32).")
def _(vae, latents):
    out = reference_decode(vae, latents)
    return out.half() if vae.config.force_upcast and vae.dtype == torch.float16 else out


@decode_latents.trap("latents not divided by scaling_factor",
                     hint="The UNet works on latents multiplied by vae.config.scaling_factor (lab 06): divide "
                          "by it before the decoder.")
def _(vae, latents):
    return reference_decode(vae, latents * vae.config.scaling_factor)
