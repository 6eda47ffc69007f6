"""Grader for lab 17 · DiT / MMDiT attention: SD3's joint attention, Flux's position ids, rotary tables and
rotary attention, and two guidance variants of diffusers.guiders (APG, CFG-Zero*).

References are live: JointAttnProcessor2_0 on a tiny `Attention` (added_kv_proj_dim = the image width, as
in SD3's blocks; qk_norm None / "rms_norm" with random norm weights; context_pre_only False / True),
FluxPipeline._prepare_latent_image_ids (its module pulls in transformers: imported once with the grader),
FluxPosEmbed, apply_rotary_emb with scaled_dot_product_attention (what FluxAttnProcessor does between its
projections), AdaptiveProjectedGuidance and ClassifierFreeZeroStarGuidance called on tensors after
set_state. The guiders log an "experimental" notice when built: they are built here, outside any check's
captured output, once per check call.

Precision: every float check carries its float64 shadow (Scenario.exact): the same diffusers code run on a
float64 copy of the module and float64 inputs (attention), FluxPosEmbed's math with float64 tables, and the
guiders' formulas in float64. diffusers runs attention in the module's dtype, casts cos/sin to float32 and
the rotated q/k back to their dtype, and casts CFG-Zero*'s α to the predictions' dtype; an answer at most
2× as far from exact math as diffusers' own (+ 2 ulps) passes, so computing wider and casting once is right.
"""
import copy
import logging
import math

import torch
import torch.nn.functional as F
from diffusers.guiders import AdaptiveProjectedGuidance, ClassifierFreeZeroStarGuidance
from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxPosEmbed
from diffusers.pipelines.flux.pipeline_flux import FluxPipeline

from diffusion_katas.core.spec import Kata, Measurement, Scenario
from diffusion_katas.core.tolerances import EMBED_ANGLE, EXACT, MODEL_FORWARD, STEP_MATH
from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import DTYPES, DenoiserProbe, quiet_diffusers, seed_from

PROCESSOR = "diffusers.models.attention_processor.JointAttnProcessor2_0.__call__"
ATTENTION = "diffusers.models.attention_processor.Attention.forward"
ROTARY = "diffusers.models.embeddings.apply_rotary_emb"
POS_EMBED = "diffusers.models.transformers.transformer_flux.FluxPosEmbed.forward"
ROPE_1D = "diffusers.models.embeddings.get_1d_rotary_pos_embed"
IMAGE_IDS = "diffusers.pipelines.flux.pipeline_flux.FluxPipeline._prepare_latent_image_ids"
APG = "diffusers.guiders.adaptive_projected_guidance"
ZERO_STAR = "diffusers.guiders.classifier_free_zero_star_guidance"

logging.getLogger("diffusers.guiders.guider_utils").setLevel(logging.ERROR)  # the "experimental" notice


def _rms(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _heads(x, heads):
    b, s, inner = x.shape
    return x.view(b, s, heads, inner // heads).transpose(1, 2)


def _merge(x):
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, h * d)


# ---- joint_attention --------------------------------------------------------------------------------
joint_attention = Kata(
    "joint_attention",
    hints=(
        "Two streams, two sets of weights, ONE attention: project the image with to_q/k/v and the text with "
        "add_q/k/v_proj (each with its own qk-norm), concatenate along the tokens with the image first, "
        "attend once, split at N, then to_out for the image and to_add_out for the text.",
        "Q = [norm_q(q_img), norm_added_q(q_txt)], K likewise, V = [v_img, v_txt] on dim 2 of (B, H, S, d); "
        "o = softmax(QKᵀ/√d)V; image = to_out(o[:, :N]); text = to_add_out(o[:, N:]) unless context_pre_only.",
        "q = split_heads(attn.to_q(x), attn.heads); q = attn.norm_q(q) if attn.norm_q is not None else q; … "
        "o = merge_heads(F.scaled_dot_product_attention(torch.cat([q, q2], 2), torch.cat([k, k2], 2), "
        "torch.cat([v, v2], 2))); return attn.to_out[0](o[:, :n]), attn.to_add_out(o[:, n:])",
    ),
    answer_key=(PROCESSOR, ATTENTION),
)

JOINT_CASES = [
    dict(batch=2, image_tokens=12, text_tokens=5, heads=2, head_dim=8, qk_norm=None, context_pre_only=False,
         dtype="float32"),
    dict(batch=3, image_tokens=9, text_tokens=7, heads=4, head_dim=4, qk_norm="rms_norm", context_pre_only=False,
         dtype="float32"),  # SD3.5's qk-norm
    dict(batch=2, image_tokens=16, text_tokens=6, heads=2, head_dim=8, qk_norm="rms_norm", context_pre_only=True,
         dtype="float32"),  # SD3's last block: no text output projection
    dict(batch=1, image_tokens=8, text_tokens=11, heads=1, head_dim=16, qk_norm=None, context_pre_only=True,
         dtype="float32"),  # more text tokens than image tokens
    dict(batch=2, image_tokens=10, text_tokens=4, heads=2, head_dim=8, qk_norm="rms_norm", context_pre_only=False,
         dtype="float16"),
]


def tiny_joint_attention(case: dict, g: torch.Generator) -> Attention:
    """An SD3-style joint Attention block's attention, random weights (norm weights random too)."""
    dim = case["heads"] * case["head_dim"]
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    attn = Attention(query_dim=dim, cross_attention_dim=None, added_kv_proj_dim=dim, dim_head=case["head_dim"],
                     heads=case["heads"], out_dim=dim, context_pre_only=case["context_pre_only"], bias=True,
                     qk_norm=case["qk_norm"], eps=1e-6, processor=JointAttnProcessor2_0())
    with torch.no_grad():
        for module in attn.modules():
            if type(module).__name__ == "RMSNorm" and getattr(module, "weight", None) is not None:
                module.weight.normal_(1.0, 0.3)
    return attn.eval().to(DTYPES[case["dtype"]])


@joint_attention.check("vs JointAttnProcessor2_0", cases=JOINT_CASES, tol=MODEL_FORWARD)
def _(case, g):
    attn = tiny_joint_attention(case, g)
    dtype, dim = DTYPES[case["dtype"]], case["heads"] * case["head_dim"]
    x = torch.randn(case["batch"], case["image_tokens"], dim, generator=g).to(dtype)
    c = torch.randn(case["batch"], case["text_tokens"], dim, generator=g).to(dtype)
    with torch.no_grad():
        expected = JointAttnProcessor2_0()(attn, x.clone(), c.clone())
        wide = copy.deepcopy(attn).to(torch.float64)
        exact = JointAttnProcessor2_0()(wide, x.double(), c.double())
    return Scenario(inputs=dict(attn=attn, hidden_states=x, encoder_hidden_states=c),
                    expected=tuple(t.detach() for t in expected), exact=tuple(t.detach() for t in exact),
                    label=f"B={case['batch']}, N={case['image_tokens']}, M={case['text_tokens']}, "
                          f"H={case['heads']}, qk_norm={case['qk_norm']}, context_pre_only={case['context_pre_only']}")


def _joint(attn, x, c, *, shared=False, text_first_split=False, separate=False, text_to_out=False,
           no_norm=False, shared_in=False, no_add_out=False, image_norm_on_text=False, split_text_first=False,
           scale_over_d=False, no_text_norm=False, scale_over_inner=False):
    """Joint attention with one misconception switched on (for traps); all off = correct."""
    heads, n = attn.heads, x.shape[1]
    sdpa = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=1 / q.shape[-1])) if scale_over_d \
        else (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=(heads * q.shape[-1]) ** -0.5)) \
        if scale_over_inner else F.scaled_dot_product_attention
    txt_layers = ((attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k) if shared or shared_in else
                  (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj,
                   *((attn.norm_q, attn.norm_k) if image_norm_on_text else (attn.norm_added_q, attn.norm_added_k))))

    def qkv(t, to_q, to_k, to_v, norm_q, norm_k):
        q, k, v = (_heads(layer(t), heads) for layer in (to_q, to_k, to_v))
        if not no_norm:
            q = norm_q(q) if norm_q is not None else q
            k = norm_k(k) if norm_k is not None else k
        return q, k, v

    with torch.no_grad():
        img = qkv(x, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
        txt = qkv(c, *txt_layers[:3], None, None) if no_text_norm else qkv(c, *txt_layers)
        if separate:
            o_img = _merge(sdpa(*img))
            o_txt = _merge(sdpa(*txt))
        else:
            first, second = (txt, img) if text_first_split else (img, txt)
            o = _merge(sdpa(*(torch.cat([a, b], 2) for a, b in zip(first, second))))
            o_img, o_txt = o[:, :n], o[:, n:]  # split as if the image came first
            if split_text_first:  # concatenated image first, split as if the text came first
                m = o.shape[1] - n
                o_txt, o_img = o[:, :m], o[:, m:]
        image = attn.to_out[0](o_img)
        if text_to_out or shared:
            text = attn.to_out[0](o_txt)
        elif attn.context_pre_only or no_add_out:
            text = o_txt
        else:
            text = attn.to_add_out(o_txt)
    return image, text


@joint_attention.trap("one projection shared by text and image tokens",
                      hint="The text stream has its own weights: add_q_proj / add_k_proj / add_v_proj, "
                           "norm_added_q / norm_added_k, and to_add_out on the way out. That is the 'MM' of MMDiT.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, shared=True)


@joint_attention.trap("the text projected with the image's to_q / to_k / to_v (to_add_out kept)",
                      hint="The text stream has projections of its own: add_q_proj, add_k_proj, add_v_proj (and "
                           "norm_added_q / norm_added_k), as it has to_add_out on the way out.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, shared_in=True)


@joint_attention.trap("to_add_out skipped (the text's attention output returned as it is)",
                      hint="Unless context_pre_only, the text part leaves through attn.to_add_out, as the image part "
                           "through to_out[0].")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, no_add_out=True)


@joint_attention.trap("the image's qk-norm (norm_q / norm_k) applied to the text",
                      hint="The text stream has its own norms: norm_added_q and norm_added_k (their weights differ "
                           "from the image's).")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, image_norm_on_text=True)


@joint_attention.trap("concatenated [text, image] but split as [image, text]",
                      hint="SD3 concatenates the image first: the image's rows of the output are o[:, :N]. "
                           "Attention does not care about the order of the tokens, but your split does.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, text_first_split=True)


@joint_attention.trap("concatenated [image, text] but split as [text, image]",
                      hint="The split follows the concatenation: with the image first, the image's rows of the "
                           "output are o[:, :N] and the text's o[:, N:].")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, split_text_first=True)


@joint_attention.trap("the scores scaled by 1/√(heads·d), the whole inner width, not 1/√d of one head",
                      hint="Each head attends on its own d = inner_dim / heads channels: the scale is 1/√d "
                           "(attn.scale; SDPA's default on (B, H, L, d) tensors), not 1/√inner_dim.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, scale_over_inner=True)


@joint_attention.trap("two separate attentions (image with image, text with text)",
                      hint="Joint attention is ONE softmax over all N + M keys: every image token sees the text "
                           "and every text token sees the image. Concatenate q, k and v before attending.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, separate=True)


@joint_attention.trap("text output through the image's to_out",
                      hint="The text part leaves through attn.to_add_out (and not at all when context_pre_only: "
                           "then the raw attention output is returned).")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, text_to_out=True)


@joint_attention.trap("qk-norm skipped",
                      hint="When the config has qk_norm, attn.norm_q / norm_k (image) and norm_added_q / "
                           "norm_added_k (text) act on each head's q and k before the concatenation.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, no_norm=True)


@joint_attention.trap("the text's qk-norm skipped (norm_added_q / norm_added_k)",
                      hint="With qk_norm, the text stream is normalized too: norm_added_q and norm_added_k act on the "
                           "text's q and k per head, as norm_q and norm_k on the image's.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, no_text_norm=True)


@joint_attention.trap("the scores scaled by 1/d instead of 1/√d",
                      hint="Scaled dot-product attention divides q·k by √d (d = the head dim): softmax(q·kᵀ/√d). "
                           "1/d flattens every score towards uniform attention.")
def _(attn, hidden_states, encoder_hidden_states):
    return _joint(attn, hidden_states, encoder_hidden_states, scale_over_d=True)


# ---- flux_position_ids ------------------------------------------------------------------------------
flux_position_ids = Kata(
    "flux_position_ids",
    hints=(
        "One row (t, row, col) per token: text tokens are all zeros; image tokens are (0, r, c) in row-major "
        "order; text rows first.",
        "ids = [zeros(M, 3); (0, r, c) for r in range(rows) for c in range(cols)], float32.",
        "r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing='ij'); "
        "img = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3).float(); "
        "return torch.cat([torch.zeros(text_len, 3), img])",
    ),
    answer_key=(IMAGE_IDS,),
)

IDS_CASES = [
    dict(text_len=5, rows=3, cols=4),
    dict(text_len=8, rows=4, cols=2),
    dict(text_len=1, rows=6, cols=6),
    dict(text_len=12, rows=2, cols=7),
    dict(text_len=0, rows=5, cols=3),  # no text tokens at all
]


@flux_position_ids.check("vs FluxPipeline._prepare_latent_image_ids after zero text ids", cases=IDS_CASES,
                         tol=EXACT)
def _(case, g):
    image = FluxPipeline._prepare_latent_image_ids(1, case["rows"], case["cols"], torch.device("cpu"), torch.float32)
    expected = torch.cat([torch.zeros(case["text_len"], 3), image])  # FluxTransformer2DModel.forward's ids
    return Scenario(inputs=dict(case), expected=expected, exact=expected.double(),
                    label=f"{case['text_len']} text + {case['rows']}×{case['cols']} image tokens")


def _ids(text_len, rows, cols, *, col_row=False, text_arange=False, image_first=False, axes=(0, 1, 2), start=0):
    r, c = torch.meshgrid(torch.arange(start, rows + start), torch.arange(start, cols + start), indexing="ij")
    r, c = (c, r) if col_row else (r, c)
    cols_ = [torch.zeros_like(r), r, c]
    image = torch.stack([cols_[a] for a in axes], -1).reshape(-1, 3).float()
    text = torch.zeros(text_len, 3)
    if text_arange:
        text[:, 1] = torch.arange(text_len)
    return torch.cat([image, text]) if image_first else torch.cat([text, image])


@flux_position_ids.trap("position ids from (col, row)",
                        hint="Axis 1 is the row, axis 2 the column: token r·cols + c gets (0, r, c). "
                             "(col, row) transposes the image for the model.")
def _(text_len, rows, cols):
    return _ids(text_len, rows, cols, col_row=True)


@flux_position_ids.trap("text tokens numbered 0, 1, 2, … instead of all zeros",
                        hint="Flux's text ids are all zeros: every text token sits at the origin, so rotary "
                             "embedding does not rotate them at all.")
def _(text_len, rows, cols):
    return _ids(text_len, rows, cols, text_arange=True)


@flux_position_ids.trap("rows and columns counted from 1",
                        hint="The first latent patch is at row 0, column 0: torch.arange(rows), torch.arange(cols).")
def _(text_len, rows, cols):
    return _ids(text_len, rows, cols, start=1)


@flux_position_ids.trap("image ids before the text ids",
                        hint="FluxTransformer2DModel concatenates (txt_ids, img_ids): text first, the same order "
                             "as its tokens.")
def _(text_len, rows, cols):
    return _ids(text_len, rows, cols, image_first=True)


@flux_position_ids.trap("tokens enumerated column by column (meshgrid indexing='xy')",
                        hint="The latent is flattened row by row: token r·cols + c is at (0, r, c). meshgrid with "
                             "indexing='ij' gives that order; 'xy' transposes it.")
def _(text_len, rows, cols):
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="xy")
    image = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3).float()
    return torch.cat([torch.zeros(text_len, 3), image])


@flux_position_ids.trap("ids (row, col, 0): the axes shifted",
                        hint="The first axis is the time/frame axis (0 for an image); row and column are axes 1 and 2.")
def _(text_len, rows, cols):
    return _ids(text_len, rows, cols, axes=(1, 2, 0))


# ---- rope_cos_sin -----------------------------------------------------------------------------------
rope_cos_sin = Kata(
    "rope_cos_sin",
    hints=(
        "Treat each axis separately: d_i/2 frequencies θ^(−2j/d_i), angles = position × frequency, cos and "
        "sin repeated so that each channel PAIR (2j, 2j + 1) shares an angle; concatenate the axes.",
        "ω_j = 1/θ^(2j/d_i), j < d_i/2;  A = ids[:, i, None]·ω[None];  cos_i = cos(A).repeat_interleave(2, 1) "
        "(c0 c0 c1 c1 …), sin likewise;  cos = cat_i cos_i (float32).",
        "for i, d in enumerate(axes_dim): w = 1 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d); "
        "a = ids[:, i].double()[:, None] * w; cos.append(a.cos().repeat_interleave(2, 1)); … "
        "return torch.cat(cos, -1).float(), torch.cat(sin, -1).float()",
    ),
    answer_key=(POS_EMBED, ROPE_1D),
)

ROPE_CASES = [
    dict(ids="flux", text_len=4, rows=3, cols=5, theta=10000.0, axes_dim=[4, 6, 6]),
    dict(ids="flux", text_len=3, rows=8, cols=8, theta=10000.0, axes_dim=[16, 56, 56]),  # Flux's head dim 128
    dict(ids="random", tokens=20, theta=256.0, axes_dim=[2, 4, 10]),
    dict(ids="random", tokens=9, theta=10000.0, axes_dim=[8, 8]),  # two axes
]


def _case_ids(case, g):
    if case["ids"] == "flux":
        image = FluxPipeline._prepare_latent_image_ids(1, case["rows"], case["cols"], torch.device("cpu"),
                                                       torch.float32)
        return torch.cat([torch.zeros(case["text_len"], 3), image])
    return torch.randint(0, 40, (case["tokens"], len(case["axes_dim"])), generator=g).to(torch.float32)


def _tables(ids, theta, axes_dim, *, halves=False, single_step=False, swap=False, dtype=torch.float64,
            total_width=False, linspace=False):
    cos, sin = [], []
    for i, d in enumerate(axes_dim):
        if total_width:  # every axis's frequencies over the whole width, not its own
            d_all = sum(axes_dim)
            exponent = torch.arange(0, d, 2, dtype=dtype) / d_all
            a = ids[:, i].to(dtype)[:, None] * (1.0 / theta ** exponent)[None]
            cos.append(a.cos().repeat_interleave(2, 1))
            sin.append(a.sin().repeat_interleave(2, 1))
            continue
        exponent = torch.arange(0, d // 2, dtype=dtype) / d if single_step else torch.arange(0, d, 2, dtype=dtype) / d
        if linspace:  # the exponents spread over [0, 1], the last one reaching θ^(−1)
            exponent = torch.linspace(0, 1, d // 2, dtype=dtype)
        a = ids[:, i].to(dtype)[:, None] * (1.0 / theta ** exponent)[None]
        c, s = (a.sin(), a.cos()) if swap else (a.cos(), a.sin())
        if halves:
            cos.append(torch.cat([c, c], -1))
            sin.append(torch.cat([s, s], -1))
        else:
            cos.append(c.repeat_interleave(2, 1))
            sin.append(s.repeat_interleave(2, 1))
    return torch.cat(cos, -1), torch.cat(sin, -1)


@rope_cos_sin.check("vs FluxPosEmbed", cases=ROPE_CASES, tol=EMBED_ANGLE)
def _(case, g):
    ids = _case_ids(case, g)
    expected = FluxPosEmbed(case["theta"], list(case["axes_dim"]))(ids.clone())
    return Scenario(inputs=dict(ids=ids, theta=case["theta"], axes_dim=list(case["axes_dim"])), expected=expected,
                    exact=_tables(ids, case["theta"], case["axes_dim"]),
                    label=f"{ids.shape[0]} tokens, θ={case['theta']:g}, axes_dim={case['axes_dim']}")


def _rope_trap(name, hint, **bug):
    @rope_cos_sin.trap(name, hint=hint)
    def _(ids, theta, axes_dim):
        return tuple(t.float() for t in _tables(ids, theta, axes_dim, **bug))


_rope_trap("cos/sin repeated as halves [c, c] instead of interleaved (c0 c0 c1 c1 …)",
           "Flux rotates interleaved channel pairs (2j, 2j + 1): each angle is repeated in place "
           "(repeat_interleave), not the whole table appended to itself.", halves=True)
_rope_trap("frequencies θ^(−j/d) instead of θ^(−2j/d)",
           "The exponent steps by 2/d: ω_j = θ^(−2j/d) for j = 0 … d/2 − 1 (arange(0, d, 2) / d).", single_step=True)
_rope_trap("each axis's frequencies over the whole width (d = sum(axes_dim))",
           "Each axis is a rotary embedding of its own: axis i's frequencies are θ^(−2j/d_i) with d_i = axes_dim[i], "
           "j < d_i/2.", total_width=True)
_rope_trap("cos and sin swapped", "The first table is the cosine of the angles, the second the sine.", swap=True)
_rope_trap("exponents linspace(0, 1, d/2) instead of 2j/d",
           "The exponents are 2j/d for j = 0 … d/2 − 1 (arange(0, d, 2) / d): they stop short of 1, at (d − 2)/d.",
           linspace=True)


# ---- rotary_attention -------------------------------------------------------------------------------
rotary_attention = Kata(
    "rotary_attention",
    hints=(
        "Rotate q and k (not v) pair by pair: channels (0, 1), (2, 3), … are the two coordinates of a point "
        "turned by the angle in cos/sin; then plain scaled-dot-product attention.",
        "For a = x[..., 0::2], b = x[..., 1::2]: rot(x) interleaves (−b, a); x' = x·cos + rot(x)·sin (float32, "
        "cast back); out = softmax(q' k'ᵀ/√d) v.",
        "a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1); r = torch.stack([-b, a], -1).flatten(-2); "
        "x2 = (x.float() * cos + r * sin).to(x.dtype); "
        "return F.scaled_dot_product_attention(rot(query), rot(key), value)",
    ),
    answer_key=(ROTARY,),
)

ROTARY_CASES = [
    dict(batch=2, heads=2, text_len=3, rows=3, cols=4, axes_dim=[4, 6, 6], dtype="float32"),
    dict(batch=1, heads=4, text_len=5, rows=2, cols=5, axes_dim=[2, 4, 10], dtype="float32"),
    dict(batch=3, heads=1, text_len=2, rows=4, cols=4, axes_dim=[8, 12, 12], dtype="float32"),
    dict(batch=2, heads=2, text_len=4, rows=3, cols=3, axes_dim=[4, 6, 6], dtype="float16"),
]


def _rotate(x, cos, sin, *, halves=False, reverse=False):
    if halves:
        a, b = x.float().chunk(2, dim=-1)
        rotated = torch.cat([-b, a], dim=-1)
    else:
        a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack([-b, a], dim=-1).flatten(-2)
    return (x.float() * cos + (-1 if reverse else 1) * rotated * sin).to(x.dtype)


@rotary_attention.check("vs apply_rotary_emb on q and k, then scaled_dot_product_attention", cases=ROTARY_CASES,
                        tol=MODEL_FORWARD)
def _(case, g):
    dtype, d = DTYPES[case["dtype"]], sum(case["axes_dim"])
    image = FluxPipeline._prepare_latent_image_ids(1, case["rows"], case["cols"], torch.device("cpu"), torch.float32)
    ids = torch.cat([torch.zeros(case["text_len"], 3), image])
    theta = 10000.0 if case["dtype"] == "float32" else 100.0
    cos, sin = FluxPosEmbed(theta, list(case["axes_dim"]))(ids)
    shape = (case["batch"], case["heads"], ids.shape[0], d)
    q, k, v = (torch.randn(shape, generator=g).to(dtype) for _ in range(3))
    expected = F.scaled_dot_product_attention(apply_rotary_emb(q, (cos, sin)), apply_rotary_emb(k, (cos, sin)), v)
    c64, s64 = cos.double(), sin.double()
    exact = F.scaled_dot_product_attention(_rotate(q.double(), c64, s64), _rotate(k.double(), c64, s64), v.double())
    return Scenario(inputs=dict(query=q, key=k, value=v, cos=cos, sin=sin), expected=expected, exact=exact,
                    label=f"q {tuple(shape)}, {case['text_len']} text + {case['rows']}×{case['cols']} image tokens")


@rotary_attention.trap("rotary applied to v too",
                       hint="Only q and k are rotated: positions decide who attends to whom (q·k depends on the "
                            "position difference); v carries content and is left as it is.")
def _(query, key, value, cos, sin):
    return F.scaled_dot_product_attention(*(_rotate(t, cos, sin) for t in (query, key, value)))


@rotary_attention.trap("rotary pairs taken as halves (rotate_half) instead of interleaved",
                       hint="Flux pairs neighbouring channels: (x[0], x[1]), (x[2], x[3]), … (use_real_unbind_dim "
                            "= −1). rotate_half pairs x[j] with x[j + d/2]: that is another model's layout.")
def _(query, key, value, cos, sin):
    return F.scaled_dot_product_attention(_rotate(query, cos, sin, halves=True), _rotate(key, cos, sin, halves=True),
                                          value)


@rotary_attention.trap("only q rotated (k left as it is)",
                       hint="Rotate k too: with both rotated, q_m·k_n depends on the position difference m − n.")
def _(query, key, value, cos, sin):
    return F.scaled_dot_product_attention(_rotate(query, cos, sin), key, value)


@rotary_attention.trap("rotated the wrong way (x·cos − rot(x)·sin)",
                       hint="(a, b) → (a·cos − b·sin, b·cos + a·sin): x·cos + rot(x)·sin with rot = (−b, a).")
def _(query, key, value, cos, sin):
    return F.scaled_dot_product_attention(_rotate(query, cos, sin, reverse=True), _rotate(key, cos, sin, reverse=True),
                                          value)


# ---- apg_guidance -----------------------------------------------------------------------------------
apg_guidance = Kata(
    "apg_guidance",
    hints=(
        "Per sample: clamp the norm of c − u to the threshold, split it into its component along the "
        "CONDITIONAL prediction and the rest, weight the parallel part by η, and add s times that to u.",
        "Δ = c − u; Δ ← Δ·min(1, r/‖Δ‖) if r > 0; ĉ = c/‖c‖; Δ∥ = ⟨Δ, ĉ⟩ĉ; Δ⊥ = Δ − Δ∥; "
        "pred = u + s·(Δ⊥ + η·Δ∥); norms and dots over every axis but the batch.",
        "dims = list(range(1, c.dim())); d = (c - u).double(); d = d * (r / torch.linalg.vector_norm(d, dim=dims, "
        "keepdim=True)).clamp(max=1); n = F.normalize(c.double(), dim=dims); par = (d * n).sum(dims, keepdim=True) * n; "
        "return (u + s * (d - par + eta * par)).to(c.dtype)",
    ),
    answer_key=(f"{APG}.normalized_guidance", f"{APG}.AdaptiveProjectedGuidance.forward"),
)

APG_CASES = [
    dict(shape=(2, 4, 8, 8), dtype="float32", guidance_scale=5.0, eta=0.0, norm_threshold=15.0),  # APG's defaults
    dict(shape=(3, 4, 8, 8), dtype="float32", guidance_scale=7.5, eta=0.5, norm_threshold=30.0),
    dict(shape=(4, 16, 4, 4), dtype="float32", guidance_scale=3.0, eta=1.0, norm_threshold=0.0),  # no rescale
    dict(shape=(2, 4, 8, 8), dtype="float16", guidance_scale=4.0, eta=0.3, norm_threshold=20.0),
    dict(shape=(2, 4, 8, 8), dtype="float32", guidance_scale=1.0, eta=0.5, norm_threshold=15.0),  # the guider is off
]


def _predictions(case, g):
    """c and u whose difference has a different size in every sample (so per-sample clamps differ)."""
    dtype, b = DTYPES[case["dtype"]], case["shape"][0]
    u = torch.randn(case["shape"], generator=g)
    size = torch.linspace(0.5, 2.5, b).reshape(-1, *([1] * (len(case["shape"]) - 1)))
    c = 0.8 * u + size * torch.randn(case["shape"], generator=g)
    return c.to(dtype), u.to(dtype)


def _apg(c, u, s, eta, r, *, onto="cond", batch_norm=False, no_rescale=False, eta_on="parallel", start="uncond",
         off_at_one=True):
    if off_at_one and math.isclose(s, 1.0):
        return c
    dims = list(range(0 if batch_norm else 1, c.dim()))
    d = c.double() - u.double()
    if r > 0 and not no_rescale:
        d = d * torch.clamp(r / torch.linalg.vector_norm(d, dim=dims, keepdim=True), max=1.0)
    ref = {"cond": c.double(), "uncond": u.double(), "diff": d}[onto]
    n = F.normalize(ref.flatten(dims[0]), dim=-1).reshape(ref.shape) if batch_norm else F.normalize(ref, dim=dims)
    par = (d * n).sum(dim=dims, keepdim=True) * n
    orth = d - par
    update = orth + eta * par if eta_on == "parallel" else eta * orth + par
    return ((u.double() if start == "uncond" else c.double()) + s * update).to(c.dtype)


@apg_guidance.check("vs AdaptiveProjectedGuidance.forward", cases=APG_CASES, tol=STEP_MATH)
def _(case, g):
    c, u = _predictions(case, g)
    with quiet_diffusers():
        guider = AdaptiveProjectedGuidance(guidance_scale=case["guidance_scale"], eta=case["eta"],
                                           adaptive_projected_guidance_rescale=case["norm_threshold"])
    guider.set_state(step=0, num_inference_steps=10, timestep=torch.tensor(999))
    expected = guider.forward(c.clone(), u.clone()).pred
    exact = (c.double() if math.isclose(case["guidance_scale"], 1.0) else
             _apg(c.double(), u.double(), case["guidance_scale"], case["eta"], case["norm_threshold"]))
    return Scenario(inputs=dict(pred_cond=c, pred_uncond=u, guidance_scale=case["guidance_scale"], eta=case["eta"],
                                norm_threshold=case["norm_threshold"]),
                    expected=expected, exact=exact,
                    label=f"{tuple(case['shape'])} {case['dtype']}, s={case['guidance_scale']}, η={case['eta']}, "
                          f"r={case['norm_threshold']}")


def _apg_trap(name, hint, **bug):
    @apg_guidance.trap(name, hint=hint)
    def _(pred_cond, pred_uncond, guidance_scale, eta=1.0, norm_threshold=15.0):
        return _apg(pred_cond, pred_uncond, guidance_scale, eta, norm_threshold, **bug)


_apg_trap("APG projection onto the unconditional prediction",
          "Project c − u onto the CONDITIONAL prediction: ĉ = c/‖c‖, Δ∥ = ⟨Δ, ĉ⟩ĉ (the part of the update that "
          "only scales the conditional output up, which oversaturates).", onto="uncond")
_apg_trap("APG projection onto the difference itself (no orthogonal part)",
          "Projecting Δ onto itself leaves nothing orthogonal: APG splits Δ against the conditional prediction c.",
          onto="diff")
_apg_trap("APG norms over the whole batch instead of per sample",
          "Every sample has its own ‖Δ‖ and its own projection: norms and dot products over every axis but the "
          "batch axis.", batch_norm=True)
_apg_trap("APG norm threshold ignored",
          "With r > 0, rescale each sample's Δ to norm at most r first: Δ·min(1, r/‖Δ‖).", no_rescale=True)
_apg_trap("η applied to the orthogonal part",
          "η damps the PARALLEL part: update = Δ⊥ + η·Δ∥ (η = 0 drops it, η = 1 is plain CFG's Δ).",
          eta_on="orthogonal")
_apg_trap("APG applied at s = 1 (the guider switches itself off there)",
          "AdaptiveProjectedGuidance treats guidance_scale ≈ 1 as 'no guidance' and returns pred_cond as it is "
          "(math.isclose(s, 1.0)); the formula would still move it by the clamped, η-damped Δ.", off_at_one=False)
_apg_trap("guided from the conditional prediction",
          "Guidance starts from the unconditional prediction: pred = u + s·update (diffusers' default formulation).",
          start="cond")


# ---- cfg_zero_star ----------------------------------------------------------------------------------
cfg_zero_star = Kata(
    "cfg_zero_star",
    hints=(
        "Two changes to CFG: the first zero_init_steps steps return zeros; afterwards u is first rescaled by "
        "the α that best fits it to c, one α per sample, and CFG is done from α·u.",
        "step < zero_init_steps → 0;  α_b = ⟨c_b, u_b⟩/(‖u_b‖² + 1e-8) over each sample's elements;  "
        "pred = α·u + s·(c − α·u).",
        "if step < zero_init_steps: return torch.zeros_like(c); cf, uf = c.double().flatten(1), u.double().flatten(1); "
        "a = (cf * uf).sum(1, keepdim=True) / ((uf * uf).sum(1, keepdim=True) + 1e-8); "
        "return (a * uf + s * (cf - a * uf)).reshape(c.shape).to(c.dtype)",
    ),
    answer_key=(f"{ZERO_STAR}.cfg_zero_star_scale", f"{ZERO_STAR}.ClassifierFreeZeroStarGuidance.forward"),
)

ZERO_STAR_CASES = [
    dict(shape=(3, 4, 8, 8), dtype="float32", guidance_scale=5.0, step=3, zero_init_steps=1),
    dict(shape=(2, 16, 4, 4), dtype="float32", guidance_scale=3.5, step=1, zero_init_steps=0),
    dict(shape=(4, 4, 8, 8), dtype="float16", guidance_scale=7.0, step=2, zero_init_steps=2),
    dict(shape=(2, 4, 8, 8), dtype="float32", guidance_scale=4.0, step=0, zero_init_steps=1),  # zero-init
    dict(shape=(1, 4, 16, 16), dtype="float16", guidance_scale=2.5, step=1, zero_init_steps=2),  # zero-init
]


def _zero_star_predictions(case, g):
    """u, and c ≈ a different multiple of u per sample plus noise (α differs clearly between samples)."""
    dtype, b = DTYPES[case["dtype"]], case["shape"][0]
    u = torch.randn(case["shape"], generator=g)
    scale = torch.linspace(0.3, 1.5, b).reshape(-1, *([1] * (len(case["shape"]) - 1)))
    c = scale * u + 0.5 * torch.randn(case["shape"], generator=g)
    return c.to(dtype), u.to(dtype)


def _zero_star(c, u, s, step, zero_init_steps, *, per_batch=False, norm_of="uncond", skip_zero=False,
               no_alpha=False, alpha_on="uncond", zero_through=False, base_unscaled=False):
    if (step <= zero_init_steps if zero_through else step < zero_init_steps) and not skip_zero:
        return torch.zeros_like(c)
    # diffusers' dtype flow: α in float32 (float64 for the shadow), cast to the predictions' dtype, the rest there.
    wide = torch.float64 if c.dtype == torch.float64 else torch.float32
    cf, uf = (c.to(wide).flatten(0 if per_batch else 1), u.to(wide).flatten(0 if per_batch else 1))
    ref = uf if norm_of == "uncond" else cf
    alpha = ((cf * uf).sum(-1, keepdim=True) / ((ref * ref).sum(-1, keepdim=True) + 1e-8)).to(c.dtype)
    if no_alpha:
        alpha = torch.ones_like(alpha)
    cf, uf = c.flatten(1), u.flatten(1)
    if base_unscaled:
        pred = uf + s * (cf - alpha * uf)
    elif alpha_on == "cond":
        pred = uf + s * (alpha * cf - uf)
    else:
        pred = alpha * uf + s * (cf - alpha * uf)
    return pred.reshape(c.shape)


@cfg_zero_star.check("vs ClassifierFreeZeroStarGuidance.forward", cases=ZERO_STAR_CASES, tol=STEP_MATH)
def _(case, g):
    c, u = _zero_star_predictions(case, g)
    with quiet_diffusers():
        guider = ClassifierFreeZeroStarGuidance(guidance_scale=case["guidance_scale"],
                                                zero_init_steps=case["zero_init_steps"])
    guider.set_state(step=case["step"], num_inference_steps=10, timestep=torch.tensor(999))
    expected = guider.forward(c.clone(), u.clone()).pred
    exact = _zero_star(c.double(), u.double(), case["guidance_scale"], case["step"], case["zero_init_steps"])
    return Scenario(inputs=dict(pred_cond=c, pred_uncond=u, guidance_scale=case["guidance_scale"], step=case["step"],
                                zero_init_steps=case["zero_init_steps"]),
                    expected=expected, exact=exact,
                    label=f"{tuple(case['shape'])} {case['dtype']}, s={case['guidance_scale']}, step {case['step']}, "
                          f"zero_init_steps={case['zero_init_steps']}")


def _zero_star_trap(name, hint, **bug):
    @cfg_zero_star.trap(name, hint=hint)
    def _(pred_cond, pred_uncond, guidance_scale, step, zero_init_steps=1):
        return _zero_star(pred_cond, pred_uncond, guidance_scale, step, zero_init_steps, **bug)


_zero_star_trap("CFG-Zero* scale computed per batch instead of per sample",
                "α is one number per sample: sum ⟨c, u⟩ and ‖u‖² over each sample's own elements (flatten(1)), "
                "shape (B, 1, 1, 1).", per_batch=True)
_zero_star_trap("α = ⟨c, u⟩/‖c‖² (the wrong norm)",
                "α is the least-squares fit of u to c: argmin_α ‖c − α·u‖² = ⟨c, u⟩/‖u‖², ‖u‖² below.",
                norm_of="cond")
_zero_star_trap("zero-init ignored (guided at the first steps)",
                "While step < zero_init_steps CFG-Zero* returns zeros: the first velocity is skipped.", skip_zero=True)
_zero_star_trap("plain CFG (α never applied)",
                "Rescale the unconditional prediction first: pred = α·u + s·(c − α·u), α per sample.", no_alpha=True)
_zero_star_trap("zero-init one step too long (step ≤ zero_init_steps)",
                "zero_init_steps counts the steps that are zeroed: steps 0 … zero_init_steps − 1 (step < "
                "zero_init_steps).", zero_through=True)
_zero_star_trap("the base term u, not α·u (u + s·(c − α·u))",
                "CFG-Zero* starts from the rescaled unconditional prediction: α·u + s·(c − α·u).", base_unscaled=True)
_zero_star_trap("α applied to the conditional prediction",
                "α rescales u, the prediction CFG starts from: α·u + s·(c − α·u).", alpha_on="cond")


# ---- flux_velocity ----------------------------------------------------------------------------------
flux_velocity = Kata(
    "flux_velocity",
    hints=(
        "A guidance-distilled Flux learned guidance as an input: one transformer call with the scale embedded, no "
        "unconditional branch. Only true CFG (true_cfg_scale > 1 with a negative prompt) pays a second call.",
        "guidance = full([B], s) if transformer.config.guidance_embeds else None; t = timestep.expand(B) / 1000; "
        "v = transformer(hidden_states=latents, timestep=t, guidance=guidance, …)[0]; true CFG: v_u from the "
        "negative prompt, v = v_u + s_true·(v − v_u).",
        "g = torch.full([1], guidance_scale).expand(B) if transformer.config.guidance_embeds else None; "
        "t = timestep.expand(B).to(latents.dtype) / 1000; call = lambda e, p: transformer(hidden_states=latents, "
        "timestep=t, guidance=g, pooled_projections=p, encoder_hidden_states=e, txt_ids=text_ids, "
        "img_ids=latent_image_ids, return_dict=False)[0]; v = call(prompt_embeds, pooled_prompt_embeds); "
        "if true_cfg_scale > 1 and negatives: u = call(negatives…); v = u + true_cfg_scale * (v - u)",
    ),
    no_answer_key="FluxPipeline computes this inline in __call__ (no callable to lock); the transformer itself is "
                  "what the learner calls",
)

FLUX_CASES = [
    dict(guidance_embeds=True, guidance_scale=3.5, true_cfg_scale=1.0, negative=True, batch=1, size=8, text=5),  # dev
    dict(guidance_embeds=True, guidance_scale=2.0, true_cfg_scale=2.5, negative=True, batch=2, size=8, text=7),
    dict(guidance_embeds=False, guidance_scale=3.5, true_cfg_scale=1.5, negative=True, batch=1, size=12, text=5),
    dict(guidance_embeds=True, guidance_scale=4.0, true_cfg_scale=3.0, negative=False, batch=1, size=8, text=7),
    # float16 latents under true CFG: the guided velocity stays in the latents' dtype
    dict(guidance_embeds=True, guidance_scale=2.0, true_cfg_scale=2.5, negative=True, batch=1, size=8, text=5,
         dtype="float16"),
]


def _flux_run(case, g):
    """A FluxPipeline run (4 steps) recording, per step, the transformer's first call and scheduler.step's input."""
    import functools

    pipe = tiny.flux_pipeline(case["guidance_embeds"])
    dtype = DTYPES[case.get("dtype", "float32")]
    with quiet_diffusers():  # "modules that should be kept in float32: []": none here
        pipe.transformer.to(dtype)
    B = case["batch"]
    L = case["text"]
    prompt = (torch.randn(B, L, 16, generator=g).to(dtype), torch.randn(B, 8, generator=g).to(dtype))
    negative = ((torch.randn(B, L, 16, generator=g).to(dtype), torch.randn(B, 8, generator=g).to(dtype))
                if case["negative"] else (None, None))
    calls, steps = [], []
    step = pipe.scheduler.step

    @functools.wraps(step)
    def recording(model_output, timestep, sample, *args, **kwargs):
        steps.append(dict(noise_pred=model_output.clone(), t=timestep.clone(), latents=sample.clone()))
        return step(model_output, timestep, sample, *args, **kwargs)

    pipe.scheduler.step = recording
    hook = pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append({k: v for k, v in kwargs.items()}), with_kwargs=True)
    outputs = pipe.transformer.register_forward_hook(
        lambda module, args, kwargs, out: calls[-1].update(output=out[0].clone()), with_kwargs=True)
    with torch.no_grad():
        pipe(prompt_embeds=prompt[0], pooled_prompt_embeds=prompt[1], negative_prompt_embeds=negative[0],
             negative_pooled_prompt_embeds=negative[1], guidance_scale=case["guidance_scale"],
             true_cfg_scale=case["true_cfg_scale"], num_inference_steps=4, height=case["size"] * 2,
             width=case["size"] * 2, output_type="latent", generator=torch.Generator().manual_seed(seed_from(g)))
    hook.remove()
    outputs.remove()
    del pipe.scheduler.step
    return pipe, prompt, negative, calls, steps


@flux_velocity.check("vs FluxPipeline's noise_pred at a step (distilled guidance, true CFG)", cases=FLUX_CASES,
                     tol=MODEL_FORWARD)
def _(case, g):
    pipe, prompt, negative, calls, steps = _flux_run(case, g)
    k = int(torch.randint(0, len(steps), (), generator=g))
    first = calls[len(calls) // len(steps) * k]
    inputs = dict(transformer=DenoiserProbe(pipe.transformer, label="FluxTransformer2DModel (tiny; calls counted)"),
                  latents=steps[k]["latents"], timestep=steps[k]["t"], prompt_embeds=prompt[0],
                  pooled_prompt_embeds=prompt[1], text_ids=first["txt_ids"], latent_image_ids=first["img_ids"],
                  guidance_scale=case["guidance_scale"], true_cfg_scale=case["true_cfg_scale"],
                  negative_prompt_embeds=negative[0], negative_pooled_prompt_embeds=negative[1])
    per_step = len(calls) // len(steps)
    # the float64 shadow: the transformer's own outputs at this step, guided in float64
    v = [c["output"].double() for c in calls[per_step * k:per_step * (k + 1)]]
    exact = v[1] + case["true_cfg_scale"] * (v[0] - v[1]) if per_step == 2 else v[0]
    return Scenario(inputs=inputs, expected=steps[k]["noise_pred"], exact=exact,
                    label=f"step {k + 1}/4, t = {float(steps[k]['t']):.1f}; guidance "
                          + ("embedded" if case["guidance_embeds"] else "not embedded (no guidance_embeds)")
                          + f"; the pipeline called the transformer {per_step}× a step")


def _flux(transformer, latents, timestep, prompt_embeds, pooled_prompt_embeds, text_ids, latent_image_ids,
          guidance_scale=3.5, true_cfg_scale=1.0, negative_prompt_embeds=None, negative_pooled_prompt_embeds=None, *,
          guidance_times=1.0, t_scale=1000.0, swap=False, from_cond=False):
    B = latents.shape[0]
    guidance = (torch.full([B], guidance_scale * guidance_times) if transformer.config.guidance_embeds else None)
    t = timestep.expand(B).to(latents.dtype) / t_scale

    def call(embeds, pooled):
        return transformer(hidden_states=latents, timestep=t, guidance=guidance, pooled_projections=pooled,
                           encoder_hidden_states=embeds, txt_ids=text_ids, img_ids=latent_image_ids,
                           return_dict=False)[0]

    with torch.no_grad():
        v = call(prompt_embeds, pooled_prompt_embeds)
        if true_cfg_scale > 1 and negative_prompt_embeds is not None:
            u = call(negative_prompt_embeds, negative_pooled_prompt_embeds)
            v = v + true_cfg_scale * (u - v) if swap else v + true_cfg_scale * (v - u) if from_cond else \
                u + true_cfg_scale * (v - u)
    return v


@flux_velocity.trap("guidance multiplied by 1000 before the call (the transformer scales it itself)",
                    hint="FluxPipeline passes guidance = full([B], guidance_scale); FluxTransformer2DModel multiplies "
                         "it by 1000 inside, as it does the timestep.")
def _(**kw):
    return _flux(**kw, guidance_times=1000.0)


@flux_velocity.trap("guidance divided by 1000 like the timestep (the transformer multiplies it back)",
                    hint="FluxPipeline passes guidance = full([B], guidance_scale) as it is; the transformer "
                         "multiplies both the timestep and the guidance by 1000, but only the timestep arrives "
                         "divided (t/1000).")
def _(**kw):
    return _flux(**kw, guidance_times=0.001)


@flux_velocity.trap("the timestep passed as t (0 … 1000), not t/1000",
                    hint="The scheduler's timesteps run 0 … 1000; the transformer takes t/1000 and multiplies it back "
                         "by 1000 inside its time embedding.")
def _(**kw):
    return _flux(**kw, t_scale=1.0)


@flux_velocity.trap("true CFG with its branches swapped: v_c + s·(v_u − v_c)",
                    hint="True CFG starts from the negative prompt's velocity: v_u + true_cfg_scale·(v_c − v_u).")
def _(**kw):
    return _flux(**kw, swap=True)


@flux_velocity.trap("true CFG guided from the conditional velocity: v_c + s·(v_c − v_u)",
                    hint="True CFG starts from the negative prompt's velocity: v_u + true_cfg_scale·(v_c − v_u) "
                         "(at s = 1 that is v_c).")
def _(**kw):
    return _flux(**kw, from_cond=True)


@flux_velocity.budget("one transformer call a step (two only for true CFG)")
def _(learner, g):
    measurements = []
    for case, what, trap in (
            (FLUX_CASES[0], "transformer calls for one step of Flux-dev (guidance 3.5; true_cfg_scale 1, a negative "
                            "prompt given)",
             ("true CFG run at true_cfg_scale = 1 (a second call for the same velocity)",
              "v_u + 1·(v_c − v_u) = v_c: at a scale of 1 the unconditional call changes nothing, so FluxPipeline "
              "runs it only when true_cfg_scale > 1.")),
            (FLUX_CASES[1], "transformer calls for one step with true CFG 2.5", None)):
        pipe, prompt, negative, calls, steps = _flux_run(case, g)
        probe = DenoiserProbe(pipe.transformer)
        learner(transformer=probe, latents=steps[0]["latents"], timestep=steps[0]["t"], prompt_embeds=prompt[0],
                pooled_prompt_embeds=prompt[1], text_ids=calls[0]["txt_ids"], latent_image_ids=calls[0]["img_ids"],
                guidance_scale=case["guidance_scale"], true_cfg_scale=case["true_cfg_scale"],
                negative_prompt_embeds=negative[0], negative_pooled_prompt_embeds=negative[1])
        allowed = len(calls) // len(steps)
        measurements.append(Measurement(what, probe.calls, allowed, "calls",
                                        "distilled guidance is an input of the one call; only true CFG pays a second",
                                        trap=trap if probe.calls == allowed + 1 else None))
    return measurements
