"""Lab 11: wrong tiled/sliced decodes and attentions fail; correct-but-costly ones are over budget."""
from expect import Fails

LAB = "11_memory"

DIFFUSERS_STYLE_TILED_DECODE = """
    # correct, but like diffusers it keeps every decoded tile alive until the end
    vsf = 2 ** (len(vae.config.block_out_channels) - 1)
    t = tile_latent_size
    stride, e = int(t * (1 - overlap_factor)), int(t * vsf * overlap_factor)
    keep = t * vsf - e
    rows = [[vae.decoder(vae.post_quant_conv(latents[:, :, i:i + t, j:j + t]) if vae.config.use_post_quant_conv
                          else latents[:, :, i:i + t, j:j + t])
             for j in range(0, latents.shape[3], stride)] for i in range(0, latents.shape[2], stride)]
    out_rows = []
    for i, row in enumerate(rows):
        for j in range(len(row)):
            if i > 0:
                row[j] = blend_seam(rows[i - 1][j], row[j], e, 2)
            if j > 0:
                row[j] = blend_seam(row[j - 1], row[j], e, 3)
        out_rows.append(torch.cat([tile[:, :, :keep, :keep] for tile in row], dim=3))
    return torch.cat(out_rows, dim=2)
"""

def solution_block(function: str) -> str:
    """The solution's own body of `function`, for mutants that change one line of it."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "solutions" / f"{LAB}.py").read_text(encoding="utf-8")
    start = text.index("# BEGIN SOLUTION", text.index(f"def {function}("))
    end = text.index("# END SOLUTION", start)
    return "\n".join(text[start:end].splitlines()[1:])


def changed(function: str, old: str, new: str) -> str:
    body = solution_block(function)
    assert old in body, f"{old!r} is not in the solution of {function}"
    return body.replace(old, new)


MUTANTS = [
    ("blend_seam", """
        e = min(first.shape[dim], second.shape[dim], extent)
        out = second.clone()
        for y in range(e):
            w = y / extent  # a blind learner's: the requested extent, not the clamped one
            out.select(dim, y).copy_(first.select(dim, first.shape[dim] - e + y) * (1 - w) + second.select(dim, y) * w)
        return out
     """, "the weights divided by the requested extent"),
    ("blend_seam", """
        e = min(first.shape[dim], second.shape[dim], extent)
        out = second.clone()
        for y in range(e):
            out.select(dim, y).copy_(first.select(dim, first.shape[dim] - e + y) * (y / e) + second.select(dim, y) * (1 - y / e))
        return out
     """, "the weights run the wrong way"),
    ("blend_seam", """
        e = min(first.shape[dim], second.shape[dim], extent)
        out = second.clone()
        for y in range(e):
            out.select(dim, y).copy_(first.select(dim, y) * (1 - y / e) + second.select(dim, y) * (y / e))
        return out
     """, "blended with `first`'s leading edge"),
    ("blend_seam", """
        e = min(first.shape[dim], second.shape[dim], extent)
        out = second.clone()
        for y in range(e):
            w = (y + 1) / e
            out.select(dim, y).copy_(first.select(dim, first.shape[dim] - e + y) * (1 - w) + second.select(dim, y) * w)
        return out
     """, "the weights one slice on: (y + 1)/E"),
    ("blend_seam", """
        e = min(first.shape[dim], second.shape[dim], extent)
        out = second.clone()
        weights = torch.linspace(0, 1, e).tolist()
        for y in range(e):
            w = weights[y]
            out.select(dim, y).copy_(first.select(dim, first.shape[dim] - e + y) * (1 - w) + second.select(dim, y) * w)
        return out
     """, "the weights as linspace(0, 1, E)"),
    ("blend_seam", """
        e = min(first.shape[-1], second.shape[-1], extent)
        out = second.clone()
        for y in range(e):
            w = y / e
            out[..., y] = first[..., first.shape[-1] - e + y] * (1 - w) + second[..., y] * w
        return out
     """, "blended along the last axis whatever `dim` says"),
    ("tiled_decode",  # each tile straight into the decoder
     changed("tiled_decode", "            if vae.config.use_post_quant_conv:\n                tile = vae.post_quant_conv(tile)\n",
             ""), "post_quant_conv skipped"),
    ("sliced_decode",  # the pipeline's unscaling done again inside decode
     changed("sliced_decode", "z = latents[b:b + 1]", "z = latents[b:b + 1] / vae.config.scaling_factor"),
     "the latents divided by scaling_factor first"),
    ("chunked_attention", changed("chunked_attention", "s = 1 / math.sqrt(d) if scale is None else scale",
                                  "s = 1 / d if scale is None else scale"), "the scale 1/d instead of 1/√d"),
    ("chunked_attention", changed("chunked_attention", 'scores.masked_fill(~m, float("-inf"))',
                                  'scores.masked_fill(m, float("-inf"))'), "the bool mask read the other way"),
    ("chunked_attention", changed("chunked_attention", 'scores.masked_fill(~m, float("-inf"))',
                                  "scores + m.to(scores.dtype)"), "the bool mask added to the scores as 0/1"),
    ("chunked_attention",  # a softmax over only −inf left as it is: NaN rows where SDPA gives 0
     changed("chunked_attention", "            weights = weights.masked_fill(~m.any(dim=-1, keepdim=True), 0.0)\n",
             "            pass\n"), "a query whose keys are all masked left as NaN"),
    ("tiled_decode", """
        vsf = 2 ** (len(vae.config.block_out_channels) - 1)
        t = tile_latent_size
        stride, e = int(t * (1 - overlap_factor)), int(t * vsf * overlap_factor)
        keep = t * vsf - e
        rows = [[vae.decoder(vae.post_quant_conv(latents[:, :, i:i + t, j:j + t]) if vae.config.use_post_quant_conv
                          else latents[:, :, i:i + t, j:j + t])
                 for j in range(0, latents.shape[3], stride)] for i in range(0, latents.shape[2], stride)]
        return torch.cat([torch.cat([tile[:, :, :keep, :keep] for tile in row], dim=3) for row in rows], dim=2)
     """, "tiles cropped and placed without blending"),
    ("tiled_decode", """
        # untiled decode: the right shape only when the tiles divide evenly, and never the same values
        return vae.decoder(vae.post_quant_conv(latents) if vae.config.use_post_quant_conv else latents)
     """, "the whole latent decoded at once"),
    ("tiled_decode",  # the output allocated with torch.empty's default dtype: float32 for a float16 VAE
     changed("tiled_decode", "tile.new_empty(B, tile.shape[1], sum(heights), sum(widths))",
             "torch.empty(B, tile.shape[1], sum(heights), sum(widths))"),
     "the output in float32 although the decoder"),
    ("tiled_decode",  # SD's 8 pixels per latent, whatever the VAE: the x4 VAE's tiles cropped and blended wrong
     DIFFUSERS_STYLE_TILED_DECODE.replace("vsf = 2 ** (len(vae.config.block_out_channels) - 1)", "vsf = 8"),
     "the VAE scale factor hard-coded to SD's 8"),
    ("tiled_decode",  # the same in the solution: its output, sized for 8, cannot take the x4 VAE's tiles (a crash,
     # named by the one listed mistake that is right on every x8 case and changes the output's size on the x4 one)
     changed("tiled_decode", "vsf = 2 ** (len(vae.config.block_out_channels) - 1)", "vsf = 8"),
     "the VAE scale factor hard-coded to SD's 8 (your function was right on the"),
    ("chunked_attention",  # the default scale from the value's width: right only when d_v = d
     changed("chunked_attention", "d = query.shape[-1]", "d = value.shape[-1]"),
     "the default scale taken from the value's width"),
    ("chunked_attention",  # the mask cut by query rows without broadcasting it first: a (B, 1, Lk) mask
     changed("chunked_attention", "mask = attn_mask.expand(query.shape[:-2] + (lq, key.shape[-2]))",
             "mask = attn_mask"),
     Fails("crash", "RuntimeError")),
    ("tiled_decode",  # a blind learner's: the left neighbour blended in first
     DIFFUSERS_STYLE_TILED_DECODE.replace("""            if i > 0:
                row[j] = blend_seam(rows[i - 1][j], row[j], e, 2)
            if j > 0:
                row[j] = blend_seam(row[j - 1], row[j], e, 3)""", """            if j > 0:
                row[j] = blend_seam(row[j - 1], row[j], e, 3)
            if i > 0:
                row[j] = blend_seam(rows[i - 1][j], row[j], e, 2)"""),
     "the left seam blended before the one above"),
    ("tiled_decode",  # a blind learner's: E rounded in latents first (differs where t·overlap is fractional)
     DIFFUSERS_STYLE_TILED_DECODE.replace("int(t * vsf * overlap_factor)", "int(t * overlap_factor) * vsf"),
     "the blend extent rounded in latents, then scaled"),
    ("chunked_attention",  # a blind learner's: four dimensions unpacked, which the VAE's (B, L, D) attention has not
     changed("chunked_attention", "d = query.shape[-1]", "_b, _h, _lq, d = query.shape"),
     "four dimensions assumed (B, H, L, D)"),
    ("chunked_attention",  # a blind learner's: a softmax per key chunk, the chunk outputs averaged
     """
     s = query.shape[-1] ** -0.5 if scale is None else scale
     starts = range(0, key.shape[-2], chunk_size)
     out = 0
     for a in starts:
         out = out + (query @ key[..., a:a + chunk_size, :].transpose(-2, -1) * s).softmax(-1) @ value[..., a:a + chunk_size, :]
     return out / len(starts)
     """, "keys chunked, each chunk's softmax on its own, the chunk outputs averaged"),
    ("chunked_attention",  # the mask applied to the weights after the softmax
     """
     s = query.shape[-1] ** -0.5 if scale is None else scale
     w = (query @ key.transpose(-2, -1) * s).softmax(-1)
     if attn_mask is not None:
         w = w * attn_mask if attn_mask.dtype == torch.bool else w + attn_mask
     return w @ value
     """, "the mask applied after the softmax"),
    ("tiled_decode", DIFFUSERS_STYLE_TILED_DECODE.replace("int(t * (1 - overlap_factor))",
                                                          "round(t * (1 - overlap_factor))"), Fails("wrong", "has shape")),
    ("sliced_decode", "return torch.cat([vae.decoder(latents[b:b + 1]) for b in range(latents.shape[0])])",
     "post_quant_conv skipped"),
    ("sliced_decode",  # post_quant_conv whatever the config: a VAE without one (SD3's, Flux's) has it as None
     "return torch.cat([vae.decoder(vae.post_quant_conv(latents[b:b + 1])) for b in range(latents.shape[0])])",
     "post_quant_conv called whatever the config"),
    ("chunked_attention", """
        s = query.shape[-1] ** -0.5 if scale is None else scale
        scores = query @ key.transpose(-2, -1) * s
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
        return scores.softmax(-2) @ value
     """, "softmax over the query axis"),
    ("chunked_attention", """
        scores = query @ key.transpose(-2, -1)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
        return scores.softmax(-1) @ value
     """, "the 1/√d scale is missing"),
    ("chunked_attention", """
        s = query.shape[-1] ** -0.5 if scale is None else scale
        out = 0
        m = None if attn_mask is None else attn_mask.expand(query.shape[:-2] + (query.shape[-2], key.shape[-2]))
        for a in range(0, key.shape[-2], chunk_size):
            sc = query @ key[..., a:a + chunk_size, :].transpose(-2, -1) * s
            if m is not None:
                mm = m[..., a:a + chunk_size]
                sc = sc.masked_fill(~mm, float("-inf")) if mm.dtype == torch.bool else sc + mm
            out = out + sc.softmax(-1).nan_to_num() @ value[..., a:a + chunk_size, :]
        return out
     """, "keys chunked"),
]


def mutant_args(function):
    """Extra pytest arguments for grading one mutant (test_mutants.py)."""
    return ("-m", "not budget")


def test_a_tiled_decode_that_keeps_every_tile_is_correct_but_over_budget(grade_mutant):
    graded = grade_mutant(LAB, "tiled_decode", DIFFUSERS_STYLE_TILED_DECODE)
    assert graded.status == "over budget", graded
    assert "OVER working set (peak minus the output) at 256² px" in graded.text
    assert "FLOPs at 16×16 latents" not in graded.text  # the FLOPs budget passes: the same tiles


def test_decoding_the_whole_batch_at_once_is_correct_but_over_the_slicing_budget(grade_mutant):
    graded = grade_mutant(LAB, "sliced_decode", "return vae.decoder(vae.post_quant_conv(latents) "
                                                "if vae.config.use_post_quant_conv else latents)")
    assert graded.status == "over budget", graded
    assert "OVER peak live bytes, batch of 4 at 128² px" in graded.text


def test_naive_attention_is_correct_but_over_the_chunking_budget(grade_mutant):
    graded = grade_mutant(LAB, "chunked_attention", """
        s = query.shape[-1] ** -0.5 if scale is None else scale
        scores = query @ key.transpose(-2, -1) * s
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
        return scores.softmax(-1).nan_to_num() @ value  # a query with every key masked: 0, as SDPA
    """)
    assert graded.status == "over budget", graded


def test_calling_torch_attention_is_the_answer_key(grade_mutant):
    graded = grade_mutant(LAB, "chunked_attention", """
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)
    """, "-m", "not budget")
    assert graded.status == "failed"
    assert "is the answer key" in graded.text


def test_the_attention_kernel_one_level_down_is_refused_too(grade_mutant):
    for body in ("return torch.ops.aten.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)",
                 "return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, scale=scale)[0]"):
        graded = grade_mutant(LAB, "chunked_attention", body, "-m", "not budget", "-k", "chunked_attention")
        assert graded.status == "failed"
        assert "is the answer key" in graded.text, graded.text


def test_blending_into_the_callers_tile_in_place_fails(grade_mutant):
    graded = grade_mutant(LAB, "blend_seam", """
        e = min(first.shape[dim], second.shape[dim], extent)
        for y in range(e):
            second.select(dim, y).copy_(first.select(dim, first.shape[dim] - e + y) * (1 - y / e) + second.select(dim, y) * (y / e))
        return second
    """, "-m", "not budget")
    assert graded.status == "failed"
    assert "changed its input(s) second in place" in graded.text


def test_a_wrong_tiled_decode_writes_a_difference_image(grade_mutant, pytester):
    unblended = next(body for function, body, expect in MUTANTS if expect == "tiles cropped and placed without blending")
    graded = grade_mutant(LAB, "tiled_decode", unblended, "-m", "not budget")
    assert "difference image" in graded.text
    assert list((pytester.path / ".kata" / "diffs").glob("tiled_decode-*.png"))


# Correct but different (issue 10): the budgets judge the math and the real cost, not the solution's shape.
ROW_STREAMING_TILED_DECODE = """
    # a whole row of tiles decoded and blended, written into the output, then only its bottom strips kept
    vsf = 2 ** (len(vae.config.block_out_channels) - 1)
    t = tile_latent_size
    stride, e = int(t * (1 - overlap_factor)), int(t * vsf * overlap_factor)
    keep = t * vsf - e
    out, above, y0 = None, None, 0
    for i in range(0, latents.shape[2], stride):
        row = []
        for c, j in enumerate(range(0, latents.shape[3], stride)):
            z = latents[:, :, i:i + t, j:j + t]
            tile = vae.decoder(vae.post_quant_conv(z) if vae.config.use_post_quant_conv else z)
            if above is not None:
                tile = blend_seam(above[c], tile, e, 2)
            if row:
                tile = blend_seam(row[-1], tile, e, 3)
            row.append(tile)
        strip = torch.cat([tile[:, :, :keep, :keep] for tile in row], dim=3)
        if out is None:
            height = sum(min(keep, min(t, latents.shape[2] - k) * vsf) for k in range(0, latents.shape[2], stride))
            out = strip.new_empty(strip.shape[:2] + (height, strip.shape[3]))
        out[:, :, y0:y0 + strip.shape[2]] = strip
        y0 += strip.shape[2]
        above = [tile[:, :, -e:, :].clone() if e else tile for tile in row]
    return out
"""

FLOAT64_CHUNKED_ATTENTION = """
    # each chunk computed in float64 (K and V upcast once) and cast once into the output
    s = query.shape[-1] ** -0.5 if scale is None else scale
    lq = query.shape[-2]
    out = query.new_empty(query.shape[:-1] + (value.shape[-1],))
    mask = None if attn_mask is None else attn_mask.expand(query.shape[:-2] + (lq, key.shape[-2]))
    k64, v64 = key.double(), value.double()
    for a in range(0, lq, chunk_size):
        scores = query[..., a:a + chunk_size, :].double() @ k64.transpose(-2, -1) * s
        if mask is not None:
            m = mask[..., a:a + chunk_size, :]
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.double()
        out[..., a:a + chunk_size, :] = (scores.softmax(-1).nan_to_num() @ v64).to(out.dtype)  # no key left: 0
    return out
"""


def test_a_tiled_decode_that_streams_whole_rows_of_tiles_passes_its_checks_and_budgets(grade_mutant):
    # It holds one row of tiles (grows with the image's width, not its area): 1.42x at twice the side.
    graded = grade_mutant(LAB, "tiled_decode", ROW_STREAMING_TILED_DECODE, "-m", "not cuda")
    assert graded.status == "passed", graded.text


def test_a_tiled_decode_that_keeps_its_seam_strips_as_views_passes_its_checks_and_budgets(grade_mutant):
    # A view keeps its whole tile alive: one row of tiles again, never every tile.
    body = changed("tiled_decode", "tile[:, :, -min(extent, tile.shape[2]):, :].clone()",
                   "tile[:, :, -min(extent, tile.shape[2]):, :]")
    body = body.replace("tile[:, :, :, -min(extent, tile.shape[3]):].clone()", "tile[:, :, :, -min(extent, tile.shape[3]):]")
    assert ".clone()" not in body.split("# 4.")[1]
    graded = grade_mutant(LAB, "tiled_decode", body, "-m", "not cuda")
    assert graded.status == "passed", graded.text


def test_a_chunked_attention_computed_in_float64_passes_its_checks_and_budget(grade_mutant):
    graded = grade_mutant(LAB, "chunked_attention", FLOAT64_CHUNKED_ATTENTION, "-m", "not cuda")
    assert graded.status == "passed", graded.text
