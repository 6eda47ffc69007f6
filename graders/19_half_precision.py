"""Grader for lab 19 · Precision: float16 vs bfloat16 (real casts), the force_upcast VAE decode, GGUF Q8_0.

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

quantize_q8_0 is graded bit for bit against gguf.quants.quantize (the gguf package llama.cpp publishes, bit-exact
with ggml-quants.c): its output is a file format. dequantize_q8_0 is graded against diffusers' dequantize_gguf_tensor
on a GGUFParameter holding gguf's bytes, with exact d·q in float64 as the shadow.
"""
import copy

import torch

from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import EXACT, HALF, VAE_FORWARD, VAE_HALF
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
    elif kind == "one_tiny":  # ordinary values and one 3e-5 (a float16 subnormal): float16 still wins
        x[2, 5] = 3e-5
    elif kind == "many_one_very_tiny":  # 2000 ordinary values and one 1e-7 (float16 keeps it to 19%): bfloat16
        # by the largest error; float16 by the mean error, or by the largest absolute error
        x = torch.randn(40, 50, generator=g, dtype=torch.float64)
        x[7, 11] = 1e-7
    elif kind == "large_and_very_tiny":  # 6e4 and 1e-7 among ordinary values: bfloat16 by the largest (and the mean)
        # relative error, float16 by the largest absolute one (16 at 6e4, against bfloat16's 128)
        x[0, 0], x[1, 1] = 6.0e4, 1e-7
    elif kind == "exact":  # small integers: both casts exact, a tie (float16, as the rule says: err ≤ err)
        x = torch.randint(-8, 9, (3, 17), generator=g).double()
    return x.to(getattr(torch, dtype))


DTYPE_CASES = [dict(kind=k, dtype=d) for k in ("unit", "large", "tiny", "just_below_inf", "wide_but_normal", "one_tiny",
                                                "many_one_very_tiny", "large_and_very_tiny")
               for d in ("float32", "float64")] + [dict(kind="zeros", dtype="float32"), dict(kind="exact", dtype="float32")]


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


@half_dtype_for.trap("the range rule of thumb: float16 only if every nonzero |x| is in [6.1e-5, 65504]",
                     hint="Both edges are softer than the range: 65504 ≤ |x| < 65520 rounds to 65504 (finite, error "
                          "≤ 2.4e-4), and one value below 6.1e-5 among ordinary ones costs float16 less than "
                          "bfloat16's 7-bit mantissa costs every value. Compare the two casts' relative errors.")
def _(x):  # declared first: it and "range alone" both say bfloat16 at 65510, where only this one is the cause
    a = x.abs()[x != 0].double()
    if a.numel() == 0:
        return "float16"
    return "float16" if float(a.max()) <= 65504 and float(a.min()) >= 6.1e-5 else "bfloat16"


@half_dtype_for.trap("chosen by range alone (float16 whenever max|x| ≤ 65504)",
                     hint="Range is half the story: values below 6.1e-5 are float16 subnormals and keep only "
                          "a few bits (1e-7 keeps one). Compare the relative errors of the two casts.")
def _(x):
    return "float16" if float(x.abs().max()) <= torch.finfo(torch.float16).max else "bfloat16"


@half_dtype_for.trap("a tie resolved to bfloat16 (err(float16) < err(bfloat16) instead of ≤)",
                     hint="Where both casts lose the same (values exact in both, or all zeros), keep float16: its "
                          "finer mantissa is the better bet for what comes next. float16 if err(float16) ≤ "
                          "err(bfloat16).")
def _(x):
    return "float16" if _rel(x, torch.float16) < _rel(x, torch.bfloat16) else "bfloat16"


@half_dtype_for.trap("the mean relative error compared, not the largest",
                     hint="The better cast is the one whose worst entry is best: one value float16 keeps to 19% (1e-7, "
                          "a subnormal) among 2000 it keeps to 0.01% averages out, but that value is ruined. Compare "
                          "the largest relative errors.")
def _(x):
    def mean(dtype):
        wide, cast = x.double(), x.to(dtype).double()
        if not torch.isfinite(cast).all():
            return float("inf")
        nz = wide != 0
        return float(((cast - wide).abs()[nz] / wide.abs()[nz]).mean()) if nz.any() else 0.0
    return "float16" if mean(torch.float16) <= mean(torch.bfloat16) else "bfloat16"


@half_dtype_for.trap("the largest absolute error compared, not the relative one",
                     hint="An error of 16 at 6e4 is 0.03%; an error of 2e-8 at 1e-7 is 19%. Divide each entry's error "
                          "by its |x| before taking the largest.")
def _(x):
    def largest(dtype):
        wide, cast = x.double(), x.to(dtype).double()
        return float((cast - wide).abs().max()) if torch.isfinite(cast).all() else float("inf")
    return "float16" if largest(torch.float16) <= largest(torch.bfloat16) else "bfloat16"


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


def _tracked_vae_class():
    """The one DtypeTrackedVAE class of this module, made on first use (pickle needs the same class object)."""
    if "DtypeTrackedVAE" in globals():
        return globals()["DtypeTrackedVAE"]
    from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL

    class DtypeTrackedVAE(AutoencoderKL):
        """An AutoencoderKL that writes down its dtype after every move (.to, .half, .float: all go through
        _apply) in `moves`: the learner's copy lives in another process, and this is how the grader sees where
        the call left it (the runner reports `moves`, Scenario.observe)."""

        def _apply(self, fn, recurse=True):
            out = super()._apply(fn, recurse)
            if "moves" in self.__dict__:
                self.moves.append(str(self.dtype).replace("torch.", ""))
            return out

        def kata_observe(self):
            """What the runner reports of the call (Scenario.observe): the dtypes this VAE was moved to."""
            return list(self.moves)

    DtypeTrackedVAE.__module__ = __name__  # pickled by the grader module's name, as the runner knows it
    DtypeTrackedVAE.__qualname__ = "DtypeTrackedVAE"
    globals()["DtypeTrackedVAE"] = DtypeTrackedVAE
    return DtypeTrackedVAE


def __getattr__(name):
    """DtypeTrackedVAE is made on first use (here, or when the runner unpickles one): importing AutoencoderKL at
    the grader's import would cost half_dtype_for's and the Q8_0 checks' runs for nothing."""
    if name == "DtypeTrackedVAE":
        return _tracked_vae_class()
    raise AttributeError(name)


def make_vae(*, overflow: bool, force_upcast: bool, scaling_factor: float, dtype: str):
    """A tiny AutoencoderKL (seeded weights) that records its moves; overflow=True scales the decoder's conv_in
    by 3e4 so that float16 activations pass 65504 while float32 ones stay finite."""
    base = tiny.vae(8).eval()
    vae = _tracked_vae_class().from_config(base.config).eval()
    vae.load_state_dict(base.state_dict())
    vae.register_to_config(force_upcast=force_upcast, scaling_factor=scaling_factor)
    if overflow:
        with torch.no_grad():
            vae.decoder.conv_in.weight.mul_(3e4)
            vae.decoder.conv_in.bias.mul_(3e4)
    vae = vae.half() if dtype == "float16" else vae
    vae.moves = []  # from here on: what a caller does to it
    return vae


def _left_as_it_came(dtype: str):
    def verify(out, observed):
        moves = [str(m)[:20] for m in observed.get("vae") or []][-50:]
        if moves and moves[-1] != dtype:
            raise KataFailure(
                f"  the VAE came in as {dtype} and your function left it in {moves[-1]} (its moves: "
                f"{' → '.join(moves)})\n"
                f"  trap: the VAE left in {moves[-1]} after the decode (never put back)\n"
                "    Put it back after the decode, as StableDiffusionXLPipeline does (vae.to(dtype=torch.float16)), "
                "or every later call on it pays the float32 cost.",
                detail="the VAE left in another dtype")
    return verify


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
    vae.moves = []  # the reference's and the shadow's moves were on copies; this one is the learner's
    return Scenario(inputs=dict(vae=vae, latents=latents), expected=expected,
                    exact=shadow_decode(vae, latents), verify=_left_as_it_came(case["dtype"]), observe=("vae",),
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


@decode_latents.trap("every float16 VAE upcast (force_upcast never read)",
                     hint="Upcasting costs a float32 decode: the pipeline pays it only when the VAE's config asks "
                          "(vae.config.force_upcast). A float16 VAE without it decodes in float16, and its image is "
                          "float16.")
def _(vae, latents):
    if vae.dtype != torch.float16:
        return reference_decode(vae, latents)
    vae.to(dtype=torch.float32)
    with torch.no_grad():
        image = vae.decode(latents.float() / vae.config.scaling_factor).sample
    vae.to(dtype=torch.float16)
    return image


@decode_latents.trap("image cast back to float16",
                     hint="The pipeline puts the VAE back to float16, not the image: the decoded image stays "
                          "float32 (its postprocessing works in float32).")
def _(vae, latents):
    out = reference_decode(vae, latents)
    return out.half() if vae.config.force_upcast and vae.dtype == torch.float16 else out


@decode_latents.trap("latents divided by scaling_factor in float16, before the upcast",
                     hint="The pipeline moves the latents to float32 first, then divides: in float16 the quotient "
                          "is rounded to ~3 digits before the float32 decode ever sees it. Cast, then divide.")
def _(vae, latents):
    if not (vae.dtype == torch.float16 and vae.config.force_upcast):
        return reference_decode(vae, latents)
    vae.to(dtype=torch.float32)
    with torch.no_grad():
        image = vae.decode((latents / vae.config.scaling_factor).float(), return_dict=False)[0]
    vae.to(dtype=torch.float16)
    return image


@decode_latents.trap("latents not divided by scaling_factor",
                     hint="The UNet works on latents multiplied by vae.config.scaling_factor (lab 06): divide "
                          "by it before the decoder.")
def _(vae, latents):
    return reference_decode(vae, latents * vae.config.scaling_factor)


@decode_latents.trap("latents multiplied by scaling_factor (the encoder's direction)",
                     hint="Encoding multiplies by vae.config.scaling_factor; decoding undoes it: divide the latents "
                          "by it before the decoder.")
def _(vae, latents):
    return reference_decode(vae, latents * vae.config.scaling_factor ** 2)


# ---- quantize_q8_0 ----------------------------------------------------------------------------------
Q8_0_KEYS = ("gguf.quants.quantize", "gguf.quants.dequantize", "gguf.quants.Q8_0.quantize_blocks",
             "gguf.quants.Q8_0.dequantize_blocks", "diffusers.quantizers.gguf.utils.dequantize_blocks_Q8_0",
             "diffusers.quantizers.gguf.utils.dequantize_gguf_tensor")

quantize_q8_0 = Kata(
    "quantize_q8_0",
    hints=(
        "Cut each row into blocks of 32. Each block gets one scale, chosen so its largest magnitude becomes ±127; "
        "the values become integers at that scale. Then write the scale's two float16 bytes and the 32 int8 bytes.",
        "d = max|x|/127 per block (float32); q = roundf(x·(1/d)), half away from zero (floor(a) + floor(2·frac(a)), "
        "signed), 0 where d = 0; bytes = cat(d.to(float16).view(uint8), q.to(int8).view(uint8)).",
        "b = x.reshape(-1, 32); d = b.abs().amax(1, keepdim=True) / 127; s = b * torch.where(d == 0, 0 * d, 1 / d); "
        "a = s.abs(); q = s.sign() * (a.floor() + (2 * (a - a.floor())).floor()); "
        "return torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], 1).reshape(x.shape[0], -1)",
    ),
    answer_key=Q8_0_KEYS,
)


def _q8_input(kind: str, rows: int, cols: int, g) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=g)
    if kind == "small":  # d ≈ 2e-5: a float16 subnormal, so the stored scale is coarser than the float32 one
        x = x * 2e-3
    elif kind == "ties":  # each block's max is 127, so d = 1 and the half-integers are exact ties
        x = (torch.randint(-254, 255, (rows, cols), generator=g) / 2).float()
        x[:, ::32] = 127.0
    elif kind == "zero_block":  # a block of zeros: d = 0, q = 0
        x[0, :32] = 0.0
    elif kind == "outlier":  # one large weight per row: a per-row scale would crush the rest
        x[:, 5] = 40.0
    elif kind == "boundary":
        x = torch.stack([_boundary_block(g) for _ in range(rows * cols // 32)]).reshape(rows, cols)
    return x


def _roundf(s: torch.Tensor) -> torch.Tensor:
    a = s.abs()
    return s.sign() * (a.floor() + (2 * (a - a.floor())).floor())


def _boundary_block(g) -> torch.Tensor:
    """32 float32 values whose scaled values sit at the float32 neighbours of half-integers: where ggml's
    x·(1/d) rounds one way and x/d, or floor(|x·(1/d)| + 0.5) in float32, the other. The block's max sets a d
    whose reciprocal is inexact; the other 31 values alternate between the two mistakes they expose (the second
    only just below ½, where |s| + 0.5 lands in a coarser binade than |s| and rounds up to 1)."""
    top = torch.tensor(100.0 + 27.0 * float(torch.rand((), generator=g)), dtype=torch.float32)
    d = top / 127
    inv = 1 / d
    values = [top]
    for i, k in enumerate(torch.randint(0, 126, (31,), generator=g).tolist()):
        k = k if i % 2 == 0 else 0
        x0 = torch.tensor((k + 0.5) * float(d), dtype=torch.float32)
        candidates = [x0]
        for direction in (1.0, -1.0):
            x = x0
            for _ in range(8):
                x = torch.nextafter(x, torch.tensor(direction * 1e9))
                candidates.append(x)
        right = [_roundf(c * inv) for c in candidates]
        divided = [_roundf(c / d) for c in candidates]
        plus_half = [(c * inv).abs().add(0.5).floor() for c in candidates]  # float32 arithmetic
        wanted = divided if i % 2 == 0 else plus_half
        pick = next((c for c, r, w in zip(candidates, right, wanted) if r != w), x0)
        values.append(pick if float(torch.rand((), generator=g)) < 0.5 else -pick)
    return torch.stack(values)[torch.randperm(32, generator=g)]


def _gguf_q8_0(x: torch.Tensor) -> torch.Tensor:
    import gguf

    return torch.from_numpy(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).copy())


Q8_CASES = [dict(kind="gaussian", rows=3, cols=64), dict(kind="ties", rows=2, cols=64),
            dict(kind="boundary", rows=2, cols=64),  # scaled values a float32 ulp from half-integers
            dict(kind="small", rows=4, cols=32), dict(kind="zero_block", rows=2, cols=96),
            dict(kind="outlier", rows=2, cols=128)]


@quantize_q8_0.check("vs gguf.quants.quantize(Q8_0), byte for byte", cases=Q8_CASES, tol=EXACT)
def _(case, g):
    x = _q8_input(case["kind"], case["rows"], case["cols"], g)
    return Scenario(inputs=dict(x=x), expected=_gguf_q8_0(x),
                    label=f"{case['kind']} weights ({case['rows']}, {case['cols']}): "
                          f"{case['rows'] * case['cols'] // 32} blocks of 34 bytes")


def _q8(x, *, round_even=False, per_row=False, divide_by_half=False, scale_last=False, divide=False,
        plus_half=False):
    blocks = x.reshape(x.shape[0], -1) if per_row else x.reshape(-1, 32)
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    used = d.half().float() if divide_by_half else d
    if divide:
        scaled = torch.where(used == 0, torch.zeros_like(blocks), blocks / used)
    else:
        scaled = blocks * torch.where(used == 0, torch.zeros_like(used), 1 / used)
    a = scaled.abs()
    if plus_half:
        q = scaled.sign() * (a + 0.5).floor()
    else:
        q = scaled.round() if round_even else scaled.sign() * (a.floor() + (2 * (a - a.floor())).floor())
    if per_row:  # the row's one scale written in front of each of its blocks
        d = d.repeat_interleave(x.shape[1] // 32, dim=0)
        q = q.reshape(-1, 32)
    d_bytes, q_bytes = d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)
    packed = torch.cat([q_bytes, d_bytes] if scale_last else [d_bytes, q_bytes], dim=1)
    return packed.reshape(x.shape[0], -1)


@quantize_q8_0.trap("rounded half to even (torch.round) instead of half away from zero (C's roundf)",
                    hint="ggml rounds with roundf: 2.5 → 3, −3.5 → −4. torch.round gives 2 and −4 (ties to even). "
                         "Round the magnitude with floor(a) + floor(2·(a − floor(a))) and put the sign back.")
def _(x):
    return _q8(x, round_even=True)


@quantize_q8_0.trap("divided by d (x / d) instead of multiplied by its float32 reciprocal (ggml's x · (1/d))",
                    hint="ggml computes id = 1/d once and multiplies: x·(1/d) and x/d round differently in float32, "
                         "and where the result sits a hair from a half-integer the quant differs by one.")
def _(x):
    return _q8(x, divide=True)


@quantize_q8_0.trap("rounded as floor(|x| + 0.5) in float32, which rounds up just below a half",
                    hint="|s| + 0.5 can itself round up to the next integer when |s| is the float just below k + ½. "
                         "Round the magnitude as floor(a) + floor(2·(a − floor(a))), as ggml's roundf-equivalent "
                         "does, and put the sign back.")
def _(x):
    return _q8(x, plus_half=True)


@quantize_q8_0.trap("one scale per row instead of per 32-value block",
                    hint="Q8_0's scale belongs to a block of 32 consecutive values: a large weight only coarsens the "
                         "31 others in its block, not the whole row.")
def _(x):
    return _q8(x, per_row=True)


@quantize_q8_0.trap("divided by the float16-rounded scale (ggml divides by the float32 d, then stores it as float16)",
                    hint="Compute q with the float32 d (x · (1/d)); only the stored scale is float16. Where float16 "
                         "rounds d (a block of small weights, d in float16's subnormals) the integers differ.")
def _(x):
    return _q8(x, divide_by_half=True)


@quantize_q8_0.trap("the scale's bytes after the quants (a block is [d, q], 2 + 32 bytes)",
                    hint="Each 34-byte block starts with the float16 scale, then the 32 int8 quants.")
def _(x):
    return _q8(x, scale_last=True)


# ---- dequantize_q8_0 --------------------------------------------------------------------------------
dequantize_q8_0 = Kata(
    "dequantize_q8_0",
    hints=(
        "Each 34 bytes are one block: a float16 scale, then 32 signed 8-bit integers. The weights are their "
        "product.",
        "blocks = data.reshape(-1, 34); d = blocks[:, :2] viewed as float16; q = blocks[:, 2:] viewed as int8 "
        "(not uint8: 0xFF is −1); x̂ = d·q in float16, back to (rows, −1).",
        "b = data.reshape(-1, 34); d = b[:, :2].contiguous().view(torch.float16); "
        "q = b[:, 2:].contiguous().view(torch.int8); return (d * q).reshape(data.shape[0], -1)",
    ),
    answer_key=Q8_0_KEYS,
)

DEQ_CASES = [dict(kind="gaussian", rows=3, cols=64), dict(kind="outlier", rows=2, cols=128),
             dict(kind="small", rows=4, cols=32), dict(kind="zero_block", rows=1, cols=96)]


@dequantize_q8_0.check("vs diffusers' dequantize_gguf_tensor (Q8_0)", cases=DEQ_CASES, tol=HALF)
def _(case, g):
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFParameter, dequantize_gguf_tensor

    data = _gguf_q8_0(_q8_input(case["kind"], case["rows"], case["cols"], g))
    expected = dequantize_gguf_tensor(GGUFParameter(data.clone(), quant_type=gguf.GGMLQuantizationType.Q8_0))
    blocks = data.reshape(-1, 34)
    exact = (blocks[:, :2].contiguous().view(torch.float16).double()
             * blocks[:, 2:].contiguous().view(torch.int8).double()).reshape(case["rows"], -1)
    return Scenario(inputs=dict(data=data), expected=expected.detach().clone(), exact=exact,
                    label=f"gguf's Q8_0 bytes of {case['kind']} weights ({case['rows']}, {case['cols']})")


def _deq(data, *, unsigned=False, scale_last=False):
    blocks = data.reshape(-1, 34)
    d_bytes, q_bytes = (blocks[:, 32:], blocks[:, :32]) if scale_last else (blocks[:, :2], blocks[:, 2:])
    q = q_bytes.contiguous()
    q = q.to(torch.float16) if unsigned else q.view(torch.int8)
    return (d_bytes.contiguous().view(torch.float16) * q).reshape(data.shape[0], -1)


@dequantize_q8_0.trap("the quants read as uint8 (a negative weight's 0xFF becomes 255, not −1)",
                      hint="Q8_0's quants are signed: view the 32 bytes as torch.int8 before multiplying.")
def _(data):
    return _deq(data, unsigned=True)


@dequantize_q8_0.trap("the scale read from the block's last two bytes (a block is [d, q])",
                      hint="The float16 scale comes first in each 34-byte block, the 32 quants after it.")
def _(data):
    return _deq(data, scale_last=True)
