"""Grader for lab 09 · LoRA injection: scaling, ΔW, fuse/unfuse, the unmerged forward.

References are peft's LoRA layers in a tiny random UNet2DConditionModel, reached the way a user reaches
them: diffusers' add_adapter (LoraConfig with init_lora_weights=False, so B is not zero; A, B and the
UNet come from the global RNG the plugin seeds per check), set_adapters, fuse_lora, unfuse_lora. The
fan_in_fan_out path uses peft on a transformers Conv1D, since a UNet has none.

The code that builds them (lora_unet, conv1d_layers) and the float16 rounding check close the file.
"""
import copy
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.lora.layer import LoraLayer
from transformers.pytorch_utils import Conv1D

from diffusion_katas.engine import tiny
from diffusion_katas.engine.comparison import mismatch
from diffusion_katas.engine.helpers import DTYPES
from diffusion_katas.engine.isolation import fresh
from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import MERGE, MODEL_FORWARD, SCALING, for_dtype


# Every library route to the answers (engine/isolation.py families): any peft tuner layer's own scaling, delta,
# merge and forward (LoRA's Linear, Conv, Embedding and the quantized ones, LyCORIS' LoHa/LoKr), and diffusers'
# legacy LoRA layers (LoRACompatibleLinear/Conv, LoRALinearLayer).
PEFT_SCALING = ("peft.tuners.**:*.set_scale", "peft.tuners.**:*.scale_layer", "peft.tuners.**:*.unscale_layer",
                "peft.tuners.**:*.update_layer")
LEGACY_LORA = ("diffusers.models.lora:*._fuse_lora", "diffusers.models.lora:*._unfuse_lora",
               "diffusers.models.lora:*.forward")


# ---- lora_scaling -----------------------------------------------------------------------------------
lora_scaling = Kata(
    "lora_scaling",
    hints=(
        "Three factors multiply: the LoraConfig's α over the rank (√rank for rsLoRA), the adapter's weight "
        "from set_adapters, and the lora_scale from fuse_lora.",
        "s = α/r · w · lora_scale, or s = α/√r · w · lora_scale with use_rslora.",
        "base = alpha / math.sqrt(rank) if use_rslora else alpha / rank; "
        "return base * adapter_weight * lora_scale",
    ),
    answer_key=("peft.tuners.lora.layer.LoraLayer.set_scale", "peft.tuners.lora.layer.LoraLayer.scale_layer",
                *PEFT_SCALING),
)

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
# conv_in, the resnets' 3×3 convs, and 1×1 convs (the resnet shortcuts, the transformers' proj_in).
CONVS = ("conv_in", "conv1", "conv2", "conv_shortcut", "proj_in")
TARGETS = {"attention": ATTENTION, "convs": CONVS, "attention+convs": ATTENTION + CONVS,
           "to_q": ("to_q",)}  # one projection per block: enough to read a scaling, cheap to build


@dataclass(frozen=True)
class Adapter:
    name: str
    r: int
    alpha: float
    rslora: bool = False
    weight: float = 1.0  # its weight in set_adapters
    targets: str = "attention"

    def __repr__(self) -> str:  # how a case shows it in a failure's first line
        return (f"'{self.name}' r={self.r} α={self.alpha}{' rsLoRA' if self.rslora else ''} "
                f"weight={self.weight} on {self.targets}")

    def describe(self) -> str:
        return (f"adapter '{self.name}' (r={self.r}, α={self.alpha}{', rsLoRA' if self.rslora else ''}, "
                f"weight {self.weight})")


SCALING_CASES = [
    dict(lora_scale=0.8, adapters=(Adapter("a", 4, 6, rslora=True, weight=0.7),
                                   Adapter("b", 8, 16, weight=1.25),
                                   Adapter("c", 16, 8, rslora=True, weight=1.0))),
    dict(lora_scale=1.0, adapters=(Adapter("d", 2, 1, weight=0.5),
                                   Adapter("e", 16, 32, rslora=True, weight=2.0))),
]


@lora_scaling.check("vs LoraLayer.scaling after fuse_lora", cases=SCALING_CASES, tol=SCALING)
def _(case, g):
    adapters = [Adapter(a.name, a.r, a.alpha, a.rslora, a.weight, targets="to_q") for a in case["adapters"]]
    unet, layers = lora_unet(adapters)
    quietly(unet.fuse_lora, lora_scale=case["lora_scale"])
    layer = next(iter(layers.values()))
    return [Scenario(inputs=dict(alpha=a.alpha, rank=a.r, use_rslora=a.rslora, adapter_weight=a.weight,
                                 lora_scale=case["lora_scale"]),
                     expected=float(layer.scaling[a.name]),
                     exact=_base(a.alpha, a.r, a.rslora) * a.weight * case["lora_scale"],  # Python floats
                     label=f"{a.describe()}, fuse_lora(lora_scale={case['lora_scale']})") for a in adapters]


def _base(alpha, rank, use_rslora):
    return alpha / rank**0.5 if use_rslora else alpha / rank


@lora_scaling.trap("r/α: the ratio turned upside down",
                   hint="The scaling is α over the rank (α/r, or α/√r with rsLoRA): a larger lora_alpha "
                        "makes the update stronger.")
def _(alpha, rank, use_rslora=False, adapter_weight=1.0, lora_scale=1.0):
    return (rank**0.5 if use_rslora else rank) / alpha * adapter_weight * lora_scale


@lora_scaling.trap("rsLoRA ignored: α/r even with use_rslora",
                   hint="With use_rslora=True peft divides by √r, not r (rank-stabilised LoRA).")
def _(alpha, rank, use_rslora=False, adapter_weight=1.0, lora_scale=1.0):
    return alpha / rank * adapter_weight * lora_scale


@lora_scaling.trap("rsLoRA as √(α/r) instead of α/√r",
                   hint="Only the rank goes under the square root: α/√r.")
def _(alpha, rank, use_rslora=False, adapter_weight=1.0, lora_scale=1.0):
    return ((alpha / rank) ** 0.5 if use_rslora else alpha / rank) * adapter_weight * lora_scale


@lora_scaling.trap("α // r: integer division",
                   hint="α/r is a true division (lora_alpha 8, r 3: 2.667, not 2). In Python 3 `/` is; `//` floors.")
def _(alpha, rank, use_rslora=False, adapter_weight=1.0, lora_scale=1.0):
    return (alpha / rank**0.5 if use_rslora else alpha // rank) * adapter_weight * lora_scale


@lora_scaling.trap("the adapter weight (set_adapters) left out",
                   hint="set_adapters(names, weights) sets each adapter's scaling to weight · α/r: "
                        "multiply by it.")
def _(alpha, rank, use_rslora=False, adapter_weight=1.0, lora_scale=1.0):
    return _base(alpha, rank, use_rslora) * lora_scale


@lora_scaling.trap("the lora_scale (fuse_lora) left out",
                   hint="fuse_lora(lora_scale=s) multiplies every active adapter's scaling by s before "
                        "merging.")
def _(alpha, rank, use_rslora=False, adapter_weight=1.0, lora_scale=1.0):
    return _base(alpha, rank, use_rslora) * adapter_weight


# ---- lora_delta -------------------------------------------------------------------------------------
LAYER_CLASSES = ("peft.tuners.lora.layer.Linear", "peft.tuners.lora.layer._ConvNd")
DELTA_KEYS = (*(f"{c}.get_delta_weight" for c in LAYER_CLASSES), "peft.tuners.**:*.get_delta_weight",
              "peft.tuners.**:*._get_delta_activations", *LEGACY_LORA)

lora_delta = Kata(
    "lora_delta",
    hints=(
        "ΔW has the base weight's shape: B (out × r) times A (r × in) gives out × in. Conv factors are "
        "4-D: flatten them to matrices first, multiply, reshape back.",
        "ΔW = s · B A;  conv: (B.flatten(1) @ A.flatten(1)).reshape(out, in, kh, kw);  fan_in_fan_out: "
        "transpose it;  float16 factors on CPU: multiply in float32, cast ΔW back.",
        "A, B = lora_A.float(), lora_B.float()  # for float16 factors; "
        "d = (B.flatten(1) @ A.flatten(1)).reshape(B.shape[0], *A.shape[1:]); "
        "d = d.T if fan_in_fan_out else d; "
        "return (d * scaling).to(lora_B.dtype)",
    ),
    answer_key=DELTA_KEYS,
)

DELTA_WHERE = "peft multiplies float16 factors in float32 on CPU and casts ΔW once, at the end."
DELTA_CASES = [
    dict(dtype="float32", adapters=(Adapter("style", 4, 6, weight=0.7),
                                    Adapter("subject", 2, 3, rslora=True, weight=1.3, targets="convs"))),
    dict(dtype="float16", adapters=(Adapter("style", 8, 4, weight=1.5, targets="attention+convs"),)),
]


@lora_delta.check("vs get_delta_weight, Linear and Conv2d", cases=DELTA_CASES, tol=MERGE)
def _(case, g):
    adapters = case["adapters"]
    unet, layers = lora_unet(adapters, DTYPES[case["dtype"]])
    scenarios = []
    for a in adapters:
        for name, layer in layers.items():
            if a.name not in layer.lora_A:
                continue
            A, B = factors(layer, a.name)
            s = Scenario(inputs=dict(lora_A=A, lora_B=B, scaling=layer.scaling[a.name], fan_in_fan_out=False),
                         expected=layer.get_delta_weight(a.name).detach(), exact=shadow_delta(layer, a.name),
                         label=layer_label(name, layer, a))
            scenarios.append(with_half_check(s, lora_delta, DELTA_WHERE))
    return scenarios


@lora_delta.check("Conv1D weights, fan_in_fan_out", cases=[dict(r=4, alpha=8), dict(r=2, alpha=3, rslora=True)],
                  tol=MERGE)
def _(case, g):
    scenarios = []
    for name, layer in conv1d_layers(case).items():
        A, B = factors(layer, "gpt2")
        scenarios.append(Scenario(
            inputs=dict(lora_A=A, lora_B=B, scaling=layer.scaling["gpt2"], fan_in_fan_out=True),
            expected=layer.get_delta_weight("gpt2").detach(), exact=shadow_delta(layer, "gpt2"),
            label=layer_label(name, layer, "gpt2")))
    return scenarios


def _matrices(lora_A, lora_B):
    half = lora_B.dtype in (torch.float16, torch.bfloat16)
    return (lora_A.float() if half else lora_A), (lora_B.float() if half else lora_B)


def _delta(lora_A, lora_B, scaling, fan_in_fan_out=False):
    """ΔW as peft computes it: a shared helper for traps that get something else wrong."""
    A, B = _matrices(lora_A, lora_B)
    d = (B.flatten(1) @ A.flatten(1)).reshape(B.shape[0], *A.shape[1:])
    return ((d.T if fan_in_fan_out else d) * scaling).to(lora_B.dtype)


@lora_delta.trap("lora_A @ lora_B instead of lora_B @ lora_A",
                 hint="A is (r, in) and B is (out, r): B @ A is (out, in), the weight's shape. A @ B only "
                      "multiplies when in = out, and then gives an r × r matrix.")
def _(lora_A, lora_B, scaling, fan_in_fan_out=False):
    A, B = _matrices(lora_A, lora_B)
    return (A.flatten(1) @ B.flatten(1) * scaling).to(lora_B.dtype)


@lora_delta.trap("the scaling left out",
                 hint="ΔW = scaling · B A: without the scaling the update has the wrong strength.")
def _(lora_A, lora_B, scaling, fan_in_fan_out=False):
    return _delta(lora_A, lora_B, 1.0, fan_in_fan_out)


@lora_delta.trap("fan_in_fan_out ignored",
                 hint="A Conv1D stores its weight as (in, out), the transpose of nn.Linear's: with "
                      "fan_in_fan_out=True return (B A)ᵀ.")
def _(lora_A, lora_B, scaling, fan_in_fan_out=False):
    return _delta(lora_A, lora_B, scaling, False)


@lora_delta.trap("transposed although fan_in_fan_out is False",
                 hint="nn.Linear stores its weight as (out, in), like B @ A already is: transpose only for "
                      "fan_in_fan_out=True.")
def _(lora_A, lora_B, scaling, fan_in_fan_out=False):
    if lora_A.dim() != 2:
        raise ValueError("a conv weight has no transpose mix-up")
    return _delta(lora_A, lora_B, scaling, not fan_in_fan_out)


@lora_delta.trap("B @ A multiplied in float16",
                 hint="On CPU peft upcasts float16 factors: (lora_B.float() @ lora_A.float()) * scaling, then "
                      ".to(float16) once at the end.")
def _(lora_A, lora_B, scaling, fan_in_fan_out=False):
    d = (lora_B.flatten(1) @ lora_A.flatten(1)).reshape(lora_B.shape[0], *lora_A.shape[1:])
    return (d.T if fan_in_fan_out else d) * scaling


# ---- merge_lora -------------------------------------------------------------------------------------
merge_lora = Kata(
    "merge_lora",
    hints=(
        "Fusing adds the adapter's ΔW to the weight once; the layer then runs at its old cost.",
        "W' = W + ΔW, with ΔW = s·BA (lora_delta) cast to W's dtype before the addition.",
        "return weight + lora_delta(lora_A, lora_B, scaling, fan_in_fan_out).to(weight.dtype)",
    ),
    answer_key=("diffusers.loaders.peft.PeftAdapterMixin.fuse_lora",
                *(f"{c}.merge" for c in LAYER_CLASSES), *DELTA_KEYS, "peft.tuners.**:*.merge",
                "diffusers.loaders.**:*.fuse_lora"),
)

MERGE_CASES = [
    dict(dtype="float32", targets="attention", r=4, alpha=6, rslora=False, weight=0.7, lora_scale=0.9),
    dict(dtype="float32", targets="convs", r=2, alpha=3, rslora=True, weight=1.3, lora_scale=1.0),
    dict(dtype="float16", targets="attention+convs", r=8, alpha=12, rslora=False, weight=0.6, lora_scale=0.7),
]
MERGE_WHERE = "peft casts ΔW to float16 first, then adds in float16: weight + ΔW.to(weight.dtype)."


def fused_scenarios(case, kata, *, unfuse: bool, where: str):
    """One scenario per LoRA layer: fuse_lora's weights (or unfuse_lora's, from the fused ones)."""
    a = Adapter("lora", case["r"], case["alpha"], case["rslora"], case["weight"], case["targets"])
    unet, layers = lora_unet([a], DTYPES[case["dtype"]])
    before = {n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()}
    quietly(unet.fuse_lora, lora_scale=case["lora_scale"])
    fused = {n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()}
    if unfuse:
        quietly(unet.unfuse_lora)
    scenarios = []
    for name, layer in layers.items():
        A, B = factors(layer, a.name)
        # The layer's scaling now: α/r · weight · lora_scale (fuse_lora multiplied it in; unfuse keeps it).
        common = dict(lora_A=A, lora_B=B, scaling=layer.scaling[a.name], fan_in_fan_out=False)
        inputs = dict(merged_weight=fused[name], **common) if unfuse else dict(weight=before[name], **common)
        delta = shadow_delta(layer, a.name)
        s = Scenario(inputs=inputs, expected=layer.get_base_layer().weight.detach().clone(),
                     exact=None if delta is None else (fused[name].double() - delta if unfuse
                                                       else before[name].double() + delta),
                     label=layer_label(name, layer, a))
        scenarios.append(with_half_check(s, kata, where))
    return scenarios


@merge_lora.check("vs fuse_lora, every LoRA layer", cases=MERGE_CASES, tol=MERGE)
def _(case, g):
    return fused_scenarios(case, merge_lora, unfuse=False, where=MERGE_WHERE)


@merge_lora.check("two adapters, fused one after the other", tol=MERGE)
def _(case, g):
    first = Adapter("style", 4, 8, weight=0.5)
    second = Adapter("subject", 2, 3, rslora=True, weight=1.5, targets="attention+convs")
    unet, layers = lora_unet([first, second])
    weights = [{n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()}]
    for a in (first, second):
        # lora_scale stays 1: each fuse_lora call would multiply every active adapter's scaling again.
        quietly(unet.fuse_lora, adapter_names=[a.name])
        weights.append({n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()})
    scenarios = []
    for step, a in enumerate((first, second)):
        for name, layer in layers.items():
            if a.name not in layer.lora_A:
                continue
            A, B = factors(layer, a.name)
            onto = ("the base weight" if step == 0 or first.name not in layer.lora_A
                    else f"the weight with '{first.name}' fused")
            scenarios.append(Scenario(
                inputs=dict(weight=weights[step][name], lora_A=A, lora_B=B, scaling=layer.scaling[a.name],
                            fan_in_fan_out=False),
                expected=weights[step + 1][name], exact=weights[step][name].double() + shadow_delta(layer, a.name),
                label=f"{layer_label(name, layer, a)}, onto {onto}"))
    return scenarios


@merge_lora.check("Conv1D weights, fan_in_fan_out", cases=[dict(r=4, alpha=6)], tol=MERGE)
def _(case, g):
    scenarios = []
    for name, layer in conv1d_layers(case).items():
        W = layer.get_base_layer().weight.detach().clone()
        quietly(layer.merge)
        A, B = factors(layer, "gpt2")
        scenarios.append(Scenario(
            inputs=dict(weight=W, lora_A=A, lora_B=B, scaling=layer.scaling["gpt2"], fan_in_fan_out=True),
            expected=layer.get_base_layer().weight.detach().clone(), exact=W.double() + shadow_delta(layer, "gpt2"),
            label=layer_label(name, layer, "gpt2")))
    return scenarios


@merge_lora.trap("ΔW added in float32, the sum cast to float16",
                 hint="peft rounds ΔW to the weight's dtype first and adds in that dtype: "
                      "weight + delta.to(weight.dtype). Summing in float32 rounds once, in another place.")
def _(weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    A, B = _matrices(lora_A, lora_B)
    d = (B.flatten(1) @ A.flatten(1)).reshape(B.shape[0], *A.shape[1:])
    return (weight.float() + (d.T if fan_in_fan_out else d) * scaling).to(weight.dtype)


@merge_lora.trap("the scaling left out",
                 hint="The merged weight is W + scaling · B A: the scaling sets how strongly the adapter "
                      "acts.")
def _(weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    return weight + _delta(lora_A, lora_B, 1.0, fan_in_fan_out).to(weight.dtype)


@merge_lora.trap("the scaling applied twice (ΔW already holds it)",
                 hint="lora_delta's ΔW = scaling · B A already carries the scaling: add it as it is.")
def _(weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    return weight + (_delta(lora_A, lora_B, scaling, fan_in_fan_out) * scaling).to(weight.dtype)


@merge_lora.trap("ΔW subtracted instead of added",
                 hint="Fusing adds ΔW (W + s·BA); unfusing is the one that subtracts.")
def _(weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    return weight - _delta(lora_A, lora_B, scaling, fan_in_fan_out).to(weight.dtype)


@merge_lora.trap("fan_in_fan_out ignored",
                 hint="A Conv1D weight is (in, out): add (B A)ᵀ to it, not B A.")
def _(weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    return weight + _delta(lora_A, lora_B, scaling, False).to(weight.dtype).reshape(weight.shape)  # (as unmerge's)


# ---- unmerge_lora -----------------------------------------------------------------------------------
unmerge_lora = Kata(
    "unmerge_lora",
    hints=(
        "Unfusing undoes fusing: the same ΔW, taken out again.",
        "W = W' − ΔW, with ΔW = s·BA cast to the weight's dtype before the subtraction.",
        "return merged_weight - lora_delta(lora_A, lora_B, scaling, fan_in_fan_out).to(merged_weight.dtype)",
    ),
    answer_key=("diffusers.loaders.peft.PeftAdapterMixin.unfuse_lora",
                *(f"{c}.unmerge" for c in LAYER_CLASSES), *DELTA_KEYS, "peft.tuners.**:*.unmerge",
                "diffusers.loaders.**:*.unfuse_lora"),
)

UNMERGE_CASES = [
    dict(dtype="float32", targets="attention", r=8, alpha=4, rslora=False, weight=1.3, lora_scale=0.8),
    dict(dtype="float32", targets="convs", r=4, alpha=5, rslora=True, weight=0.9, lora_scale=1.0),
    dict(dtype="float16", targets="attention+convs", r=4, alpha=6, rslora=False, weight=0.8, lora_scale=1.2),
]
UNMERGE_WHERE = "peft casts ΔW to float16 first, then subtracts in float16: merged_weight − ΔW.to(dtype)."


@unmerge_lora.check("vs unfuse_lora, every LoRA layer", cases=UNMERGE_CASES, tol=MERGE)
def _(case, g):
    return fused_scenarios(case, unmerge_lora, unfuse=True, where=UNMERGE_WHERE)


@unmerge_lora.check("Conv1D weights, fan_in_fan_out", cases=[dict(r=4, alpha=6, rslora=True)], tol=MERGE)
def _(case, g):
    scenarios = []
    for name, layer in conv1d_layers(case).items():
        quietly(layer.merge)
        merged = layer.get_base_layer().weight.detach().clone()
        quietly(layer.unmerge)
        A, B = factors(layer, "gpt2")
        scenarios.append(Scenario(
            inputs=dict(merged_weight=merged, lora_A=A, lora_B=B, scaling=layer.scaling["gpt2"],
                        fan_in_fan_out=True),
            expected=layer.get_base_layer().weight.detach().clone(),
            exact=merged.double() - shadow_delta(layer, "gpt2"), label=layer_label(name, layer, "gpt2")))
    return scenarios


@unmerge_lora.trap("ΔW added again instead of subtracted",
                   hint="Unfusing takes the adapter out: merged_weight − ΔW.")
def _(merged_weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    return merged_weight + _delta(lora_A, lora_B, scaling, fan_in_fan_out).to(merged_weight.dtype)


@unmerge_lora.trap("ΔW subtracted in float32, the result cast to float16",
                   hint="peft rounds ΔW to the weight's dtype first and subtracts in that dtype.")
def _(merged_weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    A, B = _matrices(lora_A, lora_B)
    d = (B.flatten(1) @ A.flatten(1)).reshape(B.shape[0], *A.shape[1:])
    return (merged_weight.float() - (d.T if fan_in_fan_out else d) * scaling).to(merged_weight.dtype)


@unmerge_lora.trap("the scaling left out",
                   hint="Take out exactly what fusing put in: scaling · B A, with the layer's current "
                        "scaling.")
def _(merged_weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    return merged_weight - _delta(lora_A, lora_B, 1.0, fan_in_fan_out).to(merged_weight.dtype)


@unmerge_lora.trap("fan_in_fan_out ignored",
                   hint="A Conv1D weight is (in, out): subtract (B A)ᵀ from it, not B A.")
def _(merged_weight, lora_A, lora_B, scaling, fan_in_fan_out=False):
    # reshaped to the weight's shape, as a learner's code that then runs on a (16, 24) Conv1D weight does: the
    # square layer's values are the same either way
    return merged_weight - _delta(lora_A, lora_B, scaling, False).to(merged_weight.dtype).reshape(merged_weight.shape)


# ---- lora_forward -----------------------------------------------------------------------------------
lora_forward = Kata(
    "lora_forward",
    hints=(
        "The layer's usual output, plus a narrow side path: project the tokens down to r numbers with A, "
        "back up with B, and scale.",
        "y = x Wᵀ + b + s · (x Aᵀ) Bᵀ;  the bias may be None.",
        "return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B) * scaling",
    ),
    answer_key=("peft.tuners.lora.layer.Linear.forward", "peft.tuners.**:*.forward",
                "peft.tuners.**:*._mixed_batch_forward", *LEGACY_LORA),
)

FORWARD_CASES = [
    dict(dtype="float32", r=4, alpha=6, rslora=False, weight=0.7, lora_scale=1.0),
    dict(dtype="float16", r=8, alpha=4, rslora=True, weight=1.5, lora_scale=1.0),
]


def forward_scenarios(case, g, *, fused: bool):
    dtype = DTYPES[case["dtype"]]
    a = Adapter("lora", case["r"], case["alpha"], case["rslora"], case["weight"])
    unet, layers = lora_unet([a], dtype)
    base = {n: m.get_base_layer().weight.detach().clone() for n, m in layers.items()}
    if fused:
        quietly(unet.fuse_lora, lora_scale=case["lora_scale"])
    scenarios = []
    for name, layer in layers.items():
        x = torch.randn((2, 6, layer.in_features), generator=g).to(dtype)
        bias = layer.get_base_layer().bias
        A, B = factors(layer, a.name)
        with torch.no_grad():
            expected = layer(x.clone())
            exact = unmerged_twin(layer, base[name])(x.double())
        where = "fused layer" if fused else "unmerged LoRA layer"
        scenarios.append(Scenario(
            inputs=dict(x=x, weight=base[name], bias=None if bias is None else bias.detach().clone(),
                        lora_A=A, lora_B=B, scaling=layer.scaling[a.name]),
            expected=expected, exact=exact, label=f"{layer_label(name, layer, a)}, vs the {where}"))
    return scenarios


@lora_forward.check("vs LoraLayer.forward, unmerged", cases=FORWARD_CASES, tol=MODEL_FORWARD)
def _(case, g):
    return forward_scenarios(case, g, fused=False)


@lora_forward.check("vs the same layer after fuse_lora",
                    cases=[dict(dtype="float32", r=4, alpha=8, rslora=False, weight=1.2, lora_scale=0.75)],
                    tol=MODEL_FORWARD)
def _(case, g):
    return forward_scenarios(case, g, fused=True)


@lora_forward.trap("the scaling left out",
                   hint="The side path is multiplied by scaling before it is added: "
                        "+ scaling · (x Aᵀ) Bᵀ.")
def _(x, weight, bias, lora_A, lora_B, scaling):
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B)


@lora_forward.trap("the side path divided by r again (scaling already holds α/r)",
                   hint="scaling is the adapter's whole factor (lora_scaling: α/r, or α/√r with rsLoRA): multiply the "
                        "side path by it, nothing more.")
def _(x, weight, bias, lora_A, lora_B, scaling):
    return F.linear(x, weight, bias) + (scaling / lora_A.shape[0]) * F.linear(F.linear(x, lora_A), lora_B)


@lora_forward.trap("the base output scaled too",
                   hint="Only the adapter's update is scaled; the frozen layer's output x Wᵀ + b is added "
                        "as it is.")
def _(x, weight, bias, lora_A, lora_B, scaling):
    return (F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B)) * scaling


@lora_forward.trap("the bias left out",
                   hint="The base layer keeps its bias: y = x Wᵀ + b + scaling · (x Aᵀ) Bᵀ "
                        "(bias may be None).")
def _(x, weight, bias, lora_A, lora_B, scaling):
    return F.linear(x, weight) + F.linear(F.linear(x, lora_A), lora_B) * scaling


@lora_forward.trap("the bias put in the scaled side path: scaling · ((x Aᵀ) Bᵀ + b)",
                   hint="The bias belongs to the frozen base layer: y = (x Wᵀ + b) + scaling · (x Aᵀ) Bᵀ.")
def _(x, weight, bias, lora_A, lora_B, scaling):
    side = F.linear(F.linear(x, lora_A), lora_B)
    return F.linear(x, weight) + (side if bias is None else side + bias) * scaling


@lora_forward.trap("only the adapter's update returned",
                   hint="LoRA adds to the frozen layer's output: start from x Wᵀ + b, then add the update.")
def _(x, weight, bias, lora_A, lora_B, scaling):
    return F.linear(F.linear(x, lora_A), lora_B) * scaling


# ---- budgets ------------------------------------------------------------------------------------------
@lora_forward.budget("FLOPs: the rank-r path, never ΔW")
def _(learner, g):
    from diffusion_katas.engine.meters import flops
    from diffusion_katas.core.spec import Measurement

    # Few tokens and a wide layer, as at inference with a short prompt: forming ΔW (2·out·in·r) costs more
    # than the rank-r path (2·tokens·r·(in + out)), so a merged-weight forward cannot pass for the rank-r one.
    n, d_in, d_out, r = 8, 256, 192, 4
    x = torch.randn((2, n, d_in), generator=g)
    weight, bias = torch.randn((d_out, d_in), generator=g), torch.randn(d_out, generator=g)
    lora_A, lora_B = torch.randn((r, d_in), generator=g), torch.randn((d_out, r), generator=g)
    mine, _ = learner.measure(flops, x=x, weight=weight, bias=bias, lora_A=lora_A, lora_B=lora_B, scaling=0.5)
    base, _ = flops(lambda: torch.nn.functional.linear(x, weight, bias))
    low_rank = 2 * x.shape[0] * n * r * (d_in + d_out)
    return [Measurement(f"FLOPs of one unmerged forward, 2×{n} tokens, {d_in}→{d_out}, r={r}", mine, base + low_rank,
                        "FLOPs",
                        f"the base layer ({base:,}) plus x·Aᵀ then ·Bᵀ through the rank-4 bottleneck "
                        f"({low_rank:,}); forming ΔW = B·A first costs 2·out·in·r = {2 * d_out * d_in * r:,} "
                        "more and defeats the point of an unmerged adapter")]


@merge_lora.budget("FLOPs: one low-rank product")
def _(learner, g):
    from diffusion_katas.engine.meters import flops
    from diffusion_katas.core.spec import Measurement

    d_in, d_out, r = 96, 80, 4
    weight = torch.randn((d_out, d_in), generator=g)
    lora_A, lora_B = torch.randn((r, d_in), generator=g), torch.randn((d_out, r), generator=g)
    mine, _ = learner.measure(flops, weight=weight, lora_A=lora_A, lora_B=lora_B, scaling=0.5)
    allowed = 2 * d_out * r * d_in
    return [Measurement("FLOPs of merging one 96→80 layer, r=4", mine, allowed, "FLOPs",
                        "B·A once (2·out·r·in); after the merge the layer costs exactly the base layer's "
                        "FLOPs at every forward, which is why serving merges")]


# ---- references: peft's LoRA layers, reached as a user reaches them ---------------------------------
# float16 results: HALF (2e-3) lets through a rounding step taken in the wrong place, which is the
# point of the float16 cases here, so those scenarios also count the values that differ at all.
# Other float32 orders flip at most ~1 value in 10,000 (measured: 0-4 of 38,304 over a whole UNet);
# adding in float32 and casting at the end, or multiplying in float16, flips 12-31% of them.
HALF_FLIPS_ALLOWED = 0.005


# peft's warnings are UserWarnings (a second adapter, merging onto merged weights): quiet_diffusers() is too narrow.
def quietly(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def lora_unet(adapters, dtype=torch.float32):
    """The tiny UNet with `adapters` added (diffusers' add_adapter) and weighted (set_adapters).

    Returns (unet, {module name: peft LoraLayer}). Warnings (a second adapter, a spurious dtype
    note) are silenced: they are about the reference, not the learner.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = tiny.unet_cond()
        if dtype != torch.float32:
            # nn.Module.to: ModelMixin.to(dtype) logs a keep-in-fp32 warning even with nothing to keep.
            torch.nn.Module.to(unet, dtype)
        for a in adapters:
            unet.add_adapter(LoraConfig(r=a.r, lora_alpha=a.alpha, target_modules=list(TARGETS[a.targets]),
                                        init_lora_weights=False, use_rslora=a.rslora), adapter_name=a.name)
        unet.set_adapters([a.name for a in adapters], weights=[a.weight for a in adapters])
    return unet, {n: m for n, m in unet.named_modules() if isinstance(m, LoraLayer)}


class Gpt2Projections(torch.nn.Module):
    """Two transformers Conv1D layers, named as in GPT-2; Conv1D stores its weight as (in, out)."""

    def __init__(self):
        super().__init__()
        self.c_proj = Conv1D(16, 16)  # nf (out) = 16, nx (in) = 16: square, so a missing transpose still adds
        self.c_attn = Conv1D(24, 16)  # out 24, in 16: weight (16, 24)


def conv1d_layers(case):
    """peft LoRA layers (fan_in_fan_out=True) around transformers Conv1D weights."""
    model = Gpt2Projections()
    config = LoraConfig(r=case["r"], lora_alpha=case["alpha"], target_modules=["c_proj", "c_attn"],
                        init_lora_weights=False, fan_in_fan_out=True, use_rslora=case.get("rslora", False))
    quietly(inject_adapter_in_model, config, model, adapter_name="gpt2")
    return {"c_proj": model.c_proj, "c_attn": model.c_attn}


def shadow_delta(layer, adapter):
    """The float64 shadow of peft's ΔW (Scenario.exact): get_delta_weight on a float64 copy of the layer.

    None for float16 layers: those scenarios grade where peft rounds (half_rounding), on purpose.
    """
    if layer.get_base_layer().weight.dtype != torch.float32:
        return None
    with torch.no_grad():
        return copy.deepcopy(layer).double().get_delta_weight(adapter).detach()


def unmerged_twin(layer, base_weight):
    """A float64 copy of a peft LoRA layer, unmerged onto `base_weight` (the weight before any fuse):
    peft's own unmerged forward in float64, the shadow of both the unmerged and the fused layer."""
    twin = copy.deepcopy(layer).double()
    twin.get_base_layer().weight.data = base_weight.double()
    twin.merged_adapters.clear()
    return twin


def factors(layer, adapter):
    return (layer.lora_A[adapter].weight.detach().clone(), layer.lora_B[adapter].weight.detach().clone())


def layer_label(name, layer, adapter: Adapter | str) -> str:
    kind = type(layer.get_base_layer()).__name__
    shape = tuple(layer.get_base_layer().weight.shape)
    who = adapter.describe() if isinstance(adapter, Adapter) else f"adapter '{adapter}'"
    return f"layer {name} ({kind} {shape}), {who}"


def count_differing(a, b) -> int:
    return int((a != b).sum())


def half_rounding(kata: Kata, expected, inputs, where: str):
    """A Scenario.verify for float16 scenarios: is the rounding step where peft takes it?

    The ordinary comparison (HALF) runs after this and explains outputs that are far off; this only
    fails outputs HALF would accept but where too many values differ from peft's by a rounding step,
    and names the trap those values match.
    """

    def allowed(n: int) -> int:
        return max(2, int(n * HALF_FLIPS_ALLOWED))

    def verify(out):
        if (type(out) is not torch.Tensor or out.shape != expected.shape or out.dtype != expected.dtype
                or mismatch(out, expected, for_dtype(MERGE, expected.dtype)) is not None):
            return
        n, off = expected.numel(), count_differing(out, expected)
        if off <= allowed(n):
            return
        worst = float((out.double() - expected.double()).abs().max())
        lines = [
            f"  {off} of {n} float16 values ({100 * off / n:.1f}%) differ from peft's by a rounding step "
            f"(up to {worst:.3g}).",
            "  Another order of float32 operations flips at most a few values in 10,000; this many means a "
            f"rounding happens elsewhere. {where}",
        ]
        for trap in kata.traps:
            try:
                wrong = trap.fn(**fresh(inputs))
            except Exception:
                continue
            if (type(wrong) is torch.Tensor and wrong.shape == out.shape and wrong.dtype == out.dtype
                    and count_differing(out, wrong) <= allowed(n)
                    and count_differing(expected, wrong) > allowed(n)):
                lines.append(f"  trap: {trap.name}\n    {trap.hint}")
                break
        raise KataFailure("\n".join(lines))

    return verify


def with_half_check(scenario: Scenario, kata: Kata, where: str) -> Scenario:
    if scenario.expected.dtype == torch.float16:
        scenario.verify = half_rounding(kata, scenario.expected, scenario.inputs, where)
    return scenario
