"""Grader for lab 22 · Offload as a schedule, against the moves diffusers' and accelerate's offload hooks make.

module_bytes is graded against get_memory_footprint() (diffusers' ModelMixin, transformers' PreTrainedModel) on
tiny models in float32, float16, bfloat16 and a mixed-dtype UNet, and a CLIPTextModel with its int64 buffer.

model_offload_trace: tiny pipelines (txt2img with and without CFG and a VAE decode, img2img, ControlNet, Flux with
true CFG) run with enable_model_cpu_offload. On a machine without an accelerator the execution device is cpu:0,
whose tensors report "cpu", so accelerate's own checks (`next(module.parameters()).device`) would see every
component on the host: while each CpuOffload.pre_forward runs, the component and its chain predecessor answer
with the placement their recorded moves gave them, and nothing else is changed. Every move is recorded where
accelerate and diffusers make it (torch.nn.Module.to on a component, to the execution device or back to the
host): accelerate's pre_forward decides what leaves and what comes in, maybe_free_model_hooks what goes back at
the end. The learner gets the calls (one per pre_forward, in order), the components' get_memory_footprint() and
model_cpu_offload_seq; the expected trace is read off the recorded moves.

group_offload_plan: apply_group_offloading(offload_type="block_level") on a copy of each tiny model; the groups
are diffusers' ModuleGroups (found through the hooks it registers), and one forward of the hooked copy, with every
ModuleGroup.onload_ / offload_ recorded, gives the peak and the bytes moved in.
"""
import copy
import functools
import warnings

import torch

from diffusion_katas.core.spec import Kata, Scenario
from diffusion_katas.core.tolerances import COUNTED
from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import SD_BETAS, quiet_diffusers, seed_from

HOST = torch.device("cpu")


# ---- tiny models --------------------------------------------------------------------------------------
def flux_transformer(dtype=torch.float32):
    """A tiny FluxTransformer2DModel with 3 double-stream and 4 single-stream blocks (two ModuleLists)."""
    from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

    from diffusers.utils import logging

    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=3, num_single_layers=4, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=False, axes_dims_rope=(2, 2, 4),
    ).eval().requires_grad_(False)
    level = logging.get_verbosity()
    logging.set_verbosity_error()  # .to(dtype) warns about _keep_in_fp32_modules, which this model has none of
    try:
        return model.to(dtype)
    finally:
        logging.set_verbosity(level)


def mixed_unet():
    """A float16 UNet whose GroupNorms stay float32 (as layerwise casting keeps norms wide): two element sizes."""
    unet = tiny.unet_cond().half()
    for module in unet.modules():
        if isinstance(module, torch.nn.GroupNorm):
            module.float()
    return unet


def t5_encoder():
    """A tiny T5EncoderModel: its embedding is shared (model.shared is encoder.embed_tokens), one tensor reached
    under two names, moved once."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)).eval()


class _Head(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(width, width) for _ in range(3)])
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def stack_model():
    """A model whose own children hold a block module (`head`, named in _group_offload_block_modules, with a list of
    its own) and an nn.Sequential of blocks: one level with both kinds of candidate for the peak."""
    return _stack_class()().eval().requires_grad_(False)


@functools.cache
def _stack_class():
    from diffusers.configuration_utils import ConfigMixin, register_to_config
    from diffusers.models.modeling_utils import ModelMixin

    class StackModel(ModelMixin, ConfigMixin):
        _group_offload_block_modules = ["head"]

        @register_to_config
        def __init__(self, width: int = 16):
            super().__init__()
            self.proj_in = torch.nn.Linear(8, width)
            self.head = _Head(width)
            self.blocks = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(5)])
            self.proj_out = torch.nn.Linear(width, 8)

        def forward(self, x):
            return self.proj_out(self.blocks(self.head(self.proj_in(x))))

        def __reduce__(self):  # the runner receives it pickled; the class is made here, not importable by name
            return _rebuild_stack, (self.state_dict(),)

    return StackModel


def _rebuild_stack(state: dict):
    model = stack_model()
    model.load_state_dict(state)
    return model


MODELS = {
    "unet": lambda: tiny.unet_cond(),
    "unet float16": lambda: tiny.unet_cond().half(),
    "unet mixed float16/float32": mixed_unet,
    "vae": lambda: tiny.vae(),
    "clip text encoder": lambda: tiny.clip_text_encoder(2),
    "flux": flux_transformer,
    "flux bfloat16": lambda: flux_transformer(torch.bfloat16),
    "t5 text encoder (shared embedding)": t5_encoder,
    "stack (a block module and a Sequential)": stack_model,
}


def forward(kind: str, model, g: torch.Generator) -> None:
    """One forward of a float32 model from MODELS on random inputs."""
    with torch.no_grad():
        if kind == "flux":
            tokens, text = 16, 5
            model(hidden_states=torch.randn(1, tokens, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, text, 16, generator=g),
                  pooled_projections=torch.randn(1, 8, generator=g), timestep=torch.rand(1, generator=g),
                  img_ids=torch.zeros(tokens, 3), txt_ids=torch.zeros(text, 3))
        elif kind == "unet":
            model(torch.randn(1, tiny.LATENT_CHANNELS, 8, 8, generator=g), 500,
                  encoder_hidden_states=tiny.text_embeddings(1, g))
        elif kind == "clip text encoder":
            model(torch.randint(0, model.config.vocab_size, (1, 9), generator=g))
        elif kind == "vae":
            model(torch.randn(1, 3, 16, 16, generator=g))
        elif kind.startswith("stack"):
            model(torch.randn(2, 8, generator=g))
        else:
            raise ValueError(kind)


# ---- module_bytes ----------------------------------------------------------------------------------------
module_bytes = Kata(
    "module_bytes",
    hints=(
        "What does `module.to(device)` carry over the bus? Every tensor the module owns, at the size it has in "
        "memory.",
        "Parameters and buffers (module.buffers(): CLIP's int64 position_ids); each t.numel() × t.element_size(), "
        "since a model can mix float16 and float32.",
        "return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])",
    ),
    answer_key=("diffusers.models.modeling_utils.ModelMixin.get_memory_footprint",
                "transformers.modeling_utils.PreTrainedModel.get_memory_footprint",
                "accelerate.utils.modeling.compute_module_sizes"),
)

BYTES_CASES = [dict(model=name) for name in MODELS]


@module_bytes.check("vs get_memory_footprint()", cases=BYTES_CASES, tol=COUNTED)
def _(case, g):
    model = MODELS[case["model"]]()
    return Scenario(inputs=dict(module=model), expected=model.get_memory_footprint(), label=case["model"])


def _tensors(module, buffers=True):
    return list(module.parameters()) + (list(module.buffers()) if buffers else [])


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _nbytes(module) -> int:
    """What an offload moves for a module (the traps' own count; the reference is get_memory_footprint)."""
    return _bytes(_tensors(module))


@module_bytes.trap("parameters only, or state_dict() (every buffer is moved, non-persistent ones too)",
                   hint="module.to() moves buffers as well: CLIPTextModel's position_ids is an int64 buffer, not a "
                        "parameter, and a non-persistent one, so state_dict() leaves it out too. Sum over "
                        "module.parameters() and module.buffers().")
def _(module):
    return _bytes(_tensors(module, buffers=False))


@module_bytes.trap("state_dict() (non-persistent buffers left out, a shared tensor counted once per name)",
                   hint="state_dict() is what a checkpoint saves, not what .to() moves: it leaves out non-persistent "
                        "buffers (CLIPTextModel's position_ids) and lists a shared tensor under each of its names "
                        "(T5's embedding). Sum over module.parameters() and module.buffers().")
def _(module):
    return _bytes(module.state_dict().values())


@module_bytes.trap("a shared tensor counted once per name (remove_duplicate=False)",
                   hint="T5's embedding is both model.shared and encoder.embed_tokens: one tensor, moved once. "
                        "module.parameters() and module.buffers() yield each tensor once.")
def _(module):
    return _bytes([t for _, t in module.named_parameters(remove_duplicate=False)]
                  + [t for _, t in module.named_buffers(remove_duplicate=False)])


@module_bytes.trap("elements, not bytes (numel without element_size)",
                   hint="A float32 element takes 4 bytes, float16/bfloat16 2, int64 8: multiply each tensor's numel() "
                        "by its element_size().")
def _(module):
    return sum(t.numel() for t in _tensors(module))


@module_bytes.trap("4 bytes per element whatever the dtype",
                   hint="Half-precision weights take 2 bytes an element (that is the point of loading them), an int64 "
                        "buffer 8: use each tensor's own element_size().")
def _(module):
    return sum(t.numel() * 4 for t in _tensors(module))


@module_bytes.trap("the first parameter's element size for every tensor",
                   hint="A model can mix dtypes (float16 weights with float32 norms; float32 weights with an int64 "
                        "buffer): take element_size() per tensor, not once for the model.")
def _(module):
    tensors = _tensors(module)
    return sum(t.numel() for t in tensors) * tensors[0].element_size()


# ---- model_offload_trace -----------------------------------------------------------------------------------
class OffloadRecorder:
    """Records, during a pipeline call under enable_model_cpu_offload, each component call (one CpuOffload
    pre_forward) and each move of a component (torch.nn.Module.to to the execution device or back to the host),
    in order. Without an accelerator the execution device is cpu:0, and accelerate's device checks read
    `next(module.parameters()).device`, which is "cpu" for every CPU tensor: while a pre_forward runs, the
    component and its chain predecessor answer with their recorded placement; accelerate's code decides the rest."""

    def __init__(self, pipe):
        self.names = {id(m): n for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
        self.where = {n: HOST for n in self.names.values()}
        self.events: list[tuple[str, str]] = []

    def __enter__(self):
        from accelerate.hooks import CpuOffload

        self._to, self._pre_forward = torch.nn.Module.to, CpuOffload.pre_forward
        recorder, module_to, pre_forward = self, self._to, self._pre_forward

        def to(module, *args, **kwargs):
            name = recorder.names.get(id(module))
            device = kwargs.get("device", args[0] if args else None)
            if name is not None and isinstance(device, (str, torch.device)):
                place = torch.device(device)
                place = HOST if place == HOST else place
                if place != recorder.where[name]:
                    recorder.events.append(("host" if place == HOST else "device", name))
                    recorder.where[name] = place
            return module_to(module, *args, **kwargs)

        def placed(module):
            return lambda recurse=True: iter([_Placed(recorder.where[recorder.names[id(module)]])])

        def spy(hook, module, *args, **kwargs):
            involved = [module] + ([hook.prev_module_hook.model] if hook.prev_module_hook is not None else [])
            for m in involved:
                m.__dict__["parameters"] = placed(m)
            try:
                result = pre_forward(hook, module, *args, **kwargs)
            finally:
                for m in involved:
                    m.__dict__.pop("parameters", None)
            recorder.events.append(("call", recorder.names[id(module)]))
            return result

        torch.nn.Module.to, CpuOffload.pre_forward = to, spy
        return self

    def __exit__(self, *exc):
        from accelerate.hooks import CpuOffload

        torch.nn.Module.to, CpuOffload.pre_forward = self._to, self._pre_forward
        return False


class _Placed:
    """What accelerate reads off a component's first parameter: only its device."""

    def __init__(self, device):
        self.device = device


def offload_pipeline(kind: str):
    """A tiny pipeline of the named kind; the SD ones with a CLIP text encoder and tokenizer."""
    from diffusers.schedulers.scheduling_ddim import DDIMScheduler

    if kind == "flux":
        pipe = tiny.flux_pipeline(guidance_embeds=False)
        pipe.vae.register_to_config(shift_factor=0.0)  # FluxPipeline's decode adds it; the tiny VAE has none
        return pipe
    from diffusers import (ControlNetModel, StableDiffusionControlNetPipeline, StableDiffusionImg2ImgPipeline,
                           StableDiffusionPipeline)

    parts = dict(vae=tiny.vae(), text_encoder=tiny.clip_text_encoder(2), tokenizer=tiny.clip_tokenizer(),
                 unet=tiny.unet_cond(), scheduler=DDIMScheduler(**SD_BETAS), safety_checker=None,
                 feature_extractor=None, requires_safety_checker=False)
    cls = {"txt2img": StableDiffusionPipeline, "img2img": StableDiffusionImg2ImgPipeline,
           "controlnet": StableDiffusionControlNetPipeline}[kind]
    if kind == "controlnet":
        parts["controlnet"] = ControlNetModel.from_unet(parts["unet"], conditioning_embedding_out_channels=(4, 8))
    with quiet_diffusers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = cls(**parts)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def offload_run(case: dict, g: torch.Generator):
    """One pipeline call under enable_model_cpu_offload: (calls, sizes, offload_seq, recorded events)."""
    pipe = offload_pipeline(case["pipeline"])
    sizes = {n: m.get_memory_footprint() for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    generator = torch.Generator().manual_seed(seed_from(g))
    steps = case["steps"] + int(torch.randint(0, 3, (), generator=g))  # the seed moves the loop's length too
    if case["pipeline"] == "flux":
        kwargs = dict(prompt_embeds=torch.randn(1, 5, 16, generator=g), pooled_prompt_embeds=torch.randn(1, 8, generator=g),
                      negative_prompt_embeds=torch.randn(1, 5, 16, generator=g),
                      negative_pooled_prompt_embeds=torch.randn(1, 8, generator=g), true_cfg_scale=case["guidance"],
                      height=16, width=16)
    else:
        kwargs = dict(prompt="a red fox in the snow", negative_prompt="blurry", guidance_scale=case["guidance"])
        if case["pipeline"] == "img2img":
            kwargs.update(image=torch.rand(1, 3, 16, 16, generator=g), strength=case["strength"])
        else:
            kwargs.update(height=16, width=16)
        if case["pipeline"] == "controlnet":
            kwargs.update(image=torch.rand(1, 3, 16, 16, generator=g))
    with quiet_diffusers(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe.enable_model_cpu_offload(device="cpu")
        with OffloadRecorder(pipe) as recorder, torch.no_grad():
            pipe(num_inference_steps=steps, output_type=case["output"], generator=generator, **kwargs)
    calls = [name for kind, name in recorder.events if kind == "call"]
    return calls, sizes, pipe.model_cpu_offload_seq.split("->"), recorder.events


def trace_from(events, sizes) -> dict:
    """The expected trace, read off the recorded moves: the moves before a call are that call's; the moves after
    the last call are maybe_free_model_hooks'; the peak is the most bytes on the device after any move."""
    on, moved_in, moved_out = set(), 0, 0
    out = dict(resident=[], to_device=[], to_host=[], peak_bytes=0, released=0)
    for kind, name in events:
        if kind == "call":
            out["resident"].append(sorted(on))
            out["to_device"].append(moved_in)
            out["to_host"].append(moved_out)
            moved_in = moved_out = 0
        elif kind == "device":
            on.add(name)
            moved_in += sizes[name]
            out["peak_bytes"] = max(out["peak_bytes"], sum(sizes[n] for n in on))
        else:
            on.discard(name)
            moved_out += sizes[name]
    assert not on, f"components left on the device after the pipeline call: {sorted(on)}"
    out["released"] = moved_out
    return out


model_offload_trace = Kata(
    "model_offload_trace",
    hints=(
        "Walk the calls keeping the set of components on the device. What makes a component leave? Not that "
        "something else runs: only that the NEXT component of the chain runs (or the pipeline call ends).",
        "chain = the offload_seq names present in sizes; pred[chain[i+1]] = chain[i]. Per call c: if pred.get(c) is "
        "on the device, it leaves (to_host); if c is not on the device, it comes in (to_device). Components outside "
        "the chain never leave before the end; at the end, everything still there is released.",
        "order = [n for n in offload_seq if n in sizes]; pred = dict(zip(order[1:], order)); on = set(); for c in "
        "calls: out_ = sizes[pred[c]] if pred.get(c) in on else 0 (and on.discard); in_ = 0 if c in on else "
        "sizes[c] (and on.add); record sorted(on), in_, out_, peak = max(peak, sum(sizes[n] for n in on)); "
        "released = sum(sizes[n] for n in on)",
    ),
    answer_key=("accelerate.hooks.CpuOffload.pre_forward", "accelerate.big_modeling.cpu_offload_with_hook",
                "diffusers.pipelines.pipeline_utils.DiffusionPipeline.enable_model_cpu_offload"),
)

TRACE_CASES = [
    # CFG: the text encoder runs twice (prompt, negative prompt); image_encoder is missing from the chain
    dict(pipeline="txt2img", guidance=5.0, steps=3, output="pt"),
    # no CFG, latents out: one text encoder call and no VAE call, so the UNet is what the end releases
    dict(pipeline="txt2img", guidance=1.0, steps=2, output="latent"),
    # the VAE encodes before the loop: the chain releases only the text encoder, the VAE stays through the loop
    dict(pipeline="img2img", guidance=4.0, steps=4, strength=0.75, output="pt"),
    # the ControlNet is outside the chain: in at its first call, out only at the end
    dict(pipeline="controlnet", guidance=3.0, steps=3, output="pt"),
    # another chain (text_encoder->text_encoder_2->transformer->vae) with no text encoders; true CFG: two calls a step
    dict(pipeline="flux", guidance=2.0, steps=3, output="pt"),
]


@model_offload_trace.check("vs the moves accelerate's hooks make in a pipeline call", cases=TRACE_CASES, tol=COUNTED)
def _(case, g):
    calls, sizes, seq, events = offload_run(case, g)
    denoiser = "transformer" if case["pipeline"] == "flux" else "unet"
    label = (f"{case['pipeline']}, {calls.count(denoiser)} {denoiser} calls, guidance {case['guidance']:g}, "
             f"output {case['output']}")
    return Scenario(inputs=dict(calls=calls, sizes=sizes, offload_seq=seq), expected=trace_from(events, sizes),
                    label=label)


def _trace(calls, sizes, offload_seq, *, release_last=False, full_seq=False, no_release=False, per_call=False,
           off_chain_released=False, peak_largest=False, release_last_called=False, load_first=False,
           moved_every_call=False, arrival_order=False, released_all=False, moved_out_every_call=False):
    order = list(offload_seq) if full_seq else [n for n in offload_seq if n in sizes]
    pred = dict(zip(order[1:], order))
    on, last, arrived = set(), None, []
    out = dict(resident=[], to_device=[], to_host=[], peak_bytes=0, released=0)
    for c in calls:
        moved_out = moved_in = 0
        if per_call:
            leaving = set(on)
        elif release_last:
            leaving = {last} if last is not None and last != c else set()
        else:
            leaving = {pred[c]} if pred.get(c) in on else set()
            if off_chain_released:
                leaving |= {n for n in on if n not in order and n != c}
        if load_first and c not in on:  # the newcomer in before the predecessor leaves: both count at the peak
            out["peak_bytes"] = max(out["peak_bytes"], sum(sizes[n] for n in on | {c}))
        going = leaving & on
        for n in going:
            on.discard(n)
            moved_out += sizes[n]
        if moved_out_every_call and pred.get(c) is not None and pred[c] not in going:
            moved_out += sizes[pred[c]]  # counted out although it was already on the host
        if c not in on or moved_every_call:
            on.add(c)
            moved_in = sizes[c]
            arrived = [n for n in arrived if n != c] + [c]
        out["resident"].append([n for n in arrived if n in on] if arrival_order else sorted(on))
        out["to_device"].append(moved_in)
        out["to_host"].append(moved_out)
        now = max(sizes[n] for n in on) if peak_largest else sum(sizes[n] for n in on)
        out["peak_bytes"] = max(out["peak_bytes"], now)
        last = c
    out["released"] = (0 if no_release else sizes[calls[-1]] if release_last_called else
                       sum(sizes.values()) if released_all else sum(sizes[n] for n in on))
    return out


@model_offload_trace.trap("a component's bytes counted in at every call, even while it is on the device",
                          hint="The hook moves a component only when it is not there yet: the UNet's second and later "
                               "steps find it on the device and move nothing (to_device 0).")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, moved_every_call=True)


@model_offload_trace.trap("the predecessor's bytes counted out at every call, even while it is on the host",
                          hint="The hook offloads the predecessor only if it is on the device: once it has left, the "
                               "component's later calls move nothing out (to_host 0).")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, moved_out_every_call=True)


@model_offload_trace.trap("resident listed in the order the components came in, not sorted",
                          hint="Each entry of resident is sorted(names on the device): a set has no order of its own, "
                               "and the trace compares lists.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, arrival_order=True)


@model_offload_trace.trap("released at the end counted as every component's bytes",
                          hint="maybe_free_model_hooks offloads what is on the device when the call ends: the sum "
                               "over the components still there, not over every component of the pipeline.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, released_all=True)


@model_offload_trace.trap("the next component loaded before its predecessor is released (the peak counts both)",
                          hint="The hook offloads the chain predecessor first, then loads the component: the peak after "
                               "a switch holds the newcomer without the one it replaces.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, load_first=True)


@model_offload_trace.trap("the component that ran last released at each switch (not the chain predecessor)",
                          hint="accelerate's hook on c offloads only c's predecessor in model_cpu_offload_seq. In "
                               "img2img the VAE encodes before the loop and nothing releases it until the end; with a "
                               "ControlNet, the UNet and the ControlNet stay side by side.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, release_last=True)


@model_offload_trace.trap("the chain broken at a missing component (image_encoder=None)",
                          hint="diffusers skips a name of model_cpu_offload_seq the pipeline does not have: with "
                               "image_encoder=None the UNet's predecessor is the text encoder, which leaves when the "
                               "UNet first runs.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, full_seq=True)


@model_offload_trace.trap("nothing released when the pipeline call ends",
                          hint="The pipeline calls maybe_free_model_hooks() before it returns: every component still on "
                               "the device goes back to the host. `released` is their bytes.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, no_release=True)


@model_offload_trace.trap("every component released before the next call (sequential-style offload)",
                          hint="Model offload keeps a component on the device until the chain moves on: the UNet comes "
                               "in once and its later steps move nothing. Leaving after each call is what sequential "
                               "(and group) offload do, at a cost in traffic every step.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, per_call=True)


@model_offload_trace.trap("components outside the chain released when another component runs",
                          hint="A component outside model_cpu_offload_seq (the ControlNet) gets a hook with no "
                               "predecessor and is no one's predecessor: once in, it stays until the pipeline call "
                               "ends, next to the UNet.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, off_chain_released=True)


@model_offload_trace.trap("peak as the largest single component on the device",
                          hint="The peak is the sum of everything on the device at once: the UNet and the VAE together "
                               "through img2img's loop, the UNet and the ControlNet through the ControlNet loop.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, peak_largest=True)


@model_offload_trace.trap("only the last component called released at the end",
                          hint="maybe_free_model_hooks sends back everything still on the device, not only the last "
                               "component: a ControlNet (outside the chain) is still there next to the VAE.")
def _(calls, sizes, offload_seq):
    return _trace(calls, sizes, offload_seq, release_last_called=True)


# ---- group_offload_plan --------------------------------------------------------------------------------------
class _GroupRecorder:
    """Records every ModuleGroup.onload_ / offload_ while active (the class's methods, restored on exit)."""

    def __enter__(self):
        from diffusers.hooks.group_offloading import ModuleGroup

        self.events, self._methods = [], (ModuleGroup.onload_, ModuleGroup.offload_)
        onload, offload, events = *self._methods, self.events

        def onload_(group):
            events.append(("in", group))
            return onload(group)

        def offload_(group):
            events.append(("out", group))
            return offload(group)

        ModuleGroup.onload_, ModuleGroup.offload_ = onload_, offload_
        return self

    def __exit__(self, *exc):
        from diffusers.hooks.group_offloading import ModuleGroup

        ModuleGroup.onload_, ModuleGroup.offload_ = self._methods
        return False


def _group_bytes(group) -> int:
    tensors = {id(t): t for m in group.modules for t in _tensors(m)}
    tensors.update({id(t): t for t in [*group.parameters, *group.buffers]})
    return _bytes(tensors.values())


def group_reference(kind: str, model, num_blocks_per_group: int, g: torch.Generator) -> dict:
    """apply_group_offloading(block_level) on a copy of `model`; its block groups, and one forward's peak and
    bytes moved in, from the recorded onload_/offload_."""
    from diffusers.hooks.group_offloading import _GROUP_OFFLOADING, apply_group_offloading

    work = copy.deepcopy(model)
    apply_group_offloading(work, onload_device=HOST, offload_device=HOST, offload_type="block_level",
                           num_blocks_per_group=num_blocks_per_group)
    names = {id(m): n for n, m in work.named_modules()}
    groups = []
    for module in work.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(_GROUP_OFFLOADING) if registry is not None else None
        if hook is not None and all(hook.group is not seen for seen in groups):
            groups.append(hook.group)
    with _GroupRecorder() as recorder:
        forward(kind, work, g)
    size = {id(group): _group_bytes(group) for group in groups}
    on = peak = moved = 0
    for what, group in recorder.events:
        if what == "in":
            on, moved = on + size[id(group)], moved + size[id(group)]
            peak = max(peak, on)
        else:
            on -= size[id(group)]
    assert on == 0, "a group left on the device after the forward"
    # A block group is led by its own first block; a resident part by the module that owns it (not one of its modules).
    blocks = [[names[id(m)] for m in group.modules] for group in groups
              if any(group.onload_leader is m for m in group.modules)]
    return dict(groups=blocks, peak_bytes=peak, bytes_per_forward=moved)


group_offload_plan = Kata(
    "group_offload_plan",
    hints=(
        "Which of a module's own children are lists of blocks, and which are block modules the model names? Cut "
        "the lists into groups, plan the block modules the same way, and keep the rest as the module's resident "
        "part. Then: what is on the device at the worst moment, and what crosses the bus in one forward?",
        "names = model._group_offload_block_modules (or none). plan(M): for name, child in M.named_children(): a "
        "block module → plan(child) with the prefix 'name.', its peak a candidate; a ModuleList/Sequential → groups "
        "of num_blocks_per_group blocks, named f'{prefix}{name}.{i}', each group's bytes a candidate. resident(M) = "
        "module_bytes(M) − the bytes of those children; peak(M) = resident(M) + the largest candidate. "
        "bytes_per_forward = module_bytes(model).",
        "names = set(getattr(model, '_group_offload_block_modules', None) or ()); groups = []; def plan(m, pre): "
        "tops, held = [], 0; for name, c in m.named_children(): if name in names: tops.append(plan(c, pre + name + "
        "'.')); held += module_bytes(c); elif isinstance(c, (nn.ModuleList, nn.Sequential)): for s in range(0, "
        "len(c), n): blocks = list(c[s:s + n]); groups.append([f'{pre}{name}.{s + i}' for i in range(len(blocks))]); "
        "tops.append(sum(module_bytes(b) for b in blocks)); held += tops[-1]; return module_bytes(m) - held + "
        "max(tops, default=0); peak = plan(model, ''); return dict(groups=groups, peak_bytes=peak, "
        "bytes_per_forward=module_bytes(model))",
    ),
    answer_key=("diffusers.hooks.group_offloading.apply_group_offloading",
                "diffusers.hooks.group_offloading._apply_group_offloading_block_level"),
)

GROUP_CASES = [
    dict(model="flux", num_blocks_per_group=1),
    # 3 double-stream blocks and 4 single, 2 a group: the first list ends on a group of one, never topped up
    # from the second list
    dict(model="flux", num_blocks_per_group=2),
    dict(model="flux", num_blocks_per_group=3),
    dict(model="unet", num_blocks_per_group=1),
    dict(model="unet", num_blocks_per_group=2),
    # CLIP's layers sit inside `encoder`: no list among the model's own children, so one resident part
    dict(model="clip text encoder", num_blocks_per_group=1),
    dict(model="vae", num_blocks_per_group=1),
    # a Sequential among the model's own children, beside a block module: the peak is the larger of the two
    # candidates on top of the resident part, never both
    dict(model="stack (a block module and a Sequential)", num_blocks_per_group=2),
]


@group_offload_plan.check("vs apply_group_offloading(block_level) and the groups it moves in a forward",
                          cases=GROUP_CASES, tol=COUNTED)
def _(case, g):
    model = MODELS[case["model"]]()
    n = case["num_blocks_per_group"]
    expected = group_reference(case["model"], model, n, g)
    return Scenario(inputs=dict(model=model, num_blocks_per_group=n), expected=expected,
                    label=f"{case['model']}, {n} block{'s' if n > 1 else ''} per group")


def _plan(model, num_blocks_per_group, *, across=False, no_resident=False, blocks_only=False,
          no_block_modules=False, residents_together=False, lists_only=False, both_on_top=False,
          params_only=False, drop_short=False, no_prefix=False, every_child=False):
    """The solution's plan with one mistake switched on (the traps below)."""
    size = (lambda m: _bytes(_tensors(m, buffers=False))) if params_only else _nbytes  # noqa: E731
    block_modules = set() if no_block_modules else set(getattr(model, "_group_offload_block_modules", None) or ())
    groups, sizes = [], []
    kinds = torch.nn.ModuleList if lists_only else (torch.nn.ModuleList, torch.nn.Sequential)

    def plan(module, prefix):
        on_top, grouped, lists, inner = [], 0, [], []
        for name, child in module.named_children():
            if name in block_modules or (every_child and not isinstance(child, kinds) and any(child.children())):
                inner.append(plan(child, "" if no_prefix else f"{prefix}{name}."))
                grouped += size(child)
            elif isinstance(child, kinds):
                lists.append([(f"{prefix}{name}.{i}", block) for i, block in enumerate(child)])
        for items in [[item for items in lists for item in items]] if across else lists:
            for s in range(0, len(items), num_blocks_per_group):
                chunk = items[s:s + num_blocks_per_group]
                if drop_short and len(chunk) < num_blocks_per_group:
                    continue
                groups.append([n for n, _ in chunk])
                sizes.append(sum(size(b) for _, b in chunk))
                on_top.append(sizes[-1])
                grouped += on_top[-1]
        top = max(inner, default=0) + max(on_top, default=0) if both_on_top else max(inner + on_top, default=0)
        return (0 if no_resident else size(module) - grouped) + top

    peak = plan(model, "")
    total = size(model)
    if residents_together:  # every level's resident part at once, under the largest group
        peak = total - sum(sizes) + max(sizes, default=0)
    return dict(groups=groups, peak_bytes=peak, bytes_per_forward=sum(sizes) if blocks_only else total)


def _lists_at_any_depth(model, num_blocks_per_group, *, outermost=True):
    """Every ModuleList/Sequential at any depth (only those not inside another one, where `outermost`), cut into
    groups; the rest resident."""
    found = [(name, child) for name, child in model.named_modules()
             if name and isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential))]
    if outermost:
        found = [(n, c) for n, c in found if not any(n.startswith(f"{m}.") for m, _ in found if m != n)]
    groups, sizes = [], []
    for name, child in found:
        for s in range(0, len(child), num_blocks_per_group):
            blocks = list(child[s:s + num_blocks_per_group])
            groups.append([f"{name}.{s + i}" for i in range(len(blocks))])
            sizes.append(sum(_nbytes(b) for b in blocks))
    total = _nbytes(model)
    return dict(groups=groups, peak_bytes=total - sum(sizes) + max(sizes, default=0), bytes_per_forward=total)


@group_offload_plan.trap("blocks grouped across lists (the model's lists chunked as one sequence)",
                         hint="Groups are cut per ModuleList: with 3 double-stream and 4 single-stream blocks and 2 "
                              "per group, the groups are [0, 1], [2] of the first list and [0, 1], [2, 3] of the "
                              "second, never the first list's 2 with the second list's 0.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, across=True)


@group_offload_plan.trap("lists found below the model's own children (every ModuleList not inside another one)",
                         hint="Block-level offloading looks only at a module's own children (named_children()): a "
                              "list inside another child (the UNet's mid_block.resnets, CLIP's encoder.layers) moves "
                              "with that child, as part of the resident part.")
def _(model, num_blocks_per_group):
    return _lists_at_any_depth(model, num_blocks_per_group)


@group_offload_plan.trap("every ModuleList at any depth grouped (lists inside blocks too)",
                         hint="Block-level offloading cuts only a module's own children that are lists: the blocks "
                              "inside a list's block (a down block's resnets) move with their block, not as groups "
                              "of their own.")
def _(model, num_blocks_per_group):
    return _lists_at_any_depth(model, num_blocks_per_group, outermost=False)


@group_offload_plan.trap("every child that holds modules planned like a block module (lists searched at every depth)",
                         hint="Only the modules the model names in _group_offload_block_modules are planned on their "
                              "own, one at a time; any other child that is not a list (a mid block, CLIP's encoder) "
                              "is part of the resident part, and the lists inside it move with it.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, every_child=True)


@group_offload_plan.trap("peak of the largest group alone (the resident part left out)",
                         hint="What is not in a group (embeddings, norms, conv_in/out, a mid block) comes in at the "
                              "start of the forward and stays to its end: the peak is that plus the largest group.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, no_resident=True)


@group_offload_plan.trap("bytes per forward of the groups only (the resident part assumed to stay between forwards)",
                         hint="The resident part is a group too, offloaded when the model's forward returns: every "
                              "forward brings in the whole model.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, blocks_only=True)


@group_offload_plan.trap("the model's block modules ignored (_group_offload_block_modules kept whole)",
                         hint="AutoencoderKL names block modules (model._group_offload_block_modules: encoder, decoder, "
                              "quant_conv, post_quant_conv): each is planned like a model of its own during its forward, "
                              "so the encoder's down_blocks are groups and only one part of the VAE is in at a time.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, no_block_modules=True)


@group_offload_plan.trap("nn.Sequential children not grouped (ModuleList only)",
                         hint="Block-level offloading cuts both kinds of block list into groups: a ModuleList and an "
                              "nn.Sequential among a module's own children.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, lists_only=True)


@group_offload_plan.trap("a block module's peak and the largest group both counted on top of the resident part",
                         hint="A block module's forward and a group's are never on the device together: each is a "
                              "candidate, and the peak is the resident part plus the largest candidate, not the sum "
                              "of the largest of each kind.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, both_on_top=True)


@group_offload_plan.trap("the plan's bytes from the parameters only (buffers left out)",
                         hint="A group moves every tensor its modules own, buffers too: count each part with "
                              "module_bytes (parameters and buffers), as the bytes per forward.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, params_only=True)


@group_offload_plan.trap("a list's last, shorter group dropped",
                         hint="range(0, len(blocks), n) with blocks[s:s + n]: the last group holds what is left "
                              "(3 blocks, 2 a group: [0, 1] and [2]).")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, drop_short=True)


@group_offload_plan.trap("a block module's groups named without its prefix",
                         hint="Group names are paths from the model: the encoder's first block is "
                              "'encoder.down_blocks.0', as model.get_submodule takes it.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, no_prefix=True)


@group_offload_plan.trap("every resident part on the device for the whole forward (a block module's counted outside "
                         "its own forward)",
                         hint="A block module's resident part comes in when its own forward starts and leaves when it "
                              "ends: the VAE's encoder and decoder are never on the device together. Plan each block "
                              "module as a module of its own and take its peak as one candidate on top of its parent's "
                              "resident part.")
def _(model, num_blocks_per_group):
    return _plan(model, num_blocks_per_group, residents_together=True)
