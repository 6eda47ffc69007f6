"""Grader for lab 01 · Forward noise process: schedules, ᾱ, add_noise, v target, zero terminal SNR.

Imports only the DDPM scheduler module: grading this lab never loads diffusers' models or pipelines.

Precision: every float check also computes the float64 shadow of diffusers' answer (Scenario.exact, the
same math on the same inputs in float64), so an answer computed wider and cast once (float64 schedules,
Python floats) passes when it is as close to exact math as diffusers' own. The one exception in the
course is add_noise/velocity on float16 samples: there the lesson is where diffusers puts the cast (ᾱ to
the sample's dtype before the square roots), so those cases have no shadow and a float32-then-cast
answer is named by its trap as more accurate than diffusers, not as a wrong formula (lesson: solutions/01).
"""
import math

import torch
from diffusers.schedulers.scheduling_ddpm import (
    DDPMScheduler,
    betas_for_alpha_bar,
    rescale_zero_terminal_snr as reference_zsnr,
)

from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import SCHEDULE
from diffusion_katas.engine.helpers import DTYPES, SCHEDULERS, SD_BETAS

# Schedules worth grading on: Stable Diffusion's, the DDPM paper's, and a short one.
SCHEDULES = [
    dict(beta_start=SD_BETAS["beta_start"], beta_end=SD_BETAS["beta_end"], num_train_timesteps=1000),
    dict(beta_start=0.0001, beta_end=0.02, num_train_timesteps=1000),
    dict(beta_start=0.001, beta_end=0.05, num_train_timesteps=37),
]
SCHEDULER_CLASSES = (
    "diffusers.schedulers.scheduling_ddpm.DDPMScheduler",
    "diffusers.schedulers.scheduling_ddim.DDIMScheduler",
)
# Every scheduler computes the schedule in its constructor (betas, ᾱ): building any of them is a route to it.
EVERY_CONSTRUCTOR = f"{SCHEDULERS}:*Scheduler*.__init__"
# add_noise and get_velocity are each other's route (get_velocity(sample=−ε, noise=x₀) = add_noise(x₀, ε)), and
# every scheduler's own (a flow's scale_noise, Karras VE's add_noise_to_input)
NOISING = tuple(f"{SCHEDULERS}:*Scheduler*.{name}" for name in ("add_noise", "get_velocity", "scale_noise",
                                                                 "add_noise_to_input"))


def scheduler(schedule: str = "scaled_linear", **kw) -> DDPMScheduler:
    return DDPMScheduler(beta_schedule=schedule, **kw)


# ---- scaled_linear_betas ----------------------------------------------------------------------------
scaled_linear_betas = Kata(
    "scaled_linear_betas",
    hints=(
        "Stable Diffusion's schedule is evenly spaced in √β, not in β.",
        "β_t = (√β_start + t·(√β_end − √β_start)/(T − 1))² for t = 0 … T−1.",
        "torch.linspace(beta_start ** 0.5, beta_end ** 0.5, T, dtype=torch.float32) ** 2",
    ),
    answer_key=(*(f"{c}.__init__" for c in SCHEDULER_CLASSES), EVERY_CONSTRUCTOR),
)


@scaled_linear_betas.check("vs DDPMScheduler.betas", cases=SCHEDULES, tol=SCHEDULE)
def _(case, g):
    exact = torch.linspace(case["beta_start"] ** 0.5, case["beta_end"] ** 0.5, case["num_train_timesteps"],
                           dtype=torch.float64) ** 2
    return Scenario(inputs=dict(case), expected=scheduler("scaled_linear", **case).betas, exact=exact)


@scaled_linear_betas.trap("a linspace over β itself (that is the 'linear' schedule)",
                          hint="Space the square roots evenly, then square: linspace(√β_start, √β_end, T)².")
def _(beta_start, beta_end, num_train_timesteps):
    return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)


@scaled_linear_betas.trap("√ of a linspace over β (the square root and the square swapped)",
                          hint="Take the square roots of the end points, space evenly, then square.")
def _(beta_start, beta_end, num_train_timesteps):
    return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32).sqrt()


@scaled_linear_betas.trap("the √β ramp as i/T (β_end never reached)",
                          hint="linspace(√β_start, √β_end, T) includes both ends: step i/(T − 1), so β_{T−1} = β_end "
                               "exactly. arange(T)/T stops one step short.")
def _(beta_start, beta_end, num_train_timesteps):
    ramp = torch.arange(num_train_timesteps, dtype=torch.float64) / num_train_timesteps
    return ((beta_start**0.5 + ramp * (beta_end**0.5 - beta_start**0.5)) ** 2).float()


@scaled_linear_betas.trap("built in float16, cast to float32 at the end",
                          hint="β is small but needs float32's 7 digits: float16 keeps about 3, so neighbouring βs "
                               "collapse onto the same value. Build the linspace in float32 (dtype=torch.float32).")
def _(beta_start, beta_end, num_train_timesteps):
    return (torch.linspace(beta_start**0.5, beta_end**0.5, num_train_timesteps, dtype=torch.float16) ** 2).float()


# ---- cosine_betas -----------------------------------------------------------------------------------
cosine_betas = Kata(
    "cosine_betas",
    hints=(
        "Define ᾱ(t) = f(t) on t ∈ [0, 1]; each β is 1 minus the ratio of two neighbouring f values.",
        "f(t) = cos(((t + 0.008)/1.008)·π/2)²;  β_i = min(1 − f((i+1)/T)/f(i/T), max_beta).",
        "Loop i over range(T) with Python floats (math.cos), collect the betas in a list, then "
        "torch.tensor(betas, dtype=torch.float32).",
    ),
    answer_key=("diffusers.schedulers.scheduling_ddpm.betas_for_alpha_bar",
                "diffusers.schedulers.scheduling_ddim.betas_for_alpha_bar",
                *(f"{c}.__init__" for c in SCHEDULER_CLASSES), EVERY_CONSTRUCTOR, f"{SCHEDULERS}:betas_for_alpha_bar"),
)


@cosine_betas.check("vs betas_for_alpha_bar",
                    cases=[dict(num_train_timesteps=1000), dict(num_train_timesteps=50, max_beta=0.999),
                           dict(num_train_timesteps=20, max_beta=0.5)], tol=SCHEDULE)
def _(case, g):
    T, max_beta = case["num_train_timesteps"], case.get("max_beta", 0.999)
    exact = torch.tensor([min(1 - _f((i + 1) / T) / _f(i / T), max_beta) for i in range(T)], dtype=torch.float64)
    return Scenario(inputs=dict(case), expected=betas_for_alpha_bar(T, max_beta=max_beta), exact=exact)


def _f(t, offset=0.008):
    return math.cos((t + offset) / (1 + offset) * math.pi / 2) ** 2


@cosine_betas.trap("the cap at max_beta is missing (the last β becomes 1)",
                   hint="Clip every β at max_beta: f(1) = 0 would otherwise make the last step β = 1.")
def _(num_train_timesteps, max_beta=0.999):
    T = num_train_timesteps
    return torch.tensor([1 - _f((i + 1) / T) / _f(i / T) for i in range(T)], dtype=torch.float32)


@cosine_betas.trap("vectorised in float32 tensors (1 − f(t + 1/T)/f(t) cancels for the first, tiny βs)",
                   hint="The early βs are ~4e-5: 1 minus a ratio that close to 1 keeps only the digits float32 has "
                        "left. diffusers loops in Python floats (float64); vectorise in float64 and cast once.")
def _(num_train_timesteps, max_beta=0.999):
    T = num_train_timesteps
    t = torch.arange(T, dtype=torch.float32)
    f = lambda u: torch.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    return (1 - f((t + 1) / T) / f(t / T)).clamp(max=max_beta)


@cosine_betas.trap("the 0.008 offset is missing",
                   hint="f(t) uses (t + s)/(1 + s) with s = 0.008, which keeps the first β from being ~0.")
def _(num_train_timesteps, max_beta=0.999):
    T = num_train_timesteps
    return torch.tensor([min(1 - _f((i + 1) / T, 0) / _f(i / T, 0), max_beta) for i in range(T)],
                        dtype=torch.float32)


@cosine_betas.trap("β taken as 1 − ᾱ(t) instead of from the ratio of neighbouring ᾱ values",
                   hint="f is ᾱ, a cumulative product: β_i = 1 − ᾱ_{i+1}/ᾱ_i, not 1 − ᾱ_i.")
def _(num_train_timesteps, max_beta=0.999):
    T = num_train_timesteps
    return torch.tensor([min(1 - _f((i + 1) / T), max_beta) for i in range(T)], dtype=torch.float32)


@cosine_betas.trap("f(t) = cos(…) without the square",
                   hint="Nichol & Dhariwal's ᾱ is cos²: f(t) = cos(((t + 0.008)/1.008)·π/2)². Without the square "
                        "every β is about half what it should be.")
def _(num_train_timesteps, max_beta=0.999):
    T = num_train_timesteps
    return torch.tensor([min(1 - _f((i + 1) / T) ** 0.5 / _f(i / T) ** 0.5, max_beta) for i in range(T)],
                        dtype=torch.float32)


@cosine_betas.trap("shifted one step late (β_i from f(i/T)/f((i − 1)/T), β_0 = 0)",
                   hint="β_i = 1 − f((i + 1)/T)/f(i/T) for i = 0 … T − 1: step i goes from time i/T to (i + 1)/T, so "
                        "the first β is already the step out of t = 0.")
def _(num_train_timesteps, max_beta=0.999):
    T = num_train_timesteps
    return torch.tensor([0.0] + [min(1 - _f(i / T) / _f((i - 1) / T), max_beta) for i in range(1, T)],
                        dtype=torch.float32)


# ---- alphas_cumprod ---------------------------------------------------------------------------------
alphas_cumprod = Kata(
    "alphas_cumprod",
    hints=(
        "ᾱ_t is how much of the clean signal's variance survives t steps: a running product.",
        "α_t = 1 − β_t and ᾱ_t = α_0 · α_1 · … · α_t.",
        "torch.cumprod(1.0 - betas, dim=0)",
    ),
    # DDPMScheduler.__init__ computes it inline (torch.cumprod), as every scheduler's constructor does
    answer_key=(*(f"{c}.__init__" for c in SCHEDULER_CLASSES), EVERY_CONSTRUCTOR),
)


@alphas_cumprod.check("vs DDPMScheduler.alphas_cumprod",
                      cases=[dict(schedule="scaled_linear"), dict(schedule="linear"),
                             dict(schedule="squaredcos_cap_v2"), dict(schedule="linear", T=37),
                             # zero terminal SNR: β_T = 1, so ᾱ_T is exactly 0
                             dict(schedule="scaled_linear", rescale_betas_zero_snr=True)], tol=SCHEDULE)
def _(case, g):
    s = scheduler(case["schedule"], num_train_timesteps=case.get("T", 1000),
                  rescale_betas_zero_snr=case.get("rescale_betas_zero_snr", False))
    return Scenario(inputs=dict(betas=s.betas.clone()), expected=s.alphas_cumprod,
                    exact=torch.cumprod(1.0 - s.betas.double(), dim=0),
                    verify=_zero_terminal_snr if case.get("rescale_betas_zero_snr") else None)


def _zero_terminal_snr(out) -> None:
    """At zero terminal SNR ᾱ_T is 0 exactly: a tiny nonzero value is within any float tolerance of it, but it is
    another schedule (σ_T = √((1 − ᾱ_T)/ᾱ_T) finite, the last step not pure noise). Judged on its own."""
    if isinstance(out, torch.Tensor) and out.dim() == 1 and len(out) and out.is_floating_point() \
            and bool(torch.isfinite(out[-1])) and float(out[-1]) != 0.0:
        tiny = 0 < float(out[-1]) <= 1e-6
        raise KataFailure(
            f"  ᾱ_T should be exactly 0 (β_T = 1: zero terminal SNR), got {float(out[-1])!r}"
            + ("\n  trap: ᾱ_T = 0 replaced by a tiny value (Euler's 2⁻²⁴ guard against an infinite σ)\n    ᾱ is "
               "the running product, 0 at zero terminal SNR: that 0 is the point. Euler and DPM-Solver put 2⁻²⁴ in "
               "their own copy only to keep σ_T = √((1 − ᾱ)/ᾱ) finite." if tiny else ""))


@alphas_cumprod.trap("a running product of β instead of 1 − β",
                     hint="ᾱ multiplies the kept fractions α = 1 − β, not the added noise β.")
def _(betas):
    return torch.cumprod(betas, dim=0)


@alphas_cumprod.trap("the product over s < t (ᾱ_0 = 1: each ᾱ one step late)",
                     hint="ᾱ_t = ∏_{s≤t}(1 − β_s) includes step t itself: ᾱ_0 = 1 − β_0, and torch.cumprod(1 − β) "
                          "is already it (no shift, no leading 1).")
def _(betas):
    return torch.cat([torch.ones(1, dtype=betas.dtype), torch.cumprod(1.0 - betas, dim=0)[:-1]])


@alphas_cumprod.trap("1 − cumprod(β)", hint="Take 1 − β first, then the running product.")
def _(betas):
    return 1 - torch.cumprod(betas, dim=0)


@alphas_cumprod.trap("a running sum instead of a running product",
                     hint="Survival fractions multiply: use torch.cumprod, not cumsum.")
def _(betas):
    return 1 - torch.cumsum(betas, dim=0)


# ---- add_noise and velocity: shared scenarios -----------------------------------------------------------
NOISE_CASES = [
    dict(shape=(4, 3, 8, 8), dtype="float32", schedule="scaled_linear"),
    dict(shape=(3, 4, 16, 16), dtype="float32", schedule="linear"),
    dict(shape=(5, 4, 8, 8), dtype="float16", schedule="scaled_linear"),
    dict(shape=(2, 6), dtype="float32", schedule="squaredcos_cap_v2"),
    dict(shape=(3, 5, 7), dtype="float32", schedule="linear", T=250),  # a schedule other than T = 1000
]


def noise_scenario(case, g, method: str) -> Scenario:
    s = scheduler(case["schedule"], num_train_timesteps=case.get("T", 1000))
    dtype = DTYPES[case["dtype"]]
    B = case["shape"][0]
    x0 = torch.randn(case["shape"], generator=g).to(dtype)
    noise = torch.randn(case["shape"], generator=g).to(dtype)
    T = s.config.num_train_timesteps
    # The edges 0 and T−1 always, the rest random: every batch mixes noise levels.
    t = torch.cat([torch.tensor([0, T - 1]), torch.randint(0, T, (B - 2,), generator=g)])
    t = t[torch.randperm(B, generator=g)]
    inputs = dict(x0=x0, noise=noise, alphas_cumprod=s.alphas_cumprod.clone(), timesteps=t)
    reference = s.add_noise if method == "add_noise" else s.get_velocity
    expected = reference(x0.clone(), noise.clone(), t.clone())
    # diffusers' own code on float64 samples is the shadow. Not for float16: there the lesson is where
    # diffusers casts (ᾱ to float16 before the square roots), the one place the course grades that.
    exact = reference(x0.double(), noise.double(), t.clone()) if dtype != torch.float16 else None
    return Scenario(inputs=inputs, expected=expected, exact=exact, label=f"timesteps {t.tolist()}")


def coefficients(alphas_cumprod, timesteps, like):
    a = alphas_cumprod.to(like.dtype)[timesteps].reshape((-1,) + (1,) * (like.dim() - 1))
    return a


add_noise = Kata(
    "add_noise",
    hints=(
        "Each sample has its own timestep: pick its ᾱ, then mix signal and noise so variances add to 1.",
        "x_t = √ᾱ_t·x_0 + √(1 − ᾱ_t)·ε, with ᾱ_t = alphas_cumprod[t] shaped (B, 1, 1, 1) and in x0's dtype.",
        "a = alphas_cumprod.to(x0.dtype)[timesteps].reshape(-1, *[1] * (x0.dim() - 1)); "
        "return a ** 0.5 * x0 + (1 - a) ** 0.5 * noise",
    ),
    answer_key=(*(f"{c}.add_noise" for c in SCHEDULER_CLASSES), *NOISING),
)


@add_noise.check("vs DDPMScheduler.add_noise", cases=NOISE_CASES, tol=SCHEDULE)
def _(case, g):
    return noise_scenario(case, g, "add_noise")


@add_noise.trap("ᾱ_t used where √ᾱ_t belongs",
                hint="The coefficients are square roots: √ᾱ_t·x_0 + √(1 − ᾱ_t)·ε keeps unit variance.")
def _(x0, noise, alphas_cumprod, timesteps):
    a = coefficients(alphas_cumprod, timesteps, x0)
    return a * x0 + (1 - a) * noise


@add_noise.trap("the signal and noise coefficients swapped",
                hint="At t = 0 the sample must be almost clean: x_0 gets √ᾱ_t (≈1), ε gets √(1 − ᾱ_t) (≈0).")
def _(x0, noise, alphas_cumprod, timesteps):
    a = coefficients(alphas_cumprod, timesteps, x0)
    return (1 - a) ** 0.5 * x0 + a**0.5 * noise


@add_noise.trap("computed in float32 and cast to float16 at the end",
                hint="That is more accurate than diffusers, and everywhere else in the course it passes; the "
                     "forward process (add_noise, velocity) is the one place whose lesson is where the cast "
                     "goes. diffusers casts ᾱ to the sample's dtype first and takes the square roots in "
                     "float16: do the same (alphas_cumprod.to(x0.dtype)).")
def _(x0, noise, alphas_cumprod, timesteps):
    a = alphas_cumprod[timesteps].reshape((-1,) + (1,) * (x0.dim() - 1))
    return (a**0.5 * x0.float() + (1 - a) ** 0.5 * noise.float()).to(x0.dtype)


@add_noise.trap("one timestep for the whole batch (the first sample's ᾱ_t for every sample)",
                hint="timesteps holds one t per sample: index alphas_cumprod with all of them, shape (B,), and "
                     "reshape to (B, 1, 1, 1) so each sample gets its own ᾱ_t.")
def _(x0, noise, alphas_cumprod, timesteps):
    a = alphas_cumprod.to(x0.dtype)[timesteps[0]]
    return a**0.5 * x0 + (1 - a) ** 0.5 * noise


@add_noise.trap("β_t used where ᾱ_t belongs (one step's noise instead of the cumulative product)",
                hint="alphas_cumprod already holds ᾱ_t; x_t jumps straight from x_0 to step t in one go.")
def _(x0, noise, alphas_cumprod, timesteps):
    abar = alphas_cumprod.to(x0.dtype)
    alphas = torch.cat([abar[:1], abar[1:] / abar[:-1]])
    a = alphas[timesteps].reshape((-1,) + (1,) * (x0.dim() - 1))
    return a**0.5 * x0 + (1 - a) ** 0.5 * noise


@add_noise.trap("ᾱ read at t − 1 (the paper's steps counted from 1)",
                hint="diffusers' timesteps index alphas_cumprod from 0: ᾱ_t is alphas_cumprod[t] (t = 0 is the "
                     "first noising step), not [t − 1] (which at t = 0 wraps to the noisiest entry).")
def _(x0, noise, alphas_cumprod, timesteps):
    a = coefficients(alphas_cumprod, timesteps - 1, x0)
    return a**0.5 * x0 + (1 - a) ** 0.5 * noise


@add_noise.trap("ᾱ_t shaped (B, 1, 1, 1) whatever x0's number of dimensions",
                hint="x0 may have any number of trailing dims: reshape ᾱ_t to (B,) + (1,) * (x0.dim() − 1), so a "
                     "(B, L) sample gets (B, 1) and a video latent (B, C, F, H, W) gets (B, 1, 1, 1, 1).")
def _(x0, noise, alphas_cumprod, timesteps):
    a = alphas_cumprod.to(x0.dtype)[timesteps].view(-1, 1, 1, 1)
    return a**0.5 * x0 + (1 - a) ** 0.5 * noise


velocity = Kata(
    "velocity",
    hints=(
        "v is the noisy sample's direction turned by 90°: the same two coefficients, swapped roles, one sign.",
        "v_t = √ᾱ_t·ε − √(1 − ᾱ_t)·x_0.",
        "a = alphas_cumprod.to(x0.dtype)[timesteps].reshape(-1, *[1] * (x0.dim() - 1)); "
        "return a ** 0.5 * noise - (1 - a) ** 0.5 * x0",
    ),
    answer_key=(*(f"{c}.get_velocity" for c in SCHEDULER_CLASSES), *NOISING),
)


@velocity.check("vs DDPMScheduler.get_velocity", cases=NOISE_CASES, tol=SCHEDULE)
def _(case, g):
    return noise_scenario(case, g, "get_velocity")


@velocity.trap("the sign flipped: √(1 − ᾱ)·x_0 − √ᾱ·ε",
               hint="v = √ᾱ·ε − √(1−ᾱ)·x_0: the noise term is positive.")
def _(x0, noise, alphas_cumprod, timesteps):
    a = coefficients(alphas_cumprod, timesteps, x0)
    return (1 - a) ** 0.5 * x0 - a**0.5 * noise


@velocity.trap("x_0 and ε swapped: √ᾱ·x_0 − √(1 − ᾱ)·ε",
               hint="In v the noise ε carries √ᾱ and the clean sample carries −√(1 − ᾱ).")
def _(x0, noise, alphas_cumprod, timesteps):
    a = coefficients(alphas_cumprod, timesteps, x0)
    return a**0.5 * x0 - (1 - a) ** 0.5 * noise


@velocity.trap("the flow-matching velocity ε − x_0 (lab 13's), not v = √ᾱ·ε − √(1 − ᾱ)·x_0",
               hint="v-prediction's v is the rate of change on the unit circle (Salimans & Ho): √ᾱ·ε − √(1 − ᾱ)·x_0. "
                    "ε − x_0 is rectified flow's velocity along a straight line.")
def _(x0, noise, alphas_cumprod, timesteps):
    return noise - x0


@velocity.trap("v recovered from x_t: (√ᾱ·x_t − x_0)/√(1 − ᾱ), equal on paper, cancelling at small t",
               hint="Dividing by √(1 − ᾱ) magnifies x_t's rounding where 1 − ᾱ is tiny (t near 0), and in float16 it "
                    "is 0/0 once ᾱ rounds to 1. Compute v directly: √ᾱ·ε − √(1 − ᾱ)·x_0.")
def _(x0, noise, alphas_cumprod, timesteps):
    a = coefficients(alphas_cumprod, timesteps, x0)
    x_t = a**0.5 * x0 + (1 - a) ** 0.5 * noise
    return (a**0.5 * x_t - x0) / (1 - a) ** 0.5


@velocity.trap("computed in float32 and cast to float16 at the end",
               hint="That is more accurate than diffusers, and everywhere else in the course it passes; the "
                    "forward process (add_noise, velocity) is the one place whose lesson is where the cast "
                    "goes. diffusers casts ᾱ to the sample's dtype first and takes the square roots in "
                    "float16: do the same (alphas_cumprod.to(x0.dtype)).")
def _(x0, noise, alphas_cumprod, timesteps):
    a = alphas_cumprod[timesteps].reshape((-1,) + (1,) * (x0.dim() - 1))
    return (a**0.5 * noise.float() - (1 - a) ** 0.5 * x0.float()).to(x0.dtype)


# ---- rescale_zero_terminal_snr ------------------------------------------------------------------------
rescale_zero_terminal_snr = Kata(
    "rescale_zero_terminal_snr",
    hints=(
        "Work on √ᾱ, not on β: move its curve down so it ends at 0, then stretch it so it starts where it did.",
        "√ᾱ' = (√ᾱ − √ᾱ_last)·√ᾱ_0/(√ᾱ_0 − √ᾱ_last);  ᾱ' = (√ᾱ')²;  α'_t = ᾱ'_t/ᾱ'_{t−1} (α'_0 = ᾱ'_0);  β' = 1 − α'.",
        "s = torch.cumprod(1 - betas, 0).sqrt(); s0, sT = s[0].clone(), s[-1].clone(); "
        "s = (s - sT) * (s0 / (s0 - sT)); a = s ** 2; return 1 - torch.cat([a[:1], a[1:] / a[:-1]])",
    ),
    answer_key=("diffusers.schedulers.scheduling_ddpm.rescale_zero_terminal_snr",
                "diffusers.schedulers.scheduling_ddim.rescale_zero_terminal_snr", f"{SCHEDULERS}:rescale_zero_terminal_snr",
                EVERY_CONSTRUCTOR),  # a scheduler built with rescale_betas_zero_snr=True rescales its betas
)


@rescale_zero_terminal_snr.check("vs rescale_zero_terminal_snr",
                                 cases=[dict(schedule="scaled_linear"), dict(schedule="linear"),
                                        dict(schedule="linear", num_train_timesteps=64)], tol=SCHEDULE)
def _(case, g):
    s = scheduler(case["schedule"], num_train_timesteps=case.get("num_train_timesteps", 1000))
    # float32 cancellation near the tail (√ᾱ_t − √ᾱ_last, then ratios of tiny ᾱ) leaves diffusers up
    # to 7.1e-6 from exact math (T=1000, index 997): the float64 shadow measures that.
    return Scenario(inputs=dict(betas=s.betas.clone()), expected=reference_zsnr(s.betas.clone()),
                    exact=reference_zsnr(s.betas.double()))


@rescale_zero_terminal_snr.trap("shifted but not rescaled (ᾱ_0 moved too)",
                                hint="After shifting √ᾱ so the last value is 0, scale it by √ᾱ_0/(√ᾱ_0 − √ᾱ_last).")
def _(betas):
    s = torch.cumprod(1 - betas, 0).sqrt()
    s = s - s[-1].clone()
    a = s**2
    return 1 - torch.cat([a[:1], a[1:] / a[:-1]])


@rescale_zero_terminal_snr.trap("shift and scale applied to ᾱ instead of √ᾱ",
                                hint="The algorithm rescales √ᾱ (the signal coefficient), then squares it.")
def _(betas):
    a = torch.cumprod(1 - betas, 0)
    a0, aT = a[0].clone(), a[-1].clone()
    a = (a - aT) * (a0 / (a0 - aT))
    return 1 - torch.cat([a[:1], a[1:] / a[:-1]])


@rescale_zero_terminal_snr.trap("β' = 1 − ᾱ' (the cumulative product never undone)",
                                hint="The rescaled curve is ᾱ', a running product: β'_t = 1 − ᾱ'_t/ᾱ'_{t−1} (β'_0 = "
                                     "1 − ᾱ'_0), not 1 − ᾱ'_t.")
def _(betas):
    return 1 - _rescaled_sqrt_abar(betas) ** 2


@rescale_zero_terminal_snr.trap("α'_0 taken as 1 (β'_0 = 0) when undoing the product",
                                hint="The first α' is ᾱ'_0 itself (ᾱ_0 = α_0): α' = [ᾱ'_0, ᾱ'_1/ᾱ'_0, …], so β'_0 stays "
                                     "the original β_0.")
def _(betas):
    a = _rescaled_sqrt_abar(betas) ** 2
    return 1 - torch.cat([torch.ones(1, dtype=a.dtype), a[1:] / a[:-1]])


def _rescaled_sqrt_abar(betas):
    """Algorithm 1's first half, right: √ᾱ shifted to end at 0 and scaled to start where it did."""
    s = torch.cumprod(1 - betas, 0).sqrt()
    s0, sT = s[0].clone(), s[-1].clone()
    return (s - sT) * (s0 / (s0 - sT))


@rescale_zero_terminal_snr.trap("the rescaled βs capped at 0.999 (β_T must be exactly 1)",
                                hint="Zero terminal SNR means ᾱ_T = 0, so the last β is 1: a cap (the cosine "
                                     "schedule's max_beta) gives the last step a little signal again.")
def _(betas):
    return reference_zsnr(betas.clone()).clamp(max=0.999)


@rescale_zero_terminal_snr.trap("only the last β set to 1",
                                hint="Zero terminal SNR changes the whole curve smoothly, not just the last step.")
def _(betas):
    out = betas.clone()
    out[-1] = 1.0
    return out
