"""Lab 09 · LoRA injection

Concept:
    LoRA (Hu et al. 2021, eq. 3, §4.1) adapts a frozen weight W₀ (out × in) with a rank-r update:
    h = W₀x + ΔWx,  ΔW = s · B A,  with A (r × in), B (out × r), r ≪ min(in, out).
    The scaling is s = α/r (α = lora_alpha), or α/√r with rsLoRA (Kalajdzievski 2023), times the
    adapter weight given to set_adapters, times the lora_scale given to fuse_lora.
    LoRA is parameter adaptation: it changes selected weights of the UNet (in diffusers usually the
    attention projections to_q, to_k, to_v, to_out.0, sometimes the convolutions too). It adds no
    input and no spatial control; ControlNet adds a spatial residual branch and IP-Adapter adds image
    features to cross-attention. They are not interchangeable: a LoRA changes what the model does
    with the inputs it already has, while the other two give it a new input.

Mental model:
    - A LoRA is two small matrices per targeted layer. Only r·(in + out) numbers are trained and
      shipped instead of in·out.
    - Two ways to run it, with the same result up to rounding:
        unmerged: every forward adds a side path, y = W₀x + b + s·B(Ax);
        fused:    once, W ← W₀ + s·BA (fuse_lora); then the layer costs what it cost before.
                  unfuse_lora subtracts the same ΔW again.
    - The scaling is state on each peft layer. set_adapters(names, weights) *sets* it to w·α/r.
      fuse_lora(lora_scale) *multiplies* it by lora_scale, and unfuse_lora leaves it multiplied.
      So fusing adapters one by one with fuse_lora(lora_scale=s, adapter_names=[...]) multiplies the
      scaling of every active adapter on each call (an adapter fused later gets s², s³, ...), and
      after unfuse_lora a forward with the unfused LoRA runs at lora_scale strength, and fusing
      again multiplies it once more. The functions below take the scaling as the layer holds it.
    - Several adapters stack: W₀ + s_a·B_a A_a + s_b·B_b A_b, merged one after the other in the
      order of the active adapters.
    - Convolutions: A is a conv with the layer's kernel, weight (r, in, kh, kw); B is a 1×1 conv,
      weight (out, r, 1, 1). Flattened, ΔW = B.flatten(1) @ A.flatten(1), reshaped to (out, in, kh, kw).
    - fan_in_fan_out: transformers' Conv1D (GPT-2) stores its weight as (in, out), the transpose of
      nn.Linear. Its ΔW is (BA)ᵀ. diffusers UNets have no such layer.
    - Half precision: peft casts ΔW to the weight's dtype and adds in that dtype. On CPU it first
      upcasts float16/bfloat16 factors and multiplies in float32, because some CPUs have slow
      half-precision matmuls. Fused and unfused again, a weight comes back within rounding, not bit
      for bit: within ~1e-7 in float32; in float16 about a quarter of the values end one step off.

Traps:
    - α/r turned upside down (r/α), or rsLoRA written as √(α/r) or as plain α/r instead of α/√r.
    - The adapter weight or the lora_scale left out of the scaling.
    - A @ B instead of B @ A: (r × in) @ (out × r) does not even multiply unless in = out, and
      then it gives an r × r matrix.
    - fan_in_fan_out ignored: a Conv1D weight is (in, out), so ΔW must be transposed to match it.
    - Unmerging by adding ΔW again instead of subtracting it.
    - float16: adding ΔW in float32 and casting the sum rounds in a different place from peft,
      which casts ΔW first and then adds in float16: 12% to 31% of the values end up one float16
      step away.

Precision:
    The course's one policy (lab 01 states it): return the weight's dtype, and compute as wide as you
    like; every float32 check also knows the exact answer on the same inputs (peft's own ΔW, merge
    and forward on a float64 copy of the layer, the scaling in Python floats) and accepts anything
    about as close to it as peft's own answer: ΔW in float64 and cast once, or Python-float scaling,
    passes. The one exception is float16 ΔW, merge and unmerge: there the lesson is where peft
    rounds (ΔW multiplied in float32, cast to float16 once, then added or subtracted in float16), so
    those checks count the values that land a rounding step from peft's and grade that placement.
    The float16 unmerged forward is graded against exact math like the float32 ones.

Say it out loud:
    "A LoRA trains a low-rank update ΔW = s·BA for chosen weights, with s = α/r (or α/√r with
    rsLoRA) times the adapter weight times the fuse scale. I can run it as a side path,
    W₀x + s·B(Ax), or fuse it into the weight once for free inference. Unfusing subtracts the
    same ΔW. Convs flatten their kernels into the same product, and half precision rounds ΔW
    before adding it. It adapts parameters; it does not add a condition the way ControlNet or
    IP-Adapter do."

Graded against: peft's LoRA layers (peft.tuners.lora.layer Linear and Conv2d: scaling,
get_delta_weight, merge, unmerge, forward), reached through diffusers' UNet2DConditionModel
add_adapter / set_adapters / fuse_lora / unfuse_lora on a tiny random UNet, plus peft on a
transformers Conv1D for fan_in_fan_out.
Run: python -m pytest katas/09_lora.py
"""
import math

import torch
import torch.nn.functional as F


# ---- Worked example --------------------------------------------------------------------------------
def lora_factor_shapes(weight_shape: tuple[int, ...], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of lora_A and lora_B that peft creates for a Linear or a Conv2d weight.

    Linear (out, in):             A (r, in),          B (out, r)
    Conv2d (out, in, kh, kw):     A (r, in, kh, kw),  B (out, r, 1, 1)
    A is a layer of the same kind as the base layer with r outputs (same kernel, stride, padding);
    B maps r channels back to out (1×1 for a conv). For a 320×320 attention projection with r = 4
    that is 4·(320 + 320) = 2,560 trained numbers instead of 102,400.
    """
    out_features, in_features, *kernel = weight_shape
    a_shape = (rank, in_features, *kernel)
    b_shape = (out_features, rank, *(1 for _ in kernel))
    return a_shape, b_shape


# ---- Your turn -------------------------------------------------------------------------------------
def lora_scaling(
    alpha: float, rank: int, use_rslora: bool = False, adapter_weight: float = 1.0, lora_scale: float = 1.0
) -> float:
    """The number s that multiplies B·A: α/r (α/√r with rsLoRA) × adapter weight × lora_scale.

    Graded against: peft LoraLayer.scaling[adapter] after diffusers' set_adapters(..., weights=[...])
    (LoraLayer.set_scale) and fuse_lora(lora_scale=...) (LoraLayer.scale_layer).
    Args:
        alpha:          lora_alpha of the adapter's LoraConfig
        rank:           r, the rank of the adapter
        use_rslora:     rank-stabilised LoRA: divide by √r instead of r
        adapter_weight: the adapter's weight in set_adapters (1.0 when not given)
        lora_scale:     the lora_scale given to fuse_lora (1.0: no extra scaling)
    Returns: a Python float.
    """
    # TODO: α over r (or over √r for rsLoRA), then times the adapter weight and the lora_scale
    raise NotImplementedError


def lora_delta(
    lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float, fan_in_fan_out: bool = False
) -> torch.Tensor:
    """ΔW = scaling · B @ A, shaped like the base weight, for a Linear or a Conv2d layer.

    Graded against: peft.tuners.lora.layer.Linear.get_delta_weight and Conv2d.get_delta_weight
    Args:
        lora_A:  (r, in) for a Linear, (r, in, kh, kw) for a Conv2d; float32 or float16
        lora_B:  (out, r) for a Linear, (out, r, 1, 1) for a Conv2d; same dtype as lora_A
        scaling: the adapter's scaling (see lora_scaling)
        fan_in_fan_out: the base weight is stored (in, out), as in transformers' Conv1D; 2-D only
    Returns: (out, in), or (in, out) with fan_in_fan_out, or (out, in, kh, kw); dtype of lora_B.
        float16 factors on CPU: multiply in float32, then cast ΔW back to float16 (as peft does).
    """
    # TODO: flatten both factors to matrices, B @ A (float32 for half factors on CPU), reshape, scale
    raise NotImplementedError


def merge_lora(
    weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """The fused weight W + ΔW, as fuse_lora leaves it in the layer.

    Graded against: diffusers PeftAdapterMixin.fuse_lora -> peft LoraLayer.merge (Linear, Conv2d)
    Args:
        weight:  the base weight W: (out, in), (out, in, kh, kw), or (in, out) for a Conv1D;
                 float32 or float16
        lora_A, lora_B, scaling, fan_in_fan_out: as for lora_delta
    Returns: the same shape and dtype as weight. A new tensor: do not change `weight` in place.
    """
    # TODO: ΔW in the weight's dtype, then one addition in that dtype
    raise NotImplementedError


def unmerge_lora(
    merged_weight: torch.Tensor, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float,
    fan_in_fan_out: bool = False,
) -> torch.Tensor:
    """The weight with the adapter taken out again, as unfuse_lora leaves it: W' − ΔW.

    Graded against: diffusers PeftAdapterMixin.unfuse_lora -> peft LoraLayer.unmerge (Linear, Conv2d)
    Args:
        merged_weight: the fused weight W'; the other arguments as for merge_lora. `scaling` is the one
                       the layer holds now (after fuse_lora it includes lora_scale).
    Returns: the same shape and dtype as merged_weight. A new tensor.
    """
    # TODO: the same ΔW as the merge, in the weight's dtype, subtracted
    raise NotImplementedError


def lora_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_A: torch.Tensor,
    lora_B: torch.Tensor, scaling: float,
) -> torch.Tensor:
    """An unmerged LoRA Linear layer: y = x Wᵀ + b + s · (x Aᵀ) Bᵀ.

    Graded against: peft.tuners.lora.layer.Linear.forward (unmerged), and the same layer after fuse_lora.
    Args:
        x:       (B, N, in) tokens, float32 or float16
        weight:  (out, in) base weight W₀ (not merged);  bias: (out,) or None
        lora_A:  (r, in);  lora_B: (out, r);  scaling: the adapter's scaling
    Returns: (B, N, out), dtype of x.
    """
    # TODO: the base layer's output plus the low-rank side path, scaled
    raise NotImplementedError
