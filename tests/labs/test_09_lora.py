"""Lab 09: wrong-but-plausible LoRA implementations fail, and the commonest ones are named."""
import pytest

from expect import Fails

LAB = "09_lora"

# The right ΔW, for mutants that get something else wrong.
DELTA = """
A, B = lora_A, lora_B
if lora_B.dtype == torch.float16:
    A, B = A.float(), B.float()
d = (B.flatten(1) @ A.flatten(1)).reshape(B.shape[0], *A.shape[1:])
"""

MUTANTS = [
    ("lora_forward",  # a blind learner's: α/r applied twice
     "return F.linear(x, weight, bias) + (scaling / lora_A.shape[0]) * F.linear(F.linear(x, lora_A), lora_B)",
     "the side path divided by r again"),
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("lora_scaling",
     "return (math.sqrt(rank) if use_rslora else rank) / alpha * adapter_weight * lora_scale",
     "r/α: the ratio turned upside down"),
    ("lora_scaling", "return alpha / rank * adapter_weight * lora_scale", "rsLoRA ignored"),
    ("lora_scaling",
     "return (math.sqrt(alpha / rank) if use_rslora else alpha / rank) * adapter_weight * lora_scale",
     "rsLoRA as √(α/r)"),
    ("lora_scaling",
     "return (alpha / math.sqrt(rank) if use_rslora else alpha / rank) * lora_scale",
     "the adapter weight (set_adapters) left out"),
    ("lora_scaling",
     "return (alpha / math.sqrt(rank) if use_rslora else alpha / rank) * adapter_weight",
     "the lora_scale (fuse_lora) left out"),
    ("lora_scaling", "return (alpha / math.sqrt(rank) if use_rslora else alpha // rank) * adapter_weight * lora_scale",
     "α // r: integer division"),
    ("lora_scaling",  # lora_scale applied twice
     "return (alpha / math.sqrt(rank) if use_rslora else alpha / rank) * adapter_weight * lora_scale ** 2",
     Fails("wrong", "expected")),
    ("lora_delta", "return (lora_A @ lora_B) * scaling", "lora_A @ lora_B instead of lora_B @ lora_A"),
    ("lora_delta", DELTA + "return (d.T if fan_in_fan_out else d).to(lora_B.dtype)", "the scaling left out"),
    ("lora_delta", DELTA + "return (d * scaling).to(lora_B.dtype)", "fan_in_fan_out ignored"),
    ("lora_delta",
     DELTA + "d = d.T if lora_A.dim() == 2 and not fan_in_fan_out else d\n"
     "return (d * scaling).to(lora_B.dtype)",
     "transposed although fan_in_fan_out is False"),
    ("lora_delta",
     """
     d = (lora_B.flatten(1) @ lora_A.flatten(1)).reshape(lora_B.shape[0], *lora_A.shape[1:])
     return (d.T if fan_in_fan_out else d) * scaling
     """,
     "B @ A multiplied in float16"),
    ("lora_delta",  # conv ΔW left flat: (out, in·kh·kw)
     DELTA.replace(".reshape(B.shape[0], *A.shape[1:])", "")
     + "return ((d.T if fan_in_fan_out else d) * scaling).to(lora_B.dtype)",
     Fails("wrong", "has shape")),
    ("lora_delta",  # a conv's A flattened channels-last: (r, kh·kw·in), reshaped back as (in, kh, kw)
     """
     A, B = lora_A.float(), lora_B.float()
     A = A.permute(0, 2, 3, 1) if A.dim() == 4 else A
     d = (B.flatten(1) @ A.flatten(1)).reshape(B.shape[0], *lora_A.shape[1:])
     return ((d.T if fan_in_fan_out else d) * scaling).to(lora_B.dtype)
     """,
     "the right values at the wrong indices (output: a layout mistake)"),
    ("lora_delta",  # half factors: ΔW left in float32
     DELTA + "return (d.T if fan_in_fan_out else d) * scaling",
     Fails("wrong", "has dtype")),
    ("merge_lora",
     DELTA + "return (weight.float() + (d.T if fan_in_fan_out else d) * scaling).to(weight.dtype)",
     "ΔW added in float32"),
    ("merge_lora", "return weight + lora_delta(lora_A, lora_B, 1.0, fan_in_fan_out).to(weight.dtype)",
     "the scaling left out"),
    ("merge_lora", "return weight - lora_delta(lora_A, lora_B, scaling, fan_in_fan_out).to(weight.dtype)",
     "ΔW subtracted instead of added"),
    ("merge_lora", "return weight + lora_delta(lora_A, lora_B, scaling).to(weight.dtype)",
     "fan_in_fan_out ignored"),
    ("merge_lora", "return weight + (lora_delta(lora_A, lora_B, scaling, fan_in_fan_out) * scaling).to(weight.dtype)",
     "the scaling applied twice"),
    ("merge_lora",  # the update alone
     "return lora_delta(lora_A, lora_B, scaling, fan_in_fan_out).to(weight.dtype)", Fails("wrong", "values differ")),
    ("unmerge_lora",
     "return merged_weight + lora_delta(lora_A, lora_B, scaling, fan_in_fan_out).to(merged_weight.dtype)",
     "ΔW added again instead of subtracted"),
    ("unmerge_lora",
     DELTA + "return (merged_weight.float() - (d.T if fan_in_fan_out else d) * scaling)"
     ".to(merged_weight.dtype)",
     "ΔW subtracted in float32"),
    ("unmerge_lora",
     "return merged_weight - lora_delta(lora_A, lora_B, 1.0, fan_in_fan_out).to(merged_weight.dtype)",
     "the scaling left out"),
    ("unmerge_lora", "return merged_weight - lora_delta(lora_A, lora_B, scaling).to(merged_weight.dtype)",
     "fan_in_fan_out ignored"),
    ("unmerge_lora",  # a blind learner's: fan_in_fan_out not passed on, ΔW reshaped to the weight's shape
     "delta = lora_delta(lora_A, lora_B, scaling)\n"
     "return merged_weight - delta.to(merged_weight.dtype).reshape(merged_weight.shape)", "fan_in_fan_out ignored"),
    ("unmerge_lora",  # float16 weights come back as float32
     DELTA + "return merged_weight.float() - (d.T if fan_in_fan_out else d) * scaling",
     Fails("wrong", "has dtype")),
    ("lora_forward", "return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B)",
     "the scaling left out"),
    ("lora_forward", "return (F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B)) * scaling",
     "the base output scaled too"),
    ("lora_forward", "return F.linear(x, weight) + F.linear(F.linear(x, lora_A), lora_B) * scaling",
     "the bias left out"),
    ("lora_forward", "return F.linear(F.linear(x, lora_A), lora_B) * scaling",
     "only the adapter's update returned"),
    ("lora_forward",
     """
     side = F.linear(F.linear(x, lora_A), lora_B)
     if bias is not None:
         side = side + bias
     return F.linear(x, weight) + side * scaling
     """,
     "the bias put in the scaled side path"),
    ("lora_forward",  # A and B used untransposed: a shape error from the learner's own line
     "return F.linear(x, weight, bias) + (x @ lora_A @ lora_B) * scaling", Fails("crash", "raised RuntimeError")),
]


def only(function: str) -> list[str]:
    """pytest -k arguments that grade one function of the lab (merge_lora is part of unmerge_lora's name)."""
    return ["-k", f"{function} and not un{function}" if function == "merge_lora" else function]


mutant_args = only  # test_mutants.py grades each mutant with these -k arguments


def test_a_float16_rounding_step_in_the_wrong_place_is_explained(grade_mutant):
    body = DELTA + "return (weight.float() + (d.T if fan_in_fan_out else d) * scaling).to(weight.dtype)"
    graded = grade_mutant(LAB, "merge_lora", body, *only("merge_lora"))
    assert "differ from peft's by a rounding step" in graded.text, graded.text
    assert "then adds in float16" in graded.text, graded.text


def test_another_float32_order_of_the_same_math_still_passes(grade_mutant):
    graded = grade_mutant(LAB, "lora_delta", """
        A, B = lora_A, lora_B
        if lora_B.dtype == torch.float16:
            A, B = A.float(), B.float()
        d = torch.einsum("or,ri->oi", scaling * B.flatten(1), A.flatten(1)).reshape(B.shape[0], *A.shape[1:])
        return (d.T if fan_in_fan_out else d).to(lora_B.dtype)
    """, *only("lora_delta"))
    assert graded.status == "passed", graded


def test_merging_into_the_given_weight_in_place_fails(grade_mutant):
    graded = grade_mutant(LAB, "merge_lora", """
        weight += lora_delta(lora_A, lora_B, scaling, fan_in_fan_out).to(weight.dtype)
        return weight
    """, *only("merge_lora"))
    assert graded.status == "failed"
    assert "changed its input(s) weight in place" in graded.text


def test_calling_peft_get_delta_weight_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "lora_delta", """
        from peft.tuners.lora.layer import Linear
        return Linear.get_delta_weight(None, "default")
    """, *only("lora_delta"))
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text


# Computed wider and cast once (issue 10): graded against peft's float64 shadow, these pass; float16 ΔW
# still rounds once, at the end, as peft's does.
FLOAT64_BODIES = [
    ("lora_delta", """
        d = (lora_B.double().flatten(1) @ lora_A.double().flatten(1)).reshape(lora_B.shape[0], *lora_A.shape[1:])
        return ((d.T if fan_in_fan_out else d) * scaling).to(lora_B.dtype)
    """),
    ("lora_forward", """
        x64 = x.double()
        y = F.linear(x64, weight.double(), None if bias is None else bias.double())
        return (y + F.linear(F.linear(x64, lora_A.double()), lora_B.double()) * scaling).to(x.dtype)
    """),
]


@pytest.mark.parametrize("function, body", FLOAT64_BODIES, ids=[f[0] for f in FLOAT64_BODIES])
def test_a_lora_computed_in_float64_and_cast_once_passes(grade_mutant, function, body):
    graded = grade_mutant(LAB, function, body, *only(function))
    assert graded.status == "passed", graded.text
