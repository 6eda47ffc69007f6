"""Grader for lab 03 · Scheduler reading: set_timesteps spacings, Euler's σ ladder, init σ, scaling, step.

Imports only the DDIM, DDPM and Euler scheduler modules: grading this lab never loads diffusers' models.

Step counts are chosen where exact arithmetic and diffusers agree. numpy's float64 grids land a hair
off an exact .5 for some n, and diffusers then rounds the other way than exact math (and than
torch.linspace): T=1000 "linspace" n ∈ {27, 31, 47, …}, "trailing" n ∈ {48, 96, …}; "trailing" n=61
even yields 62 timesteps ending in −1. tests/labs/test_03_scheduler_reading.py checks every graded
count against exact rational arithmetic, so any exact formula passes.

Precision: every float check also carries the float64 shadow of diffusers' answer (Scenario.exact: the
same math on the same inputs in float64; Euler's step upcasts to float32 inside, so its shadow is the
formula written in float64). An answer at most 2× as far from it as diffusers' own (+ 2 ulps) passes,
so an Euler step computed in float64 is right even at σ = 4096 (zero terminal SNR), where diffusers'
float32 step is 1.1e-3 from exact math.
"""
import torch
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler

from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import SCHEDULE, SIGMA, STEP_MATH, TIMESTEP_INDEX
from diffusion_katas.engine.helpers import DTYPES, SCHEDULERS, quiet_diffusers, sd_schedule

EULER = "diffusers.schedulers.scheduling_euler_discrete.EulerDiscreteScheduler"
# Every scheduler's own reading of the same thing is a route to it (another spacing's class, an ancestral sibling).
EVERY = f"{SCHEDULERS}:*Scheduler*"
# Stable Diffusion's training schedule, and two short coarse ones on which interpolating σ and
# interpolating ᾱ give visibly different answers between grid points.
SCHEDULES = {
    "SD": sd_schedule(num_train_timesteps=1000),
    "coarse linear T=50": dict(beta_schedule="linear", beta_start=0.001, beta_end=0.2, num_train_timesteps=50),
    "coarse scaled_linear T=100": sd_schedule(beta_end=0.12, num_train_timesteps=100),
}


def euler(schedule: str = "SD", *, n: int, spacing: str = "linspace", offset: int = 0, zero_snr: bool = False,
          prediction_type: str = "epsilon", interpolation: str = "linear", final: str = "zero",
          raw_table: bool = False) -> EulerDiscreteScheduler:
    """An EulerDiscreteScheduler with set_timesteps(n) already called (raw_table: see SIGMA_CASES)."""
    s = EulerDiscreteScheduler(**SCHEDULES[schedule], timestep_spacing=spacing, steps_offset=offset,
                               rescale_betas_zero_snr=zero_snr, prediction_type=prediction_type,
                               interpolation_type=interpolation, final_sigmas_type=final)
    with quiet_diffusers():  # numpy 2 warns in set_timesteps: no business of the learner's
        s.set_timesteps(n)
    # step warns unless scale_model_input ran first; the step check drives step alone on purpose.
    s.is_scale_input_called = True
    return s


# ---- inference_timesteps ----------------------------------------------------------------------------
inference_timesteps = Kata(
    "inference_timesteps",
    hints=(
        "Each spacing describes an ascending grid on 0 … T−1; inference walks it backwards, noisiest first. "
        "Only 'leading' uses steps_offset.",
        "leading: i·(T//n) + offset;  trailing: round(T − i·T/n) − 1;  linspace: round(i·(T−1)/(n−1)); "
        "all for i = 0 … n−1, rounded half to even, listed from the largest to the smallest.",
        "leading: (torch.arange(n) * (T // n)).flip(0) + steps_offset;  trailing: "
        "((T - torch.arange(n, dtype=torch.float64) * (T / n)).round() - 1).long();  linspace: "
        "torch.linspace(0, T - 1, n, dtype=torch.float64).round().flip(0).long()",
    ),
    answer_key=("diffusers.schedulers.scheduling_ddim.DDIMScheduler.set_timesteps",
                "diffusers.schedulers.scheduling_ddpm.DDPMScheduler.set_timesteps",
                f"{EULER}.set_timesteps", f"{EVERY}.set_timesteps"),
)

# (n, T, spacing, offset): n = 7 does not divide 1000 (leading ≠ trailing, linspace hits 832.5 and
# 499.5); offset 1 on trailing/linspace must change nothing; n = T visits every timestep.
DDIM_CASES = [
    dict(num_inference_steps=10, timestep_spacing="leading", steps_offset=0),
    dict(num_inference_steps=7, timestep_spacing="leading", steps_offset=0),
    dict(num_inference_steps=50, timestep_spacing="leading", steps_offset=1),
    dict(num_inference_steps=10, timestep_spacing="trailing", steps_offset=0),
    dict(num_inference_steps=7, timestep_spacing="trailing", steps_offset=1),
    dict(num_inference_steps=25, timestep_spacing="trailing", steps_offset=0),
    dict(num_inference_steps=7, timestep_spacing="linspace", steps_offset=0),
    dict(num_inference_steps=10, timestep_spacing="linspace", steps_offset=1),
    dict(num_inference_steps=50, timestep_spacing="linspace", steps_offset=0),
    # schedules other than T = 1000: a hard-coded 1000 (or its stride) fails here
    dict(num_inference_steps=7, num_train_timesteps=500, timestep_spacing="leading", steps_offset=1),
    dict(num_inference_steps=6, num_train_timesteps=80, timestep_spacing="linspace", steps_offset=0),
    # one step: linspace(0, T − 1, 1) is [0] (a grid built from T − 1 downwards gives [999])
    dict(num_inference_steps=1, timestep_spacing="linspace", steps_offset=0),
]
DDPM_CASES = [
    dict(num_inference_steps=7, num_train_timesteps=100, timestep_spacing="leading", steps_offset=1),
    dict(num_inference_steps=7, num_train_timesteps=100, timestep_spacing="trailing", steps_offset=0),
    dict(num_inference_steps=9, num_train_timesteps=100, timestep_spacing="linspace", steps_offset=1),
    dict(num_inference_steps=100, num_train_timesteps=100, timestep_spacing="trailing", steps_offset=0),
    dict(num_inference_steps=3, num_train_timesteps=1000, timestep_spacing="trailing", steps_offset=0),
    dict(num_inference_steps=3, num_train_timesteps=1000, timestep_spacing="leading", steps_offset=1),
]


def timesteps_scenario(cls, case: dict) -> Scenario:
    T = case.get("num_train_timesteps", 1000)
    s = cls(num_train_timesteps=T, timestep_spacing=case["timestep_spacing"], steps_offset=case["steps_offset"])
    s.set_timesteps(case["num_inference_steps"])
    return Scenario(inputs=dict(case), expected=s.timesteps.clone())


def _short(t: torch.Tensor) -> str:
    values = [int(v) if float(v).is_integer() else float(f"{v:.6g}") for v in t.tolist()]
    return str(values) if len(values) <= 10 else f"[{values[0]}, {values[1]}, {values[2]}, …, {values[-1]}]"


@inference_timesteps.check("vs DDIMScheduler.timesteps", cases=DDIM_CASES, tol=TIMESTEP_INDEX)
def _(case, g):
    return timesteps_scenario(DDIMScheduler, case)


@inference_timesteps.check("vs DDPMScheduler.timesteps", cases=DDPM_CASES, tol=TIMESTEP_INDEX)
def _(case, g):
    return timesteps_scenario(DDPMScheduler, case)


def grid(n, T=1000, spacing="leading", offset=0, *, ascending=False, leading_float=False,
         offset_everywhere=False, offset_nowhere=False, trailing_no_minus_one=False,
         trailing_integer_ratio=False, linspace_truncate=False, linspace_to_T=False, half_up=False,
         linspace_descending=False) -> torch.Tensor:
    """The timesteps with one misconception switched on (for traps); all switches off = correct."""
    i = torch.arange(n, dtype=torch.float64)
    if spacing == "leading":
        t = (i * (T / n)).round() if leading_float else i * (T // n)
        t = t.flip(0) + (0 if offset_nowhere else offset)
    elif spacing == "trailing":
        if trailing_integer_ratio:
            t = (T - 1) - i * (T // n)
        else:
            t = (T - i * (T / n)).round() - (0 if trailing_no_minus_one else 1)
        t = t + (offset if offset_everywhere else 0)
    elif linspace_descending:  # the grid built from T − 1 down (its own rounding, and [T − 1] for one step)
        t = torch.linspace(T - 1, 0, n, dtype=torch.float64).round() + (offset if offset_everywhere else 0)
    else:
        t = torch.linspace(0, T if linspace_to_T else T - 1, n, dtype=torch.float64)
        t = t.trunc() if linspace_truncate else (t + 0.5).floor() if half_up else t.round()
        t = t.flip(0) + (offset if offset_everywhere else 0)
    return (t.flip(0) if ascending else t).to(torch.int64)


def _timesteps_trap(name: str, hint: str, **bug):
    @inference_timesteps.trap(name, hint=hint)
    def _(num_inference_steps, num_train_timesteps=1000, timestep_spacing="leading", steps_offset=0):
        return grid(num_inference_steps, num_train_timesteps, timestep_spacing, steps_offset, **bug)


_timesteps_trap("ascending order (the grid was not reversed)",
                "Inference starts from noise: the largest timestep comes first. Reverse the grid (.flip(0)).",
                ascending=True)
_timesteps_trap("'leading' with the float spacing T/n",
                "'leading' multiplies by the integer T // n (n=7: 0, 142, …, 852); the float spacing T/n "
                "belongs to 'trailing'.", leading_float=True)
_timesteps_trap("steps_offset added for 'trailing'/'linspace' too",
                "diffusers adds steps_offset only in the 'leading' branch; 'trailing' and 'linspace' ignore it.",
                offset_everywhere=True)
_timesteps_trap("steps_offset ignored for 'leading'",
                "'leading' adds steps_offset to every timestep (Stable Diffusion 1.x: 981, 961, …, 1).",
                offset_nowhere=True)
_timesteps_trap("'trailing' without the final −1 (it starts at T)",
                "The model knows timesteps 0 … T−1: 'trailing' is round(T − i·T/n) − 1, so it starts at T−1.",
                trailing_no_minus_one=True)
_timesteps_trap("'trailing' with the integer spacing T//n from T−1",
                "'trailing' spaces by the float T/n and rounds (n=7: 999, 856, 713, …), so the gaps are "
                "143 or 142; stepping 142 at a time from 999 drifts away from that grid.",
                trailing_integer_ratio=True)
_timesteps_trap("'linspace' truncated instead of rounded",
                "Round half to even (torch.round): 499.5 becomes 500, 832.5 becomes 832; .long() alone truncates.",
                linspace_truncate=True)
_timesteps_trap("'linspace' rounded half up (floor(x + 0.5)), not half to even",
                "numpy and torch round a tie to the even neighbour: 832.5 becomes 832 and 166.5 becomes 166, where "
                "floor(x + 0.5) gives 833 and 167.", half_up=True)
_timesteps_trap("'linspace' built descending, linspace(T − 1, 0, n): one step is [T − 1], not [0]",
                "diffusers builds linspace(0, T − 1, n), rounds it and reverses it: at n = 1 that is [0], and the "
                "ties round from the ascending values.", linspace_descending=True)
_timesteps_trap("'linspace' over [0, T] instead of [0, T−1]",
                "The largest training timestep is T−1: linspace(0, T − 1, n), both ends included.",
                linspace_to_T=True)


@inference_timesteps.trap("the loop counter n−1, …, 0 (range(n) reversed) instead of the scheduler's timesteps",
                          hint="The model was trained on timesteps 0 … T−1 and must see the noise level of each "
                               "step: the spacing spreads the n steps over that whole range (leading, n = 10: "
                               "900, 800, …, 0), while n−1, …, 0 are the n cleanest training timesteps.")
def _(num_inference_steps, num_train_timesteps=1000, timestep_spacing="leading", steps_offset=0):
    return torch.arange(num_inference_steps, dtype=torch.int64).flip(0)


@inference_timesteps.trap("n consecutive training timesteps T−1, T−2, … (the spacing never applied)",
                          hint="Inference visits n of the T training timesteps spread over the whole range, not the "
                               "first n counted down from T−1 (n = 10, T = 1000: 999, 998, …, 990 would stop at a "
                               "still almost pure-noise level). The spacing picks which ones.")
def _(num_inference_steps, num_train_timesteps=1000, timestep_spacing="leading", steps_offset=0):
    return num_train_timesteps - 1 - torch.arange(num_inference_steps, dtype=torch.int64)


# ---- euler_timesteps --------------------------------------------------------------------------------
euler_timesteps = Kata(
    "euler_timesteps",
    hints=(
        "Euler uses the same three grids as DDIM, but keeps them as float32 and never rounds 'linspace'.",
        "linspace: (T−1)·(n−1−i)/(n−1) for i = 0 … n−1, unrounded (n=7: 999, 832.5, …, 0); "
        "leading/trailing: the integers of inference_timesteps, as float32.",
        "if linspace: torch.linspace(0, T - 1, n, dtype=torch.float64).flip(0).float(); "
        "else: inference_timesteps(...).float()",
    ),
    answer_key=(f"{EULER}.set_timesteps", f"{EVERY}.set_timesteps"),
)


@euler_timesteps.check("vs EulerDiscreteScheduler.timesteps", tol=SCHEDULE, cases=[
    dict(num_inference_steps=7, timestep_spacing="linspace", steps_offset=0),
    dict(num_inference_steps=10, timestep_spacing="linspace", steps_offset=1),
    dict(num_inference_steps=25, timestep_spacing="linspace", steps_offset=0),
    dict(num_inference_steps=7, num_train_timesteps=50, timestep_spacing="linspace", steps_offset=0),
    dict(num_inference_steps=7, timestep_spacing="leading", steps_offset=1),
    dict(num_inference_steps=7, timestep_spacing="trailing", steps_offset=1),
])
def _(case, g):
    s = EulerDiscreteScheduler(num_train_timesteps=case.get("num_train_timesteps", 1000),
                               timestep_spacing=case["timestep_spacing"], steps_offset=case["steps_offset"])
    with quiet_diffusers():
        s.set_timesteps(case["num_inference_steps"])
    T, n = case.get("num_train_timesteps", 1000), case["num_inference_steps"]
    exact = (torch.linspace(0, T - 1, n, dtype=torch.float64).flip(0) if case["timestep_spacing"] == "linspace"
             else s.timesteps.double())  # leading/trailing: integers, exact in float32 too
    return Scenario(inputs=dict(case), expected=s.timesteps.clone(), exact=exact)


@euler_timesteps.trap("DDIM's int64 timesteps reused as they are",
                      hint="Euler's timesteps are float32, and 'linspace' keeps its fractions (832.5 stays 832.5).")
def _(num_inference_steps, num_train_timesteps=1000, timestep_spacing="linspace", steps_offset=0):
    return grid(num_inference_steps, num_train_timesteps, timestep_spacing, steps_offset)


@euler_timesteps.trap("'linspace' rounded to integers (DDIM's rule)",
                      hint="Euler interpolates σ between table entries, so it does not round: 832.5 stays 832.5.")
def _(num_inference_steps, num_train_timesteps=1000, timestep_spacing="linspace", steps_offset=0):
    return grid(num_inference_steps, num_train_timesteps, timestep_spacing, steps_offset).to(torch.float32)


@euler_timesteps.trap("steps_offset added to every spacing (only 'leading' takes it)",
                      hint="diffusers adds steps_offset to the 'leading' grid alone: 'linspace' runs from T − 1 down "
                           "to 0 and 'trailing' from T − 1 down, whatever the offset.")
def _(num_inference_steps, num_train_timesteps=1000, timestep_spacing="linspace", steps_offset=0):
    T = num_train_timesteps
    if timestep_spacing == "linspace":
        t = torch.linspace(0, T - 1, num_inference_steps, dtype=torch.float64).flip(0)
        return (t + steps_offset).to(torch.float32)
    return grid(num_inference_steps, T, timestep_spacing, steps_offset, offset_everywhere=True).to(torch.float32)


@euler_timesteps.trap("ascending order (the grid was not reversed)",
                      hint="The noisiest timestep comes first: reverse the grid.")
def _(num_inference_steps, num_train_timesteps=1000, timestep_spacing="linspace", steps_offset=0):
    T = num_train_timesteps
    if timestep_spacing == "linspace":
        return torch.linspace(0, T - 1, num_inference_steps, dtype=torch.float64).to(torch.float32)
    return grid(num_inference_steps, T, timestep_spacing, steps_offset, ascending=True).to(torch.float32)


# ---- euler_sigmas -----------------------------------------------------------------------------------
euler_sigmas = Kata(
    "euler_sigmas",
    hints=(
        "Build the σ table at integer timesteps, read it at each (possibly fractional) timestep by "
        "linear interpolation, and end the ladder at 0.",
        "σ_k = √((1 − ᾱ_k)/ᾱ_k) with ᾱ floored at 2**-24;  σ(t) = σ_⌊t⌋ + (t − ⌊t⌋)·(σ_{⌊t⌋+1} − σ_⌊t⌋) "
        "(in float64);  output: [σ(t_0), …, σ(t_{n−1}), last] as float32, last = 0 or σ_0 ('sigma_min'); "
        "'log_linear': n + 1 values evenly spaced in log σ from σ_{T−1} to σ_0 instead of σ(t_i).",
        "ac = alphas_cumprod.clamp(min=2**-24); table = (((1 - ac) / ac) ** 0.5).double(); t = timesteps.double(); "
        "lo = t.floor().long(); hi = (lo + 1).clamp(max=T - 1); w = t - lo; "
        "s = (table[hi] - table[lo]) * w + table[lo]  (log_linear: torch.linspace(float(table[-1].log()), "
        "float(table[0].log()), n + 1).exp().double()); last = table[:1] if final_sigmas_type == 'sigma_min' "
        "else s.new_zeros(1); return torch.cat([s, last]).float()",
    ),
    answer_key=(f"{EULER}.set_timesteps", f"{EVERY}.set_timesteps"),
)

SIGMA_CASES = [
    dict(schedule="SD", n=7, spacing="linspace"),
    dict(schedule="SD", n=10, spacing="leading", offset=1),
    dict(schedule="SD", n=5, spacing="trailing", zero_snr=True),
    dict(schedule="coarse linear T=50", n=7, spacing="linspace"),
    dict(schedule="coarse scaled_linear T=100", n=8, spacing="linspace"),
    # the zero-terminal-SNR table as lab 01's rescale gives it, ᾱ_{T−1} = 0 (raw_table): diffusers'
    # scheduler floors that entry at 2**-24 before its σ table, so σ_max ≈ 4096, not ∞
    dict(schedule="SD", n=6, spacing="trailing", zero_snr=True, raw_table=True),
    dict(schedule="coarse scaled_linear T=100", n=5, spacing="linspace", zero_snr=True, raw_table=True,
         final="sigma_min"),
    # the ladder's other options: ending at σ_0, and n + 1 σs evenly spaced in log σ (timesteps unused)
    dict(schedule="SD", n=7, spacing="leading", offset=1, final="sigma_min"),
    dict(schedule="SD", n=6, spacing="linspace", interpolation="log_linear"),
    dict(schedule="coarse linear T=50", n=5, spacing="trailing", interpolation="log_linear", final="sigma_min"),
]


def sigmas_exact(alphas_cumprod, timesteps, interpolation: str, final: str):
    """The float64 shadow of the ladder: the same table (from the same float32 ᾱ, floored as diffusers
    floors it), read at the same float32 timesteps or spaced in log σ in float64."""
    table = _table(alphas_cumprod.clamp(min=2**-24).double())
    if interpolation == "log_linear":
        body = torch.linspace(float(table[-1].log()), float(table[0].log()), timesteps.shape[0] + 1,
                              dtype=torch.float64).exp()
    else:
        body = _interp(table, timesteps)
    return torch.cat([body, table[:1] if final == "sigma_min" else torch.zeros(1, dtype=torch.float64)])


def nonfinite_verify(expected: torch.Tensor):
    """Name 'σ from ᾱ = 0' where the answer is ∞/NaN and diffusers' is finite (the comparison would only
    say 'non-finite')."""
    def verify(out):
        if (type(out) is torch.Tensor and out.shape == expected.shape and not torch.isfinite(out).all()
                and torch.isfinite(expected).all()):
            raise KataFailure(
                f"  output has {int((~torch.isfinite(out)).sum())} non-finite value(s) (inf/nan) where diffusers' "
                f"σ ladder is finite (σ_max = {float(expected.max()):.6g})\n"
                f"  trap: {SIGMA_FROM_ZERO}\n    {SIGMA_FROM_ZERO_HINT}")
    return verify


SIGMA_FROM_ZERO = "σ from ᾱ = 0 (∞ at the zero-terminal-SNR end of the table)"
SIGMA_FROM_ZERO_HINT = ("A zero-terminal-SNR table ends at ᾱ = 0, where √((1 − ᾱ)/ᾱ) = ∞. diffusers reads that "
                        "ᾱ as 2**-24 (alphas_cumprod.clamp(min=2**-24)), so σ_max = √(2**24 − 1) ≈ 4096.")


@euler_sigmas.check("vs EulerDiscreteScheduler.sigmas", cases=SIGMA_CASES, tol=SIGMA)
def _(case, g):
    s = euler(**case)
    interpolation, final = case.get("interpolation", "linear"), case.get("final", "zero")
    # raw_table: the ᾱ diffusers computed before flooring its last entry (cumprod of its own rescaled β)
    ac = torch.cumprod(1 - s.betas, 0) if case.get("raw_table") else s.alphas_cumprod.clone()
    exact = sigmas_exact(s.alphas_cumprod, s.timesteps, interpolation, final)
    label = f"timesteps {_short(s.timesteps)}" + (", ᾱ_{T−1} = 0" if case.get("raw_table") else "")
    return Scenario(inputs=dict(alphas_cumprod=ac, timesteps=s.timesteps.clone(), interpolation_type=interpolation,
                                final_sigmas_type=final),
                    expected=s.sigmas.clone(), exact=exact, label=label, verify=nonfinite_verify(s.sigmas))


def _table(alphas_cumprod):
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


def _interp(table, timesteps):
    T = table.shape[0]
    table, t = table.double(), timesteps.double()
    lo = t.floor().clamp(0, T - 1).long()
    hi = (lo + 1).clamp(max=T - 1)
    return (table[hi] - table[lo]) * (t - lo) + table[lo]


def wrong_sigmas(alphas_cumprod, timesteps, interpolation_type="linear", final_sigmas_type="zero", *,
                 no_floor=False, final_zero=False, log_at_timesteps=False, final_ladder_min=False):
    """The σ ladder with one misconception switched on (all switches off = correct)."""
    ac = alphas_cumprod if no_floor else alphas_cumprod.clamp(min=2**-24)
    table = _table(ac).double()
    if log_at_timesteps and interpolation_type == "log_linear":  # log σ interpolated at the timesteps
        body = _interp(table.log(), timesteps).exp()
    elif interpolation_type == "log_linear":
        body = torch.linspace(float(table[-1].log()), float(table[0].log()), timesteps.shape[0] + 1).double().exp()
    else:
        body = _interp(table, timesteps)
    last = table[:1] if final_sigmas_type == "sigma_min" and not final_zero else body.new_zeros(1)
    if final_ladder_min and final_sigmas_type == "sigma_min":  # the ladder's own last σ, not the table's σ_0
        last = body.min().reshape(1)
    return torch.cat([body, last]).to(torch.float32)


@euler_sigmas.trap(SIGMA_FROM_ZERO, hint=SIGMA_FROM_ZERO_HINT)
def _(**kw):
    return wrong_sigmas(**kw, no_floor=True)


@euler_sigmas.trap("final σ = 0 whatever final_sigmas_type says",
                   hint="final_sigmas_type='sigma_min' ends the ladder at σ_0 = √((1 − ᾱ_0)/ᾱ_0), the smallest "
                        "trained σ; only 'zero' ends it at 0.")
def _(**kw):
    return wrong_sigmas(**kw, final_zero=True)


@euler_sigmas.trap("'sigma_min' read as the ladder's smallest σ (σ at the last timestep), not the table's σ_0",
                   hint="final_sigmas_type='sigma_min' appends σ_0 = √((1 − ᾱ_0)/ᾱ_0), the σ of training timestep 0, "
                        "whatever the ladder's last timestep is (t = 1 with 'leading' spacing and steps_offset 1).")
def _(**kw):
    return wrong_sigmas(**kw, final_ladder_min=True)


@euler_sigmas.trap("'log_linear' read as log σ interpolated at the timesteps",
                   hint="diffusers' 'log_linear' ignores the timesteps: n + 1 values evenly spaced in log σ from "
                        "σ_{T−1} down to σ_0, then the final σ (n + 2 entries).")
def _(**kw):
    return wrong_sigmas(**kw, log_at_timesteps=True)


def _ladder(sigmas):
    return torch.cat([sigmas, sigmas.new_zeros(1)]).to(torch.float32)


@euler_sigmas.trap("no final σ = 0 (n entries instead of n + 1)",
                   hint="Append a 0: the last step goes from σ(t_{n−1}) to σ = 0, the clean sample.")
def _(alphas_cumprod, timesteps, interpolation_type="linear", final_sigmas_type="zero"):
    return _interp(_table(alphas_cumprod), timesteps).to(torch.float32)


@euler_sigmas.trap("ᾱ interpolated, then turned into σ",
                   hint="Interpolate the σ table itself: σ is not linear in ᾱ, so the two disagree between "
                        "grid points.")
def _(alphas_cumprod, timesteps, interpolation_type="linear", final_sigmas_type="zero"):
    abar = _interp(alphas_cumprod, timesteps)
    return _ladder(((1 - abar) / abar) ** 0.5)


@euler_sigmas.trap("σ looked up at int(t) (the fraction dropped, no interpolation)",
                   hint="table[t.long()] truncates 832.5 to 832: interpolate, σ_832 + 0.5·(σ_833 − σ_832).")
def _(alphas_cumprod, timesteps, interpolation_type="linear", final_sigmas_type="zero"):
    return _ladder(_table(alphas_cumprod).double()[timesteps.long()])


@euler_sigmas.trap("σ read at the rounded timestep (no interpolation)",
                   hint="Fractional timesteps such as 832.5 sit between two table entries: interpolate "
                        "linearly between σ_⌊t⌋ and σ_{⌊t⌋+1}.")
def _(alphas_cumprod, timesteps, interpolation_type="linear", final_sigmas_type="zero"):
    return _ladder(_table(alphas_cumprod).double()[timesteps.round().long()])


@euler_sigmas.trap("σ = √(1 − ᾱ) (DDPM's noise coefficient)",
                   hint="Euler's σ is the noise std after dividing x_t by √ᾱ: σ = √((1 − ᾱ)/ᾱ), which reaches "
                        "~14.6, not 1.")
def _(alphas_cumprod, timesteps, interpolation_type="linear", final_sigmas_type="zero"):
    return _ladder(_interp((1 - alphas_cumprod) ** 0.5, timesteps))


@euler_sigmas.trap("σ = √(ᾱ/(1 − ᾱ)) (the ratio upside down)",
                   hint="σ grows with the noise: √((1 − ᾱ)/ᾱ), small at t = 0 and large at t = T−1.")
def _(alphas_cumprod, timesteps, interpolation_type="linear", final_sigmas_type="zero"):
    return _ladder(_interp((alphas_cumprod / (1 - alphas_cumprod)) ** 0.5, timesteps))


# ---- init_noise_sigma -------------------------------------------------------------------------------
init_noise_sigma = Kata(
    "init_noise_sigma",
    hints=(
        "The starting latent is randn times this number: its std at the first (largest) σ.",
        "σ_max = max(sigmas); 'linspace' and 'trailing' return σ_max, 'leading' returns √(σ_max² + 1).",
        "m = float(sigmas.max()); return m if timestep_spacing in ('linspace', 'trailing') else (m**2 + 1) ** 0.5",
    ),
    # init_noise_sigma is a property, which the answer-key lock cannot guard yet; locking the
    # constructor stops the same shortcut (build a scheduler, read its attribute) with a clear message.
    answer_key=(f"{EULER}.__init__", f"{EVERY}.__init__", f"{EVERY}.init_noise_sigma"),
)


@init_noise_sigma.check("vs Euler init_noise_sigma", tol=SIGMA, cases=[
    dict(schedule="SD", n=10, spacing="linspace"),
    dict(schedule="SD", n=50, spacing="leading", offset=1),
    dict(schedule="SD", n=7, spacing="trailing"),
    dict(schedule="coarse linear T=50", n=5, spacing="leading"),
    dict(schedule="SD", n=5, spacing="trailing", zero_snr=True),
])
def _(case, g):
    s = euler(**case)
    sigma_max = float(s.sigmas.max())
    exact = sigma_max if case["spacing"] in ("linspace", "trailing") else (sigma_max**2 + 1) ** 0.5
    return Scenario(inputs=dict(sigmas=s.sigmas.clone(), timestep_spacing=case["spacing"]),
                    expected=float(s.init_noise_sigma), exact=exact, label=f"σ_max = {sigma_max:.6g}")


@init_noise_sigma.trap("σ_max for every spacing",
                       hint="diffusers returns √(σ_max² + 1) for 'leading' (the std of x_0 + σ_max·ε), "
                            "σ_max only for 'linspace' and 'trailing'.")
def _(sigmas, timestep_spacing):
    return float(sigmas.max())


@init_noise_sigma.trap("√(σ_max² + 1) for every spacing",
                       hint="Only 'leading' uses √(σ_max² + 1); 'linspace' and 'trailing' return σ_max itself.")
def _(sigmas, timestep_spacing):
    return (float(sigmas.max()) ** 2 + 1) ** 0.5


@init_noise_sigma.trap("the two rules swapped: √(σ_max² + 1) for 'linspace'/'trailing', σ_max for 'leading'",
                       hint="It is the other way round: EulerDiscreteScheduler.init_noise_sigma is σ_max for "
                            "'linspace' and 'trailing', and √(σ_max² + 1) for 'leading' only.")
def _(sigmas, timestep_spacing):
    sigma_max = float(sigmas.max())
    return (sigma_max**2 + 1) ** 0.5 if timestep_spacing in ("linspace", "trailing") else sigma_max


@init_noise_sigma.trap("1.0, as for DDPM/DDIM",
                       hint="DDPM's latent is unit-variance, but Euler's is x_0 + σ·ε: start at std ≈ σ_max.")
def _(sigmas, timestep_spacing):
    return 1.0


# ---- euler_scale_model_input ------------------------------------------------------------------------
euler_scale_model_input = Kata(
    "euler_scale_model_input",
    hints=(
        "The UNet was trained on unit-variance inputs; Euler's latent x_0 + σ·ε has variance σ² + 1.",
        "model_input = x / √(σ² + 1).",
        "return sample / ((sigma**2 + 1) ** 0.5)",
    ),
    answer_key=(f"{EULER}.scale_model_input", f"{EVERY}.scale_model_input",
                # EDM's c_in with σ_data = 1 is this scaling
                f"{EVERY}.precondition_inputs", f"{EVERY}._get_conditioning_c_in"),
)


@euler_scale_model_input.check("vs scale_model_input, every timestep", tol=STEP_MATH, cases=[
    dict(shape=(2, 4, 8, 8), dtype="float32", n=10, spacing="linspace"),
    dict(shape=(1, 4, 16, 16), dtype="float16", n=5, spacing="leading", offset=1),
    dict(shape=(3, 3, 8, 8), dtype="float32", n=4, spacing="trailing", zero_snr=True),
    # float16 at zero terminal SNR: σ ≈ 4096, whose square no float16 holds (diffusers keeps σ float32)
    dict(shape=(2, 4, 8, 8), dtype="float16", n=4, spacing="trailing", zero_snr=True),
])
def _(case, g):
    case = dict(case)
    shape, dtype = case.pop("shape"), DTYPES[case.pop("dtype")]
    s = euler(**case)
    scenarios = []
    for i, t in enumerate(s.timesteps):
        sigma = s.sigmas[i]
        x = (torch.randn(shape, generator=g) * float((sigma**2 + 1) ** 0.5)).to(dtype)
        expected = s.scale_model_input(x.clone(), t)
        # A pipeline calls step after scale_model_input; step advances the scheduler to the next σ.
        s.step(torch.zeros_like(x), t, x.clone())
        exact = x.double() / (sigma.double() ** 2 + 1) ** 0.5
        scenarios.append(Scenario(inputs=dict(sample=x, sigma=sigma.clone()), expected=expected, exact=exact,
                                  label=f"step {i + 1}/{len(s.timesteps)}, t={float(t):g}, σ={float(sigma):.6g}"))
    return scenarios


@euler_scale_model_input.trap("multiplied by √(σ² + 1) instead of divided",
                              hint="The latent is too large for the UNet (std √(σ² + 1)); divide to bring it to ~1.")
def _(sample, sigma):
    return sample * ((sigma**2 + 1) ** 0.5)


@euler_scale_model_input.trap("divided by σ",
                              hint="The latent is x_0 + σ·ε, whose std is √(σ² + 1), not σ; at small σ dividing "
                                   "by σ blows the input up.")
def _(sample, sigma):
    return sample / sigma


@euler_scale_model_input.trap("divided by σ² + 1 (no square root)",
                              hint="Divide by the std √(σ² + 1), not the variance σ² + 1.")
def _(sample, sigma):
    return sample / (sigma**2 + 1)


@euler_scale_model_input.trap("σ cast to the sample's float16 before squaring (σ² overflows past 256)",
                              hint="Keep σ float32 (diffusers does): at zero terminal SNR σ ≈ 4096, and σ² = 1.7e7 is "
                                   "inf in float16, which turns the whole input to 0.")
def _(sample, sigma):
    s = sigma.to(sample.dtype)
    return sample / (s * s + 1).sqrt()


# ---- euler_step -------------------------------------------------------------------------------------
euler_step = Kata(
    "euler_step",
    hints=(
        "Turn the model output into a clean-sample guess x̂_0, then move x towards it along the ODE "
        "direction (x − x̂_0)/σ by the (negative) step σ_next − σ. Upcast to float32 first.",
        "ε: x̂_0 = x − σ·ε;  v: x̂_0 = x/(σ² + 1) − σ/√(σ² + 1)·v;  sample: x̂_0 = the output;  d = (x − x̂_0)/σ;  "
        "x_next = x + (σ_next − σ)·d, cast to model_output.dtype.",
        "x = sample.float(); x0 = x - sigma * model_output (or model_output * (-sigma / (sigma**2 + 1) ** 0.5) "
        "+ x / (sigma**2 + 1)); return (x + (x - x0) / sigma * (sigma_next - sigma)).to(model_output.dtype)",
    ),
    answer_key=(f"{EULER}.step", f"{EVERY}.step"),
)

STEP_CASES = {
    "epsilon": [
        dict(shape=(2, 4, 8, 8), dtype="float32", n=10, spacing="linspace"),
        dict(shape=(1, 4, 16, 16), dtype="float32", n=7, spacing="leading", offset=1),
        dict(shape=(3, 3, 8, 8), dtype="float32", n=5, spacing="trailing", schedule="coarse linear T=50"),
    ],
    # float16 only with v: diffusers multiplies a float16 ε by σ held as a 0-dim float32 tensor, which
    # torch rounds to float16 first; x + (σ_next − σ)·ε (the same math) is then 0.03-0.06 off.
    "v_prediction": [
        dict(shape=(2, 4, 8, 8), dtype="float32", n=7, spacing="linspace"),
        dict(shape=(2, 4, 8, 8), dtype="float32", n=6, spacing="trailing", zero_snr=True),
        dict(shape=(2, 4, 8, 8), dtype="float16", n=6, spacing="trailing", zero_snr=True),
        dict(shape=(1, 4, 8, 8), dtype="float16", n=5, spacing="leading", offset=1),
    ],
    # x̂_0 predicted directly: d = (x − out)/σ. Also with a σ_min-ended ladder and a zero-SNR start (σ = 4096).
    "sample": [
        dict(shape=(2, 4, 8, 8), dtype="float32", n=7, spacing="linspace"),
        dict(shape=(2, 3, 8, 8), dtype="float32", n=6, spacing="trailing", zero_snr=True, final="sigma_min"),
        dict(shape=(1, 4, 8, 8), dtype="float16", n=5, spacing="leading", offset=1),
        # float32 latents, a float16 model: the step returns the model output's dtype, not the sample's
        dict(shape=(2, 4, 8, 8), dtype="float16", sample_dtype="float32", n=5, spacing="linspace"),
    ],
}


def euler_exact(model_output, sample, sigma, sigma_next, prediction_type):
    """EulerDiscreteScheduler.step's formula in float64 on the same inputs: its float64 shadow (diffusers
    upcasts to float32 inside step, so its own code cannot run wider)."""
    x, out, sigma, sigma_next = sample.double(), model_output.double(), sigma.double(), sigma_next.double()
    if prediction_type == "v_prediction":
        x0 = out * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)
    elif prediction_type == "sample":
        x0 = out
    else:
        x0 = x - sigma * out
    return x + (x - x0) / sigma * (sigma_next - sigma)


def step_scenarios(case: dict, g, prediction_type: str) -> list[Scenario]:
    """A whole sampling run with random model outputs: one scenario per timestep, in order."""
    case = dict(case)
    shape, dtype = case.pop("shape"), DTYPES[case.pop("dtype")]
    sample_dtype = DTYPES[case.pop("sample_dtype", str(dtype).removeprefix("torch."))]
    s = euler(**case, prediction_type=prediction_type)
    x = (torch.randn(shape, generator=g) * float(s.init_noise_sigma)).to(sample_dtype)
    scenarios = []
    for i, t in enumerate(s.timesteps):
        out = torch.randn(shape, generator=g).to(dtype)
        sigma, sigma_next = s.sigmas[i].clone(), s.sigmas[i + 1].clone()
        # step uses the scheduler's own step index, so the reference is driven in order, like a pipeline.
        expected = s.step(out.clone(), t, x.clone()).prev_sample
        scenarios.append(Scenario(
            inputs=dict(model_output=out, sample=x, sigma=sigma, sigma_next=sigma_next,
                        prediction_type=prediction_type),
            expected=expected, exact=euler_exact(out, x, sigma, sigma_next, prediction_type),
            label=f"step {i + 1}/{len(s.timesteps)}, t={float(t):g}, σ={float(sigma):.6g} → {float(sigma_next):.6g}"))
        x = expected.to(sample_dtype)  # the caller keeps its latents in their own dtype
    return scenarios


@euler_step.check("vs Euler step, epsilon", cases=STEP_CASES["epsilon"], tol=STEP_MATH)
def _(case, g):
    return step_scenarios(case, g, "epsilon")


@euler_step.check("vs Euler step, v_prediction", cases=STEP_CASES["v_prediction"], tol=STEP_MATH)
def _(case, g):
    return step_scenarios(case, g, "v_prediction")


@euler_step.check("vs Euler step, sample", cases=STEP_CASES["sample"], tol=STEP_MATH)
def _(case, g):
    return step_scenarios(case, g, "sample")


def _x0(model_output, x, sigma, prediction_type):
    if prediction_type == "v_prediction":
        return model_output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)
    if prediction_type == "sample":
        return model_output
    return x - sigma * model_output


def _euler(model_output, sample, sigma, sigma_next, x0=None, *, upcast=True, dt=None):
    x = sample.to(torch.float32) if upcast else sample
    x0 = _x0(model_output, x, sigma, "epsilon") if x0 is None else x0
    step = (sigma_next - sigma) if dt is None else dt
    return (x + (x - x0) / sigma * step).to(model_output.dtype)


@euler_step.trap("step size σ − σ_next (the step goes back up in noise)",
                 hint="σ_next < σ: x_next = x + (σ_next − σ)·d moves against d, towards x̂_0.")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    x = sample.to(torch.float32)
    x0 = _x0(model_output, x, sigma, prediction_type)
    return _euler(model_output, sample, sigma, sigma_next, x0, dt=sigma - sigma_next)


@euler_step.trap("v-prediction treated as ε",
                 hint="With prediction_type='v_prediction' the output is v: x̂_0 = x/(σ² + 1) − σ/√(σ² + 1)·v.")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    if prediction_type == "sample":
        return _euler(model_output, sample, sigma, sigma_next, model_output)
    return _euler(model_output, sample, sigma, sigma_next)


@euler_step.trap("an x̂0 prediction ('sample') treated as ε",
                 hint="With prediction_type='sample' the model output is x̂_0 itself: d = (x − output)/σ.")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    if prediction_type == "v_prediction":
        return _euler(model_output, sample, sigma, sigma_next, _x0(model_output, sample.float(), sigma, prediction_type))
    return _euler(model_output, sample, sigma, sigma_next)


@euler_step.trap("v-prediction's x̂_0 taken on the unscaled latent (x/√(σ²+1) instead of x/(σ²+1))",
                 hint="x̂_0 = √ᾱ·z − √(1−ᾱ)·v holds for the unit-scale z = x/√(σ² + 1), and √ᾱ = 1/√(σ² + 1): "
                      "so x is divided by σ² + 1 in total.")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    x = sample.to(torch.float32)
    if prediction_type == "v_prediction":
        x0 = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1) ** 0.5
    else:
        x0 = _x0(model_output, x, sigma, prediction_type)
    return _euler(model_output, sample, sigma, sigma_next, x0)


@euler_step.trap("returned x̂_0 instead of the next latent",
                 hint="step returns x at σ_next: x + (σ_next − σ)·(x − x̂_0)/σ. x̂_0 is only the direction.")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    return _x0(model_output, sample.to(torch.float32), sigma, prediction_type).to(model_output.dtype)


@euler_step.trap("computed in float16 (no upcast to float32)",
                 hint="diffusers upcasts the latent to float32 for the update and casts the result back to "
                      "model_output.dtype: σ is large and x − x̂_0 cancels, which float16 cannot resolve.")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    x0 = _x0(model_output, sample, sigma, prediction_type)
    return _euler(model_output, sample, sigma, sigma_next, x0, upcast=False)


@euler_step.trap("σ cast to float16 too (σ² overflows float16 past σ = 256)",
                 hint="Keep σ and σ_next the float32 they are and upcast the latent: in float16, σ² + 1 is inf once "
                      "σ > 256 (zero terminal SNR's first σ is 4096), and x/(σ² + 1) and σ/√(σ² + 1) collapse to 0.")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    half = model_output.dtype
    sigma, sigma_next = sigma.to(half), sigma_next.to(half)
    x0 = _x0(model_output, sample.to(half), sigma, prediction_type)
    return _euler(model_output, sample.to(half), sigma, sigma_next, x0, upcast=False)


@euler_step.trap("the derivative not divided by σ",
                 hint="The ODE direction is d = (x − x̂_0)/σ (for ε-prediction that is ε itself).")
def _(model_output, sample, sigma, sigma_next, prediction_type="epsilon"):
    x = sample.to(torch.float32)
    x0 = _x0(model_output, x, sigma, prediction_type)
    return (x + (x - x0) * (sigma_next - sigma)).to(model_output.dtype)
