"""Grader for lab 16 · Few-step distillation: the LCM ladder, its boundary scalings and step, SD-Turbo's
trailing schedule, and the few-step loop without a CFG batch.

References are live: LCMScheduler (set_timesteps, get_scalings_for_boundary_condition_discrete, step),
EulerDiscreteScheduler with SD-Turbo's scheduler config (scaled_linear betas, timestep_spacing="trailing",
steps_offset=1), and StableDiffusionPipeline on the tiny text-conditioned UNet (engine.tiny.unet_cond)
with guidance_scale 0, 1 and 1.5, run with latents= and output_type="latent". The pipeline module is imported
with the grader (as lab 04 does), so the import's console notes are not captured as a check's output.

Precision: every float check carries its float64 shadow (Scenario.exact). The boundary scalings are
Python floats in diffusers and exact rationals in the shadow; c_skip falls to 2.5e-9 at t = 999, so they
are graded relatively (an absolute 1e-6 would let a forgotten timestep_scaling through). The LCM step runs
in the model output's dtype in diffusers (float16: 0-dim float32 ᾱ times float16 tensors stays float16);
its shadow is the same step in float64 with the same noise draw z widened, so computing in float32 and
casting once passes. The Euler σ table is float32 (diffusers' own), read at integer timesteps; its
shadow is that table recomputed in float64 from the same float32 ᾱ. The loop is compared with the
pipeline within MODEL_FORWARD (the same ops give the same bits; another batch size moves the UNet by ~1e-6).
"""
from fractions import Fraction

import torch
from diffusers.pipelines.stable_diffusion import pipeline_stable_diffusion  # noqa: F401  (see the docstring)
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.schedulers.scheduling_lcm import LCMScheduler

from diffusion_katas.core.spec import Kata, Measurement, Scenario
from diffusion_katas.core.tolerances import EXACT, HALF_STEP, MODEL_FORWARD, SIGMA, STEP_MATH, Tol
from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import (DTYPES, SD_BETAS, DenoiserProbe, PipelineRecorder, TrajectoryProbe, localizer,
                                           quiet_diffusers, seed_from)

LCM = "diffusers.schedulers.scheduling_lcm.LCMScheduler"
EULER = "diffusers.schedulers.scheduling_euler_discrete.EulerDiscreteScheduler"
PIPELINE = "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.StableDiffusionPipeline.__call__"
# SD-Turbo's scheduler_config.json (stabilityai/sd-turbo): Euler, SD betas, trailing spacing, offset 1.
TURBO = dict(**SD_BETAS, timestep_spacing="trailing", steps_offset=1)
COUNTED_UNET = "UNet2DConditionModel(tiny, random weights; calls counted)"


def _short(values) -> str:
    values = [float(f"{v:.5g}") if isinstance(v, float) else v for v in list(values)]
    return str(values) if len(values) <= 8 else f"[{values[0]}, {values[1]}, {values[2]}, …, {values[-1]}]"


def lcm(case: dict) -> LCMScheduler:
    """An LCMScheduler with SD's betas and the case's T, N, prediction type and timestep_scaling."""
    return LCMScheduler(num_train_timesteps=case.get("T", 1000), **SD_BETAS,
                        original_inference_steps=case.get("N", 50),
                        prediction_type=case.get("prediction_type", "epsilon"),
                        timestep_scaling=case.get("timestep_scaling", 10.0))


# ---- lcm_timesteps ----------------------------------------------------------------------------------
lcm_timesteps = Kata(
    "lcm_timesteps",
    hints=(
        "The model was distilled on only N = original_inference_steps timesteps, k = T // N apart. Build "
        "that ladder, turn it noisiest-first, and pick n of its rungs evenly spaced by index.",
        "k = T // N;  origin = [k·i − 1 for i = 1 … N];  reversed;  index_j = floor(j·N/n), j = 0 … n − 1;  "
        "timesteps = reversed_origin[index]  (n = 4: 999, 759, 499, 259).",
        "k = T // N; origin = torch.arange(1, N + 1) * k - 1; "
        "return origin.flip(0)[torch.arange(n) * N // n]",
    ),
    answer_key=(f"{LCM}.set_timesteps",),
)

LADDER_CASES = [dict(num_inference_steps=n, original_inference_steps=50, num_train_timesteps=1000)
                for n in range(1, 9)] + [
    dict(num_inference_steps=3, original_inference_steps=40, num_train_timesteps=500),  # k = 12: 479, 323, 167
    dict(num_inference_steps=4, original_inference_steps=32, num_train_timesteps=1000),  # k = 31: 991, …
    dict(num_inference_steps=8, original_inference_steps=50, num_train_timesteps=100),  # k = 2: 99, 87, …, 13
    dict(num_inference_steps=7, original_inference_steps=25, num_train_timesteps=1000),  # k = 40
]


@lcm_timesteps.check("vs LCMScheduler.set_timesteps", cases=LADDER_CASES, tol=EXACT)
def _(case, g):
    s = LCMScheduler(num_train_timesteps=case["num_train_timesteps"],
                     original_inference_steps=case["original_inference_steps"])
    s.set_timesteps(case["num_inference_steps"])
    return Scenario(inputs=dict(case), expected=s.timesteps.clone(), label=f"timesteps {_short(s.timesteps.tolist())}")


def _ladder_trap(name, hint):
    def register(fn):
        @lcm_timesteps.trap(name, hint=hint)
        def _(num_inference_steps, original_inference_steps=50, num_train_timesteps=1000):
            return torch.tensor(fn(num_inference_steps, original_inference_steps, num_train_timesteps),
                                dtype=torch.int64)
        return fn
    return register


def _pick(n, N, T, index):
    """The distillation ladder k·i − 1, noisiest first, read at index(j) for j = 0 … n − 1."""
    k = T // N
    origin = [k * i - 1 for i in range(1, N + 1)][::-1]
    return [origin[index(j)] for j in range(n)]


def _lcm_ladder(n, N, T):
    return _pick(n, N, T, lambda j: j * N // n)


@_ladder_trap("DDIM's leading spacing (T//n · j, reversed)",
              "LCM does not space over all T timesteps: it picks rungs of the N-step distillation ladder "
              "k·i − 1 (k = T // N), n = 4 → 999, 759, 499, 259, not 750, 500, 250, 0.")
def _(n, N, T):
    return [(T // n) * j for j in range(n)][::-1]


@_ladder_trap("trailing spacing over all T timesteps",
              "The student only knows the N distillation timesteps (19, 39, …, 999 for N = 50): n = 4 is "
              "999, 759, 499, 259, not 999, 749, 499, 249.")
def _(n, N, T):
    return [round(T - j * T / n) - 1 for j in range(n)]


@_ladder_trap("indices rounded (round(j·N/n)), not floored",
              "The picks are index_j = floor(j·N/n): integer division j·N // n (n = 3, N = 50: 0, 16, 33).")
def _(n, N, T):
    return _pick(n, N, T, lambda j: min(round(j * N / n), N - 1))


@_ladder_trap("distillation ladder k·i without the − 1",
              "The rungs are k·i − 1 for i = 1 … N (19, 39, …, 999): they end at T − 1, the last training timestep.")
def _(n, N, T):
    return [t + 1 for t in _lcm_ladder(n, N, T)]


@_ladder_trap("the first n rungs instead of n evenly spaced ones",
              "Spread the n picks over all N rungs: index_j = floor(j·N/n), not j (999, 979, 959, …).")
def _(n, N, T):
    k = T // N
    return [k * (N - j) - 1 for j in range(n)]


@_ladder_trap("indices from linspace(0, N − 1, n) (endpoint included)",
              "The indices are floor(j·N/n) (np.linspace(0, N, n, endpoint=False)): the last rung k − 1 is "
              "never picked unless n = N.")
def _(n, N, T):
    return _pick(n, N, T, lambda j: int(j * (N - 1) / (n - 1)) if n > 1 else 0)


@_ladder_trap("a fixed stride of N // n rungs (j·(N // n)), not floor(j·N/n)",
              "Integer-dividing first loses the remainder: with n = 4, N = 50 the stride 12 gives indices 0, 12, 24, "
              "36 where floor(j·50/4) gives 0, 12, 25, 37. Multiply, then divide: j·N // n.")
def _(n, N, T):
    return _pick(n, N, T, lambda j: j * (N // n))


@_ladder_trap("the ladder counted down from T − 1 in steps of k (T − 1 − k·i), not up as k·i − 1",
              "The rungs are k·i − 1 for i = 1 … N: they end at k·N − 1, which is T − 1 only when N divides T "
              "(T = 1000, N = 32: k = 31, the top rung is 991).")
def _(n, N, T):
    k = T // N
    origin = [T - 1 - k * i for i in range(N)]
    return [origin[j * N // n] for j in range(n)]


@_ladder_trap("indices from linspace(0, N − 1, n) rounded (endpoint included)",
              "The indices are floor(j·N/n) (np.linspace(0, N, n, endpoint=False)): the last rung k − 1 is "
              "never picked unless n = N.")
def _(n, N, T):
    return _pick(n, N, T, lambda j: round(j * (N - 1) / (n - 1)) if n > 1 else 0)


@_ladder_trap("original_inference_steps ignored (always 50)",
              "k = T // N with N = original_inference_steps, the length of the distillation ladder the model "
              "was trained on: read it from the argument.")
def _(n, N, T):
    return _lcm_ladder(n, 50, T)


# ---- boundary_scalings ------------------------------------------------------------------------------
boundary_scalings = Kata(
    "boundary_scalings",
    hints=(
        "Scale the timestep by timestep_scaling, then c_skip is σ_d²/(τ² + σ_d²) and c_out is τ/√(τ² + σ_d²), "
        "with σ_d = 0.5. At t = 0 that is (1, 0): f(x, 0) = x.",
        "τ = timestep_scaling·t;  c_skip = 0.25/(τ² + 0.25);  c_out = τ/√(τ² + 0.25).",
        "tau = timestep * timestep_scaling; return 0.25 / (tau**2 + 0.25), tau / (tau**2 + 0.25) ** 0.5",
    ),
    answer_key=(f"{LCM}.get_scalings_for_boundary_condition_discrete",),
)

# c_skip spans 1 (t = 0) to 2.5e-9 (t = 999, s = 10): relative, or a ×100 error at t = 999 would pass.
RELATIVE = Tol(1e-12, 1e-6, "c_skip falls to 2.5e-9 at t = 999 (s = 10): the scalings are graded relatively; "
                            "float32 arithmetic is within 1e-7 of them, a forgotten timestep_scaling is 100× off")

BOUNDARY_CASES = [dict(timestep=t, timestep_scaling=10.0) for t in (0, 1, 3, 19, 259, 999)] + [
    dict(timestep=1, timestep_scaling=1.0), dict(timestep=13, timestep_scaling=0.05),
    dict(timestep=499, timestep_scaling=0.05), dict(timestep=479, timestep_scaling=25.0),
]


def exact_scalings(t: int, s: float) -> tuple[float, float]:
    """The scalings in exact rational arithmetic on the same float inputs (c_out's root in float64)."""
    tau = Fraction(s) * t
    d = tau**2 + Fraction(1, 4)
    return float(Fraction(1, 4) / d), float(tau) / float(d) ** 0.5


@boundary_scalings.check("vs get_scalings_for_boundary_condition_discrete", cases=BOUNDARY_CASES, tol=RELATIVE)
def _(case, g):
    s = LCMScheduler(timestep_scaling=case["timestep_scaling"])
    expected = tuple(float(v) for v in s.get_scalings_for_boundary_condition_discrete(case["timestep"]))
    return Scenario(inputs=dict(case), expected=expected, exact=exact_scalings(case["timestep"], case["timestep_scaling"]),
                    label=f"c_skip = {expected[0]:.6g}, c_out = {expected[1]:.10g}")


def _scalings(t, s, *, swap=False, no_root=False, sigma_not_squared=False):
    tau = t * s
    sd2 = 0.5 if sigma_not_squared else 0.25
    c_skip = sd2 / (tau**2 + sd2)
    c_out = tau / (tau**2 + sd2) if no_root else tau / (tau**2 + sd2) ** 0.5
    return (c_out, c_skip) if swap else (c_skip, c_out)


@boundary_scalings.trap("c_skip and c_out swapped",
                        hint="c_skip multiplies the noisy input x and must vanish at high t: c_skip = σ_d²/(τ² + σ_d²) "
                             "(1 at t = 0, ~0 at t = 999); c_out = τ/√(τ² + σ_d²) weighs x̂₀.")
def _(timestep, timestep_scaling=10.0):
    return _scalings(timestep, timestep_scaling, swap=True)


@boundary_scalings.trap("c_out = 1 − c_skip (the scalings taken to sum to 1)",
                        hint="They do not: c_skip = σ_d²/(τ² + σ_d²) and c_out = τ/√(τ² + σ_d²) (at τ = 0.5: 0.5 "
                             "and 0.707). Compute c_out from its own formula.")
def _(timestep, timestep_scaling=10.0):
    c_skip, _ = _scalings(timestep, timestep_scaling)
    return c_skip, 1 - c_skip


@boundary_scalings.trap("timestep_scaling forgotten (τ = t)",
                        hint="Scale the timestep first: τ = timestep_scaling·t (10·t by default); without it c_skip "
                             "is 100× too large at every t.")
def _(timestep, timestep_scaling=10.0):
    return _scalings(timestep, 1.0)


@boundary_scalings.trap("EDM's c_out (σ_d·τ/√(τ² + σ_d²))",
                        hint="LCM's boundary c_out = τ/√(τ² + σ_d²), without EDM's σ_d factor: it tends to 1 at large t, "
                             "so the model's x̂₀ passes through whole.")
def _(timestep, timestep_scaling=10.0):
    c_skip, c_out = _scalings(timestep, timestep_scaling)
    return c_skip, 0.5 * c_out


@boundary_scalings.trap("c_out without the square root (τ/(τ² + σ_d²))",
                        hint="c_out = τ/√(τ² + σ_d²): it tends to 1 at large t, so the model's x̂₀ passes through.")
def _(timestep, timestep_scaling=10.0):
    return _scalings(timestep, timestep_scaling, no_root=True)


@boundary_scalings.trap("σ_data not squared (0.5 where σ_d² = 0.25 belongs)",
                        hint="σ_d = 0.5, and both scalings use σ_d² = 0.25.")
def _(timestep, timestep_scaling=10.0):
    return _scalings(timestep, timestep_scaling, sigma_not_squared=True)


# ---- lcm_step ---------------------------------------------------------------------------------------
lcm_step = Kata(
    "lcm_step",
    hints=(
        "Three moves: x̂₀ from the model output (as lab 02), the consistency output c_skip·x + c_out·x̂₀, "
        "then a jump forward to the NEXT rung of the ladder with fresh noise, except at the last rung.",
        "x̂₀ by prediction type;  denoised = c_skip·x + c_out·x̂₀ (boundary_scalings);  if t is not the last "
        "timestep: t' = the next entry, z = randn(shape, generator, dtype of the output), "
        "prev = √ᾱ_t'·denoised + √(1 − ᾱ_t')·z;  else prev = denoised (nothing drawn).",
        "i = timesteps.tolist().index(timestep); a = alphas_cumprod[timestep]; x0 = (sample - (1 - a) ** 0.5 * "
        "model_output) / a ** 0.5; cs, co = boundary_scalings(timestep, timestep_scaling); d = co * x0 + cs * sample; "
        "if i == len(timesteps) - 1: return d, d; an = alphas_cumprod[timesteps[i + 1]]; "
        "z = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype); "
        "return an ** 0.5 * d + (1 - an) ** 0.5 * z, d",
    ),
    answer_key=(f"{LCM}.step", f"{LCM}.get_scalings_for_boundary_condition_discrete"),
)

STEP_CASES = [
    dict(prediction_type="epsilon", n=4, shape=(2, 4, 8, 8)),  # 999, 759, 499, 259
    dict(prediction_type="v_prediction", n=3, T=500, N=40, shape=(3, 4, 8, 8)),
    # T = 100, s = 0.05: the boundary condition is far from the identity (c_skip(13) = 0.37).
    dict(prediction_type="sample", n=6, T=100, timestep_scaling=0.05, shape=(2, 3, 5, 7)),
    dict(prediction_type="epsilon", n=8, T=100, timestep_scaling=0.05, shape=(1, 4, 8, 8)),
    dict(prediction_type="epsilon", n=1, shape=(2, 4, 8, 8)),  # one step: no noise drawn at all
    dict(prediction_type="v_prediction", n=2, N=25, timestep_scaling=1.0, shape=(2, 4, 6, 6)),
]
STEP_HALF_CASES = [
    dict(prediction_type="epsilon", n=4, shape=(2, 4, 8, 8), dtype="float16"),
    dict(prediction_type="v_prediction", n=5, T=100, timestep_scaling=0.05, shape=(3, 4, 6, 6), dtype="float16"),
]


def _x0(out, x, a, prediction_type):
    if prediction_type == "epsilon":
        return (x - (1 - a) ** 0.5 * out) / a**0.5
    if prediction_type == "v_prediction":
        return a**0.5 * x - (1 - a) ** 0.5 * out
    return out


def step_scenarios(case, g):
    g = torch.Generator().manual_seed(seed_from(g))  # inputs independent of the global RNG (see lab 02)
    s = lcm(case)
    s.set_timesteps(case["n"])
    shape, dtype, kind = case["shape"], DTYPES[case.get("dtype", "float32")], case["prediction_type"]
    ladder = [int(t) for t in s.timesteps.tolist()]
    scenarios = []
    for i, t in enumerate(ladder):  # in order: the scheduler's step index advances with each call
        x0 = torch.randn(shape, generator=g)
        noise = torch.randn(shape, generator=g)
        tt = torch.tensor([t])
        x_t = s.add_noise(x0, noise, tt)
        target = {"epsilon": noise, "sample": x0, "v_prediction": s.get_velocity(x0, noise, tt)}[kind]
        model_output = (target + 0.1 * torch.randn(shape, generator=g)).to(dtype)
        x_t = x_t.to(dtype)
        seed = seed_from(g)
        drawn = torch.Generator().manual_seed(seed)
        ref = s.step(model_output.clone(), t, x_t.clone(), generator=drawn)
        # the shadow: the same step in float64, with the same draw z widened
        a = s.alphas_cumprod[t].double()
        c_skip, c_out = exact_scalings(t, s.config.timestep_scaling)
        denoised = c_out * _x0(model_output.double(), x_t.double(), a, kind) + c_skip * x_t.double()
        if i < len(ladder) - 1:
            z = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).double()
            an = s.alphas_cumprod[ladder[i + 1]].double()
            prev = an**0.5 * denoised + (1 - an) ** 0.5 * z
            arrow = f"t={t} → {ladder[i + 1]} (re-noised)"
        else:
            prev = denoised
            arrow = f"t={t}, the last step (no noise)"
        inputs = dict(model_output=model_output, timestep=t, sample=x_t, alphas_cumprod=s.alphas_cumprod.clone(),
                      timesteps=s.timesteps.clone(), generator=torch.Generator().manual_seed(seed),
                      prediction_type=kind, timestep_scaling=float(s.config.timestep_scaling))
        scenarios.append(Scenario(inputs=inputs, expected=(ref.prev_sample, ref.denoised), exact=(prev, denoised),
                                  label=f"step {i + 1}/{len(ladder)}, {arrow}", generators_after={"generator": drawn}))
    return scenarios


@lcm_step.check("vs LCMScheduler.step, every timestep", cases=STEP_CASES, tol=STEP_MATH)
def _(case, g):
    return step_scenarios(case, g)


@lcm_step.check("vs LCMScheduler.step, float16", cases=STEP_HALF_CASES, tol=HALF_STEP)
def _(case, g):
    return step_scenarios(case, g)


def wrong_lcm(model_output, timestep, sample, alphas_cumprod, timesteps, generator, prediction_type="epsilon",
              timestep_scaling=10.0, *, renoise_last=False, ddim_prev=False, swap=False, no_boundary=False,
              no_scaling=False, v_swap=""):
    """The LCM step with one misconception switched on (each trap below names one). It computes in diffusers'
    dtypes (0-dim float32 ᾱ times tensors of the model output's dtype), so where a misconception changes
    nothing it lands on diffusers' own rounding."""
    dtype = model_output.dtype
    ladder = [int(t) for t in timesteps.tolist()]
    i = ladder.index(int(timestep))
    a = alphas_cumprod[timestep]
    if prediction_type == "v_prediction" and v_swap == "coefficients":
        x0 = (1 - a) ** 0.5 * sample - a**0.5 * model_output
    elif prediction_type == "v_prediction" and v_swap == "sign":
        x0 = a**0.5 * sample + (1 - a) ** 0.5 * model_output
    elif prediction_type == "v_prediction" and v_swap == "roles":
        x0 = a**0.5 * model_output - (1 - a) ** 0.5 * sample
    else:
        x0 = _x0(model_output, sample, a, prediction_type)
    c_skip, c_out = _scalings(timestep, 1.0 if no_scaling else timestep_scaling, swap=swap)
    denoised = x0 if no_boundary else c_out * x0 + c_skip * sample
    last = i == len(ladder) - 1
    if last and not renoise_last:
        return denoised, denoised
    if ddim_prev:
        t_next = timestep - alphas_cumprod.shape[0] // len(ladder)
    else:
        t_next = timestep if last else ladder[i + 1]  # diffusers' prev_timestep at the last step is t itself
    a_next = alphas_cumprod[t_next] if t_next >= 0 else torch.tensor(1.0)
    z = torch.randn(model_output.shape, generator=generator, dtype=dtype)
    return a_next.sqrt() * denoised + (1 - a_next).sqrt() * z, denoised


def _step_trap(name, hint, **bug):
    @lcm_step.trap(name, hint=hint)
    def _(model_output, timestep, sample, alphas_cumprod, timesteps, generator, prediction_type="epsilon",
          timestep_scaling=10.0):
        return wrong_lcm(model_output, timestep, sample, alphas_cumprod, timesteps, generator, prediction_type,
                         timestep_scaling, **bug)


_step_trap("re-noised at the last step",
           "The last step returns the consistency output itself: prev_sample = denoised, and nothing is drawn "
           "from the generator (one-step LCM is deterministic).", renoise_last=True)
_step_trap("next timestep by DDIM's rule t − T//n",
           "LCM re-noises to the next entry of its own ladder (999 → 759 for n = 4), not to t − T/n.",
           ddim_prev=True)
_step_trap("c_skip and c_out swapped",
           "denoised = c_skip·x + c_out·x̂₀: c_skip (≈ 0 at noisy t) weighs the noisy sample, c_out (≈ 1) the "
           "model's estimate.", swap=True)
_step_trap("boundary condition skipped (denoised = x̂₀)",
           "The consistency output is c_skip·x + c_out·x̂₀, not x̂₀: near t = 0 (or with a small "
           "timestep_scaling) c_skip is far from 0.", no_boundary=True)
_step_trap("timestep_scaling forgotten in the boundary scalings",
           "c_skip and c_out take τ = timestep_scaling·t, not t.", no_scaling=True)
_step_trap("v-prediction's x̂₀ with √ᾱ and √(1 − ᾱ) swapped (√(1 − ᾱ)·x − √ᾱ·v)",
           "x_t = √ᾱ·x₀ + √(1 − ᾱ)·ε and v = √ᾱ·ε − √(1 − ᾱ)·x₀ give x̂₀ = √ᾱ·x_t − √(1 − ᾱ)·v.",
           v_swap="coefficients")
_step_trap("v-prediction's x̂₀ with the sign flipped (√ᾱ·x + √(1 − ᾱ)·v)",
           "x̂₀ = √ᾱ·x_t − √(1 − ᾱ)·v: v = √ᾱ·ε − √(1 − ᾱ)·x₀ carries −x₀, so it is subtracted.", v_swap="sign")
_step_trap("v-prediction's x̂₀ with x and v exchanged (√ᾱ·v − √(1 − ᾱ)·x)",
           "x̂₀ = √ᾱ·x_t − √(1 − ᾱ)·v: the sample takes √ᾱ, the model's v takes −√(1 − ᾱ).", v_swap="roles")


# ---- turbo_schedule ---------------------------------------------------------------------------------
turbo_schedule = Kata(
    "turbo_schedule",
    hints=(
        "Trailing spacing counts back from the end of training, so the first timestep is always T − 1 "
        "(999): a one-step model starts from pure noise. Read σ off the σ table there, and end with 0.",
        "t_j = round(T − j·T/n) − 1 for j = 0 … n − 1 (float32);  σ_j = √((1 − ᾱ)/ᾱ) at t_j;  "
        "sigmas = [σ_0, …, σ_{n−1}, 0].",
        "T = alphas_cumprod.shape[0]; t = torch.tensor([round(T - j * T / n) - 1 for j in range(n)], "
        "dtype=torch.float32); s = sigma_table(alphas_cumprod)[t.long()]; return t, torch.cat([s, s.new_zeros(1)])",
    ),
    answer_key=(f"{EULER}.set_timesteps",),
)

TURBO_CASES = [dict(n=n, T=1000) for n in (1, 2, 3, 4)] + [dict(n=3, T=700), dict(n=1, T=500), dict(n=6, T=1000)]


@turbo_schedule.check("vs EulerDiscreteScheduler(trailing).set_timesteps", cases=TURBO_CASES, tol=SIGMA)
def _(case, g):
    s = EulerDiscreteScheduler(num_train_timesteps=case["T"], **TURBO)
    with quiet_diffusers():
        s.set_timesteps(case["n"])
    abar = s.alphas_cumprod.clone()
    table = ((1 - abar.double()) / abar.double()) ** 0.5
    exact_sigmas = torch.cat([table[s.timesteps.long()], table.new_zeros(1)])
    return Scenario(inputs=dict(num_inference_steps=case["n"], alphas_cumprod=abar),
                    expected=(s.timesteps.clone(), s.sigmas.clone()), exact=(s.timesteps.double(), exact_sigmas),
                    label=f"T={case['T']}: timesteps {_short(s.timesteps.tolist())}")


def _turbo(timesteps, alphas_cumprod, *, ddpm_sigma=False, no_terminal=False):
    t = torch.tensor(timesteps, dtype=torch.float32)
    abar = alphas_cumprod.float()
    table = (1 - abar) ** 0.5 if ddpm_sigma else ((1 - abar) / abar) ** 0.5
    sigmas = table[t.long()]
    return t, (sigmas if no_terminal else torch.cat([sigmas, sigmas.new_zeros(1)]))


def _trailing(n, T):
    return [round(T - j * T / n) - 1 for j in range(n)]


@turbo_schedule.trap("leading spacing with steps_offset = 1 (one step sees t = 1)",
                     hint="SD-Turbo's scheduler uses trailing spacing: the first timestep is T − 1 = 999, pure "
                          "noise. Leading spacing gives (T//n)·j + 1, so one step would 'denoise' at t = 1.")
def _(num_inference_steps, alphas_cumprod):
    n, T = num_inference_steps, alphas_cumprod.shape[0]
    return _turbo([(T // n) * j + 1 for j in range(n)][::-1], alphas_cumprod)


@turbo_schedule.trap("linspace spacing (one step sees t = 0)",
                     hint="linspace(0, T − 1, n) at n = 1 is [0]: a clean image. Trailing spacing starts at T − 1 "
                          "and strides T/n down: round(T − j·T/n) − 1.")
def _(num_inference_steps, alphas_cumprod):
    n, T = num_inference_steps, alphas_cumprod.shape[0]
    return _turbo(torch.linspace(0, T - 1, n).round().flip(0).tolist(), alphas_cumprod)


@turbo_schedule.trap("t_j floored (int(T − j·T/n) − 1), not rounded",
                     hint="diffusers rounds the trailing grid: np.round(np.arange(T, 0, −T/n)) − 1 (n = 3: 999, 666, "
                          "332, where flooring gives 999, 665, 332).")
def _(num_inference_steps, alphas_cumprod):
    n, T = num_inference_steps, alphas_cumprod.shape[0]
    return _turbo([int(T - j * T / n) - 1 for j in range(n)], alphas_cumprod)


@turbo_schedule.trap("no terminal σ = 0 (n sigmas instead of n + 1)",
                     hint="Append σ = 0: the last Euler step lands on the clean latent.")
def _(num_inference_steps, alphas_cumprod):
    return _turbo(_trailing(num_inference_steps, alphas_cumprod.shape[0]), alphas_cumprod, no_terminal=True)


@turbo_schedule.trap("the σ ladder ended with σ_min (the table's σ at t = 0) instead of 0",
                     hint="SD-Turbo's Euler ends at σ = 0 (final_sigmas_type='zero'): the last step lands on the "
                          "clean sample. Ending at σ_min leaves it slightly noisy.")
def _(num_inference_steps, alphas_cumprod):
    t, sigmas = _turbo(_trailing(num_inference_steps, len(alphas_cumprod)), alphas_cumprod)
    abar = alphas_cumprod[0].float()
    return t, torch.cat([sigmas[:-1], ((1 - abar) / abar).sqrt().reshape(1)])


@turbo_schedule.trap("DDPM's σ = √(1 − ᾱ) instead of Euler's √((1 − ᾱ)/ᾱ)",
                     hint="Euler walks the variance-exploding σ = √((1 − ᾱ)/ᾱ) (14.6 at t = 999), the noise "
                          "scale of x_t/√ᾱ_t (sigma_table).")
def _(num_inference_steps, alphas_cumprod):
    return _turbo(_trailing(num_inference_steps, alphas_cumprod.shape[0]), alphas_cumprod, ddpm_sigma=True)


# ---- few_step_sample --------------------------------------------------------------------------------
few_step_sample = Kata(
    "few_step_sample",
    hints=(
        "It is the pipeline's loop with the scheduler doing the schedule-specific work: set its timesteps, "
        "start from latents·init_noise_sigma, scale each UNet input, and step with the generator. Guide only "
        "when guidance_scale > 1: below that, one UNet call per step on the prompt alone.",
        "set_timesteps(n); x = latents·init_noise_sigma; for t: ε = unet(scale_model_input(x, t), t, "
        "encoder_hidden_states=prompt_embeds).sample (s > 1: a batch [x, x] with [negative, prompt], "
        "ε = ε_u + s·(ε_c − ε_u)); x = step(ε, t, x, generator=generator).prev_sample. Under torch.no_grad().",
        "scheduler.set_timesteps(num_inference_steps); x = latents * scheduler.init_noise_sigma; "
        "with torch.no_grad(): for t in scheduler.timesteps: eps = unet(scheduler.scale_model_input(x, t), t, "
        "encoder_hidden_states=prompt_embeds).sample; x = scheduler.step(eps, t, x, generator=generator)"
        ".prev_sample  (guidance_scale > 1: cat([x, x]) and cat([negative_prompt_embeds, prompt_embeds]), chunk(2))",
    ),
    answer_key=(PIPELINE,),
)

SCHEDULERS = {"SD-Turbo Euler (trailing)": lambda: EulerDiscreteScheduler(**TURBO),
              "LCMScheduler": lambda: LCMScheduler(**SD_BETAS)}
LOOP_CASES = [
    dict(scheduler="SD-Turbo Euler (trailing)", guidance_scale=0.0, steps=1, batch=2),  # SD-Turbo's call
    dict(scheduler="SD-Turbo Euler (trailing)", guidance_scale=0.0, steps=4, batch=1),
    dict(scheduler="SD-Turbo Euler (trailing)", guidance_scale=1.0, steps=2, batch=2),
    dict(scheduler="LCMScheduler", guidance_scale=1.0, steps=4, batch=2),  # LCM-LoRA's call
    dict(scheduler="LCMScheduler", guidance_scale=0.0, steps=1, batch=1),
    dict(scheduler="LCMScheduler", guidance_scale=1.5, steps=3, batch=2, size=16),  # guides: one batch of 2B
]


def loop_scenario(case: dict, g) -> Scenario:
    unet = tiny.unet_cond(sample_size=case.get("size", 8)).requires_grad_(False)
    B, size = case["batch"], case.get("size", 8)
    prompt, negative = tiny.text_embeddings(B, g), tiny.text_embeddings(B, g)
    latents = torch.randn((B, tiny.LATENT_CHANNELS, size, size), generator=g)
    seed = seed_from(g)
    with quiet_diffusers():
        pipe = tiny.sd_pipeline(SCHEDULERS[case["scheduler"]](), unet, tiny.vae())
    drawn = torch.Generator().manual_seed(seed)
    with torch.no_grad(), quiet_diffusers(), PipelineRecorder(pipe, unet) as recorded:
        expected = pipe(prompt_embeds=prompt.clone(), negative_prompt_embeds=negative.clone(),
                        guidance_scale=case["guidance_scale"], num_inference_steps=case["steps"], generator=drawn,
                        latents=latents.clone(), output_type="latent").images
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)  # fresh, as the pipeline's was
    probe = TrajectoryProbe(unet, label=COUNTED_UNET)
    inputs = dict(unet=probe, scheduler=scheduler, latents=latents,
                  prompt_embeds=prompt, negative_prompt_embeds=negative, guidance_scale=case["guidance_scale"],
                  num_inference_steps=case["steps"], generator=torch.Generator().manual_seed(seed))
    with quiet_diffusers():
        pipe.scheduler.set_timesteps(case["steps"])
    label = (f"{case['scheduler']}, guidance_scale={case['guidance_scale']}, {case['steps']} step(s) at t = "
             f"{_short([int(t) for t in pipe.scheduler.timesteps.tolist()])}, batch {B}")
    return Scenario(inputs=inputs, expected=expected, label=label, generators_after={"generator": drawn},
                    on_mismatch=localizer(probe, recorded.steps))


@few_step_sample.check("vs StableDiffusionPipeline(guidance_scale ≤ 1.5), latents", cases=LOOP_CASES,
                       tol=MODEL_FORWARD)
def _(case, g):
    return loop_scenario(case, g)


def wrong_loop(unet, scheduler, latents, prompt_embeds, negative_prompt_embeds, guidance_scale, num_inference_steps,
               generator, *, always_guide=False, never_guide=False, no_init_sigma=False, no_scale_input=False,
               no_generator=False):
    """The loop with one misconception switched on (each trap below names one)."""
    guide = (guidance_scale > 1 or always_guide) and not never_guide
    with quiet_diffusers():
        scheduler.set_timesteps(num_inference_steps)
    x = latents if no_init_sigma else latents * scheduler.init_noise_sigma
    text = torch.cat([negative_prompt_embeds, prompt_embeds]) if guide else prompt_embeds
    with torch.no_grad():
        for t in scheduler.timesteps:
            x_in = torch.cat([x, x]) if guide else x
            if not no_scale_input:
                x_in = scheduler.scale_model_input(x_in, t)
            eps = unet(x_in, t, encoder_hidden_states=text).sample
            if guide:
                u, c = eps.chunk(2)
                eps = u + guidance_scale * (c - u)
            x = scheduler.step(eps, t, x, generator=None if no_generator else generator).prev_sample
    return x


def _loop_trap(name, hint, **bug):
    @few_step_sample.trap(name, hint=hint)
    def _(unet, scheduler, latents, prompt_embeds, negative_prompt_embeds, guidance_scale, num_inference_steps,
          generator):
        return wrong_loop(unet, scheduler, latents, prompt_embeds, negative_prompt_embeds, guidance_scale,
                          num_inference_steps, generator, **bug)


_loop_trap("guidance applied at guidance_scale ≤ 1 (at 0 that is the unconditional prediction)",
           "The pipeline guides only when guidance_scale > 1. At 0, ε_u + 0·(ε_c − ε_u) = ε_u ignores the prompt, "
           "and the doubled batch costs two forwards a step: call the UNet once, on prompt_embeds alone.",
           always_guide=True)
_loop_trap("guidance never applied (the text prediction alone at guidance_scale > 1)",
           "Above 1 the pipeline does guide: one batch [x, x] with [negative, prompt], ε_u + s·(ε_c − ε_u).",
           never_guide=True)
_loop_trap("initial latents not scaled by init_noise_sigma",
           "The pipeline starts from latents·scheduler.init_noise_sigma: σ_max = 14.6 for SD-Turbo's Euler "
           "(trailing), 1 for LCM.", no_init_sigma=True)
_loop_trap("generator not passed to scheduler.step (LCM re-noises from the global RNG)",
           "LCMScheduler.step draws the noise it re-noises with between steps: pass generator=generator, as the "
           "pipeline does, or the draws come from torch's global RNG and no seed reproduces the image.",
           no_generator=True)
_loop_trap("UNet input not scaled (scale_model_input skipped)",
           "Euler feeds the UNet x/√(σ² + 1): call scheduler.scale_model_input(x, t) on every UNet input (LCM's "
           "returns x unchanged, so use it always).", no_scale_input=True)


# ---- budget -----------------------------------------------------------------------------------------
@few_step_sample.budget("one UNet call per step, batch B (no CFG batch at guidance ≤ 1)")
def _(learner, g):
    runs = [("SD-Turbo Euler (trailing)", 0.0, 1), ("LCMScheduler", 1.0, 4)]
    B, calls, steps, largest, doubled = 2, 0, 0, 0, False
    for name, scale, n in runs:
        scheduler = SCHEDULERS[name]()
        counter = DenoiserProbe(tiny.unet_cond().requires_grad_(False), label=COUNTED_UNET)
        learner(unet=counter, scheduler=scheduler, latents=torch.randn((B, tiny.LATENT_CHANNELS, 8, 8), generator=g),
                prompt_embeds=tiny.text_embeddings(B, g), negative_prompt_embeds=tiny.text_embeddings(B, g),
                guidance_scale=scale, num_inference_steps=n, generator=torch.Generator().manual_seed(seed_from(g)))
        calls, steps = calls + counter.calls, steps + n
        largest = max([largest, *counter.batch_sizes])
        doubled = doubled or (scale == 1.0 and set(counter.batch_sizes) == {2 * B})
    return [
        Measurement(f"UNet calls over {steps} steps (SD-Turbo 1 step at s = 0, LCM 4 steps at s = 1)", calls, steps,
                    "calls", "one forward per step: a distilled model's whole cost is its step count"),
        Measurement("largest batch the UNet saw", largest, B, "",
                    f"the batch of B = {B}: at guidance_scale ≤ 1 there is no unconditional half to run",
                    trap=("the CFG batch run at guidance_scale = 1 (guidance switched on at s ≥ 1)",
                          "ε_u + 1·(ε_c − ε_u) = ε_c: at a scale of 1 the unconditional half changes nothing, so the "
                          "pipeline guides only when guidance_scale > 1.") if doubled else None),
    ]
