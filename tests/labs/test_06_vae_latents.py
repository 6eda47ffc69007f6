"""Lab 06: wrong-but-plausible implementations fail, and the commonest ones are named."""
from expect import Fails

LAB = "06_vae_latents"

MUTANTS = [
    ("vae_scale_factor", "return 2 * len(block_out_channels)", "2·n (twice the number of blocks)"),
    ("vae_scale_factor",  # a blind learner's: the distinct widths counted
     "return 2 ** len(set(block_out_channels))", "2 ** (the number of distinct widths)"),
    ("to_uint8",  # a blind learner's: ×256, clipped
     """
     x = (images * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().cpu().numpy()
     return np.clip(np.round(x * 256.0), 0, 255).astype(np.uint8)
     """, "scaled by 256 (then clipped to 255)"),
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("vae_scale_factor", "return 2 ** len(block_out_channels)", "one halving per block"),
    ("vae_scale_factor", "return 8", "a hard-coded 8"),
    ("vae_scale_factor",  # a blind learner's: a halving where the width changes
     "return 2 ** sum(a != b for a, b in zip(block_out_channels, block_out_channels[1:]))",
     "one halving per change of width"),
    ("encode_latents",  # a blind learner's: only the mean scaled
     """
     p = vae.encode(images).latent_dist
     if not sample_posterior:
         return p.mode() * vae.config.scaling_factor
     eps = torch.randn(p.mean.shape, generator=generator, dtype=p.mean.dtype)
     return p.mean * vae.config.scaling_factor + p.std * eps
     """,
     "the scaling factor applied to μ only"),
    ("vae_scale_factor", "return len(block_out_channels) * 2", Fails("wrong", "output should be")),
    ("encode_latents",
     """
     posterior = vae.encode(images).latent_dist
     return posterior.sample(generator) if sample_posterior else posterior.mode()
     """,
     "the scaling factor forgotten"),
    ("encode_latents",
     """
     posterior = vae.encode(images).latent_dist
     z = posterior.sample(generator) if sample_posterior else posterior.mode()
     return z / vae.config.scaling_factor
     """,
     "divided by the scaling factor"),
    ("encode_latents",
     """
     posterior = vae.encode(images).latent_dist
     z = posterior.sample(generator) if sample_posterior else posterior.mode()
     return z * 0.18215
     """,
     "a hard-coded 0.18215"),
    ("encode_latents", "return vae.encode(images).latent_dist.mode() * vae.config.scaling_factor",
     "the mode taken when a sample was asked for"),
    ("encode_latents", "return vae.encode(images).latent_dist.sample(generator) * vae.config.scaling_factor",
     "a sample drawn when the mode was asked for"),
    ("encode_latents",
     """
     posterior = vae.encode(images).latent_dist
     z = posterior.sample() if sample_posterior else posterior.mode()
     return z * vae.config.scaling_factor
     """,
     "sampled without the generator"),
    ("encode_latents",  # ε added without σ
     """
     posterior = vae.encode(images).latent_dist
     if not sample_posterior:
         return posterior.mode() * vae.config.scaling_factor
     eps = torch.randn(posterior.mean.shape, generator=generator, dtype=posterior.mean.dtype)
     return (posterior.mean + eps) * vae.config.scaling_factor
     """,
     Fails("wrong", "values differ")),
    ("decode_latents", "return vae.decode(latents * vae.config.scaling_factor).sample",
     "multiplied by the scaling factor"),
    ("decode_latents", "return vae.decode(latents).sample", "the scaling factor not undone"),
    ("decode_latents", "return vae.decode(latents / 0.18215).sample", "a hard-coded 0.18215"),
    ("decode_latents", "return (vae.decode(latents / vae.config.scaling_factor).sample / 2 + 0.5).clamp(0, 1)",
     "postprocessed to [0, 1] already"),
    ("decode_latents", "return vae.decode(latents / vae.config.scaling_factor)", Fails("wrong", "output should be")),  # the DecoderOutput
    ("postprocess",
     """
     x = (images + 1) / 2
     return x if output_type == "pt" else x.permute(0, 2, 3, 1).float().numpy()
     """,
     "(x + 1)/2 without the clamp"),
    ("postprocess",
     """
     x = images.clamp(0, 1) * 0.5 + 0.5
     return x if output_type == "pt" else x.permute(0, 2, 3, 1).float().numpy()
     """,
     "clamped to [0, 1] before the shift"),
    ("postprocess",
     """
     x = (images / 2 + 0.5).clamp(0, 1)
     return x if output_type == "pt" else x.float().numpy()
     """,
     "'np' left channels first"),
    ("postprocess",
     """
     x = (images / 2 + 0.5).clamp(0, 1)
     return x if output_type == "pt" else x.permute(0, 2, 3, 1).numpy()
     """,
     "'np' left in float16"),
    ("postprocess",  # a tensor where numpy was asked for
     """
     x = (images / 2 + 0.5).clamp(0, 1)
     return x if output_type == "pt" else x.permute(0, 2, 3, 1).float()
     """,
     Fails("wrong", "output should be")),
    ("to_uint8",
     "return ((images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().numpy() * 255).astype('uint8')",
     "truncated instead of rounded"),
    ("to_uint8",
     "return ((images / 2 + 0.5).permute(0, 2, 3, 1).float().numpy() * 255).round().astype('uint8')",
     "no clamp"),
    ("to_uint8",
     "return ((images / 2 + 0.5).clamp(0, 1).float().numpy() * 255).round().astype('uint8')",
     "left channels first"),
    ("to_uint8",  # 256 levels by multiplying with 256
     "return ((images / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().numpy() * 256).round().clip(0, 255)"
     ".astype('uint8')",
     Fails("wrong", "values differ")),
    ("vae_scale_factor", "return 2 * (len(block_out_channels) - 1)", "2·(n − 1) instead of 2^(n − 1)"),
    ("encode_latents",
     """
     posterior = vae.encode(images).latent_dist
     if not sample_posterior:
         return posterior.mode() * vae.config.scaling_factor
     eps = torch.randn(posterior.mean.shape, generator=generator, dtype=posterior.mean.dtype)
     return (posterior.mean + posterior.var * eps) * vae.config.scaling_factor
     """,
     "ε scaled by the variance"),
    ("encode_latents",
     """
     posterior = vae.encode(images).latent_dist
     if not sample_posterior:
         return posterior.mode() * vae.config.scaling_factor
     eps = torch.randn(posterior.mean.shape, generator=generator, dtype=torch.float64)
     return ((posterior.mean.double() + posterior.std.double() * eps) * vae.config.scaling_factor).to(images.dtype)
     """,
     "ε drawn in float64"),
    ("decode_latents", "return vae.decode(latents / vae.config.scaling_factor).sample.clamp(-1, 1)",
     "the decoder's output clamped to [−1, 1]"),
    ("postprocess",
     """
     x = (images / 2 + 0.5).clamp(0, 1)
     return x if output_type == "pt" else x.permute(0, 3, 2, 1).float().numpy()
     """,
     "'np' channels last with H and W swapped"),
]


def mutant_args(function):
    """Extra pytest arguments for grading one mutant (test_mutants.py)."""
    return ("-k", function)

# Right answers written another way (test_mutants.py grades each: it must pass).
ALTERNATIVES = [
    ("postprocess",
     """
     x = (images.float() / 2 + 0.5).clamp(0, 1)
     return x.to(images.dtype) if output_type == "pt" else x.permute(0, 2, 3, 1).numpy()
     """,
     "a float16 image denormalized in float32: for 'np' up to 2.4e-4 from diffusers' float16 rounding "
     "(fails without the float64 shadow), and closer to exact math"),
    ("to_uint8",
     "return ((images.double() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy() * 255).round().astype('uint8')",
     "float64 levels: a float16 pixel may round to the other level than diffusers', the one exact math gives"),
    ("encode_latents",
     """
     import copy
     posterior = copy.deepcopy(vae).double().encode(images.double()).latent_dist
     z = posterior.mean
     if sample_posterior:
         z = z + posterior.std * torch.randn(z.shape, generator=generator, dtype=images.dtype).double()
     return (z * vae.config.scaling_factor).to(images.dtype)
     """,
     "a float64 copy of the VAE, the draw in the VAE's dtype as diffusers takes it, cast once"),
    ("decode_latents",
     """
     import copy
     vae64 = copy.deepcopy(vae).double()
     return vae64.decode(latents.double() / vae.config.scaling_factor).sample.to(latents.dtype)
     """,
     "a float64 copy of the VAE, cast once"),
]


def test_multiplying_by_the_inverse_scaling_factor_passes(grade_mutant):
    graded = grade_mutant(LAB, "decode_latents", "return vae.decode((1 / vae.config.scaling_factor) * latents).sample")
    assert graded.status == "passed", graded


def test_decoding_sample_by_sample_passes(grade_mutant):
    graded = grade_mutant(LAB, "decode_latents", """
        z = latents / vae.config.scaling_factor
        return torch.cat([vae.decode(z[i:i + 1]).sample for i in range(z.shape[0])])
    """)
    assert graded.status == "passed", graded


def test_returning_a_tensor_for_np_says_to_convert_it(grade_mutant):
    graded = grade_mutant(LAB, "postprocess", """
        x = (images / 2 + 0.5).clamp(0, 1)
        return x if output_type == "pt" else x.permute(0, 2, 3, 1).float()
    """)
    assert graded.status == "failed"
    assert "should be a numpy.ndarray" in graded.text and ".numpy()" in graded.text


def test_calling_the_image_processor_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "postprocess", """
        from diffusers.image_processor import VaeImageProcessor
        return VaeImageProcessor().postprocess(images, output_type=output_type)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
