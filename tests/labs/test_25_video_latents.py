"""Lab 25: wrong-but-plausible implementations fail, and the commonest ones are named."""
from pathlib import Path

from expect import Fails

LAB = "25_video_latents"
REPO = Path(__file__).resolve().parents[2]


def rotary_body(split="(D - 4 * (D // 6), 2 * (D // 6), 2 * (D // 6))", layout="a.repeat_interleave(2, dim=1)",
                counts="(num_frames // patch_size[0], height // patch_size[1], width // patch_size[2])",
                order="(0, 1, 2)", dtype="torch.float64") -> str:
    """A body for rotary_3d with one line swapped for a wrong one."""
    return f"""
    D = attention_head_dim
    dims = {split}
    n = {counts}
    grids = torch.meshgrid(*(torch.arange(k, dtype={dtype}) for k in n), indexing="ij")
    parts = []
    for axis in {order}:
        d = dims[axis]
        freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype={dtype}) / d)
        a = grids[axis].reshape(-1, 1) * freqs
        parts.append({layout})
    a = torch.cat(parts, dim=1).reshape(1, -1, 1, D)
    return a.cos().float(), a.sin().float()
    """


def unpatch_body(grid="tokens.reshape(B, F_, H_, W_, p_t, p_h, p_w, -1)", perm="(0, 7, 1, 4, 2, 5, 3, 6)") -> str:
    """A body for unpatchify_video with one line swapped for a wrong one."""
    return f"""
    B = tokens.shape[0]
    p_t, p_h, p_w = patch_size
    F_, H_, W_ = num_frames // p_t, height // p_h, width // p_w
    x = {grid}.permute{perm}
    return x.reshape(B, x.shape[1], F_ * p_t, H_ * p_h, W_ * p_w)
    """


def decode_body(pixels="((chunk.clamp(-1, 1) / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)") -> str:
    """A body for decode_to_uint8 (streamed) with the pixel conversion swapped for a wrong one."""
    return f"""
    vae.clear_cache()
    x = vae.post_quant_conv(latents)
    B, n = latents.shape[0], latents.shape[2]
    video, at = None, 0
    for i in range(n):
        vae._conv_idx = [0]
        chunk = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        pixels = {pixels}
        if video is None:
            video = torch.empty((B, 1 + vae.config.scale_factor_temporal * (n - 1), *pixels.shape[2:]),
                                dtype=torch.uint8)
        video[:, at:at + pixels.shape[1]] = pixels
        at += pixels.shape[1]
    vae.clear_cache()
    return video
    """


# The float video first, then its pixels: right values, the float video's memory (and torch.cat's growing copies).
WHOLE_VIDEO = """
    vae.clear_cache()
    x = vae.post_quant_conv(latents)
    video = None
    for i in range(latents.shape[2]):
        vae._conv_idx = [0]
        chunk = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        video = chunk if video is None else torch.cat([video, chunk], dim=2)
    vae.clear_cache()
    return ((video.clamp(-1, 1) / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
    """

MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("video_num_frames", "return num_frames if num_frames % temporal == 1 else "
                         "-(-(num_frames - 1) // temporal) * temporal + 1", "rounded up to the next t·k + 1"),
    ("video_num_frames", "return max(num_frames // temporal * temporal, 1)", "rounded to a multiple of t"),
    ("video_num_frames", "return max((num_frames - 1) // temporal * temporal + 1, 1)",
     "rounded down to the t·k + 1 at or below F"),
    ("latent_shape", "return (batch_size, latent_channels, (num_frames - 1) // spatial + 1, height // temporal, "
                     "width // temporal)", "the temporal and spatial factors swapped"),
    ("encoder_chunks", "return [(0, 1)] + [(1 + 4 * k, 5 + 4 * k) for k in range(num_frames // 4)]",
     "F // 4 + 1 chunks"),
    ("video_num_frames",  # the nearest 4k + 1, ties to even k (the pipeline's warning says "nearest"; 7 → 5, 15 → 13)
     "return max(round((num_frames - 1) / temporal) * temporal + 1, 1)", 'rounded to the nearest t·k + 1'),
    ("latent_shape", "return (batch_size, latent_channels, num_frames // temporal, height // spatial, width // spatial)",
     "F // t latent frames"),
    ("latent_shape", "return (batch_size, latent_channels, num_frames // temporal + 1, height // spatial, width // spatial)",
     "F // t + 1 latent frames"),
    ("video_num_frames",  # a blind learner's: Wan 2.1's 4 written in
     "return num_frames if num_frames % 4 == 1 else max(num_frames // 4 * 4 + 1, 1)", "t fixed at 4"),
    ("latent_shape",  # a blind learner's: the sides rounded up
     "return (batch_size, latent_channels, (num_frames - 1) // temporal + 1, -(-height // spatial), "
     "-(-width // spatial))", "H / s rounded up"),
    ("latent_shape",  # a blind learner's: frames before channels
     "return (batch_size, (num_frames - 1) // temporal + 1, latent_channels, height // spatial, width // spatial)",
     "the right values in another order"),
    ("latent_shape",  # height and width swapped
     "return (batch_size, latent_channels, (num_frames - 1) // temporal + 1, width // spatial, height // spatial)",
     Fails("wrong", "")),
    ("encoder_chunks", "return [(i, min(i + 4, num_frames)) for i in range(0, num_frames, 4)]",
     "chunks of four from frame 0"),
    ("encoder_chunks", "return [(i, i + 4) for i in range(0, num_frames - 3, 4)]", "chunks of four from frame 0, whole"),
    ("encoder_chunks", "return [(0, 1)] + [(s, min(s + 4, num_frames)) for s in range(1, num_frames, 4)]",
     "a partial group at the end encoded too"),
    ("encoder_chunks",  # the chunks as (start, length)
     "return [(0, 1)] + [(1 + 4 * i, 4) for i in range((num_frames - 1) // 4)]", Fails("wrong", "")),
    ("rotary_3d", rotary_body(split="(2 * (D // 6), 2 * (D // 6), D - 4 * (D // 6))"),
     "the remainder of D given to the columns"),
    ("rotary_3d", rotary_body(layout="torch.cat([a, a], dim=1)"), "cos and sin in the half-split layout"),
    ("rotary_3d", rotary_body(order="(1, 2, 0)"), "the axes in another order"),
    ("rotary_3d", rotary_body(counts="(num_frames, height, width)"), "positions per latent voxel, not per patch"),
    ("rotary_3d", rotary_body().replace('torch.arange(k, dtype=torch.float64) for k in n',
                                        'torch.arange(k, dtype=torch.float64) * p for k, p in zip(n, patch_size)'),
     "positions counted in latent voxels"),
    ("rotary_3d",  # θ hard-coded to 10000 (right for every Wan config, not for the case that sets it)
     rotary_body().replace("theta **", "10000.0 **"), Fails("wrong", "")),
    ("rotary_3d",  # a blind learner's: every axis's frequencies over the whole head dim D
     rotary_body().replace("/ d)", "/ D)"), "each axis's frequencies over the whole head"),
    ("unpatchify_video",  # a blind learner's: each pair merged patch-major
     unpatch_body(perm="(0, 7, 4, 1, 5, 2, 6, 3)"), "each patch axis merged before its grid axis"),
    ("decode_to_uint8",  # a blind learner's: the latents straight into the decoder
     decode_body().replace("x = vae.post_quant_conv(latents)", "x = latents"), "post_quant_conv skipped"),
    ("unpatchify_video", unpatch_body(grid="tokens.reshape(B, F_, H_, W_, -1, p_t, p_h, p_w)",
                                      perm="(0, 4, 1, 5, 2, 6, 3, 7)"), "each token's vector read channels first"),
    ("unpatchify_video", unpatch_body(grid="tokens.reshape(B, F_, W_, H_, p_t, p_h, p_w, -1).transpose(2, 3)"),
     "tokens read with columns before rows"),
    ("unpatchify_video",  # rows and columns of each patch swapped
     unpatch_body(perm="(0, 7, 1, 4, 2, 6, 3, 5)"), Fails("wrong", "")),
    ("decode_to_uint8", decode_body(pixels="((chunk.clamp(-1, 1) / 2 + 0.5) * 255).to(torch.uint8).permute(0, 2, 3, 4, 1)"),
     "truncated to uint8 instead of rounded"),
    ("decode_to_uint8", decode_body(pixels="((chunk / 2 + 0.5) * 255).round().to(torch.int64).to(torch.uint8)"
                                           ".permute(0, 2, 3, 4, 1)"), "not clamped to [−1, 1]"),
    ("decode_to_uint8",  # channels first, as the decoder gives them
     decode_body(pixels="((chunk.clamp(-1, 1) / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 1, 3, 4)"),
     Fails("wrong", "shape")),
]

# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("rotary_3d",
     rotary_body(layout="torch.stack([a, a], dim=2).flatten(1)"),
     "the interleave written as stack-and-flatten"),
    ("unpatchify_video",
     unpatch_body(grid="tokens.view(B, F_, H_, W_, p_t, p_h, p_w, tokens.shape[-1] // (p_t * p_h * p_w))"),
     "view with the channel count computed"),
    ("decode_to_uint8",
     decode_body(pixels="((chunk.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1)"),
     "(x + 1)·127.5: the same pixels, a tie may round the other way"),
    ("encoder_chunks",
     """
     out, start = [(0, 1)], 1
     while start + 4 <= num_frames:
         out.append((start, start + 4))
         start += 4
     return out
     """,
     "a while loop over whole groups"),
]


def test_the_wan_rotary_module_is_refused_as_the_answer_key(grade_mutant):
    graded = grade_mutant(LAB, "rotary_3d", """
        from diffusers.models.transformers.transformer_wan import WanRotaryPosEmbed
        rope = WanRotaryPosEmbed(attention_head_dim, patch_size, max_seq_len=64, theta=theta)
        return rope(torch.zeros((1, 1, num_frames, height, width)))
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_decoding_with_the_vaes_own_decode_is_refused(grade_mutant):
    graded = grade_mutant(LAB, "decode_to_uint8", """
        video = vae.decode(latents).sample
        return ((video / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
