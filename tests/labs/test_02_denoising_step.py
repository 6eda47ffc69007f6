"""Lab 02: wrong-but-plausible denoising steps fail, and the commonest ones are named."""
import pytest

from expect import Fails

LAB = "02_denoising_step"

# Shared lines for the step mutants (each body replaces one solution block; the other functions of
# the solution, predict_x0 and predict_epsilon included, stay solved).
DDIM_HEAD = """
T = alphas_cumprod.shape[0]
prev_t = timestep - T // num_inference_steps
a = alphas_cumprod[timestep]
final = torch.tensor(1.0) if set_alpha_to_one else alphas_cumprod[0]
ap = alphas_cumprod[prev_t] if prev_t >= 0 else final
x0 = predict_x0(model_output, sample, a, prediction_type)
eps = predict_epsilon(model_output, sample, a, prediction_type)
if thresholding:
    x0 = dynamic_threshold(x0, dynamic_thresholding_ratio, sample_max_value)
elif clip_sample:
    x0 = x0.clamp(-1, 1)
std = eta * ((1 - ap) / (1 - a) * (1 - a / ap)) ** 0.5
"""
DDIM_TAIL = """
out = ap ** 0.5 * x0 + (1 - ap - std ** 2) ** 0.5 * eps
if eta > 0:
    out = out + std * torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
return out
"""
DDPM_HEAD = """
a = alphas_cumprod[timestep]
ap = alphas_cumprod[prev_timestep] if prev_timestep >= 0 else torch.tensor(1.0)
at = a / ap
bt = 1 - at
x0 = predict_x0(model_output, sample, a, prediction_type)
if thresholding:
    x0 = dynamic_threshold(x0, dynamic_thresholding_ratio, sample_max_value)
elif clip_sample:
    x0 = x0.clamp(-1, 1)
"""
DDPM_MEAN = "out = ap ** 0.5 * bt / (1 - a) * x0 + at ** 0.5 * (1 - ap) / (1 - a) * sample\n"
DDPM_NOISE = """
if timestep > 0:
    var = ((1 - ap) / (1 - a) * bt).clamp(min=1e-20)
    if variance_type == "fixed_large":
        var = bt
    out = out + var ** 0.5 * torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
return out
"""

THRESHOLD = """
x = pred_original_sample
flat = x.reshape(x.shape[0], -1).float()
s = torch.quantile(flat.abs(), dynamic_thresholding_ratio, dim=1).clamp(min=1, max=sample_max_value).unsqueeze(1)
return (torch.clamp(flat, -s, s) / s).reshape(x.shape).to(x.dtype)
"""

MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    # the right values, but no draw where σ_t = 0 (the last step): the generator is left one draw behind
    ("ddim_step", DDIM_HEAD + """
out = ap ** 0.5 * x0 + (1 - ap - std ** 2) ** 0.5 * eps
if eta > 0 and float(std) > 0:
    out = out + std * torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
return out
""", Fails("wrong", "was left in a different state than diffusers leaves it")),
    # and a DDPM step that draws at t = 0 too (where diffusers draws nothing), its noise scaled by 0
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + """
var = ((1 - ap) / (1 - a) * bt).clamp(min=1e-20) if timestep > 0 else torch.tensor(0.0)
return out + var ** 0.5 * torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
""", Fails("wrong", "was left in a different state than diffusers leaves it")),
    ("ddpm_step",  # a blind learner's: fixed_small_log's std square-rooted again
     DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace(
         "        var = bt\n", "        var = bt\n    if variance_type == 'fixed_small_log':\n        var = var ** 0.5\n"),
     "'fixed_small_log': the square root taken twice"),
    ("predict_x0", "return model_output", "the model output taken as x̂0"),
    ("predict_x0",  # a blind learner's: clipped as the scheduler's default clip_sample would
     """
     a = alpha_prod_t
     if prediction_type == "epsilon":
         x0 = (sample - (1 - a) ** 0.5 * model_output) / a ** 0.5
     elif prediction_type == "v_prediction":
         x0 = a ** 0.5 * sample - (1 - a) ** 0.5 * model_output
     else:
         x0 = model_output
     return x0.clamp(-1, 1)
     """,
     "x̂0 clamped to [−1, 1]"),
    ("predict_x0",  # a blind learner's: ᾱ cast to the tensor's dtype before the square roots (float16 cases)
     """
     a = alpha_prod_t.to(model_output.dtype)
     if prediction_type == "epsilon":
         return (sample - (1 - a) ** 0.5 * model_output) / a ** 0.5
     if prediction_type == "v_prediction":
         return a ** 0.5 * sample - (1 - a) ** 0.5 * model_output
     return model_output
     """,
     "a precision mistake: the right formula, rounded more than diffusers rounds"),
    ("predict_x0",
     """
     a = alpha_prod_t
     if prediction_type == "epsilon":
         return (sample - (1 - a) * model_output) / a
     if prediction_type == "v_prediction":
         return a * sample - (1 - a) * model_output
     return model_output
     """,
     "ᾱ_t used where √ᾱ_t belongs"),
    ("predict_x0",
     """
     if prediction_type == "sample":
         return model_output
     return (sample - (1 - alpha_prod_t) ** 0.5 * model_output) / alpha_prod_t ** 0.5
     """,
     "v treated as ε"),
    ("predict_x0",
     """
     a = alpha_prod_t
     if prediction_type == "epsilon":
         return (sample - (1 - a) ** 0.5 * model_output) / a ** 0.5
     if prediction_type == "v_prediction":
         return a ** 0.5 * model_output + (1 - a) ** 0.5 * sample
     return model_output
     """,
     "v_prediction: √ᾱ·v + √(1−ᾱ)·x_t"),
    ("predict_x0",
     """
     a = alpha_prod_t
     if prediction_type == "epsilon":
         return sample - (1 - a) ** 0.5 * model_output
     if prediction_type == "v_prediction":
         return a ** 0.5 * sample - (1 - a) ** 0.5 * model_output
     return model_output
     """,
     "epsilon: x_t − √(1−ᾱ)·ε̂ without dividing"),
    ("predict_x0",  # a blind learner's: ε's branch divided by ᾱ
     """
     a = alpha_prod_t
     if prediction_type == "epsilon":
         return (sample - (1 - a) ** 0.5 * model_output) / a
     if prediction_type == "v_prediction":
         return a ** 0.5 * sample - (1 - a) ** 0.5 * model_output
     return model_output
     """,
     "epsilon: divided by ᾱ_t instead of √ᾱ_t"),
    ("predict_x0",  # a blind learner's: v's rotation with +
     """
     a = alpha_prod_t
     if prediction_type == "epsilon":
         return (sample - (1 - a) ** 0.5 * model_output) / a ** 0.5
     if prediction_type == "v_prediction":
         return a ** 0.5 * sample + (1 - a) ** 0.5 * model_output
     return model_output
     """,
     "v_prediction with the sign flipped"),
    ("predict_x0",  # v with the roles of x_t and v swapped: no trap, a plain mismatch
     """
     a = alpha_prod_t
     if prediction_type == "epsilon":
         return (sample - (1 - a) ** 0.5 * model_output) / a ** 0.5
     if prediction_type == "v_prediction":
         return a ** 0.5 * model_output - (1 - a) ** 0.5 * sample
     return model_output
     """,
     Fails("wrong", "values differ")),
    ("predict_x0", "return sample", Fails("wrong", "values differ")),
    # ---- ddim_step
    ("ddim_step", DDIM_HEAD.replace("timestep - T // num_inference_steps", "timestep - 1") + DDIM_TAIL,
     "prev_t = t − 1"),
    ("ddim_step", DDIM_HEAD.replace(" if prev_t >= 0 else final", "") + DDIM_TAIL,
     "ᾱ_prev read at a negative index"),
    ("ddim_step",  # T hard-coded to 1000 (issue 10: every DDIM case once had T = 1000)
     DDIM_HEAD.replace("timestep - T // num_inference_steps", "timestep - 1000 // num_inference_steps") + DDIM_TAIL,
     Fails("wrong", "")),
    ("ddim_step",  # η > 0: the noise drawn sample by sample (issue 10: equal to one batch draw when C·H·W % 16 == 0)
     DDIM_HEAD + DDIM_TAIL.replace(
         "torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)",
         "torch.cat([torch.randn((1, *model_output.shape[1:]), generator=generator, dtype=model_output.dtype) "
         "for _ in range(model_output.shape[0])])"),
     Fails("wrong", "")),
    ("ddim_step", DDIM_HEAD.replace("torch.tensor(1.0) if set_alpha_to_one else alphas_cumprod[0]",
                                    "alphas_cumprod[0]") + DDIM_TAIL,
     "ᾱ_prev = alphas_cumprod[0] at the last step"),
    ("ddim_step", DDIM_HEAD.replace("torch.tensor(1.0) if set_alpha_to_one else alphas_cumprod[0]",
                                    "torch.tensor(1.0)") + DDIM_TAIL,
     "set_alpha_to_one=False ignored"),
    ("ddim_step", DDIM_HEAD.replace("if thresholding:", "if False:") + DDIM_TAIL,
     "thresholding ignored"),
    ("ddim_step", DDIM_HEAD.replace("x0 = x0.clamp(-1, 1)", "pass") + DDIM_TAIL,
     "x̂0 not clipped"),
    ("ddim_step",
     DDIM_HEAD.replace("x0 = x0.clamp(-1, 1)",
                       "x0 = x0.clamp(-1, 1)\n    eps = (sample - a ** 0.5 * x0) / (1 - a) ** 0.5") + DDIM_TAIL,
     "ε̂ recomputed from the clipped x̂0"),
    ("ddim_step",
     DDIM_HEAD.replace("x0 = predict_x0(model_output, sample, a, prediction_type)",
                       "x0 = (sample - (1 - a) ** 0.5 * model_output) / a ** 0.5"
                       " if prediction_type != 'sample' else model_output")
     .replace("eps = predict_epsilon(model_output, sample, a, prediction_type)",
              "eps = predict_epsilon(model_output, sample, a, "
              "'epsilon' if prediction_type == 'v_prediction' else prediction_type)") + DDIM_TAIL,
     "v treated as ε"),
    ("ddim_step", DDIM_HEAD.replace("(1 - a / ap)) ** 0.5", "(1 - a / ap))") + DDIM_TAIL,
     "σ² used where σ belongs"),
    ("ddim_step", DDIM_HEAD + DDIM_TAIL.replace("(1 - ap - std ** 2)", "(1 - ap)"),
     "the direction term ignores σ²"),
    ("ddim_step", DDIM_HEAD + "return ap ** 0.5 * x0 + (1 - ap - std ** 2) ** 0.5 * eps\n",
     "no noise added"),
    ("ddim_step",  # the stride rounded instead of floored: 1000/7 → 143, not 142
     DDIM_HEAD.replace("T // num_inference_steps", "round(T / num_inference_steps)") + DDIM_TAIL, Fails("wrong", "values differ")),
    ("ddim_step",  # σ without η: the direction term shrinks even at η = 0
     DDIM_HEAD.replace("std = eta *", "std =") + DDIM_TAIL.replace("std * torch", "eta * std * torch"), Fails("wrong", "values differ")),
    # ---- ddpm_step
    ("ddpm_step",
     DDPM_HEAD.replace("at = a / ap",
                       "at = a / (alphas_cumprod[timestep - 1] if timestep > 0 else torch.tensor(1.0))")
     + DDPM_MEAN + DDPM_NOISE,
     "α_t = 1 − β_t of the training schedule"),
    ("ddpm_step",
     DDPM_HEAD.replace("alphas_cumprod[prev_timestep] if prev_timestep >= 0",
                       "alphas_cumprod[timestep - 1] if timestep >= 1") + DDPM_MEAN + DDPM_NOISE,
     "prev_timestep ignored"),
    ("ddpm_step",
     DDPM_HEAD.replace(" if prev_timestep >= 0 else torch.tensor(1.0)", "") + DDPM_MEAN + DDPM_NOISE,
     "ᾱ_prev read at a negative index"),
    ("ddpm_step", DDPM_HEAD.replace("x0 = x0.clamp(-1, 1)", "pass") + DDPM_MEAN + DDPM_NOISE,
     "x̂0 not clipped"),
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace("var ** 0.5 *", "var *"),
     "variance used where the std belongs"),
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace("((1 - ap) / (1 - a) * bt).clamp(min=1e-20)", "bt"),
     "σ² = β_t ('fixed_large')"),
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + "return out\n", "no noise added"),
    ("ddpm_step",  # noise at t = 0 too: 'fixed_small' clamps its variance to 1e-20 there (right values, one draw
     # too many: said so); the trap names it where the values show it ('fixed_large')
     DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace("if timestep > 0:", "if True:"),
     Fails("wrong", "drew a different amount of noise")),
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace("var = bt", "var = 1 - a"),
     "'fixed_large' with 1 − ᾱ_t"),
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace('if variance_type == "fixed_large":', "if False:"),
     "variance_type ignored"),
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace("var = bt", "var = 1 - a / alphas_cumprod[timestep - 1]"),
     "'fixed_large' with β_t of the training table"),
    ("ddpm_step", DDPM_HEAD.replace("if thresholding:", "if False:") + DDPM_MEAN + DDPM_NOISE,
     "thresholding ignored"),
    ("ddpm_step",  # 'fixed_large' as the std: β_t taken as σ_t, not σ_t²
     DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace("var = bt", "var = bt ** 2"), 'variance used where the std belongs'),
    # ---- dynamic_threshold
    ("dynamic_threshold", THRESHOLD.replace("x.reshape(x.shape[0], -1)", "x.reshape(1, -1)"),
     "one threshold for the whole batch"),
    ("dynamic_threshold", THRESHOLD.replace("min=1, max=sample_max_value", "max=sample_max_value"),
     "s not floored at 1"),
    ("dynamic_threshold", THRESHOLD.replace("min=1, max=sample_max_value", "min=1"),
     "s not capped at sample_max_value"),
    ("dynamic_threshold", THRESHOLD.replace("torch.clamp(flat, -s, s) / s", "torch.clamp(flat, -s, s)"),
     "clamped to [−s, s] but not divided by s"),
    ("dynamic_threshold", THRESHOLD.replace("flat.abs()", "flat"), "the quantile of x̂0 instead of |x̂0|"),
    ("dynamic_threshold",  # a per-channel threshold (dim=(2, 3)) instead of one per sample: no trap, a mismatch
     """
     x = pred_original_sample
     flat = x.float().reshape(x.shape[0], x.shape[1], -1)
     s = torch.quantile(flat.abs(), dynamic_thresholding_ratio, dim=2).clamp(min=1, max=sample_max_value)
     s = s.unsqueeze(2)
     return (torch.clamp(flat, -s, s) / s).reshape(x.shape).to(x.dtype)
     """, Fails("wrong", "values differ")),
    ("ddpm_step",  # the two mean coefficients swapped between x̂0 and x_t
     DDPM_HEAD + "out = at ** 0.5 * (1 - ap) / (1 - a) * x0 + ap ** 0.5 * bt / (1 - a) * sample\n" + DDPM_NOISE,
     Fails("wrong", "values differ")),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("ddpm_step",
     """
     import math
     a = alphas_cumprod[timestep].item()
     ap = alphas_cumprod[prev_timestep].item() if prev_timestep >= 0 else 1.0
     at = a / ap
     bt = 1 - at
     x0 = predict_x0(model_output, sample, alphas_cumprod[timestep], prediction_type)
     if thresholding:
         x0 = dynamic_threshold(x0, dynamic_thresholding_ratio, sample_max_value)
     elif clip_sample:
         x0 = x0.clamp(-1, 1)
     out = math.sqrt(ap) * bt / (1 - a) * x0 + math.sqrt(at) * (1 - ap) / (1 - a) * sample
     if timestep > 0:
         var = bt if variance_type == "fixed_large" else max((1 - ap) / (1 - a) * bt, 1e-20)
         std = math.exp(0.5 * math.log(var)) if variance_type == "fixed_small_log" else math.sqrt(var)
         out = out + std * torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)
     return out
     """,
     "Python-float coefficients (.item(), math.sqrt): at T=25, t=1 → 0 diffusers' float32 β_t = 1 − ᾱ_t/ᾱ_prev "
     "is 2.8e-5 off, this one 1.4e-7 from exact (|diff| 2.6e-5 vs diffusers, outside the old 2.0e-5)"),
    ("ddpm_step",
     DDPM_HEAD.replace("a = alphas_cumprod[timestep]", "a = alphas_cumprod.double()[timestep]")
     .replace("ap = alphas_cumprod[prev_timestep] if prev_timestep >= 0 else torch.tensor(1.0)",
              "ap = alphas_cumprod.double()[prev_timestep] if prev_timestep >= 0 else torch.tensor(1.0, dtype=torch.float64)")
     .replace("predict_x0(model_output, sample, a, prediction_type)",
              "predict_x0(model_output, sample, alphas_cumprod[timestep], prediction_type)")
     + DDPM_MEAN + DDPM_NOISE,
     "float64 coefficients (0-dim float64 tensors keep a float32 sample float32)"),
    ("dynamic_threshold",
     """
     x = pred_original_sample.double()
     flat = x.reshape(x.shape[0], -1)
     s = flat.abs().quantile(dynamic_thresholding_ratio, dim=1, keepdim=True)
     s = s.clamp(1, sample_max_value) if sample_max_value >= 1 else torch.full_like(s, sample_max_value)
     return (flat.clamp(-s, s) / s).view(x.shape).to(pred_original_sample.dtype)
     """,
     "float64 quantile with keepdim, written with Tensor methods"),
    ("predict_x0",
     """
     x, m, a = sample.float(), model_output.float(), alpha_prod_t.float()
     if prediction_type == "epsilon":
         out = (x - (1 - a) ** 0.5 * m) / a ** 0.5
     elif prediction_type == "v_prediction":
         out = a ** 0.5 * x - (1 - a) ** 0.5 * m
     else:
         out = m
     return out.to(model_output.dtype)
     """,
     "float16 upcast to float32 and cast back: at t=999 diffusers' float16 rounding is multiplied by "
     "1/√ᾱ ≈ 14.6 (|diff| 0.017-0.020 vs diffusers, outside the old 0.0021)"),
]


@pytest.mark.parametrize("function, body", [
    ("ddim_step", DDIM_HEAD + DDIM_TAIL.replace("generator=generator, ", "")),
    ("ddpm_step", DDPM_HEAD + DDPM_MEAN + DDPM_NOISE.replace("generator=generator, ", "")),
    ("ddim_step", DDIM_HEAD + DDIM_TAIL.replace(
        "torch.randn(model_output.shape, generator=generator, dtype=model_output.dtype)",
        "torch.randn(model_output.shape[1:], generator=generator, dtype=model_output.dtype)")),
], ids=["ddim-global-rng", "ddpm-global-rng", "ddim-one-draw-for-the-batch"])
def test_noise_not_drawn_from_the_given_generator_is_named(grade_mutant, function, body):
    graded = grade_mutant(LAB, function, body)
    assert graded.status == "failed", graded
    assert "trap: noise not drawn from `generator`" in graded.text, graded.text


@pytest.mark.parametrize("function, body", [
    ("ddim_step", DDIM_HEAD.replace("a = alphas_cumprod[timestep]", "a = alphas_cumprod[timestep].item()")
     .replace("torch.tensor(1.0)", "1.0").replace("else alphas_cumprod[0]", "else alphas_cumprod[0].item()")
     .replace("ap = alphas_cumprod[prev_t]", "ap = alphas_cumprod[prev_t].item()")
 + DDIM_TAIL),
    ("ddpm_step", DDPM_HEAD.replace("x0 = predict_x0(model_output, sample, a, prediction_type)",
                                    "x0 = predict_x0(model_output.float(), sample.float(), a, prediction_type)")
     + DDPM_MEAN.replace("* sample", "* sample.float()")
     + DDPM_NOISE.replace("return out", "return out.to(model_output.dtype)")),
], ids=["ddim-python-float-coefficients", "ddpm-float32-then-cast"])
def test_a_right_step_written_another_way_passes_in_float16_too(grade_mutant, function, body):
    graded = grade_mutant(LAB, function, body)
    assert graded.status == "passed", graded


def test_changing_the_sample_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "ddim_step", DDIM_HEAD + DDIM_TAIL.replace("return out", "return sample.copy_(out)"))
    assert graded.status == "failed"
    assert "changed its input(s) sample in place" in graded.text


def test_calling_the_diffusers_answer_key_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "ddim_step", """
        from diffusers.schedulers.scheduling_ddim import DDIMScheduler
        s = DDIMScheduler(prediction_type=prediction_type, clip_sample=clip_sample)
        s.alphas_cumprod = alphas_cumprod
        s.set_timesteps(num_inference_steps)
        return s.step(model_output, timestep, sample, eta=eta, generator=generator).prev_sample
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
