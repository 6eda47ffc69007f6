"""Every tolerance the graders use, in one place, each with the reason it is that tolerance.

A value passes when |yours − expected| ≤ atol + rtol·|expected| (torch.isclose's rule).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tol:
    atol: float
    rtol: float
    why: str

    def describe(self) -> str:
        if self.atol == 0 and self.rtol == 0:
            return f"exact (bit for bit): {self.why}"
        return f"atol={self.atol:g}, rtol={self.rtol:g}: {self.why}"


EXACT = Tol(0.0, 0.0, "the same float32 operations in the same order as diffusers give the same bits")

SCHEDULE = Tol(
    1e-6, 1e-6,
    "a schedule built with other but equivalent float32 ops (tensor vs Python math, another order) lands "
    "within a few float32 ulps of diffusers'; one computed in float64 and cast is judged against exact "
    "math instead (where diffusers' float32 subtracts nearly equal numbers, diffusers itself lands up to "
    "~7e-6 from exact math)",
)

STEP_MATH = Tol(
    1e-5, 1e-5,
    "an update written with the same formula but another operation order (x/√a vs x·a^-½, "
    "factoring) differs by float32 rounding, ~1e-6 on unit-scale tensors; a wrong formula is off by ≥1e-3",
)

HALF = Tol(
    2e-3, 2e-3,
    "float16 holds ~3 decimal digits: re-ordering float16 ops moves results by a few ulps (~1e-3) from "
    "diffusers; computing in float32 and casting at the end can land up to 3e-2 from diffusers' float16 "
    "rounding, and is judged against exact math wherever the check has a float64 shadow",
)

SIGMA = Tol(
    1e-5, 1e-5,
    "Euler sigmas reach ~14.6 at t=999 (4096 with zero terminal SNR): the same interpolation in float64 "
    "vs float32 differs by a few float32 ulps relative to that size",
)

ROTARY_TABLE = Tol(
    2e-5, 0.0,
    "cos/sin tables of positions below 64: diffusers computes them in float64 and casts; computed in float32 "
    "an angle is off by at most ~64 float32 ulps of 1 (4e-6); a wrong split, layout or position is off by ~1",
)

PIXEL_LEVEL = Tol(
    1.0, 0.0,
    "uint8 pixels: the same decode converted with the same formula in another float order may round a pixel at "
    "a tie the other way, one level (the check also holds the share of such pixels to 0.5%)",
)

MODEL_FORWARD = Tol(
    1e-5, 1e-5,
    "a model's forward (a UNet, a text encoder, an attention block) run at another batch size or split "
    "differs by ~1e-6 (different matmul blocking); a wrong combination is off by ≥1e-2",
)


TRACE_VALUES = Tol(
    1e-4, 1e-3,
    "a trace's values in brief (min, max, mean of each boundary's tensor) come from your own run, which may differ "
    "from the pipeline's by rounding (a float16 guidance written in another order; the run itself is held to the "
    "pipeline's step by step); a tensor recorded before or after the wrong step (unscaled, unguided, not yet "
    "postprocessed) is off by ≥ 1e-2. Shapes, dtypes and devices are compared exactly",
)

TILE_BLEND = Tol(
    1e-5, 1e-5,
    "each tile goes through the same decoder, so only the blend can differ: weights built as a float32 "
    "tensor instead of Python floats move a seam pixel by an ulp; skipping or mis-ordering a blend is off by 0.1-2",
)


@dataclass(frozen=True)
class ShadowRule:
    """How far from exact math an answer may be, measured by how far diffusers' own answer is.

    Where a check also knows the float64 shadow of the reference (Scenario.exact: the same math on the
    same inputs in float64), an element passes when |yours − exact| ≤ factor·|diffusers − exact| + ulps
    ulps of the output dtype at |exact|, whatever its distance from diffusers. The check's own Tol still
    applies as a floor: an element within it of diffusers passes too. So an answer more accurate than
    diffusers (float64 coefficients, wider then cast) is never marked wrong, and a wrong formula, whose
    error is far larger than diffusers' rounding, still is.
    """

    factor: float
    ulps: float
    why: str
    # Over the whole output (engine/comparison.py): every element within `output_max_factor`× diffusers' LARGEST
    # error over the output (+ `ulps` at the element), and the RMS error within `output_rms_factor`× diffusers'
    # RMS. Diffusers' error at one element is luck (exact here, half an ulp there); over the output it is not.
    # The largest of many rounding errors is a tail: a correct formula in another order measures up to 2.2×
    # diffusers' largest (lab 14's x/√ᾱ − √((1−ᾱ)/ᾱ)·ε at t = 999 in float16, whose terms cancel) and 0.8–1.6×
    # its RMS; a mistake at a few elements is far beyond rounding there, and rounding worse everywhere
    # (float16 where diffusers upcasts: 2.5× its RMS and more) fails the RMS. No ulps are added to the RMS:
    # where diffusers is exact, the element-by-element allowance (`ulps`) holds a correct answer. Below
    # `output_min_elements` an RMS is a few elements' luck again, and `factor` holds it.
    output_max_factor: float = 3.0
    output_rms_factor: float = 2.0
    output_min_elements: int = 64

    def describe(self, dtype_name: str) -> str:
        return (f"or, against exact float64 math: at most {self.factor:g}× diffusers' own error "
                f"+ {self.ulps:g} {dtype_name} ulps from it: {self.why}")


REFERENCE_ERROR = ShadowRule(
    2.0, 2.0,
    "diffusers rounds too (float32 tables, float16 tensors), so an answer as close to exact math as "
    "diffusers' own, or closer, is right",
)


# Naming a mistake (pytest_plugin/collection.py, KataItem._explaining_trap). A trap explains a wrong output
# when it matches it within the check's tolerance, or when the output is a near variant of it: at most
# TRAP_NEAR of the way from the trap's output to the right answer (its distance to the trap's output over its
# distance to the answer, over every number). A mistake computed another way or in another precision lands
# within a few percent of the trap's; a different mistake lands about as far from the trap as from the
# answer (a ratio near 1). The name must hold on the check's next TRAP_CONFIRM scenarios too (wherever the
# learner is right there, the trap must be right; wherever wrong, the trap must explain it): a mistake that
# coincides with another on one case (a hard-coded 16 where the case's factor happens to be 16) is not named.
TRAP_NEAR = 0.25
TRAP_CONFIRM = 4

TIMESTEP_INDEX = Tol(0.0, 0.0, "DDIM/DDPM timesteps are int64 indices into the training schedule: "
                               "off by one is another noise level")
COUNTED = Tol(0.0, 0.0, "bytes are counted (elements × bytes per element) and a schedule is a sequence of names: "
                        "no arithmetic rounds, so the answer is exact or wrong")

EMBED_ANGLE = Tol(
    2.5e-4, 0.0,
    "sin/cos of angles up to ~1000 rad: one float32 ulp of such an angle is 6.1e-5, and writing ω as "
    "1/max_period**(i/half), computing it in float64 or multiplying in another order moves the angle by "
    "an ulp or two (measured ≤ 6.1e-5 over 200 seeds); a wrong layout, shift or padding is off by ~1",
)

NORM_MATH = Tol(
    1e-5, 1e-5,
    "a LayerNorm written by hand (mean, biased variance, rsqrt) and emb @ W.T + b instead of F.linear "
    "differ from diffusers' nn.LayerNorm and nn.Linear by float32 rounding (measured ≤ 3.9e-6); "
    "a LayerNorm eps of 1e-5 for 1e-6 is off by up to 9e-5 on unit-spread tokens, ~5 on tiny ones",
)

NORM_HALF = Tol(
    4e-3, 4e-3,
    "float16: a LayerNorm written by hand with float16 statistics lands up to ~2 float16 ulps from "
    "nn.LayerNorm, whose CPU kernel keeps float32 statistics (measured ≤ 1.2× (2e-3 + 2e-3·|x|) over 300 "
    "seeds); a wrong formula is off by ≥ 5e-2",
)


HALF_STEP = Tol(
    5e-3, 5e-3,
    "a float16 step written with Python-float coefficients (.item(), math.sqrt) or in float32 then cast "
    "lands up to 3.6e-3·(1 + |x|) from diffusers, which multiplies float16 tensors by 0-dim float32 "
    "ones (measured over 6 seeds, DDIM and DDPM, 3 prediction types); a wrong formula is off by ≥ 1e-2",
)


MERGE = Tol(
    1e-6, 1e-6,
    "ΔW or W + ΔW written in another float32 order (scaling folded into B, einsum, a broadcast sum) "
    "lands within 1.2e-7 of peft's; a wrong scaling, sign or transpose is off by ≥ 1e-2",
)
SCALING = Tol(
    0.0, 1e-6,
    "the same product in another order, or in float32, differs in the last bits (≤ 1e-7 relative); "
    "a wrong formula is off by ≥ 10%",
)


VAE_FORWARD = Tol(
    5e-5, 5e-5,
    "measured (float32, both tiny VAEs, 12 seeds): encoding or decoding sample by sample instead of as "
    "one batch moves the output by ≤6.4e-6, multiplying by 1/s instead of dividing by s by ≤3.5e-6; "
    "a wrong or missing scaling factor, or the mode instead of a sample, is off by ≥1e-1",
)
VAE_HALF = Tol(
    2e-2, 2e-2,
    "measured (float16, both tiny VAEs, 20 seeds): decoding sample by sample vs as one batch differs by "
    "≤1.1e-2 (float16 convolutions round differently per batch size); a wrong scaling factor, even "
    "0.18215 for 0.13025, is off by ≥0.23",
)


RELATIVE_CHANGE = Tol(
    1e-7, 1e-5,
    "δ = mean|r − r_c| / mean|r_c| over hundreds of elements: summing in another order or in float64 moves a "
    "float32 δ by ≤ 1e-6 relative (float32 sums of 256-1152 elements); each wrong formula (÷ the current "
    "residual, no abs, an L2 norm) is off by ≥ 5% on some graded case (massive-activation channels for the L2 "
    "norm), though on a case where it happens to agree it may be off by as little as 0.1%",
)
CACHED_BLOCKS = Tol(
    1e-5, 1e-5,
    "the same blocks on the same inputs, plus one subtraction and one addition of cached residuals: another "
    "order of those (x₁ + (x_N − x₁) vs x_N) moves a value by a float32 ulp or two; a wrong cache is off by "
    "what a block changed, or by how far two prompts' tails differ (≥ 1e-3)",
)

SERVED_LATENTS = Tol(
    2e-4, 2e-5,
    "a request served in a batch of 2-10 rows goes through the UNet at another batch size than alone (other "
    "matmul blocking), every step: measured ≤ 2.8e-5 (≤ 9% of this allowance) on latents up to ~50, 12 seeds × the three served "
    "runs, DDIM and Euler; a wrong timestep, guidance, scheduler or noise is off by ≥ 1e-1",
)


def output_dtype(expected):
    """The dtype of an expected output: its own, or its first tensor's (tuples, lists, dicts)."""
    if hasattr(expected, "dtype"):
        return expected.dtype
    items = expected.values() if isinstance(expected, dict) else expected if isinstance(expected, (list, tuple)) else ()
    for item in items:
        dtype = output_dtype(item)
        if dtype is not None:
            return dtype
    return None


def for_dtype(tol: Tol, dtype) -> Tol:
    """float16/bfloat16 outputs get the half-precision tolerance unless the check is exact."""
    import torch

    if tol.atol == 0 and tol.rtol == 0:
        return tol
    if tol.atol >= HALF.atol and tol.rtol >= HALF.rtol:
        return tol  # already a half-precision tolerance, with its own reason
    if dtype in (torch.float16, torch.bfloat16):
        return Tol(max(tol.atol, HALF.atol), max(tol.rtol, HALF.rtol), HALF.why)
    return tol
