"""Grader for lab 14 · Multistep solvers: λ, x̂0 for DPM-Solver++, its first- and second-order
updates, the 2M sampling loop, and the loop's convergence order (★).

Imports only the DPM-Solver multistep scheduler module: grading this lab never loads diffusers' models.

The reference is DPMSolverMultistepScheduler(algorithm_type="dpmsolver++", solver_order=2,
solver_type="midpoint", prediction_type="epsilon"), Stable Diffusion's scaled_linear table unless a
case says otherwise. The step checks call its own methods as step() calls them: `_step_index` set to
the step, the sample upcast to float32, the result cast back. Every step of set_timesteps(n) is one
Scenario, on fresh random inputs at the right noise level (x_s = α_s·x_0 + σ_s·ε with x_0 ~ N(0, 1),
and x̂_0 = x_0 + noise, an imperfect model), so a failure names the step that is wrong.

The loops are driven by a `GaussianDenoiser`: the ideal ε-prediction for data x_0 ~ N(μ_c, s_c²) per
channel, ε̂(x, t) = σ_t·(x − α_t·μ)/(α_t²·s² + σ_t²). It is the one denoiser whose probability-flow
ODE is solved by hand: the flow keeps (x − α·μ)/√(α²s² + σ²) constant, which the ★ check uses as
the exact solution. It checks each call (the sample's shape and dtype, the timestep, one call per
step) and counts the calls; it is defined at the end of the file.

Precision: every float check carries its float64 shadow (Scenario.exact): diffusers' own methods on a
float64 twin of the scheduler (helpers.float64_twin) on the same inputs, widened. For a loop the shadow
is the same loop on the twin's methods in float64 (step() itself would downcast: it upcasts the sample
to float32, which on float64 is a downcast), driven by the denoiser in float64.

★ Convergence order: the loop is run at N = 16, 32 and 64 steps on a training table whose λ falls
linearly in t (ᾱ = sigmoid(2λ)), where set_timesteps' linspace grid has equal steps in λ and doubling
N halves every one of them. The error against the exact solution must fall ≈ 4× per halving: the
measured order p = log2(e_N/e_2N) must be ≥ MIN_ORDER for both halvings. Measured over 200 seeds of
both cases: the solution's smaller p is 1.86-1.96 (diffusers' own loop passes the same bar, checked
in every build); a loop that only takes first-order steps measures 0.98 on both halvings.
Why not Stable Diffusion's own table: there the last step, into t = 0, shrinks only logarithmically
with N (λ ≈ −½·log(0.00085·(t + 1)) near t = 0), so every solver's measured order stays near 1.4-1.5
(N = 10 to 80): that grid never halves. Why float32 only: float16 rounds each step by ~5e-4, the size
of the 64-step error itself. Why final_sigmas_type="sigma_min": onto σ = 0 the last step is a jump to
x̂_0 whose error is not a power of h.
"""
from __future__ import annotations

import math

import torch
from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler

from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import HALF_STEP, SCHEDULE, STEP_MATH, Tol, for_dtype
from diffusion_katas.engine.comparison import describe, matches
from diffusion_katas.engine.helpers import DTYPES, SD_BETAS, float64_twin
from diffusion_katas.engine.isolation import fresh

DPM = "diffusers.schedulers.scheduling_dpmsolver_multistep.DPMSolverMultistepScheduler"
SCHEDULES = {
    "sd": SD_BETAS,  # Stable Diffusion
    "ddpm": dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02),  # the DDPM paper
    "cosine": dict(beta_schedule="squaredcos_cap_v2"),  # ᾱ_999 ≈ 2.4e-9: λ ≈ −9.9
}


def scheduler(case: dict) -> DPMSolverMultistepScheduler:
    """The reference scheduler of a case: DPM-Solver++(2M), midpoint, ε-prediction."""
    return DPMSolverMultistepScheduler(
        num_train_timesteps=case.get("T", 1000), **SCHEDULES[case.get("schedule", "sd")],
        algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint", prediction_type="epsilon",
        lower_order_final=case.get("lower_order_final", True), final_sigmas_type=case.get("final", "zero"),
        timestep_spacing=case.get("spacing", "linspace"), steps_offset=case.get("steps_offset", 0))


def target_alpha_prod(s, i: int) -> torch.Tensor:
    """ᾱ where step i lands: the next timestep's, or after the last one 1 ("zero") or ᾱ[0] ("sigma_min")."""
    ts = s.timesteps
    if i + 1 < len(ts):
        return s.alphas_cumprod[ts[i + 1]].clone()
    return torch.tensor(1.0) if s.config.final_sigmas_type == "zero" else s.alphas_cumprod[0].clone()


def arrow(s, i: int) -> str:
    ts = s.timesteps.tolist()
    end = (str(ts[i + 1]) if i + 1 < len(ts) else
           "σ = 0 (clean data)" if s.config.final_sigmas_type == "zero" else "σ_min (ᾱ[0])")
    return f"step {i}: t={ts[i]} → {end}"


def noisy(s, t: int, shape, g: torch.Generator):
    """(x_0, ε, x_t) in float32 with x_t at the noise level of t."""
    x0 = torch.randn(shape, generator=g)
    noise = torch.randn(shape, generator=g)
    a = s.alphas_cumprod[t]
    return x0, noise, a**0.5 * x0 + (1 - a) ** 0.5 * noise


def _ab(alpha_prod):
    return alpha_prod**0.5, (1 - alpha_prod) ** 0.5


def _lam(alpha_prod, *, squared=False, flipped=False):
    alpha, sigma = _ab(alpha_prod)
    lam = torch.log(alpha) - torch.log(sigma)
    lam = 2 * lam if squared else lam
    return -lam if flipped else lam


# ---- dpm_lambda ------------------------------------------------------------------------------------------
dpm_lambda = Kata(
    "dpm_lambda",
    hints=(
        "λ is half the log signal-to-noise ratio: log of (signal scale / noise scale). The scales of "
        "x_t = α·x_0 + σ·ε are square roots of ᾱ and 1 − ᾱ.",
        "α = √ᾱ, σ = √(1 − ᾱ), λ = log α − log σ. At ᾱ = 1 (clean data) σ = 0 and λ = +∞.",
        "alpha, sigma = alpha_sigma(alpha_prod); return torch.log(alpha) - torch.log(sigma)",
    ),
    answer_key=(f"{DPM}.__init__", f"{DPM}._sigma_to_alpha_sigma_t"),
)

LAMBDA_TABLE_CASES = [
    dict(schedule="sd"),
    dict(schedule="ddpm"),
    dict(schedule="cosine"),  # ᾱ down to 2.4e-9 at t = 999
    dict(schedule="sd", T=500),
]
LAMBDA_STEP_CASES = [
    dict(n=10),
    dict(n=7, final="sigma_min", spacing="trailing"),
    dict(n=25, spacing="leading", steps_offset=1, schedule="ddpm"),
]


@dpm_lambda.check("vs lambda_t, the training table", cases=LAMBDA_TABLE_CASES, tol=SCHEDULE)
def _(case, g):
    s = scheduler(case)
    table = s.alphas_cumprod.clone()
    exact = _lam(table.double())
    name = case["schedule"] + ("" if "T" not in case else f", T={case['T']}")
    return Scenario(inputs=dict(alpha_prod=table), expected=s.lambda_t.clone(), exact=exact,
                    label=f"{name}: λ from {float(s.lambda_t[0]):.3g} (t=0) to {float(s.lambda_t[-1]):.3g}")


@dpm_lambda.check("vs the λ of the step sigmas (σ = 0 at the end: λ = +∞)", cases=LAMBDA_STEP_CASES, tol=SCHEDULE)
def _(case, g):
    s = scheduler(case)
    s.set_timesteps(case["n"])
    twin = float64_twin(s)
    alpha_prod = torch.stack([s.alphas_cumprod[t] for t in s.timesteps] + [target_alpha_prod(s, case["n"] - 1)])

    def lam(sched):  # how dpm_solver_first_order_update computes λ from scheduler.sigmas
        alpha_t, sigma_t = sched._sigma_to_alpha_sigma_t(sched.sigmas)
        return torch.log(alpha_t) - torch.log(sigma_t)

    return Scenario(inputs=dict(alpha_prod=alpha_prod), expected=lam(s), exact=lam(twin),
                    label=f"ᾱ at timesteps {s.timesteps.tolist()} and the final level")


@dpm_lambda.trap("λ from ᾱ instead of √ᾱ (log(ᾱ/(1 − ᾱ)) is 2λ)",
                 hint="λ = log(α/σ) with α = √ᾱ and σ = √(1 − ᾱ): the log of the ratio of the scales, not of "
                      "the variances (that is the full log-SNR, twice λ).")
def _(alpha_prod):
    return _lam(alpha_prod, squared=True)


@dpm_lambda.trap("λ = log(σ/α): the sign flipped",
                 hint="λ is the log *signal*-to-noise ratio: it grows towards clean data (about 3.5 at t = 0, "
                      "−2.7 at t = 999 on Stable Diffusion's table).")
def _(alpha_prod):
    return _lam(alpha_prod, flipped=True)


@dpm_lambda.trap("1 − ᾱ clamped away from 0: λ finite where ᾱ = 1 (it is +∞)",
                 hint="At clean data (ᾱ = 1) σ = 0 and λ = +∞; diffusers keeps the inf (the last step onto σ = 0 is "
                      "first order, where h = ∞ only makes e^(−h) = 0). Do not clamp.")
def _(alpha_prod):
    a = alpha_prod.double()
    return (0.5 * (a.log() - (1 - a).clamp(min=1e-12).log())).to(alpha_prod.dtype)


@dpm_lambda.trap("the square root on ᾱ only: log √ᾱ − log(1 − ᾱ)",
                 hint="Both scales are square roots: σ = √(1 − ᾱ) as α = √ᾱ, so λ = ½·log ᾱ − ½·log(1 − ᾱ).")
def _(alpha_prod):
    return torch.log(alpha_prod ** 0.5) - torch.log(1 - alpha_prod)


# ---- data_prediction -------------------------------------------------------------------------------------
data_prediction = Kata(
    "data_prediction",
    hints=(
        "DPM-Solver++ integrates the data prediction: turn the denoiser's noise estimate into the clean "
        "sample it implies, by solving x_t = α_t·x_0 + σ_t·ε for x_0.",
        "α_t = √ᾱ_t, σ_t = √(1 − ᾱ_t);  x̂_0 = (x_t − σ_t·ε̂)/α_t.",
        "alpha_t, sigma_t = alpha_sigma(alpha_prod_t); return (sample - sigma_t * model_output) / alpha_t",
    ),
    answer_key=(f"{DPM}.convert_model_output",),
)

X0_CASES = [
    dict(n=10, shape=(2, 4, 8, 8)),
    dict(n=5, spacing="trailing", shape=(1, 4, 16, 16)),
    dict(n=8, shape=(3, 4, 8, 8), dtype="float16"),
    dict(n=6, spacing="leading", steps_offset=1, shape=(2, 3, 8, 8), dtype="float16"),
]


@data_prediction.check("vs convert_model_output, every step", cases=X0_CASES, tol=STEP_MATH)
def _(case, g):
    s = scheduler(case)
    s.set_timesteps(case["n"])
    twin = float64_twin(s)
    dtype = DTYPES[case.get("dtype", "float32")]
    scenarios = []
    for i, t in enumerate(s.timesteps.tolist()):
        _, noise, x = noisy(s, t, case["shape"], g)
        eps = (noise + 0.1 * torch.randn(case["shape"], generator=g)).to(dtype)  # an imperfect ε̂
        x = x.to(dtype)
        s._step_index = twin._step_index = i
        expected = s.convert_model_output(eps.clone(), sample=x.clone())
        exact = twin.convert_model_output(eps.double(), sample=x.double())
        a = s.alphas_cumprod[t].clone()
        scenarios.append(Scenario(inputs=dict(model_output=eps, sample=x, alpha_prod_t=a),
                                  expected=expected, exact=exact, label=f"step {i}: t={t} (ᾱ_t = {float(a):.4g})"))
    return scenarios


@data_prediction.trap("the model output returned as x̂0 (the denoiser predicts noise, not data)",
                      hint="With prediction_type='epsilon' the output is ε̂; DPM-Solver++ needs x̂_0 = (x_t − σ_t·ε̂)/α_t.")
def _(model_output, sample, alpha_prod_t):
    return model_output.clone()


@data_prediction.trap("ᾱ_t used where √ᾱ_t belongs",
                      hint="x_t = α_t·x_0 + σ_t·ε with α_t = √ᾱ_t and σ_t = √(1 − ᾱ_t): square roots.")
def _(model_output, sample, alpha_prod_t):
    return (sample - (1 - alpha_prod_t) * model_output) / alpha_prod_t


@data_prediction.trap("α_t and σ_t swapped: (x_t − α_t·ε̂)/σ_t",
                      hint="x_t = α_t·x_0 + σ_t·ε: the noise is scaled by σ_t = √(1 − ᾱ_t), the data by α_t = √ᾱ_t.")
def _(model_output, sample, alpha_prod_t):
    return (sample - alpha_prod_t ** 0.5 * model_output) / (1 - alpha_prod_t) ** 0.5


@data_prediction.trap("x_t − σ_t·ε̂/α_t: only the noise term divided (parentheses)",
                      hint="Both terms are divided by α_t: x̂_0 = (x_t − σ_t·ε̂)/α_t.")
def _(model_output, sample, alpha_prod_t):
    return sample - (1 - alpha_prod_t) ** 0.5 * model_output / alpha_prod_t ** 0.5


@data_prediction.trap("divided by ᾱ_t instead of α_t = √ᾱ_t",
                      hint="x_t = α_t·x_0 + σ_t·ε with α_t = √ᾱ_t: x̂_0 = (x_t − σ_t·ε̂)/√ᾱ_t.")
def _(model_output, sample, alpha_prod_t):
    return (sample - (1 - alpha_prod_t) ** 0.5 * model_output) / alpha_prod_t


@data_prediction.trap("x_t − σ_t·ε̂ without dividing by α_t",
                      hint="Removing the noise leaves α_t·x_0: divide by α_t = √ᾱ_t.")
def _(model_output, sample, alpha_prod_t):
    return sample - (1 - alpha_prod_t) ** 0.5 * model_output


# ---- the updates: the reference math with one mistake switched on (for the traps) -----------------------
def wrong_update(x0s, sample, alpha_prods, alpha_prod_t, *, second: bool, squared=False, flipped_h=False,
                 swapped=False, no_d1=False, r0_not_inverted=False, no_half=False, heun=False, eps_form=False,
                 no_r0=False, flipped_h0=False, x0_sign=False, alpha_ratio=False, no_upcast=False, ve_ratio=False,
                 alpha_s_on_x0=False):
    """First order (x0s = [m0], alpha_prods = [ᾱ_s0]) or 2M midpoint (oldest first), float32 like step()."""
    m0 = x0s[-1]
    m1 = x0s[-2] if second else None
    if swapped:
        m0, m1 = m1, m0
    alpha_t, sigma_t = _ab(alpha_prod_t)
    alpha_s0, sigma_s0 = _ab(alpha_prods[-1])
    lam_t, lam_s0 = _lam(alpha_prod_t, squared=squared), _lam(alpha_prods[-1], squared=squared)
    h = lam_s0 - lam_t if flipped_h else lam_t - lam_s0
    x = sample if no_upcast else sample.to(torch.float32)  # no_upcast: a float16 sample keeps the arithmetic float16
    if eps_form:  # DPM-Solver's noise-prediction update, fed x̂0
        out = (alpha_t / alpha_s0) * x - (sigma_t * (torch.exp(h) - 1.0)) * m0
        return out.to(sample.dtype)
    ratio = alpha_t / alpha_s0 if alpha_ratio else sigma_t / sigma_s0
    if ve_ratio:  # the variance-exploding σ = √((1 − ᾱ)/ᾱ) of diffusers' scheduler.sigmas, not the VP σ
        ratio = (sigma_t / alpha_t) / (sigma_s0 / alpha_s0)
    out = ratio * x + (1.0 if x0_sign else -1.0) * ((alpha_s0 if alpha_s_on_x0 else alpha_t) * (torch.exp(-h) - 1.0)) * m0
    if second and not no_d1:
        lam_s1 = _lam(alpha_prods[-2], squared=squared)
        h_0 = lam_s1 - lam_s0 if flipped_h != flipped_h0 else lam_s0 - lam_s1
        r0 = h_0 / h
        d1 = (m0 - m1) if no_r0 else (r0 if r0_not_inverted else 1.0 / r0) * (m0 - m1)
        if heun:
            out = out + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1
        else:
            out = out - (1.0 if no_half else 0.5) * (alpha_t * (torch.exp(-h) - 1.0)) * d1
    return out.to(sample.dtype)


def step_scenarios(case, g, *, second: bool):
    """Every step of set_timesteps(n) (from step 1 for the 2M update; onto σ = 0 only for first order)."""
    s = scheduler(case)
    s.set_timesteps(case["n"])
    twin = float64_twin(s)
    dtype = DTYPES[case.get("dtype", "float32")]
    shape = case["shape"]
    ts = s.timesteps.tolist()
    scenarios = []
    for i, t in enumerate(ts):
        last = i == len(ts) - 1
        if second and (i == 0 or (last and s.config.final_sigmas_type == "zero")):
            continue  # no history yet; onto σ = 0 the 2M formula is ∞/NaN (diffusers steps first order there)
        x0, _, x = noisy(s, t, shape, g)
        m0 = (x0 + 0.1 * torch.randn(shape, generator=g)).to(dtype)  # x̂_0 now: an imperfect model
        x = x.to(dtype)
        a_s, a_t = s.alphas_cumprod[t].clone(), target_alpha_prod(s, i)
        s._step_index = twin._step_index = i
        if second:
            m1 = (x0 + 0.2 * torch.randn(shape, generator=g)).to(dtype)  # x̂_0 one step earlier: noisier
            a_s1 = s.alphas_cumprod[ts[i - 1]].clone()
            expected = s.multistep_dpm_solver_second_order_update([m1.clone(), m0.clone()], sample=x.float())
            exact = twin.multistep_dpm_solver_second_order_update([m1.double(), m0.double()], sample=x.double())
            inputs = dict(model_outputs=[m1, m0], sample=x, alpha_prods=[a_s1, a_s], alpha_prod_t=a_t)
        else:
            expected = s.dpm_solver_first_order_update(m0.clone(), sample=x.float())
            exact = twin.dpm_solver_first_order_update(m0.double(), sample=x.double())
            inputs = dict(x0_pred=m0, sample=x, alpha_prod_s=a_s, alpha_prod_t=a_t)
        scenarios.append(Scenario(inputs=inputs, expected=expected.to(dtype), exact=exact, label=arrow(s, i)))
    return scenarios


# ---- first_order_update ----------------------------------------------------------------------------------
first_order_update = Kata(
    "first_order_update",
    hints=(
        "Work in λ: find α, σ and λ at both ends, the step h = λ_t − λ_s (positive: denoising raises the SNR), "
        "then scale x by the ratio of noise scales and add the α_t-weighted x̂_0 with e^{−h}. Upcast the "
        "sample to float32 for the arithmetic and return the sample's dtype.",
        "h = λ_t − λ_s;  x_t = (σ_t/σ_s)·x_s − α_t·(e^{−h} − 1)·x̂_0 (DDIM with η = 0). Onto clean data "
        "(ᾱ_t = 1): σ_t = 0, λ_t = +∞, e^{−h} = 0 and x_t = x̂_0.",
        "alpha_t, sigma_t = alpha_sigma(alpha_prod_t); _, sigma_s = alpha_sigma(alpha_prod_s); "
        "h = dpm_lambda(alpha_prod_t) - dpm_lambda(alpha_prod_s); x = sample.to(torch.float32); "
        "return ((sigma_t / sigma_s) * x - (alpha_t * (torch.exp(-h) - 1.0)) * x0_pred).to(sample.dtype)",
    ),
    answer_key=(f"{DPM}.dpm_solver_first_order_update",),
)

UPDATE_CASES = [
    dict(n=10, shape=(2, 4, 8, 8)),
    dict(n=7, final="sigma_min", spacing="trailing", shape=(1, 4, 16, 16)),
    dict(n=25, spacing="leading", steps_offset=1, schedule="ddpm", shape=(2, 3, 8, 8)),
]
UPDATE_HALF_CASES = [
    dict(n=10, shape=(2, 4, 8, 8), dtype="float16"),
    dict(n=6, final="sigma_min", shape=(3, 4, 8, 8), dtype="float16"),
]


@first_order_update.check("vs dpm_solver_first_order_update, every step", cases=UPDATE_CASES, tol=STEP_MATH)
def _(case, g):
    return step_scenarios(case, g, second=False)


@first_order_update.check("vs dpm_solver_first_order_update, float16", cases=UPDATE_HALF_CASES, tol=HALF_STEP)
def _(case, g):
    return step_scenarios(case, g, second=False)


@first_order_update.trap("h sign flipped (h = λ_s − λ_t)",
                         hint="h = λ_t − λ_s is positive for a denoising step (λ grows towards clean data), and "
                              "the update uses e^{−h}.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    return wrong_update([x0_pred], sample, [alpha_prod_s], alpha_prod_t, second=False, flipped_h=True)


@first_order_update.trap("λ from ᾱ instead of √ᾱ (h doubled)",
                         hint="λ = log(√ᾱ) − log(√(1 − ᾱ)); log(ᾱ/(1 − ᾱ)) is 2λ and makes e^{−h} its square.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    return wrong_update([x0_pred], sample, [alpha_prod_s], alpha_prod_t, second=False, squared=True)


@first_order_update.trap("the x̂0 term's sign flipped (+ α_t·(e^{−h} − 1)·x̂0)",
                         hint="e^{−h} − 1 is negative for a denoising step: x_t = (σ_t/σ_s)·x_s − α_t·(e^{−h} − 1)·x̂_0 "
                              "adds a positive share of x̂_0.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    return wrong_update([x0_pred], sample, [alpha_prod_s], alpha_prod_t, second=False, x0_sign=True)


@first_order_update.trap("α_s on the x̂0 term instead of α_t (the step's start, not its target)",
                         hint="x_t = (σ_t/σ_s)·x_s − α_t·(e^{−h} − 1)·x̂_0: the x̂_0 share is scaled to where the step "
                              "lands (α_t), so the step onto σ = 0 returns x̂_0 itself.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    return wrong_update([x0_pred], sample, [alpha_prod_s], alpha_prod_t, second=False, alpha_s_on_x0=True)


@first_order_update.trap("α_t/α_s on the sample instead of σ_t/σ_s",
                         hint="DPM-Solver++ (the data prediction) keeps the sample's noise share: x is scaled by the "
                              "ratio of noise scales σ_t/σ_s; α_t/α_s belongs to the noise-prediction form.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    return wrong_update([x0_pred], sample, [alpha_prod_s], alpha_prod_t, second=False, alpha_ratio=True)


@first_order_update.trap("the σ ratio from scheduler.sigmas' √((1 − ᾱ)/ᾱ), not the VP σ = √(1 − ᾱ)",
                         hint="DPM-Solver++ works in the variance-preserving α_t = √ᾱ_t, σ_t = √(1 − ᾱ_t) "
                              "(diffusers' _sigma_to_alpha_sigma_t turns scheduler.sigmas back into these): "
                              "x_t = (σ_t/σ_s)·x_s − α_t·(e^{−h} − 1)·x̂_0.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    return wrong_update([x0_pred], sample, [alpha_prod_s], alpha_prod_t, second=False, ve_ratio=True)


@first_order_update.trap("the noise-prediction (DPM-Solver) update fed x̂0: (α_t/α_s)·x − σ_t·(e^h − 1)·x̂0",
                         hint="That formula is for ε (algorithm_type='dpmsolver'). DPM-Solver++ integrates x̂_0: "
                              "x_t = (σ_t/σ_s)·x_s − α_t·(e^{−h} − 1)·x̂_0.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    return wrong_update([x0_pred], sample, [alpha_prod_s], alpha_prod_t, second=False, eps_form=True)


@first_order_update.trap("the coefficients computed in float16 (ᾱ cast to the sample's dtype before λ and h)",
                         hint="λ = log α − log σ, and h = λ_t − λ_s subtracts two close numbers: in float16 each keeps "
                              "about 3 digits, and e^{−h} − 1 loses the rest. Compute α, σ, λ and h from the float32 "
                              "ᾱ (as diffusers does), upcast the sample, and cast only the result back.")
def _(x0_pred, sample, alpha_prod_s, alpha_prod_t):
    half = sample.dtype
    return wrong_update([x0_pred], sample, [alpha_prod_s.to(half)], alpha_prod_t.to(half), second=False,
                        no_upcast=True)


# ---- second_order_update ---------------------------------------------------------------------------------
second_order_update = Kata(
    "second_order_update",
    hints=(
        "Start from the first-order update and add a correction from how x̂_0 changed since the previous "
        "step: m0 is this step's x̂_0 (the LAST entry of the oldest-first list), m1 the previous one. "
        "Measure both steps in λ.",
        "h = λ_t − λ_s0, h_0 = λ_s0 − λ_s1, r0 = h_0/h, D0 = m0, D1 = (m0 − m1)/r0;  "
        "x_t = (σ_t/σ_s0)·x − α_t·(e^{−h} − 1)·D0 − ½·α_t·(e^{−h} − 1)·D1  (float32 sample, cast back).",
        "m0, m1 = model_outputs[-1], model_outputs[-2]; l_t, l_s0, l_s1 = dpm_lambda(alpha_prod_t), "
        "dpm_lambda(alpha_prods[-1]), dpm_lambda(alpha_prods[-2]); h = l_t - l_s0; r0 = (l_s0 - l_s1) / h; "
        "D1 = (1.0 / r0) * (m0 - m1); c = alpha_t * (torch.exp(-h) - 1.0); x = sample.to(torch.float32); "
        "return ((sigma_t / sigma_s0) * x - c * m0 - 0.5 * c * D1).to(sample.dtype)",
    ),
    answer_key=(f"{DPM}.multistep_dpm_solver_second_order_update",),
)


@second_order_update.check("vs multistep_dpm_solver_second_order_update, every step", cases=UPDATE_CASES, tol=STEP_MATH)
def _(case, g):
    return step_scenarios(case, g, second=True)


@second_order_update.check("vs multistep_dpm_solver_second_order_update, float16", cases=UPDATE_HALF_CASES,
                           tol=HALF_STEP)
def _(case, g):
    return step_scenarios(case, g, second=True)


def _second_trap(name: str, hint: str, **mistake):
    @second_order_update.trap(name, hint=hint)
    def _(model_outputs, sample, alpha_prods, alpha_prod_t):
        return wrong_update(model_outputs, sample, alpha_prods, alpha_prod_t, second=True, **mistake)


_second_trap("m0 and m1 swapped (model_outputs is oldest first)",
             "diffusers' model_outputs lists the history oldest first: m0 = model_outputs[-1] is this step's x̂_0, "
             "m1 = model_outputs[-2] the previous step's (and alpha_prods likewise).", swapped=True)
@second_order_update.trap("alpha_prods read newest first (the ᾱ of the previous step taken as this step's)",
                          hint="alpha_prods lists the history oldest first, like model_outputs: ᾱ_s0 = "
                               "alpha_prods[-1] belongs to this step's x̂_0 = model_outputs[-1].")
def _(model_outputs, sample, alpha_prods, alpha_prod_t):
    return wrong_update(model_outputs, sample, alpha_prods[::-1], alpha_prod_t, second=True)


@second_order_update.trap("the whole history read newest first (model_outputs[0] and alpha_prods[0] taken as this "
                          "step's)",
                          hint="diffusers keeps model_outputs and alpha_prods oldest first: this step's x̂_0 and ᾱ_s0 "
                               "are the last entries, [-1], the previous step's [-2].")
def _(model_outputs, sample, alpha_prods, alpha_prod_t):
    return wrong_update(model_outputs[::-1], sample, alpha_prods[::-1], alpha_prod_t, second=True)


_second_trap("h sign flipped (h = λ_s0 − λ_t)",
             "h = λ_t − λ_s0 and h_0 = λ_s0 − λ_s1 are both positive for denoising steps; the update uses e^{−h}.",
             flipped_h=True)
_second_trap("λ from ᾱ instead of √ᾱ (h doubled)",
             "λ = log(√ᾱ) − log(√(1 − ᾱ)). Doubling λ leaves r0 = h_0/h unchanged but squares e^{−h}.", squared=True)
_second_trap("the D1 correction dropped: that is the first-order update",
             "2M adds −½·α_t·(e^{−h} − 1)·D1 with D1 = (m0 − m1)/r0: the slope of x̂_0 from the previous step is "
             "what makes it second order.", no_d1=True)
_second_trap("D1 = r0·(m0 − m1): r0 where 1/r0 belongs",
             "r0 = h_0/h compares the previous step with this one; the difference m0 − m1 spans h_0, so rescale "
             "it to this step: D1 = (m0 − m1)/r0.", r0_not_inverted=True)
_second_trap("D1 = m0 − m1 without the 1/r0 (the previous step taken as long as this one)",
             "The difference m0 − m1 spans the previous step h_0; D1 rescales it to this step's h: "
             "D1 = (m0 − m1)/r0 with r0 = h_0/h (1 only where both steps are equally long in λ).", no_r0=True)
_second_trap("h_0 sign flipped (h_0 = λ_s1 − λ_s0)",
             "h_0 = λ_s0 − λ_s1: the previous step, measured like this one (later λ minus earlier), is positive.",
             flipped_h0=True)
_second_trap("the ½ of the midpoint rule missing on the D1 term",
             "solver_type='midpoint': x_t = … − ½·α_t·(e^{−h} − 1)·D1.", no_half=True)
_second_trap("the 'heun' D1 coefficient α_t·((e^{−h} − 1)/h + 1) (solver_type='heun', not 'midpoint')",
             "The graded scheduler uses solver_type='midpoint': the D1 term is −½·α_t·(e^{−h} − 1)·D1.", heun=True)


# ---- dpm_solver_sample -----------------------------------------------------------------------------------
dpm_solver_sample = Kata(
    "dpm_solver_sample",
    hints=(
        "One denoiser call per timestep. Turn each ε̂ into x̂_0, keep the last two x̂_0 (and their ᾱ), and step "
        "with first_order_update or second_order_update. The first step has no history; the last step is "
        "first order onto σ = 0, and with lower_order_final when there are fewer than 15 steps.",
        "step i: s = timesteps[i], target = timesteps[i + 1], or after the last ᾱ = 1 ('zero') / "
        "alphas_cumprod[0] ('sigma_min'); x̂_0 = data_prediction(denoiser(x, s), x, ᾱ_s); order 1 if i == 0 or "
        "(last and (final_sigmas_type == 'zero' or (lower_order_final and n < 15))), else order 2 with the "
        "history oldest first.",
        "for i, t in enumerate(timesteps): a_s = alphas_cumprod[t]; a_t = alphas_cumprod[timesteps[i + 1]] if "
        "i + 1 < n else (torch.tensor(1.0) if final_sigmas_type == 'zero' else alphas_cumprod[0]); "
        "x0 = data_prediction(denoiser(x, t), x, a_s); x0s = (x0s + [x0])[-2:]; abars = (abars + [a_s])[-2:]; "
        "x = first_order_update(x0, x, a_s, a_t) if i == 0 or lower_final else "
        "second_order_update(x0s, x, abars, a_t)",
    ),
    answer_key=(f"{DPM}.step", f"{DPM}.convert_model_output", f"{DPM}.dpm_solver_first_order_update",
                f"{DPM}.multistep_dpm_solver_second_order_update"),
)

LOOP_CASES = [
    dict(n=10, batch=2),  # DPM++ 2M as front ends run it: last step first order (σ = 0)
    dict(n=20, final="sigma_min", batch=1),  # n ≥ 15: lower_order_final does not apply, last step 2M
    dict(n=8, final="sigma_min", batch=3),  # n < 15: lower_order_final makes the last step first order
    dict(n=15, final="sigma_min", batch=1),  # the boundary: 15 steps is not "fewer than 15", the last step 2M
    dict(n=14, final="sigma_min", batch=1),  # and 14 is: first order (n ≤ 15 and n < 15 differ only at 15)
    dict(n=6, final="sigma_min", lower_order_final=False, batch=2),  # the flag off: last step 2M
    dict(n=12, lower_order_final=False, batch=2),  # the flag off, but σ = 0 forces first order anyway
    dict(n=7, spacing="trailing", schedule="ddpm", T=500, batch=2, channels=3),
    dict(n=3, spacing="leading", steps_offset=1, batch=1, size=16),
    dict(n=10, batch=2, dtype="float16"),
    dict(n=9, final="sigma_min", batch=3, dtype="float16"),
]


def gaussian_data(case: dict, g: torch.Generator):
    """μ and s per channel of the Gaussian data a case's denoiser is ideal for."""
    channels = case.get("channels", 4)
    mean = 0.5 * torch.randn(channels, generator=g, dtype=torch.float64)
    std = 0.3 + torch.rand(channels, generator=g, dtype=torch.float64)
    return mean, std


def reference_loop(s, denoiser, x: torch.Tensor) -> torch.Tensor:
    """diffusers' loop: scheduler.step(denoiser(x, t), t, x) over its timesteps."""
    for t in s.timesteps:
        x = s.step(denoiser.predict(x, t), t, x).prev_sample
    return x


def shadow_loop(twin, denoiser, x: torch.Tensor) -> torch.Tensor:
    """The float64 shadow of reference_loop: step()'s control flow on the twin's own methods."""
    x = x.double()
    history = [None, None]
    n = len(twin.timesteps)
    for i, t in enumerate(twin.timesteps):
        twin._step_index = i
        m = twin.convert_model_output(denoiser.predict(x, t), sample=x)
        history = [history[-1], m]
        lower_final = i == n - 1 and (twin.config.final_sigmas_type == "zero"
                                      or (twin.config.lower_order_final and n < 15))
        if i == 0 or lower_final:
            x = twin.dpm_solver_first_order_update(m, sample=x)
        else:
            x = twin.multistep_dpm_solver_second_order_update(history, sample=x)
    return x


def _nonfinite(v: torch.Tensor) -> torch.Tensor:
    """Where v is NaN, +∞ and −∞: a 0/0 first step (NaN) is not an ∞ last step."""
    return torch.stack([v.isnan(), v == math.inf, v == -math.inf])


def nonfinite_trap_verify(kata: Kata, inputs: dict, expected: torch.Tensor, tol: Tol):
    """Name a trap whose output is ∞/NaN exactly where the learner's is (comparison.matches never counts NaN
    as equal to NaN): a second-order first step (0/0) and a second-order step onto σ = 0 (h = ∞)."""
    tol = for_dtype(tol, expected.dtype)

    def verify(out):
        if type(out) is not torch.Tensor or out.shape != expected.shape or not out.is_floating_point():
            return
        bad = ~torch.isfinite(out)
        if not bad.any() or not torch.isfinite(expected).all():
            return
        for trap in kata.traps:
            try:
                wrong = trap.fn(**fresh(inputs))
            except Exception:
                continue
            if (type(wrong) is torch.Tensor and wrong.shape == out.shape
                    and torch.equal(_nonfinite(out), _nonfinite(wrong))
                    and matches(torch.where(bad, 0, out), torch.where(bad, 0, wrong), tol)):
                raise KataFailure(
                    f"  output has {int(bad.sum())} non-finite value(s) (nan/inf) where the reference is finite\n"
                    f"  trap: {trap.name}\n    {trap.hint}")

    return verify


@dpm_solver_sample.check("vs DPMSolverMultistepScheduler.step, the whole loop", cases=LOOP_CASES, tol=STEP_MATH)
def _(case, g):
    s = scheduler(case)
    s.set_timesteps(case["n"])
    twin = float64_twin(s)
    dtype = DTYPES[case.get("dtype", "float32")]
    size = case.get("size", 8)
    shape = (case["batch"], case.get("channels", 4), size, size)
    mean, std = gaussian_data(case, g)
    denoiser = GaussianDenoiser(s.alphas_cumprod, mean, std, s.timesteps, shape, dtype)
    x_T = torch.randn(shape, generator=g).to(dtype)
    expected = reference_loop(s, denoiser, x_T.clone())
    exact = shadow_loop(twin, denoiser, x_T)
    inputs = dict(denoiser=denoiser, sample=x_T, alphas_cumprod=s.alphas_cumprod.clone(),
                  timesteps=s.timesteps.clone(), lower_order_final=case.get("lower_order_final", True),
                  final_sigmas_type=case.get("final", "zero"))
    check_nonfinite = nonfinite_trap_verify(dpm_solver_sample, inputs, expected, STEP_MATH)

    def verify(out):
        denoiser.verify(out)
        check_nonfinite(out)

    return Scenario(inputs=inputs, expected=expected, exact=exact, verify=verify,
                    label=f"timesteps {s.timesteps.tolist()}")


def wrong_loop(denoiser, sample, alphas_cumprod, timesteps, lower_order_final=True, final_sigmas_type="zero", *,
               eps_as_x0=False, second_first=False, ignore_lower_final=False, lower_final_any_n=False,
               newest_first=False, always_first=False, final_swapped=False, eps_history=False, up_to_15=False,
               lower_second=False, stale_previous=False):
    """The 2M loop with one misconception switched on (each trap below names one)."""
    predict = denoiser.predict if isinstance(denoiser, GaussianDenoiser) else denoiser
    n = len(timesteps)
    x, x0s, abars = sample, [], []
    for i, t in enumerate(timesteps):
        a_s = alphas_cumprod[t]
        if i + 1 < n:
            a_t = alphas_cumprod[timesteps[i + 1]]
        elif (final_sigmas_type == "zero") != final_swapped:
            a_t = torch.tensor(1.0)
        else:
            a_t = alphas_cumprod[0]
        eps = predict(x, t)
        alpha, sigma = _ab(a_s)
        x0 = eps if eps_as_x0 else (x - sigma * eps) / alpha
        x0s, abars = (x0s + [eps if eps_history else x0])[-2:], (abars + [a_s])[-2:]
        if stale_previous and i > 0:  # the "previous" x̂0 kept from the first step, never refreshed
            first = first if i > 1 else (x0s[0], abars[0])
            x0s, abars = [first[0], x0s[-1]], [first[1], abars[-1]]
        last = i == n - 1
        if ignore_lower_final:
            lower_final = False
        elif lower_final_any_n:
            lower_final = last and (final_sigmas_type == "zero" or lower_order_final)
        else:
            lower_final = last and (final_sigmas_type == "zero" or (lower_order_final and (n <= 15 if up_to_15
                                                                                           else n < 15)))
        if lower_second and i == n - 2 and lower_order_final and n < 15:  # order 3's rule, at order 2
            lower_final = True
        if always_first or (i == 0 and not second_first) or lower_final:
            x = wrong_update([x0], x, [a_s], a_t, second=False)
        else:
            hx, ha = (x0s * 2, abars * 2) if len(x0s) == 1 else (x0s, abars)  # no history: the current one twice
            x = wrong_update(hx[::-1] if newest_first else hx, x, ha[::-1] if newest_first else ha, a_t, second=True)
    return x


def _loop_trap(name: str, hint: str, **mistake):
    @dpm_solver_sample.trap(name, hint=hint)
    def _(**inputs):
        return wrong_loop(**inputs, **mistake)


_loop_trap("ε used where x̂0 belongs (the denoiser's output fed to the updates unconverted)",
           "DPM-Solver++ integrates the data prediction: x̂_0 = data_prediction(denoiser(x, t), x, ᾱ_t) before "
           "the update, and the history holds x̂_0.", eps_as_x0=True)
_loop_trap("the history holds the denoiser's ε̂, not x̂0",
           "Keep x̂_0 = data_prediction(ε̂, x, ᾱ_s) in the history (diffusers' model_outputs holds the converted "
           "outputs): second_order_update's D1 is the slope of x̂_0, not of ε̂.", eps_history=True)
_loop_trap("the first step taken second order (no history yet: h_0 = 0 and D1 = 0/0)",
           "The first step has no previous x̂_0 to take a slope from: it is first order (diffusers: "
           "lower_order_nums < 1). Second order starts at the second step.", second_first=True)
_loop_trap("lower_order_final ignored: the last step taken second order",
           "diffusers takes the last step first order when final_sigmas_type == 'zero' (λ_t = ∞ there: the 2M "
           "formula is ∞/NaN) or when lower_order_final and len(timesteps) < 15.", ignore_lower_final=True)
_loop_trap("lower_order_final applied at every n (diffusers: only below 15 steps)",
           "The flag's rule is `lower_order_final and len(timesteps) < 15`: with 15 or more steps onto σ_min "
           "the last step stays second order.", lower_final_any_n=True)
_loop_trap("lower_order_final at n ≤ 15 (the boundary one off: diffusers' rule is n < 15)",
           "`lower_order_final and len(timesteps) < 15`: at exactly 15 steps the last step stays second order.",
           up_to_15=True)
_loop_trap("the second-to-last step taken first order too (diffusers' lower_order_second, a third-order rule)",
           "At order 2 only the last step drops to first order (lower_order_final, n < 15); diffusers' "
           "lower_order_second applies to solver_order = 3 alone.", lower_second=True)
_loop_trap("the previous x̂0 kept from the first step (the history never moves on)",
           "Each step's history is the two latest x̂_0 (and their ᾱ): push this step's x̂_0 and drop the oldest, "
           "as diffusers' model_outputs does.", stale_previous=True)
_loop_trap("the x̂0 history passed newest first",
           "second_order_update takes the history oldest first, as diffusers' model_outputs: append each new "
           "x̂_0 (and its ᾱ) at the end.", newest_first=True)
_loop_trap("the first-order update at every step (DDIM: the history is never used)",
           "After the first step, 2M uses second_order_update with this step's and the previous step's x̂_0; "
           "only the first step and the lower-order last step are first order.", always_first=True)
_loop_trap("the last step's target swapped: 'zero' lands on clean data (ᾱ = 1), 'sigma_min' on ᾱ[0]",
           "After the last timestep there is no table entry to read: final_sigmas_type='zero' means σ = 0, "
           "ᾱ = 1; 'sigma_min' means the least noisy training level, alphas_cumprod[0].", final_swapped=True)


# ---- ★ convergence order ---------------------------------------------------------------------------------
MIN_ORDER = 1.6
ORDER_WHY = (f"p ≥ {MIN_ORDER} for both halvings: order 2 divides the error by 4 per halving, order 1 by 2; "
             f"{MIN_ORDER} (÷{2 ** MIN_ORDER:.1f}) lies between, with margin both ways (over 200 seeds the "
             "solution's smaller p is ≥ 1.86, a loop of first-order steps measures ≤ 0.99)")
CONVERGENCE_STEPS = (16, 32, 64)  # all ≥ 15: lower_order_final changes nothing, and every run is alike
CONVERGENCE_CASES = [
    dict(lambdas=(3.0, -3.0), batch=2),
    dict(lambdas=(4.0, -2.5), T=500, lower_order_final=False, batch=3, channels=3, size=4),
]


def lambda_linear_betas(T: int, lambda_max: float, lambda_min: float) -> torch.Tensor:
    """β of a training table whose λ falls linearly in t: ᾱ_t = sigmoid(2λ_t), β_t = 1 − ᾱ_t/ᾱ_{t−1}."""
    lam = torch.linspace(lambda_max, lambda_min, T, dtype=torch.float64)
    abar = torch.sigmoid(2 * lam)
    return (1 - abar / torch.cat([torch.ones(1, dtype=torch.float64), abar[:-1]])).float()


def convergence_scheduler(case: dict) -> DPMSolverMultistepScheduler:
    return DPMSolverMultistepScheduler(
        num_train_timesteps=case.get("T", 1000), trained_betas=lambda_linear_betas(case.get("T", 1000),
                                                                                  *case["lambdas"]).tolist(),
        algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint", prediction_type="epsilon",
        lower_order_final=case.get("lower_order_final", True), final_sigmas_type="sigma_min")


def orders(errors: list[float]) -> list[float]:
    return [math.log2(a / b) if a > 0 and b > 0 else float("nan") for a, b in zip(errors, errors[1:])]


class _MeasuredInVerify:
    """The `expected` of a convergence scenario: its verify measured the output, so this equals it."""

    __array_ufunc__ = None

    def __eq__(self, other):
        return True

    def __repr__(self):
        return "the error measured above"


@dpm_solver_sample.check("★ convergence order ≈ 2 (halve the step, the error falls 4×)", cases=CONVERGENCE_CASES,
                         tol=STEP_MATH)
def _(case, g):
    s = convergence_scheduler(case)
    table = s.alphas_cumprod.clone()
    size = case.get("size", 8)
    shape = (case["batch"], case.get("channels", 4), size, size)
    mean, std = gaussian_data(case, g)
    probe = GaussianDenoiser(table, mean, std, [], shape, torch.float32)
    # x_T from the noisy marginal N(α_T·μ, α_T²s² + σ_T²) (any x_T would do: the flow is affine).
    a_T = table[-1].double()
    spread = (a_T * probe.var() + 1 - a_T).sqrt()
    x_T = (a_T.sqrt() * probe.mean_b() + spread * torch.randn(shape, generator=g, dtype=torch.float64)).float()
    exact = probe.exact(x_T, table[-1], table[0])  # the ODE's solution at σ_min, by hand

    def rms(out) -> float:
        return float((out.double() - exact).pow(2).mean().sqrt())

    reference = []
    for n in CONVERGENCE_STEPS:
        s.set_timesteps(n)
        reference.append(rms(reference_loop(s, probe, x_T.clone())))
    if min(orders(reference)) < MIN_ORDER:  # a grader self-check, not the learner's fault
        raise RuntimeError(f"grader: diffusers' own 2M loop measures order {orders(reference)} here")

    errors: dict[int, float] = {}
    scenarios = []
    for n in CONVERGENCE_STEPS:
        s.set_timesteps(n)
        denoiser = GaussianDenoiser(table, mean, std, s.timesteps, shape, torch.float32)
        lam = _lam(table.double())
        h = float(lam[0] - lam[-1]) / n
        inputs = dict(denoiser=denoiser, sample=x_T.clone(), alphas_cumprod=table.clone(),
                      timesteps=s.timesteps.clone(), lower_order_final=s.config.lower_order_final,
                      final_sigmas_type="sigma_min")
        scenarios.append(Scenario(inputs=inputs, expected=_MeasuredInVerify(),
                                  label=f"N={n} steps (h ≈ {h:.3f} in λ; the ODE solved to σ_min by hand)",
                                  verify=_convergence_verify(n, denoiser, x_T, rms, errors, reference)))
    return scenarios


def _convergence_verify(n: int, denoiser, x_T: torch.Tensor, rms, errors: dict, reference: list):
    def verify(out):
        denoiser.verify(out)
        if type(out) is not torch.Tensor or out.shape != x_T.shape or out.dtype != x_T.dtype:
            raise KataFailure(f"  output should be a {x_T.dtype} tensor of shape {tuple(x_T.shape)}, got {describe(out)}")
        if not torch.isfinite(out).all():
            raise KataFailure(f"  output has {int((~torch.isfinite(out)).sum())} non-finite value(s) (nan/inf): no "
                              "error against the ODE's solution can be measured")
        errors[n] = rms(out)
        if n != CONVERGENCE_STEPS[-1] or len(errors) < len(CONVERGENCE_STEPS):
            return
        mine = [errors[k] for k in CONVERGENCE_STEPS]
        p = orders(mine)
        if min(p) >= MIN_ORDER:
            return
        pairs = ", ".join(f"{q:.2f} (N={a} → {b})" for q, a, b in zip(p, CONVERGENCE_STEPS, CONVERGENCE_STEPS[1:]))
        shown = ", ".join(f"N={k}: {e:.3g}" for k, e in zip(CONVERGENCE_STEPS, mine))
        ref_shown = ", ".join(f"{e:.3g}" for e in reference)
        ratios = ", ".join(f"{a / b:.2f}" if b > 0 else "∞" for a, b in zip(mine, mine[1:]))
        if max(p) < 0.5:
            verdict = ("your error does not shrink as the steps get finer: the loop converges to another answer "
                       "(a wrong λ, target or sign), or not at all")
        elif max(p) < 1.3:
            verdict = ("first order: the loop converges like one that only ever takes first-order steps (DDIM). "
                       "Either the second-order correction never acts (after the first step, 2M calls "
                       "second_order_update with this step's and the previous step's x̂_0), or each step's x̂_0 or "
                       "target is off by a first-order amount (the ᾱ it is computed with)")
        else:
            verdict = "less than second order: look at the D1 correction and the history it is built from"
        raise KataFailure(
            f"  measured convergence order p = log2(e_N / e_2N) = {pairs}: {verdict}\n"
            f"    error vs the exact solution of the ODE (RMS): {shown}; each halving of the step divides "
            f"yours by {ratios}, a second-order solver's by ≈ 4\n"
            f"    diffusers' DPMSolverMultistepScheduler on the same problem: p = "
            f"{', '.join(f'{q:.2f}' for q in orders(reference))} (errors {ref_shown})\n"
            f"  required: {ORDER_WHY}")

    return verify


# ---- the denoiser (after the katas: used at run time) ----------------------------------------------------
class GaussianDenoiser:
    """The ideal ε-prediction for Gaussian data x_0 ~ N(μ_c, s_c²) per channel; each call checked and counted.

    ε̂(x, t) = σ_t·(x − α_t·μ)/(α_t²·s² + σ_t²), α_t = √ᾱ_t, σ_t = √(1 − ᾱ_t), computed in float64 and
    returned in x's dtype. Remote (engine/runner.py): the learner's runner gets a stand-in, and every call runs,
    is counted and is checked here, in the grader's process.
    """

    kata_remote = True

    def remote_view(self) -> dict:
        return dict(label=repr(self))

    def __init__(self, alphas_cumprod, mean, std, timesteps, shape, dtype):
        self.table = alphas_cumprod.detach().double().clone()
        self.mean = mean.double()
        self.std = std.double()
        self.expected = [int(t) for t in timesteps]
        self.shape = tuple(shape)
        self.dtype = str(dtype).replace("torch.", "")
        self.seen: list[int] = []

    def __repr__(self) -> str:
        return f"GaussianDenoiser(ideal ε̂ for Gaussian data; {self.dtype} {self.shape}; calls counted)"

    def mean_b(self) -> torch.Tensor:
        return self.mean.view(1, -1, 1, 1)

    def var(self) -> torch.Tensor:
        return (self.std**2).view(1, -1, 1, 1)

    def predict(self, sample: torch.Tensor, timestep) -> torch.Tensor:
        """ε̂ without the call checks (references, shadows and traps call this)."""
        a = self.table[int(timestep)]
        alpha, sigma = a.sqrt(), (1 - a).sqrt()
        eps = sigma * (sample.double() - alpha * self.mean_b()) / (alpha**2 * self.var() + sigma**2)
        return eps.to(sample.dtype)

    def exact(self, x: torch.Tensor, alpha_prod_from, alpha_prod_to) -> torch.Tensor:
        """The probability-flow ODE's solution from noise level ᾱ_from to ᾱ_to, in float64: the flow keeps
        (x − α·μ)/√(α²s² + σ²) constant."""
        a, b = torch.as_tensor(alpha_prod_from).double(), torch.as_tensor(alpha_prod_to).double()
        spread_a = (a * self.var() + 1 - a).sqrt()
        spread_b = (b * self.var() + 1 - b).sqrt()
        return b.sqrt() * self.mean_b() + spread_b / spread_a * (x.double() - a.sqrt() * self.mean_b())

    def __call__(self, sample, timestep, *args, **kwargs):
        k, n = len(self.seen), len(self.expected)
        where = f"denoiser call {k + 1}"
        if not isinstance(sample, torch.Tensor):
            raise KataFailure(f"  {where} got {type(sample).__name__} as its sample: it takes x, the (B, C, H, W) tensor")
        try:
            t = int(timestep)
        except (TypeError, ValueError, RuntimeError):
            raise KataFailure(f"  {where} got timestep {timestep!r}: it takes one timestep, an entry of timesteps") from None
        self.seen.append(t)
        if tuple(sample.shape) != self.shape:
            raise KataFailure(f"  {where} got a sample of shape {tuple(sample.shape)}; the loop's is {self.shape}")
        if str(sample.dtype).replace("torch.", "") != self.dtype:
            raise KataFailure(
                f"  {where} got a {sample.dtype} sample, but the denoiser runs in {self.dtype}: keep the sample in its "
                "own dtype between steps (diffusers casts each step's result back), as a float16 UNet needs")
        once = ("Multistep solvers call the denoiser once per step: the second order comes from the previous "
                "step's x̂_0, not from an extra call")
        if k > 0 and t == self.seen[-2]:
            raise KataFailure(f"  {where} got t={t} again: two denoiser calls for one step. {once}.")
        if k >= n:
            raise KataFailure(f"  {where}: the schedule has only {n} timesteps. {once}.")
        if t != self.expected[k]:
            raise KataFailure(f"  {where} got t={t}; step {k} is at timesteps[{k}] = {self.expected[k]}. "
                              f"Call it once per timestep, in order: {self.expected}")
        return self.predict(sample, timestep)

    def verify(self, out) -> None:
        n = len(self.expected)
        if len(self.seen) < n:
            raise KataFailure(f"  the denoiser was called {len(self.seen)} times; the loop has {n} timesteps, one "
                              f"call each. Not visited: t = {self.expected[len(self.seen):]}")
