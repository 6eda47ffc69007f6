"""Lab 08: wrong-but-plausible implementations fail, and the commonest ones are named."""
import textwrap

# The unpatchify checks import diffusers' transformer models lazily (a heavy import); do it once here,
# before any pytester snapshot, so that the mutant runs share it instead of importing it again each time.
import diffusers.models.transformers.dit_transformer_2d  # noqa: F401
import pytest

from expect import Fails

LAB = "08_conditioning"

# The embedding's angles, written once for the timestep mutants (each then gets one thing wrong).
ANGLES = """
half = embedding_dim // 2
freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / (half - downscale_freq_shift))
a = scale * (timesteps[:, None].float() * freqs)
"""
PAD = """
if embedding_dim % 2:
    emb = F.pad(emb, (0, 1))
return emb
"""
CAT = "emb = torch.cat([a.cos(), a.sin()] if flip_sin_to_cos else [a.sin(), a.cos()], -1)"


def body(*parts: str) -> str:
    """One function body from parts written at different indents."""
    return "\n".join(textwrap.dedent(part).strip("\n") for part in parts)


MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("timestep_embedding", body(ANGLES, "emb = torch.cat([a.sin(), a.cos()], -1)", PAD),
     "[sin | cos] kept although flip_sin_to_cos=True"),
    ("timestep_embedding", body(ANGLES, """
     first, second = (a.cos(), a.sin()) if flip_sin_to_cos else (a.sin(), a.cos())
     emb = torch.stack([first, second], -1).reshape(len(timesteps), -1)
     """, PAD),
     "sin and cos interleaved"),
    ("timestep_embedding", body(ANGLES, """
     emb = torch.cat([a.sin(), a.cos()], -1)
     if flip_sin_to_cos:
         emb = emb.flip(-1)
     """, PAD),
     "the whole vector reversed"),
    ("timestep_embedding",
     body(ANGLES.replace("(half - downscale_freq_shift)", "(half - 1)"), CAT, PAD),
     "frequencies divided by half − 1"),
    ("timestep_embedding",
     body(ANGLES.replace("(half - downscale_freq_shift)", "half"), CAT, PAD),
     "downscale_freq_shift ignored"),
    ("timestep_embedding",
     body(ANGLES, "return torch.cat([a.cos(), a.sin()] if flip_sin_to_cos else [a.sin(), a.cos()], -1)"),
     "an odd embedding_dim not zero-padded"),
    ("timestep_embedding", body(ANGLES, CAT, PAD.replace("(0, 1)", "(1, 0)")), "an odd embedding_dim's zero column put first"),
    ("timestep_embedding", body(ANGLES.replace("a = scale * (timesteps", "a = (timesteps"), CAT, "emb = scale * emb", PAD),
     "scale applied to the sines and cosines, not to the angles"),
    ("timestep_embedding", body(ANGLES.replace("torch.arange(half, dtype=torch.float32)",
                                               "torch.arange(1, half + 1, dtype=torch.float32)"), CAT, PAD),
     "frequencies counted from i = 1"),
    ("timestep_embedding",  # frequencies growing instead of shrinking
     body(ANGLES.replace("-math.log", "math.log"), CAT, PAD),
     Fails("wrong", "values differ")),
    ("timestep_embedding",  # the embedding left in float64
     body(ANGLES.replace("timesteps[:, None].float()", "timesteps[:, None].double()"), CAT, PAD),
     Fails("wrong", "has dtype")),
    ("timestep_embedding",  # the timesteps never cast: float64 timesteps make a float64 embedding
     body(ANGLES.replace("timesteps[:, None].float()", "timesteps[:, None]"), CAT, PAD),
     "the timesteps not cast to float32"),
    ("timestep_embedding",  # the frequencies built in the timesteps' dtype (float16 angles for float16 timesteps)
     body(ANGLES.replace("timesteps[:, None].float()", "timesteps[:, None]")
                .replace("dtype=torch.float32", "dtype=timesteps.dtype if timesteps.is_floating_point() else None"),
          CAT, PAD),
     'the timesteps not cast to float32'),
    ("patchify",
     """
     B, C, H, W = latents.shape
     p = patch_size
     return latents.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 3, 5, 1).reshape(B, -1, C * p * p)
     """,
     "channels last inside a patch"),
    ("patchify",
     """
     B, C, H, W = latents.shape
     p = patch_size
     return latents.reshape(B, C, H // p, p, W // p, p).permute(0, 4, 2, 1, 3, 5).reshape(B, -1, C * p * p)
     """,
     "the patch grid transposed"),
    ("patchify",
     """
     B, C, H, W = latents.shape
     p = patch_size
     return latents.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 5, 3).reshape(B, -1, C * p * p)
     """,
     "rows and columns swapped inside a patch"),
    ("patchify",
     """
     B, C, H, W = latents.shape
     return latents.reshape(B, (H // patch_size) * (W // patch_size), -1)
     """,
     "a plain reshape"),
    ("patchify",  # a blind learner's: H and W split as (p, H/p), so a token's pixels lie H/p apart
     """
     B, C, H, W = latents.shape
     p = patch_size
     return latents.reshape(B, C, p, H // p, p, W // p).permute(0, 3, 5, 1, 2, 4).reshape(B, -1, C * p * p)
     """,
     "H and W split as (p, H/p)"),
    ("patchify",  # one feature vector per patch, but (B, C·p·p, N): the transpose forgotten
     """
     B, C, H, W = latents.shape
     p = patch_size
     return latents.reshape(B, C, H // p, p, W // p, p).permute(0, 1, 3, 5, 2, 4).reshape(B, C * p * p, -1)
     """,
     Fails("wrong", "values differ")),
    ("unpatchify",
     """
     p = patch_size
     x = tokens.reshape(tokens.shape[0], height // p, width // p, channels, p, p)
     return torch.einsum("nhwcpq->nchpwq", x).reshape(tokens.shape[0], channels, height, width)
     """,
     "channels first inside a token"),
    ("unpatchify",
     """
     p = patch_size
     x = tokens.reshape(tokens.shape[0], width // p, height // p, p, p, channels)
     return torch.einsum("nwhpqc->nchpwq", x).reshape(tokens.shape[0], channels, height, width)
     """,
     "the patch grid transposed"),
    ("unpatchify",
     """
     p = patch_size
     x = tokens.reshape(tokens.shape[0], height // p, width // p, p, p, channels)
     return torch.einsum("nhwpqc->nchqwp", x).reshape(tokens.shape[0], channels, height, width)
     """,
     "rows and columns swapped inside a patch"),
    ("unpatchify",  # no regrouping at all
     "return tokens.transpose(1, 2).reshape(tokens.shape[0], channels, height, width)",
     Fails("wrong", "values differ")),
    ("ada_layer_norm_zero",
     """
     s, c, g, s2, c2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).chunk(6, dim=1)
     h = F.layer_norm(x.transpose(1, 2), (x.shape[1],), eps=1e-6).transpose(1, 2)
     return h * (1 + c[:, None]) + s[:, None], g, s2, c2, g2
     """, "LayerNorm over the tokens (axis N)"),
    ("ada_layer_norm_zero",
     """
     s, c, g, s2, c2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).chunk(6, dim=1)
     h = F.layer_norm(x, (x.shape[-1],), eps=1e-6)
     return h * c[:, None] + s[:, None], g, s2, c2, g2
     """,
     "the scale used without the 1 +"),
    ("ada_layer_norm_zero",
     """
     c, s, g, c2, s2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).chunk(6, dim=1)
     h = F.layer_norm(x, (x.shape[-1],), eps=1e-6)
     return modulate(h, s, c), g, s2, c2, g2
     """,
     "shift and scale swapped"),
    ("ada_layer_norm_zero",
     """
     s, c, g, s2, c2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).chunk(6, dim=1)
     return F.layer_norm(modulate(x, s, c), (x.shape[-1],), eps=1e-6), g, s2, c2, g2
     """,
     "modulated before the LayerNorm"),
    ("ada_layer_norm_zero",
     """
     s, c, g, s2, c2, g2 = F.linear(emb, linear_weight, linear_bias).chunk(6, dim=1)
     return modulate(F.layer_norm(x, (x.shape[-1],), eps=1e-6), s, c), g, s2, c2, g2
     """,
     "the SiLU skipped"),
    ("ada_layer_norm_zero",
     """
     s, c, g, s2, c2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).chunk(6, dim=1)
     return modulate(torch.nn.LayerNorm(x.shape[-1], elementwise_affine=False).to(x.dtype)(x), s, c), g, s2, c2, g2
     """,
     "LayerNorm eps 1e-5"),
    ("ada_layer_norm_zero",
     """
     s, c, g, s2, c2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).chunk(6, dim=1)
     h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
     return modulate(h, s, c), g, s2, c2, g2
     """,
     "an RMSNorm"),
    ("ada_layer_norm_zero",  # only the modulated tokens, not the four vectors the block needs
     """
     s, c, g, s2, c2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).chunk(6, dim=1)
     return modulate(F.layer_norm(x, (x.shape[-1],), eps=1e-6), s, c)
     """,
     Fails("wrong", "output should be")),
    ("ada_layer_norm_zero",  # the chunks split along the token features' wrong axis
     """
     s, c, g, s2, c2, g2 = F.linear(F.silu(emb), linear_weight, linear_bias).reshape(emb.shape[0], -1, 6).unbind(-1)
     return modulate(F.layer_norm(x, (x.shape[-1],), eps=1e-6), s, c), g, s2, c2, g2
     """,
     Fails("wrong", "values differ")),
]


EQUIVALENTS = [
    # (function, a correct body written another way): the tolerances must accept these.
    ("timestep_embedding",  # ω as 1/max_period**(i/(half − shift)), angles in float64
     """
     half = embedding_dim // 2
     i = torch.arange(half, dtype=torch.float64)
     a = (timesteps.double()[:, None] * scale / max_period ** (i / (half - downscale_freq_shift))).float()
     emb = torch.cat([a.cos(), a.sin()] if flip_sin_to_cos else [a.sin(), a.cos()], -1)
     return torch.cat([emb, emb.new_zeros(len(timesteps), embedding_dim % 2)], -1)
     """),
    ("patchify",  # F.unfold gathers each patch in (c, i, j) order, row-major over the grid
     """
     return F.unfold(latents.float(), patch_size, stride=patch_size).transpose(1, 2).to(latents.dtype)
     """),
    ("ada_layer_norm_zero",  # LayerNorm and Linear by hand, in the inputs' dtype (float16 statistics)
     """
     p = emb * torch.sigmoid(emb) @ linear_weight.T + linear_bias
     s, c, g, s2, c2, g2 = p.chunk(6, dim=1)
     mean = x.mean(-1, keepdim=True)
     var = ((x - mean) ** 2).mean(-1, keepdim=True)
     return (x - mean) / torch.sqrt(var + 1e-6) * (1 + c[:, None]) + s[:, None], g, s2, c2, g2
     """),
    ("ada_layer_norm_zero",  # everything in float64, cast once: judged against the float64 shadow
     """
     p = F.linear(F.silu(emb.double()), linear_weight.double(), linear_bias.double())
     s, c, g, s2, c2, g2 = p.chunk(6, dim=1)
     out = F.layer_norm(x.double(), (x.shape[-1],), eps=1e-6) * (1 + c[:, None]) + s[:, None]
     return tuple(t.to(x.dtype) for t in (out, g, s2, c2, g2))
     """),
]


@pytest.mark.parametrize("function, body", EQUIVALENTS, ids=[f"{m[0]}-{i}" for i, m in enumerate(EQUIVALENTS)])
def test_a_correct_implementation_written_another_way_passes(grade_mutant, function, body):
    graded = grade_mutant(LAB, function, body)
    assert graded.status == "passed", graded


def test_calling_the_diffusers_answer_key_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "timestep_embedding", """
        from diffusers.models.embeddings import get_timestep_embedding
        return get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale,
                                      max_period)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
