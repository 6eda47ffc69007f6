"""Lab 22 · Offload as a schedule: what CPU offload costs in accelerator bytes and in bytes moved

Concept:
    Offloading keeps weights in host memory and moves them to the accelerator only while they are needed.
    It is not free: every byte that comes in goes back out, over a bus far slower than the accelerator's own
    memory. Whether that cost is paid once per image or at every step depends only on the schedule, which
    modules are on the device when, and the schedule follows from two things you can read off a pipeline:
    the size of each component and the order the pipeline calls them in. diffusers has two schedules:
    - model offload (enable_model_cpu_offload, accelerate's CpuOffload hooks): a whole component comes in
      when it is called and stays until the NEXT component of model_cpu_offload_seq is called; the UNet
      stays for the whole loop, so a step moves nothing;
    - group offload (apply_group_offloading, block level): the blocks of a model's ModuleLists come in a
      group at a time and go out after the group's last block, at every forward; the peak is one group plus
      what the model keeps for its whole forward, and every step moves the whole model in and out.

Mental model:
    - What moves: a module's parameters AND buffers, each numel × its own element size (a float16 model
      with a float32 norm, an int64 position_ids buffer): ModelMixin.get_memory_footprint().
    - Model offload is a chain over model_cpu_offload_seq (e.g. "text_encoder->image_encoder->unet->vae"),
      skipping names the pipeline does not have (image_encoder=None). Calling component c:
        1. if c is in the chain and its predecessor p in the chain is on the device, p goes back to the host;
        2. if c is not on the device, it comes in.
      Only the chain predecessor leaves: in img2img the VAE encodes before the loop and stays through it.
      A component outside the chain (a ControlNet, called every step) has a hook with no predecessor: in at
      its first call, out only at the end. When the pipeline call ends (maybe_free_model_hooks), everything
      still on the device goes back.
    - Block-level group offload of one model: each ModuleList / Sequential among the model's OWN children
      is cut into groups of num_blocks_per_group consecutive blocks (a group never spans two lists; nested
      lists are part of their block); everything else the model holds (its other children, its own
      parameters and buffers) is one more group, in for the whole forward. A group comes in before its first
      block runs and leaves after its last block. Peak = that resident part + the largest group; one forward
      moves every byte of the model in, and out again. A model may name "block modules"
      (_group_offload_block_modules: AutoencoderKL's encoder, decoder and quant convs), each planned the same
      way during its own forward, so a VAE's peak is its largest part's, not the whole VAE.

Traps:
    - Counting parameters only (or the state_dict, which leaves out non-persistent buffers): buffers
      (position_ids, a quantization scale) are moved too.
    - Counting elements, or 4 bytes per element: a half-precision model is half the bytes, and a model can
      mix dtypes.
    - Offloading whatever ran last: model offload releases only the chain predecessor, so a component called
      out of the chain's order (the VAE in img2img) stays resident next to the UNet.
    - Treating a component outside the chain like a chain member: a ControlNet is never released before the
      end, so the peak is UNet + ControlNet.
    - Breaking the chain at a missing component: image_encoder=None is skipped, the UNet's predecessor is the
      text encoder.
    - Forgetting the end of the call: everything still on the device goes back when the pipeline returns,
      not only the last component called.
    - Offloading after every call: that is sequential (or group) offload; model offload keeps the UNet for
      the whole loop, and its steps move nothing.
    - A peak of one component: the peak is the sum of what is on the device together.
    - Grouping blocks across lists or inside blocks: groups are cut per top-level ModuleList.
    - Ignoring a model's block modules: a VAE is planned through its encoder and decoder, not kept whole.
    - A peak without the resident part, or bytes per forward of the blocks only.
    - Every resident part at once: a block module's resident part is on the device only during its own
      forward (a VAE's encoder and decoder never together).

Precision:
    None to allow for: bytes are counted (integers) and a schedule is a sequence of names; every value is
    compared exactly.

Say it out loud:
    "Model offload moves each component once per image: in when it is called, out when the next component
    in the chain is called, the rest at the end; the UNet stays for the loop, so its steps cost no traffic,
    and the peak is the largest set of components that are on the device together. Group offload moves the
    whole model every step, a group at a time, for a peak of one group plus the resident part."

Graded against: enable_model_cpu_offload on tiny StableDiffusionPipeline, StableDiffusionImg2ImgPipeline,
StableDiffusionControlNetPipeline and FluxPipeline runs, accelerate's own CpuOffload hooks deciding every move
(recorded as they happen); apply_group_offloading(offload_type="block_level") on tiny Flux, UNet, CLIP and VAE
models, its ModuleGroups' onload_/offload_ recorded during a forward; ModelMixin.get_memory_footprint.
Run: python -m pytest katas/22_offload_schedule.py
"""
import torch


# ---- Worked example --------------------------------------------------------------------------------
def chain(offload_seq: list[str], components: list[str]) -> list[str]:
    """The model-offload chain: model_cpu_offload_seq's names that the pipeline has, in order (diffusers skips
    a name whose component is None or not a module)."""
    return [name for name in offload_seq if name in components]


# ---- Your turn -------------------------------------------------------------------------------------
def module_bytes(module: torch.nn.Module) -> int:
    """The bytes an offload moves for `module`: every parameter and buffer, numel × its own element size.

    Graded against: ModelMixin.get_memory_footprint() (transformers' PreTrainedModel.get_memory_footprint for
    a CLIPTextModel), on float32, float16, bfloat16 and mixed-dtype models.
    Args:
        module: a torch.nn.Module (a UNet, a VAE, a text encoder, a transformer).
    Returns: an int, in bytes.
    """
    # BEGIN SOLUTION: parameters and buffers alike, each at its own element size
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)
    # END SOLUTION


def model_offload_trace(calls: list[str], sizes: dict[str, int], offload_seq: list[str]) -> dict:
    """What enable_model_cpu_offload keeps on the accelerator, and moves, through one pipeline call.

    Rules (accelerate's CpuOffload hooks, as diffusers installs them): the components named in `offload_seq`
    that the pipeline has form a chain; every other component in `sizes` gets a hook of its own. Everything
    starts on the host. Before component c runs:
      1. if c is in the chain and its predecessor p in the chain is on the device, p moves to the host;
      2. if c is not on the device, c moves to the device.
    After the last call, everything still on the device moves to the host (maybe_free_model_hooks).

    Graded against: the moves accelerate's hooks make during real pipeline calls (txt2img, img2img, ControlNet,
    Flux), recorded as they happen.
    Args:
        calls:       the components in the order the pipeline calls them (a call = a forward, or a VAE
                     encode/decode), e.g. ["text_encoder", "text_encoder", "unet", "unet", "vae"].
        sizes:       bytes of every module component the pipeline offloads (module_bytes); a component
                     diffusers excludes from offload (a safety checker) stays on the device and is not in it.
        offload_seq: model_cpu_offload_seq split on "->"; it may name components the pipeline lacks.
    Returns: dict with
        resident:   per call, the sorted names of the components on the device while it runs;
        to_device:  per call, bytes moved host → device just before it;
        to_host:    per call, bytes moved device → host just before it;
        peak_bytes: the most bytes on the device at any time;
        released:   bytes moved device → host when the pipeline call ends.
    """
    # BEGIN SOLUTION: a chain member releases its predecessor only; off-chain components stay; all leave at the end
    order = chain(offload_seq, list(sizes))
    # 1. Each chain member's predecessor: the previous PRESENT name (a missing one does not break the chain).
    predecessor = {name: prev for prev, name in zip(order, order[1:])}
    on_device: set[str] = set()
    out = dict(resident=[], to_device=[], to_host=[], peak_bytes=0, released=0)
    for name in calls:
        moved_out = moved_in = 0
        # 2. Only the chain predecessor leaves, whatever ran last.
        prev = predecessor.get(name)
        if prev in on_device:
            on_device.remove(prev)
            moved_out = sizes[prev]
        # 3. The component comes in if it is not there yet (the UNet's later steps move nothing).
        if name not in on_device:
            on_device.add(name)
            moved_in = sizes[name]
        out["resident"].append(sorted(on_device))
        out["to_device"].append(moved_in)
        out["to_host"].append(moved_out)
        out["peak_bytes"] = max(out["peak_bytes"], sum(sizes[n] for n in on_device))
    # 4. maybe_free_model_hooks: the end of the call sends back what is left.
    out["released"] = sum(sizes[n] for n in on_device)
    return out
    # END SOLUTION


def group_offload_plan(model: torch.nn.Module, num_blocks_per_group: int) -> dict:
    """Block-level group offloading of one model: its groups, its peak and its traffic per forward.

    Rules (diffusers' apply_group_offloading(offload_type="block_level")), for a module M (first the model):
      - each child of M (M.named_children()) that is a torch.nn.ModuleList or torch.nn.Sequential is cut into
        groups of num_blocks_per_group consecutive blocks; a group comes in before its first block runs and
        goes out after its last;
      - a child whose name is in the model's block modules (model._group_offload_block_modules, if it has one:
        AutoencoderKL names its encoder, decoder, quant_conv and post_quant_conv; the same names at every
        level) is planned the same way, in turn, during its own forward;
      - everything else M holds (its other children, its own parameters and buffers) is M's resident part,
        in for the whole of M's forward.
    Children run one after another, blocks in order.

    Graded against: apply_group_offloading(model, offload_type="block_level", num_blocks_per_group=...), its
    ModuleGroups' onload_/offload_ recorded during one forward of the model.
    Args:
        model:                a Flux transformer, a UNet2DConditionModel, a CLIPTextModel, an AutoencoderKL.
        num_blocks_per_group: blocks per group (≥ 1); a list's last group may be shorter.
    Returns: dict with
        groups:            the groups cut from lists (not the resident parts), depth first in child order,
                           each a list of qualified names ("transformer_blocks.0", "encoder.down_blocks.1");
        peak_bytes:        the most bytes on the device during one forward;
        bytes_per_forward: bytes moved host → device in one forward (the same bytes go back).
    """
    # BEGIN SOLUTION: groups per list, block modules planned in turn; peak = resident part + the largest thing on top
    block_modules = set(getattr(model, "_group_offload_block_modules", None) or ())
    groups = []

    def plan(module: torch.nn.Module, prefix: str) -> int:
        """Records module's groups; returns the peak bytes of its forward."""
        on_top, grouped = [], 0
        for name, child in module.named_children():
            if name in block_modules:
                # 1. A block module: its own groups and resident part, on the device only during its forward.
                on_top.append(plan(child, f"{prefix}{name}."))
                grouped += module_bytes(child)
            elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
                # 2. Consecutive blocks of this list only: a group never spans two lists.
                for start in range(0, len(child), num_blocks_per_group):
                    blocks = list(child[start:start + num_blocks_per_group])
                    groups.append([f"{prefix}{name}.{start + i}" for i in range(len(blocks))])
                    on_top.append(sum(module_bytes(block) for block in blocks))
                    grouped += on_top[-1]
        # 3. The resident part stays through the forward; one group (or block module) at a time on top of it.
        return module_bytes(module) - grouped + max(on_top, default=0)

    peak = plan(model, "")
    # 4. Every byte comes in once per forward, and goes out again.
    return dict(groups=groups, peak_bytes=peak, bytes_per_forward=module_bytes(model))
    # END SOLUTION
