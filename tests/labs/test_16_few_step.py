"""Lab 16: wrong-but-plausible implementations fail, and the commonest ones are named."""
import re
import importlib.util
from pathlib import Path

from expect import Fails

LAB = "16_few_step"
REPO = Path(__file__).resolve().parents[2]


def ladder_body(origin="torch.arange(1, N + 1, dtype=torch.int64) * k - 1",
                index="torch.arange(n, dtype=torch.int64) * N // n", out="origin.flip(0)[index]",
                setup="") -> str:
    """A body for lcm_timesteps with one line swapped for a wrong one."""
    return f"""
    n, N, T = num_inference_steps, original_inference_steps, num_train_timesteps
    {setup}
    k = T // N
    origin = {origin}
    index = {index}
    return {out}
    """


def scalings_body(tau="timestep * timestep_scaling", c_skip="sd2 / (tau**2 + sd2)",
                  c_out="tau / (tau**2 + sd2) ** 0.5", sd2="0.5**2") -> str:
    """A body for boundary_scalings with one line swapped for a wrong one."""
    return f"""
    sd2 = {sd2}
    tau = {tau}
    c_skip = {c_skip}
    c_out = {c_out}
    return float(c_skip), float(c_out)
    """


def step_body(x0_v="a**0.5 * x - (1 - a) ** 0.5 * out", scaling="timestep_scaling",
              denoised="c_skip * x + c_out * x0", last="i == len(ladder) - 1", nxt="ladder[i + 1]",
              z="torch.randn(model_output.shape, generator=generator, dtype=dtype)", wide="float") -> str:
    """A body for lcm_step with one line swapped for a wrong one."""
    return f"""
    dtype = model_output.dtype
    ladder = [int(t) for t in timesteps.tolist()]
    i = ladder.index(int(timestep))
    last = {last}
    a = alphas_cumprod[timestep].{wide}()
    x, out = sample.{wide}(), model_output.{wide}()
    if prediction_type == "epsilon":
        x0 = (x - (1 - a) ** 0.5 * out) / a**0.5
    elif prediction_type == "v_prediction":
        x0 = {x0_v}
    else:
        x0 = out
    c_skip, c_out = boundary_scalings(timestep, {scaling})
    denoised = ({denoised}).to(dtype)
    if last:
        return denoised, denoised
    a_next = alphas_cumprod[{nxt}].{wide}()
    z = {z}
    prev = a_next**0.5 * denoised.{wide}() + (1 - a_next) ** 0.5 * z.{wide}()
    return prev.to(dtype), denoised
    """


def turbo_body(t="[round(T - j * T / n) - 1 for j in range(n)]", dtype="torch.float32",
               table="sigma_table(alphas_cumprod)", out="timesteps, torch.cat([sigmas, sigmas.new_zeros(1)])") -> str:
    """A body for turbo_schedule with one line swapped for a wrong one."""
    return f"""
    n, T = num_inference_steps, alphas_cumprod.shape[0]
    timesteps = torch.tensor({t}, dtype={dtype})
    sigmas = ({table})[timesteps.long()]
    return {out}
    """


def loop_body(guide="guidance_scale > 1", start="latents * scheduler.init_noise_sigma",
              x_in="scheduler.scale_model_input(torch.cat([x, x]) if guide else x, t)",
              call="unet(x_in, t, encoder_hidden_states=text).sample",
              combine="noise_uncond + guidance_scale * (noise_text - noise_uncond)",
              step="scheduler.step(noise_pred, t, x, generator=generator).prev_sample") -> str:
    """A body for few_step_sample with one line swapped for a wrong one."""
    return f"""
    guide = {guide}
    scheduler.set_timesteps(num_inference_steps)
    x = {start}
    text = torch.cat([negative_prompt_embeds, prompt_embeds]) if guide else prompt_embeds
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            x_in = {x_in}
            noise_pred = {call}
            if guide:
                noise_uncond, noise_text = noise_pred.chunk(2)
                noise_pred = {combine}
            x = {step}
    return x
    """


MUTANTS = [
    ("lcm_step", step_body(x0_v="a**0.5 * x + (1 - a) ** 0.5 * out"), "v-prediction's x̂₀ with the sign flipped"),
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("lcm_timesteps", ladder_body(out="(torch.arange(n) * (T // n)).flip(0)"), "DDIM's leading spacing"),
    ("lcm_timesteps", ladder_body(out="torch.tensor([round(T - j * T / n) - 1 for j in range(n)])"),
     "trailing spacing over all T timesteps"),
    ("lcm_timesteps", ladder_body(origin="torch.arange(1, N + 1, dtype=torch.int64) * k"),
     "distillation ladder k·i without the − 1"),
    ("lcm_timesteps", ladder_body(out="origin.flip(0)[:n]"), "the first n rungs instead of n evenly spaced ones"),
    ("lcm_timesteps", ladder_body(index="torch.tensor([j * (N - 1) // (n - 1) if n > 1 else 0 for j in range(n)])"),
     "indices from linspace(0, N − 1, n)"),
    ("lcm_timesteps", ladder_body(setup="N = 50"), "original_inference_steps ignored (always 50)"),
    ("lcm_timesteps", ladder_body(index="torch.arange(n, dtype=torch.int64) * (N // n)"),  # a blind learner's
     "a fixed stride of N // n rungs"),
    ("lcm_timesteps",  # a blind learner's: the ladder from the top, T − 1 − k·i
     ladder_body(out="torch.tensor([T - 1 - k * i for i in range(N)])[index]"),
     "the ladder counted down from T − 1 in steps of k"),
    ("lcm_timesteps",  # a blind learner's: rounded linspace with its endpoint
     ladder_body(index="torch.tensor([round(j * (N - 1) / (n - 1)) if n > 1 else 0 for j in range(n)])"),
     "indices from linspace(0, N − 1, n) rounded"),
    ("boundary_scalings", scalings_body(c_out="1 - sd2 / (tau**2 + sd2)"), "c_out = 1 − c_skip"),
    ("turbo_schedule",  # a blind learner's: final_sigmas_type="sigma_min"
     turbo_body(out="timesteps, torch.cat([sigmas, sigma_table(alphas_cumprod)[:1]])"),
     "the σ ladder ended with σ_min"),
    ("lcm_timesteps",  # the picks in ascending order (the ladder not reversed first)
     ladder_body(out="origin[index]"), Fails("wrong", "expected")),
    ("lcm_timesteps",  # float timesteps (Euler's habit): LCM's are int64
     ladder_body(out="origin.flip(0)[index].float()"), Fails("wrong", "dtype")),
    ("boundary_scalings", scalings_body(c_skip="tau / (tau**2 + sd2) ** 0.5", c_out="sd2 / (tau**2 + sd2)"),
     "c_skip and c_out swapped"),
    ("boundary_scalings", scalings_body(tau="timestep"), "timestep_scaling forgotten (τ = t)"),
    ("boundary_scalings", scalings_body(c_out="tau / (tau**2 + sd2)"), "c_out without the square root"),
    ("boundary_scalings", scalings_body(sd2="0.5"), "σ_data not squared"),
    ("boundary_scalings",  # EDM's c_skip with σ = t (no timestep_scaling, σ_d² over σ² + σ_d², squared wrong)
     scalings_body(c_skip="sd2 / (tau + sd2) ** 2"), Fails("wrong", "expected")),
    ("lcm_step", step_body(last="False", nxt="ladder[i + 1] if i + 1 < len(ladder) else timestep"),
     "re-noised at the last step"),
    ("lcm_step", step_body(nxt="timestep - alphas_cumprod.shape[0] // len(ladder)"),
     "next timestep by DDIM's rule t − T//n"),
    ("lcm_step", step_body(denoised="c_out * x + c_skip * x0"), "c_skip and c_out swapped"),
    ("lcm_step", step_body(denoised="x0"), "boundary condition skipped (denoised = x̂₀)"),
    ("lcm_step", step_body(scaling="1.0"), "timestep_scaling forgotten in the boundary scalings"),
    ("lcm_step",  # the noise from the global RNG: right shape, other numbers, the generator untouched
     step_body(z="torch.randn(model_output.shape, dtype=dtype)"), Fails("wrong", "")),
    ("lcm_step",  # z drawn before checking for the last step, then thrown away: right values, one draw too many
     step_body(last="i == len(ladder) - 1 and torch.randn(model_output.shape, generator=generator) is not None"),
     Fails("wrong", "was left in a different state than diffusers leaves it")),
    ("lcm_step", step_body(x0_v="a**0.5 * out - (1 - a) ** 0.5 * x"), "v-prediction's x̂₀ with x and v exchanged"),
    ("lcm_step", step_body(x0_v="(1 - a) ** 0.5 * x - a**0.5 * out"),
     "v-prediction's x̂₀ with √ᾱ and √(1 − ᾱ) swapped"),
    ("turbo_schedule", turbo_body(t="[(T // n) * j + 1 for j in range(n)][::-1]"), "leading spacing with steps_offset"),
    ("turbo_schedule", turbo_body(t="torch.linspace(0, T - 1, n).round().flip(0).tolist()"), "linspace spacing"),
    ("turbo_schedule", turbo_body(out="timesteps, sigmas"), "no terminal σ = 0"),
    ("turbo_schedule",  # a blind learner's: the trailing grid floored (int) where diffusers rounds
     turbo_body(t="[int(T - j * T / n) - 1 for j in range(n)]"), "t_j floored"),
    ("boundary_scalings",  # a blind learner's: EDM's c_out, σ_d·τ/√(τ² + σ_d²)
     scalings_body(c_out="0.5 * tau / (tau**2 + sd2) ** 0.5"), "EDM's c_out"),
    ("lcm_timesteps",  # a blind learner's: the evenly spaced picks rounded, not floored
     ladder_body(index="torch.tensor([round(j * N / n) for j in range(n)])"), "indices rounded"),
    ("turbo_schedule", turbo_body(table="(1 - alphas_cumprod) ** 0.5"), "DDPM's σ = √(1 − ᾱ)"),
    ("turbo_schedule",  # an integer stride T // n: 999, 666, 333 for n = 3 (trailing rounds T − j·T/n: 332)
     turbo_body(t="[T - j * (T // n) - 1 for j in range(n)]"), Fails("wrong", "values differ")),
    ("turbo_schedule",  # int64 timesteps: the Euler scheduler's are float32
     turbo_body(dtype="torch.int64"), Fails("wrong", "dtype")),
    ("few_step_sample", loop_body(guide="True"), "guidance applied at guidance_scale ≤ 1"),
    ("few_step_sample", loop_body(guide="False"), "guidance never applied"),
    ("few_step_sample", loop_body(start="latents"), "initial latents not scaled by init_noise_sigma"),
    ("few_step_sample", loop_body(x_in="torch.cat([x, x]) if guide else x"), "UNet input not scaled"),
    ("few_step_sample",  # the step's noise from the global RNG (LCM re-noises with it)
     loop_body(step="scheduler.step(noise_pred, t, x).prev_sample"), "generator not passed to scheduler.step"),
    ("few_step_sample",  # the loop index where the timestep belongs
     loop_body(call="unet(x_in, i, encoder_hidden_states=text).sample"), Fails("wrong", "values differ")),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("lcm_timesteps",
     """
     import numpy as np
     k = num_train_timesteps // original_inference_steps
     origin = (np.arange(1, original_inference_steps + 1) * k - 1)[::-1]
     index = np.floor(np.linspace(0, original_inference_steps, num_inference_steps, endpoint=False)).astype(np.int64)
     return torch.from_numpy(origin[index].copy()).long()
     """,
     "diffusers' own numpy recipe, written out"),
    ("boundary_scalings",
     """
     tau = torch.tensor(float(timestep), dtype=torch.float32) * timestep_scaling
     return float(0.25 / (tau**2 + 0.25)), float(tau * torch.rsqrt(tau**2 + 0.25))
     """,
     "float32 tensor arithmetic, c_out through rsqrt (within 1e-7 relative)"),
    ("boundary_scalings",
     """
     from fractions import Fraction
     tau = Fraction(timestep_scaling) * timestep
     d = tau**2 + Fraction(1, 4)
     return float(Fraction(1, 4) / d), float(tau) / float(d) ** 0.5
     """,
     "exact rational arithmetic, rounded once"),
    ("lcm_step", step_body(wide="double"), "the step in float64, cast once"),
    ("lcm_step",
     step_body(wide="float", denoised="x0 + c_skip * (x - x0) + (c_out + c_skip - 1) * x0"),
     "the consistency output re-associated around x̂₀"),
    ("turbo_schedule", turbo_body(table="(((1 - alphas_cumprod.double()) / alphas_cumprod.double()) ** 0.5).float()"),
     "the σ table in float64, cast once"),
    ("turbo_schedule",
     """
     n, T = num_inference_steps, alphas_cumprod.shape[0]
     timesteps = (torch.arange(T, 0, -T / n, dtype=torch.float64).round() - 1).float()
     sigmas = sigma_table(alphas_cumprod)[timesteps.long()]
     return timesteps, torch.cat([sigmas, torch.zeros(1)])
     """,
     "the trailing timesteps through a float arange, as diffusers builds them"),
    ("few_step_sample", loop_body(combine="(1 - guidance_scale) * noise_uncond + guidance_scale * noise_text"),
     "the guidance combine rearranged (an ulp or two from the pipeline's)"),
    ("few_step_sample",
     loop_body(step="scheduler.step(noise_pred, t, x, generator=generator, return_dict=False)[0]"),
     "the step's tuple output instead of its dataclass"),
]


def test_calling_the_lcm_scheduler_step_is_refused(grade_mutant):
    graded = grade_mutant(LAB, "lcm_step", """
        from diffusers.schedulers.scheduling_lcm import LCMScheduler
        s = LCMScheduler(num_train_timesteps=alphas_cumprod.shape[0], prediction_type=prediction_type,
                         timestep_scaling=timestep_scaling)
        s.alphas_cumprod = alphas_cumprod
        s.timesteps = timesteps
        s.num_inference_steps = len(timesteps)
        out = s.step(model_output, timestep, sample, generator=generator)
        return out.prev_sample, out.denoised
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_the_lesson_claims_hold_on_diffusers_itself():
    # n = 4 → 999, 759, 499, 259; f(x, 0) = x; c_out(259) = 1 − 1.9e-8 at s = 10; SD-Turbo's one step sees 999.
    from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
    from diffusers.schedulers.scheduling_lcm import LCMScheduler

    s = LCMScheduler()
    s.set_timesteps(4)
    assert s.timesteps.tolist() == [999, 759, 499, 259]
    assert s.get_scalings_for_boundary_condition_discrete(0) == (1.0, 0.0)
    assert abs(s.get_scalings_for_boundary_condition_discrete(259)[1] - (1 - 1.9e-8)) < 1e-9
    e = EulerDiscreteScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                               timestep_spacing="trailing", steps_offset=1)
    e.set_timesteps(1)
    assert e.timesteps.tolist() == [999.0] and abs(float(e.init_noise_sigma) - 14.6146) < 1e-3


def _grader():
    path = REPO / "graders" / f"{LAB}.py"
    spec = importlib.util.spec_from_file_location(f"_test_grader_{LAB}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cases_vary_what_the_brief_of_this_lab_asks_for():
    # n = 1 … 8 and T ≠ 1000 for the ladder; every prediction type, float16 and float32, a one-step run (no draw)
    # and a small timestep_scaling (the boundary condition far from the identity) for the step; both
    # schedulers and guidance 0, 1 and > 1 for the loop.
    grader = _grader()
    assert {c["num_inference_steps"] for c in grader.LADDER_CASES} == set(range(1, 9))
    assert {c["num_train_timesteps"] for c in grader.LADDER_CASES} - {1000}
    steps = grader.STEP_CASES + grader.STEP_HALF_CASES
    assert {c["prediction_type"] for c in steps} == {"epsilon", "v_prediction", "sample"}
    assert {c.get("dtype", "float32") for c in steps} == {"float16", "float32"}
    assert any(c["n"] == 1 for c in steps) and any(c.get("timestep_scaling", 10.0) < 1 for c in steps)
    assert {c["n"] for c in grader.TURBO_CASES} >= {1, 2, 3, 4}
    assert {c["scheduler"] for c in grader.LOOP_CASES} == set(grader.SCHEDULERS)
    assert {c["guidance_scale"] for c in grader.LOOP_CASES} >= {0.0, 1.0, 1.5}


def test_no_ladder_case_tells_the_exact_floor_from_diffusers_float_linspace():
    # diffusers picks floor(linspace(0, N, n, endpoint=False)) in floats, one index lower than the exact
    # floor(j·N/n) at some (N, n) (30, 22 is the first): the docstring's integer route and diffusers' float
    # route are both right, so no graded case may sit where they differ.
    import numpy as np

    for case in _grader().LADDER_CASES:
        n, N = case["num_inference_steps"], case["original_inference_steps"]
        exact = [j * N // n for j in range(n)]
        floated = np.floor(np.linspace(0, N, num=n, endpoint=False)).astype(np.int64).tolist()
        assert exact == floated, case
    assert np.floor(np.linspace(0, 30, num=22, endpoint=False)).astype(np.int64).tolist() != [
        j * 30 // 22 for j in range(22)]  # the example the lesson gives


LOOP = """
    guide = guidance_scale > 1
    scheduler.set_timesteps(num_inference_steps)
    x = latents * scheduler.init_noise_sigma
    text = torch.cat([negative_prompt_embeds, prompt_embeds]) if guide else prompt_embeds
    with torch.no_grad():
        for i, t in enumerate(scheduler.timesteps):
            x_in = {x_in}
            noise_pred = unet(x_in, {t_in}, encoder_hidden_states=text).sample
            if guide:
                noise_uncond, noise_text = noise_pred.chunk(2)
                noise_pred = noise_uncond + guidance_scale * (noise_text - noise_uncond)
            x = scheduler.step(noise_pred, t, x, generator=generator).prev_sample
    return x
"""
SCALED = "scheduler.scale_model_input(torch.cat([x, x]) if guide else x, t)"


def test_a_loop_that_fails_is_told_the_first_step_where_it_left_the_pipeline(grade_mutant):
    # the timestep nudged at the second step only: the UNet is told another t there
    graded = grade_mutant(LAB, "few_step_sample", LOOP.format(x_in=SCALED, t_in="t + 5 if i == 1 else t"))
    assert graded.status == "failed"
    assert re.search(r"where it first differs: step 2 of \d: the denoiser got t = [\d.]+, the pipeline's got t", 
                     graded.text), graded.text
    # scale_model_input skipped: on SD-Turbo's Euler the very first UNet input is √(σ² + 1) = 14.6x too large
    graded = grade_mutant(LAB, "few_step_sample", LOOP.format(x_in="torch.cat([x, x]) if guide else x", t_in="t"))
    assert graded.status == "failed"
    assert re.search(r"where it first differs: step 1 of \d: the denoiser's input differs .*14\.\d+× the "
                     r"pipeline's everywhere.*scale_model_input", graded.text), graded.text


def test_a_step_that_draws_twice_is_told_its_generator_moved_too(grade_mutant):
    # the noise drawn twice (the first draw thrown away): the values differ, and the generator's state says why
    twice = step_body(z="(torch.randn(model_output.shape, generator=generator, dtype=dtype), "
                        "torch.randn(model_output.shape, generator=generator, dtype=dtype))[1]")
    graded = grade_mutant(LAB, "lcm_step", twice)
    assert graded.status == "failed", graded
    assert "values differ" in graded.text and "also: `generator` was left in a different state" in graded.text
