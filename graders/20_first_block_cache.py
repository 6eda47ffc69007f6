"""Grader for lab 20 · First Block Cache, against diffusers' cache hooks on a tiny Flux transformer.

residual_change is graded against the δ that FBCHeadBlockHook._should_compute_remaining_blocks computes and
compares with its threshold (the live method, on a state holding the cached residual; its `.item()` recorded),
with the same method run on float64 residuals as the shadow.

first_block_cache_step and cached_transformer_calls are graded against FluxTransformer2DModel.enable_cache(
FirstBlockCacheConfig(threshold)) on a tiny random Flux transformer, run the way FluxPipeline runs it: a
FlowMatchEulerDiscreteScheduler loop, each transformer call under cache_context("cond") or, with true CFG,
("uncond"). Torch hooks on the hooked model's first and last blocks record, at every call, the first block's
inputs, diffusers' cache state (FBCSharedBlockState) before and after, and the last block's outputs. The learner's
functions get unhooked copies of the same blocks, counted. Each run's threshold starts at the case's value and is
moved until the run has both skipped and computed calls and no δ within 2% of it (a decision never turns on
rounding); the label gives the threshold used. One more check pins the comparison itself: the same call twice at
threshold 0, where δ = 0 exactly and diffusers skips (δ > threshold, not ≥).
"""
import copy

import torch

from diffusion_katas.core.spec import Kata, Measurement, Scenario
from diffusion_katas.core.tolerances import CACHED_BLOCKS, RELATIVE_CHANGE

FBC = "diffusers.hooks.first_block_cache"
ANSWER_KEY = (f"{FBC}.FBCHeadBlockHook.new_forward", f"{FBC}.FBCBlockHook.new_forward",
              f"{FBC}.FBCHeadBlockHook._should_compute_remaining_blocks", f"{FBC}.apply_first_block_cache")

# ---- residual_change --------------------------------------------------------------------------------
residual_change = Kata(
    "residual_change",
    hints=(
        "How far did this step's first-block residual move from the cached one, relative to the cached one? "
        "One number over every element.",
        "δ = mean|r − r_cached| / mean|r_cached|: an L1 change relative to the cached residual's own size.",
        "return float((residual - cached_residual).abs().mean() / cached_residual.abs().mean())",
    ),
    answer_key=ANSWER_KEY,
)


class _ItemSpy(torch.overrides.TorchFunctionMode):
    """Records every Tensor.item() result while active: the δ diffusers' hook turns into a Python float."""

    def __init__(self):
        super().__init__()
        self.values = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.item:
            self.values.append(out)
        return out


def hook_delta(residual: torch.Tensor, cached: torch.Tensor) -> float:
    """δ as FBCHeadBlockHook._should_compute_remaining_blocks computes it, on a state holding `cached`."""
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook, FBCSharedBlockState
    from diffusers.hooks.hooks import CacheContext, StateManager

    manager = StateManager(FBCSharedBlockState, (), {})
    manager.set_context(CacheContext("cond"))
    manager.get_state().head_block_residual = cached
    with _ItemSpy() as spy:
        FBCHeadBlockHook(manager, threshold=0.0)._should_compute_remaining_blocks(residual)
    assert len(spy.values) == 1, spy.values
    return spy.values[0]


def _residuals(kind: str, shape, dtype, g):
    cached = torch.randn(*shape, generator=g, dtype=torch.float64)
    noise = torch.randn(*shape, generator=g, dtype=torch.float64)
    if kind == "close":  # a late step: the residual barely moved
        residual = cached + 0.05 * noise
    elif kind == "grown":  # the residual grew: its own mean differs from the cached one's
        residual = 1.8 * cached + 0.3 * noise
    elif kind == "shrunk":
        residual = 0.4 * cached + 0.2 * noise
    elif kind == "outlier_channels":  # a DiT's few massive-activation channels dominate any L2 norm, not the L1 mean
        cached[..., :2] *= 30.0
        residual = cached + 0.3 * noise
    else:  # "moved": an early step, a large change
        residual = cached + noise
    return residual.to(dtype), cached.to(dtype)


CHANGE_CASES = [dict(kind="close", shape=(1, 16, 16), dtype="float32"),
                dict(kind="grown", shape=(2, 12, 32), dtype="float32"),
                dict(kind="shrunk", shape=(1, 20, 8), dtype="float64"),
                dict(kind="moved", shape=(3, 7, 16), dtype="float32"),
                dict(kind="grown", shape=(1, 9, 24), dtype="float64"),
                dict(kind="outlier_channels", shape=(2, 10, 32), dtype="float32")]


@residual_change.check("vs FBCHeadBlockHook's δ", cases=CHANGE_CASES, tol=RELATIVE_CHANGE)
def _(case, g):
    residual, cached = _residuals(case["kind"], case["shape"], getattr(torch, case["dtype"]), g)
    return Scenario(inputs=dict(residual=residual, cached_residual=cached), expected=hook_delta(residual, cached),
                    exact=hook_delta(residual.double(), cached.double()),
                    label=f"a {case['kind']} residual, {case['dtype']}")


@residual_change.trap("δ relative to the current residual (÷ mean|r| instead of mean|r_cached|)",
                      hint="The yardstick is the cached residual: δ asks how far this step moved from the last "
                           "full step, measured in that step's own size. Divide by mean|cached_residual|.")
def _(residual, cached_residual):
    return float((residual - cached_residual).abs().mean() / residual.abs().mean())


@residual_change.trap("the signed mean of the difference (no abs: positive and negative changes cancel)",
                      hint="mean(r − r_cached) is close to 0 for any change that goes both ways: take the "
                           "absolute value of each difference before the mean.")
def _(residual, cached_residual):
    return float((residual - cached_residual).mean().abs() / cached_residual.abs().mean())


@residual_change.trap("δ per sample, then averaged over the batch (a mean of ratios)",
                      hint="One δ for the whole batch: mean|r − r_cached| over every element, divided by "
                           "mean|r_cached| over every element. A quiet sample's ratio would otherwise count as much "
                           "as a loud one's.")
def _(residual, cached_residual):
    r, c = residual.double().flatten(1), cached_residual.double().flatten(1)
    return float(((r - c).abs().mean(1) / c.abs().mean(1)).mean())


@residual_change.trap("an L2 change ‖r − r_cached‖ / ‖r_cached‖ instead of the mean absolute one",
                      hint="First Block Cache (like TeaCache) uses the relative L1 change: mean absolute values, "
                           "not Euclidean norms. The threshold's scale is made for that number.")
def _(residual, cached_residual):
    return float((residual - cached_residual).norm() / cached_residual.norm())


# ---- the hooked tiny Flux transformer ----------------------------------------------------------------
IN_CHANNELS, JOINT_DIM, POOLED_DIM = 4, 16, 8


class CountedBlocks(torch.nn.ModuleList):
    """A ModuleList of Flux blocks that logs the index of every block called (in `calls`); slices share the log.
    Each block is remote (`_Counted`): the learner's runner gets stand-ins, and every call runs and is logged
    here, so `calls` is the grader's own record: the runner's copy of the list is never read back."""

    def __init__(self, modules=None, config=None):
        modules = list(modules or [])
        if modules and not all(isinstance(m, _Counted) for m in modules):
            log: list[int] = []
            modules = [_Counted(m, i, log) for i, m in enumerate(modules)]
        super().__init__(modules)
        self.calls = modules[0].log if modules else []
        self.config = config  # what these blocks are (for describing them)

    def __repr__(self) -> str:
        c = self.config or {}
        return (f"{len(self)} Flux blocks ({c.get('double_stream')} double-stream, {c.get('single_stream')} "
                f"single-stream; tiny, random weights; block calls counted)")


class _Counted(torch.nn.Module):
    kata_remote = True

    def __init__(self, block, index, log):
        super().__init__()
        self.block, self.index, self.log = block, index, log

    def remote_view(self) -> dict:
        return dict(label=f"Flux block {self.index} ({type(self.block).__name__}, tiny; calls counted)")

    def forward(self, *args, **kwargs):
        self.log.append(self.index)
        return self.block(*args, **kwargs)


def make_transformer(double_stream: int, single_stream: int):
    """A tiny FluxTransformer2DModel (random weights from the global RNG): 2 heads of 8, rotary axes (2, 2, 4)."""
    from diffusers import FluxTransformer2DModel

    return FluxTransformer2DModel(patch_size=1, in_channels=IN_CHANNELS, num_layers=double_stream,
                                  num_single_layers=single_stream, attention_head_dim=8, num_attention_heads=2,
                                  joint_attention_dim=JOINT_DIM, pooled_projection_dim=POOLED_DIM,
                                  guidance_embeds=False, axes_dims_rope=(2, 2, 4)).eval().requires_grad_(False)


def counted_blocks(model) -> CountedBlocks:
    """Unhooked copies of the model's blocks in the order its forward runs them, counted."""
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    return CountedBlocks(copy.deepcopy(blocks), config=dict(double_stream=len(model.transformer_blocks),
                                                            single_stream=len(model.single_transformer_blocks),
                                                            dim=model.inner_dim))


def _snapshot(state):
    """diffusers' FBCSharedBlockState as this lab's cache dict (None before the context's first call)."""
    if state.head_block_residual is None:
        return None
    hid, enc = state.head_block_output[0], state.head_block_output[1]
    tail_hid, tail_enc = state.tail_block_residuals
    return {"head_residual": state.head_block_residual.clone(), "head_output": (hid.clone(), enc.clone()),
            "tail_residuals": (tail_hid.clone(), tail_enc.clone()), "should_compute": bool(state.should_compute)}


def _inputs(case, g):
    B, (h, w), L = case["batch"], case["hw"], case["text"]
    latents = torch.randn(B, h * w, IN_CHANNELS, generator=g)
    prompts = [(torch.randn(B, L, JOINT_DIM, generator=g), torch.randn(B, POOLED_DIM, generator=g))
               for _ in range(2)]  # the prompt's, then the negative prompt's
    if case.get("negative") == "close":  # a negative prompt a little off the prompt: the two contexts' first-block
        (embeds, pooled), (other, other_pooled) = prompts  # residuals are then close, and only keying the caches
        prompts[1] = (embeds + 0.03 * other, pooled + 0.03 * other_pooled)  # by context tells them apart
    if case.get("negative") == "far":  # a negative prompt far from the prompt (4× its scale): the two contexts'
        other, other_pooled = prompts[1]  # residuals change at different paces, and their decisions part
        prompts[1] = (4 * other, 4 * other_pooled)
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return latents, prompts, img_ids.reshape(h * w, 3), torch.zeros(L, 3)


def hooked(pristine, threshold: float):
    """A copy of `pristine` with First Block Cache at `threshold`, and the list its torch hooks fill: per transformer
    call, the first block's inputs, diffusers' cache before and after, the last block's outputs."""
    from diffusers.hooks import FirstBlockCacheConfig

    model = copy.deepcopy(pristine)
    model.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    head = model.transformer_blocks[0]._diffusers_hook.get_hook("fbc_leader_block_hook")
    last = [*model.transformer_blocks, *model.single_transformer_blocks][-1]
    calls = []

    def before(module, args, kwargs):
        calls.append(dict(context=head.state_manager.context.name,
                          hidden_states=kwargs["hidden_states"].clone(),
                          encoder_hidden_states=kwargs["encoder_hidden_states"].clone(), temb=kwargs["temb"].clone(),
                          image_rotary_emb=tuple(t.clone() for t in kwargs["image_rotary_emb"]),
                          cache_before=_snapshot(head.state_manager.get_state())))

    def after(module, args, kwargs, output):
        enc, hid = output
        calls[-1].update(output=(hid.clone(), enc.clone()), cache_after=_snapshot(head.state_manager.get_state()))

    model.transformer_blocks[0].register_forward_pre_hook(before, with_kwargs=True)
    last.register_forward_hook(after, with_kwargs=True)
    return model, calls


def record_run(pristine, case, start, threshold: float) -> list[dict]:
    """FluxPipeline's denoising loop on a hooked copy of `pristine`, from the inputs `start`: every call recorded."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    model, calls = hooked(pristine, threshold)
    latents, prompts, img_ids, txt_ids = start
    latents = latents.clone()
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(case["steps"])
    contexts = ("cond", "uncond") if case["cfg"] else ("cond",)
    for t in scheduler.timesteps:
        timestep = t.expand(latents.shape[0]).to(latents.dtype) / 1000
        preds = []
        for context, (embeds, pooled) in zip(contexts, prompts):
            with model.cache_context(context):
                preds.append(model(hidden_states=latents, timestep=timestep, pooled_projections=pooled,
                                   encoder_hidden_states=embeds, txt_ids=txt_ids, img_ids=img_ids,
                                   return_dict=False)[0])
        v = preds[0] if len(preds) == 1 else preds[1] + case["cfg"] * (preds[0] - preds[1])
        latents = scheduler.step(v, t, latents).prev_sample
    model._reset_stateful_cache()  # as the pipeline does at the end of a generation
    return calls


def _deltas(blocks, calls) -> list[float | None]:
    """Each call's δ in float64 (None where nothing was cached): for keeping thresholds away from them."""
    out = []
    for call in calls:
        if call["cache_before"] is None:
            out.append(None)
            continue
        _, hid = blocks[0].block(hidden_states=call["hidden_states"], encoder_hidden_states=call["encoder_hidden_states"],
                                 temb=call["temb"], image_rotary_emb=call["image_rotary_emb"])
        r, c = (hid - call["hidden_states"]).double(), call["cache_before"]["head_residual"].double()
        out.append(float((r - c).abs().mean() / c.abs().mean()))
    return out


def run(case, g):
    """A tiny transformer, its inputs, and a recorded cached run whose threshold separates skips from full runs; with
    `contexts_differ`, one where the cond and uncond calls of some step decide differently (each context keeps its
    own cache: an uncond call that follows the cond call's decision must show), where a threshold within a factor
    of 1.2 of the first one gives that."""
    pristine = make_transformer(*case["layers"])
    blocks = counted_blocks(pristine)
    start = _inputs(case, g)
    threshold = case["start_threshold"]
    for _ in range(40):
        calls = record_run(pristine, case, start, threshold)
        verdict = _separates(blocks, calls, threshold)
        if verdict == "ok":
            break
        threshold *= {"never skips": 1.25, "always skips": 1 / 1.25, "too close": 1.03}[verdict]
    else:
        raise RuntimeError(f"no threshold separates this run's skips from its full runs: {case}")
    if case.get("contexts_differ") and not _contexts_differ(calls):
        for k in range(1, 24):  # outwards from the threshold found, 1.5% at a time, up to ×1.2 and ÷1.2
            near = threshold * 1.015 ** (k // 2 + 1 if k % 2 else -(k // 2))
            other = record_run(pristine, case, start, near)
            if _contexts_differ(other) and _separates(blocks, other, near) == "ok":
                calls, threshold = other, near
                break
    blocks.calls.clear()
    return blocks, calls, threshold


def _separates(blocks, calls, threshold) -> str:
    """Whether a run both skips and runs every block, with no δ within 2% of the threshold: "ok", or what is wrong."""
    deltas = [d for d in _deltas(blocks, calls) if d is not None]
    skipped = sum(not c["cache_after"]["should_compute"] for c in calls)
    if skipped == 0:
        return "never skips"
    if skipped == len(deltas):
        return "always skips"
    if any(abs(d - threshold) <= 0.02 * threshold for d in deltas):
        return "too close"
    return "ok"


def _contexts_differ(calls) -> bool:
    """Whether some step's cond and uncond calls (in that order) made different decisions."""
    return any(a["cache_after"]["should_compute"] != b["cache_after"]["should_compute"]
               for a, b in zip(calls[0::2], calls[1::2]))


def _threshold(threshold, case) -> str:
    return (f"threshold {threshold:.4g} (moved from the case's {case['start_threshold']:g} until the run both skips "
            "and runs every block, and no δ is within 2% of it)")


def _label(calls, i, threshold, case):
    call = calls[i]
    ran = call["cache_after"]["should_compute"]
    return (f"call {i + 1}/{len(calls)} ({call['context']}), {_threshold(threshold, case)}: diffusers "
            + ("ran every block" + (" (nothing cached yet)" if call["cache_before"] is None else "")
               if ran else "skipped blocks[1:]"))


# ---- first_block_cache_step -----------------------------------------------------------------------------
first_block_cache_step = Kata(
    "first_block_cache_step",
    hints=(
        "The first block always runs. Its residual decides: compare it with the cached one; then either run "
        "every other block and cache what this step did, or add what the other blocks added last time.",
        "r = x₁ − x; compute if cache is None or δ(r, cache['head_residual']) > threshold, then cache r, (x₁, c₁) "
        "and (x_N − x₁, c_N − c₁); else return (x₁ + tail_x, c₁ + tail_c) with the cache unchanged but "
        "should_compute False.",
        "enc1, hid1 = blocks[0](hidden_states=..., ...); r = hid1 - hidden_states; if cache is None or "
        "residual_change(r, cache['head_residual']) > threshold: hid, enc = run_blocks(blocks[1:], hid1, enc1, "
        "temb, image_rotary_emb); return hid, enc, {'head_residual': r, 'head_output': (hid1, enc1), "
        "'tail_residuals': (hid - hid1, enc - enc1), 'should_compute': True}; else: th, te = "
        "cache['tail_residuals']; return hid1 + th, enc1 + te, {**cache, 'should_compute': False}",
    ),
    answer_key=ANSWER_KEY,
)

STEP_CASES = [
    dict(layers=(2, 2), hw=(4, 4), text=5, batch=1, steps=8, cfg=0.0, start_threshold=0.15),
    dict(layers=(1, 3), hw=(3, 5), text=3, batch=2, steps=6, cfg=3.0, start_threshold=0.2),
    dict(layers=(3, 1), hw=(4, 2), text=4, batch=1, steps=7, cfg=0.0, start_threshold=0.1),
]


@first_block_cache_step.check("vs the hooked Flux transformer, call by call", cases=STEP_CASES, tol=CACHED_BLOCKS)
def _(case, g):
    blocks, calls, threshold = run(case, g)
    return [Scenario(inputs=dict(blocks=blocks, hidden_states=c["hidden_states"],
                                 encoder_hidden_states=c["encoder_hidden_states"], temb=c["temb"],
                                 image_rotary_emb=c["image_rotary_emb"], cache=c["cache_before"], threshold=threshold),
                     expected=(*c["output"], c["cache_after"]), label=_label(calls, i, threshold, case))
            for i, c in enumerate(calls)]


REPEAT_CASES = [dict(layers=(2, 2), hw=(4, 4), text=5, batch=1), dict(layers=(1, 3), hw=(3, 5), text=3, batch=2)]


@first_block_cache_step.check("an unchanged call at threshold 0 (δ = 0 is not > 0: diffusers skips)",
                              cases=REPEAT_CASES, tol=CACHED_BLOCKS)
def _(case, g):
    pristine = make_transformer(*case["layers"])
    blocks = counted_blocks(pristine)
    latents, ((embeds, pooled), _), img_ids, txt_ids = _inputs(case, g)
    model, calls = hooked(pristine, 0.0)
    timestep = torch.full((case["batch"],), 0.5)
    for _ in range(2):  # the same call twice: the first block's residual does not change at all
        with model.cache_context("cond"):
            model(hidden_states=latents, timestep=timestep, pooled_projections=pooled, encoder_hidden_states=embeds,
                  txt_ids=txt_ids, img_ids=img_ids, return_dict=False)
    c = calls[1]
    assert c["cache_after"]["should_compute"] is False
    return Scenario(inputs=dict(blocks=blocks, hidden_states=c["hidden_states"],
                                encoder_hidden_states=c["encoder_hidden_states"], temb=c["temb"],
                                image_rotary_emb=c["image_rotary_emb"], cache=c["cache_before"], threshold=0.0),
                    expected=(*c["output"], c["cache_after"]),
                    label="the call before had the same inputs, threshold 0: δ = 0 and 0 > 0 is false, so "
                          "diffusers skips blocks[1:]")


def _step(blocks, hidden_states, encoder_hidden_states, temb, image_rotary_emb, cache, threshold, *,
          refresh_on_skip=False, tail_from_input=False, text_cached=True, at_threshold_computes=False):
    """The cached step, with one thing done wrong (the traps below)."""
    def call(block, hid, enc):
        enc, hid = block(hidden_states=hid, encoder_hidden_states=enc, temb=temb, image_rotary_emb=image_rotary_emb)
        return hid, enc

    hid1, enc1 = call(blocks[0], hidden_states, encoder_hidden_states)
    r = hid1 - hidden_states
    if cache is None:
        compute = True
    else:
        delta = hook_delta(r, cache["head_residual"])
        compute = delta >= threshold if at_threshold_computes else delta > threshold
    if not compute:
        tail_hid, tail_enc = cache["tail_residuals"]
        new = {**cache, "should_compute": False}
        if refresh_on_skip:
            new["head_residual"] = r
        return hid1 + tail_hid, (enc1 + tail_enc) if text_cached else enc1, new
    hid, enc = hid1, enc1
    for block in blocks[1:]:
        hid, enc = call(block, hid, enc)
    base_hid, base_enc = (hidden_states, encoder_hidden_states) if tail_from_input else (hid1, enc1)
    return hid, enc, {"head_residual": r, "head_output": (hid1, enc1),
                      "tail_residuals": (hid - base_hid, enc - base_enc), "should_compute": True}


@first_block_cache_step.trap("the cached residual refreshed on a skipped step (δ against the previous step, not "
                             "the last computed one)",
                             hint="A skipped step leaves the cache as it is: δ must keep measuring against the "
                                  "last step that ran every block, or a slow drift never crosses the threshold "
                                  "while the cached tail grows stale.")
def _(**kw):
    return _step(**kw, refresh_on_skip=True)


@first_block_cache_step.trap("every block run when δ equals the threshold (δ ≥ threshold instead of δ > threshold)",
                             hint="diffusers computes only when the change is above the threshold: δ > threshold. "
                                  "At threshold 0 an unchanged input (δ = 0) skips.")
def _(**kw):
    return _step(**kw, at_threshold_computes=True)


@first_block_cache_step.trap("the tail residual taken from the blocks' input (x_N − x) instead of the first "
                             "block's output (x_N − x₁)",
                             hint="The tail residual is what blocks[1:] added: last output − first block's output. "
                                  "Measured from the input it also holds the first block's change, which a skipped "
                                  "step then adds twice.")
def _(**kw):
    return _step(**kw, tail_from_input=True)


@first_block_cache_step.trap("only the image stream restored on a skipped step (the text stream left at b_1's "
                             "output)",
                             hint="Flux's blocks update both streams: a skipped step adds the cached tail residual "
                                  "to encoder_hidden_states too.")
def _(**kw):
    return _step(**kw, text_cached=False)


# ---- cached_transformer_calls --------------------------------------------------------------------------
cached_transformer_calls = Kata(
    "cached_transformer_calls",
    hints=(
        "Each call goes through first_block_cache_step with the cache its own context left: the cond and "
        "uncond calls see different prompts and must not share a cache.",
        "caches = {}; per call: hid, enc, cache = first_block_cache_step(..., caches.get(call['context']), "
        "threshold); caches[context] = cache; record (hid, enc, cache['should_compute']).",
        "caches, out = {}, []; for c in calls: h, e, k = first_block_cache_step(blocks, c['hidden_states'], "
        "c['encoder_hidden_states'], c['temb'], c['image_rotary_emb'], caches.get(c['context']), threshold); "
        "caches[c['context']] = k; out.append((h, e, k['should_compute'])); return out",
    ),
    answer_key=ANSWER_KEY,
)

RUN_CASES = [
    dict(layers=(2, 2), hw=(4, 4), text=5, batch=1, steps=8, cfg=3.5, negative="close", start_threshold=0.15),
    dict(layers=(1, 2), hw=(5, 3), text=4, batch=1, steps=10, cfg=0.0, start_threshold=0.2),
    # the cond and uncond calls of some step decide differently (each context keeps its own cache)
    dict(layers=(2, 1), hw=(3, 3), text=6, batch=2, steps=6, cfg=2.0, start_threshold=0.12, negative="far",
         contexts_differ=True),
]


def _call_inputs(calls):
    keys = ("context", "hidden_states", "encoder_hidden_states", "temb", "image_rotary_emb")
    return [{k: c[k] for k in keys} for c in calls]


@cached_transformer_calls.check("vs the hooked Flux transformer through whole sampling runs, with and without true CFG",
                                cases=RUN_CASES, tol=CACHED_BLOCKS)
def _(case, g):
    blocks, calls, threshold = run(case, g)
    trace = "".join("C" if c["cache_after"]["should_compute"] else "·" for c in calls)
    return Scenario(inputs=dict(blocks=blocks, calls=_call_inputs(calls), threshold=threshold),
                    expected=[(*c["output"], c["cache_after"]["should_compute"]) for c in calls],
                    label=f"{len(calls)} calls, {_threshold(threshold, case)}; diffusers' trace {trace} "
                          "(C: every block ran, ·: skipped)")


def _calls(blocks, calls, threshold, *, shared=False, forget=False, flag_before=False, follow_cond=False,
           by_parity=False):
    caches, out, cond_ran = {}, [], True
    for i, call in enumerate(calls):
        key = "one" if shared else (i % 2) if by_parity else call["context"]
        before = None if forget else caches.get(key)
        here = threshold
        if follow_cond and call["context"] != "cond" and before is not None:
            here = -1.0 if cond_ran else float("inf")  # the cond call's decision forced on this one
        hid, enc, cache = _step(blocks, call["hidden_states"], call["encoder_hidden_states"], call["temb"],
                                call["image_rotary_emb"], before, here)
        if call["context"] == "cond":
            cond_ran = cache["should_compute"]
        caches[key] = cache
        flag = (True if before is None else before["should_compute"]) if flag_before else cache["should_compute"]
        out.append((hid, enc, flag))
    return out


@cached_transformer_calls.trap("one cache shared by the cond and uncond calls",
                               hint="FluxPipeline wraps each call in transformer.cache_context('cond') or "
                                    "('uncond'): the two prompts give different residuals and tails, and each "
                                    "context keeps its own cache. Key the caches by call['context'].")
def _(**kw):
    return _calls(**kw, shared=True)


@cached_transformer_calls.trap("the caches picked by the call's position (even/odd), not by its context",
                               hint="Which cache a call uses is in call['context'] ('cond' or 'uncond'): without true "
                                    "CFG every call is 'cond', and with it the order is the pipeline's business. Key "
                                    "the caches by the context, not by counting calls.")
def _(**kw):
    return _calls(**kw, by_parity=True)


@cached_transformer_calls.trap("the computed flag read from the cache before the call (the previous call's decision)",
                               hint="Whether this call ran every block is in the cache first_block_cache_step "
                                    "returns: read should_compute from the new cache, not the one passed in.")
def _(**kw):
    return _calls(**kw, flag_before=True)


@cached_transformer_calls.trap("the uncond call made to follow the cond call's decision (one decision per step)",
                               hint="Each context decides from its own cache: the uncond prediction's first-block "
                                    "residual changes at its own pace, so it may run every block where the cond call "
                                    "skipped, or the other way round. Call first_block_cache_step with the threshold "
                                    "for both.")
def _(**kw):
    return _calls(**kw, follow_cond=True)


@cached_transformer_calls.trap("the returned cache dropped: every call starts empty (and runs every block)",
                               hint="first_block_cache_step returns the cache for the next call of the same "
                                    "context: keep it and pass it back, or nothing is ever skipped.")
def _(**kw):
    return _calls(**kw, forget=True)


# ---- budgets ------------------------------------------------------------------------------------------
BUDGET_CASE = dict(layers=(2, 2), hw=(4, 4), text=5, batch=1, steps=8, cfg=3.0, start_threshold=0.15)


def _allowed(calls, n_blocks) -> tuple[int, int]:
    skipped = sum(not c["cache_after"]["should_compute"] for c in calls)
    return (len(calls) - skipped) * n_blocks + skipped, skipped


@first_block_cache_step.budget("a skipped call runs the first block only")
def _(learner, g):
    blocks, calls, threshold = run(BUDGET_CASE, g)
    for c in calls:
        learner(blocks=blocks, hidden_states=c["hidden_states"], encoder_hidden_states=c["encoder_hidden_states"],
                temb=c["temb"], image_rotary_emb=c["image_rotary_emb"], cache=c["cache_before"], threshold=threshold)
    allowed, skipped = _allowed(calls, len(blocks))
    every = len(blocks.calls) == len(calls) * len(blocks)  # the cost of running every block on every call
    return [Measurement(f"block calls over {len(calls)} transformer calls ({skipped} skipped by diffusers)",
                        len(blocks.calls), allowed, "calls",
                        f"{len(blocks)} blocks per computed call, 1 (the first) per skipped call: the saving is the "
                        "point of the cache",
                        trap=("every block run on a skipped call (the cache consulted after the work)",
                              "Decide from the first block's residual alone, then run the remaining blocks only when "
                              "the change is over the threshold: a skipped call costs one block, not all of them.")
                        if every else None)]


@cached_transformer_calls.budget("block calls over a cached CFG run")
def _(learner, g):
    blocks, calls, threshold = run(BUDGET_CASE, g)
    learner(blocks=blocks, calls=_call_inputs(calls), threshold=threshold)
    allowed, skipped = _allowed(calls, len(blocks))
    return [Measurement(f"block calls over {len(calls)} transformer calls ({skipped} skipped by diffusers)",
                        len(blocks.calls), allowed, "calls",
                        f"{len(blocks)} blocks per computed call, 1 per skipped call, each call once")]
