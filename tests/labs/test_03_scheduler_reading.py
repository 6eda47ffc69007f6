"""Lab 03: wrong-but-plausible implementations fail, and the commonest ones are named."""
import importlib.util
from fractions import Fraction
from pathlib import Path

from expect import Fails

LAB = "03_scheduler_reading"
REPO = Path(__file__).resolve().parents[2]


def timesteps_body(leading="(torch.arange(n) * (T // n)).flip(0) + steps_offset",
                   trailing="((T - torch.arange(n, dtype=torch.float64) * (T / n)).round() - 1).long()",
                   linspace="torch.linspace(0, T - 1, n, dtype=torch.float64).round().flip(0).long()") -> str:
    """A body for inference_timesteps with one branch swapped for a wrong one."""
    return f"""
    n, T = num_inference_steps, num_train_timesteps
    if timestep_spacing == "leading":
        return {leading}
    if timestep_spacing == "trailing":
        return {trailing}
    return {linspace}
    """


def step_body(x0_eps="x - sigma * model_output",
              x0_v="model_output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)",
              x0_sample="model_output",
              upcast="sample.to(torch.float32)",
              result="x + (x - x0) / sigma * (sigma_next - sigma)") -> str:
    """A body for euler_step with one line swapped for a wrong one."""
    return f"""
    x = {upcast}
    x0 = {x0_v} if prediction_type == "v_prediction" else {x0_sample} if prediction_type == "sample" else {x0_eps}
    return ({result}).to(model_output.dtype)
    """


LOG_LINEAR = "torch.linspace(float(table[-1].log()), float(table[0].log()), timesteps.shape[0] + 1).double().exp()"


def sigmas_body(table="((1 - alphas_cumprod) / alphas_cumprod) ** 0.5", t="timesteps.double()",
                end="torch.cat([s, last]).float()", floor="2**-24", log_linear=LOG_LINEAR,
                last="table[:1] if final_sigmas_type == 'sigma_min' else s.new_zeros(1)") -> str:
    """A body for euler_sigmas with one line swapped for a wrong one."""
    return f"""
    T = alphas_cumprod.shape[0]
    alphas_cumprod = alphas_cumprod.clamp(min={floor})
    table = ({table}).double()
    t = {t}
    lo = t.floor().long()
    hi = (lo + 1).clamp(max=T - 1)
    s = (table[hi] - table[lo]) * (t - lo) + table[lo]
    if interpolation_type == "log_linear":
        s = {log_linear}
    last = {last}
    return {end}
    """


MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("inference_timesteps",  # a blind learner's: ties rounded half up
     timesteps_body(linspace="(torch.linspace(0, T - 1, n, dtype=torch.float64) + 0.5).floor().flip(0).long()"),
     "'linspace' rounded half up"),
    ("inference_timesteps",  # a blind learner's: the grid built descending ([999] for one step)
     timesteps_body(linspace="torch.linspace(T - 1, 0, n, dtype=torch.float64).round().long()"),
     "'linspace' built descending"),
    ("inference_timesteps", timesteps_body(leading="torch.arange(n) * (T // n) + steps_offset"),
     "ascending order"),
    ("inference_timesteps",
     timesteps_body(leading="(torch.arange(n, dtype=torch.float64) * (T / n)).round().flip(0).long() + steps_offset"),
     "'leading' with the float spacing T/n"),
    ("inference_timesteps",
     timesteps_body(trailing="((T - torch.arange(n, dtype=torch.float64) * (T / n)).round() - 1).long() + steps_offset",
                    linspace="torch.linspace(0, T - 1, n, dtype=torch.float64).round().flip(0).long() + steps_offset"),
     "steps_offset added for"),
    ("inference_timesteps", timesteps_body(leading="(torch.arange(n) * (T // n)).flip(0)"),
     "steps_offset ignored for 'leading'"),
    ("inference_timesteps",
     timesteps_body(trailing="(T - torch.arange(n, dtype=torch.float64) * (T / n)).round().long()"),
     "'trailing' without the final −1"),
    ("inference_timesteps", timesteps_body(trailing="T - 1 - torch.arange(n) * (T // n)"),
     "'trailing' with the integer spacing T//n"),
    ("inference_timesteps", timesteps_body(linspace="torch.linspace(0, T - 1, n, dtype=torch.float64).flip(0).long()"),
     "'linspace' truncated"),
    # the training schedule walked one timestep at a time (the lesson's second trap)
    ("inference_timesteps", timesteps_body(leading="T - 1 - torch.arange(n)", trailing="T - 1 - torch.arange(n)",
                                           linspace="T - 1 - torch.arange(n)"),
     "n consecutive training timesteps"),
    ("inference_timesteps", timesteps_body(linspace="torch.linspace(0, T, n, dtype=torch.float64).round().flip(0).long()"),
     "'linspace' over [0, T]"),
    ("inference_timesteps",  # a loop counter is not a schedule (the lesson's first trap)
     "return torch.arange(num_inference_steps).flip(0)", "the loop counter n−1, …, 0"),
    ("inference_timesteps",  # the right values as float: DDIM's timesteps are int64
     timesteps_body(leading="((torch.arange(n) * (T // n)).flip(0) + steps_offset).double()"), Fails("wrong", "has dtype")),
    ("euler_timesteps",
     "return inference_timesteps(num_inference_steps, num_train_timesteps, timestep_spacing, steps_offset)",
     "DDIM's int64 timesteps reused"),
    ("euler_timesteps",  # a blind learner's: steps_offset added whatever the spacing
     """
     import numpy as np
     n, T = num_inference_steps, num_train_timesteps
     if timestep_spacing == "linspace":
         ts = np.linspace(0, T - 1, n, dtype=np.float32)[::-1].copy()
     elif timestep_spacing == "leading":
         ts = (np.arange(0, n) * (T // n)).round()[::-1].copy().astype(np.float32)
     elif timestep_spacing == "trailing":
         ts = np.arange(T, 0, -T / n).round().astype(np.float32) - 1
     else:
         raise ValueError(f"unknown timestep_spacing {timestep_spacing}")
     ts = ts + np.float32(steps_offset)
     return torch.from_numpy(ts.astype(np.float32))
     """, "steps_offset added to every spacing"),
    ("euler_timesteps",
     "return inference_timesteps(num_inference_steps, num_train_timesteps, timestep_spacing, steps_offset).float()",
     "'linspace' rounded to integers"),
    ("euler_timesteps",
     """
     if timestep_spacing == "linspace":
         return torch.linspace(0, num_train_timesteps - 1, num_inference_steps)
     return inference_timesteps(num_inference_steps, num_train_timesteps, timestep_spacing,
                                steps_offset).flip(0).float()
     """,
     "ascending order"),
    ("euler_sigmas", sigmas_body(end="s.float()"), "no final σ = 0"),
    ("euler_sigmas",  # a blind learner's: 'sigma_min' as the ladder's own smallest σ
     sigmas_body(last="s.min().reshape(1) if final_sigmas_type == 'sigma_min' else s.new_zeros(1)"),
     "'sigma_min' read as the ladder's smallest σ"),
    ("euler_sigmas",
     """
     T = alphas_cumprod.shape[0]
     t = timesteps.double()
     lo = t.floor().long()
     hi = (lo + 1).clamp(max=T - 1)
     a = (alphas_cumprod.double()[hi] - alphas_cumprod.double()[lo]) * (t - lo) + alphas_cumprod.double()[lo]
     s = ((1 - a) / a) ** 0.5
     return torch.cat([s, s.new_zeros(1)]).float()
     """,
     "ᾱ interpolated, then turned into σ"),
    ("euler_sigmas", sigmas_body(t="timesteps.round().double()"), "σ read at the rounded timestep"),
    ("euler_sigmas", sigmas_body(table="(1 - alphas_cumprod) ** 0.5"), "σ = √(1 − ᾱ)"),
    ("euler_sigmas", sigmas_body(table="(alphas_cumprod / (1 - alphas_cumprod)) ** 0.5"), "σ = √(ᾱ/(1 − ᾱ))"),
    ("euler_sigmas",  # the ladder in the wrong order
     sigmas_body(end="torch.cat([s.flip(0), s.new_zeros(1)]).float()"), Fails("wrong", "values differ")),
    ("euler_sigmas", "return torch.cat([(((1 - alphas_cumprod) / alphas_cumprod) ** 0.5)[timesteps.long()], "
                     "torch.zeros(1)])", "σ looked up at int(t)"),
    ("euler_sigmas",  # the final 0 put first
     sigmas_body(end="torch.cat([s.new_zeros(1), s]).float()"), Fails("wrong", "values differ")),
    # the options: ᾱ = 0 at the zero-terminal-SNR end, the final σ, log-linear spacing
    ("euler_sigmas", sigmas_body(floor="0"), "σ from ᾱ = 0"),
    ("euler_sigmas", sigmas_body(last="s.new_zeros(1)"), "final σ = 0 whatever final_sigmas_type says"),
    ("euler_sigmas", sigmas_body(log_linear="_interp_log(table, t)").replace(
        "    T = alphas_cumprod.shape[0]\n",
        "    T = alphas_cumprod.shape[0]\n"
        "    def _interp_log(table, t):\n"
        "        lo = t.floor().long(); hi = (lo + 1).clamp(max=T - 1)\n"
        "        return ((table[hi].log() - table[lo].log()) * (t - lo) + table[lo].log()).exp()\n"),
     "'log_linear' read as log σ interpolated at the timesteps"),
    ("euler_sigmas",  # 'sigma_min' read as the smallest σ of the ladder, σ(t_{n−1}), not the table's σ_0
     sigmas_body(last="s[-1:] if final_sigmas_type == 'sigma_min' else s.new_zeros(1)"), Fails("wrong", "values differ")),
    ("init_noise_sigma", "return float(sigmas.max())", "σ_max for every spacing"),
    ("init_noise_sigma", "return (float(sigmas.max()) ** 2 + 1) ** 0.5", "√(σ_max² + 1) for every spacing"),
    ("init_noise_sigma", "return 1.0", "1.0, as for DDPM/DDIM"),
    ("init_noise_sigma",  # the smallest σ is 0: the end of the ladder, not its start
     "return float(sigmas[-1])", Fails("wrong", "expected")),
    ("init_noise_sigma",  # a blind learner's: the two rules swapped
     "sigma_max = float(sigmas.max())\nif timestep_spacing in ('linspace', 'trailing'):\n"
     "    return (sigma_max**2 + 1) ** 0.5\nreturn sigma_max", "the two rules swapped"),
    ("euler_scale_model_input", "return sample * (sigma**2 + 1) ** 0.5", "multiplied by √(σ² + 1)"),
    ("euler_scale_model_input", "return sample / sigma", "divided by σ"),
    ("euler_scale_model_input", "return sample / (sigma**2 + 1)", "divided by σ² + 1"),
    ("euler_scale_model_input",  # a blind learner's: σ in float16, σ² inf at zero terminal SNR
     "s = sigma.to(sample.dtype)\nreturn sample / (s * s + 1).sqrt()", "σ cast to the sample's float16"),
    ("euler_scale_model_input",  # DDPM's coefficient √ᾱ is right, but this is √(1 − ᾱ)
     "return sample * sigma / (sigma**2 + 1) ** 0.5", Fails("wrong", "values differ")),
    ("euler_step", step_body(result="x + (x - x0) / sigma * (sigma - sigma_next)"), "step size σ − σ_next"),
    ("euler_step",  # a blind learner's: cast back to the sample's dtype (float32 latents, a float16 model)
     step_body().replace(".to(model_output.dtype)", ".to(sample.dtype)"),
     "computed in float32 and never cast back to float16"),
    ("euler_step", step_body(x0_v="x - sigma * model_output"), "v-prediction treated as ε"),
    ("euler_step", step_body(x0_v="model_output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1) ** 0.5"),
     "v-prediction's x̂_0 taken on the unscaled latent"),
    ("euler_step", step_body(result="x0"), "returned x̂_0 instead of the next latent"),
    ("euler_step", step_body(upcast="sample"), "computed in float16"),
    ("euler_step",  # a blind learner's: σ and σ_next cast to the model's dtype as well
     "\n    sigma, sigma_next = sigma.to(model_output.dtype), sigma_next.to(model_output.dtype)"
     + step_body(upcast="sample.to(model_output.dtype)"), "σ cast to float16 too"),
    ("euler_step", step_body(x0_sample="x - sigma * model_output"), "an x̂0 prediction ('sample') treated as ε"),
    ("euler_step", step_body(result="x + (x - x0) * (sigma_next - sigma)"), "the derivative not divided by σ"),
    ("euler_step",  # x̂_0 read at the wrong noise level
     step_body(x0_eps="x - sigma_next * model_output"), Fails("wrong", "values differ")),
    ("euler_step",  # the output left in float32 for a float16 model
     """
     x = sample.to(torch.float32)
     x0 = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1) if prediction_type == "v_prediction" else x - sigma * model_output
     if prediction_type == "sample":
         x0 = model_output
     return x + (x - x0) / sigma * (sigma_next - sigma)
     """,
     Fails("wrong", "has dtype")),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("euler_step",
     step_body(upcast="sample.double()",
               x0_eps="x - sigma.double() * model_output.double()",
               x0_v="model_output.double() * (-sigma.double() / (sigma.double()**2 + 1) ** 0.5) "
                    "+ x / (sigma.double()**2 + 1)",
               result="x + (x - x0) / sigma.double() * (sigma_next.double() - sigma.double())"),
     "the step in float64: with zero terminal SNR at σ = 4096 (v-prediction) diffusers' float32 step is "
     "1.1e-3 from exact math (|diff| 1.3e-3 vs diffusers, outside the old 2.0e-4)"),
    ("euler_sigmas", sigmas_body(table="((1 - alphas_cumprod.double()) / alphas_cumprod.double()) ** 0.5"),
     "the σ table in float64 instead of float32"),
    ("euler_sigmas",
     sigmas_body(log_linear="torch.linspace(table[-1].log().item(), table[0].log().item(), timesteps.shape[0] + 1, "
                            "dtype=torch.float64).exp()"),
     "the log-linear ladder in float64 (diffusers spaces float32 logs)"),
    ("euler_sigmas",  # σ = ∞ at ᾱ = 0 replaced by the float16-subnormal value by hand
     sigmas_body(floor="0").replace("    table = (", "    alphas_cumprod = torch.where(alphas_cumprod == 0, "
                                    "torch.tensor(2.0**-24), alphas_cumprod)\n    table = ("),
     "ᾱ = 0 replaced by 2**-24 with torch.where instead of a clamp"),
    ("euler_scale_model_input", "return (sample.double() / (sigma.double() ** 2 + 1) ** 0.5).to(sample.dtype)",
     "float64 then cast"),
]


def test_the_same_euler_step_written_as_x0_plus_sigma_next_eps_passes(grade_mutant):
    # x + (σ_next − σ)·(x − x̂_0)/σ = x̂_0 + σ_next·ε for ε-prediction: the same step, other float ops.
    graded = grade_mutant(LAB, "euler_step", """
        x = sample.to(torch.float32)
        if prediction_type == "v_prediction":
            x0 = model_output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)
            return (x + (x - x0) / sigma * (sigma_next - sigma)).to(model_output.dtype)
        if prediction_type == "sample":  # x + (σ_next − σ)·(x − x̂_0)/σ = x̂_0 + σ_next/σ·(x − x̂_0)
            return (model_output + sigma_next / sigma * (x - model_output)).to(model_output.dtype)
        return (x - sigma * model_output + sigma_next * model_output).to(model_output.dtype)
    """)
    assert graded.status == "passed", graded


def test_python_float_sigmas_are_accepted_by_scale_model_input(grade_mutant):
    graded = grade_mutant(LAB, "euler_scale_model_input", "return sample / ((float(sigma) ** 2 + 1) ** 0.5)")
    assert graded.status == "passed", graded


def test_reading_init_noise_sigma_off_a_scheduler_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "init_noise_sigma", """
        from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
        s = EulerDiscreteScheduler(timestep_spacing=timestep_spacing)
        s.sigmas = sigmas
        return float(s.init_noise_sigma)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_calling_the_diffusers_answer_key_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "inference_timesteps", """
        from diffusers.schedulers.scheduling_ddim import DDIMScheduler
        s = DDIMScheduler(num_train_timesteps=num_train_timesteps, timestep_spacing=timestep_spacing,
                          steps_offset=steps_offset)
        s.set_timesteps(num_inference_steps)
        return s.timesteps
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_changing_the_latent_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "euler_scale_model_input", "return sample.div_((sigma**2 + 1) ** 0.5)")
    assert graded.status == "failed"
    assert "changed its input(s) sample in place" in graded.text


def _grader():
    path = REPO / "graders" / f"{LAB}.py"
    spec = importlib.util.spec_from_file_location(f"_test_grader_{LAB}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def exact_timesteps(n: int, T: int, spacing: str, offset: int) -> list[int]:
    """The timesteps in exact rational arithmetic, rounded half to even (Python's round on a Fraction)."""
    if spacing == "leading":
        return [i * (T // n) + offset for i in range(n)][::-1]
    if spacing == "trailing":
        return [round(T - Fraction(i * T, n)) - 1 for i in range(n)]
    if n == 1:  # linspace(0, T − 1, 1) is [0]: its start
        return [0]
    return [round(Fraction(i * (T - 1), n - 1)) for i in range(n)][::-1]


def test_every_graded_step_count_is_one_where_diffusers_equals_exact_arithmetic():
    # numpy's float64 grids flip an exact .5 for some step counts (T=1000: linspace n=27, trailing n=48):
    # the grader must not use those, or a learner's exact formula would be marked wrong.
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    grader = _grader()
    for case in grader.DDIM_CASES + grader.DDPM_CASES:
        n, T = case["num_inference_steps"], case.get("num_train_timesteps", 1000)
        spacing, offset = case["timestep_spacing"], case["steps_offset"]
        s = DDIMScheduler(num_train_timesteps=T, timestep_spacing=spacing, steps_offset=offset)
        s.set_timesteps(n)
        assert s.timesteps.tolist() == exact_timesteps(n, T, spacing, offset), case


def test_init_noise_sigma_as_a_0_dim_tensor_fails_as_its_docstring_says_and_names_the_fix(grade_mutant):
    # One rule: where the reference is a Python number, so is the answer (the docstring says so, and that
    # diffusers' own property is a 0-dim tensor)
    graded = grade_mutant("03_scheduler_reading", "init_noise_sigma", """
        sigma_max = sigmas.max()
        return sigma_max if timestep_spacing in ("linspace", "trailing") else (sigma_max**2 + 1) ** 0.5
    """, "-m", "not budget")
    assert graded.status == "failed", graded
    assert "should be a Python float" in graded.text and "use .item()" in graded.text, graded.text
    doc = (REPO / "katas" / "03_scheduler_reading.py").read_text(encoding="utf-8")
    assert "Returns: a Python float (diffusers' property answers a 0-dim tensor" in doc
