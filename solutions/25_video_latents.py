"""Lab 25 · Video latents

Concept:
    Today's open video models (Wan, LTX-Video, HunyuanVideo) are latent diffusion in time as well as
    space. A causal video VAE compresses a clip (B, 3, F, H, W) into latents (B, C, F', H/s, W/s) with
    F' = (F − 1)/t + 1: the first frame is encoded alone, as an image, and every later group of t frames
    (t = 4 for Wan) becomes one latent frame. A transformer then sees the latents as a sequence of 3-D
    patches, one token per (frame, row, column) patch, whose rotary embedding rotates by three
    positions at once. You will rebuild, from plain tensors, what WanPipeline, AutoencoderKLWan,
    WanRotaryPosEmbed and WanTransformer3DModel compute around the denoiser, and decode a video without
    holding it twice in float32.

Mental model:
    - Frames come in 4k + 1: one image frame, then k groups of four. WanPipeline moves any other count to
      F // 4 · 4 + 1 (and warns): 10 → 9, 12 → 13, 16 → 17; the encoder itself drops the frames past the
      last full group.
    - Causality is what makes video VAEs streamable: a latent frame depends only on the frames before
      it. The encoder walks the clip in chunks (frame 0 alone, then four at a time) and the decoder one
      latent frame at a time, each carrying a small cache of the previous chunk's features. The first
      latent frame decodes to one frame, every later one to four.
    - Memory: the decoded float32 video is the largest tensor of the whole call (81 frames of 480×832
      are 388 MB). Turning each decoded chunk into uint8 pixels as it comes out keeps a quarter of that.
    - Tokens: patches of (p_t, p_h, p_w) = (1, 2, 2) latent voxels, in frame-major order: token
      n = (f·H' + h)·W' + w. Each token's output vector holds its patch as (p_t, p_h, p_w, C).
    - Rotary positions in 3-D: the head dimension D is split into frames, rows and columns, the rows and
      columns getting 2·⌊D/6⌋ each and the frames the rest; each part is a 1-D rotary table over its own
      axis (θ = 10000), and a token's cos/sin is the three tables read at (f, h, w), concatenated.

Traps:
    - Frame counts that are not 4k + 1: the pipeline takes F // 4 · 4 + 1 (10 → 9, not 13; 7 → 5, not
      the other "nearest", 9), and the latent frame count is (F − 1) // 4 + 1, not F // 4.
    - Chunking the encoder in fours from frame 0: frame 0 is its own chunk, then [1, 5), [5, 9), …, and
      a partial group at the end is dropped, not encoded.
    - The first latent frame decodes to one frame, not four: F = 4·(F' − 1) + 1.
    - The rotary split: rows and columns get 2·⌊D/6⌋ each, the frames the remainder (D = 16: frames 8,
      rows 4, columns 4), not the remainder to the last axis; the table repeats each cos and sin twice,
      interleaved (c₀, c₀, c₁, c₁, …), not the half-split layout.
    - Positions per patch, not per latent voxel: a 2×2 patch advances the row position by one.
    - Token order: frames outermost, then rows, then columns; and inside a token, the patch's voxels
      first and the channels last.
    - Decoding the whole float video before converting it: correct values, twice the memory or more.
    - uint8 pixels are (x/2 + ½)·255 rounded, after clamping: without the clamp, values outside [−1, 1]
      wrap around in uint8; truncating instead of rounding darkens every frame by half a level.

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names and compute as
    wide as you like. The rotary tables are computed in float64 and returned in float32, as diffusers
    does; the decode's pixels are uint8, where another float order may round a pixel at a tie the other
    way (at most one level, on a tiny share of the pixels). The tables are judged against exact float64
    math like every float in the course.

Say it out loud:
    "A video latent has (F − 1)/4 + 1 frames: the first frame alone, then one per four. The causal VAE
    walks the clip chunk by chunk and decodes one latent frame at a time, so I can turn each decoded
    chunk into uint8 pixels before the next one exists. The transformer reads frame-major 1×2×2 patches,
    and its rotary embedding spends 2⌊D/6⌋ dimensions on rows, as many on columns and the rest on frames,
    each an interleaved 1-D table read at the patch's position."

Graded against: WanPipeline (its frame rounding and prepare_latents, on a tiny pipeline run),
AutoencoderKLWan (encode's chunks, decode, the latent shapes of real encodes), WanRotaryPosEmbed and
WanTransformer3DModel's output layout (tiny, random weights), and VideoProcessor.postprocess_video's
pixels, on fresh seeded inputs; the decode's peak memory against decoding the whole float video first.
Run: python -m pytest katas/25_video_latents.py
"""
import math

import torch


# ---- Worked example --------------------------------------------------------------------------------
def compression(vae) -> tuple[int, int]:
    """(t, s): frames per latent frame after the first, and pixels per latent pixel per side, as the
    Wan pipelines read them from the VAE's config (4 and 8 for Wan 2.1)."""
    return vae.config.scale_factor_temporal, vae.config.scale_factor_spatial


# ---- Your turn: shapes -----------------------------------------------------------------------------------
def video_num_frames(num_frames: int, temporal: int = 4) -> int:
    """The frame count a Wan pipeline generates when asked for `num_frames`: kept when F % t == 1 (the
    counts t·k + 1); any other becomes F // t · t + 1 (10 → 9, 12 → 13), and never below 1.

    Graded against: WanPipeline.__call__ (the num_frames it hands prepare_latents, on tiny pipeline runs)
    Returns: an int.
    """
    # BEGIN SOLUTION: keep t·k + 1; otherwise the t·k + 1 above the multiple of t at or below F
    if num_frames % temporal != 1:
        num_frames = num_frames // temporal * temporal + 1
    return max(num_frames, 1)
    # END SOLUTION


def latent_shape(batch_size: int, num_frames: int, height: int, width: int, latent_channels: int,
                 temporal: int = 4, spatial: int = 8) -> tuple[int, int, int, int, int]:
    """The shape of a video's latents: (B, C, (F − 1)//t + 1, H//s, W//s).

    Graded against: WanPipeline.prepare_latents (what it draws) and AutoencoderKLWan.encode (the latents of
    real clips of F frames)
    Args: num_frames F (a count of the form t·k + 1, or any count: the encoder drops a partial group)
    Returns: a tuple of five ints.
    """
    # BEGIN SOLUTION: one latent frame for the first frame, one per t frames after it; s per side in space
    return (batch_size, latent_channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)
    # END SOLUTION


def encoder_chunks(num_frames: int) -> list[tuple[int, int]]:
    """The frame ranges [start, end) Wan's causal video encoder processes, in order: frame 0 alone, then four
    at a time (whatever the VAE's temporal factor); frames past the last full group are not encoded.

    Graded against: AutoencoderKLWan.encode (the frames each call of its encoder received)
    Returns: a list of (start, end) pairs, e.g. F = 9: [(0, 1), (1, 5), (5, 9)].
    """
    # BEGIN SOLUTION: the first frame alone (an image), then one chunk per full group of four
    groups = (num_frames - 1) // 4
    return [(0, 1)] + [(1 + 4 * i, 5 + 4 * i) for i in range(groups)]
    # END SOLUTION


# ---- Your turn: the transformer's view -------------------------------------------------------------------
def rotary_3d(attention_head_dim: int, patch_size: tuple[int, int, int], num_frames: int, height: int, width: int,
              theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The 3-axis rotary embedding of a video transformer's tokens: (cos, sin), each (1, N, 1, D).

    D = attention_head_dim splits into d_h = d_w = 2·⌊D/6⌋ and d_f = D − d_h − d_w. For an axis of d dims
    the 1-D table at position p is angle_j = p / θ^(2j/d), j = 0 … d/2 − 1, each cos and sin repeated twice,
    interleaved: (cos a₀, cos a₀, cos a₁, cos a₁, …). A token at patch position (f, h, w) gets the frame
    table at f, the row table at h and the column table at w, concatenated in that order; tokens run
    frame-major, N = F'·H'·W' with F' = num_frames // p_t, H' = height // p_h, W' = width // p_w.

    Graded against: WanRotaryPosEmbed(attention_head_dim, patch_size, max_seq_len, theta)(latents)
    Args: num_frames, height, width: the latents' frames, rows and columns (before patching).
    Returns: (cos, sin), float32, computed in float64.
    """
    # BEGIN SOLUTION: three 1-D interleaved tables (frames get the remainder of D), read at each token's position
    d_h = d_w = 2 * (attention_head_dim // 6)
    d_f = attention_head_dim - d_h - d_w
    counts = (num_frames // patch_size[0], height // patch_size[1], width // patch_size[2])

    def table(dim: int, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # (dim/2,)
        angles = torch.outer(torch.arange(positions, dtype=torch.float64), freqs)  # (positions, dim/2)
        return angles.cos().repeat_interleave(2, dim=1), angles.sin().repeat_interleave(2, dim=1)

    F_, H_, W_ = counts
    parts = []
    for (dim, n), view in zip(((d_f, F_), (d_h, H_), (d_w, W_)),
                              ((F_, 1, 1, -1), (1, H_, 1, -1), (1, 1, W_, -1))):
        cos, sin = table(dim, n)
        parts.append((cos.view(*view).expand(F_, H_, W_, -1), sin.view(*view).expand(F_, H_, W_, -1)))
    # The axes concatenated per token (frames, rows, columns), tokens frame-major.
    cos = torch.cat([p[0] for p in parts], dim=-1).reshape(1, F_ * H_ * W_, 1, -1)
    sin = torch.cat([p[1] for p in parts], dim=-1).reshape(1, F_ * H_ * W_, 1, -1)
    return cos.float(), sin.float()
    # END SOLUTION


def unpatchify_video(tokens: torch.Tensor, num_frames: int, height: int, width: int,
                     patch_size: tuple[int, int, int]) -> torch.Tensor:
    """The transformer's output tokens back into a latent video.

    tokens (B, N, p_t·p_h·p_w·C): token n = (f·H' + h)·W' + w holds the patch at (f, h, w), its vector laid
    out as (p_t, p_h, p_w, C). Returns (B, C, F, H, W) with F = F'·p_t, H = H'·p_h, W = W'·p_w.

    Graded against: WanTransformer3DModel.forward (its last layer's output replaced by `tokens`: the model's own
    reshape turns them into the latent video)
    Args: num_frames, height, width: of the latent video (before patching).
    """
    # BEGIN SOLUTION: split the token axis into (F', H', W') and the vector into (p_t, p_h, p_w, C), interleave
    B = tokens.shape[0]
    p_t, p_h, p_w = patch_size
    F_, H_, W_ = num_frames // p_t, height // p_h, width // p_w
    x = tokens.reshape(B, F_, H_, W_, p_t, p_h, p_w, -1)
    # (B, C, F', p_t, H', p_h, W', p_w): each patch axis next to its grid axis, then merged
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.reshape(B, x.shape[1], F_ * p_t, H_ * p_h, W_ * p_w)
    # END SOLUTION


# ---- Your turn: decoding a video without holding it twice ----------------------------------------------------
def decode_to_uint8(vae, latents: torch.Tensor) -> torch.Tensor:
    """A Wan video's pixels, decoded one latent frame at a time and turned into uint8 as they come.

    The causal decoder, one latent frame at a time (what AutoencoderKLWan.decode runs inside):
        vae.clear_cache();  x = vae.post_quant_conv(latents)
        for i in range(F'):  vae._conv_idx = [0]
            frames = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx,
                                 first_chunk=(i == 0))          # 1 frame for i = 0, then t frames each
        vae.clear_cache()
    Each decoded chunk in [−1, 1] becomes pixels: clamp to [−1, 1], (x/2 + ½)·255, rounded to uint8, laid out
    (B, F, H, W, 3) as video writers take frames. Keep only the uint8 video and the chunk at hand.

    Graded against: AutoencoderKLWan.decode, then VideoProcessor.postprocess_video(output_type="pil") (its
    pixels); budget: peak memory against decoding the whole float video first. (A VAE whose config sets
    patch_size, Wan 2.2's 5B one, also unpatchifies the decoder's output; the lab's VAEs have none.)
    Args: latents (B, C, F', h, w) float32.
    Returns: (B, 1 + t·(F' − 1), h·s, w·s, 3) uint8.
    """
    # BEGIN SOLUTION: one uint8 video allocated once; each latent frame decoded, converted, written, dropped
    vae.clear_cache()
    x = vae.post_quant_conv(latents)
    B, n = latents.shape[0], latents.shape[2]
    video = None
    at = 0
    for i in range(n):
        vae._conv_idx = [0]
        chunk = vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0)
        # 1. Pixels now: the float chunk is a few frames; the float video is never built.
        pixels = ((chunk.clamp(-1, 1) / 2 + 0.5) * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)
        del chunk
        if video is None:
            t = vae.config.scale_factor_temporal
            video = torch.empty((B, 1 + t * (n - 1), *pixels.shape[2:]), dtype=torch.uint8)
        # 2. Written in place: no growing torch.cat (which would copy the video so far at every step).
        video[:, at:at + pixels.shape[1]] = pixels
        at += pixels.shape[1]
    vae.clear_cache()
    return video
    # END SOLUTION
