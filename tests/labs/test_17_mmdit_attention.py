"""Lab 17: wrong-but-plausible implementations fail, and the commonest ones are named."""
import importlib.util
from pathlib import Path

from expect import Fails

LAB = "17_mmdit_attention"
REPO = Path(__file__).resolve().parents[2]


def joint_body(txt="attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_added_q, attn.norm_added_k",
               norm="q = norm_q(q) if norm_q is not None else q\n        k = norm_k(k) if norm_k is not None else k",
               order="(q, q2), (k, k2), (v, v2)", split="o[:, :n], o[:, n:]",
               text_out="attn.to_add_out(text) if not attn.context_pre_only else text",
               attend="merge_heads(F.scaled_dot_product_attention(query, key, value))") -> str:
    """A body for joint_attention with one line swapped for a wrong one."""
    return f"""
    n, heads = hidden_states.shape[1], attn.heads

    def qkv(x, to_q, to_k, to_v, norm_q, norm_k):
        q, k, v = (split_heads(layer(x), heads) for layer in (to_q, to_k, to_v))
        {norm}
        return q, k, v

    q, k, v = qkv(hidden_states, attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k)
    q2, k2, v2 = qkv(encoder_hidden_states, {txt})
    query, key, value = (torch.cat(pair, dim=2) for pair in ({order}))
    o = {attend}
    image, text = {split}
    return attn.to_out[0](image), {text_out}
    """


def ids_body(text="torch.zeros(text_len, 3)", grid="torch.stack([torch.zeros_like(r), r, c], -1)",
             out="torch.cat([text, image])") -> str:
    """A body for flux_position_ids with one line swapped for a wrong one."""
    return f"""
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    image = {grid}.reshape(rows * cols, 3).float()
    text = {text}
    return {out}
    """


def rope_body(omega="1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)",
              rep="a.cos().repeat_interleave(2, 1), a.sin().repeat_interleave(2, 1)",
              out="torch.cat(cos, -1).float(), torch.cat(sin, -1).float()") -> str:
    """A body for rope_cos_sin with one line swapped for a wrong one."""
    return f"""
    cos, sin = [], []
    for i, d in enumerate(axes_dim):
        w = {omega}
        a = ids[:, i].double()[:, None] * w[None]
        co, si = {rep}
        cos.append(co)
        sin.append(si)
    return {out}
    """


def rotary_body(pairs="x.float().unflatten(-1, (-1, 2)).unbind(-1)",
                rotated="torch.stack([-b, a], dim=-1).flatten(-2)", combine="x.float() * cos + r * sin",
                attend="rot(query), rot(key), value") -> str:
    """A body for rotary_attention with one line swapped for a wrong one."""
    return f"""
    def rot(x):
        a, b = {pairs}
        r = {rotated}
        return ({combine}).to(x.dtype)

    return F.scaled_dot_product_attention({attend})
    """


def apg_body(diff="pred_cond.double() - pred_uncond.double()", dims="list(range(1, pred_cond.dim()))",
             clamp="torch.clamp(norm_threshold / torch.linalg.vector_norm(d, dim=dims, keepdim=True), max=1.0)",
             onto="pred_cond.double()", update="orth + eta * par", start="pred_uncond.double()",
             cast=".to(pred_cond.dtype)", off="abs(guidance_scale - 1.0) < 1e-9") -> str:
    """A body for apg_guidance with one line swapped for a wrong one."""
    return f"""
    if {off}:
        return pred_cond
    dims = {dims}
    d = {diff}
    if norm_threshold > 0:
        d = d * {clamp}
    unit = F.normalize({onto}, dim=dims)
    par = (d * unit).sum(dim=dims, keepdim=True) * unit
    orth = d - par
    return ({start} + guidance_scale * ({update})){cast}
    """


def zero_star_body(zero="step < zero_init_steps", flat="1", denom="(u * u).sum(-1, keepdim=True) + 1e-8",
                   pred="alpha * u + guidance_scale * (c - alpha * u)", cast=".to(pred_cond.dtype)") -> str:
    """A body for cfg_zero_star with one line swapped for a wrong one."""
    return f"""
    if {zero}:
        return torch.zeros_like(pred_cond)
    c, u = pred_cond.double().flatten({flat}), pred_uncond.double().flatten({flat})
    alpha = (c * u).sum(-1, keepdim=True) / ({denom})
    pred = {pred}
    return pred.reshape(pred_cond.shape){cast}
    """


def flux_body(g="torch.full([1], guidance_scale).expand(B)", t="timestep.expand(B).to(latents.dtype) / 1000",
              combine="u + true_cfg_scale * (v - u)", second="true_cfg_scale > 1 and negative_prompt_embeds is not None") -> str:
    """A body for flux_velocity with one line swapped for a wrong one."""
    return f"""
    B = latents.shape[0]
    guidance = {g} if transformer.config.guidance_embeds else None
    t = {t}
    def call(e, p):
        return transformer(hidden_states=latents, timestep=t, guidance=guidance, pooled_projections=p,
                           encoder_hidden_states=e, txt_ids=text_ids, img_ids=latent_image_ids, return_dict=False)[0]
    with torch.no_grad():
        v = call(prompt_embeds, pooled_prompt_embeds)
        if {second}:
            u = call(negative_prompt_embeds, negative_pooled_prompt_embeds)
            v = {combine}
    return v
    """


MUTANTS = [
    ("joint_attention", joint_body(attend="merge_heads(F.scaled_dot_product_attention(query, key, value, "
                                          "scale=1 / query.shape[-1]))"), "the scores scaled by 1/d"),
    ("flux_position_ids",  # a blind learner's: meshgrid indexing='xy'
     """
     r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="xy")
     img = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3).float()
     return torch.cat([torch.zeros(text_len, 3), img])
     """, "tokens enumerated column by column"),
    ("joint_attention", joint_body(txt="attn.to_q, attn.to_k, attn.to_v, attn.norm_added_q, attn.norm_added_k"),
     "the text projected with the image's to_q / to_k / to_v"),
    ("joint_attention", joint_body(text_out="text"), "to_add_out skipped"),
    ("joint_attention",  # a blind learner's: the image first in the concatenation, the text first in the split
     joint_body(split="o[:, o.shape[1] - n:], o[:, :o.shape[1] - n]"), "concatenated [image, text] but split as [text, image]"),
    ("joint_attention", joint_body(txt="attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_q, attn.norm_k"),
     "the image's qk-norm (norm_q / norm_k) applied to the text"),
    ("flux_position_ids", ids_body().replace("torch.arange(rows), torch.arange(cols)",
                                             "torch.arange(1, rows + 1), torch.arange(1, cols + 1)"),
     "rows and columns counted from 1"),
    ("rope_cos_sin", rope_body(omega="1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / sum(axes_dim))"),
     "each axis's frequencies over the whole width"),
    ("cfg_zero_star", zero_star_body(zero="step <= zero_init_steps"), "zero-init one step too long"),
    ("cfg_zero_star", zero_star_body(pred="u + guidance_scale * (c - alpha * u)"), "the base term u, not α·u"),
    ("flux_velocity", flux_body(combine="v + true_cfg_scale * (v - u)"), "true CFG guided from the conditional velocity"),
    ("flux_velocity", flux_body(g="torch.full([1], guidance_scale * 1000).expand(B)"), "guidance multiplied by 1000"),
    ("flux_velocity", flux_body(t="timestep.expand(B).to(latents.dtype)"), "the timestep passed as t (0 … 1000)"),
    ("flux_velocity", flux_body(combine="v + true_cfg_scale * (u - v)"), "true CFG with its branches swapped"),
    ("flux_velocity", flux_body(g="torch.full([1], guidance_scale / 1000).expand(B)"),
     "guidance divided by 1000 like the timestep"),
    ("joint_attention",  # a blind learner's: 1/√(H·d)
     joint_body(attend="merge_heads(F.scaled_dot_product_attention(query, key, value, "
                       "scale=(heads * query.shape[-1]) ** -0.5))"),
     "the scores scaled by 1/√(heads·d)"),
    ("flux_velocity",  # a blind learner's: the guided velocity combined in float32, never cast back
     flux_body(combine="u.float() + true_cfg_scale * (v.float() - u.float())"),
     "computed in float32 and never cast back to float16"),

    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("joint_attention", joint_body(txt="attn.to_q, attn.to_k, attn.to_v, attn.norm_q, attn.norm_k",
                                   text_out="attn.to_out[0](text)"), "one projection shared by text and image tokens"),
    ("joint_attention", joint_body(order="(q2, q), (k2, k), (v2, v)"), "concatenated [text, image] but split as"),
    ("joint_attention",
     joint_body(attend="torch.cat([merge_heads(F.scaled_dot_product_attention(q, k, v)), "
                       "merge_heads(F.scaled_dot_product_attention(q2, k2, v2))], 1)"),
     "two separate attentions"),
    ("joint_attention", joint_body(text_out="attn.to_out[0](text)"), "text output through the image's to_out"),
    ("joint_attention", joint_body(norm="pass"), "qk-norm skipped"),
    ("joint_attention",  # a blind learner's: the image's qk-norm applied, the text's forgotten
     joint_body(txt="attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, None, None"), "the text's qk-norm skipped"),
    ("rope_cos_sin",  # a blind learner's: the exponents spread over [0, 1]
     rope_body(omega="1.0 / theta ** torch.linspace(0, 1, d // 2, dtype=torch.float64)"),
     "exponents linspace(0, 1, d/2)"),
    ("joint_attention",  # the text's own projections, but the image's qk-norm on them
     joint_body(txt="attn.add_q_proj, attn.add_k_proj, attn.add_v_proj, attn.norm_q, attn.norm_k"),
     Fails("wrong", "values differ")),
    ("joint_attention",  # softmax without the 1/√d scale
     joint_body(attend="merge_heads(F.scaled_dot_product_attention(query, key, value, scale=1.0))"),
     Fails("wrong", "values differ")),
    ("joint_attention",  # the text's output projection forgotten (context_pre_only read backwards)
     joint_body(text_out="text if not attn.context_pre_only else text"), Fails("wrong", "values differ")),
    ("flux_position_ids", ids_body(grid="torch.stack([torch.zeros_like(r), c, r], -1)"), "position ids from (col, row)"),
    ("flux_position_ids", ids_body(text="torch.stack([torch.zeros(text_len), torch.arange(text_len).float(), "
                                        "torch.zeros(text_len)], -1)"), "text tokens numbered 0, 1, 2"),
    ("flux_position_ids", ids_body(out="torch.cat([image, text])"), "image ids before the text ids"),
    ("flux_position_ids", ids_body(grid="torch.stack([r, c, torch.zeros_like(r)], -1)"), "ids (row, col, 0)"),
    ("flux_position_ids",  # the grid counted from 1
     ids_body(grid="torch.stack([torch.zeros_like(r), r + 1, c + 1], -1)"), Fails("wrong", "values differ")),
    ("flux_position_ids",  # int64 ids
     ids_body(out="torch.cat([text, image]).long()"), Fails("wrong", "has dtype")),
    ("rope_cos_sin", rope_body(rep="torch.cat([a.cos(), a.cos()], 1), torch.cat([a.sin(), a.sin()], 1)"),
     "cos/sin repeated as halves"),
    ("rope_cos_sin", rope_body(omega="1.0 / theta ** (torch.arange(0, d // 2, dtype=torch.float64) / d)"),
     "frequencies θ^(−j/d)"),
    ("rope_cos_sin", rope_body(rep="a.sin().repeat_interleave(2, 1), a.cos().repeat_interleave(2, 1)"),
     "cos and sin swapped"),
    ("rope_cos_sin",  # ω = θ^(+2j/d): frequencies growing instead of decaying
     rope_body(omega="theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)"), Fails("wrong", "values differ")),
    ("rope_cos_sin",  # one table over the whole width, read at the first axis only
     rope_body(omega="1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)\n        i = 0"),
     Fails("wrong", "values differ")),
    ("rope_cos_sin",  # float64 tables out
     rope_body(out="torch.cat(cos, -1), torch.cat(sin, -1)"), Fails("wrong", "has dtype")),
    ("rotary_attention", rotary_body(attend="rot(query), rot(key), rot(value)"), "rotary applied to v too"),
    ("rotary_attention", rotary_body(pairs="x.float().chunk(2, dim=-1)", rotated="torch.cat([-b, a], dim=-1)"),
     "rotary pairs taken as halves"),
    ("rotary_attention", rotary_body(attend="rot(query), key, value"), "only q rotated"),
    ("rotary_attention", rotary_body(combine="x.float() * cos - r * sin"), "rotated the wrong way"),
    ("rotary_attention",  # the pair's coordinates swapped without the sign: (b, a)
     rotary_body(rotated="torch.stack([b, a], dim=-1).flatten(-2)"), Fails("wrong", "values differ")),
    ("rotary_attention",  # no rotation at all
     rotary_body(attend="query, key, value"), Fails("wrong", "values differ")),
    ("apg_guidance", apg_body(onto="pred_uncond.double()"), "APG projection onto the unconditional prediction"),
    ("apg_guidance", apg_body(onto="d"), "APG projection onto the difference itself"),
    ("apg_guidance", apg_body(dims="list(range(0, pred_cond.dim()))"), "APG norms over the whole batch"),
    ("apg_guidance", apg_body(clamp="1.0"), "APG norm threshold ignored"),
    ("apg_guidance", apg_body(update="eta * orth + par"), "η applied to the orthogonal part"),
    ("apg_guidance", apg_body(start="pred_cond.double()"), "guided from the conditional prediction"),
    ("apg_guidance", apg_body(off="False"), "APG applied at s = 1 (the guider switches itself off there)"),
    ("apg_guidance",  # the clamp as a scale (always r/‖Δ‖, never min(1, ·))
     apg_body(clamp="norm_threshold / torch.linalg.vector_norm(d, dim=dims, keepdim=True)"),
     Fails("wrong", "values differ")),
    ("apg_guidance",  # float64 out
     apg_body(cast=""), Fails("wrong", "has dtype")),
    ("cfg_zero_star", zero_star_body(flat="0"), "CFG-Zero* scale computed per batch instead of per sample"),
    ("cfg_zero_star", zero_star_body(denom="(c * c).sum(-1, keepdim=True) + 1e-8"), "α = ⟨c, u⟩/‖c‖²"),
    ("cfg_zero_star", zero_star_body(zero="False"), "zero-init ignored"),
    ("cfg_zero_star", zero_star_body(pred="u + guidance_scale * (c - u)"), "plain CFG (α never applied)"),
    ("cfg_zero_star", zero_star_body(pred="u + guidance_scale * (alpha * c - u)"), "α applied to the conditional"),
    ("cfg_zero_star",  # zero-init off by one (step ≤ zero_init_steps)
     zero_star_body(zero="step <= zero_init_steps"), Fails("wrong", "values differ")),
    ("cfg_zero_star",  # float64 out
     zero_star_body(cast=""), Fails("wrong", "has dtype")),
]


# Right answers written another way: each must pass (see test_mutants.py).
ALTERNATIVES = [
    ("flux_velocity",  # the guided velocity combined in float64, cast back once: closer to exact math
     flux_body(combine="(u.double() + true_cfg_scale * (v.double() - u.double())).to(latents.dtype)"),
     "true CFG combined in float64 and cast back to the latents' dtype once"),
    ("joint_attention",
     joint_body(order="(q2, q), (k2, k), (v2, v)", split="o[:, o.shape[1] - n:], o[:, :o.shape[1] - n]"),
     "text first, split accordingly: attention without positions does not care about the order of its tokens"),
    ("joint_attention",
     joint_body(attend="merge_heads(torch.softmax((query.float() @ key.float().transpose(-1, -2)) "
                       "/ query.shape[-1] ** 0.5, dim=-1) @ value.float()).to(query.dtype)"),
     "attention by hand, softmax in float32 (closer to exact math than float16 SDPA)"),
    ("flux_position_ids",
     """
     ids = torch.zeros(text_len + rows * cols, 3)
     for r in range(rows):
         for c in range(cols):
             ids[text_len + r * cols + c, 1:] = torch.tensor([r, c])
     return ids
     """,
     "a loop over the grid"),
    ("rope_cos_sin",
     rope_body(omega="torch.exp(-torch.arange(0, d, 2, dtype=torch.float32) / d * torch.log(torch.tensor(theta)))",
               rep="a.float().cos().repeat_interleave(2, 1), a.float().sin().repeat_interleave(2, 1)"),
     "ω as exp(−2j/d·ln θ) in float32 (an ulp or two of the angle away)"),
    ("rotary_attention",
     """
     def rot(x):
         z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
         w = torch.polar(torch.ones_like(cos[:, 0::2].double()), torch.atan2(sin[:, 0::2].double(), cos[:, 0::2].double()))
         return torch.view_as_real(z * w).flatten(-2).to(x.dtype)

     return F.scaled_dot_product_attention(rot(query), rot(key), value)
     """,
     "complex multiplication by e^{iθ} (Lumina's form), in float64"),
    ("apg_guidance",
     apg_body(diff="(pred_cond - pred_uncond).float()", onto="pred_cond.float()",
              start="pred_uncond.float()"),
     "float32 throughout instead of diffusers' float64 projection"),
    ("cfg_zero_star",
     """
     if step < zero_init_steps:
         return torch.zeros_like(pred_cond)
     dims = list(range(1, pred_cond.dim()))
     c, u = pred_cond.float(), pred_uncond.float()
     alpha = (c * u).sum(dims, keepdim=True) / ((u ** 2).sum(dims, keepdim=True) + 1e-8)
     return (guidance_scale * c + (1 - guidance_scale) * alpha * u).to(pred_cond.dtype)
     """,
     "float32, sums over the axes, the combination re-associated as s·c + (1 − s)·α·u"),
]


def test_calling_the_processor_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "joint_attention", """
        from diffusers.models.attention_processor import JointAttnProcessor2_0
        return JointAttnProcessor2_0()(attn, hidden_states, encoder_hidden_states)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_calling_apply_rotary_emb_is_refused(grade_mutant):
    graded = grade_mutant(LAB, "rotary_attention", """
        from diffusers.models.embeddings import apply_rotary_emb
        return F.scaled_dot_product_attention(apply_rotary_emb(query, (cos, sin)), apply_rotary_emb(key, (cos, sin)),
                                              value)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


def test_key_order_does_not_matter_to_attention_without_positions_as_the_lesson_says():
    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    perm = torch.randperm(7, generator=g)
    assert torch.allclose(F.scaled_dot_product_attention(q, k, v),
                          F.scaled_dot_product_attention(q, k[:, :, perm], v[:, :, perm]), atol=1e-12)


def _grader():
    path = REPO / "graders" / f"{LAB}.py"
    spec = importlib.util.spec_from_file_location(f"_test_grader_{LAB}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cases_vary_what_the_brief_of_this_lab_asks_for():
    # Batch, token counts and heads vary; qk-norm on and off; context_pre_only both ways; float16 and
    # float32; grids with rows ≠ cols (where (col, row) shows); guidance with several samples.
    grader = _grader()
    joint = grader.JOINT_CASES
    assert {c["context_pre_only"] for c in joint} == {False, True}
    assert {c["qk_norm"] for c in joint} == {None, "rms_norm"}
    assert len({c["heads"] for c in joint}) >= 3 and len({c["batch"] for c in joint}) >= 3
    assert all(c["image_tokens"] != c["text_tokens"] for c in joint), "a wrong split shows only when N ≠ M"
    assert {c["dtype"] for c in joint} == {c["dtype"] for c in grader.ROTARY_CASES} == {"float16", "float32"}
    assert any(c["rows"] != c["cols"] for c in grader.IDS_CASES)
    assert any(c["rows"] != c["cols"] for c in grader.ROTARY_CASES)
    assert all(c["shape"][0] > 1 for c in grader.APG_CASES)
    assert {c["dtype"] for c in grader.APG_CASES} == {c["dtype"] for c in grader.ZERO_STAR_CASES} == {"float16",
                                                                                                      "float32"}
    assert any(c["step"] < c["zero_init_steps"] for c in grader.ZERO_STAR_CASES)
    assert any(c["step"] >= c["zero_init_steps"] > 0 for c in grader.ZERO_STAR_CASES)
    assert any(c["norm_threshold"] == 0 for c in grader.APG_CASES)
