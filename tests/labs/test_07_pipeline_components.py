"""Lab 07: wrong-but-plausible implementations fail, and the commonest ones are named."""
from expect import Fails

LAB = "07_pipeline_components"

PREPARE = """
shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
if latents is not None:
    noise = latents
elif isinstance(generator, list) and len(generator) > 1:
    noise = torch.cat([torch.randn((1, *shape[1:]), generator=gen, dtype=dtype) for gen in generator])
else:
    noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
return noise * init_noise_sigma
"""

MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("repeat_per_prompt",  # a blind learner's: tokens interleaved, then viewed
     "b, l, _ = prompt_embeds.shape\nreturn prompt_embeds.repeat_interleave(num_images_per_prompt, dim=1)"
     ".view(b * num_images_per_prompt, l, -1)",
     "each token copied n times in place, then viewed"),
    ("repeat_per_prompt",  # a blind learner's: the features repeated, then viewed
     "b, l, d = prompt_embeds.shape\nreturn prompt_embeds.repeat(1, 1, num_images_per_prompt)"
     ".view(b * num_images_per_prompt, l, d)",
     "each token copied n times in place, then viewed"),
    ("prepare_latents",  # a blind learner's: SD's factor 8 where the tiny VAE's is 2
     """
     shape = (batch_size, num_channels_latents, height // 8, width // 8)
     if latents is not None:
         return latents * init_noise_sigma
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
     return noise * init_noise_sigma
     """, "the VAE factor hard-coded to SD's 8"),
    ("input_error",  # a blind learner's: only a list too short refused
     """
     if height % 8 or width % 8:
         return "size"
     if isinstance(generator, list) and len(generator) < batch_size:
         return "generators"
     return None
     """,
     "only a generator list shorter than the batch refused"),
    ("input_error",
     """
     if height % vae_scale_factor or width % vae_scale_factor:
         return "size"
     if isinstance(generator, list) and len(generator) != batch_size:
         return "generators"
     return None
     """,
     "divisibility checked against vae_scale_factor"),
    ("input_error",
     """
     if height % 8:
         return "size"
     if isinstance(generator, list) and len(generator) != batch_size:
         return "generators"
     return None
     """,
     "only the height checked"),
    ("input_error",
     """
     if height % 8 or width % 8:
         return "size"
     if isinstance(generator, list) and len(generator) > 1 and len(generator) != batch_size:
         return "generators"
     return None
     """,
     "a list of one generator accepted"),
    ("input_error", "return 'size' if height % 8 or width % 8 else None", "the generator list's length not checked"),
    ("input_error", "return None", Fails("wrong", "output should be")),
    ("input_error",  # an empty message is no message
     """
     if height % 8 or width % 8 or (isinstance(generator, list) and len(generator) != batch_size):
         return ""
     return None
     """,
     Fails("wrong", "output should be")),
    ("input_error",  # raising like diffusers instead of returning the message
     """
     if height % 8 or width % 8:
         raise ValueError("height and width must be divisible by 8")
     return None
     """,
     Fails("crash", "raised ValueError")),
    ("repeat_per_prompt", "return prompt_embeds.repeat(num_images_per_prompt, 1, 1)", "the whole batch tiled"),
    ("repeat_per_prompt", "return prompt_embeds.repeat(1, num_images_per_prompt, 1)",
     "repeated along the token axis but not reshaped"),
    ("repeat_per_prompt", "return prompt_embeds", "not repeated at all"),
    ("repeat_per_prompt",  # the right order, built by viewing the wrong axis
     """
     B, L, D = prompt_embeds.shape
     return prompt_embeds.repeat(1, 1, num_images_per_prompt).view(B * num_images_per_prompt, L, D)
     """,
     Fails("wrong", "values differ")),
    ("prepare_latents",
     """
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if latents is not None:
         return latents
     if isinstance(generator, list) and len(generator) > 1:
         return torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     gen = generator[0] if isinstance(generator, list) else generator
     return torch.randn(shape, generator=gen, dtype=dtype)
     """,
     "init_noise_sigma forgotten"),
    ("prepare_latents",
     """
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if latents is not None:
         return latents / init_noise_sigma
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
     return noise / init_noise_sigma
     """,
     "divided by init_noise_sigma"),
    ("prepare_latents",
     """
     shape = (batch_size, num_channels_latents, width // vae_scale_factor, height // vae_scale_factor)
     gen = generator[0] if isinstance(generator, list) else generator
     noise = latents if latents is not None else torch.randn(shape, generator=gen, dtype=dtype)
     return noise * init_noise_sigma
     """,
     "height and width swapped"),
    ("prepare_latents",
     """
     shape = (batch_size, num_channels_latents, height, width)
     gen = generator[0] if isinstance(generator, list) else generator
     noise = latents if latents is not None else torch.randn(shape, generator=gen, dtype=dtype)
     return noise * init_noise_sigma
     """,
     "the image size used for the latents"),
    ("prepare_latents",
     """
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     gen = generator[0] if isinstance(generator, list) else generator
     noise = latents if latents is not None else torch.randn(shape, generator=gen, dtype=dtype)
     return noise * init_noise_sigma
     """,
     "a generator list: everything drawn from the first generator"),
    ("prepare_latents",
     """
     if latents is not None:
         return latents
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
     return noise * init_noise_sigma
     """,
     "the given latents not scaled"),
    ("prepare_latents",
     """
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
     return noise * init_noise_sigma
     """,
     "fresh noise drawn although latents were given"),
    ("prepare_latents",  # the dtype argument ignored: float32 noise for a float16 request
     """
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator)
     return (noise if latents is None else latents) * init_noise_sigma
     """,
     'the noise drawn in float32 and cast to dtype'),
    ("prepare_latents",  # SD's 4 channels hard-coded: wrong for an SD3/Flux-style UNet (16) or any other
     """
     shape = (batch_size, 4, height // vae_scale_factor, width // vae_scale_factor)
     if latents is not None:
         return latents * init_noise_sigma
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
     return noise * init_noise_sigma
     """,
     "4 latent channels hard-coded"),
    ("prepare_latents",  # one generator, but drawn one sample at a time
     """
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if latents is not None:
         return latents * init_noise_sigma
     gens = generator if isinstance(generator, list) else [generator] * batch_size
     noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in gens])
     return noise * init_noise_sigma
     """,
     "one generator drawn sample by sample"),
    ("prepare_latents",  # generator=None replaced by a seeded generator: reproducible, but not the global RNG
     """
     if generator is None:
         generator = torch.Generator().manual_seed(0)
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if latents is not None:
         return latents * init_noise_sigma
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
     return noise * init_noise_sigma
     """,
     Fails("wrong", "values differ")),
    ("prepare_latents",  # noise drawn (and thrown away) although latents were given: the generator moves
     """
     shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
     if isinstance(generator, list) and len(generator) > 1:
         noise = torch.cat([torch.randn((1, *shape[1:]), generator=g, dtype=dtype) for g in generator])
     else:
         noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)
     return (noise if latents is None else latents) * init_noise_sigma
     """,
     Fails("wrong", "drew a different amount of noise")),
    ("prepare_latents",  # the right latents, then a stray draw from the global RNG when no generator is given
     PREPARE.replace("return noise * init_noise_sigma", """out = noise * init_noise_sigma
if generator is None:
    torch.randn(1)
return out"""),
     Fails("wrong", "the global RNG does not stand where diffusers' draw leaves it")),
    ("prepare_latents",  # the right latents, then one more draw from each generator it was given
     PREPARE.replace("return noise * init_noise_sigma", """out = noise * init_noise_sigma
for gen in (generator if isinstance(generator, list) else [generator]):
    if gen is not None:
        torch.randn(1, generator=gen)
return out"""),
     Fails("wrong", "drew a different amount of noise")),
    ("prepare_latents",  # a generator list drawn through copies: the right values, the caller's list untouched
     PREPARE.replace("generator=gen, dtype=dtype) for gen in generator",
                     "generator=torch.Generator().set_state(gen.get_state()), dtype=dtype) for gen in generator"),
     Fails("wrong", "drew a different amount of noise")),
]

# Right answers written another way (test_mutants.py grades each: it must pass).
ALTERNATIVES = [
    ("prepare_latents",
     PREPARE.replace("return noise * init_noise_sigma", "return (noise.double() * init_noise_sigma).to(noise.dtype)"),
     "σ_init·ε in float64, cast once: judged against the float64 shadow where its rounding differs"),
]


def mutant_args(function):
    """Extra pytest arguments for grading one mutant (test_mutants.py)."""
    return ("-k", function)


def test_any_non_empty_message_counts_as_the_error(grade_mutant):
    graded = grade_mutant(LAB, "input_error", """
        if height % 8 or width % 8 or (isinstance(generator, list) and len(generator) != batch_size):
            return "no"
        return None
    """, "-k", "input_error")
    assert graded.status == "passed", graded


def test_repeat_interleave_is_the_same_order(grade_mutant):
    graded = grade_mutant(LAB, "repeat_per_prompt", "return prompt_embeds.repeat_interleave(num_images_per_prompt, 0)",
                          "-k", "repeat_per_prompt")
    assert graded.status == "passed", graded


def test_drawing_float32_noise_and_casting_differs_where_the_size_is_not_a_multiple_of_16(grade_mutant):
    # Equal on a CPU only when C·h·w is a multiple of 16 (what every case used to be); (3, 3, 9, 5) is not.
    graded = grade_mutant(LAB, "prepare_latents", """
        shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
        if latents is not None:
            return latents * init_noise_sigma
        if isinstance(generator, list) and len(generator) > 1:
            noise = torch.cat([torch.randn((1, *shape[1:]), generator=g) for g in generator])
        else:
            noise = torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator)
        return noise.to(dtype) * init_noise_sigma
    """, "-k", "prepare_latents")
    assert graded.status == "failed", graded
    assert "trap: the noise drawn in float32 and cast to dtype" in graded.text, graded.text


def test_calling_the_pipeline_method_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "prepare_latents", """
        from diffusers.utils.torch_utils import randn_tensor
        shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)
        noise = latents if latents is not None else randn_tensor(shape, generator=generator, dtype=dtype)
        return noise * init_noise_sigma
    """, "-k", "prepare_latents")
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
