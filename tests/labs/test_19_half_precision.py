"""Lab 19: wrong-but-plausible precision choices fail, and the commonest ones are named."""
import importlib.util
from pathlib import Path

import torch

from expect import Fails

LAB = "19_half_precision"
REPO = Path(__file__).resolve().parents[2]


def choice_body(rule="f16 <= bf16") -> str:
    """A body for half_dtype_for with its decision swapped for a wrong one."""
    return f"""
    f16 = max_relative_error(x, torch.float16)
    bf16 = max_relative_error(x, torch.bfloat16)
    m = float(x.abs().max())
    return "float16" if {rule} else "bfloat16"
    """


def decode_body(up="vae.dtype == torch.float16 and vae.config.force_upcast", vae_to="vae.to(dtype=torch.float32)",
                lat="latents = latents.to(torch.float32)", scaled="latents / vae.config.scaling_factor",
                out="image") -> str:
    """A body for decode_latents with one line swapped for a wrong one."""
    return f"""
    up = {up}
    if up:
        {vae_to}
        {lat}
    with torch.no_grad():
        image = vae.decode({scaled}).sample
    if up:
        vae.to(dtype=torch.float16)
    return {out}
    """


def quantize_body(round_="s.sign() * (a.floor() + (2 * (a - a.floor())).floor())", block="32",
                  inv="torch.where(d == 0, torch.zeros_like(d), 1 / d)") -> str:
    """A body for quantize_q8_0 with one line swapped for a wrong one."""
    return f"""
    b = x.reshape(-1, {block})
    d = b.abs().amax(dim=1, keepdim=True) / 127
    s = b * {inv}
    a = s.abs()
    q = {round_}
    d = d.repeat_interleave({block} // 32, dim=0)
    q = q.reshape(-1, 32)
    return torch.cat([d.to(torch.float16).view(torch.uint8), q.to(torch.int8).view(torch.uint8)], 1).reshape(x.shape[0], -1)
    """


def dequantize_body(q="b[:, 2:].contiguous().view(torch.int8)", d="b[:, :2].contiguous().view(torch.float16)") -> str:
    return f"""
    b = data.reshape(-1, 34)
    return ({d} * {q}).reshape(data.shape[0], -1)
    """


MUTANTS = [
    ("quantize_q8_0", quantize_body(round_="s.round()"), "rounded half to even (torch.round)"),
    ("quantize_q8_0", quantize_body(block="x.shape[1]"), "one scale per row instead of per 32-value block"),
    ("quantize_q8_0", quantize_body(inv="torch.where(d == 0, torch.zeros_like(d), 1 / d.half().float())"),
     "divided by the float16-rounded scale"),
    ("quantize_q8_0",  # x + 0.5 floored, ignoring the sign: negative values round toward +inf
     quantize_body(round_="(s + 0.5).floor()"), Fails("wrong", "")),
    ("quantize_q8_0",  # divided by d, not multiplied by ggml's float32 reciprocal
     quantize_body(inv="torch.where(d == 0, torch.zeros_like(d), 1 / d)").replace(
         "s = b * torch.where(d == 0, torch.zeros_like(d), 1 / d)",
         "s = torch.where(d == 0, torch.zeros_like(b), b / d)"), "divided by d (x / d)"),
    ("quantize_q8_0",  # half away from zero as floor(|s| + 0.5), signed: right except just below ½
     quantize_body(round_="s.sign() * (a + 0.5).floor()"), "rounded as floor(|x| + 0.5) in float32"),
    ("quantize_q8_0",  # the scale from 128 (int8's −128 end) instead of 127
     quantize_body(inv="torch.where(d == 0, torch.zeros_like(d), 127 / (128 * d))"), Fails("wrong", "")),
    ("dequantize_q8_0", dequantize_body(q="b[:, 2:].to(torch.float16)"), "the quants read as uint8"),
    ("dequantize_q8_0", dequantize_body(d="b[:, 32:].contiguous().view(torch.float16)", q="b[:, :32].contiguous().view(torch.int8)"),
     "the scale read from the block's last two bytes"),
    ("dequantize_q8_0",  # the scale read as bfloat16 (same two bytes, another format)
     dequantize_body(d="b[:, :2].contiguous().view(torch.bfloat16).half()"), Fails("wrong", "")),
    ("half_dtype_for", choice_body("m <= 65504"), "chosen by range alone (float16 whenever max|x| ≤ 65504)"),
    ("half_dtype_for",  # the lesson's old summary rule, [6e-5, 65504]
     choice_body("((m <= 65504 and float(x.abs()[x != 0].min()) >= 6e-5) if (x != 0).any() else True)"),
     "the range rule of thumb"),
    ("half_dtype_for", choice_body("False"), "always bfloat16 (the wider range is always safer)"),
    ("half_dtype_for",  # a tie (values exact in both dtypes, or zeros) resolved to bfloat16
     choice_body("f16 < bf16"),
     "a tie resolved to bfloat16"),
    ("half_dtype_for", choice_body("True"), "always float16 (more mantissa bits is always better)"),
    ("half_dtype_for",  # blind learners': the mean relative error, and the largest absolute error
     """
     wide, nz = x.double(), x != 0
     errs = []
     for dtype in (torch.float16, torch.bfloat16):
         cast = x.to(dtype).double()
         ok = bool(torch.isfinite(cast).all())
         errs.append(float(((cast - wide).abs()[nz] / wide.abs()[nz]).mean()) if ok and nz.any() else 0.0 if ok
                     else float("inf"))
     return "float16" if errs[0] <= errs[1] else "bfloat16"
     """, "the mean relative error compared, not the largest"),
    ("half_dtype_for",
     """
     errs = []
     for dtype in (torch.float16, torch.bfloat16):
         cast = x.to(dtype).double()
         errs.append(float((cast - x.double()).abs().max()) if torch.isfinite(cast).all() else float("inf"))
     return "float16" if errs[0] <= errs[1] else "bfloat16"
     """, "the largest absolute error compared, not the relative one"),
    ("half_dtype_for",  # float16's range checked, and its smallest *normal* value as the floor, but 0 counted too
     choice_body("m <= 65504 and float(x.abs().min()) >= 6.1e-5"), 'the range rule of thumb'),
    ("decode_latents", decode_body(up="False"), "decoded in float16 although force_upcast is set"),
    ("decode_latents", decode_body(out="image.half() if up else image"),
     "image cast back to float16"),
    ("decode_latents",  # a blind learner's: the division in float16, the quotient upcast
     decode_body(lat="latents = (latents / vae.config.scaling_factor).float()", scaled="latents if up else "
                 "latents / vae.config.scaling_factor"),
     "latents divided by scaling_factor in float16, before the upcast"),
    ("decode_latents", decode_body(scaled="latents"), "latents not divided by scaling_factor"),
    ("decode_latents", decode_body(scaled="latents * vae.config.scaling_factor"),
     "latents multiplied by scaling_factor"),
    ("decode_latents",  # the latents upcast, the VAE left in float16: a dtype mismatch in the first conv
     decode_body(vae_to="pass"), Fails("crash", "")),
    ("decode_latents",  # the VAE upcast, the latents left in float16: the same mismatch the other way
     decode_body(lat="pass"), Fails("crash", "")),
    ("decode_latents",  # the VAE upcast and never put back: right image, a float32 VAE left for the next call
     decode_body().replace("        vae.to(dtype=torch.float16)\n", "        pass\n"),
     "the VAE left in float32 after the decode"),
    ("decode_latents",  # force_upcast ignored: every float16 VAE upcast (the float16-only case shows it)
     decode_body(up="vae.dtype == torch.float16"), "every float16 VAE upcast (force_upcast never read)"),
]

ALTERNATIVES = [
    ("quantize_q8_0", """
     rows, cols = x.shape
     out = torch.empty(rows, cols // 32, 34, dtype=torch.uint8)
     for r in range(rows):
         for k in range(cols // 32):
             block = x[r, 32 * k:32 * (k + 1)]
             d = block.abs().max() / 127
             s = block * (1 / d) if d > 0 else torch.zeros_like(block)
             q = torch.where(s >= 0, 1.0, -1.0) * (s.abs().floor() + (2 * (s.abs() - s.abs().floor())).floor())
             out[r, k, :2] = d.reshape(1).half().view(torch.uint8)
             out[r, k, 2:] = q.to(torch.int8).view(torch.uint8)
     return out.reshape(rows, -1)
     """, "block by block in loops, the sign by torch.where"),
    ("dequantize_q8_0", """
     b = data.reshape(-1, 34)
     d = b[:, :2].contiguous().view(torch.float16).double()
     q = b[:, 2:].contiguous().view(torch.int8).double()
     return (d * q).half().reshape(data.shape[0], -1)
     """, "the product in float64, cast once"),
    ("half_dtype_for",
     """
     if float(x.abs().max()) > 65504:  # 65504 < v < 65520 rounds to 65504: compare the casts to be exact
         if not torch.isfinite(x.to(torch.float16)).all():
             return "bfloat16"
     w = x.double()
     nz = w != 0
     if not nz.any():
         return "float16"
     e16 = ((x.to(torch.float16).double() - w).abs()[nz] / w.abs()[nz]).max()
     eb = ((x.to(torch.bfloat16).double() - w).abs()[nz] / w.abs()[nz]).max()
     return "float16" if e16 <= eb else "bfloat16"
     """,
     "the overflow tested first, the errors measured inline"),
    ("decode_latents", decode_body(vae_to="vae.float()", lat="latents = latents.double().float()",
                                   scaled="latents * (1 / vae.config.scaling_factor)"),
     "vae.float(), and a multiplication by 1/s instead of a division"),
]


def _grader():
    path = REPO / "graders" / f"{LAB}.py"
    spec = importlib.util.spec_from_file_location(f"_test_grader_{LAB}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_overflowing_vae_really_overflows_in_float16_and_not_in_float32():
    grader = _grader()
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 4, 8, 8, generator=g)
    vae = grader.make_vae(overflow=True, force_upcast=True, scaling_factor=0.13025, dtype="float32")
    with torch.no_grad():
        wide = vae.decode(latents / 0.13025).sample
        half = vae.half().decode((latents / 0.13025).half()).sample
    assert torch.isfinite(wide).all() and not torch.isfinite(half).all()


def test_the_reference_decode_leaves_a_float16_vae_in_float16_and_returns_float32():
    grader = _grader()
    vae = grader.make_vae(overflow=True, force_upcast=True, scaling_factor=0.13025, dtype="float16")
    image = grader.reference_decode(vae, torch.randn(1, 4, 8, 8).half())
    assert image.dtype == torch.float32 and vae.dtype == torch.float16 and torch.isfinite(image).all()


def test_the_lesson_numbers_are_torch_finfo_facts():
    f16, bf16 = torch.finfo(torch.float16), torch.finfo(torch.bfloat16)
    assert f16.max == 65504 and f16.eps == 2**-10 and abs(f16.tiny - 6.1e-5) < 1e-6
    assert bf16.eps == 2**-7 and bf16.max > 3.3e38
    assert torch.tensor(65510.0).half().item() == 65504 and torch.tensor(65520.0).half().isinf()


def test_the_cases_vary_what_the_brief_of_this_lab_asks_for():
    # both input dtypes, both answers; float16 and float32 VAEs, force_upcast on and off, both scaling factors, B > 1
    grader = _grader()
    assert {c["dtype"] for c in grader.DTYPE_CASES} == {"float32", "float64"}
    assert {"tiny", "large", "unit", "one_tiny"} <= {c["kind"] for c in grader.DTYPE_CASES}
    cases = grader.UPCAST_CASES + grader.HALF_CASES
    assert {c["dtype"] for c in cases} == {"float16", "float32"}
    assert {c["force_upcast"] for c in cases} == {True, False}
    assert {c["scaling_factor"] for c in cases} == {0.13025, 0.18215}
    assert any(c["batch"] > 1 for c in cases)
    # Q8_0: ties (roundf), a float16-subnormal scale, a zero block, an outlier; several blocks per row
    assert {"ties", "small", "zero_block", "outlier"} <= {c["kind"] for c in grader.Q8_CASES}
    assert any(c["cols"] > 32 for c in grader.Q8_CASES + grader.DEQ_CASES)


def test_q8_0_is_8_5_bits_a_weight_and_the_block_max_maps_to_127():
    import gguf
    import numpy as np

    x = np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32)
    data = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    assert data.shape == (2, 68) and 68 * 8 / 64 == 8.5
    q = data.reshape(-1, 34)[:, 2:].view(np.int8)
    assert (np.abs(q).max(axis=1) == 127).all()
