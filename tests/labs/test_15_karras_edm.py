"""Lab 15: wrong-but-plausible implementations fail, and the commonest ones are named."""
import importlib.util
from pathlib import Path

from expect import Fails

LAB = "15_karras_edm"
REPO = Path(__file__).resolve().parents[2]


def ladder_body(ramp="torch.linspace(0, 1, num_inference_steps, dtype=torch.float64)",
                sigmas="(hi + ramp * (lo - hi)) ** rho", out="torch.cat([s, s.new_zeros(1)])") -> str:
    """A body for karras_sigmas with one line swapped for a wrong one."""
    return f"""
    ramp = {ramp}
    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    s = ({sigmas}).float()
    return {out}
    """


def t_body(low="(torch.searchsorted(lt, ls, right=True) - 1).clamp(0, len(lt) - 2)",
           w="((ls - lt[j]) / (lt[j + 1] - lt[j])).clamp(0, 1)", t="j + w",
           logs="train_sigmas.double().log(), sigmas.double().log()") -> str:
    """A body for sigma_to_t with one line swapped for a wrong one."""
    return f"""
    lt, ls = {logs}
    j = {low}
    w = {w}
    return ({t}).float()
    """


def inputs_body(c_in="1 / (s ** 2 + sigma_data ** 2) ** 0.5", c_noise="0.25 * s.log()",
                s="sigma.double()", cast=".to(sample.dtype)") -> str:
    """A body for edm_model_inputs with one line swapped for a wrong one."""
    return f"""
    s = {s}
    c = ({c_in}).reshape(-1, 1, 1, 1)
    return (sample.double() * c){cast}, ({c_noise}).float()
    """


def denoised_body(c_skip="sigma_data ** 2 / (s ** 2 + sigma_data ** 2)",
                  c_out="k * s * sigma_data / (s ** 2 + sigma_data ** 2) ** 0.5",
                  k="-1 if prediction_type == 'v_prediction' else 1", s="sigma.double().reshape(-1, 1, 1, 1)",
                  cast=".float()") -> str:
    """A body for edm_denoised with one line swapped for a wrong one."""
    return f"""
    s = {s}
    k = {k}
    return (({c_skip}) * sample.double() + ({c_out}) * model_output.double()){cast}
    """


def step_body(update="x + (sigma_next - sigma) * (x - d0) / sigma", cast=".to(model_output.dtype)") -> str:
    """A body for edm_euler_step (calling the solution's edm_denoised) with one line swapped for a wrong one."""
    return f"""
    d0 = edm_denoised(sample, model_output, sigma.reshape(1).expand(sample.shape[0]), sigma_data, prediction_type)
    x = sample.float()
    return ({update}){cast}
    """


MUTANTS = [
    ("edm_sample",  # a blind learner's: σ for c_noise
     """
     x = sample
     for i in range(len(sigmas) - 1):
         x_in, _ = edm_model_inputs(x, sigmas[i].expand(x.shape[0]), sigma_data)
         x = edm_euler_step(network(x_in, sigmas[i]), x, sigmas[i], sigmas[i + 1], sigma_data, prediction_type)
     return x
     """, "the network fed σ instead of c_noise"),
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("karras_sigmas",
     ladder_body(sigmas="(sigma_max ** rho + ramp * (sigma_min ** rho - sigma_max ** rho)) ** (1 / rho)"),
     "ρ applied to σ instead of σ^{1/ρ}"),
    ("karras_sigmas", ladder_body(out="torch.cat([s.flip(0), s.new_zeros(1)])"), "ladder ascending"),
    ("karras_sigmas", ladder_body(out="s"), "no terminal σ = 0"),
    ("karras_sigmas", ladder_body(out="torch.cat([s, s[-1:]])"), "σ_min repeated as the terminal σ instead of 0"),
    ("karras_sigmas", ladder_body(ramp="torch.arange(num_inference_steps, dtype=torch.float64) / num_inference_steps"),
     "ramp i/n instead of i/(n − 1)"),
    ("karras_sigmas", ladder_body(sigmas="sigma_max + ramp * (sigma_min - sigma_max)"), "ρ ignored"),
    ("karras_sigmas",
     ladder_body(sigmas="sigma_max * (sigma_min / sigma_max) ** ramp"),
     "evenly spaced in log σ"),
    ("karras_sigmas",  # the terminal 0 put first
     ladder_body(out="torch.cat([s.new_zeros(1), s])"), Fails("wrong", "values differ")),
    ("karras_sigmas",  # float64 out: diffusers' σs are float32
     ladder_body(out="torch.cat([s, s.new_zeros(1)]).double()"), Fails("wrong", "has dtype")),
    ("sigma_to_t", t_body(logs="train_sigmas.double(), sigmas.double()"), "interpolated linearly in σ"),
    ("sigma_to_t", t_body(t="(j + w).round()"), "rounded to the nearest integer timestep"),
    ("sigma_to_t", t_body(t="(torch.searchsorted(lt, ls, right=True) - 1).clamp(0, len(lt) - 1).double()"),
     "the entry below, not interpolated"),
    ("sigma_to_t", t_body(t="len(lt) - 1 - (j + w)"), "table read backwards"),
    ("sigma_to_t", t_body(w="(ls - lt[j]) / (lt[j + 1] - lt[j])"), "not clamped"),
    ("sigma_to_t", t_body(t="0.25 * ls"), "EDM's c_noise = ¼·ln σ fed as the timestep"),
    ("sigma_to_t", t_body(low="torch.searchsorted(lt, ls, right=True) - 1", w="(ls - lt[j]) / (lt[j + 1] - lt[j])"),
     "the index j never clamped"),
    ("sigma_to_t",  # the entry above instead of below: the interpolation runs one index high
     t_body(t="j + 1 + w"), Fails("wrong", "values differ")),
    ("sigma_to_t",  # the log σ table's own index scaled to [0, 1] (t/T, as flow matching's σ)
     t_body(t="(j + w) / len(lt)"), Fails("wrong", "values differ")),
    ("edm_model_inputs", inputs_body(c_in="1 / s"), "c_in = 1/σ"),
    ("edm_model_inputs", inputs_body(c_in="1 / (s ** 2 + 1) ** 0.5"), "c_in = 1/√(σ² + 1)"),
    ("edm_model_inputs", inputs_body(c_in="1 / (s ** 2 + sigma_data) ** 0.5"), "c_in = 1/√(σ² + σ_data)"),
    ("edm_model_inputs", inputs_body(c_noise="s"), "c_noise = σ instead of ¼·ln σ"),
    ("edm_model_inputs", inputs_body(c_noise="s.log()"), "c_noise = ln σ (the ¼ dropped)"),
    ("edm_model_inputs", inputs_body(s="sigma.double()[:1].expand(len(sigma))"), "one σ for the whole batch"),
    ("edm_model_inputs",  # float32 scaled sample for a float16 network
     inputs_body(cast=".float()"), Fails("wrong", "has dtype")),
    ("edm_model_inputs", inputs_body(c_noise="0.25 * s.log10()"), "c_noise = ¼·log10 σ"),
    ("edm_model_inputs", inputs_body(c_noise="(s / 4).log()"), "c_noise = ln(σ/4)"),  # a blind learner's
    ("edm_denoised",
     denoised_body(c_skip="k * s * sigma_data / (s ** 2 + sigma_data ** 2) ** 0.5",
                   c_out="sigma_data ** 2 / (s ** 2 + sigma_data ** 2)"), "c_skip and c_out swapped"),
    ("edm_denoised", denoised_body(k="1"), "c_out's sign the wrong way round"),
    ("edm_denoised", denoised_body(c_skip="1 / (s ** 2 + 1)", c_out="k * s / (s ** 2 + 1) ** 0.5"),
     "σ_data forgotten"),
    ("edm_denoised", denoised_body(c_out="k * s * sigma_data / (s ** 2 + sigma_data ** 2)"),
     "c_out without the square root"),
    ("edm_denoised", denoised_body(c_skip="1", c_out="-s"), "Euler's x̂₀ = x − σ·F"),
    ("edm_denoised", denoised_body(s="sigma.double()[:1].reshape(-1, 1, 1, 1)"), "one σ for the whole batch"),
    ("edm_denoised",  # c_skip with σ_data unsquared in the numerator
     denoised_body(c_skip="sigma_data / (s ** 2 + sigma_data ** 2)"), Fails("wrong", "values differ")),
    ("edm_denoised",  # x̂₀ left in the model's dtype: float16 for a float16 model, though step works in float32
     denoised_body(cast=".to(model_output.dtype)"), Fails("wrong", "dtype")),
    ("edm_euler_step", step_body(update="x + (sigma_next - sigma) * model_output.float()"),
     "the network output used as the slope"),
    ("edm_euler_step", step_body(update="d0"), "returned x̂₀ instead of the next sample"),
    ("edm_euler_step", step_body(update="x + (sigma - sigma_next) * (x - d0) / sigma"),
     "the step taken back up in noise"),
    ("edm_euler_step", step_body(cast=""), "left in float32 for a float16 model"),
    ("edm_euler_step",  # the slope divided by σ_next (infinite at the last step, wrong before it)
     step_body(update="x + (sigma_next - sigma) * (x - d0) / sigma_next"), "the slope divided by σ_next"),
    ("edm_euler_step",  # a blind learner's: x̂₀ preconditioned at σ_next
     """
    d0 = edm_denoised(sample, model_output, sigma_next.reshape(1).expand(sample.shape[0]), sigma_data, prediction_type)
    x = sample.float()
    return (x + (sigma_next - sigma) * (x - d0) / sigma).to(model_output.dtype)
    """, "x̂₀ preconditioned at σ_next"),
    ("edm_euler_step",  # the slope's sign flipped: (x̂₀ − x)/σ walks away from the data
     step_body(update="x + (sigma_next - sigma) * (d0 - x) / sigma"), "the step taken back up in noise"),
    ("edm_euler_step",  # x̂₀ mixed from the network's input c_in·x (the skip term on the scaled sample)
     """
    x_in = (sample.double() / (sigma.double() ** 2 + sigma_data ** 2) ** 0.5).to(sample.dtype)
    d0 = edm_denoised(x_in, model_output, sigma.reshape(1).expand(sample.shape[0]), sigma_data, prediction_type)
    x = sample.float()
    return (x + (sigma_next - sigma) * (x - d0) / sigma).to(model_output.dtype)
    """, "x̂₀ mixed from the network's input c_in·x"),
    ("edm_denoised",  # v_prediction's sign put on c_skip instead of c_out
     denoised_body(c_skip="k * sigma_data ** 2 / (s ** 2 + sigma_data ** 2)",
                   c_out="s * sigma_data / (s ** 2 + sigma_data ** 2) ** 0.5"), "for v_prediction, c_skip's sign flipped"),
    ("sigma_to_t", t_body(t="j + 1 - w"), "the interpolation weights swapped"),
    ("sigma_to_t",  # a blind learner's: j clamped above only, t clamped at the end
     t_body(low="(torch.searchsorted(lt, ls, right=True) - 1).clamp(max=len(lt) - 2)", w="(ls - lt[j]) / (lt[j + 1] - lt[j])",
            t="(j + w).clamp(0, len(lt) - 1)"),
     "the index j clamped above only"),
    ("karras_sigmas",  # arange(n)/(n − 1): 0/0 for a single step
     ladder_body(ramp="torch.arange(num_inference_steps, dtype=torch.float64) / (num_inference_steps - 1)"),
     "the ramp as arange(n)/(n − 1)"),
]



def loop_body(start="sample", rungs="range(len(sigmas) - 1)", x_in="x_in", c_noise="c_noise[0]", calls=1) -> str:
    """A body for edm_sample (calling the solution's helpers) with one line swapped for a wrong one."""
    call = " + ".join([f"network({x_in}, {c_noise})"] * calls) + (f") / {calls}" if calls > 1 else "")
    call = f"({call}" if calls > 1 else call
    return f"""
    x = {start}
    for i in {rungs}:
        x_in, c_noise = edm_model_inputs(x, sigmas[i].reshape(1).expand(x.shape[0]), sigma_data)
        model_output = {call}
        x = edm_euler_step(model_output, x, sigmas[i], sigmas[i + 1], sigma_data, prediction_type)
    return x
    """


MUTANTS += [
    ("edm_sample", loop_body(x_in="x"), "the network fed x itself"),
    ("edm_sample", loop_body(start="(sample.float() * sigmas[0]).to(sample.dtype)"),
     "the starting sample multiplied by σ_0 again"),
    ("edm_sample",  # the step onto σ = 0 skipped: its call count says so before any value is compared
     loop_body(rungs="range(len(sigmas) - 2)"), Fails("wrong", "the last step lands on σ = 0")),
    ("edm_sample",  # the network fed σ itself as its noise label
     loop_body(c_noise="sigmas[i]"), Fails("wrong")),
    ("edm_sample",  # two network calls per step (averaged): right values, twice the calls
     loop_body(calls=2), Fails("wrong", "only")),
    ("edm_sample",  # a blind learner's: the noise label cast to the sample's dtype (float16 runs)
     loop_body(c_noise="c_noise[0].to(x.dtype)"), "c_noise cast to the sample's dtype"),
    ("edm_sample",  # a blind learner's: σ_data passed to the step but not to edm_model_inputs
     loop_body().replace("expand(x.shape[0]), sigma_data)", "expand(x.shape[0]))"),
     "σ_data not passed on to edm_model_inputs"),
    ("edm_sample",  # a blind learner's: the network called sample by sample
     """
     x = sample
     for i in range(len(sigmas) - 1):
         x_in, c_noise = edm_model_inputs(x, sigmas[i].reshape(1).expand(x.shape[0]), sigma_data)
         model_output = torch.cat([network(x_in[b:b + 1], c_noise[0]) for b in range(x.shape[0])])
         x = edm_euler_step(model_output, x, sigmas[i], sigmas[i + 1], sigma_data, prediction_type)
     return x
     """, "the network called once per sample"),
    ("edm_euler_step",  # a blind learner's: σ_data not passed on to edm_denoised
     step_body().replace("sigma_data, prediction_type)", "prediction_type=prediction_type)"),
     "σ_data not passed on to edm_denoised"),
    ("edm_denoised",  # a blind learner's: σ_data = 0.5 written in
     denoised_body(c_skip="0.25 / (s ** 2 + 0.25)", c_out="k * s * 0.5 / (s ** 2 + 0.25) ** 0.5"),
     "σ_data fixed at 0.5"),
    ("edm_model_inputs",  # a blind learner's: the first sample's c_in for all, c_noise per sample
     inputs_body(c_in="(1 / (s[:1] ** 2 + sigma_data ** 2) ** 0.5).expand(s.shape[0])"),
     "c_in from the first sample's σ for the whole batch"),
    ("karras_sigmas",  # a blind learner's: _convert_to_karras copied with its ρ = 7
     ladder_body().replace("lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)",
                           "rho = 7.0\n    lo, hi = sigma_min ** (1 / rho), sigma_max ** (1 / rho)"),
     "ρ fixed at 7 (the rho argument ignored)"),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("edm_denoised",  # diffusers' own arithmetic: c_out·F in the model's dtype, the sum in float32
     """
     s = sigma.float().reshape(-1, 1, 1, 1)
     c_skip = sigma_data ** 2 / (s ** 2 + sigma_data ** 2)
     c_out = s * sigma_data / (s ** 2 + sigma_data ** 2) ** 0.5 * (-1 if prediction_type == "v_prediction" else 1)
     return c_skip * sample.float() + c_out.to(model_output.dtype) * model_output
     """,
     "diffusers' own order: the product with F in a float16 model's dtype, returned float32"),
    ("karras_sigmas",
     ladder_body(ramp="torch.linspace(0, 1, num_inference_steps)"),
     "the ladder in float32 throughout (a few float32 ulps from diffusers' float64-then-cast)"),
    ("karras_sigmas",
     """
     n = num_inference_steps
     i = torch.arange(n, dtype=torch.float64)
     ramp = i / (n - 1) if n > 1 else i
     s = torch.exp(rho * torch.log(sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))))
     return torch.cat([s.float(), torch.zeros(1)])
     """,
     "i/(n − 1) written out and the power as exp(ρ·ln(…))"),
    ("sigma_to_t",
     """
     import numpy as np
     lt = np.log(train_sigmas.double().numpy())
     return torch.from_numpy(np.interp(np.log(sigmas.double().numpy()), lt, np.arange(len(lt)))).float()
     """,
     "numpy's interp on the log σ table (it clamps at both ends)"),
    ("sigma_to_t",
     t_body(logs="train_sigmas.log(), sigmas.log()",
            low="(torch.searchsorted(lt, ls, right=True) - 1).clamp(0, len(lt) - 2)"),
     "the interpolation in float32 (diffusers' table is float32 too)"),
    ("edm_model_inputs",
     """
     c_in = torch.rsqrt(sigma ** 2 + sigma_data ** 2)[:, None, None, None]
     return sample * c_in.to(sample.dtype), torch.log(sigma) / 4
     """,
     "rsqrt, and the product in the sample's dtype (diffusers' own order for a float16 sample)"),
    ("edm_denoised",
     """
     s = sigma.double().reshape(-1, 1, 1, 1)
     c_skip = sigma_data ** 2 / (s ** 2 + sigma_data ** 2)
     c_out = s * sigma_data * torch.rsqrt(s ** 2 + sigma_data ** 2)
     if prediction_type == "v_prediction":
         c_out = -c_out
     return (sample.double() - (1 - c_skip) * sample.double() + c_out * model_output.double()).float()
     """,
     "c_skip written as 1 − σ²/(σ² + σ_data²) applied to x, rsqrt for c_out"),
    ("edm_denoised",
     denoised_body(s="sigma.reshape(-1, 1, 1, 1)", c_skip="sigma_data ** 2 / (s ** 2 + sigma_data ** 2)"),
     "the coefficients in float32 (diffusers' own precision)"),
    ("edm_euler_step",
     step_body(update="x + (sigma_next / sigma - 1) * (x - d0)"),
     "the step size folded into a ratio: x + (σ_next/σ − 1)·(x − x̂₀)"),
    ("edm_euler_step",
     step_body(update="d0 + (sigma_next / sigma) * (x - d0)"),
     "x̂₀ plus the remaining noise scaled by σ_next/σ: the same Euler step, re-associated (DDIM in σ)"),
    ("edm_sample",
     """
     x = sample
     for i in range(len(sigmas) - 1):
         s, s_next = sigmas[i], sigmas[i + 1]
         c_in = (s ** 2 + sigma_data ** 2) ** -0.5
         F = network((x.float() * c_in).to(x.dtype), torch.log(s) / 4).float()
         c_skip = sigma_data ** 2 / (s ** 2 + sigma_data ** 2)
         c_out = s * sigma_data * c_in * (-1 if prediction_type == "v_prediction" else 1)
         d = (x.float() - (c_skip * x.float() + c_out * F)) / s
         x = (x.float() + (s_next - s) * d).to(sample.dtype)
     return x
     """,
     "the whole loop inline in float32, without the lab's helpers"),
]


def test_calling_the_edm_schedulers_step_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "edm_euler_step", """
        from diffusers.schedulers.scheduling_edm_euler import EDMEulerScheduler
        s = EDMEulerScheduler(sigma_data=sigma_data, prediction_type=prediction_type)
        s.sigmas = torch.stack([sigma, sigma_next])
        s._step_index = 0
        return s.step(model_output, s.precondition_noise(sigma), sample).prev_sample
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_calling_a_schedulers_copy_of_sigma_to_t_is_refused_too(grade_mutant):
    graded = grade_mutant(LAB, "sigma_to_t", """
        import numpy as np
        from diffusers import DPMSolverMultistepScheduler
        s = DPMSolverMultistepScheduler()
        lt = np.log(train_sigmas.double().numpy())
        return torch.from_numpy(s._sigma_to_t(sigmas.double().numpy(), lt)).float()
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_changing_the_sample_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "edm_model_inputs", """
        c = (1 / (sigma ** 2 + sigma_data ** 2) ** 0.5).reshape(-1, 1, 1, 1)
        return sample.mul_(c.to(sample.dtype)), 0.25 * sigma.log()
    """)
    assert graded.status == "failed"
    assert "changed its input(s) sample in place" in graded.text


def test_the_euler_karras_ladder_spans_the_training_table_as_the_lesson_says():
    # The lesson's claims about diffusers, checked on diffusers itself: σ_max and σ_min are the ends of the
    # training table, ρ is 7, and t is interpolated in log σ (so the first timestep is exactly T − 1).
    import math

    from diffusers import EulerDiscreteScheduler

    s = EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                               use_karras_sigmas=True)
    table = s.sigmas[:-1].flip(0).clone()
    s.set_timesteps(10)
    assert math.isclose(float(s.sigmas[0]), float(table[-1]), rel_tol=1e-6)
    assert math.isclose(float(s.sigmas[-2]), float(table[0]), rel_tol=1e-6)
    assert float(s.sigmas[-1]) == 0.0 and len(s.sigmas) == 11
    assert float(s.timesteps[0]) == 999.0 and float(s.timesteps[-1]) == 0.0
    assert any(float(t) != round(float(t)) for t in s.timesteps)  # fractional timesteps


def test_edm_with_sigma_data_one_is_lab_03s_euler_v_prediction_as_the_lesson_says():
    import torch
    from diffusers import EDMEulerScheduler

    s = EDMEulerScheduler(sigma_data=1.0, prediction_type="v_prediction")
    x, v, sigma = torch.randn(2, 4, 4, 4, dtype=torch.float64), torch.randn(2, 4, 4, 4, dtype=torch.float64), 3.7
    euler = x / (sigma**2 + 1) - sigma / (sigma**2 + 1) ** 0.5 * v
    assert torch.allclose(s.precondition_outputs(x, v, sigma), euler, rtol=1e-12, atol=1e-12)
    assert torch.allclose(s.precondition_inputs(x, sigma), x / (sigma**2 + 1) ** 0.5, rtol=1e-12, atol=1e-12)


def _grader():
    path = REPO / "graders" / f"{LAB}.py"
    spec = importlib.util.spec_from_file_location(f"_test_grader_{LAB}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cases_vary_what_the_brief_of_this_lab_asks_for():
    # n, ρ, σ_min/σ_max, prediction type, σ_data, float16 and float32, batches > 1 with per-sample σs, and
    # σs outside the training table (the clamp).
    grader = _grader()
    assert len({c["num_inference_steps"] for c in grader.EDM_LADDER_CASES}) >= 5
    assert {c["rho"] for c in grader.EDM_LADDER_CASES} >= {1.0, 3.0, 7.0, 12.0}
    assert len({(c["sigma_min"], c["sigma_max"]) for c in grader.EDM_LADDER_CASES}) >= 3
    assert any("config_sigma_max" in c for c in grader.EULER_LADDER_CASES)
    assert len({c.get("betas") for c in grader.EULER_LADDER_CASES}) == 3
    assert any(c["low"] < 1 for c in grader.CUSTOM_SIGMA_CASES) and any(c["high"] > 1 for c in grader.CUSTOM_SIGMA_CASES)
    assert {c["prediction_type"] for c in grader.DENOISED_CASES} == {c["prediction_type"] for c in grader.STEP_CASES} \
        == {"epsilon", "v_prediction"}
    assert {c["dtype"] for c in grader.PRECONDITION_CASES} == {c["dtype"] for c in grader.STEP_CASES} \
        == {"float16", "float32"}
    assert len({c["sigma_data"] for c in grader.PRECONDITION_CASES}) >= 3
    assert any(c["shape"][0] > 1 for c in grader.PRECONDITION_CASES + grader.DENOISED_CASES + grader.STEP_CASES)
