"""Lab 05: wrong-but-plausible sampling loops fail, and the commonest ones are named."""
import pytest

from expect import Fails

LAB = "05_sampling_loop"
FUNCTIONS = ("initial_noise", "sampling_loop", "to_image", "generate")


def only(function):
    """-k arguments that grade one kata function (faster). "sampling_loop" is also in the file name, which
    -k matches too, so that one is selected by leaving the others out."""
    others = " and ".join(f"not {f}" for f in FUNCTIONS if f != function)
    return ("-k", others if function in LAB else function)

LOOP = """
scheduler.set_timesteps(num_inference_steps)
kw = {} if eta is None else {"eta": eta}
x = noise
with torch.no_grad():
    for t in scheduler.timesteps:
        x = scheduler.step(unet(x, t).sample, t, x, STEP_ARGS**kw).prev_sample AFTER
return x
"""


def loop(step_args="generator=generator, ", after="", eta_kw=True):
    body = LOOP.replace("STEP_ARGS", step_args).replace(" AFTER", after)
    return body if eta_kw else body.replace("**kw", "")


MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("initial_noise",
     """
     return torch.cat([torch.randn((1, channels, size, size), generator=generator, dtype=dtype)
                       for _ in range(batch_size)])
     """,
     "one torch.randn call per image"),
    ("initial_noise",
     "return torch.rand((batch_size, channels, size, size), generator=generator, dtype=dtype)",
     "uniform noise"),
    ("initial_noise",
     "return torch.randn((batch_size, size, size, channels), generator=generator, dtype=dtype)",
     "channels last"),
    ("initial_noise",  # float32 noise cast to float16: other values unless B·C·H·W is a multiple of 16
     "return torch.randn((batch_size, channels, size, size), generator=generator).to(dtype)",
     "drawn in float32, then cast to dtype"),
    ("initial_noise",  # the global RNG instead of the generator
     "return torch.randn((batch_size, channels, size, size), dtype=dtype)",
     "drawn from the global RNG: generator= not passed"),
    ("initial_noise",  # the dtype ignored
     "return torch.randn((batch_size, channels, size, size), generator=generator)",
     Fails("wrong", "has dtype")),
    ("initial_noise",  # the right noise, then one draw too many from the generator
     """
     x = torch.randn((batch_size, channels, size, size), generator=generator, dtype=dtype)
     torch.randn(1, generator=generator)
     return x
     """,
     Fails("wrong", "drew a different amount of noise")),
    ("initial_noise",  # the right values, drawn from a copy: the caller's generator is never advanced
     """
     copy = torch.Generator().set_state(generator.get_state())
     return torch.randn((batch_size, channels, size, size), generator=copy, dtype=dtype)
     """,
     Fails("wrong", "drew a different amount of noise")),
    ("sampling_loop", loop(step_args=""), "scheduler.step called without generator="),
    ("sampling_loop", loop(eta_kw=False), "eta not passed to scheduler.step"),
    ("sampling_loop", loop(after=".clamp(-1, 1)"), "the sample clamped to [-1, 1] inside the loop"),
    ("sampling_loop",  # the right loop, then a draw after the last step (a "preview" noise)
     loop().replace("return x", "torch.randn(x.shape, generator=generator)\nreturn x"),
     Fails("wrong", "drew a different amount of noise")),
    ("sampling_loop",  # the generator re-seeded: reproducible, but not the pipeline's stream
     loop(step_args="generator=torch.Generator().manual_seed(0), "),
     Fails("wrong", "values differ")),
    ("to_image", "return sample / 2 + 0.5", "rescaled but not clamped"),
    ("to_image", "return sample.clamp(0, 1)", "clamped but not rescaled"),
    ("to_image", "return (sample / 2 + 0.5).clamp(0, 1) * 255", "scaled to 0-255"),
    ("to_image", "return sample.clamp(-1, 1)", "clamped to [-1, 1], never mapped to [0, 1]"),
    ("to_image", "return (sample - sample.min()) / (sample.max() - sample.min())",
     "stretched by its own min and max, not mapped from [-1, 1]"),
    ("to_image",  # per image: a near variant of the batch-wide stretch
     """
     lo = sample.amin(dim=(1, 2, 3), keepdim=True)
     return (sample - lo) / (sample.amax(dim=(1, 2, 3), keepdim=True) - lo)
     """,
     "stretched by its own min and max, not mapped from [-1, 1]"),
    ("to_image", "return sample.sigmoid()", Fails("wrong", "values differ")),
    ("generate",
     """
     noise = initial_noise(batch_size, unet.config.in_channels, unet.config.sample_size, generator, unet.dtype)
     return sampling_loop(unet, scheduler, noise, num_inference_steps, generator, eta=eta)
     """,
     "the sample returned before to_image"),
    ("generate",  # the noise drawn one image at a time (through the learner's own initial_noise)
     """
     c, s = unet.config.in_channels, unet.config.sample_size
     noise = torch.cat([initial_noise(1, c, s, generator, unet.dtype) for _ in range(batch_size)])
     return to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, generator, eta=eta))
     """,
     "the initial noise drawn one image at a time"),
    ("generate",  # a blind learner's: a fresh generator with the same seed for the loop
     """
     c, s = unet.config.in_channels, unet.config.sample_size
     noise = initial_noise(batch_size, c, s, generator, unet.dtype)
     again = torch.Generator().manual_seed(generator.initial_seed())
     return to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, again, eta=eta))
     """,
     "a fresh generator with the same seed for the loop"),
    ("generate",  # the noise drawn in float32 and cast to the UNet's float16
     """
     c, s = unet.config.in_channels, unet.config.sample_size
     noise = initial_noise(batch_size, c, s, generator, torch.float32).to(unet.dtype)
     return to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, generator, eta=eta))
     """,
     "the initial noise drawn in float32, then cast to the UNet's dtype"),
    ("generate",
     """
     noise = initial_noise(batch_size, unet.config.in_channels, unet.config.sample_size, generator, unet.dtype)
     return to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, generator))
     """,
     "eta not passed on to the loop"),
    ("generate",
     """
     noise = initial_noise(batch_size, unet.config.in_channels, unet.config.sample_size, generator, unet.dtype)
     scheduler.set_timesteps(num_inference_steps)
     kw = {} if eta is None else {"eta": eta}
     x = noise
     with torch.no_grad():
         for t in scheduler.timesteps:
             x = scheduler.step(unet(x, t).sample, t, x, **kw).prev_sample
     return to_image(x)
     """,
     "scheduler.step called without generator="),
    ("generate",  # the right images from a copy of the generator: the caller's is never advanced
     """
     copy = torch.Generator().set_state(generator.get_state())
     noise = initial_noise(batch_size, unet.config.in_channels, unet.config.sample_size, copy, unet.dtype)
     return to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, copy, eta=eta))
     """,
     Fails("wrong", "drew a different amount of noise")),
]

# Loops whose UNet calls differ from the pipeline's: the counted UNet names what went wrong.
CALL_MUTANTS = [
    ("sampling_loop", "set_timesteps forgotten",
     """
     x = noise
     with torch.no_grad():
         for t in scheduler.timesteps:
             x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **({} if eta is None else {"eta": eta})).prev_sample
     return x
     """,
     "trap: set_timesteps not called: the scheduler's earlier schedule used"),
    ("sampling_loop", "the UNet called twice per step",
     """
     scheduler.set_timesteps(num_inference_steps)
     kw = {} if eta is None else {"eta": eta}
     x = noise
     with torch.no_grad():
         for t in scheduler.timesteps:
             preview = unet(x, t).sample
             x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **kw).prev_sample
     return x
     """,
     "trap: the UNet called twice per step"),
    ("sampling_loop", "range(n) instead of the timesteps",
     """
     scheduler.set_timesteps(num_inference_steps)
     kw = {} if eta is None else {"eta": eta}
     x = noise
     with torch.no_grad():
         for t in range(num_inference_steps):
             x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **kw).prev_sample
     return x
     """,
     "trap: the loop index as the timestep (range(n))"),
    ("sampling_loop", "the loop index passed to scheduler.step",
     """
     scheduler.set_timesteps(num_inference_steps)
     kw = {} if eta is None else {"eta": eta}
     x = noise
     with torch.no_grad():
         for i, t in enumerate(scheduler.timesteps):
             x = scheduler.step(unet(x, t).sample, i, x, generator=generator, **kw).prev_sample
     return x
     """,
     "trap: the loop index passed to scheduler.step"),
    ("sampling_loop", "the timesteps reversed",
     """
     scheduler.set_timesteps(num_inference_steps)
     kw = {} if eta is None else {"eta": eta}
     x = noise
     with torch.no_grad():
         for t in scheduler.timesteps.flip(0):
             x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **kw).prev_sample
     return x
     """,
     "the schedule walked backwards"),
    ("sampling_loop", "the last step skipped",
     """
     scheduler.set_timesteps(num_inference_steps)
     kw = {} if eta is None else {"eta": eta}
     x = noise
     with torch.no_grad():
         for t in scheduler.timesteps[:-1]:
             x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **kw).prev_sample
     return x
     """,
     "trap: the loop stopped before the schedule's end"),
    ("sampling_loop", "no torch.no_grad()",
     """
     scheduler.set_timesteps(num_inference_steps)
     kw = {} if eta is None else {"eta": eta}
     x = noise
     for t in scheduler.timesteps:
         x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **kw).prev_sample
     return x
     """,
     "torch.no_grad()"),
    ("generate", "one image at a time",
     """
     images = []
     for _ in range(batch_size):
         noise = initial_noise(1, unet.config.in_channels, unet.config.sample_size, generator, unet.dtype)
         images.append(to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, generator, eta=eta)))
     return torch.cat(images)
     """,
     "sends all"),
    ("generate", "the noise drawn in float32 whatever the UNet's dtype",
     """
     noise = initial_noise(batch_size, unet.config.in_channels, unet.config.sample_size, generator, torch.float32)
     return to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, generator, eta=eta))
     """,
     "draws the noise in unet.dtype"),
]


mutant_args = only  # test_mutants.py grades each mutant with these -k arguments

# Right answers written another way (test_mutants.py grades each: it must pass).
ALTERNATIVES = [
    ("to_image", "return (sample.double() / 2 + 0.5).clamp(0, 1).to(sample.dtype)",
     "float64 then cast: to_image follows the course's precision policy (judged against its float64 shadow)"),
]


@pytest.mark.parametrize("function, mistake, body, message", CALL_MUTANTS, ids=[m[1] for m in CALL_MUTANTS])
def test_a_loop_that_calls_the_unet_unlike_the_pipeline_fails_with_a_diagnosis(
        grade_mutant, function, mistake, body, message):
    graded = grade_mutant(LAB, function, body, *only(function))
    assert graded.status == "failed", graded
    assert message in graded.text, graded.text


def test_changing_the_sample_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "to_image", "return sample.div_(2).add_(0.5).clamp_(0, 1)", *only("to_image"))
    assert graded.status == "failed"
    assert "changed its input(s) sample in place" in graded.text


def test_calling_the_pipelines_noise_helper_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "initial_noise", """
        from diffusers.utils.torch_utils import randn_tensor
        return randn_tensor((batch_size, channels, size, size), generator=generator, dtype=dtype)
    """, *only("initial_noise"))
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
