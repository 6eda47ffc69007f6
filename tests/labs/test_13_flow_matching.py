"""Lab 13: wrong-but-plausible implementations fail, and the commonest ones are named."""
import importlib.util
import math
from pathlib import Path

from expect import Fails

LAB = "13_flow_matching"
REPO = Path(__file__).resolve().parents[2]


def ladder_body(end="shift_sigma(1 / T, shift)", shifted="shift_sigma(grid, shift)",
                out="torch.cat([s, s.new_zeros(1)]), s * T") -> str:
    """A body for flow_sigmas with one line swapped for a wrong one."""
    return f"""
    n, T = num_inference_steps, num_train_timesteps
    grid = torch.linspace(1.0, {end}, n, dtype=torch.float64)
    s = ({shifted}).float()
    return {out}
    """


def mu_body(tokens="(height // vae_scale_factor // patch_size) * (width // vae_scale_factor // patch_size)",
            slope="(max_shift - base_shift) / (max_image_seq_len - base_image_seq_len)",
            mu="base_shift + m * (tokens - base_image_seq_len)") -> str:
    """A body for resolution_mu with one line swapped for a wrong one."""
    return f"""
    tokens = {tokens}
    m = {slope}
    return {mu}
    """


def shift_body(s="math.exp(mu) if time_shift_type == 'exponential' else mu",
               out="s / (s + (1 / sigmas - 1))") -> str:
    """A body for time_shift with one line swapped for a wrong one."""
    return f"""
    s = {s}
    return {out}
    """


def noise_body(index="(timesteps[None, :] == timestep[:, None]).long().argmax(1)",
               sigma="sigmas[index].float().reshape(-1, 1, 1, 1)",
               mix="sigma * noise.float() + (1 - sigma) * sample.float()", cast=".to(sample.dtype)") -> str:
    """A body for scale_noise with one line swapped for a wrong one."""
    return f"""
    index = {index}
    sigma = {sigma}
    return ({mix}){cast}
    """


def step_body(update="sample.float() + (sigma_next - sigma) * model_output.float()",
              cast=".to(model_output.dtype)") -> str:
    """A body for flow_euler_step with one line swapped for a wrong one."""
    return f"""
    return ({update}){cast}
    """


MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("flow_sigmas", ladder_body(shifted="shift_sigma(grid * T, shift) / T"), "shift applied to t instead of σ"),
    ("flow_sigmas", ladder_body(out="s, s * T"), "no terminal σ = 0"),
    ("flow_sigmas", ladder_body(end="1 / T", shifted="grid"), "shift ignored"),
    ("flow_sigmas", ladder_body(end="1 / T"), "grid down to 1/T"),
    ("flow_sigmas", ladder_body(shifted="grid / (shift - (shift - 1) * grid)"), "shifted the wrong way (1/s)"),
    ("flow_sigmas", ladder_body(end="0.0"), "grid down to 0, then another 0"),
    ("flow_sigmas", ladder_body(out="torch.cat([s, s.new_zeros(1)]), grid.float() * T"),
     "timesteps from the unshifted grid"),
    ("flow_sigmas",  # the ladder climbing from clean to noise
     ladder_body(out="torch.cat([s.flip(0), s.new_zeros(1)]), s.flip(0) * T"), Fails("wrong", "values differ")),
    ("flow_sigmas",  # float64 out: diffusers' σs and timesteps are float32
     ladder_body(out="torch.cat([s, s.new_zeros(1)]).double(), (s * T).double()"), Fails("wrong", "has dtype")),
    ("flow_sigmas",  # the timesteps rounded to integers (DDIM's habit): the model sees 893, not 892.8
     ladder_body(out="torch.cat([s, s.new_zeros(1)]), (s * T).round()"), Fails("wrong", "values differ")),
    ("resolution_mu", mu_body(tokens="height * width"), "μ from the pixel count instead of the token count"),
    ("resolution_mu", mu_body(tokens="(height // vae_scale_factor // patch_size) ** 2"),  # a blind learner's
     "the token count as (height // f // p)²"),
    ("resolution_mu", mu_body(tokens="(height // 16) * (width // 16)"), "16 pixels per token written in"),  # blind
    ("resolution_mu",  # a blind learner's: height // f * p (precedence: multiplied by the patch size)
     mu_body(tokens="(height // vae_scale_factor * patch_size) * (width // vae_scale_factor * patch_size)"),
     "each side as height // vae_scale_factor * patch_size"),
    ("resolution_mu", mu_body(tokens="(height // vae_scale_factor) * (width // vae_scale_factor)"),
     "μ from the latent pixel count"),
    ("resolution_mu", mu_body(mu="base_shift + m * tokens"), "the line anchored at 0 tokens"),
    ("resolution_mu",  # the line clamped between its two anchors
     mu_body(mu="min(max(base_shift + m * (tokens - base_image_seq_len), base_shift), max_shift)"),
     "μ clamped to [base_shift, max_shift]"),
    ("resolution_mu", mu_body(mu="math.exp(base_shift + m * (tokens - base_image_seq_len))"),
     "returned the shift e^μ instead of μ"),
    ("resolution_mu",  # SD3/Flux's 16 pixels per token hard-coded: wrong for any other VAE or patch size
     mu_body(tokens="(height // 16) * (width // 16)"), Fails("wrong", "expected")),
    ("resolution_mu",  # the slope upside down
     mu_body(slope="(max_image_seq_len - base_image_seq_len) / (max_shift - base_shift)"), Fails("wrong", "expected")),
    ("time_shift", shift_body(s="mu"), "'exponential' with μ instead of e^μ"),
    ("time_shift", shift_body(out="s / (s + 1 / sigmas)"), "the −1 left out"),
    ("time_shift", shift_body(s="math.exp(mu)"), "'linear' with e^μ"),
    ("time_shift", shift_body(s="mu if time_shift_type == 'exponential' else math.exp(mu)"),
     "the two types swapped"),
    ("time_shift", shift_body(out="1 / (1 + s * (1 / sigmas - 1))"), "shifted the wrong way (1/s: towards clean)"),
    ("time_shift",  # (1/σ − 1) raised to 2 (time_shift's `sigma` exponent is 1.0 in set_timesteps)
     shift_body(out="s / (s + (1 / sigmas - 1) ** 2)"), Fails("wrong", "values differ")),
    ("time_shift",  # float64 out for float32 σs
     shift_body(out="(s / (s + (1 / sigmas - 1))).double()"), Fails("wrong", "has dtype")),
    ("scale_noise", noise_body(mix="(1 - sigma) * noise.float() + sigma * sample.float()"), "σ and 1 − σ swapped"),
    ("scale_noise", noise_body(mix="sigma ** 0.5 * noise.float() + (1 - sigma) ** 0.5 * sample.float()"),
     "DDPM's √ coefficients"),
    ("scale_noise", noise_body(mix="sample.float() + sigma * noise.float()"), "Euler's latent x₀ + σ·ε"),
    ("scale_noise", noise_body(sigma="sigmas[index[:1]].float().reshape(-1, 1, 1, 1)"),
     "one σ for the whole batch"),
    ("scale_noise", noise_body(index="torch.arange(sample.shape[0])"), "σ indexed by batch position"),
    ("scale_noise", noise_body(sigma="timestep.float().reshape(-1, 1, 1, 1)"), "the timestep used as σ"),
    ("scale_noise",  # the σ of the next step (off by one in the schedule)
     noise_body(index="(timesteps[None, :] == timestep[:, None]).long().argmax(1) + 1"), "σ one index on"),
    ("scale_noise",  # left in float32 for float16 latents
     noise_body(cast=""), Fails("wrong", "has dtype")),
    ("scale_noise",  # σ = t/1000: right wherever num_train_timesteps is 1000 (timesteps are σ·T)
     noise_body(sigma="(timestep.float() / 1000).reshape(-1, 1, 1, 1)"), "σ = t / 1000"),
    ("flow_euler_step",
     """
     x, v = sample.float(), model_output.float()
     x0 = (x - sigma * v) / (1 - sigma)
     return ((1 - sigma_next) * x0 + sigma_next * v).to(model_output.dtype)
     """,
     "ε-style (DDIM) update on a velocity model"),
    ("flow_euler_step", step_body(update="sample.float() + (sigma - sigma_next) * model_output.float()"),
     "σ and σ_next swapped"),
    ("flow_euler_step", step_body(update="sample.float() - sigma * model_output.float()"),
     "returned x̂₀ = x − σ·v"),
    ("flow_euler_step", step_body(cast=""), "left in float32 for a float16 model"),
    ("flow_euler_step", step_body(update="sample.float() + (sigma_next - sigma) * 1000 * model_output.float()"),
     "the step in timestep units"),
    ("flow_sigmas",  # n + 1 grid points down to 0: the terminal σ taken from the grid
     """
     n, T = num_inference_steps, num_train_timesteps
     s = shift_sigma(torch.linspace(1.0, 0.0, n + 1, dtype=torch.float64), shift).float()
     return s, s[:-1] * T
     """,
     "one grid of n + 1 points from 1 down to 0"),
    ("resolution_mu", mu_body(slope="(max_shift - base_shift) / max_image_seq_len", mu="base_shift + m * tokens"),
     "the line drawn from (0 tokens, base_shift)"),
    ("flow_euler_step",  # the step size σ_next alone
     step_body(update="sample.float() + sigma_next * model_output.float()"), Fails("wrong", "values differ")),
    ("flow_euler_step",  # lab 03's VE-Euler step with v read as ε and a √(σ² + 1) scaling left in
     step_body(update="sample.float() / (sigma**2 + 1) ** 0.5 + (sigma_next - sigma) * model_output.float()"),
     Fails("wrong", "values differ")),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("flow_sigmas",
     """
     n, T = num_inference_steps, num_train_timesteps
     s = shift_sigma(torch.linspace(1.0, shift_sigma(1 / T, shift), n, dtype=torch.float64), shift)
     return torch.cat([s, s.new_zeros(1)]).float(), (s * T).float()
     """,
     "timesteps from the float64 σs, cast once (closer to exact math than diffusers' float32 σ·T)"),
    ("flow_sigmas",
     """
     n, T = num_inference_steps, num_train_timesteps
     s = shift_sigma(torch.linspace(1.0, shift_sigma(1 / T, shift), n), shift)
     return torch.cat([s, s.new_zeros(1)]), s * T
     """,
     "the ladder in float32 throughout (a few float32 ulps from diffusers' float64-then-cast)"),
    ("resolution_mu",
     """
     from fractions import Fraction
     tokens = (height // vae_scale_factor // patch_size) * (width // vae_scale_factor // patch_size)
     m = (Fraction(max_shift) - Fraction(base_shift)) / (max_image_seq_len - base_image_seq_len)
     return float(Fraction(base_shift) + m * (tokens - base_image_seq_len))
     """,
     "μ in exact rational arithmetic, rounded once"),
    ("resolution_mu",
     """
     tokens = torch.tensor((height // vae_scale_factor // patch_size) * (width // vae_scale_factor // patch_size),
                           dtype=torch.float32)
     m = (max_shift - base_shift) / (max_image_seq_len - base_image_seq_len)
     return float(base_shift + m * (tokens - base_image_seq_len))
     """,
     "μ through a float32 tensor"),
    ("time_shift",
     shift_body(out="s * sigmas / (1 + (s - 1) * sigmas)"),
     "the static shift with s = e^μ (or μ): the same function of σ, other float ops"),
    ("time_shift",
     shift_body(out="(s / (s + (1 / sigmas.double() - 1))).to(sigmas.dtype)"),
     "float64 then cast: Flux's float32 grid shifted more exactly than diffusers' float32 numpy"),
    ("scale_noise",
     noise_body(index="(timesteps[None, :] - timestep[:, None]).abs().argmin(1)",
                sigma="sigmas[index].double().reshape(-1, 1, 1, 1)",
                mix="sigma * noise.double() + (1 - sigma) * sample.double()"),
     "the nearest timestep's σ, and the mix in float64 then cast"),
    ("scale_noise",
     noise_body(sigma="sigmas.to(sample.dtype)[index].reshape(-1, 1, 1, 1)",
                mix="sigma * noise + (1.0 - sigma) * sample", cast=""),
     "diffusers' own order: σ cast to the latent's dtype (float16 too) and mixed there"),
    ("flow_euler_step",
     step_body(update="sample.double() + (sigma_next.double() - sigma.double()) * model_output.double()"),
     "the step in float64, cast once (closer to exact math than diffusers, whose dt·v is float16 for "
     "float16 models)"),
    ("flow_euler_step",
     step_body(update="(sample.float() - sigma * model_output.float()) + sigma_next * model_output.float()"),
     "x̂₀ + σ_next·v: the same step re-associated"),
]


def test_calling_set_timesteps_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "flow_sigmas", """
        from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
        s = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
        s.set_timesteps(num_inference_steps)
        return s.sigmas, s.timesteps
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_calling_the_sd3_pipelines_copy_of_calculate_shift_is_refused_too(grade_mutant):
    graded = grade_mutant(LAB, "resolution_mu", """
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
        tokens = (height // vae_scale_factor // patch_size) * (width // vae_scale_factor // patch_size)
        return calculate_shift(tokens, base_image_seq_len, max_image_seq_len, base_shift, max_shift)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_changing_the_latent_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "flow_euler_step", """
        return sample.add_((sigma_next - sigma) * model_output)
    """)
    assert graded.status == "failed"
    assert "changed its input(s) sample in place" in graded.text


def test_the_lowest_sigma_is_shifted_twice_as_the_lesson_says():
    # The lesson's claim about diffusers, checked on diffusers itself: the grid ends at the training
    # ladder's (already shifted) σ_min, and is shifted again.
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    def shift(sigma, s):
        return s * sigma / (1 + (s - 1) * sigma)

    s = FlowMatchEulerDiscreteScheduler(shift=3.0)
    s.set_timesteps(28)
    assert math.isclose(float(s.sigmas[-2]), shift(shift(1 / 1000, 3.0), 3.0), rel_tol=1e-6)
    assert float(s.sigmas[0]) == 1.0 and float(s.sigmas[-1]) == 0.0 and len(s.sigmas) == 29


def test_dynamic_shifting_is_the_static_shift_with_e_to_the_mu_as_the_lesson_says():
    import torch
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    sigmas = torch.linspace(1.0, 0.01, 17, dtype=torch.float64)
    for kind, factor in (("exponential", math.exp(0.9)), ("linear", 0.9)):
        s = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type=kind)
        shifted = s.time_shift(0.9, 1.0, sigmas)
        assert torch.allclose(shifted, factor * sigmas / (1 + (factor - 1) * sigmas), rtol=1e-12, atol=0)


def _grader():
    path = REPO / "graders" / f"{LAB}.py"
    spec = importlib.util.spec_from_file_location(f"_test_grader_{LAB}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cases_vary_what_the_brief_of_this_lab_asks_for():
    # shift ≠ 1 and = 1, several step counts, distinct timesteps in a batch > 1, float16 and float32,
    # both time_shift types: the situations where the traps differ from diffusers.
    grader = _grader()
    assert {c["shift"] for c in grader.LADDER_CASES} >= {1.0, 3.0, 0.5}
    assert len({c["num_inference_steps"] for c in grader.LADDER_CASES}) >= 5
    assert {c["time_shift_type"] for c in grader.FLUX_GRID_CASES} == {"exponential", "linear"}
    assert {c["dtype"] for c in grader.NOISE_CASES} == {c["dtype"] for c in grader.STEP_CASES} == {"float16", "float32"}
    assert all(c["shape"][0] > 1 for c in grader.NOISE_CASES)
    assert grader.STEP_CASES[0].get("start"), "the first run starts part-way down: the DDIM trap is finite there"
