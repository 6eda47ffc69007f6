"""Grader for lab 02 · Denoising step: x̂0 from each prediction type, one DDIM step, one DDPM step.

Imports only the DDIM and DDPM scheduler modules: grading this lab never loads diffusers' models.

Every step check runs over EVERY timestep of the schedule, one Scenario per step, labelled
"t=981 → 961". Each step gets fresh random inputs rather than the reference's own trajectory: a
trajectory driven by a random "model" is no more realistic, and with independent steps a failure is
reported at the step that is wrong (the last step, say) instead of surfacing later as drift. The
inputs are still consistent with t: x_t = √ᾱ_t·x_0 + √(1−ᾱ_t)·ε with x_0 ~ N(0, 1), and the model
output is the true target (ε, v or x_0) plus 0.1·N(0, 1), an imperfect model. So x̂_0 leaves [−1, 1]
about as often as in a real run and clipping is exercised at every noise level.

Precision: every scenario also carries the float64 shadow of diffusers' answer (Scenario.exact):
diffusers' own step run by a float64 twin of the scheduler (helpers.float64_twin) on the same inputs,
widened, with the same noise draw z. An answer at most 2× as far from it as diffusers' own (+ 2 ulps)
passes: float64 or Python-float coefficients, float16 computed in float32 and cast. That matters where
diffusers' rounding is large: β_t = 1 − ᾱ_t/ᾱ_prev in float32 at T=25, t=1 → 0 (2.8e-5 relative), and
float16 x̂_0 at t=999, where dividing by √ᾱ_t ≈ 0.068 multiplies float16 rounding by 14.6.
"""
import torch
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusion_katas.engine.comparison import matches
from diffusion_katas.engine.isolation import fresh
from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import HALF_STEP, STEP_MATH, Tol, for_dtype
from diffusion_katas.engine.helpers import DTYPES, SCHEDULERS, SD_BETAS, float64_twin, sd_schedule, seed_from

SCHEDULES = {
    "sd": SD_BETAS,  # Stable Diffusion
    "ddpm": dict(beta_schedule="linear", beta_start=0.0001, beta_end=0.02),  # the DDPM paper
    "zsnr": sd_schedule(rescale_betas_zero_snr=True),  # ᾱ_{T−1} = 0 exactly: v-prediction only
}


def scheduler(cls, case: dict, **kw):
    return cls(num_train_timesteps=case.get("T", 1000), **SCHEDULES[case.get("schedule", "sd")],
               prediction_type=case.get("prediction_type", "epsilon"), **kw)


# Inputs and the global RNG: the plugin seeds the global RNG and `g` with the same number, so a learner
# who draws from the global RNG (no generator=) would redraw the grader's first input tensor exactly.
# The step checks draw their inputs from a generator seeded *from* g instead, so such a draw is
# independent noise, as it would be in a real pipeline.


def step_inputs(s, t: int, case: dict, g: torch.Generator):
    """(model_output, x_t) at timestep t: x_t at the right noise level, an imperfect model's output."""
    shape, dtype = case["shape"], DTYPES[case.get("dtype", "float32")]
    x0 = torch.randn(shape, generator=g)
    noise = torch.randn(shape, generator=g)
    tt = torch.tensor([t])
    x_t = s.add_noise(x0, noise, tt)
    target = {"epsilon": noise, "sample": x0,
              "v_prediction": s.get_velocity(x0, noise, tt)}[s.config.prediction_type]
    model_output = target + 0.1 * torch.randn(shape, generator=g)
    return model_output.to(dtype), x_t.to(dtype)


def arrow(t: int, prev: int, set_alpha_to_one: bool = True) -> str:
    end = "ᾱ_prev = 1" if set_alpha_to_one else "set_alpha_to_one=False: ᾱ_prev = ᾱ_0"
    return f"t={t} → {prev}" + (f" (past the start: {end})" if prev < 0 else "")


def threshold_config(case: dict) -> dict:
    """The scheduler's dynamic-thresholding config for a case (off unless the case says so)."""
    return dict(thresholding=case.get("thresholding", False), dynamic_thresholding_ratio=case.get("ratio", 0.995),
                sample_max_value=case.get("max_value", 1.0))


def threshold_inputs(case: dict) -> dict:
    """The same options as the learner's keyword arguments."""
    return {k: v for k, v in threshold_config(case).items()}


# The `verify` of a step scenario does two things the plugin's trap matching cannot (yet):
#
# 1. Name "noise not from `generator`": that wrong draw is not reproducible, so no trap function can
#    match it. Every formula mistake in a step (a wrong stride, ᾱ where √ᾱ belongs, a missing σ² in
#    the direction term, σ² for σ, no clipping) only changes the per-step scalar coefficients of
#    x̂_0 (clipped), x_t and the model output; a wrong draw is independent of all three. So take the
#    learner's output minus the reference's noiseless mean, divide by σ, project x̂_0, x_t, the model
#    output and a constant out of it and out of the right draw z, and compare what is left: the
#    right noise (whatever its scale) correlates ~1 with z; another draw correlates ~0 (one draw
#    of shape (C, H, W) broadcast over a batch of 2: ~0.7). Named when the correlation is < 0.9 and
#    the leftover has the size of unit noise (std 0.7-1.4); anything else goes on to the ordinary
#    comparison and traps (the lab's mutant tests check that no trap is misnamed).
# 2. Name a trap whose output is NaN where the learner's is NaN: ᾱ_prev read at a negative index makes
#    1 − ᾱ_t/ᾱ_prev negative under DDIM's square root, so the learner's output is NaN at the last
#    step, and comparison.matches never counts NaN as equal to NaN.
def step_verify(kata: Kata, inputs: dict, expected: torch.Tensor, tol: Tol, std: float = 0.0,
                z: torch.Tensor | None = None, x0: torch.Tensor | None = None):
    tol = for_dtype(tol, expected.dtype)

    def leftover(v: torch.Tensor) -> torch.Tensor:
        basis = torch.stack([x0.double().flatten(), inputs["sample"].double().flatten(),
                             inputs["model_output"].double().flatten(),
                             torch.ones(v.numel(), dtype=torch.float64)], 1)
        coef = torch.linalg.lstsq(basis, v.unsqueeze(1)).solution
        return v - (basis @ coef).squeeze(1)

    def verify(out):
        if type(out) is not torch.Tensor or out.shape != expected.shape:
            return
        bad = ~torch.isfinite(out)
        if bad.any() and torch.isfinite(expected).all():
            for trap in kata.traps:
                try:
                    wrong = trap.fn(**fresh(inputs))
                except Exception:
                    continue
                if (type(wrong) is torch.Tensor and wrong.shape == out.shape
                        and torch.equal(bad, ~torch.isfinite(wrong))
                        and matches(torch.where(bad, 0, out), torch.where(bad, 0, wrong), tol)):
                    raise KataFailure(
                        f"  output has {int(bad.sum())} non-finite value(s) (nan/inf) where the reference "
                        f"is finite\n  trap: {trap.name}\n    {trap.hint}")
            return
        if z is None or std < 1e-2 or bad.any():
            return
        mean = expected.double().flatten() - std * z.double().flatten()
        n = leftover((out.detach().double().flatten() - mean) / std)
        right = leftover(z.double().flatten())
        if not 0.7 < float(n.std()) < 1.4:
            return
        if float(torch.corrcoef(torch.stack([n, right]))[0, 1]) < 0.9:
            raise KataFailure(
                f"  the step adds noise of the right size (σ_t = {std:.4g}), but not the noise diffusers "
                "draws from the generator you were given\n"
                "  trap: noise not drawn from `generator` (or drawn in another shape, dtype or order)\n"
                "    Draw exactly once per step: torch.randn(model_output.shape, generator=generator, "
                "dtype=model_output.dtype). Without generator= the global RNG is used and the run is "
                "not reproducible.")

    return verify


# Every route to a step: any scheduler's own step (the "Parallel" and "Ancestral" siblings, DDIMInverse...), the
# batched step of the parallel ones, the variance helpers, and x̂_0 as the multistep solvers convert it.
STEP_FAMILY = (f"{SCHEDULERS}:*Scheduler*.step", f"{SCHEDULERS}:*Scheduler*.batch_step_no_noise",
               f"{SCHEDULERS}:*Scheduler*._get_variance", f"{SCHEDULERS}:*Scheduler*._batch_get_variance",
               f"{SCHEDULERS}:*Scheduler*.convert_model_output",
               # and the pipelines that predict x̂_0 or ε themselves (Self-Attention Guidance's pred_x0, pred_epsilon)
               "diffusers.pipelines.**:*.pred_x0", "diffusers.pipelines.**:*.pred_epsilon")


# ---- predict_x0 ------------------------------------------------------------------------------------------
predict_x0 = Kata(
    "predict_x0",
    hints=(
        "The model output is a prediction about x_t, not pixels. Invert x_t = √ᾱ·x_0 + √(1 − ᾱ)·ε "
        "for x_0, using whichever quantity prediction_type says the model predicted.",
        "epsilon: (x_t − √(1 − ᾱ_t)·ε̂)/√ᾱ_t;  v_prediction: √ᾱ_t·x_t − √(1 − ᾱ_t)·v;  sample: the output itself.",
        "b = 1 - alpha_prod_t; epsilon: return (sample - b ** 0.5 * model_output) / alpha_prod_t ** 0.5; "
        "v_prediction: return alpha_prod_t ** 0.5 * sample - b ** 0.5 * model_output; sample: return model_output",
    ),
    answer_key=("diffusers.schedulers.scheduling_ddim.DDIMScheduler.step",
                "diffusers.schedulers.scheduling_ddpm.DDPMScheduler.step", *STEP_FAMILY),
)

X0_CASES = [
    dict(prediction_type="epsilon", shape=(4, 4, 8, 8)),
    dict(prediction_type="v_prediction", shape=(2, 3, 16, 16), schedule="ddpm"),
    dict(prediction_type="sample", shape=(2, 4, 8, 8)),
    dict(prediction_type="v_prediction", shape=(2, 4, 8, 8), schedule="zsnr"),  # ᾱ_{T−1} = 0: x̂_0 = −v
    dict(prediction_type="epsilon", shape=(2, 4, 8, 8), dtype="float16"),
    dict(prediction_type="v_prediction", shape=(3, 4, 8, 8), dtype="float16"),
]


@predict_x0.check("vs DDIM pred_original_sample", cases=X0_CASES, tol=STEP_MATH)
def _(case, g):
    s = scheduler(DDIMScheduler, case, clip_sample=False)
    s.set_timesteps(10)  # step() needs it; pred_original_sample does not depend on the stride
    s64 = float64_twin(s)
    T = s.config.num_train_timesteps
    # the edges T−1 and 0 and two random timesteps, noisiest first as a sampler visits them
    ts = sorted([0, T - 1] + torch.randint(1, T - 1, (2,), generator=g).tolist(), reverse=True)
    scenarios = []
    for t in ts:
        model_output, x_t = step_inputs(s, t, case, g)
        a = s.alphas_cumprod[t].clone()
        expected = s.step(model_output.clone(), t, x_t.clone()).pred_original_sample
        exact = s64.step(model_output.double(), t, x_t.double()).pred_original_sample
        scenarios.append(Scenario(
            inputs=dict(model_output=model_output, sample=x_t, alpha_prod_t=a,
                        prediction_type=case["prediction_type"]),
            expected=expected, exact=exact, label=f"t={t} (ᾱ_t = {float(a):.4g})"))
    return scenarios


@predict_x0.trap("the model output taken as x̂0 (the model predicts noise, not pixels)",
                 hint="With prediction_type='epsilon' the output is the noise ε̂ in x_t; solve "
                      "x_t = √ᾱ·x_0 + √(1−ᾱ)·ε̂ for x_0.")
def _(model_output, sample, alpha_prod_t, prediction_type):
    return model_output.clone()


@predict_x0.trap("x̂0 clamped to [−1, 1] (clip_sample is the step's business, after this)",
                 hint="predict_x0 returns the model's estimate as it is: the scheduler clips (clip_sample) or "
                      "thresholds it afterwards, inside step, and only when its config says so.")
def _(model_output, sample, alpha_prod_t, prediction_type):
    x0, _ = _x0_eps(model_output.double(), sample.double(), alpha_prod_t.double(), prediction_type)
    return x0.clamp(-1, 1).to(model_output.dtype)


@predict_x0.trap("ᾱ_t used where √ᾱ_t belongs",
                 hint="x_t = √ᾱ_t·x_0 + √(1−ᾱ_t)·ε: the coefficients are square roots of ᾱ_t and 1 − ᾱ_t.")
def _(model_output, sample, alpha_prod_t, prediction_type):
    a = alpha_prod_t
    if prediction_type == "v_prediction":
        return a * sample - (1 - a) * model_output
    if prediction_type == "sample":
        return model_output.clone()
    return (sample - (1 - a) * model_output) / a


@predict_x0.trap("v treated as ε (the epsilon formula used for v_prediction)",
                 hint="v = √ᾱ·ε − √(1−ᾱ)·x_0 is not the noise: x̂_0 = √ᾱ_t·x_t − √(1−ᾱ_t)·v, no division.")
def _(model_output, sample, alpha_prod_t, prediction_type):
    if prediction_type == "sample":
        return model_output.clone()
    return (sample - (1 - alpha_prod_t) ** 0.5 * model_output) / alpha_prod_t**0.5


def _x0_with(model_output, sample, a, prediction_type, *, eps=None, v=None):
    """predict_x0 with its ε or v branch replaced by a mistake (the traps below): eps(a), v(a) give x̂0."""
    if prediction_type == "sample":
        return model_output.clone()
    if prediction_type == "v_prediction":
        return v(a) if v is not None else a**0.5 * sample - (1 - a) ** 0.5 * model_output
    return eps(a) if eps is not None else (sample - (1 - a) ** 0.5 * model_output) / a**0.5


@predict_x0.trap("v_prediction: √ᾱ·v + √(1−ᾱ)·x_t, which is ε̂, not x̂0",
                 hint="From v, x̂_0 = √ᾱ_t·x_t − √(1−ᾱ_t)·v; the other rotation, √ᾱ·v + √(1−ᾱ)·x_t, gives ε̂.")
def _(model_output, sample, alpha_prod_t, prediction_type):
    return _x0_with(model_output, sample, alpha_prod_t, prediction_type,
                    v=lambda a: a**0.5 * model_output + (1 - a) ** 0.5 * sample)


@predict_x0.trap("epsilon: divided by ᾱ_t instead of √ᾱ_t",
                 hint="x_t − √(1−ᾱ_t)·ε̂ is √ᾱ_t·x_0: divide by √ᾱ_t (dividing by ᾱ_t overshoots by 1/√ᾱ_t).")
def _(model_output, sample, alpha_prod_t, prediction_type):
    return _x0_with(model_output, sample, alpha_prod_t, prediction_type,
                    eps=lambda a: (sample - (1 - a) ** 0.5 * model_output) / a)


@predict_x0.trap("v_prediction with the sign flipped: √ᾱ·x_t + √(1−ᾱ)·v",
                 hint="x̂_0 = √ᾱ_t·x_t − √(1−ᾱ_t)·v: v = √ᾱ·ε − √(1−ᾱ)·x_0 carries −x_0, so it is subtracted.")
def _(model_output, sample, alpha_prod_t, prediction_type):
    return _x0_with(model_output, sample, alpha_prod_t, prediction_type,
                    v=lambda a: a**0.5 * sample + (1 - a) ** 0.5 * model_output)


@predict_x0.trap("epsilon: x_t − √(1−ᾱ)·ε̂ without dividing by √ᾱ_t",
                 hint="Removing the noise leaves √ᾱ_t·x_0: divide by √ᾱ_t to get x_0.")
def _(model_output, sample, alpha_prod_t, prediction_type):
    return _x0_with(model_output, sample, alpha_prod_t, prediction_type,
                    eps=lambda a: sample - (1 - a) ** 0.5 * model_output)


# ---- dynamic_threshold -----------------------------------------------------------------------------------
dynamic_threshold = Kata(
    "dynamic_threshold",
    hints=(
        "One threshold per sample: a high quantile of that sample's absolute values, never below 1 and "
        "never above sample_max_value. Clamp the sample to ±threshold, then divide by it.",
        "flatten to (B, C·H·W); s = quantile(|x|, ratio, dim=1) clamped to [1, sample_max_value]; "
        "x ← clamp(x, −s, s)/s per row; reshape back, cast to the input dtype (quantile needs float32).",
        "flat = x.reshape(x.shape[0], -1).float(); s = torch.quantile(flat.abs(), dynamic_thresholding_ratio, "
        "dim=1).clamp(min=1, max=sample_max_value).unsqueeze(1); "
        "return (torch.clamp(flat, -s, s) / s).reshape(x.shape).to(x.dtype)",
    ),
    answer_key=("diffusers.schedulers.scheduling_ddpm.DDPMScheduler._threshold_sample",
                "diffusers.schedulers.scheduling_ddim.DDIMScheduler._threshold_sample",
                f"{SCHEDULERS}:*Scheduler*._threshold_sample", *STEP_FAMILY),
)

# Each sample gets its own spread (`scales`): a quiet one whose quantile is below 1 (the floor at 1
# shows), a loud one whose quantile passes sample_max_value (the ceiling shows), so one threshold for
# the whole batch, a missing floor or ceiling and a missing division each change the answer.
THRESHOLD_CASES = [
    dict(shape=(3, 4, 8, 8), dtype="float32", ratio=0.995, max_value=1.5, scales=(0.3, 0.55, 2.0)),
    dict(shape=(2, 3, 5, 7), dtype="float32", ratio=0.9, max_value=3.0, scales=(1.5, 0.8)),
    dict(shape=(4, 1, 6, 6), dtype="float32", ratio=0.5, max_value=1.0, scales=(0.5, 1.0, 2.0, 4.0)),
    dict(shape=(2, 4, 8, 8), dtype="float16", ratio=0.995, max_value=2.0, scales=(0.6, 1.2)),
]


@dynamic_threshold.check("vs DDPMScheduler._threshold_sample", cases=THRESHOLD_CASES, tol=STEP_MATH)
def _(case, g):
    dtype = DTYPES[case["dtype"]]
    s = DDPMScheduler(thresholding=True, dynamic_thresholding_ratio=case["ratio"],
                      sample_max_value=case["max_value"])
    scales = torch.tensor(case["scales"]).view(-1, *[1] * (len(case["shape"]) - 1))
    x = (torch.randn(case["shape"], generator=g) * scales).to(dtype)
    expected = s._threshold_sample(x.clone())
    exact = s._threshold_sample(x.double())  # the same code in float64
    q = torch.quantile(x.float().abs().reshape(x.shape[0], -1), case["ratio"], dim=1)
    return Scenario(inputs=dict(pred_original_sample=x, dynamic_thresholding_ratio=case["ratio"],
                                sample_max_value=case["max_value"]),
                    expected=expected, exact=exact,
                    label=f"per-sample quantiles {[round(v, 3) for v in q.tolist()]}, max {case['max_value']}")


def wrong_threshold(pred_original_sample, dynamic_thresholding_ratio=0.995, sample_max_value=1.0, *,
                    one_for_batch=False, no_floor=False, no_ceiling=False, no_divide=False, signed=False):
    """Dynamic thresholding with one misconception switched on (each trap below names one)."""
    x = pred_original_sample
    flat = x.reshape(1 if one_for_batch else x.shape[0], -1).to(torch.float32)
    s = torch.quantile(flat if signed else flat.abs(), dynamic_thresholding_ratio, dim=1)
    s = torch.clamp(s, min=None if no_floor else 1, max=None if no_ceiling else sample_max_value).unsqueeze(1)
    out = torch.clamp(flat, -s, s)
    return (out if no_divide else out / s).reshape(x.shape).to(x.dtype)


@dynamic_threshold.trap("one threshold for the whole batch",
                        hint="Each sample gets its own s: reshape to (B, C·H·W) and take the quantile along dim=1.")
def _(**kw):
    return wrong_threshold(**kw, one_for_batch=True)


@dynamic_threshold.trap("s not floored at 1 (a quiet sample is blown up to ±1)",
                        hint="Clamp s to [1, sample_max_value]: with s = 1 the step is plain clipping; a sample "
                             "whose values are all small must stay as it is.")
def _(**kw):
    return wrong_threshold(**kw, no_floor=True)


@dynamic_threshold.trap("s not capped at sample_max_value",
                        hint="s = clamp(quantile, min=1, max=sample_max_value): the ceiling bounds the rescale.")
def _(**kw):
    return wrong_threshold(**kw, no_ceiling=True)


@dynamic_threshold.trap("clamped to [−s, s] but not divided by s",
                        hint="Imagen's thresholding rescales too: clamp(x, −s, s) / s lies in [−1, 1].")
def _(**kw):
    return wrong_threshold(**kw, no_divide=True)


@dynamic_threshold.trap("the quantile of x̂0 instead of |x̂0|",
                        hint="The threshold is a quantile of the absolute values, so it bounds both signs.")
def _(**kw):
    return wrong_threshold(**kw, signed=True)


# ---- ddim_step -------------------------------------------------------------------------------------------
ddim_step = Kata(
    "ddim_step",
    hints=(
        "Get x̂_0 and ε̂ from the prediction, clip x̂_0, then rebuild a sample at the previous noise "
        "level: √ᾱ_prev·x̂_0 + (what is left of the noise budget)·ε̂ + σ·z. The previous timestep is "
        "T//n earlier, and ᾱ is 1 before the start of the table.",
        "prev_t = t − T//n; ᾱ_prev = ᾱ[prev_t] if prev_t ≥ 0 else 1; σ = η·√((1−ᾱ_prev)/(1−ᾱ_t)·(1−ᾱ_t/ᾱ_prev)); "
        "x_prev = √ᾱ_prev·clip(x̂_0) + √(1−ᾱ_prev−σ²)·ε̂ + σ·z, with ε̂ from the unclipped prediction "
        "and z drawn only when η > 0.",
        "prev = timestep - alphas_cumprod.shape[0] // num_inference_steps; a = alphas_cumprod[timestep]; "
        "ap = alphas_cumprod[prev] if prev >= 0 else torch.tensor(1.0); x0 = predict_x0(...); "
        "eps = predict_epsilon(...); if clip_sample: x0 = x0.clamp(-1, 1); "
        "std = eta * ((1 - ap) / (1 - a) * (1 - a / ap)) ** 0.5; "
        "out = ap ** 0.5 * x0 + (1 - ap - std ** 2) ** 0.5 * eps; if eta > 0: out = out + std * "
        "torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)",
    ),
    answer_key=("diffusers.schedulers.scheduling_ddim.DDIMScheduler.step",
                "diffusers.schedulers.scheduling_ddim.DDIMScheduler._get_variance", *STEP_FAMILY),
)

DDIM_CASES = [
    dict(prediction_type="epsilon", eta=0.0, clip_sample=True, n=10, shape=(2, 4, 8, 8)),
    dict(prediction_type="epsilon", eta=0.0, clip_sample=False, n=10, steps_offset=1, shape=(1, 4, 16, 16)),
    # trailing at n=7: 999, 856, …, 142, but the stride is 1000//7 = 142, so 999 → 857, and 142 → 0.
    dict(prediction_type="epsilon", eta=1.0, clip_sample=True, n=7, spacing="trailing", shape=(2, 3, 8, 8)),
    dict(prediction_type="v_prediction", eta=0.5, clip_sample=False, n=10, spacing="trailing",
         schedule="zsnr", shape=(2, 4, 8, 8)),
    dict(prediction_type="sample", eta=0.3, clip_sample=True, n=10, spacing="linspace", shape=(2, 4, 8, 8)),
    dict(prediction_type="v_prediction", eta=0.0, clip_sample=True, n=20, schedule="ddpm", shape=(2, 4, 8, 8)),
    # T = 500 (a hard-coded 1000 fails), and C·H·W = 105, not a multiple of 16: one draw per sample then
    # differs from one draw for the batch, so η > 0 shows which the step does.
    dict(prediction_type="epsilon", eta=0.7, clip_sample=False, n=9, T=500, shape=(3, 3, 5, 7)),
    # set_alpha_to_one=False: the last step lands on ᾱ_0, not 1 (Stable Diffusion 1.x's own config)
    dict(prediction_type="epsilon", eta=0.0, clip_sample=True, n=10, set_alpha_to_one=False, shape=(2, 4, 8, 8)),
    # dynamic thresholding (it replaces clip_sample=True): one quantile per sample of |x̂_0|
    dict(prediction_type="sample", eta=0.5, clip_sample=True, n=8, thresholding=True, ratio=0.9,
         max_value=2.0, spacing="trailing", shape=(3, 4, 8, 8)),
    dict(prediction_type="epsilon", eta=0.0, clip_sample=False, n=10, thresholding=True, ratio=0.995,
         max_value=1.5, schedule="ddpm", set_alpha_to_one=False, shape=(2, 3, 8, 8)),
]
DDIM_HALF_CASES = [
    dict(prediction_type="epsilon", eta=1.0, clip_sample=True, n=8, shape=(2, 4, 8, 8), dtype="float16"),
    dict(prediction_type="v_prediction", eta=0.0, clip_sample=False, n=10, spacing="trailing", T=400,
         shape=(3, 4, 5, 6), dtype="float16"),
    dict(prediction_type="epsilon", eta=0.5, clip_sample=True, n=6, set_alpha_to_one=False, thresholding=True,
         ratio=0.95, max_value=1.8, shape=(2, 4, 8, 8), dtype="float16"),
]


def ddim_scenarios(case, g, tol):
    g = torch.Generator().manual_seed(seed_from(g))  # see 'Inputs and the global RNG'
    s = scheduler(DDIMScheduler, case, clip_sample=case["clip_sample"],
                  timestep_spacing=case.get("spacing", "leading"), steps_offset=case.get("steps_offset", 0),
                  set_alpha_to_one=case.get("set_alpha_to_one", True), **threshold_config(case))
    n, eta = case["n"], case["eta"]
    s.set_timesteps(n)
    s64 = float64_twin(s)
    stride = s.config.num_train_timesteps // n
    scenarios = []
    for t in s.timesteps.tolist():  # every step of the schedule
        model_output, x_t = step_inputs(s, t, case, g)
        seed = seed_from(g)
        drawn = torch.Generator().manual_seed(seed)  # the reference's generator: its state after the step
        ref = s.step(model_output.clone(), t, x_t.clone(), eta=eta, generator=drawn)
        expected = ref.prev_sample
        std = eta * float(s._get_variance(t, t - stride)) ** 0.5
        z = randn_tensor(model_output.shape, generator=torch.Generator().manual_seed(seed),
                         dtype=model_output.dtype) if eta > 0 else None
        # the shadow: the same step in float64, with the same draw z widened
        exact = s64.step(model_output.double(), t, x_t.double(), eta=eta,
                         variance_noise=None if z is None else z.double()).prev_sample
        inputs = dict(model_output=model_output, timestep=t, sample=x_t,
                      alphas_cumprod=s.alphas_cumprod.clone(), num_inference_steps=n, eta=eta,
                      generator=torch.Generator().manual_seed(seed),
                      prediction_type=case["prediction_type"], clip_sample=case["clip_sample"],
                      set_alpha_to_one=case.get("set_alpha_to_one", True), **threshold_inputs(case))
        scenarios.append(Scenario(inputs=inputs, expected=expected, exact=exact,
                                  label=arrow(t, t - stride, case.get("set_alpha_to_one", True)),
                                  verify=step_verify(ddim_step, inputs, expected, tol, std, z, ref.pred_original_sample),
                                  generators_after={"generator": drawn}))
    return scenarios


@ddim_step.check("vs DDIMScheduler.step, every timestep", cases=DDIM_CASES, tol=STEP_MATH)
def _(case, g):
    return ddim_scenarios(case, g, STEP_MATH)


@ddim_step.check("vs DDIMScheduler.step, float16", cases=DDIM_HALF_CASES, tol=HALF_STEP)
def _(case, g):
    return ddim_scenarios(case, g, HALF_STEP)


def _x0_eps(model_output, sample, a, prediction_type):
    b = 1 - a
    if prediction_type == "epsilon":
        return (sample - b**0.5 * model_output) / a**0.5, model_output
    if prediction_type == "sample":
        return model_output, (sample - a**0.5 * model_output) / b**0.5
    return a**0.5 * sample - b**0.5 * model_output, a**0.5 * model_output + b**0.5 * sample


def wrong_ddim(model_output, timestep, sample, alphas_cumprod, num_inference_steps, eta, generator,
               prediction_type, clip_sample, set_alpha_to_one=True, thresholding=False,
               dynamic_thresholding_ratio=0.995, sample_max_value=1.0, *, prev=None, final=None,
               clipped_eps=False, v_as_eps=False, no_clip=False, variance_not_std=False,
               no_sigma_in_direction=False, no_noise=False, no_threshold=False):
    """DDIM with one misconception switched on (each trap below names one)."""
    T = alphas_cumprod.shape[0]
    prev_t = timestep - T // num_inference_steps if prev is None else prev(timestep, T, num_inference_steps)
    a = alphas_cumprod[timestep]
    if prev_t >= 0:
        ap = alphas_cumprod[prev_t]
    elif final is not None:
        ap = final(alphas_cumprod, prev_t)
    else:
        ap = torch.tensor(1.0) if set_alpha_to_one else alphas_cumprod[0]
    kind = "epsilon" if v_as_eps and prediction_type == "v_prediction" else prediction_type
    x0, eps = _x0_eps(model_output, sample, a, kind)
    if thresholding and not no_threshold:
        x0 = wrong_threshold(x0, dynamic_thresholding_ratio, sample_max_value)
    elif clip_sample and not no_clip:
        x0 = x0.clamp(-1, 1)
        if clipped_eps:
            eps = (sample - a**0.5 * x0) / (1 - a) ** 0.5
    var = ((1 - ap) / (1 - a)) * (1 - a / ap)
    std = eta * (var if variance_not_std else var**0.5)
    out = ap**0.5 * x0 + (1 - ap - (0 if no_sigma_in_direction else std**2)) ** 0.5 * eps
    if eta > 0 and not no_noise:
        out = out + std * torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
    return out


@ddim_step.trap("prev_t = t − 1 (one training step instead of the stride T//n)",
                hint="With n inference steps each update jumps T//n training steps: prev_t = t − T//n.")
def _(**kw):
    return wrong_ddim(**kw, prev=lambda t, T, n: t - 1)


@ddim_step.trap("ᾱ_prev read at a negative index (Python wraps it to the noisy end of the table)",
                hint="When prev_t < 0 there is no table entry: the step lands on clean data, ᾱ_prev = 1 "
                     "(DDIMScheduler's final_alpha_cumprod with set_alpha_to_one=True).")
def _(**kw):
    return wrong_ddim(**kw, final=lambda ac, p: ac[p])


@ddim_step.trap("ᾱ_prev = alphas_cumprod[0] at the last step (whatever set_alpha_to_one says)",
                hint="That is set_alpha_to_one=False only. The default, True, lands the last step on "
                     "clean data: ᾱ_prev = 1 when prev_t < 0.")
def _(**kw):
    return wrong_ddim(**kw, final=lambda ac, p: ac[0])


@ddim_step.trap("set_alpha_to_one=False ignored (ᾱ_prev = 1 at the last step)",
                hint="With set_alpha_to_one=False the step past the start of the table lands on the "
                     "table's first entry: ᾱ_prev = alphas_cumprod[0] (diffusers' final_alpha_cumprod).")
def _(**kw):
    return wrong_ddim(**kw, final=lambda ac, p: torch.tensor(1.0))


@ddim_step.trap("thresholding ignored (x̂0 clipped or left as it is)",
                hint="With thresholding=True x̂_0 goes through dynamic_threshold (it replaces clip_sample): "
                     "a per-sample quantile clamp and rescale.")
def _(**kw):
    return wrong_ddim(**kw, no_threshold=True)


@ddim_step.trap("x̂0 not clipped (clip_sample is True by default)",
                hint="When clip_sample is True clamp x̂_0 to [−1, 1] before using it.")
def _(**kw):
    return wrong_ddim(**kw, no_clip=True)


@ddim_step.trap("ε̂ recomputed from the clipped x̂0",
                hint="DDIM keeps ε̂ from the raw model output (use_clipped_model_output=False); only x̂_0 "
                     "is clipped.")
def _(**kw):
    return wrong_ddim(**kw, clipped_eps=True)


@ddim_step.trap("v treated as ε",
                hint="For v_prediction: x̂_0 = √ᾱ·x_t − √(1−ᾱ)·v and ε̂ = √ᾱ·v + √(1−ᾱ)·x_t.")
def _(**kw):
    return wrong_ddim(**kw, v_as_eps=True)


@ddim_step.trap("σ² used where σ belongs (variance instead of std)",
                hint="σ_t = η·√((1−ᾱ_prev)/(1−ᾱ_t)·(1−ᾱ_t/ᾱ_prev)): take the square root before scaling z.")
def _(**kw):
    return wrong_ddim(**kw, variance_not_std=True)


@ddim_step.trap("the direction term ignores σ² (√(1 − ᾱ_prev) instead of √(1 − ᾱ_prev − σ²))",
                hint="The fresh noise σ·z uses part of the noise budget 1 − ᾱ_prev; ε̂ gets what is left.")
def _(**kw):
    return wrong_ddim(**kw, no_sigma_in_direction=True)


@ddim_step.trap("no noise added (η > 0 needs σ·z)",
                hint="When eta > 0 add σ_t·z with z = torch.randn(model_output.shape, generator=generator, "
                     "dtype=model_output.dtype).")
def _(**kw):
    return wrong_ddim(**kw, no_noise=True)


# ---- ddpm_step -------------------------------------------------------------------------------------------
ddpm_step = Kata(
    "ddpm_step",
    hints=(
        "Get x̂_0 (clipped), then the Gaussian posterior between x̂_0 and x_t: its mean, plus its std "
        "times fresh noise except at t = 0. With a strided schedule the step's α covers the whole stride.",
        "ᾱ_prev = ᾱ[prev_t] if prev_t ≥ 0 else 1; α_t = ᾱ_t/ᾱ_prev; β_t = 1 − α_t; "
        "μ = √ᾱ_prev·β_t/(1−ᾱ_t)·x̂_0 + √α_t·(1−ᾱ_prev)/(1−ᾱ_t)·x_t; σ² = (1−ᾱ_prev)/(1−ᾱ_t)·β_t.",
        "a = alphas_cumprod[timestep]; ap = alphas_cumprod[prev_timestep] if prev_timestep >= 0 else "
        "torch.tensor(1.0); at = a / ap; bt = 1 - at; x0 = predict_x0(...) (clamp if clip_sample); "
        "out = ap ** 0.5 * bt / (1 - a) * x0 + at ** 0.5 * (1 - ap) / (1 - a) * sample; if timestep > 0: "
        "out = out + ((1 - ap) / (1 - a) * bt).clamp(min=1e-20) ** 0.5 * torch.randn(model_output.shape, "
        "generator=generator, dtype=model_output.dtype)",
    ),
    answer_key=("diffusers.schedulers.scheduling_ddpm.DDPMScheduler.step",
                "diffusers.schedulers.scheduling_ddpm.DDPMScheduler._get_variance", *STEP_FAMILY),
)

DDPM_CASES = [
    dict(prediction_type="epsilon", clip_sample=True, n=10, shape=(2, 4, 8, 8)),
    dict(prediction_type="epsilon", clip_sample=False, n=10, steps_offset=1, schedule="ddpm", shape=(1, 4, 16, 16)),
    dict(prediction_type="v_prediction", clip_sample=False, n=7, spacing="trailing", schedule="zsnr",
         shape=(2, 4, 8, 8)),
    dict(prediction_type="sample", clip_sample=True, n=10, spacing="linspace", shape=(2, 3, 8, 8)),
    # the full chain of a short schedule: every training timestep, prev_t = t − 1
    dict(prediction_type="epsilon", clip_sample=True, n=25, T=25, schedule="ddpm", shape=(2, 4, 8, 8)),
    # the other variance types: σ² = β_t of the stride; the posterior's σ through exp(½·log σ²)
    dict(prediction_type="epsilon", clip_sample=True, n=10, variance_type="fixed_large", shape=(2, 4, 8, 8)),
    dict(prediction_type="v_prediction", clip_sample=False, n=7, spacing="trailing", T=500,
         variance_type="fixed_small_log", shape=(2, 3, 8, 8)),
    # dynamic thresholding in place of clip_sample, with each variance type
    dict(prediction_type="sample", clip_sample=True, n=8, thresholding=True, ratio=0.9, max_value=2.0,
         variance_type="fixed_large", shape=(3, 4, 8, 8)),
    dict(prediction_type="epsilon", clip_sample=False, n=10, thresholding=True, ratio=0.995, max_value=1.5,
         schedule="ddpm", shape=(2, 3, 8, 8)),
]
DDPM_HALF_CASES = [
    dict(prediction_type="epsilon", clip_sample=True, n=10, shape=(2, 4, 8, 8), dtype="float16"),
    dict(prediction_type="v_prediction", clip_sample=False, n=8, spacing="trailing", T=600, shape=(3, 4, 5, 6),
         dtype="float16"),
    dict(prediction_type="epsilon", clip_sample=True, n=6, variance_type="fixed_large", thresholding=True,
         ratio=0.95, max_value=1.8, shape=(2, 4, 8, 8), dtype="float16"),
]


def ddpm_std(s, t: int):
    """σ_t of DDPMScheduler's step at t (its _get_variance returns the std itself for "fixed_small_log")."""
    v = s._get_variance(t)
    return v if s.config.variance_type == "fixed_small_log" else v**0.5


def ddpm_shadow(s64, model_output, t: int, x_t, seed: int, z):
    """DDPMScheduler.step on a float64 twin, with the reference's draw z in place of its own.

    DDPMScheduler.step takes no variance_noise and would draw float64 noise (other values): take its
    own draw back out (the same generator seed, float64) and put z, widened, in."""
    out = s64.step(model_output.double(), t, x_t.double(),
                   generator=torch.Generator().manual_seed(seed)).prev_sample
    if t > 0:
        std = ddpm_std(s64, t)
        own = randn_tensor(model_output.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        out = out - std * own + std * z.double()
    return out


def ddpm_scenarios(case, g, tol):
    g = torch.Generator().manual_seed(seed_from(g))  # see 'Inputs and the global RNG'
    s = scheduler(DDPMScheduler, case, clip_sample=case["clip_sample"],
                  timestep_spacing=case.get("spacing", "leading"), steps_offset=case.get("steps_offset", 0),
                  variance_type=case.get("variance_type", "fixed_small"), **threshold_config(case))
    s.set_timesteps(case["n"])
    s64 = float64_twin(s)
    ts = s.timesteps.tolist()
    scenarios = []
    for i, t in enumerate(ts):  # every step of the schedule
        prev = ts[i + 1] if i + 1 < len(ts) else -1
        model_output, x_t = step_inputs(s, t, case, g)
        seed = seed_from(g)
        drawn = torch.Generator().manual_seed(seed)  # the reference's generator: its state after the step
        ref = s.step(model_output.clone(), t, x_t.clone(), generator=drawn)
        expected = ref.prev_sample
        std = float(ddpm_std(s, t)) if t > 0 else 0.0
        z = randn_tensor(model_output.shape, generator=torch.Generator().manual_seed(seed), dtype=model_output.dtype)
        exact = ddpm_shadow(s64, model_output, t, x_t, seed, z)
        inputs = dict(model_output=model_output, timestep=t, sample=x_t,
                      alphas_cumprod=s.alphas_cumprod.clone(), prev_timestep=prev,
                      generator=torch.Generator().manual_seed(seed),
                      prediction_type=case["prediction_type"], clip_sample=case["clip_sample"],
                      variance_type=case.get("variance_type", "fixed_small"), **threshold_inputs(case))
        scenarios.append(Scenario(inputs=inputs, expected=expected, exact=exact, label=arrow(t, prev),
                                  verify=step_verify(ddpm_step, inputs, expected, tol, std, z, ref.pred_original_sample),
                                  generators_after={"generator": drawn}))
    return scenarios


@ddpm_step.check("vs DDPMScheduler.step, every timestep", cases=DDPM_CASES, tol=STEP_MATH)
def _(case, g):
    return ddpm_scenarios(case, g, STEP_MATH)


@ddpm_step.check("vs DDPMScheduler.step, float16", cases=DDPM_HALF_CASES, tol=HALF_STEP)
def _(case, g):
    return ddpm_scenarios(case, g, HALF_STEP)


def wrong_ddpm(model_output, timestep, sample, alphas_cumprod, prev_timestep, generator, prediction_type,
               clip_sample, variance_type="fixed_small", thresholding=False, dynamic_thresholding_ratio=0.995,
               sample_max_value=1.0, *, one_step_alpha=False, ignore_prev=False, wrap=False, no_clip=False,
               variance_not_std=False, fixed_large=False, fixed_small=False, large_of_table=False,
               no_noise=False, no_threshold=False, noise_at_zero=False, large_cumulative=False, log_root_twice=False):
    """DDPM with one misconception switched on (each trap below names one)."""
    t = timestep
    p = t - 1 if ignore_prev else prev_timestep
    a = alphas_cumprod[t]
    ap = alphas_cumprod[p] if (p >= 0 or wrap) else torch.tensor(1.0)
    if one_step_alpha:  # α_t of the training schedule: ᾱ_t/ᾱ_{t−1}
        at = a / (alphas_cumprod[t - 1] if t > 0 else torch.tensor(1.0))
    else:
        at = a / ap
    bt = 1 - at
    x0, _ = _x0_eps(model_output, sample, a, prediction_type)
    if thresholding and not no_threshold:
        x0 = wrong_threshold(x0, dynamic_thresholding_ratio, sample_max_value)
    elif clip_sample and not no_clip:
        x0 = x0.clamp(-1, 1)
    out = (ap**0.5 * bt) / (1 - a) * x0 + at**0.5 * (1 - ap) / (1 - a) * sample
    if (t > 0 or noise_at_zero) and not no_noise:
        z = torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
        large = fixed_large or (variance_type == "fixed_large" and not fixed_small)
        if large and large_of_table:  # β_t of the training table: 1 − ᾱ_t/ᾱ_{t−1}
            var = 1 - a / alphas_cumprod[t - 1]
        elif large and large_cumulative:  # 1 − ᾱ_t, the cumulative noise
            var = 1 - a
        else:
            var = bt if large else torch.clamp((1 - ap) / (1 - a) * bt, min=1e-20)
        if log_root_twice and variance_type == "fixed_small_log":
            var = var**0.5  # exp(½·log σ²) = σ, then its square root taken as well
        out = out + (var if variance_not_std else var**0.5) * z
    return out


@ddpm_step.trap("α_t = 1 − β_t of the training schedule (ᾱ_t/ᾱ_{t−1}) instead of ᾱ_t/ᾱ_prev",
                hint="With n < T steps one update spans t − prev_t training steps: use the stride's "
                     "α_t = ᾱ_t/ᾱ_prev (and β_t = 1 − α_t) in the mean and the variance.")
def _(**kw):
    return wrong_ddpm(**kw, one_step_alpha=True)


@ddpm_step.trap("prev_timestep ignored (the posterior of t → t − 1)",
                hint="The step lands on prev_timestep, which is t − T//n or so with a strided schedule: "
                     "read ᾱ_prev there.")
def _(**kw):
    return wrong_ddpm(**kw, ignore_prev=True)


@ddpm_step.trap("ᾱ_prev read at a negative index (Python wraps it to the noisy end of the table)",
                hint="After the last step prev_timestep is −1: there is no table entry, ᾱ_prev = 1.")
def _(**kw):
    return wrong_ddpm(**kw, wrap=True)


@ddpm_step.trap("x̂0 not clipped (clip_sample is True by default)",
                hint="When clip_sample is True clamp x̂_0 to [−1, 1] before the posterior mean.")
def _(**kw):
    return wrong_ddpm(**kw, no_clip=True)


@ddpm_step.trap("variance used where the std belongs",
                hint="Scale z by σ_t = √((1−ᾱ_prev)/(1−ᾱ_t)·β_t), the square root of the posterior variance.")
def _(**kw):
    return wrong_ddpm(**kw, variance_not_std=True)


@ddpm_step.trap("σ² = β_t ('fixed_large') instead of the posterior variance",
                hint="variance_type='fixed_small' (the default, and 'fixed_small_log') is the posterior's "
                     "β̃_t = (1−ᾱ_prev)/(1−ᾱ_t)·β_t; only 'fixed_large' uses β_t itself.")
def _(**kw):
    return wrong_ddpm(**kw, fixed_large=True)


@ddpm_step.trap("variance_type ignored (the posterior variance 'fixed_small' always)",
                hint="variance_type='fixed_large' sets σ_t² = β_t = 1 − ᾱ_t/ᾱ_prev, the variance of the "
                     "forward step, larger than the posterior's β̃_t.")
def _(**kw):
    return wrong_ddpm(**kw, fixed_small=True)


@ddpm_step.trap("'fixed_small_log': the square root taken twice (exp(½·log σ²) is σ already)",
                hint="fixed_small_log works in log space: exp(0.5·log(clamp(σ², 1e-20))) is the std σ itself; "
                     "multiply z by it as it is, with no further square root.")
def _(**kw):
    return wrong_ddpm(**kw, log_root_twice=True)


@ddpm_step.trap("'fixed_large' with β_t of the training table (1 − ᾱ_t/ᾱ_{t−1})",
                hint="With a strided schedule β_t is the stride's: 1 − ᾱ_t/ᾱ_prev, the same β_t as in the mean.")
def _(**kw):
    return wrong_ddpm(**kw, large_of_table=True)


@ddpm_step.trap("'fixed_large' with 1 − ᾱ_t (the cumulative noise) instead of β_t",
                hint="'fixed_large' is the forward step's variance β_t = 1 − ᾱ_t/ᾱ_prev, not the whole noise "
                     "1 − ᾱ_t accumulated from x_0.")
def _(**kw):
    return wrong_ddpm(**kw, large_cumulative=True)


@ddpm_step.trap("noise added at the last step too (t = 0)",
                hint="The step onto t = 0 returns the posterior mean: x_0's estimate gets no fresh noise (diffusers "
                     "adds σ_t·z only where t > 0), and nothing is drawn from the generator there.")
def _(**kw):
    return wrong_ddpm(**kw, noise_at_zero=True)


@ddpm_step.trap("thresholding ignored (x̂0 clipped or left as it is)",
                hint="With thresholding=True x̂_0 goes through dynamic_threshold (it replaces clip_sample): "
                     "a per-sample quantile clamp and rescale.")
def _(**kw):
    return wrong_ddpm(**kw, no_threshold=True)


@ddpm_step.trap("no noise added (DDPM adds σ_t·z at every t > 0)",
                hint="Add σ_t·z with z = torch.randn(model_output.shape, generator=generator, "
                     "dtype=model_output.dtype) whenever timestep > 0.")
def _(**kw):
    return wrong_ddpm(**kw, no_noise=True)
