"""Grader for lab 15 · Karras and EDM: the ρ-ladder, σ → fractional t, EDM preconditioning, the EDM Euler step.

Imports only two scheduler modules (EulerDiscreteScheduler, EDMEulerScheduler): no model is built.

The ladder is graded against both of diffusers' Karras ladders: EulerDiscreteScheduler(use_karras_sigmas=
True), whose σ_min and σ_max are the ends of its training table (or its config's sigma_min/sigma_max) and
whose ρ is fixed at 7, and EDMEulerScheduler, which takes σ_min, σ_max and ρ from its config. σ → t is
graded against the Euler scheduler's timesteps, from its own Karras σs and from set_timesteps(sigmas=…)
with σs in and out of the table (the clamp). The preconditioning is graded against EDMEulerScheduler's
precondition_inputs / precondition_noise / precondition_outputs, called as scale_model_input and step
call them: each sample with its own 0-dim σ (a batch of per-sample σs is the situation where a
broadcasting mistake shows). The step is graded over whole runs of EDMEulerScheduler.step with
s_churn = 0 (its default: the step is deterministic and draws nothing).

Precision: every float check carries the float64 shadow of diffusers' answer (Scenario.exact: the same
math on the same inputs in float64). diffusers builds both ladders in float64 and casts them to
float32; _sigma_to_t interpolates float64 σs on a float32 log σ table; precondition_inputs keeps
float16 samples float16; step upcasts the sample to float32 but multiplies c_out·F in the model
output's dtype. An answer at most 2× as far from exact math as diffusers' own (+ 2 ulps) passes.
The ladder checks use the SIGMA tolerance, not SCHEDULE: raising to ρ multiplies a float32 rounding
error by ρ, so a ladder built in float32 throughout lands up to ~2e-6 relative from diffusers' float64-
then-cast (measured: 7.6e-5 at σ = 40.8 on the cosine table, ρ = 7), and that is float32, not a mistake.
"""
from __future__ import annotations

import numpy as np
import torch
from diffusers.schedulers.scheduling_edm_euler import EDMEulerScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler

from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import SCHEDULE, SIGMA, STEP_MATH
from diffusion_katas.engine.helpers import DTYPES, quiet_diffusers, sd_schedule

EULER = "diffusers.schedulers.scheduling_euler_discrete.EulerDiscreteScheduler"
EDM = "diffusers.schedulers.scheduling_edm_euler.EDMEulerScheduler"


def _short(t: torch.Tensor) -> str:
    values = [float(f"{v:.5g}") for v in t.flatten().tolist()]
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, {values[2]}, …, {values[-1]}]"


def euler(case: dict) -> EulerDiscreteScheduler:
    """An EulerDiscreteScheduler with Karras σs from a case: its β schedule (Stable Diffusion's by default),
    T and config sigma_min / sigma_max when the case gives them."""
    betas = {"scaled_linear": sd_schedule(), "linear": dict(beta_schedule="linear"),
             "squaredcos_cap_v2": dict(beta_schedule="squaredcos_cap_v2")}[case.get("betas", "scaled_linear")]
    return EulerDiscreteScheduler(num_train_timesteps=case.get("T", 1000), use_karras_sigmas=True,
                                  sigma_min=case.get("config_sigma_min"), sigma_max=case.get("config_sigma_max"),
                                  **betas)


def table_sigmas(s: EulerDiscreteScheduler) -> torch.Tensor:
    """The training table's σs, ascending in t, as diffusers holds them before set_timesteps (float32)."""
    return s.sigmas[:-1].flip(0).clone()


def edm(case: dict) -> EDMEulerScheduler:
    keys = ("sigma_min", "sigma_max", "rho", "sigma_data", "prediction_type")
    return EDMEulerScheduler(**{k: case[k] for k in keys if k in case})


def log_uniform(size, low: float, high: float, g: torch.Generator) -> torch.Tensor:
    """σs spread evenly in log σ over [low, high], float32."""
    u = torch.rand(size, generator=g, dtype=torch.float64)
    return torch.exp(np.log(low) + u * (np.log(high) - np.log(low))).to(torch.float32)


def _per_sample(sigma: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return sigma.reshape(-1, *([1] * (like.dim() - 1)))


# ---- karras_sigmas ----------------------------------------------------------------------------------
karras_sigmas = Kata(
    "karras_sigmas",
    hints=(
        "Space the n noise levels evenly in σ^{1/ρ}, from σ_max down to σ_min, raise them back to the power "
        "ρ, and end the ladder with a 0.",
        "ramp = i/(n − 1) for i = 0 … n − 1 (linspace(0, 1, n));  σ_i = (σ_max^{1/ρ} + ramp·(σ_min^{1/ρ} − "
        "σ_max^{1/ρ}))^ρ;  sigmas = [σ_0, …, σ_{n−1}, 0], float32.",
        "r = torch.linspace(0, 1, n, dtype=torch.float64); lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho); "
        "s = ((hi + r * (lo - hi)) ** rho).float(); return torch.cat([s, s.new_zeros(1)])",
    ),
    answer_key=(f"{EULER}._convert_to_karras", f"{EULER}.set_timesteps", f"{EDM}._compute_karras_sigmas",
                f"{EDM}.set_timesteps"),
)

# Euler: ρ = 7 and σ_min / σ_max from the training table (or the config); n = 1 is left to the EDM cases
# (Euler's one-step grid is t = 0, whose σ it takes as σ_max too).
EULER_LADDER_CASES = [
    dict(num_inference_steps=25, betas="scaled_linear"),  # Stable Diffusion with "Karras sigmas"
    dict(num_inference_steps=10, betas="linear"),
    dict(num_inference_steps=7, betas="squaredcos_cap_v2"),
    dict(num_inference_steps=12, betas="scaled_linear", T=500),
    dict(num_inference_steps=6, betas="scaled_linear", config_sigma_min=0.01, config_sigma_max=20.0),
    dict(num_inference_steps=2, betas="linear"),
]
EDM_LADDER_CASES = [
    dict(num_inference_steps=40, sigma_min=0.002, sigma_max=80.0, rho=7.0),  # EDM's defaults
    dict(num_inference_steps=18, sigma_min=0.002, sigma_max=80.0, rho=3.0),
    dict(num_inference_steps=9, sigma_min=0.0292, sigma_max=14.6146, rho=12.0),
    dict(num_inference_steps=5, sigma_min=0.1, sigma_max=10.0, rho=1.0),  # ρ = 1: linear in σ
    dict(num_inference_steps=1, sigma_min=0.002, sigma_max=80.0, rho=7.0),
    dict(num_inference_steps=3, sigma_min=0.5, sigma_max=2.0, rho=7.0),
]


def exact_ladder(n: int, sigma_min: float, sigma_max: float, rho: float) -> torch.Tensor:
    ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    sigmas = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([sigmas, sigmas.new_zeros(1)])


@karras_sigmas.check("vs EulerDiscreteScheduler(use_karras_sigmas=True).set_timesteps → sigmas",
                     cases=EULER_LADDER_CASES, tol=SIGMA)
def _(case, g):
    s = euler(case)
    table = table_sigmas(s)
    sigma_min = case.get("config_sigma_min") or float(table[0])
    sigma_max = case.get("config_sigma_max") or float(table[-1])
    n = case["num_inference_steps"]
    with quiet_diffusers():
        s.set_timesteps(n)
    return Scenario(inputs=dict(num_inference_steps=n, sigma_min=sigma_min, sigma_max=sigma_max, rho=7.0),
                    expected=s.sigmas.clone(), exact=exact_ladder(n, sigma_min, sigma_max, 7.0),
                    label=f"σ_min={sigma_min:.6g}, σ_max={sigma_max:.6g}: sigmas {_short(s.sigmas)}")


@karras_sigmas.check("vs EDMEulerScheduler(sigma_min, sigma_max, rho).set_timesteps → sigmas",
                     cases=EDM_LADDER_CASES, tol=SIGMA)
def _(case, g):
    s = edm(case)
    s.set_timesteps(case["num_inference_steps"])
    return Scenario(inputs=dict(case), expected=s.sigmas.clone(),
                    exact=exact_ladder(case["num_inference_steps"], case["sigma_min"], case["sigma_max"], case["rho"]),
                    label=f"sigmas {_short(s.sigmas)}")


def ladder(n, sigma_min, sigma_max, rho, *, rho_on_sigma=False, ascending=False, no_terminal=False,
           terminal_min=False, ramp_over_n=False, linear=False, log_linear=False, ramp_divided=False):
    """The ladder with one misconception switched on (for traps); all switches off = correct."""
    if ramp_over_n:
        ramp = torch.linspace(0, 1, n + 1, dtype=torch.float64)[:n]
    elif ramp_divided:
        ramp = torch.arange(n, dtype=torch.float64) / (n - 1) if n > 1 else torch.full((1,), float("nan"),
                                                                                         dtype=torch.float64)
    else:
        ramp = torch.linspace(0, 1, n, dtype=torch.float64)
    if rho_on_sigma:
        sigmas = (sigma_max**rho + ramp * (sigma_min**rho - sigma_max**rho)) ** (1 / rho)
    elif linear:
        sigmas = sigma_max + ramp * (sigma_min - sigma_max)
    elif log_linear:
        sigmas = torch.exp(np.log(sigma_max) + ramp * (np.log(sigma_min) - np.log(sigma_max)))
    else:
        sigmas = (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    sigmas = sigmas.to(torch.float32)
    if ascending:
        sigmas = sigmas.flip(0)
    if no_terminal:
        return sigmas
    return torch.cat([sigmas, sigmas[-1:] if terminal_min else sigmas.new_zeros(1)])


def _ladder_trap(name: str, hint: str, nonfinite: bool = False, **bug):
    @karras_sigmas.trap(name, hint=hint, nonfinite=nonfinite)
    def _(num_inference_steps, sigma_min, sigma_max, rho=7.0):
        return ladder(num_inference_steps, sigma_min, sigma_max, rho, **bug)


_ladder_trap("ρ applied to σ instead of σ^{1/ρ} ((σ^ρ interpolated)^{1/ρ})",
             "The ladder is evenly spaced in σ^{1/ρ}: interpolate σ_max^{1/ρ} → σ_min^{1/ρ}, then raise to ρ. "
             "Interpolating σ^ρ and taking the ρ-th root puts nearly every step at σ_max.", rho_on_sigma=True)
_ladder_trap("ladder ascending (σ_min first)",
             "Sampling starts at the noisiest level: σ_0 = σ_max, and the ladder falls to σ_min, then 0.",
             ascending=True)
_ladder_trap("no terminal σ = 0 (n sigmas instead of n + 1)",
             "Append a 0: the last step goes from σ_min to the clean sample.", no_terminal=True)
_ladder_trap("σ_min repeated as the terminal σ instead of 0",
             "The ladder ends at σ = 0 (final_sigmas_type='zero'): the last step lands on the clean sample.",
             terminal_min=True)
_ladder_trap("ramp i/n instead of i/(n − 1) (σ_min never reached)",
             "The ramp is linspace(0, 1, n): its last value is 1, so σ_{n−1} = σ_min exactly.", ramp_over_n=True)
_ladder_trap("the ramp as arange(n)/(n − 1): 0/0 for a single step",
             "For n = 1 the ramp is [0] (linspace(0, 1, 1)), so the ladder is [σ_max, 0]; arange(n)/(n − 1) divides "
             "0 by 0 there.", nonfinite=True, ramp_divided=True)
_ladder_trap("ρ ignored (evenly spaced in σ)",
             "Space the steps evenly in σ^{1/ρ}, not in σ: ρ = 7 crowds them at low noise.", linear=True)
_ladder_trap("evenly spaced in log σ (the exponential schedule)",
             "That is use_exponential_sigmas (ρ → ∞). Karras' ladder is evenly spaced in σ^{1/ρ}.",
             log_linear=True)


@karras_sigmas.trap("ρ fixed at 7 (the rho argument ignored)",
                    hint="EulerDiscreteScheduler._convert_to_karras hard-codes ρ = 7; this function takes ρ as an "
                         "argument (EDMEulerScheduler's config.rho): use it.")
def _(num_inference_steps, sigma_min, sigma_max, rho=7.0):
    return ladder(num_inference_steps, sigma_min, sigma_max, 7.0)

# ---- sigma_to_t -------------------------------------------------------------------------------------
sigma_to_t = Kata(
    "sigma_to_t",
    hints=(
        "Find the two training σs around each σ (the table is ascending in t), and interpolate the index "
        "linearly in log σ; outside the table, clamp to 0 or T − 1.",
        "j = the last index with ln σ_j ≤ ln σ, kept in [0, T − 2];  w = (ln σ − ln σ_j)/(ln σ_{j+1} − ln σ_j), "
        "clamped to [0, 1];  t = j + w  (float32).",
        "lt = train_sigmas.double().log(); ls = sigmas.double().log(); "
        "j = (torch.searchsorted(lt, ls, right=True) - 1).clamp(0, len(lt) - 2); "
        "w = ((ls - lt[j]) / (lt[j + 1] - lt[j])).clamp(0, 1); return (j + w).float()",
    ),
    answer_key=(f"{EULER}._sigma_to_t", f"{EULER}.set_timesteps"),
)

# The Euler ladder's cases, plus custom σs drawn in and out of the table.
# The first has σs below the table and none above it, so an index j left unclamped is named by its trap there,
# before it crashes (index T) on the second's σs above the table.
CUSTOM_SIGMA_CASES = [
    dict(size=20, betas="squaredcos_cap_v2", low=0.8, high=0.5),
    dict(size=12, betas="scaled_linear", low=0.5, high=2.0),  # ×½ below σ_0 to ×2 above σ_{T−1}
    dict(size=7, betas="linear", low=1.0, high=1.0),
    dict(size=9, betas="scaled_linear", T=300, low=1.0, high=1.5),
]


def exact_t(sigmas: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """_sigma_to_t in float64 on the same σs and table (np.interp clamps as its clip does)."""
    log_table = np.log(table.double().numpy())
    return torch.from_numpy(np.interp(np.log(sigmas.double().numpy()), log_table, np.arange(len(log_table),
                                                                                              dtype=np.float64)))


@sigma_to_t.check("vs EulerDiscreteScheduler(use_karras_sigmas=True).timesteps", cases=EULER_LADDER_CASES,
                  tol=SCHEDULE)
def _(case, g):
    s = euler(case)
    table = table_sigmas(s)
    with quiet_diffusers():
        s.set_timesteps(case["num_inference_steps"])
    sigmas = s.sigmas[:-1].clone()
    return Scenario(inputs=dict(sigmas=sigmas, train_sigmas=table), expected=s.timesteps.clone(),
                    exact=exact_t(sigmas, table), label=f"timesteps {_short(s.timesteps)}")


@sigma_to_t.check("vs EulerDiscreteScheduler.set_timesteps(sigmas=…).timesteps, σs in and out of the table",
                  cases=CUSTOM_SIGMA_CASES, tol=SCHEDULE)
def _(case, g):
    s = euler(case)
    table = table_sigmas(s)
    sigmas = log_uniform(case["size"], float(table[0]) * case["low"], float(table[-1]) * case["high"], g)
    sigmas[:2] = torch.tensor([float(table[0]) * case["low"], float(table[-1]) * case["high"]])  # both ends, always
    sigmas = sigmas.sort(descending=True).values
    with quiet_diffusers():
        s.set_timesteps(sigmas=sigmas.tolist() + [0.0])
    return Scenario(inputs=dict(sigmas=sigmas, train_sigmas=table), expected=s.timesteps.clone(),
                    exact=exact_t(sigmas, table), label=f"sigmas {_short(sigmas)}")


def _interp(x: torch.Tensor, xp: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """Index-interpolation of x over the ascending xp, as float64 (clamped to the ends, or extrapolated)."""
    x, xp = x.double(), xp.double()
    j = (torch.searchsorted(xp, x, right=True) - 1).clamp(0, len(xp) - 2)
    w = (x - xp[j]) / (xp[j + 1] - xp[j])
    return j + (w.clamp(0, 1) if clamp else w)


@sigma_to_t.trap("interpolated linearly in σ, not in log σ",
                 hint="The table is interpolated in log σ: w = (ln σ − ln σ_j)/(ln σ_{j+1} − ln σ_j). σ grows "
                      "almost exponentially with t, so a straight line in σ puts t off between entries.")
def _(sigmas, train_sigmas):
    return _interp(sigmas, train_sigmas).float()


@sigma_to_t.trap("the interpolation weights swapped (t = j + 1 − w)",
                 hint="w measures how far σ is from entry j towards j + 1: t = j + w, so σ = σ_j gives t = j.")
def _(sigmas, train_sigmas):
    t = _interp(sigmas.log(), train_sigmas.log())
    j = t.floor().clamp(max=len(train_sigmas) - 2)
    return (2 * j + 1 - t).float()


@sigma_to_t.trap("rounded to the nearest integer timestep",
                 hint="Keep the fraction: the model is fed t = j + w (e.g. 916.28), not a whole timestep.")
def _(sigmas, train_sigmas):
    return _interp(sigmas.log(), train_sigmas.log()).round().float()


@sigma_to_t.trap("the entry below, not interpolated (t = j)",
                 hint="Interpolate between the two entries around σ: t = j + w with w ∈ [0, 1).")
def _(sigmas, train_sigmas):
    return _interp(sigmas.log(), train_sigmas.log()).floor().float()


@sigma_to_t.trap("table read backwards (T − 1 − t)",
                 hint="train_sigmas is ascending in t: index j is timestep j (σ_0 is the cleanest).")
def _(sigmas, train_sigmas):
    return (len(train_sigmas) - 1 - _interp(sigmas.log(), train_sigmas.log())).float()


@sigma_to_t.trap("not clamped: extrapolated beyond the table's ends",
                 hint="A σ above the table's largest is fed t = T − 1, one below its smallest t = 0: clamp w to [0, 1].")
def _(sigmas, train_sigmas):
    return _interp(sigmas.log(), train_sigmas.log(), clamp=False).float()


@sigma_to_t.trap("the index j never clamped: a σ below the table reads entry −1 (Python wraps to the table's far end)",
                 hint="searchsorted − 1 is −1 for a σ below the table's first entry, and t[−1] is the LAST entry in "
                      "Python: keep j in [0, T − 2] (so j + 1 exists too; a σ above the table would index T) and "
                      "clamp w to [0, 1].")
def _(sigmas, train_sigmas):
    return _unclamped_j(sigmas, train_sigmas).float()  # raises (index T) where a σ is above the table


@sigma_to_t.trap("the index j clamped above only: a σ below the table still reads entry −1 (t clamped after)",
                 hint="searchsorted − 1 is −1 for a σ below the table's first entry, and t[−1] is the LAST entry: "
                      "clamping t to [0, T − 1] afterwards hides most of it, not all. Clamp j to [0, T − 2] and w "
                      "to [0, 1] before adding them.")
def _(sigmas, train_sigmas):
    return _unclamped_j(sigmas, train_sigmas, top=True).clamp(0, len(train_sigmas) - 1).float()


def _unclamped_j(sigmas, train_sigmas, top=False):
    """t = j + w with j = searchsorted − 1 left at −1 below the table (clamped to T − 2 above it with `top`), w
    unclamped."""
    x, xp = sigmas.double().log(), train_sigmas.double().log()
    j = torch.searchsorted(xp, x, right=True) - 1
    j = j.clamp(max=len(xp) - 2) if top else j
    return j + (x - xp[j]) / (xp[j + 1] - xp[j])


@sigma_to_t.trap("EDM's c_noise = ¼·ln σ fed as the timestep",
                 hint="¼·ln σ is what an EDM model reads. A model trained on a discrete table needs the (fractional) "
                      "index of σ in that table.")
def _(sigmas, train_sigmas):
    return (0.25 * sigmas.double().log()).float()


# ---- edm_model_inputs -------------------------------------------------------------------------------
edm_model_inputs = Kata(
    "edm_model_inputs",
    hints=(
        "Scale each sample so that it has unit variance at its σ (the data's σ_data and the noise's σ add in "
        "quadrature), and feed the noise level as a quarter of its natural log.",
        "c_in = 1/√(σ² + σ_data²), one per sample, broadcast as (B, 1, 1, 1);  return (c_in·x in the sample's "
        "dtype, ¼·ln σ as float32).",
        "c = (1 / (sigma.double() ** 2 + sigma_data ** 2) ** 0.5).reshape(-1, 1, 1, 1); "
        "return (sample.double() * c).to(sample.dtype), (0.25 * sigma.double().log()).float()",
    ),
    answer_key=(f"{EDM}.precondition_inputs", f"{EDM}.precondition_noise", f"{EDM}._get_conditioning_c_in",
                f"{EDM}.scale_model_input"),
)

PRECONDITION_CASES = [
    dict(shape=(3, 4, 8, 8), dtype="float32", sigma_data=0.5),  # EDM's σ_data
    dict(shape=(2, 4, 8, 8), dtype="float16", sigma_data=0.5),
    dict(shape=(4, 3, 16, 16), dtype="float32", sigma_data=1.0),  # σ_data = 1: lab 03's Euler scaling
    dict(shape=(2, 4, 8, 8), dtype="float16", sigma_data=0.25),
    dict(shape=(1, 4, 8, 8), dtype="float32", sigma_data=0.5),
]


def precondition_inputs(case: dict, g: torch.Generator):
    """A batch of noisy samples at per-sample σs (log-uniform over EDM's range 0.002 … 80): x = x₀ + σ·ε."""
    shape, dtype = case["shape"], DTYPES[case["dtype"]]
    sigma = log_uniform(shape[0], 0.002, 80.0, g)
    x0 = torch.randn(shape, generator=g) * case["sigma_data"]
    sample = (x0 + _per_sample(sigma, x0) * torch.randn(shape, generator=g)).to(dtype)
    return sample, sigma


@edm_model_inputs.check("vs precondition_inputs and precondition_noise, one σ per sample",
                        cases=PRECONDITION_CASES, tol=STEP_MATH)
def _(case, g):
    sample, sigma = precondition_inputs(case, g)
    s = EDMEulerScheduler(sigma_data=case["sigma_data"])
    scaled = torch.cat([s.precondition_inputs(sample[b:b + 1].clone(), sigma[b].clone())
                        for b in range(sample.shape[0])])
    c_noise = s.precondition_noise(sigma.clone())
    sd = case["sigma_data"]
    exact_scaled = sample.double() / _per_sample(sigma.double() ** 2 + sd**2, sample) ** 0.5
    return Scenario(inputs=dict(sample=sample, sigma=sigma, sigma_data=sd), expected=(scaled, c_noise),
                    exact=(exact_scaled, 0.25 * sigma.double().log()), label=f"σ {_short(sigma)}")


def _inputs(sample, sigma, c_in, c_noise):
    c = _per_sample(c_in(sigma.double()), sample)
    return (sample.double() * c).to(sample.dtype), c_noise(sigma.double()).float()


@edm_model_inputs.trap("c_in = 1/σ (σ_data forgotten)",
                       hint="The noisy sample x₀ + σ·ε has variance σ² + σ_data², not σ²: c_in = 1/√(σ² + σ_data²).")
def _(sample, sigma, sigma_data=0.5):
    return _inputs(sample, sigma, lambda s: 1 / s, lambda s: 0.25 * s.log())


@edm_model_inputs.trap("c_in = 1/√(σ² + 1) (lab 03's Euler scaling, σ_data taken as 1)",
                       hint="EDM's data has standard deviation σ_data (0.5), not 1: c_in = 1/√(σ² + σ_data²).")
def _(sample, sigma, sigma_data=0.5):
    return _inputs(sample, sigma, lambda s: 1 / (s**2 + 1) ** 0.5, lambda s: 0.25 * s.log())


@edm_model_inputs.trap("c_in = 1/√(σ² + σ_data) (σ_data not squared)",
                       hint="Variances add: σ² + σ_data², with σ_data squared.")
def _(sample, sigma, sigma_data=0.5):
    return _inputs(sample, sigma, lambda s: 1 / (s**2 + sigma_data) ** 0.5, lambda s: 0.25 * s.log())


@edm_model_inputs.trap("c_noise = σ instead of ¼·ln σ",
                       hint="An EDM network reads the noise level as c_noise = ¼·ln σ (Karras et al. 2022, table 1).")
def _(sample, sigma, sigma_data=0.5):
    return _inputs(sample, sigma, lambda s: 1 / (s**2 + sigma_data**2) ** 0.5, lambda s: s)


@edm_model_inputs.trap("c_noise = ¼·log10 σ (the common log, not the natural one)",
                       hint="c_noise = ¼·ln σ: torch.log, the natural logarithm.")
def _(sample, sigma, sigma_data=0.5):
    return _inputs(sample, sigma, lambda s: 1 / (s**2 + sigma_data**2) ** 0.5, lambda s: 0.25 * s.log10())


@edm_model_inputs.trap("c_noise = ln σ (the ¼ dropped)",
                       hint="c_noise = ¼·ln σ: a quarter of the natural log.")
def _(sample, sigma, sigma_data=0.5):
    return _inputs(sample, sigma, lambda s: 1 / (s**2 + sigma_data**2) ** 0.5, lambda s: s.log())


@edm_model_inputs.trap("c_noise = ln(σ/4) (the ¼ inside the log)",
                       hint="c_noise = ¼·ln σ: the quarter multiplies the log (ln(σ/4) = ln σ − ln 4 only shifts it).")
def _(sample, sigma, sigma_data=0.5):
    return _inputs(sample, sigma, lambda s: 1 / (s**2 + sigma_data**2) ** 0.5, lambda s: (s / 4).log())


@edm_model_inputs.trap("one σ for the whole batch (the first sample's)",
                       hint="Each sample has its own σ: broadcast c_in as (B, 1, 1, 1).")
def _(sample, sigma, sigma_data=0.5):
    first = sigma[:1].expand(sigma.shape[0])
    return _inputs(sample, first, lambda s: 1 / (s**2 + sigma_data**2) ** 0.5, lambda s: 0.25 * s.log())


@edm_model_inputs.trap("c_in from the first sample's σ for the whole batch (c_noise per sample)",
                       hint="Each sample has its own σ, and so its own c_in = 1/√(σ_i² + σ_data²): broadcast c_in as "
                            "(B, 1, 1, 1), as you did c_noise.")
def _(sample, sigma, sigma_data=0.5):
    scaled, _ = _inputs(sample, sigma[:1].expand(sigma.shape[0]), lambda s: 1 / (s**2 + sigma_data**2) ** 0.5,
                        lambda s: 0.25 * s.log())
    return scaled, (0.25 * sigma.double().log()).float()

# ---- edm_denoised -----------------------------------------------------------------------------------
edm_denoised = Kata(
    "edm_denoised",
    hints=(
        "x̂₀ mixes a skip connection from x with the scaled network output: the skip weight vanishes at high "
        "noise (x is almost pure noise there), the output weight tends to σ_data.",
        "c_skip = σ_data²/(σ² + σ_data²);  c_out = ±σ·σ_data/√(σ² + σ_data²) (− for v_prediction);  "
        "x̂₀ = c_skip·x + c_out·F, σ per sample as (B, 1, 1, 1), float32.",
        "s = sigma.double().reshape(-1, 1, 1, 1); c_skip = sigma_data ** 2 / (s ** 2 + sigma_data ** 2); "
        "c_out = s * sigma_data / (s ** 2 + sigma_data ** 2) ** 0.5 * (-1 if prediction_type == 'v_prediction' else 1); "
        "return (c_skip * sample.double() + c_out * model_output.double()).float()",
    ),
    answer_key=(f"{EDM}.precondition_outputs",),
)

# A float16 model too: diffusers multiplies c_out·F in float16 and returns float32 (step upcast the sample), so
# the output is float32 whatever the model's dtype, as the docstring says (an x̂₀ left in float16 fails).
DENOISED_CASES = [
    dict(shape=(3, 4, 8, 8), dtype="float32", sigma_data=0.5, prediction_type="epsilon"),
    dict(shape=(2, 4, 8, 8), dtype="float32", sigma_data=0.5, prediction_type="v_prediction"),
    dict(shape=(1, 4, 16, 16), dtype="float32", sigma_data=0.5, prediction_type="epsilon"),
    dict(shape=(3, 4, 8, 8), dtype="float32", sigma_data=1.0, prediction_type="v_prediction"),  # lab 03's v
    dict(shape=(4, 3, 8, 8), dtype="float32", sigma_data=0.25, prediction_type="epsilon"),
    dict(shape=(2, 4, 8, 8), dtype="float16", sigma_data=0.5, prediction_type="epsilon"),
    dict(shape=(3, 4, 8, 8), dtype="float16", sigma_data=1.0, prediction_type="v_prediction"),
]


def exact_denoised(sample, model_output, sigma, sigma_data, prediction_type) -> torch.Tensor:
    s = _per_sample(sigma.double(), sample)
    c_skip = sigma_data**2 / (s**2 + sigma_data**2)
    c_out = s * sigma_data / (s**2 + sigma_data**2) ** 0.5 * (-1 if prediction_type == "v_prediction" else 1)
    return c_skip * sample.double() + c_out * model_output.double()


@edm_denoised.check("vs precondition_outputs, as step calls it, one σ per sample", cases=DENOISED_CASES,
                    tol=STEP_MATH)
def _(case, g):
    sample, sigma = precondition_inputs(case, g)
    model_output = torch.randn(case["shape"], generator=g).to(sample.dtype)
    s = EDMEulerScheduler(sigma_data=case["sigma_data"], prediction_type=case["prediction_type"])
    expected = torch.cat([s.precondition_outputs(sample[b:b + 1].float(), model_output[b:b + 1].clone(),
                                                 sigma[b].clone()) for b in range(sample.shape[0])])
    inputs = dict(sample=sample, model_output=model_output, sigma=sigma, sigma_data=case["sigma_data"],
                  prediction_type=case["prediction_type"])
    return Scenario(inputs=inputs, expected=expected, exact=exact_denoised(**inputs), label=f"σ {_short(sigma)}")


def _mix(sample, model_output, sigma, c_skip, c_out):
    s = _per_sample(sigma.double(), sample)
    return (c_skip(s) * sample.double() + c_out(s) * model_output.double()).float()


def _sign(prediction_type):
    return -1 if prediction_type == "v_prediction" else 1


@edm_denoised.trap("c_skip and c_out swapped",
                   hint="c_skip = σ_data²/(σ² + σ_data²) weighs x (it → 0 at high noise); c_out = σ·σ_data/√(σ² + "
                        "σ_data²) weighs F.")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    k = _sign(prediction_type)
    return _mix(sample, model_output, sigma, lambda s: k * s * sigma_data / (s**2 + sigma_data**2) ** 0.5,
                lambda s: sigma_data**2 / (s**2 + sigma_data**2))


@edm_denoised.trap("c_out's sign the wrong way round for the prediction type",
                   hint="EDMEulerScheduler: c_out = +σ·σ_data/√(σ² + σ_data²) for 'epsilon', − for 'v_prediction'.")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    k = -_sign(prediction_type)
    return _mix(sample, model_output, sigma, lambda s: sigma_data**2 / (s**2 + sigma_data**2),
                lambda s: k * s * sigma_data / (s**2 + sigma_data**2) ** 0.5)


@edm_denoised.trap("for v_prediction, c_skip's sign flipped instead of c_out's",
                   hint="v_prediction changes only c_out's sign (c_out = −σ·σ_data/√(σ² + σ_data²)); c_skip = "
                        "σ_data²/(σ² + σ_data²) is the same for both prediction types.")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    k = _sign(prediction_type)
    return _mix(sample, model_output, sigma, lambda s: k * sigma_data**2 / (s**2 + sigma_data**2),
                lambda s: s * sigma_data / (s**2 + sigma_data**2) ** 0.5)


@edm_denoised.trap("σ_data forgotten (taken as 1)",
                   hint="Every coefficient carries σ_data (EDM: 0.5): c_skip = σ_data²/(σ² + σ_data²), "
                        "c_out = σ·σ_data/√(σ² + σ_data²).")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    k = _sign(prediction_type)
    return _mix(sample, model_output, sigma, lambda s: 1 / (s**2 + 1), lambda s: k * s / (s**2 + 1) ** 0.5)


@edm_denoised.trap("c_out without the square root (σ·σ_data/(σ² + σ_data²))",
                   hint="c_out = σ·σ_data/√(σ² + σ_data²): it tends to σ_data at high noise.")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    k = _sign(prediction_type)
    return _mix(sample, model_output, sigma, lambda s: sigma_data**2 / (s**2 + sigma_data**2),
                lambda s: k * s * sigma_data / (s**2 + sigma_data**2))


@edm_denoised.trap("Euler's x̂₀ = x − σ·F (no preconditioning)",
                   hint="An EDM network's output is preconditioned: x̂₀ = c_skip·x + c_out·F, not x − σ·ε.")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    return _mix(sample, model_output, sigma, lambda s: 1, lambda s: -s)


@edm_denoised.trap("one σ for the whole batch (the first sample's)",
                   hint="Each sample has its own σ: broadcast c_skip and c_out as (B, 1, 1, 1).")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    k = _sign(prediction_type)
    return _mix(sample, model_output, sigma[:1].expand(sigma.shape[0]), lambda s: sigma_data**2 / (s**2 + sigma_data**2),
                lambda s: k * s * sigma_data / (s**2 + sigma_data**2) ** 0.5)


@edm_denoised.trap("σ_data fixed at 0.5 (EDM's default; the sigma_data argument ignored)",
                   hint="0.5 is EDM's σ_data for images normalised to [−1, 1]; a model trained otherwise has its own "
                        "(its scheduler's config.sigma_data): use the argument in c_skip and c_out.")
def _(sample, model_output, sigma, sigma_data=0.5, prediction_type="epsilon"):
    return exact_denoised(sample, model_output, sigma, 0.5, prediction_type).float()

# ---- edm_euler_step ---------------------------------------------------------------------------------
edm_euler_step = Kata(
    "edm_euler_step",
    hints=(
        "Turn the network output into x̂₀ (your edm_denoised), take the ODE's slope (x − x̂₀)/σ, and step "
        "by σ_next − σ (negative). Upcast to float32 or wider, cast back at the end.",
        "x̂₀ = c_skip·x + c_out·F;  d = (x − x̂₀)/σ;  x_next = x + (σ_next − σ)·d, returned in "
        "model_output.dtype.",
        "d0 = edm_denoised(sample, model_output, sigma.reshape(1).expand(len(sample)), sigma_data, prediction_type); "
        "x = sample.float(); return (x + (sigma_next - sigma) * (x - d0) / sigma).to(model_output.dtype)",
    ),
    answer_key=(f"{EDM}.step", f"{EDM}.precondition_outputs"),
)

STEP_CASES = [
    dict(shape=(2, 4, 8, 8), dtype="float32", n=8, sigma_min=0.002, sigma_max=80.0, rho=7.0, sigma_data=0.5,
         prediction_type="epsilon"),
    dict(shape=(3, 4, 8, 8), dtype="float16", n=6, sigma_min=0.002, sigma_max=80.0, rho=7.0, sigma_data=0.5,
         prediction_type="v_prediction"),
    dict(shape=(1, 4, 16, 16), dtype="float32", n=5, sigma_min=0.0292, sigma_max=14.6146, rho=3.0,
         sigma_data=1.0, prediction_type="epsilon"),
    dict(shape=(2, 3, 8, 8), dtype="float16", n=4, sigma_min=0.002, sigma_max=80.0, rho=7.0, sigma_data=0.5,
         prediction_type="epsilon"),
    dict(shape=(2, 4, 8, 8), dtype="float32", n=4, sigma_min=0.1, sigma_max=10.0, rho=10.0, sigma_data=0.25,
         prediction_type="v_prediction"),
]


@edm_euler_step.check("vs EDMEulerScheduler.step (s_churn = 0), whole sampling runs", cases=STEP_CASES,
                      tol=STEP_MATH)
def _(case, g):
    shape, dtype = case["shape"], DTYPES[case["dtype"]]
    s = edm(case)
    s.set_timesteps(case["n"])
    sd, kind = case["sigma_data"], case["prediction_type"]
    x = (torch.randn(shape, generator=g) * s.sigmas[0]).to(dtype)  # σ_max·ε: the start of sampling
    scenarios = []
    for i, t in enumerate(s.timesteps):
        model_output = torch.randn(shape, generator=g).to(dtype)
        sigma, sigma_next = s.sigmas[i].clone(), s.sigmas[i + 1].clone()
        s.scale_model_input(x.clone(), t)  # what a pipeline calls first (sets the step index)
        expected = s.step(model_output.clone(), t, x.clone()).prev_sample
        batch = shape[0]
        x0 = exact_denoised(x, model_output, sigma.reshape(1).expand(batch), sd, kind)
        exact = x.double() + (sigma_next.double() - sigma.double()) * (x.double() - x0) / sigma.double()
        scenarios.append(Scenario(
            inputs=dict(model_output=model_output, sample=x, sigma=sigma, sigma_next=sigma_next, sigma_data=sd,
                        prediction_type=kind),
            expected=expected, exact=exact,
            label=f"step {i + 1}/{len(s.timesteps)}, σ={float(sigma):.6g} → {float(sigma_next):.6g}"))
        x = expected
    return scenarios


def _denoised(model_output, sample, sigma, sigma_data, prediction_type):
    return exact_denoised(sample, model_output, sigma.reshape(1).expand(sample.shape[0]), sigma_data, prediction_type)


def _step_with(model_output, sample, sigma, sigma_next, sigma_data, prediction_type, *, x0_at=None, slope_over=None,
               up=False):
    """The Euler step with one misconception switched on (all off = correct): x̂₀ preconditioned at `x0_at`, the
    slope divided by `slope_over`, or the step taken back up in noise."""
    x = sample.double()
    x0 = _denoised(model_output, sample, sigma if x0_at is None else x0_at, sigma_data, prediction_type)
    d = (x - x0) / (sigma if slope_over is None else slope_over).double()
    h = (sigma - sigma_next) if up else (sigma_next - sigma)
    return (x + h.double() * d).to(model_output.dtype)


@edm_euler_step.trap("the network output used as the slope (d = F, as if F were ε)",
                     hint="F is preconditioned, not ε: the slope is (x − x̂₀)/σ with x̂₀ = c_skip·x + c_out·F.")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    return (sample.double() + (sigma_next.double() - sigma.double()) * model_output.double()).to(model_output.dtype)


@edm_euler_step.trap("returned x̂₀ instead of the next sample",
                     hint="x̂₀ is where the ODE ends (σ = 0); the step stops at σ_next: x + (σ_next − σ)·(x − x̂₀)/σ.")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    return _denoised(model_output, sample, sigma, sigma_data, prediction_type).to(model_output.dtype)


@edm_euler_step.trap("the step taken back up in noise (σ and σ_next swapped, or the slope as (x̂₀ − x)/σ)",
                     hint="x_next = x + (σ_next − σ)·d with d = (x − x̂₀)/σ: σ_next < σ, so the step size is "
                          "negative and the sample moves towards x̂₀. Flipping either sign moves it away.")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    return _step_with(model_output, sample, sigma, sigma_next, sigma_data, prediction_type, up=True)


@edm_euler_step.trap("x̂₀ mixed from the network's input c_in·x, not the sample x",
                     hint="c_in·x is what the network reads; the denoiser's skip term is c_skip·x, on the sample itself.")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    x, s = sample.double(), sigma.double()
    c_in = 1 / (s**2 + sigma_data**2) ** 0.5
    denoised = _denoised(model_output, (x * c_in).to(sample.dtype), sigma, sigma_data, prediction_type).double()
    return (x + (sigma_next.double() - s) * (x - denoised) / s).to(model_output.dtype)


@edm_euler_step.trap("x̂₀ preconditioned at σ_next (the σ the step goes to), not at σ",
                     hint="The network was called at σ: x̂₀ = c_skip(σ)·x + c_out(σ)·F, with the σ of this rung; "
                          "σ_next only sets how far the step goes.")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    return _step_with(model_output, sample, sigma, sigma_next, sigma_data, prediction_type, x0_at=sigma_next)


@edm_euler_step.trap("the slope divided by σ_next, not σ", nonfinite=True,
                     hint="d = (x − x̂₀)/σ, the slope where the sample is now; divided by σ_next it is infinite at the "
                          "last step (σ_next = 0).")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    return _step_with(model_output, sample, sigma, sigma_next, sigma_data, prediction_type, slope_over=sigma_next)


@edm_euler_step.trap("σ_data not passed on to edm_denoised (x̂₀ with its default 0.5)",
                     hint="edm_denoised(..., sigma_data, prediction_type): pass both on, or x̂₀ is preconditioned with "
                          "EDM's default σ_data = 0.5 whatever the model's.")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    return _step_with(model_output, sample, sigma, sigma_next, 0.5, prediction_type)


@edm_euler_step.trap("left in float32 for a float16 model",
                     hint="diffusers casts prev_sample back to model_output.dtype: return the model's dtype.")
def _(model_output, sample, sigma, sigma_next, sigma_data=0.5, prediction_type="epsilon"):
    x = sample.double()
    d = (x - _denoised(model_output, sample, sigma, sigma_data, prediction_type)) / sigma.double()
    return (x + (sigma_next.double() - sigma.double()) * d).float()


# ---- edm_sample -------------------------------------------------------------------------------------
edm_sample = Kata(
    "edm_sample",
    hints=(
        "One network call per rung of the ladder: feed it the preconditioned sample and noise label "
        "(edm_model_inputs), then take the Euler step to the next σ (edm_euler_step). The sample already "
        "starts at σ_0.",
        "for i in range(n): x_in, c_noise = c_in(σ_i)·x, ¼·ln σ_i;  F = network(x_in, c_noise);  "
        "x = edm_euler_step(F, x, σ_i, σ_{i+1}, σ_data, prediction_type);  return x.",
        "for i in range(len(sigmas) - 1): x_in, c = edm_model_inputs(x, sigmas[i].reshape(1).expand(len(x)), "
        "sigma_data); x = edm_euler_step(network(x_in, c[0]), x, sigmas[i], sigmas[i + 1], sigma_data, "
        "prediction_type)",
    ),
    answer_key=(f"{EDM}.step", f"{EDM}.scale_model_input", f"{EDM}.precondition_inputs", f"{EDM}.precondition_outputs"),
)

LOOP_CASES = [
    dict(shape=(2, 4, 8, 8), dtype="float32", n=6, sigma_min=0.002, sigma_max=80.0, rho=7.0, sigma_data=0.5,
         prediction_type="epsilon"),
    dict(shape=(2, 4, 8, 8), dtype="float16", n=5, sigma_min=0.002, sigma_max=80.0, rho=7.0, sigma_data=0.5,
         prediction_type="v_prediction"),
    dict(shape=(3, 3, 8, 8), dtype="float32", n=4, sigma_min=0.0292, sigma_max=14.6146, rho=7.0, sigma_data=1.0,
         prediction_type="v_prediction"),
    dict(shape=(1, 4, 8, 8), dtype="float16", n=8, sigma_min=0.01, sigma_max=20.0, rho=3.0, sigma_data=0.5,
         prediction_type="epsilon"),
]


class GaussianEDMNetwork:
    """The raw EDM network F whose denoiser D = c_skip·x + c_out·F is ideal for Gaussian data x₀ ~ N(0, s_c²)
    per channel: D(x; σ) = s²/(s² + σ²)·x. It reads σ back from c_noise (σ = e^{4·c_noise}) and x from
    x_in (x = x_in·√(σ² + σ_data²)), so it sees only what a real EDM network sees. Computes in float64,
    returns x_in's dtype; checks each call's shape and dtype and counts the calls. Remote: the learner's runner
    gets a stand-in, and each call is counted and checked here."""

    kata_remote = True

    def __init__(self, std: torch.Tensor, sigma_data: float, prediction_type: str, shape, dtype, calls: int):
        self.std = std.double()
        self.sigma_data = sigma_data
        self.sign = -1.0 if prediction_type == "v_prediction" else 1.0
        self.shape = tuple(shape)
        self.dtype = str(dtype).replace("torch.", "")
        self.calls = calls
        self.seen = 0

    def __repr__(self) -> str:
        return f"GaussianEDMNetwork(ideal F for Gaussian data; {self.dtype} {self.shape}; calls counted)"

    def remote_view(self) -> dict:
        return dict(label=repr(self))

    def predict(self, x_in: torch.Tensor, c_noise) -> torch.Tensor:
        """F without the call checks (references, shadows and traps call this)."""
        sigma = torch.exp(4 * torch.as_tensor(c_noise, dtype=torch.float64))
        sigma = sigma.reshape(-1, 1, 1, 1) if sigma.numel() > 1 else sigma.reshape(())
        sd2, var = self.sigma_data**2, (self.std**2).view(1, -1, 1, 1)
        x = x_in.double() * (sigma**2 + sd2) ** 0.5
        denoised = var / (var + sigma**2) * x
        c_skip = sd2 / (sigma**2 + sd2)
        c_out = self.sign * sigma * self.sigma_data / (sigma**2 + sd2) ** 0.5
        return ((denoised - c_skip * x) / c_out).to(x_in.dtype)

    def __call__(self, x_in, c_noise, *args, **kwargs):
        self.seen += 1
        where = f"network call {self.seen}"
        if not isinstance(x_in, torch.Tensor) or tuple(x_in.shape) != self.shape:
            got = tuple(x_in.shape) if isinstance(x_in, torch.Tensor) else type(x_in).__name__
            per_sample = isinstance(x_in, torch.Tensor) and got == (1, *self.shape[1:]) and self.shape[0] > 1
            raise KataFailure(f"  {where} got {got} as its input; it takes c_in·x, shaped {self.shape}"
                              + ("\n  trap: the network called once per sample\n    One call per step on the whole "
                                 f"batch of {self.shape[0]}: the network is batched (a pipeline never loops over "
                                 "samples), and each call costs a full forward pass." if per_sample else ""))
        if str(x_in.dtype).replace("torch.", "") != self.dtype:
            raise KataFailure(f"  {where} got a {x_in.dtype} input, but the network runs in {self.dtype}: keep the "
                              "sample in its own dtype between steps (diffusers casts each step's result back)")
        if isinstance(c_noise, torch.Tensor) and c_noise.is_floating_point() \
                and torch.finfo(c_noise.dtype).eps > torch.finfo(torch.float32).eps:
            raise KataFailure(
                f"  {where} got c_noise as a {str(c_noise.dtype).removeprefix('torch.')} tensor; the network takes "
                "it in float32, as the scheduler's timesteps are\n"
                f"  trap: c_noise cast to the sample's dtype\n    The noise label stays float32 whatever the sample's "
                "dtype: rounded to a half dtype, ¼·ln σ moves σ = e^{4·c_noise} by up to a few percent. Cast x_in "
                "only.")
        if self.seen > self.calls:
            raise KataFailure(f"  {where}: the ladder has only {self.calls} steps, one network call each")
        return self.predict(x_in, c_noise)

    def verify(self, out) -> None:
        if self.seen < self.calls:
            raise KataFailure(f"  the network was called {self.seen} times; the ladder has {self.calls} steps, "
                              "one call each (the last step lands on σ = 0)")


def _network(case: dict, g: torch.Generator) -> GaussianEDMNetwork:
    std = 0.3 + 0.9 * torch.rand(case["shape"][1], generator=g, dtype=torch.float64)
    return GaussianEDMNetwork(std, case["sigma_data"], case["prediction_type"], case["shape"], DTYPES[case["dtype"]],
                              case["n"])


def exact_loop(network: GaussianEDMNetwork, sample: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The same loop in float64 throughout (the network on float64 inputs)."""
    x, sd, sign = sample.double(), network.sigma_data, network.sign
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i].double(), sigmas[i + 1].double()
        F = network.predict(x / (s**2 + sd**2) ** 0.5, 0.25 * s.log())
        denoised = sd**2 / (s**2 + sd**2) * x + sign * s * sd / (s**2 + sd**2) ** 0.5 * F
        x = x + (s_next - s) * (x - denoised) / s
    return x


@edm_sample.check("vs scale_model_input, the network and EDMEulerScheduler.step, whole runs", cases=LOOP_CASES,
                  tol=STEP_MATH)
def _(case, g):
    s = edm(case)
    s.set_timesteps(case["n"])
    network = _network(case, g)
    x = (torch.randn(case["shape"], generator=g) * s.sigmas[0]).to(DTYPES[case["dtype"]])  # x = σ_0·ε
    start = x.clone()
    for t in s.timesteps:
        model_output = network.predict(s.scale_model_input(x, t), t)
        x = s.step(model_output, t, x).prev_sample
    inputs = dict(network=network, sample=start, sigmas=s.sigmas.clone(), sigma_data=case["sigma_data"],
                  prediction_type=case["prediction_type"])
    return Scenario(inputs=inputs, expected=x, exact=exact_loop(network, start, s.sigmas), verify=network.verify,
                    label=f"sigmas {_short(s.sigmas)}")


def wrong_loop(network, sample, sigmas, sigma_data=0.5, prediction_type="epsilon", *, unscaled=False,
               start_scaled=False, sigma_as_noise=False, input_sigma_data=None):
    """The loop with one misconception switched on (for traps); all switches off = correct (float64 math)."""
    predict = network.predict if isinstance(network, GaussianEDMNetwork) else network
    x = sample.double() * (sigmas[0].double() if start_scaled else 1)
    sign = -1 if prediction_type == "v_prediction" else 1
    for i in range(len(sigmas) - 1):
        s, s_next = sigmas[i].double(), sigmas[i + 1].double()
        sd_in = sigma_data if input_sigma_data is None else input_sigma_data
        x_in = (x if unscaled else x / (s**2 + sd_in**2) ** 0.5).to(sample.dtype)
        F = predict(x_in, sigmas[i] if sigma_as_noise else 0.25 * s.log()).double()
        denoised = sigma_data**2 / (s**2 + sigma_data**2) * x + sign * s * sigma_data / (s**2 + sigma_data**2) ** 0.5 * F
        x = (x + (s_next - s) * (x - denoised) / s).to(sample.dtype).double()
    return x.to(sample.dtype)


@edm_sample.trap("the network fed x itself (c_in·x forgotten)",
                 hint="An EDM network is trained on c_in·x = x/√(σ² + σ_data²), unit variance at every σ: scale its "
                      "input (edm_model_inputs) before every call.")
def _(network, sample, sigmas, sigma_data=0.5, prediction_type="epsilon"):
    return wrong_loop(network, sample, sigmas, sigma_data, prediction_type, unscaled=True)


@edm_sample.trap("the network fed σ instead of c_noise = ¼·ln σ",
                 hint="The network's noise input is c_noise = ¼·ln σ (edm_model_inputs returns it), not σ itself.")
def _(network, sample, sigmas, sigma_data=0.5, prediction_type="epsilon"):
    return wrong_loop(network, sample, sigmas, sigma_data, prediction_type, sigma_as_noise=True)


@edm_sample.trap("σ_data not passed on to edm_model_inputs (c_in with its default 0.5)",
                 hint="edm_model_inputs(x, σ, sigma_data): without it the network's input is scaled for σ_data = 0.5 "
                      "while the step preconditions with the model's σ_data.")
def _(network, sample, sigmas, sigma_data=0.5, prediction_type="epsilon"):
    return wrong_loop(network, sample, sigmas, sigma_data, prediction_type, input_sigma_data=0.5)


@edm_sample.trap("the starting sample multiplied by σ_0 again",
                 hint="`sample` is already at σ_0 (x = σ_0·ε, as the pipeline draws it): start the loop from it as it is.")
def _(network, sample, sigmas, sigma_data=0.5, prediction_type="epsilon"):
    return wrong_loop(network, sample, sigmas, sigma_data, prediction_type, start_scaled=True)
