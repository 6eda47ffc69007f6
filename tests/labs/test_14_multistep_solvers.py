"""Lab 14: wrong-but-plausible DPM-Solver++ pieces fail, the commonest are named, and a first-order loop
sold as second order fails the ★ convergence check with its measured order."""
from expect import Fails

LAB = "14_multistep_solvers"

# Shared lines for the update mutants (each body replaces one solution block; the other functions of the
# solution, alpha_sigma and dpm_lambda included, stay solved).
FIRST_HEAD = """
alpha_t, sigma_t = alpha_sigma(alpha_prod_t)
alpha_s, sigma_s = alpha_sigma(alpha_prod_s)
h = dpm_lambda(alpha_prod_t) - dpm_lambda(alpha_prod_s)
x = sample.to(torch.float32)
"""
FIRST_TAIL = "return ((sigma_t / sigma_s) * x - (alpha_t * (torch.exp(-h) - 1.0)) * x0_pred).to(sample.dtype)\n"

SECOND_HEAD = """
m0, m1 = model_outputs[-1], model_outputs[-2]
a_s0, a_s1 = alpha_prods[-1], alpha_prods[-2]
alpha_t, sigma_t = alpha_sigma(alpha_prod_t)
_, sigma_s0 = alpha_sigma(a_s0)
l_t, l_s0, l_s1 = dpm_lambda(alpha_prod_t), dpm_lambda(a_s0), dpm_lambda(a_s1)
h, h_0 = l_t - l_s0, l_s0 - l_s1
r0 = h_0 / h
D1 = (1.0 / r0) * (m0 - m1)
c = alpha_t * (torch.exp(-h) - 1.0)
x = sample.to(torch.float32)
"""
SECOND_TAIL = "return ((sigma_t / sigma_s0) * x - c * m0 - 0.5 * c * D1).to(sample.dtype)\n"

LOOP_HEAD = """
n = len(timesteps)
x, x0s, abars = sample, [], []
for i, t in enumerate(timesteps):
    a_s = alphas_cumprod[t]
    if i + 1 < n:
        a_t = alphas_cumprod[timesteps[i + 1]]
    elif final_sigmas_type == "zero":
        a_t = torch.tensor(1.0)
    else:
        a_t = alphas_cumprod[0]
    x0 = data_prediction(denoiser(x, t), x, a_s)
    x0s, abars = (x0s + [x0])[-2:], (abars + [a_s])[-2:]
    last = i == n - 1
    lower_final = last and (final_sigmas_type == "zero" or (lower_order_final and n < 15))
"""
LOOP_STEP = """
    if i == 0 or lower_final:
        x = first_order_update(x0, x, a_s, a_t)
    else:
        x = second_order_update(x0s, x, abars, a_t)
return x
"""
FIRST_ORDER_ONLY = LOOP_HEAD + "    x = first_order_update(x0, x, a_s, a_t)\nreturn x\n"

MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("dpm_lambda", "return torch.log(alpha_prod) - torch.log(1 - alpha_prod)", "λ from ᾱ instead of √ᾱ"),
    ("dpm_lambda", "a, s = alpha_sigma(alpha_prod)\nreturn torch.log(s) - torch.log(a)", "λ = log(σ/α): the sign flipped"),
    ("dpm_lambda",  # a blind learner's: 1 − ᾱ clamped "for stability", so λ is finite at ᾱ = 1
     "alpha = torch.sqrt(alpha_prod)\nsigma = torch.sqrt(torch.clamp(1 - alpha_prod, min=1e-12))\n"
     "return torch.log(alpha) - torch.log(sigma)", "1 − ᾱ clamped away from 0"),
    ("dpm_solver_sample",  # a blind learner's: diffusers' lower_order_second (an order-3 rule) at order 2
     LOOP_HEAD.replace("    last = i == n - 1\n", "    last = i == n - 1\n    second_last = i == n - 2 and lower_order_final and n < 15\n")
     + LOOP_STEP.replace("if i == 0 or lower_final:", "if i == 0 or lower_final or second_last:"),
     "the second-to-last step taken first order too"),
    ("dpm_solver_sample",  # a blind learner's: the previous x̂0 stored at the first step only
     LOOP_HEAD.replace("x0s, abars = (x0s + [x0])[-2:], (abars + [a_s])[-2:]",
                       "x0s, abars = ([x0s[0], x0] if x0s else [x0]), ([abars[0], a_s] if abars else [a_s])")
     + LOOP_STEP, "the previous x̂0 kept from the first step"),
    ("first_order_update",  # a blind learner's: the σ ratio from the variance-exploding sigmas
     """
     alpha_t, sigma_t = alpha_sigma(alpha_prod_t)
     alpha_s, sigma_s = alpha_sigma(alpha_prod_s)
     h = dpm_lambda(alpha_prod_t) - dpm_lambda(alpha_prod_s)
     x = sample.to(torch.float32)
     ratio = (sigma_t / alpha_t) / (sigma_s / alpha_s)
     return (ratio * x - alpha_t * (torch.exp(-h) - 1.0) * x0_pred).to(sample.dtype)
     """, "the σ ratio from scheduler.sigmas"),
    ("second_order_update",  # a blind learner's: the whole history read newest first
     """
     m0, m1 = model_outputs[0], model_outputs[1]
     a_s0, a_s1 = alpha_prods[0], alpha_prods[1]
     alpha_t, sigma_t = alpha_sigma(alpha_prod_t)
     _, sigma_s0 = alpha_sigma(a_s0)
     h, h_0 = dpm_lambda(alpha_prod_t) - dpm_lambda(a_s0), dpm_lambda(a_s0) - dpm_lambda(a_s1)
     d1 = (1.0 / (h_0 / h)) * (m0 - m1)
     x = sample.to(torch.float32)
     out = (sigma_t / sigma_s0) * x - (alpha_t * (torch.exp(-h) - 1.0)) * m0 - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * d1
     return out.to(sample.dtype)
     """, "the whole history read newest first"),
    ("dpm_lambda",  # √ on one side only
     "return torch.log(alpha_prod ** 0.5) - torch.log(1 - alpha_prod)", "the square root on ᾱ only"),
    ("dpm_lambda",  # base-10 logs
     "a, s = alpha_sigma(alpha_prod)\nreturn torch.log10(a) - torch.log10(s)", Fails("wrong", "values differ")),
    # ---- data_prediction
    ("data_prediction", "return model_output.clone()", "the model output returned as x̂0"),
    ("data_prediction", "return (sample - (1 - alpha_prod_t) * model_output) / alpha_prod_t", "ᾱ_t used where √ᾱ_t belongs"),
    ("data_prediction", "return sample - (1 - alpha_prod_t) ** 0.5 * model_output", "x_t − σ_t·ε̂ without dividing by α_t"),
    ("data_prediction", "a, s = alpha_sigma(alpha_prod_t)\nreturn (sample - a * model_output) / s",
     "α_t and σ_t swapped"),
    ("data_prediction", "a, s = alpha_sigma(alpha_prod_t)\nreturn sample - s * model_output / a",
     "x_t − σ_t·ε̂/α_t: only the noise term divided"),
    ("data_prediction", "a, s = alpha_sigma(alpha_prod_t)\nreturn (sample - s * model_output) / alpha_prod_t",
     "divided by ᾱ_t instead of α_t"),
    ("data_prediction",  # the noise added instead of removed
     "a, s = alpha_sigma(alpha_prod_t)\nreturn (sample + s * model_output) / a", Fails("wrong", "values differ")),
    # ---- first_order_update
    ("first_order_update", FIRST_HEAD.replace("h = dpm_lambda(alpha_prod_t) - dpm_lambda(alpha_prod_s)",
                                              "h = dpm_lambda(alpha_prod_s) - dpm_lambda(alpha_prod_t)") + FIRST_TAIL,
     "h sign flipped"),
    ("first_order_update", FIRST_HEAD.replace("h = dpm_lambda", "h = 2 * dpm_lambda").replace(" - dpm_lambda(alpha_prod_s)",
                                                                                           " - 2 * dpm_lambda(alpha_prod_s)") + FIRST_TAIL,
     "λ from ᾱ instead of √ᾱ (h doubled)"),
    ("first_order_update",
     FIRST_HEAD + "return ((alpha_t / alpha_s) * x - (sigma_t * (torch.exp(h) - 1.0)) * x0_pred).to(sample.dtype)\n",
     "the noise-prediction (DPM-Solver) update fed x̂0"),
    ("first_order_update", FIRST_HEAD + FIRST_TAIL.replace("x - (alpha_t", "x + (alpha_t"), "the x̂0 term's sign flipped"),
    ("first_order_update", FIRST_HEAD + FIRST_TAIL.replace("x - (alpha_t *", "x - (alpha_s *"),  # a blind learner's
     "α_s on the x̂0 term instead of α_t"),
    ("first_order_update", FIRST_HEAD + FIRST_TAIL.replace("(sigma_t / sigma_s)", "(alpha_t / alpha_s)"),
     "α_t/α_s on the sample instead of σ_t/σ_s"),
    ("first_order_update",  # the σ ratio upside down
     FIRST_HEAD + FIRST_TAIL.replace("(sigma_t / sigma_s)", "(sigma_s / sigma_t)"), Fails("wrong", "")),
    ("first_order_update",  # a blind learner's: λ, the coefficients and the update all in the sample's float16
     """
     dt = sample.dtype
     a_s, a_t = alpha_prod_s.to(dt), alpha_prod_t.to(dt)
     sigma_s, sigma_t = (1 - a_s).sqrt(), (1 - a_t).sqrt()
     alpha_t = a_t.sqrt()
     h = (torch.log(alpha_t) - torch.log(sigma_t)) - (torch.log(a_s.sqrt()) - torch.log(sigma_s))
     return (sigma_t / sigma_s) * sample - alpha_t * (torch.exp(-h) - 1.0) * x0_pred.to(dt)
     """, "the coefficients computed in float16"),
    ("first_order_update",  # float16 in, float32 out: the cast back forgotten
     FIRST_HEAD + "return (sigma_t / sigma_s) * x - (alpha_t * (torch.exp(-h) - 1.0)) * x0_pred\n",
     Fails("wrong", "has dtype torch.float32; expected torch.float16")),
    # ---- second_order_update
    ("second_order_update", SECOND_HEAD.replace("m0, m1 = model_outputs[-1], model_outputs[-2]",
                                                "m0, m1 = model_outputs[0], model_outputs[1]") + SECOND_TAIL,
     "m0 and m1 swapped"),
    ("second_order_update", SECOND_HEAD.replace("h, h_0 = l_t - l_s0, l_s0 - l_s1", "h, h_0 = l_s0 - l_t, l_s1 - l_s0")
     + SECOND_TAIL, "h sign flipped"),
    ("second_order_update", SECOND_HEAD.replace("h, h_0 = l_t - l_s0, l_s0 - l_s1",
                                                "h, h_0 = 2 * (l_t - l_s0), 2 * (l_s0 - l_s1)") + SECOND_TAIL,
     "λ from ᾱ instead of √ᾱ (h doubled)"),
    ("second_order_update", SECOND_HEAD + SECOND_TAIL.replace(" - 0.5 * c * D1", ""), "the D1 correction dropped"),
    ("second_order_update", SECOND_HEAD.replace("(1.0 / r0)", "r0") + SECOND_TAIL, "D1 = r0·(m0 − m1)"),
    ("second_order_update", SECOND_HEAD.replace("D1 = (1.0 / r0) * (m0 - m1)", "D1 = m0 - m1") + SECOND_TAIL,
     "D1 = m0 − m1 without the 1/r0"),
    ("second_order_update", SECOND_HEAD.replace("h, h_0 = l_t - l_s0, l_s0 - l_s1", "h, h_0 = l_t - l_s0, l_s1 - l_s0")
     + SECOND_TAIL, "h_0 sign flipped"),
    ("second_order_update", SECOND_HEAD.replace("a_s0, a_s1 = alpha_prods[-1], alpha_prods[-2]",
                                                "a_s0, a_s1 = alpha_prods[0], alpha_prods[1]") + SECOND_TAIL,
     "alpha_prods read newest first"),
    ("second_order_update", SECOND_HEAD + SECOND_TAIL.replace("0.5 * c * D1", "c * D1"), "the ½ of the midpoint rule"),
    ("second_order_update",
     SECOND_HEAD + "return ((sigma_t / sigma_s0) * x - c * m0 + alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0) * D1)"
                   ".to(sample.dtype)\n", "the 'heun' D1 coefficient"),
    ("second_order_update",  # the slope without rescaling to this step: D1 = m0 − m1
     SECOND_HEAD.replace("(1.0 / r0) * ", "") + SECOND_TAIL, Fails("wrong", "values differ")),
    # ---- dpm_solver_sample
    ("dpm_solver_sample", LOOP_HEAD.replace("x0 = data_prediction(denoiser(x, t), x, a_s)", "x0 = denoiser(x, t)")
     + LOOP_STEP, "ε used where x̂0 belongs"),
    ("dpm_solver_sample", LOOP_HEAD.replace("x0 = data_prediction(denoiser(x, t), x, a_s)",
                                            "eps = denoiser(x, t)\n    x0 = data_prediction(eps, x, a_s)").replace(
        "(x0s + [x0])[-2:]", "(x0s + [eps])[-2:]") + LOOP_STEP, "the history holds the denoiser's ε̂, not x̂0"),
    ("dpm_solver_sample",  # "no history? use the current x̂0 twice"
     LOOP_HEAD + LOOP_STEP.replace("if i == 0 or lower_final:", "if lower_final:").replace(
         "x = second_order_update(x0s, x, abars, a_t)",
         "x = second_order_update(x0s if i else [x0, x0], x, abars if i else [a_s, a_s], a_t)"),
     "the first step taken second order"),
    ("dpm_solver_sample", LOOP_HEAD.replace("lower_final = last and", "lower_final = False and") + LOOP_STEP,
     "lower_order_final ignored"),
    ("dpm_solver_sample", LOOP_HEAD.replace("(lower_order_final and n < 15)", "lower_order_final") + LOOP_STEP,
     "lower_order_final applied at every n"),
    ("dpm_solver_sample",  # the boundary one off: n ≤ 15 (right at every n but 15)
     LOOP_HEAD.replace("(lower_order_final and n < 15)", "(lower_order_final and n <= 15)") + LOOP_STEP,
     "lower_order_final at n ≤ 15"),
    ("dpm_solver_sample", LOOP_HEAD.replace("(x0s + [x0])[-2:], (abars + [a_s])[-2:]", "([x0] + x0s)[:2], ([a_s] + abars)[:2]")
     + LOOP_STEP, "the x̂0 history passed newest first"),
    ("dpm_solver_sample", FIRST_ORDER_ONLY, "the first-order update at every step"),
    ("dpm_solver_sample", LOOP_HEAD.replace('elif final_sigmas_type == "zero":', 'elif final_sigmas_type != "zero":')
     + LOOP_STEP, "the last step's target swapped"),
    ("dpm_solver_sample",  # a Heun-like second call per step: multistep solvers call once
     LOOP_HEAD.replace("x0 = data_prediction(denoiser(x, t), x, a_s)",
                       "x0 = data_prediction(denoiser(x, t), x, a_s)\n    denoiser(x, t)") + LOOP_STEP,
     Fails("wrong", "once per step")),
    ("dpm_solver_sample",  # the float16 sample kept in float32 between steps
     LOOP_HEAD.replace("x, x0s, abars = sample, [], []", "x, x0s, abars = sample.float(), [], []")
     + LOOP_STEP.replace("return x", "return x.to(sample.dtype)"),
     Fails("wrong", "but the denoiser runs in float16")),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("dpm_lambda",
     "a = alpha_prod.double()\nreturn (0.5 * torch.log(a / (1 - a))).to(alpha_prod.dtype)",
     "½·log of the SNR in float64, cast once: closer to exact math than diffusers' two float32 logs"),
    ("data_prediction",
     """
     a = alpha_prod_t.double()
     return ((sample.double() - (1 - a) ** 0.5 * model_output.double()) / a ** 0.5).to(model_output.dtype)
     """,
     "float64 then cast once: in float16 diffusers rounds x_t − σ·ε̂ before dividing by α (1/α ≈ 14.6 at t=999)"),
    ("first_order_update",
     """
     a_s, a_t = alpha_prod_s.double(), alpha_prod_t.double()
     h = dpm_lambda(a_t) - dpm_lambda(a_s)
     out = ((1 - a_t) / (1 - a_s)) ** 0.5 * sample.double() - a_t ** 0.5 * (torch.exp(-h) - 1.0) * x0_pred.double()
     return out.to(sample.dtype)
     """,
     "float64 coefficients and tensors (σ_t/σ_s as one square root), cast once at the end"),
    ("second_order_update",
     """
     m0, m1 = model_outputs[-1].double(), model_outputs[-2].double()
     a_t, a_s0, a_s1 = alpha_prod_t.double(), alpha_prods[-1].double(), alpha_prods[-2].double()
     l_t, l_s0, l_s1 = (0.5 * torch.log(a / (1 - a)) for a in (a_t, a_s0, a_s1))
     h = l_t - l_s0
     c = a_t ** 0.5 * torch.expm1(-h)
     D1 = (m0 - m1) * h / (l_s0 - l_s1)
     out = ((1 - a_t) / (1 - a_s0)) ** 0.5 * sample.double() - c * m0 - 0.5 * c * D1
     return out.to(sample.dtype)
     """,
     "float64 throughout, expm1 for e^{−h} − 1 and D1 written as (m0 − m1)·h/h_0, cast once"),
    ("dpm_solver_sample",
     """
     n = len(timesteps)
     ac = alphas_cumprod.double()
     x, hist = sample, []
     for i, t in enumerate(timesteps):
         a_s = ac[t]
         a_t = ac[timesteps[i + 1]] if i + 1 < n else (
             torch.tensor(1.0, dtype=torch.float64) if final_sigmas_type == "zero" else ac[0])
         x64 = x.double()
         x0 = (x64 - (1 - a_s) ** 0.5 * denoiser(x, t).double()) / a_s ** 0.5
         hist = (hist + [(x0, a_s)])[-2:]
         lam = lambda a: 0.5 * torch.log(a / (1 - a))
         h = lam(a_t) - lam(a_s)
         c = a_t ** 0.5 * (torch.exp(-h) - 1.0)
         out = ((1 - a_t) / (1 - a_s)) ** 0.5 * x64 - c * x0
         last = i == n - 1
         if i > 0 and not (last and (final_sigmas_type == "zero" or (lower_order_final and n < 15))):
             (m1, a_s1), _ = hist
             out = out - 0.5 * c * (x0 - m1) * h / (lam(a_s) - lam(a_s1))
         x = out.to(sample.dtype)
     return x
     """,
     "every step in float64, the sample cast back to its dtype for the next denoiser call (float16 too)"),
]


def test_a_first_order_loop_fails_the_convergence_check_with_its_measured_order(grade_mutant):
    graded = grade_mutant(LAB, "dpm_solver_sample", FIRST_ORDER_ONLY)
    assert graded.status == "failed", graded
    assert "★ convergence order" in graded.text and "measured convergence order p = log2(e_N / e_2N) = 0.9" in graded.text, \
        graded.text
    assert "first order: the loop converges like one that only ever takes first-order steps" in graded.text


def test_the_right_loop_passes_the_convergence_check_alone(grade_mutant):
    graded = grade_mutant(LAB, "dpm_solver_sample", LOOP_HEAD + LOOP_STEP, "-k", "convergence")
    assert graded.status == "passed", graded


def test_calling_the_diffusers_answer_key_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "first_order_update", """
        from diffusers.schedulers.scheduling_dpmsolver_multistep import DPMSolverMultistepScheduler
        s = DPMSolverMultistepScheduler()
        return s.dpm_solver_first_order_update(x0_pred, sample=sample)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_changing_the_sample_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "dpm_solver_sample", LOOP_HEAD + LOOP_STEP.replace("return x", "return sample.copy_(x)"))
    assert graded.status == "failed"
    assert "changed its input(s) sample in place" in graded.text


def test_a_formula_mistake_of_roundings_size_in_float16_is_named_not_called_a_precision_problem(grade_mutant):
    # D1 without its 1/r0 is off by little where the two steps are about as long in λ: in float16 its error is of
    # rounding's size, which alone reads as precision; the trap explains it, and the precision note is withdrawn
    body = SECOND_HEAD.replace("D1 = (1.0 / r0) * (m0 - m1)", "D1 = m0 - m1") + SECOND_TAIL
    graded = grade_mutant(LAB, "second_order_update", body, "-k", "second_order_update and float16")
    assert graded.status == "failed", graded
    assert "trap: D1 = m0 − m1 without the 1/r0" in graded.text, graded.text
    assert "a precision problem, not the formula" not in graded.text, graded.text
