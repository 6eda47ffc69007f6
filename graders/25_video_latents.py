"""Grader for lab 25 · Video latents: frame counts, latent shapes, the causal encoder's chunks, the 3-axis rotary
embedding, the transformer's output layout, and a decode that never holds the float video.

References are diffusers' own Wan components on tiny random models (`wan_vae`, `wan_transformer`):
- WanPipeline on a one-step run (output_type="latent"): the num_frames its __call__ hands prepare_latents and
  the shape prepare_latents draws (recorded by wrapping the pipeline's method);
- AutoencoderKLWan.encode on real clips: the latent shape, and the frames each call of its encoder received
  (a forward pre-hook on vae.encoder; the clip's frame f is filled with the value f, so a chunk names itself);
- WanRotaryPosEmbed called on latents of the case's shape;
- WanTransformer3DModel.forward with its proj_out output replaced by the scenario's tokens (a forward hook),
  so the model's own reshape and permute produce the expected latent video (lab 08's technique);
- AutoencoderKLWan.decode then VideoProcessor.postprocess_video(output_type="pil"): the pixels as arrays.

The budget measures peak live tensor bytes (engine/meters.py) of the learner's decode against the same decode
done the way a pipeline does it, the whole float video first (measured live on the same latents).

Precision: the rotary tables carry a float64 shadow (the same formula in float64); the pixels are uint8,
compared level by level (`one_level`).
"""
import functools

import numpy as np
import torch

from diffusion_katas.core.spec import Kata, KataFailure, Measurement, Scenario
from diffusion_katas.core.tolerances import EXACT, PIXEL_LEVEL, ROTARY_TABLE
from diffusion_katas.engine.helpers import quiet_diffusers, seed_from
from diffusion_katas.engine.meters import peak_bytes

WAN = "diffusers.models.autoencoders.autoencoder_kl_wan.AutoencoderKLWan"
ROPE = "diffusers.models.transformers.transformer_wan.WanRotaryPosEmbed"
PIPELINE = "diffusers.pipelines.wan.pipeline_wan.WanPipeline"
TEXT_DIM = 16


# (temporal, spatial) -> the architecture that compresses so: dim_mult's length sets the spatial downsamples,
# temperal_downsample (sic) which of them also halve time. The config's scale factors must agree with it.
ARCHITECTURES = {(4, 8): ([1, 1, 1, 1], [False, True, True]), (2, 8): ([1, 1, 1, 1], [False, False, True]),
                 (4, 4): ([1, 1, 1], [True, True])}


def wan_vae(temporal: int = 4, spatial: int = 8, z_dim: int = 4):
    """A tiny AutoencoderKLWan (Wan 2.1's is temporal 4, spatial 8, 16 channels)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan

    dim_mult, downsample = ARCHITECTURES[(temporal, spatial)]
    return AutoencoderKLWan(base_dim=3, z_dim=z_dim, dim_mult=dim_mult, num_res_blocks=1, temperal_downsample=downsample,
                            scale_factor_temporal=temporal, scale_factor_spatial=spatial).eval().requires_grad_(False)


def wan_transformer(attention_head_dim: int = 12, patch_size=(1, 2, 2), channels: int = 4):
    from diffusers.models.transformers.transformer_wan import WanTransformer3DModel

    return WanTransformer3DModel(patch_size=tuple(patch_size), num_attention_heads=2,
                                 attention_head_dim=attention_head_dim, in_channels=channels, out_channels=channels,
                                 text_dim=TEXT_DIM, freq_dim=16, ffn_dim=16, num_layers=1, cross_attn_norm=True,
                                 qk_norm="rms_norm_across_heads", rope_max_seq_len=64).eval().requires_grad_(False)


def pipeline_run(num_frames: int, height: int, width: int, batch: int, g: torch.Generator, temporal: int = 4,
                 spatial: int = 8, channels: int = 4) -> dict:
    """One step of a tiny WanPipeline: the num_frames its __call__ gave prepare_latents, and what that drew."""
    from diffusers.pipelines.wan.pipeline_wan import WanPipeline
    from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler

    with quiet_diffusers():
        pipe = WanPipeline(tokenizer=None, text_encoder=None, transformer=wan_transformer(channels=channels),
                           vae=wan_vae(temporal, spatial, channels),
                           scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))
    pipe.set_progress_bar_config(disable=True)
    seen = {}
    original = pipe.prepare_latents

    def prepare_latents(*args, **kwargs):
        latents = original(*args, **kwargs)
        seen.update(num_frames=args[4] if len(args) > 4 else kwargs["num_frames"], shape=tuple(latents.shape))
        return latents

    pipe.prepare_latents = prepare_latents
    prompt = torch.randn((batch, 5, TEXT_DIM), generator=g)
    import logging

    quiet = logging.getLogger("diffusers.pipelines.wan.pipeline_wan")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # "num_frames - 1 has to be divisible by 4. Rounding to the nearest number."
    try:
        with torch.no_grad(), quiet_diffusers():
            pipe(prompt_embeds=prompt, negative_prompt_embeds=prompt, height=height, width=width,
                 num_frames=num_frames, num_inference_steps=1, guidance_scale=1.0, output_type="latent",
                 generator=torch.Generator().manual_seed(seed_from(g)))
    finally:
        quiet.setLevel(level)
    return seen


# ---- video_num_frames -----------------------------------------------------------------------------------
video_num_frames = Kata(
    "video_num_frames",
    hints=(
        "A causal video VAE wants one image frame plus whole groups of t: counts of the form t·k + 1. The "
        "pipeline keeps those and moves any other count to the t·k + 1 just above the multiple of t below it.",
        "F % t == 1: F;  else F // t · t + 1;  at least 1.",
        "return max(num_frames if num_frames % temporal == 1 else num_frames // temporal * temporal + 1, 1)",
    ),
    answer_key=(f"{PIPELINE}.__call__", "diffusers.pipelines.**:*Pipeline*.__call__"),
)

# every remainder mod 4, and 7 and 15: "the nearest 4k + 1" ties there (5 or 9; 13 or 17), the pipeline takes F // 4·4 + 1;
# and a VAE that halves time only once (t = 2): counts of the form 2k + 1
FRAME_CASES = [dict(num_frames=n) for n in (9, 10, 12, 16, 17, 1, 3, 4, 7, 15, 33)] + [
    dict(num_frames=n, temporal=2) for n in (10, 7, 8)]


@video_num_frames.check("vs WanPipeline.__call__'s rounding (a one-step run)", cases=FRAME_CASES, tol=EXACT)
def _(case, g):
    t = case.get("temporal", 4)
    seen = pipeline_run(case["num_frames"], 32, 32, 1, g, temporal=t)
    return Scenario(inputs=dict(num_frames=case["num_frames"], temporal=t), expected=seen["num_frames"],
                    label=f"asked for {case['num_frames']} frames, temporal factor {t}")


@video_num_frames.trap("rounded up to the next t·k + 1",
                       hint="The pipeline takes F // t · t + 1: 10 → 9 (not 13), 12 → 13, 16 → 17.")
def _(num_frames, temporal=4):
    return num_frames if num_frames % temporal == 1 else -(-(num_frames - 1) // temporal) * temporal + 1


@video_num_frames.trap("rounded to the nearest t·k + 1 (the pipeline rounds down)",
                       hint="WanPipeline's warning says 'nearest', but its code takes F // t · t + 1: 7 → 5 and "
                            "15 → 13, not 9 and 17.")
def _(num_frames, temporal=4):
    return max(round((num_frames - 1) / temporal) * temporal + 1, 1)


@video_num_frames.trap("rounded down to the t·k + 1 at or below F ((F − 1) // t · t + 1)",
                       hint="The pipeline takes F // t · t + 1, the t·k + 1 just above the multiple of t at or below "
                            "F: 12 → 13 (not 9), 10 → 9.")
def _(num_frames, temporal=4):
    return max((num_frames - 1) // temporal * temporal + 1, 1)


@video_num_frames.trap("t fixed at 4 (Wan 2.1's factor; the temporal argument ignored)",
                       hint="The temporal factor is the VAE's (vae_scale_factor_temporal): 4 for Wan 2.1, other "
                            "values for other VAEs. Round with the `temporal` you are given.")
def _(num_frames, temporal=4):
    return num_frames if num_frames % 4 == 1 else max(num_frames // 4 * 4 + 1, 1)


@video_num_frames.trap("rounded to a multiple of t (the + 1 forgotten)",
                       hint="The first frame is encoded alone: counts are t·k + 1 (9, 13, 17 …), not t·k.")
def _(num_frames, temporal=4):
    return max(num_frames // temporal * temporal, 1)


# ---- latent_shape ---------------------------------------------------------------------------------------
latent_shape = Kata(
    "latent_shape",
    hints=(
        "Space shrinks by s per side; time keeps one latent frame for the first frame and one for every t after it.",
        "(B, C, (F − 1) // t + 1, H // s, W // s).",
        "return (batch_size, latent_channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)",
    ),
    answer_key=(f"{PIPELINE}.prepare_latents", "diffusers.pipelines.**:*Pipeline*.prepare_latents",
                "diffusers.pipelines.**:*Pipeline*.__call__", f"{WAN}.encode", f"{WAN}._encode"),
)

SHAPE_CASES = [
    dict(source="pipeline", batch=1, num_frames=9, height=32, width=32),
    dict(source="pipeline", batch=2, num_frames=17, height=48, width=32, channels=8),
    dict(source="pipeline", batch=1, num_frames=1, height=32, width=64),  # an image: one latent frame
    dict(source="pipeline", batch=1, num_frames=9, height=32, width=48, temporal=2),
    dict(source="encoder", batch=1, num_frames=13, height=16, width=16),
    dict(source="encoder", batch=2, num_frames=10, height=16, width=24, channels=8),  # a partial group at the end
    dict(source="encoder", batch=1, num_frames=5, height=24, width=16, spatial=4),
    dict(source="encoder", batch=1, num_frames=9, height=16, width=16, temporal=2),
    dict(source="encoder", batch=1, num_frames=12, height=16, width=16),  # F a multiple of t: F // t + 1 says 4, not 3
    # H and W not multiples of s: each downsampling floors, so the latent side is H // s (a ceiling says one more)
    dict(source="encoder", batch=1, num_frames=5, height=20, width=12),
    dict(source="encoder", batch=1, num_frames=5, height=22, width=18, spatial=4),
]


@latent_shape.check("vs WanPipeline.prepare_latents and AutoencoderKLWan.encode", cases=SHAPE_CASES, tol=EXACT)
def _(case, g):
    B, F, H, W = case["batch"], case["num_frames"], case["height"], case["width"]
    t, s, c = case.get("temporal", 4), case.get("spatial", 8), case.get("channels", 4)
    if case["source"] == "pipeline":
        shape = pipeline_run(F, H, W, B, g, temporal=t, spatial=s, channels=c)["shape"]
        label = "the latents WanPipeline.prepare_latents drew"
    else:
        video = torch.rand((B, 3, F, H, W), generator=g) * 2 - 1
        with torch.no_grad():
            shape = tuple(wan_vae(t, s, c).encode(video).latent_dist.mean.shape)
        label = f"the latents AutoencoderKLWan.encode made of {F} frames"
    return Scenario(inputs=dict(batch_size=B, num_frames=F, height=H, width=W, latent_channels=c, temporal=t,
                                spatial=s), expected=shape, label=f"{label} (t = {t}, s = {s})")


@latent_shape.trap("H / s rounded up (a partial latent pixel kept)",
                   hint="Each of the VAE's downsamplings halves the side and drops the odd pixel: the latent side is "
                        "H // s, rounded down (the pipeline asks for sides divisible by 16 for that reason).")
def _(batch_size, num_frames, height, width, latent_channels, temporal=4, spatial=8):
    return (batch_size, latent_channels, (num_frames - 1) // temporal + 1, -(-height // spatial), -(-width // spatial))


@latent_shape.trap("F // t latent frames (the first frame's own latent forgotten)",
                   hint="The first frame is a latent frame of its own: (F − 1) // t + 1 (9 frames → 3, not 2).")
def _(batch_size, num_frames, height, width, latent_channels, temporal=4, spatial=8):
    return (batch_size, latent_channels, num_frames // temporal, height // spatial, width // spatial)


@latent_shape.trap("F // t + 1 latent frames (right only where F − 1 is a multiple of t)",
                   hint="The first frame has its own latent and the rest go t at a time: (F − 1) // t + 1. For 12 "
                        "frames (t = 4): 1 + 11 // 4 = 3 (the last three frames are a partial group, dropped).")
def _(batch_size, num_frames, height, width, latent_channels, temporal=4, spatial=8):
    return (batch_size, latent_channels, num_frames // temporal + 1, height // spatial, width // spatial)


@latent_shape.trap("the temporal and spatial factors swapped",
                   hint="Frames shrink by the temporal factor t ((F − 1) // t + 1), height and width by the spatial "
                        "factor s (H // s, W // s).")
def _(batch_size, num_frames, height, width, latent_channels, temporal=4, spatial=8):
    return (batch_size, latent_channels, (num_frames - 1) // spatial + 1, height // temporal, width // temporal)


# ---- encoder_chunks -------------------------------------------------------------------------------------
encoder_chunks = Kata(
    "encoder_chunks",
    hints=(
        "The encoder is causal and streams: the first frame goes in alone (it is an image), then the clip "
        "group by group.",
        "[(0, 1)] + [(1 + 4i, 5 + 4i) for i < (F − 1) // 4].",
        "return [(0, 1)] + [(1 + 4 * i, 5 + 4 * i) for i in range((num_frames - 1) // 4)]",
    ),
    answer_key=(f"{WAN}.encode", f"{WAN}._encode", f"{WAN}.tiled_encode"),
)

# the temporal factor 2 VAE too: Wan's encoder reads four frames a chunk whatever its factor
# 8: a multiple of four (F // 4 + 1 chunks would run past the clip's end)
CHUNK_CASES = [dict(num_frames=n) for n in (9, 10, 1, 13, 7, 17, 8)] + [dict(num_frames=11, temporal=2)]


@encoder_chunks.check("vs the frames AutoencoderKLWan.encode gives its encoder", cases=CHUNK_CASES, tol=EXACT)
def _(case, g):
    F = case["num_frames"]
    vae = wan_vae(case.get("temporal", 4))
    # frame f of the clip holds the value f: each call's input names the frames it got
    clip = torch.arange(F, dtype=torch.float32).view(1, 1, F, 1, 1).expand(1, 3, F, 16, 16).contiguous()
    chunks = []
    hook = vae.encoder.register_forward_pre_hook(lambda module, args: chunks.append(
        (int(args[0][0, 0, 0, 0, 0]), int(args[0][0, 0, -1, 0, 0]) + 1)))
    try:
        with torch.no_grad():
            vae.encode(clip)
    finally:
        hook.remove()
    return Scenario(inputs=dict(num_frames=F), expected=chunks,
                    label=f"{F} frames, a VAE of temporal factor {vae.config.scale_factor_temporal}")


@encoder_chunks.trap("chunks of four from frame 0 (the first frame not alone)",
                     hint="Frame 0 is encoded alone, as an image; the groups of four start at frame 1: (0, 1), (1, 5), …")
def _(num_frames):
    return [(i, min(i + 4, num_frames)) for i in range(0, num_frames, 4)]


@encoder_chunks.trap("chunks of four from frame 0, whole groups only (the first frame not alone)",
                     hint="Frame 0 is encoded alone, as an image; the groups of four start at frame 1: (0, 1), (1, 5), "
                          "(5, 9) for 9 frames, not (0, 4), (4, 8).")
def _(num_frames):
    return [(i, i + 4) for i in range(0, num_frames - 3, 4)]


@encoder_chunks.trap("a partial group at the end encoded too",
                     hint="Only whole groups of four are encoded: 10 frames give (0, 1), (1, 5), (5, 9); frame 9 is "
                          "dropped (and the pipeline never asks for it: it keeps counts of the form 4k + 1).")
def _(num_frames):
    return [(0, 1)] + [(s, min(s + 4, num_frames)) for s in range(1, num_frames, 4)]


@encoder_chunks.trap("F // 4 + 1 chunks (one past the clip's end where F is a multiple of four)",
                     hint="After frame 0 come (F − 1) // 4 whole groups: 8 frames give (0, 1), (1, 5); frames 5 to 7 "
                          "are a partial group, not encoded, and there is no (5, 9).")
def _(num_frames):
    return [(0, 1)] + [(1 + 4 * k, 5 + 4 * k) for k in range(num_frames // 4)]


# ---- rotary_3d ------------------------------------------------------------------------------------------
rotary_3d = Kata(
    "rotary_3d",
    hints=(
        "Three 1-D rotary tables, one per axis, concatenated per token: rows and columns get 2·⌊D/6⌋ dimensions "
        "each, frames the rest; positions count patches, tokens run frame-major.",
        "d_h = d_w = 2⌊D/6⌋, d_f = D − d_h − d_w;  a_j(p) = p/θ^(2j/d);  cos/sin repeat_interleave(2);  "
        "token (f, h, w) → [table_f(f), table_h(h), table_w(w)];  shape (1, F'H'W', 1, D).",
        "freqs = 1 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d); "
        "angles = torch.outer(torch.arange(n, dtype=torch.float64), freqs); angles.cos().repeat_interleave(2, 1)",
    ),
    answer_key=(ROPE, f"{ROPE}.forward", f"{ROPE}.__init__", "diffusers.models.embeddings.get_1d_rotary_pos_embed",
                "diffusers.models.**:*Rotary*", "diffusers.models.**:*rotary*"),
)

ROPE_CASES = [
    dict(attention_head_dim=12, patch_size=(1, 2, 2), num_frames=3, height=8, width=8),
    dict(attention_head_dim=16, patch_size=(1, 2, 2), num_frames=5, height=4, width=12),  # D/6 not whole
    dict(attention_head_dim=20, patch_size=(1, 2, 2), num_frames=2, height=6, width=4),
    dict(attention_head_dim=12, patch_size=(2, 2, 2), num_frames=4, height=8, width=4),  # frames in pairs
    dict(attention_head_dim=24, patch_size=(1, 1, 1), num_frames=3, height=3, width=5, theta=500.0),
]


def exact_rotary(attention_head_dim, patch_size, num_frames, height, width, theta=10000.0):
    """The same tables in float64 (diffusers computes them in float64 too and casts)."""
    d_h = d_w = 2 * (attention_head_dim // 6)
    d_f = attention_head_dim - d_h - d_w
    n = (num_frames // patch_size[0], height // patch_size[1], width // patch_size[2])
    grids = torch.meshgrid(*(torch.arange(k, dtype=torch.float64) for k in n), indexing="ij")
    angles = []
    for dim, pos in zip((d_f, d_h, d_w), grids):
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        angles.append((pos[..., None] * freqs).repeat_interleave(2, dim=-1))
    a = torch.cat(angles, dim=-1).reshape(1, -1, 1, attention_head_dim)
    return a.cos(), a.sin()


@rotary_3d.check("vs WanRotaryPosEmbed", cases=ROPE_CASES, tol=ROTARY_TABLE)
def _(case, g):
    from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed

    args = {**dict(theta=10000.0), **case}
    rope = WanRotaryPosEmbed(args["attention_head_dim"], tuple(args["patch_size"]), max_seq_len=64,
                             theta=args["theta"])
    latents = torch.zeros((1, 4, case["num_frames"], case["height"], case["width"]))
    cos, sin = rope(latents)
    return Scenario(inputs=dict(args, patch_size=tuple(args["patch_size"])), expected=(cos.clone(), sin.clone()),
                    exact=exact_rotary(**args), label=f"D = {case['attention_head_dim']}, split "
                    f"{args['attention_head_dim'] - 4 * (args['attention_head_dim'] // 6)}/"
                    f"{2 * (args['attention_head_dim'] // 6)}/{2 * (args['attention_head_dim'] // 6)}")


def _rotary(attention_head_dim, patch_size, num_frames, height, width, theta=10000.0, *, split=None,
            interleave=True, order=(0, 1, 2), per_voxel=False, corner=False, head_wide=False):
    D = attention_head_dim
    dims = split(D) if split else (D - 4 * (D // 6), 2 * (D // 6), 2 * (D // 6))
    n = (num_frames, height, width) if per_voxel else (num_frames // patch_size[0], height // patch_size[1],
                                                       width // patch_size[2])
    grids = torch.meshgrid(*(torch.arange(k, dtype=torch.float64) * (p if corner else 1)
                             for k, p in zip(n, patch_size)), indexing="ij")
    angles = []
    for axis in order:
        dim, pos = dims[axis], grids[axis]
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / (D if head_wide else dim))
        a = pos[..., None] * freqs
        angles.append(a.repeat_interleave(2, dim=-1) if interleave else torch.cat([a, a], dim=-1))
    a = torch.cat(angles, dim=-1).reshape(1, -1, 1, D)
    return a.cos().float(), a.sin().float()


def _rotary_trap(name: str, hint: str, **bug):
    @rotary_3d.trap(name, hint=hint)
    def _(attention_head_dim, patch_size, num_frames, height, width, theta=10000.0):
        return _rotary(attention_head_dim, patch_size, num_frames, height, width, theta, **bug)


_rotary_trap("the remainder of D given to the columns, not the frames",
             "Rows and columns get 2·⌊D/6⌋ each and the frames the rest: D = 16 splits frames 8, rows 4, columns 4.",
             split=lambda D: (2 * (D // 6), 2 * (D // 6), D - 4 * (D // 6)))
_rotary_trap("cos and sin in the half-split layout (c₀ … c_{d/2−1}, c₀ … c_{d/2−1}), not interleaved",
             "Wan's tables repeat each value twice in place: (c₀, c₀, c₁, c₁, …) (repeat_interleave(2)); the "
             "half-split layout belongs to rotate-half rotary code.", interleave=False)
_rotary_trap("the axes in another order (rows, columns, frames)",
             "Concatenate per token in the order frames, rows, columns: the frame table first.", order=(1, 2, 0))
_rotary_trap("positions per latent voxel, not per patch",
             "A token is a patch: with (1, 2, 2) patches there are H/2 row positions, not H. Divide each axis by its "
             "patch size first.", per_voxel=True)
_rotary_trap("each axis's frequencies over the whole head (θ^(2j/D)), not its own width",
             "Each axis is a rotary table of its own: angle_j = p / θ^(2j/d) with d that axis's share of D (d_f, d_h "
             "or d_w), not D itself.", head_wide=True)
_rotary_trap("positions counted in latent voxels (the patch's corner), not in patches",
             "A patch's position is its index on the patch grid (0, 1, 2, …), not its first voxel's (0, 2, 4, …).",
             corner=True)


# ---- unpatchify_video -----------------------------------------------------------------------------------
unpatchify_video = Kata(
    "unpatchify_video",
    hints=(
        "Tokens run frame-major over the patch grid, and each token's vector is its patch laid out as (p_t, p_h, "
        "p_w, C): split both, then put every patch axis next to its grid axis.",
        "x = tokens.reshape(B, F', H', W', p_t, p_h, p_w, C);  permute to (B, C, F', p_t, H', p_h, W', p_w);  "
        "merge pairs.",
        "x = tokens.reshape(B, F_, H_, W_, p_t, p_h, p_w, -1).permute(0, 7, 1, 4, 2, 5, 3, 6); "
        "return x.reshape(B, -1, F_ * p_t, H_ * p_h, W_ * p_w)",
    ),
    answer_key=("diffusers.models.transformers.transformer_wan.WanTransformer3DModel.forward",
                "diffusers.models.**:*Transformer*3D*.forward"),
)

UNPATCH_CASES = [
    dict(batch=1, num_frames=3, height=8, width=8, patch_size=(1, 2, 2)),
    dict(batch=2, num_frames=2, height=4, width=12, patch_size=(1, 2, 2)),  # wider than high
    dict(batch=1, num_frames=4, height=8, width=4, patch_size=(2, 2, 2)),  # patches across frames
    dict(batch=2, num_frames=3, height=6, width=4, patch_size=(1, 1, 2)),
]


@unpatchify_video.check("vs WanTransformer3DModel's output layout (its last layer's output replaced)",
                        cases=UNPATCH_CASES, tol=EXACT)
def _(case, g):
    p = tuple(case["patch_size"])
    model = wan_transformer(patch_size=p)
    B, F, H, W = case["batch"], case["num_frames"], case["height"], case["width"]
    n = (F // p[0]) * (H // p[1]) * (W // p[2])
    tokens = torch.randn((B, n, p[0] * p[1] * p[2] * 4), generator=g)
    hook = model.proj_out.register_forward_hook(lambda module, args, output: tokens.clone())
    try:
        with torch.no_grad():
            expected = model(hidden_states=torch.zeros((B, 4, F, H, W)), timestep=torch.zeros(B),
                             encoder_hidden_states=torch.zeros((B, 5, TEXT_DIM))).sample
    finally:
        hook.remove()
    return Scenario(inputs=dict(tokens=tokens, num_frames=F, height=H, width=W, patch_size=p), expected=expected,
                    label=f"{F}×{H}×{W} latents, patches {p}")


def _unpatch(tokens, num_frames, height, width, patch_size, *, channels_first=False, order="fhw",
             patch_outer=False):
    B = tokens.shape[0]
    p_t, p_h, p_w = patch_size
    F_, H_, W_ = num_frames // p_t, height // p_h, width // p_w
    if order == "fhw":
        grid = tokens.reshape(B, F_, H_, W_, -1)
    else:  # tokens read as column-major in space (w before h)
        grid = tokens.reshape(B, F_, W_, H_, -1).permute(0, 1, 3, 2, 4)
    x = grid.reshape(B, F_, H_, W_, -1, p_t, p_h, p_w) if channels_first else grid.reshape(B, F_, H_, W_, p_t, p_h,
                                                                                            p_w, -1)
    x = x.permute(0, 4, 1, 5, 2, 6, 3, 7) if channels_first else x.permute(0, 7, 1, 4, 2, 5, 3, 6)
    if patch_outer:  # each pair merged patch-major: index p·F' + f instead of f·p_t + p
        x = x.permute(0, 1, 3, 2, 5, 4, 7, 6)
    return x.reshape(B, x.shape[1], F_ * p_t, H_ * p_h, W_ * p_w)


@unpatchify_video.trap("each token's vector read channels first (C, p_t, p_h, p_w)",
                       hint="Wan lays a token's vector out as (p_t, p_h, p_w, C): the channels last.")
def _(tokens, num_frames, height, width, patch_size):
    return _unpatch(tokens, num_frames, height, width, patch_size, channels_first=True)


@unpatchify_video.trap("tokens read with columns before rows",
                       hint="Tokens run frame-major, then row, then column: n = (f·H' + h)·W' + w.")
def _(tokens, num_frames, height, width, patch_size):
    return _unpatch(tokens, num_frames, height, width, patch_size, order="fwh")


@unpatchify_video.trap("each patch axis merged before its grid axis (frame p·F' + f, not f·p_t + p)",
                       hint="A patch's voxels sit next to each other: frame f·p_t + p of patch row f, so permute to "
                            "(B, C, F', p_t, H', p_h, W', p_w), each grid axis just before its patch axis, then merge.")
def _(tokens, num_frames, height, width, patch_size):
    return _unpatch(tokens, num_frames, height, width, patch_size, patch_outer=True)


# ---- decode_to_uint8 ------------------------------------------------------------------------------------
decode_to_uint8 = Kata(
    "decode_to_uint8",
    hints=(
        "The causal decoder already works one latent frame at a time: turn each decoded chunk into uint8 pixels "
        "and write it into one uint8 video made once, instead of building the float video first.",
        "video = empty((B, 1 + t·(F' − 1), H, W, 3), uint8);  per latent frame: chunk = vae.decoder(...);  "
        "pixels = round((clamp(chunk, −1, 1)/2 + ½)·255) as (B, f, H, W, 3);  write at the next frames.",
        "pixels = ((chunk.clamp(-1, 1) / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1); "
        "video[:, at:at + pixels.shape[1]] = pixels",
    ),
    answer_key=(f"{WAN}.decode", f"{WAN}._decode", f"{WAN}.tiled_decode", f"{WAN}.forward",
                "diffusers.video_processor:*.postprocess_video", "diffusers.image_processor:*Processor*.postprocess",
                "diffusers.image_processor:*Processor*.numpy_to_pil", "diffusers.utils.export_utils:*"),
)

DECODE_CASES = [
    dict(batch=1, latent_frames=3, height=2, width=2),
    dict(batch=1, latent_frames=3, height=2, width=2, temporal=2),  # two frames per latent frame after the first
    dict(batch=2, latent_frames=2, height=2, width=3),
    dict(batch=1, latent_frames=1, height=3, width=2),  # one latent frame: one image frame
    # a decoder that overshoots [−1, 1], as real VAEs do on saturated colours: the clamp matters
    dict(batch=1, latent_frames=4, height=2, width=2, overshoot=4.0),
]


def pixels_of(vae, latents) -> torch.Tensor:
    """AutoencoderKLWan.decode, then VideoProcessor.postprocess_video(output_type="pil"): its frames as arrays."""
    from diffusers.video_processor import VideoProcessor

    with torch.no_grad():
        video = vae.decode(latents).sample
    frames = VideoProcessor(vae_scale_factor=8).postprocess_video(video, output_type="pil")
    return torch.from_numpy(np.stack([np.stack([np.asarray(f) for f in clip]) for clip in frames]))


def one_level(expected: torch.Tensor):
    """uint8 pixels: another float order may round a pixel at a tie the other way (one level, rarely); more than
    0.5% of the pixels off is a different conversion (truncating moves about half of them)."""

    def verify(output):
        if not isinstance(output, torch.Tensor) or output.shape != expected.shape or output.dtype != torch.uint8:
            return  # the value check reports structure
        diff = output.int() - expected.int()
        if bool((diff.abs() > 1).any()):
            return  # (verify runs before the value check, which reports these, with the traps they match)
        share = float((diff != 0).float().mean())
        if share > 0.005:
            darker = bool((diff <= 0).all())
            raise KataFailure(
                f"  {share:.1%} of the pixels differ from diffusers' by one level (at most 0.5% may, where another "
                "float order rounds a tie the other way)"
                + ("; every one of them darker:\n  trap: truncated to uint8 instead of rounded\n    "
                   + TRUNCATED_HINT if darker else ""))

    return verify


@decode_to_uint8.check("vs AutoencoderKLWan.decode and VideoProcessor.postprocess_video's pixels",
                       cases=DECODE_CASES, tol=PIXEL_LEVEL)
def _(case, g):
    vae = wan_vae(case.get("temporal", 4))
    if case.get("overshoot"):
        with torch.no_grad():
            vae.decoder.conv_out.weight.mul_(case["overshoot"])
            vae.decoder.conv_out.bias.mul_(case["overshoot"])
    latents = torch.randn((case["batch"], 4, case["latent_frames"], case["height"], case["width"]), generator=g)
    expected = pixels_of(vae, latents)
    return Scenario(inputs=dict(vae=vae, latents=latents), expected=expected, verify=one_level(expected),
                    label=f"{case['latent_frames']} latent frames → {expected.shape[1]} frames of "
                          f"{expected.shape[2]}×{expected.shape[3]}")


def _pixels(vae, latents, *, clamp=True, rounding=True, layout="BFHWC", post_quant_conv=True):
    with torch.no_grad():
        video = vae.decode(latents).sample if clamp and post_quant_conv else \
            _unclamped(vae, latents, post_quant_conv)
        video = video.clamp(-1, 1) if clamp else video
    x = (video / 2 + 0.5) * 255
    x = (x.round() if rounding else x).to(torch.uint8) if clamp else x.round().to(torch.int64).to(torch.uint8)
    return x.permute(0, 2, 3, 4, 1) if layout == "BFHWC" else x.permute(0, 2, 1, 3, 4)


def _unclamped(vae, latents, post_quant_conv=True):
    vae.clear_cache()
    x = vae.post_quant_conv(latents) if post_quant_conv else latents
    chunks = []
    for i in range(latents.shape[2]):
        vae._conv_idx = [0]
        chunks.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                  first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(chunks, dim=2)


TRUNCATED_HINT = ("The pipelines' pixels are (x/2 + ½)·255 rounded (VaeImageProcessor.numpy_to_pil): .round() before "
                  ".to(torch.uint8), which alone truncates.")


@decode_to_uint8.trap("truncated to uint8 instead of rounded", hint=TRUNCATED_HINT)
def _(vae, latents):
    return _pixels(vae, latents, rounding=False)


@decode_to_uint8.trap("not clamped to [−1, 1] (values outside wrap around in uint8)",
                      hint="Clamp the decoded frames to [−1, 1] first (AutoencoderKLWan.decode does): 1.2 would "
                           "become 280, which is no uint8 (converted, it wraps: 24 on the usual CPU path).")
def _(vae, latents):
    return _pixels(vae, latents, clamp=False)


@decode_to_uint8.trap("post_quant_conv skipped (the latents fed to the decoder as they are)",
                      hint="AutoencoderKLWan.decode runs vae.post_quant_conv on the latents first (a 1×1×1 conv), then "
                           "the decoder frame by frame: x = vae.post_quant_conv(latents).")
def _(vae, latents):
    return _pixels(vae, latents, post_quant_conv=False)


# ---- the decode's memory --------------------------------------------------------------------------------
@functools.cache
def _whole_video_peak(shape: tuple) -> int:
    """Peak live bytes of the decode a pipeline does: the whole float video (AutoencoderKLWan.decode, whose frame
    loop grows it with torch.cat), then its uint8 pixels. Depends on shapes only: measured once per process."""
    vae = wan_vae()
    latents = torch.zeros(shape)

    def whole():
        video = vae.decode(latents).sample
        return ((video / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)

    return peak_bytes(whole)[0]


BUDGET_SHAPE = (1, 4, 9, 4, 4)  # 33 frames of 32×32


@decode_to_uint8.budget("peak memory: the uint8 video and one chunk, not the float video")
def _(learner, g):
    latents = torch.randn(BUDGET_SHAPE, generator=g)
    mine, out = learner.measure(peak_bytes, vae=wan_vae(), latents=latents)
    whole = _whole_video_peak(BUDGET_SHAPE)
    return [Measurement(
        f"peak live bytes decoding {BUDGET_SHAPE[2]} latent frames ({1 + 4 * (BUDGET_SHAPE[2] - 1)} frames of "
        f"{BUDGET_SHAPE[3] * 8}×{BUDGET_SHAPE[4] * 8})", mine, 0.6 * whole, "bytes",
        f"0.6x the peak of decoding the whole float video first ({whole / 2**20:.2f} MiB, measured on the same "
        "latents): the solution measures 0.44x; the float video built first (by AutoencoderKLWan.decode, or "
        "chunk by chunk and concatenated) 1.0x or more",
        trap=("the whole float video decoded before the conversion to uint8",
              "Convert as you go: decode a chunk of latent frames, turn it into uint8 pixels in the output, and let "
              "its float frames go before the next chunk.") if mine >= 0.95 * whole else None)]
