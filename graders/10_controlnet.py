"""Grader for lab 10 · ControlNet conditioning: zero convs, residual scaling, where the residuals join
the UNet, and one ControlNet + CFG denoising step.

Every expected value comes from diffusers running tiny random-weight models:
- zero_conv: the ControlNet's own 1×1 convs, on the features that reach them (forward hooks);
- scale_control_residuals: ControlNetModel.forward at conditioning_scale=1.0 (the raw residuals)
  and at the graded scale / guess mode (the expected ones);
- add_control_residuals: UNet2DConditionModel.forward with the residuals, recording (pre-hooks on
  its up blocks) the skip tensors and the hidden state its up blocks were actually given;
- controlnet_cfg_step: StableDiffusionControlNetPipeline, latents recorded after every step.
A fresh ControlNet returns exact zeros (zero convs), so the models are randomised: the 1×1 convs and
the control-image embedding's zero-initialised last conv get N(0, 1) weights from the seeded global
RNG. Only the "fresh ControlNet" checks use them as built.
"""
import copy
import functools
import weakref

import torch
from diffusers.models.controlnets.controlnet import ControlNetModel
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import DTYPES, EVERY_PIPELINE_CALL, float64_twin, quiet_diffusers, sd_schedule
from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import EXACT, HALF, MODEL_FORWARD, SCHEDULE, STEP_MATH

PIPELINE = "diffusers.pipelines.controlnet.pipeline_controlnet.StableDiffusionControlNetPipeline"


# ---- tiny models ------------------------------------------------------------------------------------
def sd_layout_unet(sample_size: int = 16) -> UNet2DConditionModel:
    """SD 1.5's block layout (4 blocks × 2 layers: 12 skips), with tiny channel counts."""
    return UNet2DConditionModel(
        sample_size=sample_size, in_channels=tiny.LATENT_CHANNELS, out_channels=tiny.LATENT_CHANNELS,
        layers_per_block=2, block_out_channels=(4, 4, 8, 8), norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=tiny.TEXT_DIM, attention_head_dim=2,
    ).eval()


def flat_unet(sample_size: int = 8) -> UNet2DConditionModel:
    """One down block, no downsampler, conv_in as wide as the block: all 3 skips share one shape, so only
    their values tell them apart (a residual added to the wrong skip shows, it cannot crash)."""
    return UNet2DConditionModel(
        sample_size=sample_size, in_channels=tiny.LATENT_CHANNELS, out_channels=tiny.LATENT_CHANNELS,
        layers_per_block=2, block_out_channels=(8,), norm_num_groups=4,
        down_block_types=("CrossAttnDownBlock2D",), up_block_types=("CrossAttnUpBlock2D",),
        cross_attention_dim=tiny.TEXT_DIM, attention_head_dim=4,
    ).eval()


# layout -> (UNet builder, the control image embedding's channels, control image size / latent size).
# Each stride-2 conv of the embedding halves the image: (4, 8) halves it once, SD's four entries
# three times (x8, as a 512-pixel image maps to a 64-latent).
LAYOUTS = {
    "tiny": (tiny.unet_cond, (4, 8), 2),
    "sd": (sd_layout_unet, (4, 4, 8, 8), 8),
    "flat": (flat_unet, (4, 8), 2),
}


def randomise(controlnet: ControlNetModel) -> None:
    """Give the zero-initialised layers random weights, so the residuals are not all zero."""
    zero_layers = [*controlnet.controlnet_down_blocks, controlnet.controlnet_mid_block,
                   controlnet.controlnet_cond_embedding.conv_out]
    with torch.no_grad():
        for layer in zero_layers:
            for p in layer.parameters():
                torch.nn.init.normal_(p)


@functools.lru_cache(maxsize=8)
def _models(check_seed: int, layout: str, dtype: str, fresh: bool):
    build_unet, embedding_channels, _ = LAYOUTS[layout]
    unet = build_unet().requires_grad_(False)
    controlnet = ControlNetModel.from_unet(
        unet, conditioning_embedding_out_channels=embedding_channels).eval().requires_grad_(False)
    if not fresh:
        randomise(controlnet)
    if dtype == "float16":  # nn.Module.half: ModelMixin.to would log a from_pretrained warning
        unet, controlnet = unet.half(), controlnet.half()
    return unet, controlnet


def models(layout: str = "tiny", dtype: str = "float32", fresh: bool = False):
    """(unet, controlnet), built once per check: the plugin seeds the global RNG before each check,
    and torch.initial_seed() is that seed, so cases of one check share models built from it."""
    return _models(torch.initial_seed(), layout, dtype, fresh)


def model_inputs(case: dict, g: torch.Generator) -> dict:
    """Latents, a timestep, text embeddings and a control image in [0, 1] for one forward."""
    dtype = DTYPES[case.get("dtype", "float32")]
    B, size = case.get("batch", 2), case.get("size", 8)
    factor = LAYOUTS[case.get("layout", "tiny")][2]
    t = case.get("t")
    t = torch.tensor(t) if t is not None else torch.randint(0, 1000, (), generator=g)
    return dict(
        sample=torch.randn((B, tiny.LATENT_CHANNELS, size, size), generator=g).to(dtype),
        timestep=t,
        encoder_hidden_states=tiny.text_embeddings(B, g).to(dtype),
        controlnet_cond=torch.rand((B, 3, size * factor, size * factor), generator=g).to(dtype),
    )


def controlnet_residuals(controlnet, inputs: dict, **kwargs):
    with torch.no_grad():
        down, mid = controlnet(**inputs, return_dict=False, **kwargs)
    return list(down), mid


def _shapes(tensors) -> str:
    kinds = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
    shapes = " ".join("(" + ",".join(map(str, t.shape)) + ")" for t in tensors)
    return f"{len(tensors)} {'/'.join(kinds)} tensors {shapes}"


class ShownTuple(tuple):
    """A tuple of tensors that failure messages show by shape (callees get a plain tuple)."""

    def __repr__(self) -> str:
        return "tuple of " + _shapes(self)


class ShownList(list):
    """A list of tensors that failure messages show by shape (callees get a plain list)."""

    def __repr__(self) -> str:
        return "list of " + _shapes(self)


# Long sequences are shown as "<type name> of N": let that read "list of 12", not "ShownList of 12".
ShownTuple.__name__, ShownList.__name__ = "tuple", "list"


# ---- zero_conv ----------------------------------------------------------------------------------------
zero_conv = Kata(
    "zero_conv",
    hints=(
        "A 1×1 convolution looks at one pixel at a time: at every (b, h, w) it is a matrix times the "
        "C-vector of channels, plus a bias.",
        "y[b, o, h, w] = Σ_c W[o, c] · x[b, c, h, w] + bias[o], with W = weight[:, :, 0, 0] of shape (C_out, C).",
        'torch.einsum("oc,bchw->bohw", weight[:, :, 0, 0], features) + bias[None, :, None, None]',
    ),
    # The reference is an nn.Conv2d: writing the conv as a product over channels is the exercise.
    # every convolution: each torch entry point (conv1d/2d/3d, transposed, torch.convolution, nn.Conv*), and at the
    # kernel (aten's convolution ops, however they were reached: torch.ops.aten, another dimension)
    answer_key=("torch.nn.functional.conv2d", "torch.conv2d", "torch.nn.Conv2d.forward", "torch.nn.functional:conv*",
                "torch:conv*", "torch:*convolution*", "torch.nn.modules.conv:*.forward",
                "torch.nn.modules.conv:*._conv_forward"),
    forbidden_ops=("convolution", "conv1d", "conv2d", "conv3d", "conv_transpose", "conv_tbc"),
)


def zero_conv_scenarios(case: dict, g, fresh: bool) -> list[Scenario]:
    """One scenario per zero conv of a ControlNet, on the feature that reached it in a forward."""
    unet, controlnet = models(case.get("layout", "tiny"), case.get("dtype", "float32"), fresh)
    convs = [(f"controlnet_down_blocks[{i}]", conv) for i, conv in enumerate(controlnet.controlnet_down_blocks)]
    convs.append(("controlnet_mid_block", controlnet.controlnet_mid_block))
    seen = {}
    hooks = [conv.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out)))
             for name, conv in convs]
    try:
        controlnet_residuals(controlnet, model_inputs(case, g))
    finally:
        for hook in hooks:
            hook.remove()
    return [Scenario(inputs=dict(features=seen[name][0].clone(), weight=conv.weight.detach().clone(),
                                 bias=conv.bias.detach().clone()),
                     expected=seen[name][1], exact=double(conv)(seen[name][0].double()),
                     label=name + (" of a fresh ControlNet" if fresh else ""))
            for name, conv in convs]


@zero_conv.check("vs ControlNet's 1x1 convs, randomised",
                 cases=[dict(layout="tiny", batch=2, size=8), dict(layout="sd", batch=1, size=16),
                        dict(layout="tiny", batch=3, size=8, dtype="float16")], tol=STEP_MATH)
def _(case, g):
    return zero_conv_scenarios(case, g, fresh=False)


@zero_conv.check("fresh ControlNet: exactly zero", cases=[dict(layout="tiny", batch=2, size=8)], tol=EXACT)
def _(case, g):
    return zero_conv_scenarios(case, g, fresh=True)


@zero_conv.trap("the weight transposed: W[c, o] instead of W[o, c]",
                hint="weight is (C_out, C_in, 1, 1): output channel first. Contract its SECOND axis "
                     "with the features' channel axis.")
def _(features, weight, bias):
    return torch.einsum("co,bchw->bohw", weight[:, :, 0, 0], features) + bias[None, :, None, None]


@zero_conv.trap("the bias left out",
                hint="A zero conv has a bias too (zero at init, like the weight): add bias[o] to every pixel "
                     "of output channel o.")
def _(features, weight, bias):
    return torch.einsum("oc,bchw->bohw", weight[:, :, 0, 0], features)


@zero_conv.trap("the bias added before the weight: W·(x + b)",
                hint="The bias belongs to the output channels and is added after the product: W·x + b.")
def _(features, weight, bias):
    return torch.einsum("oc,bchw->bohw", weight[:, :, 0, 0], features + bias[None, :, None, None])


@zero_conv.trap("channels moved last with reshape, not permute (pixels and channels scrambled)",
                hint="reshape keeps the memory order: (B, C, H, W).reshape(B, H·W, C) does not put a pixel's channels "
                     "together. Use features.permute(0, 2, 3, 1) (and back), or einsum('oc,bchw->bohw').")
def _(features, weight, bias):
    B, C, H, W = features.shape
    out = features.reshape(B, H * W, C) @ weight[:, :, 0, 0].T + bias
    return out.reshape(B, weight.shape[0], H, W)


# ---- scale_control_residuals ------------------------------------------------------------------------
scale_control_residuals = Kata(
    "scale_control_residuals",
    hints=(
        "Normally one number scales every residual, the mid one included. Guess mode hands out a ladder "
        "of scales, one per residual, small for the shallow skips and largest for the mid block.",
        "Guess mode: s = logspace(−1, 0, n + 1)·conditioning_scale for n down residuals; "
        "down[i]·s[i] and mid·s[n]. Otherwise everything · conditioning_scale.",
        "s = torch.logspace(-1, 0, len(down_residuals) + 1) * conditioning_scale; "
        "return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]",
    ),
    answer_key=("diffusers.models.controlnets.controlnet.ControlNetModel.forward",
                "diffusers.models.controlnets.**:*.forward"),  # every ControlNet's (Sparse, Union, Multi, XS...)
)


def scaling_scenario(case: dict, g) -> Scenario:
    layout, dtype = case.get("layout", "tiny"), case.get("dtype", "float32")
    _, controlnet = models(layout, dtype)
    inputs = model_inputs(case, g)
    raw_down, raw_mid = controlnet_residuals(controlnet, inputs)  # conditioning_scale=1.0: unscaled
    scale, guess = case["conditioning_scale"], case["guess_mode"]
    expected = controlnet_residuals(controlnet, inputs, conditioning_scale=scale, guess_mode=guess)
    # The shadow: ControlNetModel.forward's scaling on the same raw residuals, in float64.
    n = len(raw_down)
    scales = (torch.logspace(-1, 0, n + 1, dtype=torch.float64) * scale if guess
              else torch.full((n + 1,), scale, dtype=torch.float64))
    exact = ([d.double() * k for d, k in zip(raw_down, scales)], raw_mid.double() * scales[-1])
    return Scenario(inputs=dict(down_residuals=ShownList(raw_down), mid_residual=raw_mid, conditioning_scale=scale,
                                guess_mode=guess),
                    expected=expected, exact=exact, label=f"{len(raw_down)} down residuals + 1 mid")


@scale_control_residuals.check(
    "vs ControlNetModel.forward",
    cases=[dict(layout="tiny", batch=2, size=8, conditioning_scale=1.0, guess_mode=False),
           dict(layout="tiny", batch=1, size=16, conditioning_scale=0.45, guess_mode=False),
           dict(layout="tiny", batch=2, size=8, conditioning_scale=1.0, guess_mode=True),
           dict(layout="tiny", batch=3, size=8, conditioning_scale=1.6, guess_mode=True),
           dict(layout="sd", batch=1, size=16, conditioning_scale=0.8, guess_mode=True),
           dict(layout="sd", batch=2, size=16, conditioning_scale=0.7, guess_mode=False)],
    tol=SCHEDULE)
def _(case, g):
    return scaling_scenario(case, g)


# A tuple output gets no automatic float16 tolerance (for_dtype looks at a tensor's dtype): say it here.
@scale_control_residuals.check(
    "vs ControlNetModel.forward, float16",
    cases=[dict(layout="tiny", batch=2, size=8, conditioning_scale=0.8, guess_mode=False, dtype="float16"),
           dict(layout="tiny", batch=2, size=8, conditioning_scale=0.5, guess_mode=True, dtype="float16")],
    tol=HALF)
def _(case, g):
    return scaling_scenario(case, g)


def _ladder(n, scale):
    return torch.logspace(-1, 0, n + 1) * scale


@scale_control_residuals.trap("guess-mode scales reversed (1.0 on the shallowest skip, 0.1 on the mid block)",
                              hint="The ladder rises with depth: down_residuals[0] (conv_in's skip) gets "
                                   "0.1·scale and the mid residual gets the last entry, 1.0·scale.")
def _(down_residuals, mid_residual, conditioning_scale, guess_mode=False):
    if not guess_mode:
        return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
    s = _ladder(len(down_residuals), conditioning_scale).flip(0)
    return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]


@scale_control_residuals.trap("conditioning_scale applied to the mid residual only",
                              hint="conditioning_scale multiplies every residual the ControlNet returns: "
                                   "all the down residuals as well as the mid one.")
def _(down_residuals, mid_residual, conditioning_scale, guess_mode=False):
    if not guess_mode:
        return list(down_residuals), mid_residual * conditioning_scale
    s = torch.logspace(-1, 0, len(down_residuals) + 1)
    return [d * k for d, k in zip(down_residuals, s)], mid_residual * (s[-1] * conditioning_scale)


@scale_control_residuals.trap("conditioning_scale applied to the down residuals only",
                              hint="The mid residual is scaled too: by conditioning_scale, or by the ladder's "
                                   "last entry in guess mode.")
def _(down_residuals, mid_residual, conditioning_scale, guess_mode=False):
    if not guess_mode:
        return [d * conditioning_scale for d in down_residuals], mid_residual
    s = _ladder(len(down_residuals), conditioning_scale)
    return [d * k for d, k in zip(down_residuals, s)], mid_residual


@scale_control_residuals.trap("guess mode without conditioning_scale (the bare 0.1 → 1 ladder)",
                              hint="In guess mode the ladder is multiplied by conditioning_scale: "
                                   "logspace(−1, 0, n + 1) · conditioning_scale.")
def _(down_residuals, mid_residual, conditioning_scale, guess_mode=False):
    if not guess_mode:
        return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
    s = _ladder(len(down_residuals), 1.0)
    return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]


@scale_control_residuals.trap("a ladder of n scales for the down residuals, the mid one left at the flat scale",
                              hint="The ladder has n + 1 entries: one per down residual and one more, the "
                                   "largest, for the mid residual.")
def _(down_residuals, mid_residual, conditioning_scale, guess_mode=False):
    if not guess_mode:
        return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
    s = torch.logspace(-1, 0, len(down_residuals)) * conditioning_scale
    return [d * k for d, k in zip(down_residuals, s)], mid_residual * conditioning_scale


@scale_control_residuals.trap("a linear ladder (linspace 0.1 → 1) instead of a logarithmic one",
                              hint="The scales are evenly spaced in log10 from −1 to 0: torch.logspace(-1, 0, n + 1), "
                                   "not linspace(0.1, 1, n + 1).")
def _(down_residuals, mid_residual, conditioning_scale, guess_mode=False):
    if not guess_mode:
        return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
    s = torch.linspace(0.1, 1.0, len(down_residuals) + 1) * conditioning_scale
    return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]


# ---- add_control_residuals --------------------------------------------------------------------------
add_control_residuals = Kata(
    "add_control_residuals",
    hints=(
        "The down residuals do not touch the hidden state flowing down the encoder: each one joins the "
        "skip tensor an up block will concatenate later. The mid residual comes after the mid block.",
        "skips'[i] = skips[i] + down_residuals[i] (same order);  h = mid_block(mid_input) + mid_residual.",
        "return tuple(s + r for s, r in zip(skip_samples, down_residuals)), mid_block(mid_input) + mid_residual",
    ),
    answer_key=("diffusers.models.unets.unet_2d_condition.UNet2DConditionModel.forward",
                # every UNet model's own (not its blocks: the mid block is the kata's to call)
                "diffusers.models.unets.**:*UNet*Model.forward", "diffusers.models.unets.**:*UNet.forward",
                "diffusers.models.controlnets.**:*.forward"),
)


class BoundMidBlock:
    """The UNet's mid block with the arguments the UNet gave it bound, except the hidden state."""

    def __init__(self, block, args: tuple, kwargs: dict):
        self.block, self.args, self.kwargs = block, args, kwargs

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.block(hidden_states, *self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"{type(self.block).__name__}(h) with the timestep embedding and the text bound"


def record_unet(unet, inputs: dict, down=None, mid=None) -> dict:
    """Run the UNet (with the residuals, if given) and record the down path's skips, the mid block's
    input and bound arguments, and what each up block was given."""
    seen: dict = {"down": {}, "up": {}}

    def down_hook(i):
        return lambda m, args, out: seen["down"].__setitem__(i, tuple(out[1]))

    def up_hook(i):
        def hook(m, args, kwargs):
            seen["up"][i] = (kwargs["hidden_states"], tuple(kwargs["res_hidden_states_tuple"]))
        return hook

    def mid_hook(m, args, kwargs):
        seen["mid"] = (args[0], args[1:], dict(kwargs))

    hooks = [unet.conv_in.register_forward_hook(lambda m, args, out: seen.__setitem__("conv_in", out)),
             unet.mid_block.register_forward_pre_hook(mid_hook, with_kwargs=True)]
    hooks += [block.register_forward_hook(down_hook(i)) for i, block in enumerate(unet.down_blocks)]
    hooks += [block.register_forward_pre_hook(up_hook(i), with_kwargs=True)
              for i, block in enumerate(unet.up_blocks)]
    residuals = {} if down is None else dict(down_block_additional_residuals=down,
                                              mid_block_additional_residual=mid)
    try:
        with torch.no_grad():
            unet(**{k: v for k, v in inputs.items() if k != "controlnet_cond"}, **residuals)
    finally:
        for hook in hooks:
            hook.remove()
    ups = range(len(unet.up_blocks))
    return dict(
        skips=(seen["conv_in"],) + sum((seen["down"][i] for i in range(len(unet.down_blocks))), ()),
        mid=seen["mid"],
        # The up blocks take the skips from the end: the last up block holds the first skips.
        up_skips=sum((seen["up"][i][1] for i in reversed(ups)), ()),
        up_input=seen["up"][0][0],
    )


def residual_scenario(case: dict, g, fresh: bool) -> Scenario:
    unet, controlnet = models(case.get("layout", "tiny"), case.get("dtype", "float32"), fresh)
    inputs = model_inputs(case, g)
    down, mid = controlnet_residuals(controlnet, inputs)
    # Fresh: the residuals are zeros, and the up blocks must get what they get with no ControlNet.
    run = record_unet(unet, inputs) if fresh else record_unet(unet, inputs, down, mid)
    mid_input, mid_args, mid_kwargs = run["mid"]
    # The shadow, computed where an output is outside the tolerance: the same sums, and the mid block on a
    # float64 copy with its arguments widened.
    exact = functools.partial(_shadow_residuals, unet.mid_block, mid_input, mid_args, mid_kwargs, run["skips"], down,
                              mid)
    return Scenario(
        inputs=dict(skip_samples=ShownTuple(s.clone() for s in run["skips"]), mid_input=mid_input.clone(),
                    mid_block=BoundMidBlock(unet.mid_block, mid_args, mid_kwargs),
                    down_residuals=ShownList(down), mid_residual=mid),
        expected=(run["up_skips"], run["up_input"]), exact=exact,
        label=(f"{len(down)} skips, t={int(inputs['timestep'])}"
               + (": a fresh ControlNet, so the up blocks must see what they see without it" if fresh else "")))


@add_control_residuals.check(
    "vs UNet2DConditionModel.forward",
    # "flat" first: its skips all have one shape, so a residual on the wrong skip gives wrong values (named
    # below) instead of a shape error.
    cases=[dict(layout="flat", batch=2, size=8), dict(layout="tiny", batch=2, size=8, t=999),
           dict(layout="tiny", batch=1, size=16, t=0), dict(layout="sd", batch=2, size=16),
           dict(layout="tiny", batch=2, size=8, dtype="float16")],
    tol=EXACT)
def _(case, g):
    return residual_scenario(case, g, fresh=False)


@add_control_residuals.check("fresh ControlNet: UNet unchanged", cases=[dict(layout="tiny", batch=2, size=8)],
                             tol=EXACT)
def _(case, g):
    return residual_scenario(case, g, fresh=True)


@add_control_residuals.trap("the mid residual added to the mid block's input instead of its output",
                            hint="Run the mid block on mid_input as it is, then add mid_residual to what "
                                 "it returns: mid_block(mid_input) + mid_residual.")
def _(skip_samples, mid_input, mid_block, down_residuals, mid_residual):
    return (tuple(s + r for s, r in zip(skip_samples, down_residuals)), mid_block(mid_input + mid_residual))


@add_control_residuals.trap("the down residuals never added to the skips",
                            hint="Each down residual is added to its skip tensor: the up blocks concatenate "
                                 "skip + residual, not the bare skip.")
def _(skip_samples, mid_input, mid_block, down_residuals, mid_residual):
    return tuple(skip_samples), mid_block(mid_input) + mid_residual


@add_control_residuals.trap("the last down residual also added to the hidden state (the mid block's input)",
                            hint="The down residuals change only the skips. In diffusers the last skip and "
                                 "the mid block's input are one tensor; `skip + r` makes a new one, so the "
                                 "mid block still reads the hidden state without the residual.")
def _(skip_samples, mid_input, mid_block, down_residuals, mid_residual):
    return (tuple(s + r for s, r in zip(skip_samples, down_residuals)),
            mid_block(mid_input + down_residuals[-1]) + mid_residual)


@add_control_residuals.trap("the down residuals added in reversed order (the last residual on the first skip)",
                            hint="down_residuals come in the same order as skip_samples, shallowest first: "
                                 "residual i goes onto skip i (zip them as they are). Only the up blocks read "
                                 "the skips from the end.")
def _(skip_samples, mid_input, mid_block, down_residuals, mid_residual):
    return (tuple(s + r for s, r in zip(skip_samples, list(down_residuals)[::-1])),
            mid_block(mid_input) + mid_residual)


@add_control_residuals.trap("the skips returned in the order the up blocks use them (reversed)",
                            hint="Return the skips in down-path order, shallowest first, as skip_samples "
                                 "comes; the UNet itself takes them from the end.")
def _(skip_samples, mid_input, mid_block, down_residuals, mid_residual):
    skips = tuple(s + r for s, r in zip(skip_samples, down_residuals))
    return skips[::-1], mid_block(mid_input) + mid_residual


# ---- controlnet_cfg_step ----------------------------------------------------------------------------
controlnet_cfg_step = Kata(
    "controlnet_cfg_step",
    hints=(
        "Follow the pipeline's loop body: CFG batch [uncond, cond], ControlNet residuals for that batch, "
        "the UNet with both residual kinds, guidance, scheduler.step. Guess mode changes only what "
        "ControlNet sees and what the unconditional half gets.",
        "x2 = cat([x, x]); text = cat([neg, pos]); normal: controlnet(x2, t, text, cat([image, image])); "
        "guess: controlnet(x, t, pos, image) then cat([zeros, r]) per residual; "
        "ε = unet(x2, t, text, residuals); ε̂ = ε_u + w·(ε_c − ε_u); x_{t−1} = step(ε̂, t, x).",
        "down, mid = controlnet(c_in, timestep, encoder_hidden_states=c_text, controlnet_cond=c_img, "
        "conditioning_scale=conditioning_scale, guess_mode=guess_mode, return_dict=False); "
        "noise = unet(x2, timestep, encoder_hidden_states=text, down_block_additional_residuals=down, "
        "mid_block_additional_residual=mid).sample",
    ),
    answer_key=(f"{PIPELINE}.__call__", EVERY_PIPELINE_CALL),
)


class Shown:
    """A model or scheduler handed to the learner as it is (calls and attributes go straight through),
    shown in failure messages by a one-line description instead of its many-line repr."""

    def __init__(self, obj, description: str):
        self._obj, self._description = obj, description

    def __call__(self, *args, **kwargs):
        return self._obj(*args, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_obj", "_description"):
            raise AttributeError(name)
        return getattr(self._obj, name)

    def __deepcopy__(self, memo):  # the plugin gives each callee its own copy of a scheduler
        import copy

        return Shown(copy.deepcopy(self._obj, memo), self._description)

    def __repr__(self) -> str:
        return self._description


def controlnet_pipeline_class():
    """Import the pipeline module once, without transformers' warnings about torchvision (its CLIP
    image processors fall back to PIL here) ending up in a learner's failure output."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        from diffusers.pipelines.controlnet.pipeline_controlnet import StableDiffusionControlNetPipeline
    finally:
        hf_logging.set_verbosity(level)
    return StableDiffusionControlNetPipeline


STEP_CASES = [
    dict(batch=1, spacing="leading", guidance_scale=7.5, conditioning_scale=1.0, guess_mode=False),
    dict(batch=2, spacing="trailing", guidance_scale=5.0, conditioning_scale=0.6, guess_mode=False),
    dict(batch=2, spacing="leading", guidance_scale=4.0, conditioning_scale=1.0, guess_mode=True),
    dict(batch=1, spacing="trailing", guidance_scale=3.0, conditioning_scale=0.7, guess_mode=True),
    # Euler: scale_model_input divides by √(σ² + 1) (DDIM's is the identity), both for the UNet's batch and for
    # ControlNet's input, and the latents start at init_noise_sigma
    dict(batch=1, spacing="leading", guidance_scale=5.0, conditioning_scale=0.8, guess_mode=False, scheduler="euler"),
    dict(batch=2, spacing="trailing", guidance_scale=4.0, conditioning_scale=1.0, guess_mode=True, scheduler="euler"),
]


def _at_its_step(scheduler):
    """A copy of the pipeline's scheduler that finds its step from the timestep it is given (Euler counts its
    steps; a copy handed to one step must not carry the whole run's count)."""
    own = copy.deepcopy(scheduler)
    if hasattr(own, "_step_index"):
        own._step_index = None
        own._begin_index = None
    return own


@controlnet_cfg_step.check("vs StableDiffusionControlNetPipeline", cases=STEP_CASES, tol=MODEL_FORWARD)
def _(case, g):
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    StableDiffusionControlNetPipeline = controlnet_pipeline_class()
    unet, controlnet = models("tiny")
    # "leading" with steps_offset 0 ends at t = 0; "trailing" starts at t = 999.
    if case.get("scheduler") == "euler":
        from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler

        scheduler = EulerDiscreteScheduler(**sd_schedule(timestep_spacing=case["spacing"]))
    else:
        scheduler = DDIMScheduler(**sd_schedule(clip_sample=False, set_alpha_to_one=False,
                                                timestep_spacing=case["spacing"]))
    with quiet_diffusers():
        pipe = StableDiffusionControlNetPipeline(
            vae=tiny.vae(), text_encoder=None, tokenizer=None, unet=unet, controlnet=controlnet,
            scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    B, size = case["batch"], 8
    prompt_embeds, negative_prompt_embeds = tiny.text_embeddings(B, g), tiny.text_embeddings(B, g)
    control_image = torch.rand((B, 3, 2 * size, 2 * size), generator=g)
    latents = torch.randn((B, tiny.LATENT_CHANNELS, size, size), generator=g)
    after: list[tuple] = []

    def record(pipeline, i, t, kwargs):
        after.append((t, kwargs["latents"].clone()))
        return {}

    pipe(prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds, image=control_image,
         height=2 * size, width=2 * size, num_inference_steps=3, guidance_scale=case["guidance_scale"],
         controlnet_conditioning_scale=case["conditioning_scale"], guess_mode=case["guess_mode"],
         latents=latents.clone(), output_type="latent", callback_on_step_end=record,
         callback_on_step_end_tensor_inputs=["latents"])
    name = type(pipe.scheduler).__name__
    scenarios, before = [], latents * pipe.scheduler.init_noise_sigma  # as prepare_latents scales given latents
    for number, (t, expected) in enumerate(after, 1):
        shown = dict(unet=Shown(unet, "UNet2DConditionModel (tiny: 4 latent channels, text width 32)"),
                     controlnet=Shown(controlnet, "ControlNetModel (from_unet of that UNet, control image ×2 "
                                                  "the latent size)"),
                     scheduler=Shown(_at_its_step(pipe.scheduler), f"{name} ({case['spacing']} spacing, "
                                                                  f"timesteps {pipe.scheduler.timesteps.tolist()})"))
        # The shadow: the pipeline's loop body on float64 copies of its models and scheduler tables. Built with the
        # case, not deferred: a right step is within the tolerance only with it (Euler's latents reach tens), and
        # a case is built while the runner computes the one before.
        exact = _shadow_step(unet, controlnet, _at_its_step(pipe.scheduler), before, t, prompt_embeds,
                             negative_prompt_embeds, control_image, case)
        scenarios.append(Scenario(
            inputs=dict(**shown, latents=before.clone(),
                        timestep=t, prompt_embeds=prompt_embeds, negative_prompt_embeds=negative_prompt_embeds,
                        control_image=control_image, guidance_scale=case["guidance_scale"],
                        conditioning_scale=case["conditioning_scale"], guess_mode=case["guess_mode"]),
            expected=expected, exact=exact, label=f"step {number}/{len(after)}, t={int(t)}"))
        before = expected
    return scenarios


def _shadow_residuals(mid_block, mid_input, mid_args, mid_kwargs, skips, down, mid):
    wide = lambda v: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
    with torch.no_grad():
        mid_out = double(mid_block)(mid_input.double(), *map(wide, mid_args), **{k: wide(v) for k, v in mid_kwargs.items()})
    return tuple(s.double() + r.double() for s, r in zip(skips, down)), mid_out + mid.double()


def _shadow_step(unet, controlnet, scheduler, before, t, prompt_embeds, negative_prompt_embeds, control_image, case):
    return _step(unet=double(unet), controlnet=double(controlnet), scheduler=float64_twin(scheduler),
                 latents=before.double(), timestep=t, prompt_embeds=prompt_embeds.double(),
                 negative_prompt_embeds=negative_prompt_embeds.double(), control_image=control_image.double(),
                 guidance_scale=case["guidance_scale"], conditioning_scale=case["conditioning_scale"],
                 guess_mode=case["guess_mode"], control="guess")


def double(module):
    """A float64 copy of a module: run on float64 inputs, diffusers' own forward is the shadow. One copy per module
    and state of its weights (a check's models are built once and shared by its cases and steps: the step check
    copied the UNet and the ControlNet at every step)."""
    state = tuple(t._version for t in (*module.parameters(), *module.buffers()))
    kept = _DOUBLES.get(module)
    if kept is None or kept[0] != state:
        kept = _DOUBLES[module] = (state, copy.deepcopy(module).double())
    return kept[1]


_DOUBLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # module -> (its weights' versions, float64 copy)


def _step(unet, controlnet, scheduler, latents, timestep, prompt_embeds, negative_prompt_embeds, control_image,
          guidance_scale, conditioning_scale, guess_mode, *, control="normal", swap_halves=False,
          pass_scale=True, pass_guess=True, scaled=True, control_scaled=True, step_scaled=False, scale_twice=False):
    """One step with a chosen mistake; control: "guess" (right), "guess both halves", "guess zeros last";
    scaled: the models' input through scale_model_input (control_scaled: ControlNet's too), step_scaled: the
    scaled latents given to scheduler.step."""
    scheduler = copy.deepcopy(scheduler)  # its own count of steps (Euler), as the learner's copy has
    raw = latents
    x2, text = scheduler.scale_model_input(torch.cat([latents] * 2), timestep), \
        torch.cat([negative_prompt_embeds, prompt_embeds])
    if not scaled:
        x2 = torch.cat([latents] * 2)
    latents = scheduler.scale_model_input(latents, timestep) if scaled else latents  # ControlNet's guess input
    if step_scaled:
        raw = latents
    control_x2 = x2 if control_scaled else torch.cat([raw] * 2)
    if not control_scaled:
        latents = raw
    extra = dict(conditioning_scale=conditioning_scale) if pass_scale else {}
    guess = guess_mode if pass_guess else False
    with torch.no_grad():
        if guess_mode and control in ("guess", "guess zeros last"):
            down, mid = controlnet(latents, timestep, encoder_hidden_states=prompt_embeds, controlnet_cond=control_image,
                                   guess_mode=guess, return_dict=False, **extra)
            pad = (lambda r: torch.cat([r, torch.zeros_like(r)])) if control == "guess zeros last" else (
                lambda r: torch.cat([torch.zeros_like(r), r]))
            down, mid = [pad(d) for d in down], pad(mid)
        else:
            down, mid = controlnet(control_x2, timestep, encoder_hidden_states=text,
                                   controlnet_cond=torch.cat([control_image] * 2), guess_mode=guess,
                                   return_dict=False, **extra)
        if scale_twice:  # the residuals, already scaled inside ControlNet, multiplied by the scale again
            down, mid = [d * conditioning_scale for d in down], mid * conditioning_scale
        noise = unet(x2, timestep, encoder_hidden_states=text, down_block_additional_residuals=down,
                     mid_block_additional_residual=mid).sample
    u, c = noise.chunk(2)
    if swap_halves:
        u, c = c, u
    return scheduler.step(u + guidance_scale * (c - u), timestep, raw).prev_sample


@controlnet_cfg_step.trap("the latents not passed through scheduler.scale_model_input (Euler divides by √(σ² + 1))",
                          hint="Scale what the models see: scheduler.scale_model_input(torch.cat([latents] * 2), t) "
                               "for the UNet's batch, and scale_model_input(latents, t) for ControlNet in guess mode; "
                               "scheduler.step takes the unscaled latents. DDIM's scaling is the identity, Euler's is "
                               "not.")
def _(**kw):
    return _step(**kw, scaled=False, control="guess")


@controlnet_cfg_step.trap("ControlNet fed the unscaled latents (only the UNet's input through scale_model_input)",
                          hint="ControlNet sees what the UNet sees: the scaled batch scale_model_input(cat([x, x]), t) "
                               "(in guess mode scale_model_input(x, t)). Euler's scaling divides by √(σ² + 1).")
def _(**kw):
    return _step(**kw, control="guess", control_scaled=False)


@controlnet_cfg_step.trap("scheduler.step given the scaled latents (scale_model_input's output kept as the latents)",
                          hint="scale_model_input makes the models' input only: keep the latents as they came "
                               "and pass those to scheduler.step(ε̂, t, latents).")
def _(**kw):
    return _step(**kw, control="guess", step_scaled=True)


@controlnet_cfg_step.trap("guess mode: ControlNet run on both halves instead of the conditional half only",
                          hint="In guess mode ControlNet sees only the conditional latents and prompt_embeds "
                               "(and the control image once); the unconditional half gets zero residuals.")
def _(**kw):
    return _step(**kw, control="guess both halves")


@controlnet_cfg_step.trap("guess mode: the zero residuals given to the conditional half",
                          hint="The batch is [uncond, cond]: pad as torch.cat([torch.zeros_like(r), r]), "
                               "zeros first.")
def _(**kw):
    return _step(**kw, control="guess zeros last")


@controlnet_cfg_step.trap("guess mode not passed to the ControlNet (one flat scale)",
                          hint="Pass guess_mode=guess_mode to controlnet(...): it switches the residual "
                               "scales to the 0.1 → 1 ladder.")
def _(**kw):
    return _step(**kw, control="guess", pass_guess=False)


@controlnet_cfg_step.trap("conditioning_scale not passed to the ControlNet",
                          hint="controlnet(..., conditioning_scale=conditioning_scale): without it every "
                               "residual keeps scale 1.0.")
def _(**kw):
    return _step(**kw, control="guess", pass_scale=False)


@controlnet_cfg_step.trap("conditioning_scale applied twice (passed to the ControlNet, then its residuals multiplied "
                          "by it again)",
                          hint="ControlNet scales its residuals itself when given conditioning_scale (and the guess "
                               "ladder with it): pass it once, and add the residuals it returns as they are.")
def _(**kw):
    return _step(**kw, control="guess", scale_twice=True)


@controlnet_cfg_step.trap("the unconditional and conditional predictions swapped in the guidance",
                          hint="The batch is [uncond, cond] (negative_prompt_embeds first), so noise.chunk(2) "
                               "gives (uncond, cond): ε̂ = ε_u + w·(ε_c − ε_u).")
def _(**kw):
    return _step(**kw, control="guess", swap_halves=True)
