"""Lab 11 · Memory: tiled VAE decode, sliced decode, chunked attention

Concept:
    Fitting a pipeline on a GPU means naming the peak-memory owner, picking the optimisation that
    shrinks it, and measuring what it costs. At high resolution the owner is often the VAE decoder
    (activations at full pixel resolution, all at once) or attention (a (Lq, Lk) score matrix per head).
    Tiling and slicing trade a little extra compute for a peak that no longer grows with the image
    or the batch; chunking attention bounds the score matrix.

Mental model:
    - Untiled decode: one decoder pass over the whole latent; its largest activation is
      (B, 128, H, W) at output resolution, so memory grows with the image area.
    - Tiled decode (diffusers AutoencoderKL.tiled_decode): latent tiles of size t overlapping by a
      fraction o are decoded one by one; each decoded tile is blended into its upper and left
      neighbours over E = int(t·vsf·o) pixel rows/columns with linear weights, then cropped to
      t·vsf − E. Peak = one tile's activations + whatever tiles you still hold.
    - Sliced decode: the batch is decoded one sample at a time; the peak is one sample's activations.
    - Chunked attention: softmax(Q Kᵀ·s + mask) V computed for a block of queries at a time; every
      query row's softmax needs all keys, so chunk over queries, never over keys.

Traps:
    - Comparing tiled with untiled decode: with random weights (and per-tile GroupNorm statistics)
      they differ by far more than rounding; tiled decode is graded against tiled_decode.
    - Blending against neighbours that were not blended yet: diffusers blends in place, so the tile
      above and the tile to the left are already blended when they are used.
    - Holding every decoded tile until the end (what diffusers does): correct, but the peak grows
      with the image again. Keep only the strips the next blends need.
    - SD's 8 pixels per latent written in: the factor is the VAE's, 2^(len(block_out_channels) − 1).
    - Chunking attention over keys and normalising each chunk's softmax on its own.
    - The scale 1/√d, and a mask added after the softmax instead of before.
    - A query whose bool mask keeps no key (a padding row): a softmax over only −inf is NaN;
      scaled_dot_product_attention gives that row 0.

Precision:
    The course's one policy (lab 01 states it): return the decoder's dtype, and compute as wide as you
    like; every check also knows the exact answer on the same inputs (the same tiles, blends and
    attention in float64: a float64 copy of the same VAE, scaled_dot_product_attention on float64
    tensors) and accepts anything about as close to it as diffusers' own answer. diffusers blends with
    Python-float weights in the tiles' dtype and runs attention in the inputs' dtype; blending in
    float64, or computing each attention chunk in float64 and casting it once, is right too. The
    budgets count what your code really allocates (a float64 chunk costs twice the bytes of a float32
    one), never the shape of one implementation.

Say it out loud:
    "Tiled decode caps the decoder's working set at one tile: decode a tile, blend its first E rows
    and columns into the neighbours already placed, write the kept part into the output, and keep
    only the seam strips. It costs about 1/(1−o)² the FLOPs for overlap o. Slicing does the same
    over the batch; chunked attention does it over queries, because a softmax row needs every key."

Graded against: diffusers AutoencoderKL.tiled_decode / blend_v / blend_h, AutoencoderKL.decode
with enable_slicing(), and torch.nn.functional.scaled_dot_product_attention (what diffusers'
AttnProcessor2_0 calls); with budgets on peak live tensor bytes and FLOPs, and on a GPU, time and
peak memory against diffusers' own tiled_decode.
Run: python -m pytest katas/11_memory.py   (budgets: python -m pytest katas/11_memory.py -m budget)
"""
import math

import torch


def blend_seam(first: torch.Tensor, second: torch.Tensor, extent: int, dim: int) -> torch.Tensor:
    """Blend `second`'s leading edge with `first`'s trailing edge along `dim` (2: rows, 3: columns).

    For y in 0 … E−1 with E = min(first.shape[dim], second.shape[dim], extent):
        out[y] = first[−E + y]·(1 − y/E) + second[y]·(y/E)        (other positions: second as is)
    Graded against: AutoencoderKL.blend_v (dim=2) and blend_h (dim=3).
    Args: first, second: (B, C, H, W) decoded tiles; extent: E in pixels.
    Returns: a new tensor shaped like `second` (diffusers writes into `second`; you must not).
    """
    # TODO: clone `second`, then blend the first E slices along dim with linear weights y/E
    raise NotImplementedError


def tiled_decode(vae, latents: torch.Tensor, tile_latent_size: int, overlap_factor: float = 0.25) -> torch.Tensor:
    """Decode latents tile by tile, as AutoencoderKL.tiled_decode does, with a small working set.

    Geometry (all ints, as diffusers computes them):
        vsf    = 2 ** (len(vae.config.block_out_channels) − 1)     pixels per latent
        stride = int(tile_latent_size · (1 − overlap_factor))       latent step between tile starts
        E      = int(tile_latent_size · vsf · overlap_factor)       blended pixels at each seam
        keep   = tile_latent_size · vsf − E                         pixels kept per tile and axis
    Tiles start at every `stride` in both axes (edge tiles are smaller). Each tile goes through
    vae.post_quant_conv (if vae.config.use_post_quant_conv) and vae.decoder; it is blended with the
    tile above (dim 2) and then the tile to its left (dim 3), both already blended, and cropped to
    [:keep, :keep].
    Graded against: AutoencoderKL.tiled_decode with tile_latent_min_size = tile_latent_size,
    tile_sample_min_size = tile_latent_size·vsf, tile_overlap_factor = overlap_factor.
    Budgets: a working set (peak live bytes minus the output) that grows at most with the image's
    side (seam strips, or one row of tiles), never with its area, and a peak under 0.2x untiled
    decode's; FLOPs no more than diffusers' tiled_decode.
    Args: vae: AutoencoderKL; latents: (B, 4, h, w).  Returns: (B, 3, H, W) in the decoder's dtype.
    """
    # TODO: decode tile by tile into a preallocated output, keeping only the seam strips
    raise NotImplementedError


def sliced_decode(vae, latents: torch.Tensor) -> torch.Tensor:
    """Decode a batch one sample at a time, as AutoencoderKL.decode does after enable_slicing().

    Each sample: vae.post_quant_conv (if vae.config.use_post_quant_conv), then vae.decoder.
    Graded against: AutoencoderKL.decode with enable_slicing() (bitwise the same as a per-sample loop;
    decoding the batch at once differs by ~2e-6 and holds every sample's activations at once).
    Args: vae: AutoencoderKL; latents: (B, 4, h, w).  Returns: (B, 3, h·vsf, w·vsf).
    """
    # TODO: one sample at a time through post_quant_conv and the decoder, into one output
    raise NotImplementedError


def chunked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    chunk_size: int,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(Q Kᵀ · scale + mask) V, computed `chunk_size` queries at a time.

    scale defaults to 1/√d. attn_mask broadcasts to (..., Lq, Lk): a bool mask keeps True
    positions (False → −inf before the softmax); a float mask is added to the scores. A query whose
    keys a bool mask removes all attends to nothing: its output row is 0, as
    scaled_dot_product_attention's (a softmax over only −inf is NaN).
    Graded against: torch.nn.functional.scaled_dot_product_attention (locked while your code runs).
    Budget: peak live bytes well under the naive (B, H, Lq, Lk) score matrix.
    Args: query (..., Lq, D), key (..., Lk, D), value (..., Lk, Dv), the same leading dimensions:
    (B, H) in a UNet's multi-head attention, (B,) alone in the VAE's single-head one.  Returns: (..., Lq, Dv).
    """
    # TODO: for each block of queries: scores, mask, softmax over keys, times V, into the output
    raise NotImplementedError
