"""Grader for lab 13 · Flow matching: the shifted σ ladder, μ from tokens, time_shift, scale_noise, step.

Imports FlowMatchEulerDiscreteScheduler and the Flux pipeline's calculate_shift (its module pulls in
transformers: importing it once costs ~8 s, the price of grading μ against the pipelines' own code and
of refusing it while learner code runs; SD3's pipeline holds a "Copied from" copy with the same code,
which the lock refuses too). No model is built.

Precision: every float check carries the float64 shadow of diffusers' answer (Scenario.exact: the same
math on the same inputs in float64). diffusers builds its ladder in float64 and casts it to float32,
runs time_shift on Flux's float32 grid in float32, scale_noise in the latent's dtype (float16: σ
rounded to float16 first) and multiplies (σ_next − σ)·v in the model output's dtype inside step; an
answer at most 2× as far from exact math as diffusers' own (+ 2 ulps) passes, so computing wider and
casting once is right everywhere.
"""
from fractions import Fraction

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import SCHEDULE, STEP_MATH
from diffusion_katas.engine.helpers import DTYPES

FLOW = "diffusers.schedulers.scheduling_flow_match_euler_discrete.FlowMatchEulerDiscreteScheduler"
CALCULATE_SHIFT = "diffusers.pipelines.flux.pipeline_flux.calculate_shift"


def _short(t: torch.Tensor) -> str:
    values = [float(f"{v:.5g}") for v in t.tolist()]
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, {values[2]}, …, {values[-1]}]"


def _shift(sigma, s):
    return s * sigma / (1 + (s - 1) * sigma)


def scheduler(*, n: int | None = None, shift: float = 1.0, mu: float | None = None,
              time_shift_type: str = "exponential", T: int = 1000) -> FlowMatchEulerDiscreteScheduler:
    """A FlowMatchEulerDiscreteScheduler: static `shift`, or dynamic shifting when `mu` is given;
    set_timesteps(n) already called unless n is None (the training ladder)."""
    dynamic = mu is not None
    s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=shift, use_dynamic_shifting=dynamic,
                                        time_shift_type=time_shift_type)
    if n is not None:
        s.set_timesteps(n, mu=mu)
    return s


def tokens_of(height: int, width: int, vae_scale_factor: int, patch_size: int) -> int:
    """The image_seq_len StableDiffusion3Pipeline.__call__ passes to calculate_shift: its latents are
    (height // vae_scale_factor, width // vae_scale_factor), cut into patch_size² patches. (Flux packs
    2×2 latent patches: the same count.)"""
    return (height // vae_scale_factor // patch_size) * (width // vae_scale_factor // patch_size)


# ---- flow_sigmas ------------------------------------------------------------------------------------
flow_sigmas = Kata(
    "flow_sigmas",
    hints=(
        "Take n evenly spaced σ from 1 down to the smallest σ of the (already shifted) training ladder, "
        "shift them with shift_sigma, and end the ladder with a 0; the model's timesteps are σ·T.",
        "σ_min = shift(1/T) with shift(σ) = sσ/(1 + (s − 1)σ);  grid = linspace(1, σ_min, n);  "
        "sigmas = [shift(grid), 0] (float32);  timesteps = T·shift(grid).",
        "g = torch.linspace(1.0, shift_sigma(1 / T, shift), n, dtype=torch.float64); "
        "s = shift_sigma(g, shift).float(); return torch.cat([s, s.new_zeros(1)]), s * T",
    ),
    answer_key=(f"{FLOW}.set_timesteps",),
)

LADDER_CASES = [
    dict(num_inference_steps=28, shift=3.0, num_train_timesteps=1000),  # SD3's default
    dict(num_inference_steps=7, shift=3.0, num_train_timesteps=1000),
    dict(num_inference_steps=10, shift=6.0, num_train_timesteps=1000),
    dict(num_inference_steps=5, shift=0.5, num_train_timesteps=1000),  # s < 1 leans towards clean
    dict(num_inference_steps=9, shift=1.5, num_train_timesteps=100),
    dict(num_inference_steps=4, shift=1.0, num_train_timesteps=1000),  # no shift at all
    dict(num_inference_steps=1, shift=3.0, num_train_timesteps=1000),
]


def exact_ladder(n: int, shift: float, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """set_timesteps' ladder in float64 throughout: its float64 shadow."""
    grid = torch.linspace(1.0, _shift(1 / T, shift), n, dtype=torch.float64)
    sigmas = _shift(grid, shift)
    return torch.cat([sigmas, sigmas.new_zeros(1)]), sigmas * T


@flow_sigmas.check("vs set_timesteps → (sigmas, timesteps)", cases=LADDER_CASES, tol=SCHEDULE)
def _(case, g):
    s = scheduler(n=case["num_inference_steps"], shift=case["shift"], T=case["num_train_timesteps"])
    return Scenario(inputs=dict(case), expected=(s.sigmas.clone(), s.timesteps.clone()),
                    exact=exact_ladder(case["num_inference_steps"], case["shift"], case["num_train_timesteps"]),
                    label=f"sigmas {_short(s.sigmas)}")


def ladder(n, shift, T, *, shift_t=False, no_terminal=False, no_shift=False, grid_to_one_over_T=False,
           inverted=False, grid_to_zero=False, unshifted_timesteps=False):
    """The ladder with one misconception switched on (for traps); all switches off = correct."""
    end = 0.0 if grid_to_zero else (1 / T if grid_to_one_over_T or no_shift else _shift(1 / T, shift))
    grid = torch.linspace(1.0, end, n, dtype=torch.float64)
    if no_shift:
        sigmas = grid
    elif shift_t:  # the formula applied to t = σ·T, then divided back
        sigmas = _shift(grid * T, shift) / T
    elif inverted:
        sigmas = _shift(grid, 1 / shift)
    else:
        sigmas = _shift(grid, shift)
    sigmas = sigmas.to(torch.float32)
    timesteps = (grid.to(torch.float32) if unshifted_timesteps else sigmas) * T
    return (sigmas if no_terminal else torch.cat([sigmas, sigmas.new_zeros(1)])), timesteps


def _ladder_trap(name: str, hint: str, **bug):
    @flow_sigmas.trap(name, hint=hint)
    def _(num_inference_steps, shift=1.0, num_train_timesteps=1000):
        return ladder(num_inference_steps, shift, num_train_timesteps, **bug)


_ladder_trap("shift applied to t instead of σ",
             "The shift sσ/(1 + (s − 1)σ) is a map of [0, 1] onto itself: apply it to σ, then take t = σ·T. "
             "On t ∈ [0, T] it sends the noisiest step (t = 1000, s = 3) to 3000/2001 ≈ 1.5.", shift_t=True)
_ladder_trap("no terminal σ = 0 (n sigmas instead of n + 1)",
             "Append a 0 to the sigmas: the last step goes from the last σ to 0, the clean latent. The "
             "timesteps stay n long.", no_terminal=True)
_ladder_trap("shift ignored",
             "Shift every grid point: σ' = sσ/(1 + (s − 1)σ) (s = 3: σ = 0.5 becomes 0.75).", no_shift=True)
_ladder_trap("grid down to 1/T (the unshifted end of the training ladder)",
             "The grid spans the training ladder, which __init__ has already shifted: its smallest σ is "
             "shift(1/T) (0.002994 for s = 3), so the last σ is shifted twice (0.008929).",
             grid_to_one_over_T=True)
_ladder_trap("shifted the wrong way (1/s)",
             "sσ/(1 + (s − 1)σ) with s > 1 moves σ up, towards noise; σ/(s − (s − 1)σ) is the shift by 1/s.",
             inverted=True)
_ladder_trap("grid down to 0, then another 0",
             "The grid ends at the smallest training σ, shift(1/T), not at 0: the only 0 is the terminal one.",
             grid_to_zero=True)


@flow_sigmas.trap("one grid of n + 1 points from 1 down to 0 (the terminal σ taken from the grid)",
                  hint="The n sigmas run from 1 to shift(1/T), the smallest training σ; the terminal 0 is appended "
                       "after them, not the last point of the grid (n + 1 evenly spaced points put every σ "
                       "elsewhere).")
def _(num_inference_steps, shift=1.0, num_train_timesteps=1000):
    sigmas = _shift(torch.linspace(1.0, 0.0, num_inference_steps + 1, dtype=torch.float64), shift).to(torch.float32)
    return sigmas, sigmas[:-1] * num_train_timesteps


_ladder_trap("timesteps from the unshifted grid",
             "The model must see the σ it is at: timesteps = T · (the shifted σs), not T · grid.",
             unshifted_timesteps=True)


# ---- resolution_mu ----------------------------------------------------------------------------------
resolution_mu = Kata(
    "resolution_mu",
    hints=(
        "Count the image's tokens (pixels → latent pixels → patches), then read μ off the line through "
        "(base_image_seq_len, base_shift) and (max_image_seq_len, max_shift).",
        "tokens = (H // f // p)·(W // f // p);  m = (max_shift − base_shift)/(max_seq − base_seq);  "
        "μ = base_shift + m·(tokens − base_seq).",
        "tokens = (height // vae_scale_factor // patch_size) * (width // vae_scale_factor // patch_size); "
        "m = (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len); "
        "return base_shift + m * (tokens - base_image_seq_len)",
    ),
    # The lock is by code: the SD3 pipeline's copy of calculate_shift (and every other copy) is refused too.
    answer_key=(CALCULATE_SHIFT,),
)

_LINE = dict(base_image_seq_len=256, max_image_seq_len=4096, base_shift=0.5, max_shift=1.15)
MU_CASES = [
    dict(height=1024, width=1024, vae_scale_factor=8, patch_size=2, **_LINE),  # Flux 1024²: 4096 tokens
    dict(height=512, width=512, vae_scale_factor=8, patch_size=2, **_LINE),
    dict(height=1344, width=768, vae_scale_factor=8, patch_size=2, **{**_LINE, "max_shift": 1.16}),  # SD3's
    dict(height=256, width=256, vae_scale_factor=8, patch_size=2, **_LINE),  # 64 tokens: below the base
    dict(height=2048, width=2048, vae_scale_factor=8, patch_size=2, **_LINE),  # 16384: beyond the max
    dict(height=1024, width=512, vae_scale_factor=16, patch_size=2, **_LINE),  # 32·16 = 512 tokens
    dict(height=512, width=512, vae_scale_factor=8, patch_size=1, **_LINE),  # 64·64 = 4096 tokens
    dict(height=1024, width=768, vae_scale_factor=8, patch_size=2, base_image_seq_len=1024,
         max_image_seq_len=8192, base_shift=0.3, max_shift=0.9),
]


def exact_mu(tokens, base_image_seq_len, max_image_seq_len, base_shift, max_shift) -> float:
    """calculate_shift in exact rational arithmetic on the same float inputs: its shadow."""
    b, m = Fraction(base_shift), Fraction(max_shift)
    slope = (m - b) / (max_image_seq_len - base_image_seq_len)
    return float(b + slope * (tokens - base_image_seq_len))


@resolution_mu.check("vs calculate_shift at the pipeline's token count", cases=MU_CASES, tol=SCHEDULE)
def _(case, g):
    tokens = tokens_of(case["height"], case["width"], case["vae_scale_factor"], case["patch_size"])
    line = [case[k] for k in ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")]
    return Scenario(inputs=dict(case), expected=calculate_shift(tokens, *line), exact=exact_mu(tokens, *line),
                    label=f"{tokens} tokens")


def _line(seq, base_image_seq_len, max_image_seq_len, base_shift, max_shift):
    return base_shift + (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len) * (seq - base_image_seq_len)


@resolution_mu.trap("μ from the pixel count instead of the token count",
                    hint="The line is in tokens: a 1024² image is (1024/8/2)² = 4096 tokens, not 1,048,576 "
                         "pixels (that gives μ ≈ 178). Divide each side by vae_scale_factor and by patch_size.")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    return _line(height * width, **line)


@resolution_mu.trap("each side as height // vae_scale_factor * patch_size (multiplied by the patch size)",
                    hint="// and * bind left to right: height // f * p is (height // f)·p. Divide by both: "
                         "height // f // p (1024 → 64 tokens a side, not 256).")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    return _line((height // vae_scale_factor * patch_size) * (width // vae_scale_factor * patch_size), **line)


@resolution_mu.trap("the token count as (height // f // p)²: a square image assumed",
                    hint="Tokens = (height // f // p)·(width // f // p): a 1024×576 image has 64·36 tokens, "
                         "not 64².")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    return _line((height // vae_scale_factor // patch_size) ** 2, **line)


@resolution_mu.trap("16 pixels per token written in (SD3 and Flux's f = 8, p = 2)",
                    hint="Divide by this model's vae_scale_factor and patch_size: other models have other ones.")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    return _line((height // 16) * (width // 16), **line)


@resolution_mu.trap("μ from the latent pixel count (the patches forgotten)",
                    hint="Each token is a patch_size × patch_size block of latent pixels: divide each latent "
                         "side by patch_size too (1024² → 128² latent pixels → 64² = 4096 tokens).")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    return _line((height // vae_scale_factor) * (width // vae_scale_factor), **line)


@resolution_mu.trap("the line anchored at 0 tokens (tokens − base_image_seq_len not subtracted)",
                    hint="μ = base_shift exactly at base_image_seq_len tokens: μ = base_shift + m·(tokens − base).")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    seq = tokens_of(height, width, vae_scale_factor, patch_size)
    m = (line["max_shift"] - line["base_shift"]) / (line["max_image_seq_len"] - line["base_image_seq_len"])
    return line["base_shift"] + m * seq


@resolution_mu.trap("the line drawn from (0 tokens, base_shift) to (max_image_seq_len, max_shift)",
                    hint="The line goes through (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift): "
                         "slope (max_shift − base_shift)/(max_image_seq_len − base_image_seq_len), and μ = "
                         "base_shift at base_image_seq_len tokens, not at 0.")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    seq = tokens_of(height, width, vae_scale_factor, patch_size)
    return line["base_shift"] + (line["max_shift"] - line["base_shift"]) * seq / line["max_image_seq_len"]


@resolution_mu.trap("returned the shift e^μ instead of μ",
                    hint="Return μ itself; time_shift takes the exponential ('exponential': s = e^μ).")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    import math

    return math.exp(_line(tokens_of(height, width, vae_scale_factor, patch_size), **line))


@resolution_mu.trap("μ clamped to [base_shift, max_shift]",
                    hint="calculate_shift extrapolates the line: below base_image_seq_len tokens μ < base_shift, "
                         "beyond max_image_seq_len μ > max_shift (a 2048² Flux image: μ ≈ 3.1). No clamp.")
def _(height, width, vae_scale_factor=8, patch_size=2, **line):
    mu = _line(tokens_of(height, width, vae_scale_factor, patch_size), **line)
    return min(max(mu, line["base_shift"]), line["max_shift"])


# ---- time_shift -------------------------------------------------------------------------------------
time_shift = Kata(
    "time_shift",
    hints=(
        "It is the static shift again, with s = e^μ for 'exponential' and s = μ for 'linear'.",
        "s = e^μ ('exponential') or μ ('linear');  σ' = s / (s + (1/σ − 1)), in the dtype of sigmas.",
        "s = math.exp(mu) if time_shift_type == 'exponential' else mu; return s / (s + (1 / sigmas - 1))",
    ),
    answer_key=(f"{FLOW}.time_shift", f"{FLOW}._time_shift_exponential", f"{FLOW}._time_shift_linear",
                f"{FLOW}.set_timesteps"),
)

# (n, tokens → μ, type): μ from the resolutions the pipelines see; Flux's grid linspace(1, 1/n, n).
FLUX_GRID_CASES = [
    dict(num_inference_steps=28, tokens=4096, time_shift_type="exponential"),  # Flux 1024²: μ = 1.15
    dict(num_inference_steps=4, tokens=1024, time_shift_type="exponential"),
    dict(num_inference_steps=10, tokens=4032, time_shift_type="linear"),
    dict(num_inference_steps=6, tokens=16384, time_shift_type="linear"),
    dict(num_inference_steps=8, tokens=64, time_shift_type="exponential"),
]


def exact_time_shift(mu: float, sigmas: torch.Tensor, time_shift_type: str) -> torch.Tensor:
    """time_shift's formula in float64 on the same σs (math.exp(μ) is already a float64)."""
    import math

    s = math.exp(mu) if time_shift_type == "exponential" else mu
    return s / (s + (1 / sigmas.double() - 1))


@time_shift.check("vs set_timesteps(sigmas=Flux's grid, mu=μ) → sigmas", cases=FLUX_GRID_CASES, tol=SCHEDULE)
def _(case, g):
    n, kind = case["num_inference_steps"], case["time_shift_type"]
    mu = calculate_shift(case["tokens"])
    s = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type=kind)
    grid = np.linspace(1.0, 1 / n, n)  # what FluxPipeline.__call__ passes
    s.set_timesteps(sigmas=grid, mu=mu)
    sigmas = torch.from_numpy(grid.astype(np.float32))  # set_timesteps' own first step
    return Scenario(inputs=dict(mu=mu, sigmas=sigmas, time_shift_type=kind), expected=s.sigmas[:-1].clone(),
                    exact=exact_time_shift(mu, sigmas, kind), label=f"μ = {mu:.6g}")


@time_shift.check("vs time_shift on random σs", tol=SCHEDULE, cases=[
    dict(size=16, dtype="float32", mu=1.15, time_shift_type="exponential"),
    dict(size=9, dtype="float32", mu=2.0, time_shift_type="linear"),
    dict(size=5, dtype="float16", mu=0.3, time_shift_type="exponential"),
    dict(size=12, dtype="float32", mu=0.7, time_shift_type="linear"),
])
def _(case, g):
    sigmas = torch.rand(case["size"], generator=g).clamp_min(1e-3).to(DTYPES[case["dtype"]])
    sigmas[0] = 1.0  # the noisy end must stay at 1
    s = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type=case["time_shift_type"])
    expected = s.time_shift(case["mu"], 1.0, sigmas.clone())
    return Scenario(inputs=dict(mu=case["mu"], sigmas=sigmas, time_shift_type=case["time_shift_type"]),
                    expected=expected, exact=exact_time_shift(case["mu"], sigmas, case["time_shift_type"]))


def _shifted(s, sigmas):
    return s / (s + (1 / sigmas - 1))


@time_shift.trap("'exponential' with μ instead of e^μ (the linear formula)",
                 hint="'exponential' means the shift is e^μ: σ' = e^μ / (e^μ + (1/σ − 1)).")
def _(mu, sigmas, time_shift_type="exponential"):
    return _shifted(mu, sigmas)


@time_shift.trap("'linear' with e^μ (the exponential formula)",
                 hint="'linear' uses μ itself as the shift: σ' = μ / (μ + (1/σ − 1)).")
def _(mu, sigmas, time_shift_type="exponential"):
    import math

    return _shifted(math.exp(mu), sigmas)


@time_shift.trap("the two types swapped (μ for 'exponential', e^μ for 'linear')",
                 hint="'exponential' shifts by e^μ, 'linear' by μ itself: σ' = s / (s + (1/σ − 1)) with "
                      "s = e^μ or s = μ.")
def _(mu, sigmas, time_shift_type="exponential"):
    import math

    return _shifted(mu if time_shift_type == "exponential" else math.exp(mu), sigmas)


@time_shift.trap("shifted the wrong way (1/s: towards clean)",
                 hint="A positive shift moves σ towards 1 (noise): σ' = s / (s + (1/σ − 1)), not 1 / (1 + s·(1/σ − 1)).")
def _(mu, sigmas, time_shift_type="exponential"):
    import math

    s = math.exp(mu) if time_shift_type == "exponential" else mu
    return _shifted(1 / s, sigmas)


@time_shift.trap("the −1 left out (s / (s + 1/σ))",
                 hint="The shift acts on the odds (1 − σ)/σ = 1/σ − 1: σ' = s / (s + (1/σ − 1)), which keeps σ = 1 "
                      "at 1 (s / (s + 1/σ) would give s / (s + 1) there).")
def _(mu, sigmas, time_shift_type="exponential"):
    import math

    s = math.exp(mu) if time_shift_type == "exponential" else mu
    return s / (s + 1 / sigmas)


# ---- scale_noise ------------------------------------------------------------------------------------
scale_noise = Kata(
    "scale_noise",
    hints=(
        "Rectified flow's noisy sample is a straight line from x₀ to ε: find each sample's σ from its "
        "timestep and mix.",
        "i_b = the index of timestep[b] in timesteps;  σ_b = sigmas[i_b];  x_t = σ_b·ε + (1 − σ_b)·x₀, "
        "σ broadcast over (C, H, W), cast to the dtype of sample.",
        "i = (timesteps[None, :] == timestep[:, None]).long().argmax(1); s = sigmas[i].reshape(-1, 1, 1, 1); "
        "return (s * noise.float() + (1 - s) * sample.float()).to(sample.dtype)",
    ),
    answer_key=(f"{FLOW}.scale_noise",),
)

NOISE_CASES = [
    dict(shape=(4, 4, 8, 8), dtype="float32", ladder="training", shift=3.0),  # training: 1000 σs
    dict(shape=(3, 16, 8, 8), dtype="float16", ladder="inference", n=8, shift=3.0),  # img2img's start
    dict(shape=(2, 4, 16, 16), dtype="float32", ladder="dynamic", n=6, mu=1.15),
    dict(shape=(5, 4, 8, 8), dtype="float16", ladder="training", shift=1.0),
    # T ≠ 1000: timesteps are σ·T, so σ = t/1000 (right whenever T = 1000) is off here; read σ from the table
    dict(shape=(3, 4, 8, 8), dtype="float32", ladder="training", shift=3.0, T=500),
    dict(shape=(2, 4, 8, 8), dtype="float32", ladder="inference", n=5, shift=1.0, T=2000),
]


@scale_noise.check("vs scale_noise, a batch of distinct timesteps", cases=NOISE_CASES, tol=STEP_MATH)
def _(case, g):
    shape, dtype = case["shape"], DTYPES[case["dtype"]]
    if case["ladder"] == "training":
        s = scheduler(shift=case["shift"], T=case.get("T", 1000))
    else:
        s = scheduler(n=case["n"], shift=case.get("shift", 1.0), mu=case.get("mu"), T=case.get("T", 1000))
    pick = torch.randperm(len(s.timesteps), generator=g)[: shape[0]]  # distinct timesteps, any order
    timestep = s.timesteps[pick].clone()
    sample = torch.randn(shape, generator=g).to(dtype)
    noise = torch.randn(shape, generator=g).to(dtype)
    expected = s.scale_noise(sample.clone(), timestep.clone(), noise.clone())
    sigma = s.sigmas[pick].double().reshape(-1, 1, 1, 1)
    exact = sigma * noise.double() + (1 - sigma) * sample.double()
    return Scenario(inputs=dict(sample=sample, noise=noise, timestep=timestep, timesteps=s.timesteps.clone(),
                                sigmas=s.sigmas.clone()),
                    expected=expected, exact=exact, label=f"timesteps {_short(timestep)}")


def _sigma_of(timestep, timesteps, sigmas, sample):
    index = (timesteps[None, :] == timestep[:, None]).long().argmax(1)
    return sigmas[index].float().reshape(-1, *([1] * (sample.dim() - 1)))


def _mix(sample, noise, sigma, signal, noise_weight):
    return (noise_weight(sigma) * noise.float() + signal(sigma) * sample.float()).to(sample.dtype)


@scale_noise.trap("σ and 1 − σ swapped (x_t = (1 − σ)·ε + σ·x₀)",
                  hint="σ is the noise level: at σ = 1 the sample is pure noise. x_t = σ·ε + (1 − σ)·x₀.")
def _(sample, noise, timestep, timesteps, sigmas):
    return _mix(sample, noise, _sigma_of(timestep, timesteps, sigmas, sample), lambda s: s, lambda s: 1 - s)


@scale_noise.trap("DDPM's √ coefficients (√(1 − σ)·x₀ + √σ·ε)",
                  hint="Rectified flow mixes linearly, without square roots: x_t = (1 − σ)·x₀ + σ·ε "
                       "(the weights sum to 1, not their squares).")
def _(sample, noise, timestep, timesteps, sigmas):
    return _mix(sample, noise, _sigma_of(timestep, timesteps, sigmas, sample),
                lambda s: (1 - s) ** 0.5, lambda s: s ** 0.5)


@scale_noise.trap("Euler's latent x₀ + σ·ε (lab 03's parametrisation)",
                  hint="Flow matching shrinks the signal as it adds noise: x_t = (1 − σ)·x₀ + σ·ε.")
def _(sample, noise, timestep, timesteps, sigmas):
    return _mix(sample, noise, _sigma_of(timestep, timesteps, sigmas, sample), lambda s: 1, lambda s: s)


@scale_noise.trap("one σ for the whole batch (the first sample's)",
                  hint="Each sample has its own timestep: look each one up and broadcast σ as (B, 1, 1, 1).")
def _(sample, noise, timestep, timesteps, sigmas):
    sigma = _sigma_of(timestep[:1], timesteps, sigmas, sample)
    return _mix(sample, noise, sigma, lambda s: 1 - s, lambda s: s)


@scale_noise.trap("σ indexed by batch position (sigmas[b]), not looked up from the timestep",
                  hint="Sample b's σ sits where its timestep sits in `timesteps`: find that index first.")
def _(sample, noise, timestep, timesteps, sigmas):
    sigma = sigmas[: sample.shape[0]].float().reshape(-1, *([1] * (sample.dim() - 1)))
    return _mix(sample, noise, sigma, lambda s: 1 - s, lambda s: s)


@scale_noise.trap("the timestep used as σ (t = 1000·σ)",
                  hint="Timesteps run to T = 1000; σ runs to 1. Use the σ at the timestep's index (σ = t/T).")
def _(sample, noise, timestep, timesteps, sigmas):
    sigma = timestep.float().reshape(-1, *([1] * (sample.dim() - 1)))
    return _mix(sample, noise, sigma, lambda s: 1 - s, lambda s: s)


@scale_noise.trap("σ one index on (sigmas[i + 1], the next step's)",
                  hint="sigmas[i] is the σ of timesteps[i]: the same index, not the one after it (sigmas has one "
                       "more entry, the final 0, for the step's σ_next).")
def _(sample, noise, timestep, timesteps, sigmas):
    index = (timesteps[None, :] == timestep[:, None]).long().argmax(1) + 1
    sigma = sigmas[index].float().reshape(-1, *([1] * (sample.dim() - 1)))
    return _mix(sample, noise, sigma, lambda s: 1 - s, lambda s: s)


@scale_noise.trap("σ = t / 1000 (the timesteps' scale T taken to be 1000)",
                  hint="timesteps = σ·num_train_timesteps, and T need not be 1000: look σ up in `sigmas` at the "
                       "timestep's index instead of dividing.")
def _(sample, noise, timestep, timesteps, sigmas):
    sigma = (timestep.float() / 1000).reshape(-1, *([1] * (sample.dim() - 1)))
    return _mix(sample, noise, sigma, lambda s: 1 - s, lambda s: s)


# ---- flow_euler_step --------------------------------------------------------------------------------
flow_euler_step = Kata(
    "flow_euler_step",
    hints=(
        "The model's output is the velocity dx/dσ: one Euler step moves x along it by σ_next − σ "
        "(negative). Upcast to float32 first, cast back at the end.",
        "x_next = x + (σ_next − σ)·v, in float32, cast to model_output.dtype.",
        "return (sample.float() + (sigma_next - sigma) * model_output.float()).to(model_output.dtype)",
    ),
    answer_key=(f"{FLOW}.step",),
)

# A whole run per case; the first case is an img2img run that starts part-way down (σ < 1 first).
STEP_CASES = [
    dict(shape=(2, 4, 8, 8), dtype="float32", n=10, shift=3.0, start=4),
    dict(shape=(2, 16, 8, 8), dtype="float32", n=6, shift=3.0),
    dict(shape=(1, 4, 16, 16), dtype="float16", n=5, mu=1.15),
    dict(shape=(3, 4, 8, 8), dtype="float16", n=4, shift=1.0, start=1),
    dict(shape=(2, 4, 8, 8), dtype="float32", n=5, mu=0.8, time_shift_type="linear"),
]


@flow_euler_step.check("vs step, whole sampling runs", cases=STEP_CASES, tol=STEP_MATH)
def _(case, g):
    shape, dtype, start = case["shape"], DTYPES[case["dtype"]], case.get("start", 0)
    s = scheduler(n=case["n"], shift=case.get("shift", 1.0), mu=case.get("mu"),
                  time_shift_type=case.get("time_shift_type", "exponential"))
    if start:
        s.set_begin_index(start)  # what an img2img pipeline does for strength < 1
    x = torch.randn(shape, generator=g).to(dtype)
    scenarios = []
    for i in range(start, len(s.timesteps)):
        t = s.timesteps[i]
        v = torch.randn(shape, generator=g).to(dtype)
        sigma, sigma_next = s.sigmas[i].clone(), s.sigmas[i + 1].clone()
        expected = s.step(v.clone(), t, x.clone()).prev_sample
        exact = x.double() + (sigma_next.double() - sigma.double()) * v.double()
        scenarios.append(Scenario(
            inputs=dict(model_output=v, sample=x, sigma=sigma, sigma_next=sigma_next), expected=expected,
            exact=exact,
            label=f"step {i + 1}/{len(s.timesteps)}, t={float(t):.6g}, σ={float(sigma):.6g} → {float(sigma_next):.6g}"))
        x = expected
    return scenarios


@flow_euler_step.trap("ε-style (DDIM) update on a velocity model",
                      hint="The output is a velocity v = ε − x₀, not ε: there is no x̂₀ = (x − σ·out)/(1 − σ) to "
                           "re-noise (at σ = 1 it divides by 0). The whole step is x + (σ_next − σ)·v.")
def _(model_output, sample, sigma, sigma_next):
    x, out = sample.float(), model_output.float()
    x0 = (x - sigma * out) / (1 - sigma)
    return ((1 - sigma_next) * x0 + sigma_next * out).to(model_output.dtype)


@flow_euler_step.trap("σ and σ_next swapped (the step goes back up in noise)",
                      hint="σ_next < σ: the step size σ_next − σ is negative, and x moves against v.")
def _(model_output, sample, sigma, sigma_next):
    return (sample.float() + (sigma - sigma_next) * model_output.float()).to(model_output.dtype)


@flow_euler_step.trap("returned x̂₀ = x − σ·v instead of the next latent",
                      hint="x − σ·v is where the line ends (σ = 0); the step stops at σ_next: x + (σ_next − σ)·v.")
def _(model_output, sample, sigma, sigma_next):
    return (sample.float() - sigma * model_output.float()).to(model_output.dtype)


@flow_euler_step.trap("the step in timestep units (t_next − t = 1000·(σ_next − σ))",
                      hint="The velocity is per unit of σ, not of t = 1000·σ: x + (σ_next − σ)·v. A step 1000 times "
                           "too long throws x far past the data.")
def _(model_output, sample, sigma, sigma_next):
    return (sample.float() + (sigma_next - sigma) * 1000 * model_output.float()).to(model_output.dtype)


@flow_euler_step.trap("left in float32 for a float16 model",
                      hint="diffusers casts prev_sample back to model_output.dtype: return the model's dtype.")
def _(model_output, sample, sigma, sigma_next):
    return sample.float() + (sigma_next - sigma) * model_output.float()
