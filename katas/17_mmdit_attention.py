"""Lab 17 · DiT / MMDiT attention

Concept:
    SD3 and Flux drop the UNet's cross-attention. Their transformer blocks keep two token streams, the
    image's and the text's, each with its own weights (an "MM"-DiT: multi-modal), and let them meet in
    ONE attention over the concatenation of both: every image token attends to every text token and
    to every other image token, and the text tokens attend to the image too. Position enters through
    rotary embeddings (Flux): q and k are rotated by angles that depend on each token's (t, row, col)
    position id, so q·k depends on the *difference* of positions. Around the network, guidance has grown
    variants that are pure tensor math on the two predictions: adaptive projected guidance (APG) and
    CFG-Zero*. You will rebuild SD3's joint attention processor, Flux's position ids, its cos/sin tables
    and the rotary attention, the two guidance variants of `diffusers.guiders`, and Flux-dev's distilled
    guidance: a model trained to take the guidance scale as an input, so guiding costs no second call.

Mental model:
    - Joint attention (JointAttnProcessor2_0), image x (B, N, C) and text c (B, M, C):
        q, k, v  = to_q(x),     to_k(x),     to_v(x)          → heads (B, H, N, d); norm_q / norm_k
        q', k', v' = add_q_proj(c), add_k_proj(c), add_v_proj(c) → heads (B, H, M, d); norm_added_q / _k
        o = softmax(QKᵀ/√d)V  with Q = [q, q'], K = [k, k'], V = [v, v'] along the tokens (image first)
        image out = to_out(o[:, :N]);  text out = to_add_out(o[:, N:])  (raw o[:, N:] if context_pre_only)
      Attention without positions is blind to the order of its keys: only the split has to match the
      concatenation. (Flux concatenates [text, image], and there the order matters: its rotary ids are
      concatenated the same way.)
    - Flux's position ids: one row of 3 numbers per token. Text tokens: (0, 0, 0), all of them. Image
      token at grid cell (r, c) of the packed latent: (0, r, c), row-major. ids = [text ids; image ids].
    - FluxPosEmbed(θ, axes_dim): each axis i gets d_i/2 frequencies ω_j = θ^(−2j/d_i); the angle of a
      token is its position on that axis times ω_j; cos and sin are repeated *interleaved*
      (c0 c0 c1 c1 …) so that channels (2j, 2j+1) form a rotating pair; the axes are concatenated.
    - apply_rotary_emb (use_real, unbind −1): for each pair (a, b) → (a·cos − b·sin, b·cos + a·sin),
      i.e. out = x·cos + rot(x)·sin with rot(x) = (−b, a) per pair. q and k are rotated; v is not:
      positions shape *who attends to whom*, not *what is carried*.
    - APG (Sadat et al. 2024), per sample, norms over all but the batch axis:
        Δ = c − u;  Δ ← Δ·min(1, r/‖Δ‖) (r > 0);  ĉ = c/‖c‖;  Δ∥ = (Δ·ĉ)ĉ;  Δ⊥ = Δ − Δ∥
        pred = u + s·(Δ⊥ + η·Δ∥)
    - CFG-Zero* (Fan et al. 2025), per sample: α = ⟨c, u⟩ / (‖u‖² + 1e-8), the scale that best fits the
      unconditional prediction to the conditional one; pred = α·u + s·(c − α·u); and the first
      zero_init_steps steps return zeros ("zero-init": a flow model's first velocity is worst).

Traps:
    - One projection for both streams: the text tokens have their own add_q/k/v_proj, their own qk-norm
      and their own output projection to_add_out.
    - Concatenate in one order and split in the other: SD3 puts the image first, so the image output is
      o[:, :N]. Two separate attentions (image-only, text-only) are not joint attention at all.
    - Rotary on v, rotary pairs taken as halves (rotate_half: (x[:d/2], x[d/2:])) instead of interleaved
      (x[0::2], x[1::2]), cos/sin repeated as [c, c] instead of c0 c0 c1 c1, ω = θ^(−j/d) for θ^(−2j/d).
    - Position ids as (col, row): the image is transposed for the model (only visible when rows ≠ cols).
    - APG projects the difference onto the *conditional* prediction, not the unconditional one or the
      difference itself; η scales the parallel part, not the orthogonal one; and at s = 1 the guider is
      off: it returns the conditional prediction as it is.
    - CFG-Zero*'s α is one number *per sample*, not one for the batch; ‖u‖² in the denominator, not ‖c‖².
    - Flux-dev's guidance is an input, not a second pass: one call with guidance = full([B], s), which the
      transformer multiplies by 1000 itself, as it does the timestep it is given as t/1000. Only true CFG
      pays a second call, on the negative prompt, and combines from it: v_u + s_true·(v_c − v_u).

Precision:
    The course's one policy (lab 01 states it): return the dtype the docstring names, and compute as
    wide as you like; the graders measure your error against exact float64 math (the same diffusers code
    run on float64 modules and inputs) and accept anything about as close to it as diffusers' own answer.
    diffusers runs attention in the module's dtype (float16 too), builds ω in float64 and casts cos/sin
    to float32, rotates in float32 and casts back to x's dtype, projects APG's difference in float64,
    and computes CFG-Zero*'s α in float32. Computing any of it wider and casting once passes.

Say it out loud:
    "MMDiT keeps separate weights per modality and one attention over the concatenated tokens, so text
    and image attend to each other both ways; the output is split back and each part goes through its
    own projection. Flux gives each token a (0, row, col) id, text gets zeros, and rotates q and k by
    angles pos·θ^(−2j/d) on interleaved channel pairs, never v. APG keeps the part of c − u orthogonal to
    c and damps the parallel part by η; CFG-Zero* rescales u per sample by ⟨c, u⟩/‖u‖² and zeros the
    first steps."

Graded against: diffusers JointAttnProcessor2_0 on a tiny Attention (added_kv_proj_dim, qk_norm None /
"rms_norm", context_pre_only False / True), FluxPipeline._prepare_latent_image_ids, FluxPosEmbed,
apply_rotary_emb + scaled_dot_product_attention (Flux's attention), AdaptiveProjectedGuidance and
ClassifierFreeZeroStarGuidance from diffusers.guiders, on fresh seeded inputs; FluxPipeline's noise_pred on a tiny
FluxTransformer2DModel with and without guidance_embeds, with and without true CFG.
Run: python -m pytest katas/17_mmdit_attention.py
"""
import math

import torch
import torch.nn.functional as F


# ---- Worked example --------------------------------------------------------------------------------
def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, S, H·d) → (B, H, S, d): the layout scaled_dot_product_attention works in."""
    batch, tokens, inner = x.shape
    return x.view(batch, tokens, heads, inner // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, d) → (B, S, H·d): back to one vector per token."""
    batch, heads, tokens, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, tokens, heads * head_dim)


# ---- Your turn -------------------------------------------------------------------------------------
def joint_attention(attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
    """SD3's joint attention: two token streams, their own projections, one attention, split back.

    attn is a diffusers `Attention` built with added_kv_proj_dim. Use its layers, never attn(...) itself:
        image stream: attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k (norms may be None),
                      attn.to_out[0] (then attn.to_out[1], a dropout)
        text stream:  attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_added_q,
                      attn.norm_added_k (may be None), attn.to_add_out (None when attn.context_pre_only)
        attn.heads:   the number of heads; head_dim = inner dim / heads
    The qk-norms act on (B, H, S, d) heads. Queries, keys and values are concatenated along the tokens,
    image first: [image, text]; one softmax(QKᵀ/√d)V; the first N rows are the image's.

    Graded against: JointAttnProcessor2_0()(attn, hidden_states, encoder_hidden_states)
    Args:
        attn:                  the Attention module (float32 or float16 weights)
        hidden_states:         (B, N, C) image tokens, dtype of attn
        encoder_hidden_states: (B, M, C) text tokens, dtype of attn
    Returns: (image_out (B, N, C), text_out (B, M, C)); text_out is the raw attention output (B, M, H·d)
    when attn.context_pre_only (SD3's last block has no text output projection). dtype of the inputs.
    """
    # TODO: each stream's own projections and qk-norm, one attention over [image, text], split, project
    raise NotImplementedError


def flux_position_ids(text_len: int, rows: int, cols: int) -> torch.Tensor:
    """Flux's 3-axis position ids for [text tokens, image tokens], as its transformer concatenates them.

    Text tokens all get (0, 0, 0). The image token at (row r, column c) of the packed latent grid (the
    latent after Flux's 2×2 packing: rows = height/16, cols = width/16) gets (0, r, c), row-major:
    token index r·cols + c.

    Graded against: torch.cat([zeros(text_len, 3), FluxPipeline._prepare_latent_image_ids(1, rows, cols,
    cpu, float32)]) (what FluxTransformer2DModel.forward concatenates as ids)
    Args:
        text_len:   M, the number of text tokens
        rows, cols: the image token grid
    Returns: (M + rows·cols, 3) float32.
    """
    # TODO: zeros for the text, then (0, row, col) for every image token in row-major order
    raise NotImplementedError


def rope_cos_sin(ids: torch.Tensor, theta: float, axes_dim: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flux's rotary tables: per axis i, ω_j = θ^(−2j/d_i) for j < d_i/2, angles ids[:, i]·ω_j, their cos
    and sin repeated interleaved (a0 a0 a1 a1 …, so channels 2j and 2j+1 share an angle); axes concatenated.

    Graded against: FluxPosEmbed(theta, axes_dim)(ids)
    Args:
        ids:      (S, n_axes) float32 position ids (from `flux_position_ids`, or any)
        theta:    θ, the base (Flux: 10000)
        axes_dim: d_i per axis, each even (Flux: (16, 56, 56), summing to the head dim 128)
    Returns: (cos, sin), each (S, sum(axes_dim)) float32.
    """
    # TODO: per axis, angles pos·θ^(−2j/d); cos and sin each repeated interleaved; concatenate the axes
    raise NotImplementedError


def rotary_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Flux's attention with rotary position embeddings: rotate q and k (never v), then attend.

    Rotation, per interleaved channel pair (a, b) = (x[..., 2j], x[..., 2j + 1]):
        (a, b) → (a·cos − b·sin, b·cos + a·sin)      i.e.  x·cos + rot(x)·sin, rot(x) = (−b, a) per pair
    in float32, cast back to x's dtype; then softmax(q kᵀ/√d)·v.

    Graded against: F.scaled_dot_product_attention(apply_rotary_emb(query, (cos, sin)),
    apply_rotary_emb(key, (cos, sin)), value) (use_real=True, use_real_unbind_dim=−1: Flux's)
    Args:
        query, key, value: (B, H, S, d), float32 or float16
        cos, sin:          (S, d) float32 (from `rope_cos_sin`)
    Returns: (B, H, S, d), dtype of query.
    """
    # TODO: rotate each (even, odd) channel pair of q and k by its angle, leave v alone, attend
    raise NotImplementedError


def apg_guidance(pred_cond: torch.Tensor, pred_uncond: torch.Tensor, guidance_scale: float,
                 eta: float = 1.0, norm_threshold: float = 15.0) -> torch.Tensor:
    """Adaptive projected guidance: guide along the part of c − u orthogonal to c, damp the parallel part.

    Per sample b, with norms and dot products over all axes but the batch:
        Δ = c − u;   if r > 0: Δ ← Δ·min(1, r/‖Δ‖)
        ĉ = c/‖c‖;   Δ∥ = (Δ·ĉ)·ĉ;   Δ⊥ = Δ − Δ∥
        pred = u + s·(Δ⊥ + η·Δ∥)

    Graded against: AdaptiveProjectedGuidance(guidance_scale=s, eta=η,
    adaptive_projected_guidance_rescale=r).forward(pred_cond, pred_uncond).pred (no momentum)
    Args:
        pred_cond, pred_uncond: (B, C, H, W) the two predictions, float32 or float16
        guidance_scale:         s; at s = 1 (math.isclose) the guider switches itself off and returns pred_cond
        eta:                    η, the weight of the parallel part
        norm_threshold:         r, the largest ‖Δ‖ allowed per sample (0: no rescale)
    Returns: (B, C, H, W), dtype of pred_cond.
    """
    # TODO: per-sample rescale of c − u, project it onto c (in float64), recombine with η, add s· to u
    raise NotImplementedError


def cfg_zero_star(pred_cond: torch.Tensor, pred_uncond: torch.Tensor, guidance_scale: float,
                  step: int, zero_init_steps: int = 1) -> torch.Tensor:
    """CFG-Zero*: classifier-free guidance from the unconditional prediction rescaled per sample, and
    zeros for the first zero_init_steps steps.

        step < zero_init_steps:  pred = 0
        otherwise, per sample b: α_b = ⟨c_b, u_b⟩ / (‖u_b‖² + 1e-8)   (sums over all axes but the batch)
                                 pred = α·u + s·(c − α·u)

    Graded against: ClassifierFreeZeroStarGuidance(guidance_scale=s, zero_init_steps=…) after
    set_state(step, …), .forward(pred_cond, pred_uncond).pred
    Args:
        pred_cond, pred_uncond: (B, C, H, W) the two predictions, float32 or float16
        guidance_scale:         s
        step:                   the index of the denoising step (0 first)
        zero_init_steps:        how many first steps return zeros
    Returns: (B, C, H, W), dtype of pred_cond.
    """
    # TODO: zeros while step < zero_init_steps; else α per sample = ⟨c, u⟩/‖u‖², guide from α·u
    raise NotImplementedError


def flux_velocity(transformer, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                  pooled_prompt_embeds: torch.Tensor, text_ids: torch.Tensor, latent_image_ids: torch.Tensor,
                  guidance_scale: float = 3.5, true_cfg_scale: float = 1.0,
                  negative_prompt_embeds: torch.Tensor | None = None,
                  negative_pooled_prompt_embeds: torch.Tensor | None = None) -> torch.Tensor:
    """The velocity FluxPipeline hands scheduler.step at one step: distilled guidance, and true CFG on top.

        guidance = full([B], guidance_scale) if transformer.config.guidance_embeds else None
        v_c = transformer(latents, timestep/1000 (per sample), guidance, the prompt)      one call
        true CFG (true_cfg_scale > 1 and a negative prompt given): v_u = the same on the negative prompt,
        v = v_u + true_cfg_scale·(v_c − v_u)                                              a second call

    Graded against: FluxPipeline.__call__'s denoising step (the noise_pred it hands scheduler.step), on a tiny
    FluxTransformer2DModel with and without guidance_embeds; the transformer counts its calls.
    Args:
        transformer:            a FluxTransformer2DModel, called as transformer(hidden_states=…, timestep=…,
                                guidance=…, pooled_projections=…, encoder_hidden_states=…, txt_ids=…, img_ids=…,
                                return_dict=False)[0]
        latents:                (B, S, C) packed latents
        timestep:               0-dim, the scheduler's timestep t (0 … 1000)
        prompt_embeds:          (B, L, D);  pooled_prompt_embeds: (B, P)
        text_ids, latent_image_ids: (L, 3) and (S, 3) position ids
        guidance_scale:         embedded (guidance-distilled models only): one call, no unconditional branch
        true_cfg_scale:         classifier-free guidance with a second call, when > 1 and a negative prompt is given
        negative_prompt_embeds, negative_pooled_prompt_embeds: the negative prompt, or None
    Returns: (B, S, C) in the latents' dtype.
    """
    # TODO: guidance as an input of the one call (if the model embeds it); a second call only for true CFG
    raise NotImplementedError
