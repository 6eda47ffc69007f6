"""Lab 01: wrong-but-plausible implementations fail, and the commonest ones are named."""
from expect import Fails

LAB = "01_forward_noise"

MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("scaled_linear_betas",  # a blind learner's: "betas are small, half is enough"
     "return (torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float16) ** 2)"
     ".to(torch.float32)", "built in float16, cast to float32 at the end"),
    ("cosine_betas",  # f = cos, not cos²
     """
     f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2)
     T = num_train_timesteps
     return torch.tensor([min(1 - f((i + 1) / T) / f(i / T), max_beta) for i in range(T)], dtype=torch.float32)
     """, "f(t) = cos(…) without the square"),
    ("cosine_betas",  # a blind learner's: the schedule one step late, β_0 = 0
     """
     f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
     T = num_train_timesteps
     return torch.tensor([0.0] + [min(1 - f(i / T) / f((i - 1) / T), max_beta) for i in range(1, T)],
                         dtype=torch.float32)
     """, "shifted one step late"),
    ("alphas_cumprod",  # a blind learner's: the exclusive product
     """
     acp = torch.cumprod(1.0 - betas, dim=0)
     return torch.cat([torch.ones(1, dtype=acp.dtype), acp[:-1]])
     """, "the product over s < t"),
    ("add_noise",  # a blind learner's: the paper's 1-based t
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps - 1].reshape((-1,) + (1,) * (x0.ndim - 1))
     return a ** 0.5 * x0 + (1 - a) ** 0.5 * noise
     """, "ᾱ read at t − 1"),
    ("add_noise",  # a blind learner's: 4-D hard-coded
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps]
     return (a ** 0.5).view(-1, 1, 1, 1) * x0 + ((1 - a) ** 0.5).view(-1, 1, 1, 1) * noise
     """, "ᾱ_t shaped (B, 1, 1, 1) whatever x0's number of dimensions"),
    ("rescale_zero_terminal_snr",  # a blind learner's: the cumulative product never undone
     """
     s = torch.cumprod(1.0 - betas, dim=0).sqrt()
     s0, sT = s[0].clone(), s[-1].clone()
     s = (s - sT) * (s0 / (s0 - sT))
     return 1 - s ** 2
     """, "β' = 1 − ᾱ'"),
    ("rescale_zero_terminal_snr",  # a blind learner's: α'_0 = 1
     """
     s = torch.cumprod(1.0 - betas, dim=0).sqrt()
     s0, sT = s[0].clone(), s[-1].clone()
     s = (s - sT) * (s0 / (s0 - sT))
     a = s ** 2
     return 1 - torch.cat([torch.ones(1, dtype=a.dtype), a[1:] / a[:-1]])
     """, "α'_0 taken as 1"),
    ("scaled_linear_betas",
     "return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32)",
     "a linspace over β itself"),
    ("scaled_linear_betas",
     "return torch.linspace(beta_start, beta_end, num_train_timesteps, dtype=torch.float32).sqrt()",
     "√ of a linspace over β"),
    ("cosine_betas",
     """
     f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
     T = num_train_timesteps
     return torch.tensor([1 - f((i + 1) / T) / f(i / T) for i in range(T)], dtype=torch.float32)
     """,
     "the cap at max_beta is missing"),
    ("cosine_betas",
     """
     f = lambda t: math.cos(t * math.pi / 2) ** 2
     T = num_train_timesteps
     return torch.tensor([min(1 - f((i + 1) / T) / f(i / T), max_beta) for i in range(T)], dtype=torch.float32)
     """,
     "the 0.008 offset is missing"),
    ("alphas_cumprod", "return torch.cumprod(betas, dim=0)", "a running product of β"),
    ("add_noise",
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps[0]]
     return a.sqrt() * x0 + (1 - a).sqrt() * noise
     """,
     "one timestep for the whole batch"),
    ("scaled_linear_betas",  # a blind learner's: the ramp i/T
     """
     r = torch.arange(num_train_timesteps, dtype=torch.float32) / num_train_timesteps
     return (beta_start ** 0.5 + r * (beta_end ** 0.5 - beta_start ** 0.5)) ** 2
     """, "the √β ramp as i/T"),
    ("cosine_betas",  # a blind learner's: vectorised in float32
     """
     i = torch.arange(num_train_timesteps, dtype=torch.float32)
     f = torch.cos((i / num_train_timesteps + 0.008) / 1.008 * torch.pi / 2) ** 2
     g = torch.cos(((i + 1) / num_train_timesteps + 0.008) / 1.008 * torch.pi / 2) ** 2
     return torch.clamp(1 - g / f, max=max_beta)
     """, "vectorised in float32 tensors"),
    ("velocity", "return noise - x0", "the flow-matching velocity ε − x_0"),
    ("velocity",  # a blind learner's: through add_noise, then divided back out
     """
     x_t = add_noise(x0, noise, alphas_cumprod, timesteps)
     a = alphas_cumprod.to(x0.dtype)[timesteps].reshape((-1,) + (1,) * (x0.dim() - 1))
     return (a ** 0.5 * x_t - x0) / (1 - a) ** 0.5
     """, "v recovered from x_t"),
    ("rescale_zero_terminal_snr",  # a blind learner's: capped like the cosine schedule
     """
     s = torch.cumprod(1 - betas, 0).sqrt()
     s0, sT = s[0].clone(), s[-1].clone()
     s = (s - sT) * (s0 / (s0 - sT))
     a = s ** 2
     return (1 - torch.cat([a[:1], a[1:] / a[:-1]])).clamp(max=0.999)
     """, "the rescaled βs capped at 0.999"),
    ("alphas_cumprod", "return 1 - torch.cumsum(betas, dim=0)", "a running sum"),
    ("alphas_cumprod",  # a blind learner's: Euler's zero-SNR guard copied into the table itself
     "a = torch.cumprod(1.0 - betas, dim=0)\na[-1] = a[-1] if a[-1] > 0 else 2.0 ** -24\nreturn a",
     "ᾱ_T = 0 replaced by a tiny value"),
    ("add_noise",
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps].reshape(-1, *[1] * (x0.dim() - 1))
     return a * x0 + (1 - a) * noise
     """,
     "ᾱ_t used where √ᾱ_t belongs"),
    ("add_noise",
     """
     a = alphas_cumprod[timesteps].reshape(-1, *[1] * (x0.dim() - 1))
     return (a.sqrt() * x0.float() + (1 - a).sqrt() * noise.float()).to(x0.dtype)
     """,
     "computed in float32 and cast"),
    ("add_noise",  # no per-sample broadcast: a shape error from the learner's own line
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps]
     return a.sqrt() * x0 + (1 - a).sqrt() * noise
     """,
     Fails("crash", "raised RuntimeError")),
    ("add_noise",  # one timestep for the whole batch
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps[0]]
     return a.sqrt() * x0 + (1 - a).sqrt() * noise
     """,
     'one timestep for the whole batch'),
    ("velocity",
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps].reshape(-1, *[1] * (x0.dim() - 1))
     return (1 - a).sqrt() * x0 - a.sqrt() * noise
     """,
     "the sign flipped"),
    ("velocity",
     """
     a = alphas_cumprod.to(x0.dtype)[timesteps].reshape(-1, *[1] * (x0.dim() - 1))
     return a.sqrt() * x0 - (1 - a).sqrt() * noise
     """,
     "x_0 and ε swapped"),
    ("rescale_zero_terminal_snr",
     """
     s = torch.cumprod(1 - betas, 0).sqrt()
     s = s - s[-1].clone()
     a = s ** 2
     return 1 - torch.cat([a[:1], a[1:] / a[:-1]])
     """,
     "shifted but not rescaled"),
    ("rescale_zero_terminal_snr",
     """
     out = betas.clone()
     out[-1] = 1.0
     return out
     """,
     "only the last β set to 1"),
]


# Right answers written another way: each must pass (see test_mutants.py). Computing wider and casting
# once is right everywhere in the course but in add_noise/velocity on float16 (the lesson's Precision).
ALTERNATIVES = [
    ("rescale_zero_terminal_snr",
     """
     b = betas.double()
     s = torch.cumprod(1 - b, 0).sqrt()
     s0, sT = s[0].clone(), s[-1].clone()
     s = (s - sT) * (s0 / (s0 - sT))
     a = s ** 2
     return (1 - torch.cat([a[:1], a[1:] / a[:-1]])).to(betas.dtype)
     """,
     "float64 then cast: closer to exact math than diffusers' float32, which cancellation near the tail "
     "leaves 7.1e-6 off at index 997 (2.8e-6 from diffusers, outside the 1.6e-6 tolerance of old)"),
    ("scaled_linear_betas",
     "return (torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float64) ** 2)"
     ".to(torch.float32)",
     "the schedule in float64, cast once"),
    ("cosine_betas",
     """
     T = num_train_timesteps
     f = lambda t: torch.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
     i = torch.arange(T, dtype=torch.float64)
     return (1 - f((i + 1) / T) / f(i / T)).clamp(max=max_beta).to(torch.float32)
     """,
     "vectorised in float64 instead of a Python loop"),
    ("alphas_cumprod", "return torch.cumprod(1 - betas.double(), dim=0).to(betas.dtype)",
     "the running product in float64, cast once"),
    ("alphas_cumprod", "return torch.log1p(-betas.double()).cumsum(0).exp().to(betas.dtype)",
     "in log space, float64 (log1p(−1) = −inf gives ᾱ_T = 0 exactly)"),
]


def test_changing_the_input_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "alphas_cumprod", """
        betas.mul_(-1).add_(1)
        return torch.cumprod(betas, dim=0)
    """)
    assert graded.status == "failed"
    assert "changed its input(s) betas in place" in graded.text


def test_calling_the_diffusers_answer_key_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "add_noise", """
        from diffusers import DDPMScheduler
        return DDPMScheduler().add_noise(x0, noise, timesteps)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_a_sibling_schedulers_copy_of_the_answer_key_is_refused(grade_mutant):
    # LCMScheduler.add_noise is "Copied from" DDPMScheduler.add_noise: the same code, another class
    graded = grade_mutant(LAB, "add_noise", """
        from diffusers import LCMScheduler
        scheduler = LCMScheduler()
        scheduler.alphas_cumprod = alphas_cumprod
        return scheduler.add_noise(x0, noise, timesteps)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text, graded.text
    assert "answer key" in graded.reasons


def test_the_answer_key_captured_before_the_lock_is_refused(grade_mutant):
    graded = grade_mutant(LAB, "add_noise", """
        import functools
        from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
        captured = functools.partial(DDPMScheduler.add_noise, DDPMScheduler())
        return captured(x0, noise, timesteps)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text, graded.text
