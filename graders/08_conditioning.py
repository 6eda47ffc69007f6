"""Grader for lab 08 · UNet and DiT conditioning: timestep features, patchify, unpatchify, adaLN-Zero.

References are live diffusers code:
- get_timestep_embedding and the Timesteps module (with the UNets' settings and with others);
- PatchEmbed with its Conv2d set to the identity and no positional embedding, so its output is the
  patches themselves in the order a Linear equal to the conv expects;
- the unpatchify at the end of DiTTransformer2DModel.forward (square) and SD3Transformer2DModel.forward
  (non-square): a tiny random model runs with a forward hook that replaces its last Linear's output by
  the scenario's tokens, so the model's own reshape/einsum turns them into the expected latent;
- AdaLayerNormZero, with random modulation weights (diffusers does not zero-initialise them).

Import cost: embeddings and normalization load with this module. The transformer models load only when
an unpatchify check runs: importing one imports diffusers' whole transformers package (~75 model files).

Precision: every float scenario also carries the float64 shadow of diffusers' answer (Scenario.exact):
the sinusoid with float64 frequencies and angles from the timesteps' own values; patchify and unpatchify
by the same diffusers code on the widened tensors (a float64 copy of the identity PatchEmbed; the model's
own reshape fed float64 tokens); adaLN-Zero's formula in float64 on the same inputs. An answer at most 2×
as far from it as diffusers' own (+ 2 ulps) passes: float64 frequencies or angles cast to float32, a
LayerNorm computed in float64 and cast. Only data moves in patchify and unpatchify, so there any
difference from diffusers is a wrong layout whatever the dtype.
"""
import copy
import functools
import math

import torch
import torch.nn.functional as F
from diffusers.models.embeddings import PatchEmbed, Timesteps, get_timestep_embedding
from diffusers.models.normalization import AdaLayerNormZero

from diffusion_katas.engine.helpers import DTYPES, MODELS, PIPELINES
from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import EMBED_ANGLE, EXACT, NORM_HALF, NORM_MATH


# ---- timestep_embedding -----------------------------------------------------------------------------
def draw_timesteps(kind: str, batch: int, g: torch.Generator, dtype: str | None = None) -> torch.Tensor:
    """Timesteps with both ends of the range in every batch, shuffled.

    "int": int64 in [0, 999], as DDPM/DDIM pass them; "fractional": float32 in [0, 999], as Euler-type
    schedulers pass them; "unit": float32 in [0, 1], the flow-matching models' sigmas (used with scale).
    """
    if kind == "int":
        t = torch.cat([torch.tensor([0, 999]), torch.randint(1, 999, (batch - 2,), generator=g)])
    elif kind == "fractional":
        t = torch.cat([torch.tensor([0.0, 999.0]), torch.rand(batch - 2, generator=g) * 999])
    else:
        t = torch.cat([torch.tensor([0.0, 1.0]), torch.rand(batch - 2, generator=g)])
    t = t[torch.randperm(batch, generator=g)]
    return t if dtype is None else t.to(DTYPES.get(dtype) or getattr(torch, dtype))


def timestep_label(t: torch.Tensor) -> str:
    values = [round(v, 3) for v in t.tolist()] if t.is_floating_point() else t.tolist()
    return f"timesteps {values}"


timestep_embedding = Kata(
    "timestep_embedding",
    hints=(
        "half = embedding_dim // 2 frequencies spaced geometrically from 1 down to ~1/max_period; "
        "each timestep gives half angles, and the output is their sines and cosines side by side.",
        "ω_i = exp(−ln(max_period)·i/(half − downscale_freq_shift)), i = 0…half−1; angles = scale·t·ω; "
        "emb = [sin | cos], or [cos | sin] when flip_sin_to_cos (the halves swap); odd D: one 0 column at the end.",
        "freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32) / (half - "
        "downscale_freq_shift)); a = scale * (timesteps[:, None].float() * freqs); emb = torch.cat([a.sin(), "
        "a.cos()], -1); flip: torch.cat([emb[:, half:], emb[:, :half]], -1); odd: F.pad(emb, (0, 1))",
    ),
    answer_key=("diffusers.models.embeddings.get_timestep_embedding",
                "diffusers.models.embeddings.Timesteps.forward",
                # every model's own copy of the sinusoid (Qwen's, Z-Image's, the Bria and SkyReels Timesteps...)
                f"{MODELS}:*timestep_embedding*", f"{MODELS}:*.*timestep_embedding*", f"{MODELS}:*Timesteps.forward",
                f"{MODELS}:*Timestep*Embed*.forward", f"{MODELS}:*Timestep*Embedder*.forward"),
)


@timestep_embedding.check(
    "vs Timesteps, the UNets' settings",
    cases=[dict(embedding_dim=320, timesteps="int", batch=6),
           dict(embedding_dim=32, timesteps="fractional", batch=5),
           dict(embedding_dim=33, timesteps="int", batch=4),
           # Timesteps in other dtypes: diffusers casts them to float32 first (timesteps[:, None].float()),
           # so the embedding is float32 whatever they come in (float64 from a numpy-built schedule, int32
           # from an index, float16 from a half-precision pipeline).
           dict(embedding_dim=64, timesteps="fractional", batch=5, dtype="float64"),
           dict(embedding_dim=40, timesteps="int", batch=4, dtype="int32"),
           dict(embedding_dim=48, timesteps="fractional", batch=4, dtype="float16")],
    tol=EMBED_ANGLE,
)
def _(case, g):
    # UNet2DConditionModel's time_proj: Timesteps(block_out_channels[0], flip_sin_to_cos=True, freq_shift=0).
    # Only timesteps and the width are passed: the kata's defaults must be those settings.
    t = draw_timesteps(case["timesteps"], case["batch"], g, case.get("dtype"))
    time_proj = Timesteps(case["embedding_dim"], flip_sin_to_cos=True, downscale_freq_shift=0)
    return Scenario(inputs=dict(timesteps=t, embedding_dim=case["embedding_dim"]),
                    expected=time_proj(t.clone()), exact=sinusoid_shadow(t, case["embedding_dim"]),
                    label=timestep_label(t))


@timestep_embedding.check(
    "vs get_timestep_embedding, options",
    cases=[  # the function's own defaults; DiT's label embedder; flow-matching sigmas ×1000; odd and short
        dict(embedding_dim=64, flip_sin_to_cos=False, downscale_freq_shift=1, timesteps="int", batch=4),
        dict(embedding_dim=256, flip_sin_to_cos=True, downscale_freq_shift=1, timesteps="fractional", batch=4),
        dict(embedding_dim=256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000.0, timesteps="unit",
             batch=5),
        dict(embedding_dim=17, flip_sin_to_cos=False, downscale_freq_shift=0, max_period=1000,
             timesteps="fractional", batch=3),
        dict(embedding_dim=96, flip_sin_to_cos=True, downscale_freq_shift=1, scale=2.5, max_period=500,
             timesteps="unit", batch=4, dtype="float64"),
    ],
    tol=EMBED_ANGLE,
)
def _(case, g):
    options = {k: v for k, v in case.items() if k not in ("timesteps", "batch", "dtype")}
    t = draw_timesteps(case["timesteps"], case["batch"], g, case.get("dtype"))
    return Scenario(inputs=dict(timesteps=t, **options), expected=get_timestep_embedding(t.clone(), **options),
                    exact=sinusoid_shadow(t, **options), label=timestep_label(t))


def sinusoid_shadow(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0,
                    max_period=10000):
    """get_timestep_embedding in float64: its frequencies and angles, from the timesteps' own values."""
    half = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float64) / (half - downscale_freq_shift)
    angles = scale * (timesteps.double()[:, None] * torch.exp(exponent)[None, :])
    emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    return F.pad(emb, (0, 1)) if embedding_dim % 2 else emb


def _sinusoid(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0,
              max_period=10000, *, layout="halves", pad=True, pad_front=False, scale_outside=False,
              from_one=False):
    """The embedding with one thing changed (for the traps): the layout of sin/cos, or the padding."""
    half = embedding_dim // 2
    steps = torch.arange(1, half + 1, dtype=torch.float32) if from_one else torch.arange(half, dtype=torch.float32)
    freqs = torch.exp(-math.log(max_period) * steps / (half - downscale_freq_shift))
    angles = (1.0 if scale_outside else scale) * (timesteps[:, None].float() * freqs[None, :])
    first, second = (angles.cos(), angles.sin()) if flip_sin_to_cos else (angles.sin(), angles.cos())
    if layout == "interleaved":
        emb = torch.stack([first, second], dim=-1).reshape(len(timesteps), 2 * half)
    elif layout == "reversed":
        emb = torch.cat([angles.sin(), angles.cos()], dim=-1)
        emb = emb.flip(-1) if flip_sin_to_cos else emb
    else:
        emb = torch.cat([first, second], dim=-1)
    if scale_outside:
        emb = scale * emb
    if pad and embedding_dim % 2:
        emb = F.pad(emb, (1, 0) if pad_front else (0, 1))
    return emb


@timestep_embedding.trap("[sin | cos] kept although flip_sin_to_cos=True asks for [cos | sin]",
                         hint="flip_sin_to_cos=True (the UNets' setting) puts the cosine half first.")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, False, downscale_freq_shift, scale, max_period)


@timestep_embedding.trap("sin and cos interleaved (sin ω_0, cos ω_0, sin ω_1, …) as in the Transformer paper",
                         hint="diffusers concatenates two halves: all the sines, then all the cosines "
                              "(or the cosines first when flipped).")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period,
                     layout="interleaved")


@timestep_embedding.trap("the whole vector reversed for flip_sin_to_cos",
                         hint="Flipping swaps the two halves, [sin | cos] -> [cos | sin]; each half keeps "
                              "its frequencies from fast to slow.")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period,
                     layout="reversed")


@timestep_embedding.trap("the timesteps not cast to float32 (the output follows their dtype)",
                         hint="diffusers computes the angles as timesteps[:, None].float() * freqs: the embedding "
                              "is float32 whatever dtype the timesteps come in (float64, float16, integers).")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    half = embedding_dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32)
                      / (half - downscale_freq_shift))
    angles = scale * (timesteps[:, None] * freqs[None, :])  # float64 timesteps promote the product to float64
    first, second = (angles.cos(), angles.sin()) if flip_sin_to_cos else (angles.sin(), angles.cos())
    emb = torch.cat([first, second], dim=-1)
    return F.pad(emb, (0, 1)) if embedding_dim % 2 else emb


@timestep_embedding.trap("frequencies divided by half − 1 (get_timestep_embedding's default shift of 1)",
                         hint="The exponent is divided by half − downscale_freq_shift, and the UNets use a "
                              "shift of 0: ω_i = max_period^(−i/half).")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, 1, scale, max_period)


@timestep_embedding.trap("downscale_freq_shift ignored (frequencies always divided by half)",
                         hint="ω_i = max_period^(−i/(half − downscale_freq_shift)): with a shift of 1 the "
                              "slowest frequency is exactly 1/max_period.")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, 0, scale, max_period)


@timestep_embedding.trap("an odd embedding_dim not zero-padded",
                         hint="2·(D // 2) = D − 1 columns for an odd D: append one column of zeros at the end.")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period, pad=False)


@timestep_embedding.trap("an odd embedding_dim's zero column put first",
                         hint="The zero column is appended at the END: F.pad(emb, (0, 1)).")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period,
                     pad_front=True)


@timestep_embedding.trap("scale applied to the sines and cosines, not to the angles",
                         hint="scale multiplies the angles (scale·t·ω) before sin and cos: a larger scale spins "
                              "faster, it does not make the embedding louder.")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period,
                     scale_outside=True)


@timestep_embedding.trap("frequencies counted from i = 1 (the fastest, ω_0 = 1, left out)",
                         hint="i runs 0 … half − 1: the first frequency is max_period^0 = 1.")
def _(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0.0, scale=1.0, max_period=10000):
    return _sinusoid(timesteps, embedding_dim, flip_sin_to_cos, downscale_freq_shift, scale, max_period,
                     from_one=True)


# ---- patchify ---------------------------------------------------------------------------------------
def identity_patch_embed(channels: int, patch_size: int, height: int, width: int, dtype) -> PatchEmbed:
    """A PatchEmbed whose conv maps each patch to itself: embed_dim = C·p·p, weight = I, bias = 0."""
    dim = channels * patch_size * patch_size
    embed = PatchEmbed(height=height, width=width, patch_size=patch_size, in_channels=channels,
                       embed_dim=dim, pos_embed_type=None)
    with torch.no_grad():
        # Conv weight (D, C, p, p): output feature d reads input (c, i, j) = the d-th in (C, p, p) order.
        embed.proj.weight.copy_(torch.eye(dim).reshape(dim, channels, patch_size, patch_size))
        embed.proj.bias.zero_()
    return embed.to(dtype).eval()


patchify = Kata(
    "patchify",
    hints=(
        "A token is one p×p patch with all its channels. Split H and W into (grid, offset), bring the grid "
        "axes forward, and flatten each patch in the order PatchEmbed's conv weight (D, C, p, p) reads it.",
        "(B, C, H, W) -> (B, C, H/p, p, W/p, p) -> (B, H/p, W/p, C, p, p) -> (B, (H/p)·(W/p), C·p·p); "
        "token n = row·(W/p) + col.",
        "latents.reshape(B, C, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C * p * p)",
    ),
    answer_key=("diffusers.models.embeddings.PatchEmbed.forward",
                f"{MODELS}:*PatchEmbed*.forward", f"{MODELS}:*Patch*Embed*.forward",  # every model's patch embedding
                f"{PIPELINES}:*._pack_latents", f"{MODELS}:*.*patchify*", f"{MODELS}:*patchify*"),  # and packing
)


@patchify.check(
    "vs PatchEmbed with an identity proj",
    cases=[dict(shape=(2, 4, 8, 8), patch_size=2, dtype="float32"),
           dict(shape=(3, 4, 16, 8), patch_size=4, dtype="float32"),
           dict(shape=(1, 16, 6, 10), patch_size=2, dtype="float32"),
           dict(shape=(2, 4, 8, 12), patch_size=2, dtype="float16")],
    tol=EXACT,
)
def _(case, g):
    B, C, H, W = case["shape"]
    dtype = DTYPES[case["dtype"]]
    latents = torch.randn(case["shape"], generator=g).to(dtype)
    embed = identity_patch_embed(C, case["patch_size"], H, W, dtype)
    with torch.no_grad():
        expected = embed(latents.clone())
        exact = copy.deepcopy(embed).double()(latents.double())  # the same module in float64
    return Scenario(inputs=dict(latents=latents, patch_size=case["patch_size"]), expected=expected, exact=exact,
                    label=f"a {H}×{W} latent, {C} channels, {case['patch_size']}×{case['patch_size']} patches")


def _patches(latents, patch_size, order):
    B, C, H, W = latents.shape
    p = patch_size
    return latents.reshape(B, C, H // p, p, W // p, p).permute(*order).reshape(B, -1, C * p * p)


@patchify.trap("channels last inside a patch, (i, j, c): the unpatchify layout",
               hint="PatchEmbed's conv weight is (D, C, p, p): a patch's features run channel by channel, "
                    "(c, i, j). Only the output side (unpatchify) reads them channels last.")
def _(latents, patch_size):
    return _patches(latents, patch_size, (0, 2, 4, 3, 5, 1))


@patchify.trap("the patch grid transposed (width outer, height inner)",
               hint="Tokens run row-major like conv_output.flatten(2): token n = row·(W/p) + col.")
def _(latents, patch_size):
    return _patches(latents, patch_size, (0, 4, 2, 1, 3, 5))


@patchify.trap("rows and columns swapped inside a patch, (c, j, i)",
               hint="Inside a patch the row offset i comes before the column offset j, as in the conv "
                    "kernel (kh, kw).")
def _(latents, patch_size):
    return _patches(latents, patch_size, (0, 2, 4, 1, 5, 3))


@patchify.trap("a plain reshape to (B, N, C·p·p): the p×p pixels of a patch are never gathered",
               hint="Split H into (H/p, p) and W into (W/p, p) and permute before flattening: neighbouring "
                    "pixels of a patch are not contiguous in memory.")
def _(latents, patch_size):
    B, C, H, W = latents.shape
    return latents.reshape(B, (H // patch_size) * (W // patch_size), C * patch_size * patch_size)


@patchify.trap("H and W split as (p, H/p): each token gathers pixels H/p apart, not a p×p block",
               hint="A patch is p neighbouring rows and columns: split H into (H/p, p), the grid index first and the "
                    "offset inside the patch last (reshape(B, C, H/p, p, W/p, p)), then permute.")
def _(latents, patch_size):
    B, C, H, W = latents.shape
    p = patch_size
    x = latents.reshape(B, C, p, H // p, p, W // p).permute(0, 3, 5, 1, 2, 4)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


# ---- unpatchify -------------------------------------------------------------------------------------
@functools.cache
def _transformer_classes():
    # Imported on first use: any diffusers transformer model imports the whole transformers package.
    from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel
    from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

    return DiTTransformer2DModel, SD3Transformer2DModel


def unpatchify_by_dit(tokens, patch_size, height, width, channels):
    """Run a tiny DiTTransformer2DModel whose proj_out_2 output is replaced by `tokens`."""
    DiT, _ = _transformer_classes()
    model = DiT(num_attention_heads=1, attention_head_dim=8, in_channels=channels, out_channels=channels,
                num_layers=1, sample_size=height, patch_size=patch_size, num_embeds_ada_norm=10).eval()
    model.proj_out_2.register_forward_hook(lambda module, args, output: tokens.clone())
    B = tokens.shape[0]
    with torch.no_grad():
        return model(torch.randn(B, channels, height, width), timestep=torch.randint(0, 1000, (B,)),
                     class_labels=torch.randint(0, 10, (B,))).sample


def unpatchify_by_sd3(tokens, patch_size, height, width, channels):
    """Run a tiny SD3Transformer2DModel (non-square latents allowed) whose proj_out output is `tokens`."""
    _, SD3 = _transformer_classes()
    side = max(height, width)
    model = SD3(sample_size=side, patch_size=patch_size, in_channels=channels, out_channels=channels,
                num_layers=1, attention_head_dim=8, num_attention_heads=1, joint_attention_dim=8,
                caption_projection_dim=8, pooled_projection_dim=8, pos_embed_max_size=side // patch_size).eval()
    model.proj_out.register_forward_hook(lambda module, args, output: tokens.clone())
    B = tokens.shape[0]
    with torch.no_grad():
        return model(torch.randn(B, channels, height, width), encoder_hidden_states=torch.randn(B, 3, 8),
                     pooled_projections=torch.randn(B, 8), timestep=torch.rand(B) * 1000).sample


def unpatchify_scenario(case, g, reference) -> Scenario:
    B, C, H, W = case["shape"]
    p = case["patch_size"]
    tokens = torch.randn(B, (H // p) * (W // p), p * p * C, generator=g).to(DTYPES[case["dtype"]])
    expected = reference(tokens.clone(), p, H, W, C)
    exact = reference(tokens.double(), p, H, W, C)  # the model's own reshape, fed float64 tokens
    return Scenario(inputs=dict(tokens=tokens, patch_size=p, height=H, width=W, channels=C), expected=expected,
                    exact=exact,
                    label=f"{H // p}×{W // p} tokens of {p}×{p}×{C} -> a {H}×{W} latent")


unpatchify = Kata(
    "unpatchify",
    hints=(
        "Undo the token layout the model's last Linear writes: one token per grid cell, row-major, its "
        "p·p·C features channels last. Reshape to expose those axes, reorder, merge.",
        "(B, h·w, p·p·C) -> (B, h, w, p, q, C) -> (B, C, h, p, w, q) -> (B, C, h·p, w·q), with h = H/p, w = W/p.",
        "x = tokens.reshape(B, h, w, p, p, C); x = torch.einsum('nhwpqc->nchpwq', x); "
        "return x.reshape(B, C, h * p, w * p)",
    ),
    answer_key=("diffusers.models.transformers.dit_transformer_2d.DiTTransformer2DModel.forward",
                "diffusers.models.transformers.transformer_sd3.SD3Transformer2DModel.forward",
                "diffusers.models.transformers.transformer_2d.Transformer2DModel._get_output_for_patched_inputs",
                # every transformer's own output path (each folds its tokens back into a latent)
                f"{MODELS}:*Transformer*.forward", f"{MODELS}:*Transformer*._get_output_for_patched_inputs",
                f"{MODELS}:*unpatchify*", f"{MODELS}:*.*unpatchify*", f"{PIPELINES}:*._unpack_latents"),
)


@unpatchify.check(
    "vs DiTTransformer2DModel output path",
    cases=[dict(shape=(2, 4, 8, 8), patch_size=2, dtype="float32"),
           dict(shape=(1, 4, 16, 16), patch_size=4, dtype="float32"),
           dict(shape=(3, 8, 6, 6), patch_size=2, dtype="float16")],
    tol=EXACT,
)
def _(case, g):
    return unpatchify_scenario(case, g, unpatchify_by_dit)


@unpatchify.check(
    "vs SD3Transformer2DModel, non-square",
    cases=[dict(shape=(2, 16, 8, 12), patch_size=2, dtype="float32"),
           dict(shape=(1, 4, 16, 8), patch_size=4, dtype="float32"),
           dict(shape=(2, 4, 6, 10), patch_size=2, dtype="float16")],
    tol=EXACT,
)
def _(case, g):
    return unpatchify_scenario(case, g, unpatchify_by_sd3)


def _fold(tokens, patch_size, height, width, channels, token_axes, order):
    p = patch_size
    h, w = height // p, width // p
    B = tokens.shape[0]
    sizes = dict(h=h, w=w, p=p, q=p, c=channels)
    x = tokens.reshape(B, *(sizes[a] for a in token_axes))  # the axes as the wrong layout names them
    x = x.permute(0, *(1 + token_axes.index(a) for a in order))
    return x.reshape(B, channels, height, width)


@unpatchify.trap("channels first inside a token, (c, i, j): patchify's layout, undone",
                 hint="The output Linear writes a token's features channels last, (i, j, c): diffusers "
                      "reshapes to (B, h, w, p, p, C). Unpatchify is not the inverse of PatchEmbed's order.")
def _(tokens, patch_size, height, width, channels):
    return _fold(tokens, patch_size, height, width, channels, "hwcpq", "chpwq")


@unpatchify.trap("the patch grid transposed (tokens read width outer, height inner)",
                 hint="Tokens are row-major: reshape the token axis to (H/p, W/p), height first.")
def _(tokens, patch_size, height, width, channels):
    return _fold(tokens, patch_size, height, width, channels, "whpqc", "chpwq")


@unpatchify.trap("rows and columns swapped inside a patch ('nhwpqc->nchqwp')",
                 hint="Inside a token the row offset p comes before the column offset q, and p goes with "
                      "the grid row h: 'nhwpqc->nchpwq'.")
def _(tokens, patch_size, height, width, channels):
    return _fold(tokens, patch_size, height, width, channels, "hwpqc", "chqwp")


# ---- ada_layer_norm_zero ----------------------------------------------------------------------------
def adaln_scenario(case, g, dtype) -> Scenario:
    B, N, D = case["batch"], case["tokens"], case["dim"]
    spread = case.get("spread", 1.0)
    num_classes = 10 if case.get("dit") else None
    norm = AdaLayerNormZero(D, num_embeddings=num_classes).eval()  # eval: no random label dropout
    with torch.no_grad():
        # diffusers leaves nn.Linear's default init (the paper's zeros come with trained weights):
        # draw the regression so that shift, scale and gate are all clearly non-zero.
        norm.linear.weight.copy_(torch.randn(6 * D, D, generator=g) * 0.5 / D**0.5)
        norm.linear.bias.copy_(torch.randn(6 * D, generator=g) * 0.25)
    norm = norm.to(dtype)
    # Per-token offsets make the mean matter (an RMSNorm would differ); a tiny spread makes eps matter.
    x = ((torch.randn(B, N, D, generator=g) + torch.randn(B, N, 1, generator=g)) * spread).to(dtype)
    with torch.no_grad():
        if num_classes:  # DiT: emb = TimestepEmbedding(Timesteps(t)) + LabelEmbedding(class), inside the norm
            t = torch.cat([torch.tensor([0, 999]), torch.randint(0, 1000, (B - 2,), generator=g)])
            labels = torch.randint(0, num_classes, (B,), generator=g)
            emb = norm.emb(t, labels, hidden_dtype=dtype)
            expected = norm(x.clone(), timestep=t, class_labels=labels, hidden_dtype=dtype)
            label = f"DiT-style: emb from timesteps {t.tolist()} and class labels {labels.tolist()}"
        else:
            emb = torch.randn(B, D, generator=g).to(dtype)
            expected = norm(x.clone(), emb=emb.clone())
            label = "tokens with a tiny spread (the LayerNorm's eps matters)" if spread < 0.1 else ""
    inputs = dict(x=x, emb=emb, linear_weight=norm.linear.weight.detach().clone(),
                  linear_bias=norm.linear.bias.detach().clone())
    return Scenario(inputs=inputs, expected=tuple(expected), exact=adaln_shadow(**inputs), label=label)


def adaln_shadow(x, emb, linear_weight, linear_bias):
    """AdaLayerNormZero.forward's math in float64 on the same inputs (emb as given: DiT's already embedded)."""
    params = F.linear(F.silu(emb.double()), linear_weight.double(), linear_bias.double())
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = params.chunk(6, dim=1)
    out = F.layer_norm(x.double(), (x.shape[-1],), eps=1e-6) * (1 + scale_msa[:, None]) + shift_msa[:, None]
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp


ada_layer_norm_zero = Kata(
    "ada_layer_norm_zero",
    hints=(
        "The conditioning vector goes through SiLU and one Linear to six (B, D) vectors; the first two "
        "modulate a plain LayerNorm of the tokens, the other four are returned for the block to use.",
        "shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = Linear(SiLU(emb)).chunk(6); "
        "out = LN(x)·(1 + scale_msa) + shift_msa with LN over D, no affine, eps = 1e-6.",
        "p = F.linear(F.silu(emb), linear_weight, linear_bias); s, c, gm, s2, c2, g2 = p.chunk(6, dim=1); "
        "h = F.layer_norm(x, (x.shape[-1],), eps=1e-6); return modulate(h, s, c), gm, s2, c2, g2",
    ),
    answer_key=("diffusers.models.normalization.AdaLayerNormZero.forward",
                f"{MODELS}:*AdaLayerNorm*.forward", f"{MODELS}:*AdaLN*.forward"),  # every model's adaLN
)


@ada_layer_norm_zero.check(
    "vs AdaLayerNormZero",
    cases=[dict(batch=2, tokens=16, dim=32),
           dict(batch=3, tokens=5, dim=48, spread=3.0),
           dict(batch=2, tokens=8, dim=32, spread=1e-3),
           dict(batch=3, tokens=4, dim=32, dit=True)],
    tol=NORM_MATH,
)
def _(case, g):
    return adaln_scenario(case, g, torch.float32)


@ada_layer_norm_zero.check(
    "vs AdaLayerNormZero, float16",
    cases=[dict(batch=2, tokens=8, dim=64), dict(batch=3, tokens=4, dim=32)],
    tol=NORM_HALF,
)
def _(case, g):
    return adaln_scenario(case, g, torch.float16)


def _adaln(x, emb, linear_weight, linear_bias, *, order="shift-scale", one_plus=True, before=False,
           silu=True, eps=1e-6, rms=False, over_tokens=False):
    """adaLN-Zero with one thing changed (for the traps)."""
    params = F.linear(F.silu(emb) if silu else emb, linear_weight, linear_bias)
    a, b, gate_msa, c, d, gate_mlp = params.chunk(6, dim=1)
    shift_msa, scale_msa, shift_mlp, scale_mlp = (a, b, c, d) if order == "shift-scale" else (b, a, d, c)
    factor = (1 + scale_msa[:, None]) if one_plus else scale_msa[:, None]

    def norm(t):
        if over_tokens:  # normalised over the N tokens of each feature instead of the D features of each token
            return F.layer_norm(t.transpose(1, 2), (t.shape[1],), eps=eps).transpose(1, 2)
        if rms:
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)
        return F.layer_norm(t, (t.shape[-1],), eps=eps)

    out = norm(x * factor + shift_msa[:, None]) if before else norm(x) * factor + shift_msa[:, None]
    return out, gate_msa, shift_mlp, scale_mlp, gate_mlp


@ada_layer_norm_zero.trap("the scale used without the 1 +: LN(x)·scale + shift",
                          hint="diffusers modulates with (1 + scale): a zero-initialised regressor then "
                               "leaves the normalised tokens as they are.")
def _(x, emb, linear_weight, linear_bias):
    return _adaln(x, emb, linear_weight, linear_bias, one_plus=False)


@ada_layer_norm_zero.trap("shift and scale swapped: the chunks taken as (scale, shift, gate)",
                          hint="The six chunks are shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, "
                               "gate_mlp, in that order.")
def _(x, emb, linear_weight, linear_bias):
    return _adaln(x, emb, linear_weight, linear_bias, order="scale-shift")


@ada_layer_norm_zero.trap("modulated before the LayerNorm: LN(x·(1 + scale) + shift)",
                          hint="Normalise first, then modulate: the LayerNorm would undo any per-sample "
                               "shift and most of the scale.")
def _(x, emb, linear_weight, linear_bias):
    return _adaln(x, emb, linear_weight, linear_bias, before=True)


@ada_layer_norm_zero.trap("the SiLU skipped: Linear(emb) instead of Linear(SiLU(emb))",
                          hint="AdaLayerNormZero applies SiLU to the conditioning vector before its Linear.")
def _(x, emb, linear_weight, linear_bias):
    return _adaln(x, emb, linear_weight, linear_bias, silu=False)


@ada_layer_norm_zero.trap("LayerNorm eps 1e-5 (nn.LayerNorm's default) instead of 1e-6",
                          hint="AdaLayerNormZero builds nn.LayerNorm(D, elementwise_affine=False, eps=1e-6): "
                               "pass eps=1e-6.")
def _(x, emb, linear_weight, linear_bias):
    return _adaln(x, emb, linear_weight, linear_bias, eps=1e-5)


@ada_layer_norm_zero.trap("LayerNorm over the tokens (axis N) instead of each token's features (D)",
                          hint="Each token is normalised on its own, over its D features: layer_norm(x, (D,)).")
def _(x, emb, linear_weight, linear_bias):
    return _adaln(x, emb, linear_weight, linear_bias, over_tokens=True)


@ada_layer_norm_zero.trap("an RMSNorm (no mean subtracted) instead of a LayerNorm",
                          hint="LayerNorm subtracts each token's mean before dividing by its standard "
                               "deviation; RMSNorm (used for q/k in newer models) does not.")
def _(x, emb, linear_weight, linear_bias):
    return _adaln(x, emb, linear_weight, linear_bias, rms=True)
