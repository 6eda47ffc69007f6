"""Lab 22: wrong-but-plausible offload schedules fail, the commonest by name; the references are the moves
accelerate's and diffusers' own hooks make, recorded, and the recording changes nothing else."""
from pathlib import Path

import torch

from diffusion_katas.core.course import load_module
from expect import Fails

LAB = "22_offload_schedule"
REPO = Path(__file__).resolve().parents[2]


def trace_body(order="[n for n in offload_seq if n in sizes]", leave="pred.get(c) in on",
               peak="sum(sizes[n] for n in on)", released="sum(sizes[n] for n in on)", peak_first=False) -> str:
    """A body for model_offload_trace with one rule swapped for a wrong one."""
    before, after = ("        out['peak_bytes'] = max(out['peak_bytes'], {peak})\n".format(peak=peak), "") if peak_first \
        else ("", "        out['peak_bytes'] = max(out['peak_bytes'], {peak})\n".format(peak=peak))
    return f"""
    order = {order}
    pred = dict(zip(order[1:], order))
    on = set()
    out = dict(resident=[], to_device=[], to_host=[], peak_bytes=0, released=0)
    for c in calls:
{before}        moved_in = moved_out = 0
        if {leave}:
            on.discard(pred[c])
            moved_out = sizes[pred[c]]
        if c not in on:
            on.add(c)
            moved_in = sizes[c]
        out['resident'].append(sorted(on))
        out['to_device'].append(moved_in)
        out['to_host'].append(moved_out)
{after}    out['released'] = {released}
    return out
    """


RELEASE_LAST = """
    on, last = set(), None
    out = dict(resident=[], to_device=[], to_host=[], peak_bytes=0, released=0)
    for c in calls:
        moved_in = moved_out = 0
        if last is not None and last != c and last in on:
            on.discard(last)
            moved_out = sizes[last]
        if c not in on:
            on.add(c)
            moved_in = sizes[c]
        out['resident'].append(sorted(on))
        out['to_device'].append(moved_in)
        out['to_host'].append(moved_out)
        out['peak_bytes'] = max(out['peak_bytes'], sum(sizes[n] for n in on))
        last = c
    out['released'] = sum(sizes[n] for n in on)
    return out
    """


def plan_body(blocks="set(getattr(model, '_group_offload_block_modules', None) or ())",
              resident="module_bytes(module) - grouped", top="max(on_top, default=0)",
              per_forward="module_bytes(model)", inner="plan(child, prefix + name + '.')") -> str:
    """A body for group_offload_plan with one rule swapped for a wrong one."""
    return f"""
    block_modules = {blocks}
    groups = []

    def plan(module, prefix):
        on_top, grouped = [], 0
        for name, child in module.named_children():
            if name in block_modules:
                on_top.append({inner})
                grouped += module_bytes(child)
            elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
                for s in range(0, len(child), num_blocks_per_group):
                    blocks = list(child[s:s + num_blocks_per_group])
                    groups.append([f'{{prefix}}{{name}}.{{s + i}}' for i in range(len(blocks))])
                    on_top.append(sum(module_bytes(b) for b in blocks))
                    grouped += on_top[-1]
        return {resident} + {top}

    peak = plan(model, '')
    return dict(groups=groups, peak_bytes=peak, bytes_per_forward={per_forward})
    """


ACROSS = """
    blocks = [(f'{name}.{i}', b) for name, child in model.named_children()
              if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) for i, b in enumerate(child)]
    groups, sizes = [], []
    for s in range(0, len(blocks), num_blocks_per_group):
        chunk = blocks[s:s + num_blocks_per_group]
        groups.append([n for n, _ in chunk])
        sizes.append(sum(module_bytes(b) for _, b in chunk))
    total = module_bytes(model)
    return dict(groups=groups, peak_bytes=total - sum(sizes) + max(sizes, default=0), bytes_per_forward=total)
    """

RESIDENTS_TOGETHER = """
    names = set(getattr(model, '_group_offload_block_modules', None) or ())
    groups, sizes = [], []

    def walk(module, prefix):
        for name, child in module.named_children():
            if name in names:
                walk(child, prefix + name + '.')
            elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
                for s in range(0, len(child), num_blocks_per_group):
                    blocks = list(child[s:s + num_blocks_per_group])
                    groups.append([f'{prefix}{name}.{s + i}' for i in range(len(blocks))])
                    sizes.append(sum(module_bytes(b) for b in blocks))

    walk(model, '')
    total = module_bytes(model)
    return dict(groups=groups, peak_bytes=total - sum(sizes) + max(sizes, default=0), bytes_per_forward=total)
    """

MUTANTS = [
    ("module_bytes", "return sum(p.numel() * p.element_size() for p in module.parameters())",
     "parameters only, or state_dict() (every buffer is moved, non-persistent ones too)"),
    ("module_bytes", "return sum(t.numel() for t in [*module.parameters(), *module.buffers()])",
     "elements, not bytes (numel without element_size)"),
    ("module_bytes", "return sum(t.numel() * 4 for t in [*module.parameters(), *module.buffers()])",
     "4 bytes per element whatever the dtype"),
    ("module_bytes",  # the state dict leaves out non-persistent buffers (CLIP's position_ids), lists T5's shared
     # embedding twice
     "return sum(v.numel() * v.element_size() for v in module.state_dict().values())",
     "state_dict() (non-persistent buffers left out, a shared tensor counted once per name)"),
    ("module_bytes",  # every name's tensor: T5's shared embedding twice
     "return sum(t.numel() * t.element_size() for _, t in [*module.named_parameters(remove_duplicate=False), "
     "*module.named_buffers(remove_duplicate=False)])",
     "a shared tensor counted once per name (remove_duplicate=False)"),
    ("group_offload_plan",  # ModuleList only: an nn.Sequential of blocks left in the resident part
     plan_body().replace("isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential))",
                         "isinstance(child, torch.nn.ModuleList)"),
     "nn.Sequential children not grouped (ModuleList only)"),
    ("group_offload_plan",  # the largest block-module peak AND the largest group on top of the resident part
     plan_body(inner="plan(child, prefix + name + '.')").replace(
         "on_top, grouped = [], 0", "on_top, grouped, heads = [], 0, []").replace(
         "on_top.append(plan(child, prefix + name + '.'))", "heads.append(plan(child, prefix + name + '.'))").replace(
         "max(on_top, default=0)", "max(heads, default=0) + max(on_top, default=0)"),
     "a block module's peak and the largest group both counted on top of the resident part"),
    ("module_bytes",  # a float where the reference counts bytes as an int
     "return float(sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()]))",
     Fails("wrong", "should be the integer")),
    ("model_offload_trace", trace_body(order="list(offload_seq)"),
     "the chain broken at a missing component (image_encoder=None)"),
    ("model_offload_trace", trace_body(released="0"), "nothing released when the pipeline call ends"),
    ("model_offload_trace", trace_body(leave="c in pred"),  # a blind learner's: out at every call, on the host or not
     "the predecessor's bytes counted out at every call"),
    ("model_offload_trace", trace_body(peak="max(sizes[n] for n in on)"),
     "peak as the largest single component on the device"),
    ("model_offload_trace", RELEASE_LAST,
     "the component that ran last released at each switch (not the chain predecessor)"),
    ("model_offload_trace", trace_body(released="sizes[calls[-1]]"),
     "only the last component called released at the end"),
    ("model_offload_trace",  # the component's bytes counted in even when it is already on the device
     trace_body().replace("        if c not in on:\n            on.add(c)\n            moved_in = sizes[c]\n",
                          "        on.add(c)\n        moved_in = sizes[c]\n"),
     "a component's bytes counted in at every call"),
    ("model_offload_trace",  # the newcomer loaded before the predecessor leaves: the peak holds both
     trace_body().replace("        if pred.get(c) in on:\n",
                          "        if c not in on:\n"
                          "            out['peak_bytes'] = max(out['peak_bytes'], sum(sizes[n] for n in on | {c}))\n"
                          "        if pred.get(c) in on:\n"),
     "the next component loaded before its predecessor is released"),
    ("model_offload_trace",  # the peak read before the call's moves: one call late
     trace_body(peak="sum(sizes[n] for n in on) if on else 0", peak_first=True), Fails("wrong", "peak_bytes")),
    ("model_offload_trace",  # released as every component's bytes, whether it was on the device or not
     trace_body(released="sum(sizes.values())"), "released at the end counted as every component's bytes"),
    ("model_offload_trace",  # resident in the order the components came in
     trace_body().replace("on = set()", "on = []").replace("on.discard(pred[c])", "on.remove(pred[c])").replace(
         "on.add(c)", "on.append(c)").replace("out['resident'].append(sorted(on))", "out['resident'].append(list(on))"),
     "resident listed in the order the components came in"),
    ("group_offload_plan",  # a list's remainder dropped
     plan_body().replace("blocks = list(child[s:s + num_blocks_per_group])",
                         "blocks = list(child[s:s + num_blocks_per_group])\n"
                         "                    if len(blocks) < num_blocks_per_group:\n"
                         "                        continue"),
     "a list's last, shorter group dropped"),
    ("group_offload_plan", plan_body(inner="plan(child, '')"), "a block module's groups named without its prefix"),
    ("group_offload_plan",  # a blind learner's: every child holding modules planned on its own, like a block module
     plan_body().replace("if name in block_modules:",
                         "if name in block_modules or (not isinstance(child, (torch.nn.ModuleList, "
                         "torch.nn.Sequential)) and any(True for _ in child.children())):"),
     "every child that holds modules planned like a block module"),
    ("group_offload_plan", """
     groups, sizes = [], []
     for name, child in model.named_modules():
         if name and isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
             for s in range(0, len(child), num_blocks_per_group):
                 blocks = list(child[s:s + num_blocks_per_group])
                 groups.append([f"{name}.{s + i}" for i in range(len(blocks))])
                 sizes.append(sum(module_bytes(b) for b in blocks))
     total = module_bytes(model)
     return dict(groups=groups, peak_bytes=total - sum(sizes) + max(sizes, default=0), bytes_per_forward=total)
     """, "every ModuleList at any depth grouped"),
    ("group_offload_plan", plan_body(blocks="set()"),
     "the model's block modules ignored (_group_offload_block_modules kept whole)"),
    ("group_offload_plan", plan_body(resident="0"), "peak of the largest group alone (the resident part left out)"),
    ("group_offload_plan",
     plan_body(per_forward="sum(module_bytes(model.get_submodule(n)) for group in groups for n in group)"),
     "bytes per forward of the groups only (the resident part assumed to stay between forwards)"),
    ("group_offload_plan", ACROSS, "blocks grouped across lists (the model's lists chunked as one sequence)"),
    ("group_offload_plan", RESIDENTS_TOGETHER,
     "every resident part on the device for the whole forward (a block module's counted outside its own forward)"),
    ("group_offload_plan",  # every ModuleList outside another one, the UNet's mid_block lists included
     """
    found = [(n, c) for n, c in model.named_modules() if n and isinstance(c, (torch.nn.ModuleList, torch.nn.Sequential))]
    found = [(n, c) for n, c in found if not any(n.startswith(m + '.') for m, _ in found if m != n)]
    groups, sizes = [], []
    for name, child in found:
        for s in range(0, len(child), num_blocks_per_group):
            blocks = list(child[s:s + num_blocks_per_group])
            groups.append([f'{name}.{s + i}' for i in range(len(blocks))])
            sizes.append(sum(module_bytes(b) for b in blocks))
    total = module_bytes(model)
    return dict(groups=groups, peak_bytes=total - sum(sizes) + max(sizes, default=0), bytes_per_forward=total)
    """, "lists found below the model's own children (every ModuleList not inside another one)"),
    ("group_offload_plan",  # every group counted on the device at once: the peak of no offload at all
     plan_body(top="sum(on_top)"), Fails("wrong", "peak_bytes")),
    ("group_offload_plan",  # a block module counted whole on top of the resident part, not planned in turn
     plan_body(inner="(plan(child, prefix + name + '.'), module_bytes(child))[1]"), Fails("wrong", "peak_bytes")),
]

ALTERNATIVES = [
    ("module_bytes", "return sum(t.nbytes for t in (*module.parameters(), *module.buffers()))",
     "Tensor.nbytes is numel × element_size"),
    ("module_bytes", """
     seen = {}
     for m in module.modules():
         for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
             seen[id(t)] = t.numel() * t.dtype.itemsize
     return sum(seen.values())
     """, "module by module, with dtype.itemsize"),
    ("model_offload_trace", """
     chain_ = [n for n in offload_seq if n in sizes]
     placed = {n: False for n in sizes}
     resident, to_device, to_host, peak = [], [], [], 0
     for c in calls:
         i = chain_.index(c) if c in chain_ else -1
         p = chain_[i - 1] if i > 0 else None
         out_ = sizes[p] if p is not None and placed[p] else 0
         if p is not None:
             placed[p] = False
         in_ = 0 if placed[c] else sizes[c]
         placed[c] = True
         resident.append(sorted(n for n, v in placed.items() if v))
         to_device.append(in_)
         to_host.append(out_)
         peak = max(peak, sum(sizes[n] for n, v in placed.items() if v))
     return dict(resident=resident, to_device=to_device, to_host=to_host, peak_bytes=peak,
                 released=sum(sizes[n] for n, v in placed.items() if v))
     """, "a placement table and list indices instead of a set and a predecessor map"),
    ("group_offload_plan", """
     names = set(getattr(model, '_group_offload_block_modules', None) or ())
     groups = []

     def walk(module, prefix):
         resident = module_bytes(module)
         biggest = 0
         for name, child in module.named_children():
             if name in names:
                 resident -= module_bytes(child)
                 biggest = max(biggest, walk(child, prefix + name + '.'))
             elif isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)):
                 items = list(child)
                 while items:
                     first = len(child) - len(items)
                     chunk, items = items[:num_blocks_per_group], items[num_blocks_per_group:]
                     groups.append([f'{prefix}{name}.{first + i}' for i in range(len(chunk))])
                     size = sum(module_bytes(b) for b in chunk)
                     resident -= size
                     biggest = max(biggest, size)
         return resident + biggest

     return {'bytes_per_forward': module_bytes(model), 'peak_bytes': walk(model, ''), 'groups': groups}
     """, "a running maximum, lists consumed from the front"),
]


def _grader():
    return load_module(REPO / "graders" / f"{LAB}.py", f"_test_grader_{LAB}")


def _run(case_pipeline):
    grader = _grader()
    torch.manual_seed(0)
    case = next(c for c in grader.TRACE_CASES if c["pipeline"] == case_pipeline)
    calls, sizes, seq, events = grader.offload_run(case, torch.Generator().manual_seed(0))
    return grader, calls, sizes, seq, grader.trace_from(events, sizes)


def test_recording_an_offloaded_run_leaves_torch_and_accelerate_as_they_were():
    from accelerate.hooks import CpuOffload

    to, pre_forward = torch.nn.Module.to, CpuOffload.pre_forward
    _run("controlnet")
    assert torch.nn.Module.to is to and CpuOffload.pre_forward is pre_forward


def test_in_img2img_the_vae_stays_on_the_device_through_the_whole_loop():
    # accelerate's hook releases only the chain predecessor: the VAE encodes before the UNet runs and nothing
    # releases it until the pipeline call ends
    _, calls, sizes, _, trace = _run("img2img")
    loop = [i for i, c in enumerate(calls) if c == "unet"]
    assert loop and all(trace["resident"][i] == ["unet", "vae"] for i in loop)
    assert trace["peak_bytes"] == sizes["unet"] + sizes["vae"]


def test_a_controlnet_outside_the_chain_stays_until_the_end_and_the_unet_moves_once():
    _, calls, sizes, _, trace = _run("controlnet")
    assert calls.count("controlnet") == calls.count("unet") >= 3
    assert all("controlnet" in r for r in trace["resident"][calls.index("controlnet"):])
    assert [b for c, b in zip(calls, trace["to_device"]) if c == "unet"] == [sizes["unet"]] + [0] * (calls.count("unet") - 1)


def test_every_byte_that_comes_in_goes_back_out_in_each_recorded_trace():
    grader = _grader()
    for case in grader.TRACE_CASES:
        torch.manual_seed(0)
        calls, sizes, seq, events = grader.offload_run(case, torch.Generator().manual_seed(1))
        trace = grader.trace_from(events, sizes)
        assert sum(trace["to_device"]) == sum(trace["to_host"]) + trace["released"] > 0, case
        assert len(trace["resident"]) == len(calls)


def test_the_vae_is_planned_through_its_block_modules_and_its_peak_is_one_part():
    grader = _grader()
    torch.manual_seed(0)
    vae = grader.MODELS["vae"]()
    plan = grader.group_reference("vae", vae, 1, torch.Generator().manual_seed(0))
    assert plan["groups"][0] == ["encoder.down_blocks.0"]
    assert any(g[0].startswith("decoder.up_blocks.") for g in plan["groups"])
    assert plan["bytes_per_forward"] == vae.get_memory_footprint() > plan["peak_bytes"]


def test_group_offload_moves_the_whole_model_every_forward_and_model_offload_moves_nothing_per_step():
    # the lesson's contrast, on the same UNet size: block-level groups bring every byte in each forward
    grader = _grader()
    torch.manual_seed(0)
    unet = grader.MODELS["unet"]()
    plan = grader.group_reference("unet", unet, 1, torch.Generator().manual_seed(0))
    assert plan["bytes_per_forward"] == unet.get_memory_footprint() > plan["peak_bytes"]
    _, calls, sizes, _, trace = _run("txt2img")
    steps = [b for c, b in zip(calls, trace["to_device"]) if c == "unet"]
    assert steps[0] == sizes["unet"] and not any(steps[1:])
