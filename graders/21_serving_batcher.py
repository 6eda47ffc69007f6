"""Grader for lab 21 · Serving: a step-level batcher, against each request run alone through its pipeline.

Every reference is StableDiffusionPipeline (tiny UNet, no text encoder) run for ONE request at a time with its
prompt_embeds, negative_prompt_embeds, guidance_scale, num_inference_steps and a generator seeded with its seed,
output_type="latent"; a PipelineRecorder keeps what its UNet got and returned and what scheduler.step got.

pack_batch: the entries are requests at some step of their solo runs; the expected batch is the concatenation of
the UNet inputs the pipeline built for each alone (the sample doubled under CFG, the text [negative, positive]),
each row with its request's timestep. split_guided: the batch output is the concatenation of the UNet outputs of
the solo runs; the expected pieces are the guided noise each solo run handed scheduler.step. serve: each finished
request's latents against its solo run (SERVED_LATENTS: a batched UNet call rounds a sample differently from a
call on it alone); the denoiser is a DenoiserProbe, and the batch it saw at each call must hold exactly the
active requests' rows (the join / leave / cancel rules of the docstring). Budget: calls and rows on a larger run.
"""
import copy

import torch

from diffusion_katas.core.spec import Kata, KataFailure, Measurement, Scenario
from diffusion_katas.core.tolerances import EXACT, SERVED_LATENTS, STEP_MATH
from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import SD_BETAS, DenoiserProbe, PipelineRecorder

# Euler with "leading" spacing: its init_noise_sigma changes with set_timesteps, so reading it first shows
SCHEDULERS = {"ddim": ("DDIMScheduler", {}), "euler": ("EulerDiscreteScheduler", dict(timestep_spacing="leading"))}


def pipeline(kind: str):
    """A tiny StableDiffusionPipeline with the named scheduler, its config as the pipeline rewrites it and every
    value explicit: the pipeline's __init__ patches steps_offset and clip_sample but leaves them listed among the
    defaults, so a learner's `type(s).from_config(s.config)` would drop them (a standard idiom that must work)."""
    import diffusers

    name, extra = SCHEDULERS[kind]
    pipe = tiny.sd_pipeline(getattr(diffusers, name)(**SD_BETAS, **extra), unet=tiny.unet_cond().requires_grad_(False))
    config = {k: v for k, v in pipe.scheduler.config.items() if not k.startswith("_")}
    pipe.scheduler = type(pipe.scheduler)(**config)
    return pipe


def make_requests(specs, g) -> list[dict]:
    """Requests from (guidance_scale, num_inference_steps, arrival, cancel_at) specs, with random prompts."""
    return [dict(id=f"r{i}", prompt_embeds=tiny.text_embeddings(1, g), negative_prompt_embeds=tiny.text_embeddings(1, g),
                 guidance_scale=s, num_inference_steps=n, seed=int(torch.randint(0, 2**31 - 1, (), generator=g)),
                 arrival=arrival, cancel_at=cancel) for i, (s, n, arrival, cancel) in enumerate(specs)]


def solo(pipe, request, latent_shape, record=False):
    """One request alone through the pipeline: its final latents (and the recorder, when asked)."""
    C, h, w = latent_shape
    scale = pipe.vae_scale_factor
    kwargs = dict(prompt_embeds=request["prompt_embeds"], negative_prompt_embeds=request["negative_prompt_embeds"],
                  guidance_scale=request["guidance_scale"], num_inference_steps=request["num_inference_steps"],
                  generator=torch.Generator().manual_seed(request["seed"]), height=h * scale, width=w * scale,
                  output_type="latent", return_dict=False)
    assert C == pipe.unet.config.in_channels
    if not record:
        return pipe(**kwargs)[0]
    with PipelineRecorder(pipe, pipe.unet) as recorder:
        latents = pipe(**kwargs)[0]
    return latents, recorder


def _describe(requests) -> str:
    return "; ".join(f"{r['id']}: s={r['guidance_scale']:g}, {r['num_inference_steps']} steps, arrives {r['arrival']}"
                     + (f", cancelled at {r['cancel_at']}" if r["cancel_at"] is not None else "") for r in requests)


# ---- pack_batch --------------------------------------------------------------------------------------
pack_batch = Kata(
    "pack_batch",
    hints=(
        "Each request brings the rows its own pipeline call would give the UNet: how many, in which order, and "
        "at which timestep? Then concatenate, and remember where each request's rows are.",
        "CFG (s > 1): rows [x, x], text [negative, positive]; otherwise one row x with the positive text. Every "
        "row gets its request's timestep (torch.stack). layout[i] = (start, start + rows).",
        "for e in entries: rows = 2 if e['guidance_scale'] > 1 else 1; samples += [e['sample']] * rows; "
        "texts += [e['negative_prompt_embeds'], e['prompt_embeds']] if rows == 2 else [e['prompt_embeds']]; "
        "ts += [e['timestep']] * rows; layout.append((start, start + rows)); start += rows — then "
        "torch.cat(samples), torch.stack(ts), torch.cat(texts), layout",
    ),
    no_answer_key="the batch across requests is the server's own: no diffusers function builds it (the pipeline's "
                  "per-request CFG batch is inline in StableDiffusionPipeline.__call__)",
)

PACK_CASES = [
    dict(scheduler="ddim", specs=((7.5, 5), (1.0, 4), (3.0, 6)), latent_shape=(4, 8, 8)),
    # a scale below 1 (no CFG, as at 1): tells "CFG at s ≥ 1" from "CFG always"
    dict(scheduler="euler", specs=((0.5, 3), (4.0, 5)), latent_shape=(4, 8, 12)),
    dict(scheduler="ddim", specs=((2.0, 3), (5.0, 4), (1.0, 2), (1.5, 5)), latent_shape=(4, 12, 8)),
]


def _solo_steps(case, g):
    """Each request of the case run alone, recorded, at a random step of its run."""
    pipe = pipeline(case["scheduler"])
    requests = make_requests([(s, n, 0, None) for s, n in case["specs"]], g)
    picked = []
    for r in requests:
        _, recorder = solo(pipe, r, case["latent_shape"], record=True)
        k = int(torch.randint(0, r["num_inference_steps"], (), generator=g))
        picked.append((r, recorder.steps[k], k))
    return picked


@pack_batch.check("vs each request's own pipeline UNet input, concatenated", cases=PACK_CASES, tol=EXACT)
def _(case, g):
    picked = _solo_steps(case, g)
    entries, layout, start = [], [], 0
    for r, step, _ in picked:
        rows = step.denoiser_input.shape[0]
        entries.append(dict(sample=step.denoiser_input[:1].clone(), timestep=step.t.clone(),
                            prompt_embeds=r["prompt_embeds"], negative_prompt_embeds=r["negative_prompt_embeds"],
                            guidance_scale=r["guidance_scale"]))
        layout.append((start, start + rows))
        start += rows
    expected = (torch.cat([s.denoiser_input for _, s, _ in picked]),
                torch.stack([s.t for _, s, _ in picked for _ in range(s.denoiser_input.shape[0])]),
                torch.cat([s.conditioning for _, s, _ in picked]), layout)
    label = ", ".join(f"{r['id']} (s={r['guidance_scale']:g}, step {k + 1}/{r['num_inference_steps']})"
                      for r, _, k in picked)
    return Scenario(inputs=dict(entries=entries), expected=expected, label=f"{case['scheduler']}: {label}")


def _pack(entries, *, order="np", one_t=False, double_all=False, cfg_at_one=False, negative_alone=False):
    samples, ts, texts, layout, start = [], [], [], [], 0
    for e in entries:
        cfg = e["guidance_scale"] > 1 or double_all or (cfg_at_one and e["guidance_scale"] >= 1)
        rows = 2 if cfg else 1
        pair = [e["negative_prompt_embeds"], e["prompt_embeds"]]
        texts += (pair if order == "np" else pair[::-1]) if cfg else [pair[0] if negative_alone else pair[1]]
        samples += [e["sample"]] * rows
        ts += [entries[0]["timestep"] if one_t else e["timestep"]] * rows
        layout.append((start, start + rows))
        start += rows
    return torch.cat(samples), torch.stack(ts), torch.cat(texts), layout


@pack_batch.trap("the CFG text rows as [positive, negative] (the pipeline puts the negative prompt first)",
                 hint="StableDiffusionPipeline concatenates [negative_prompt_embeds, prompt_embeds] and reads the "
                      "output chunks as (uncond, text): keep that order in each request's rows.")
def _(entries):
    return _pack(entries, order="pn")


@pack_batch.trap("one timestep for the whole batch (the first request's)",
                 hint="Requests are at different points of their own schedules: each row carries its own "
                      "request's timestep, and the UNet takes a (R,) tensor of them.")
def _(entries):
    return _pack(entries, one_t=True)


@pack_batch.trap("CFG at guidance_scale = 1 too (the pipeline guides only above 1)",
                 hint="StableDiffusionPipeline's do_classifier_free_guidance is guidance_scale > 1: at s = 1 the "
                      "guided noise equals the text prediction, so the request takes one row (uses_cfg).")
def _(entries):
    return _pack(entries, cfg_at_one=True)


@pack_batch.trap("a request without CFG given its negative prompt (the pair's first row)",
                 hint="A request that does not guide runs on its prompt alone: its one text row is prompt_embeds. "
                      "[negative, positive][:rows] keeps the wrong one.")
def _(entries):
    return _pack(entries, negative_alone=True)


@pack_batch.trap("two rows for every request (CFG assumed)",
                 hint="Only a request that guides (uses_cfg(guidance_scale): s > 1) takes two rows, [negative, "
                      "positive]; any other takes one, its prompt's.")
def _(entries):
    return _pack(entries, double_all=True)


# ---- split_guided ------------------------------------------------------------------------------------
split_guided = Kata(
    "split_guided",
    hints=(
        "The layout says which rows are whose. A request with two rows gets classifier-free guidance with its "
        "own scale; a request with one row gets that row.",
        "for (a, b), s in zip(layout, scales): rows = noise_pred[a:b]; two rows: u, c = rows.chunk(2); "
        "u + s·(c − u); one row: rows.",
        "out = []; for (a, b), s in zip(layout, guidance_scales): r = noise_pred[a:b]; if b - a == 2: u, c = "
        "r.chunk(2); r = u + s * (c - u); out.append(r); return out",
    ),
    no_answer_key="StableDiffusionPipeline combines the two halves inline in __call__ (lab 04 grades that line); "
                  "splitting a batch across requests is the server's own",
)


@split_guided.check("vs the guided noise each request's own pipeline handed scheduler.step", cases=PACK_CASES,
                    tol=STEP_MATH)
def _(case, g):
    picked = _solo_steps(case, g)
    layout, start = [], 0
    for _, step, _ in picked:
        layout.append((start, start + step.denoiser_output.shape[0]))
        start = layout[-1][1]
    return Scenario(inputs=dict(noise_pred=torch.cat([s.denoiser_output for _, s, _ in picked]), layout=layout,
                                guidance_scales=[r["guidance_scale"] for r, _, _ in picked]),
                    expected=[s.step_input for _, s, _ in picked],
                    label=f"{case['scheduler']}: " + ", ".join(f"{r['id']} s={r['guidance_scale']:g}"
                                                               for r, _, _ in picked))


def _split(noise_pred, layout, guidance_scales, *, swap=False, pairs=False, first_scale=False, from_text=False):
    out = []
    for i, ((a, b), s) in enumerate(zip(layout, guidance_scales)):
        s = guidance_scales[0] if first_scale else s
        if pairs:
            a, b = 2 * i, 2 * i + (2 if b - a == 2 else 1)
        rows = noise_pred[a:b]
        if rows.shape[0] == 2:
            u, c = rows.chunk(2)
            if swap:
                u, c = c, u
            rows = (c if from_text else u) + s * (c - u)
        out.append(rows)
    return out


@split_guided.trap("uncond and text rows swapped: ε_c + s(ε_u − ε_c)",
                   hint="The first row of a CFG pair is the negative prompt's (uncond), the second the prompt's: "
                        "ε_u + s(ε_c − ε_u).")
def _(noise_pred, layout, guidance_scales):
    return _split(noise_pred, layout, guidance_scales, swap=True)


@split_guided.trap("two rows assumed per request (the rows found by position, not by the layout)",
                   hint="A request without CFG has one row: after it every request's rows start one earlier. "
                        "Read each request's rows from layout[i].")
def _(noise_pred, layout, guidance_scales):
    return _split(noise_pred, layout, guidance_scales, pairs=True)


@split_guided.trap("the first request's guidance scale for every request",
                   hint="Each request keeps its own guidance scale: combine entry i's rows with "
                        "guidance_scales[i].")
def _(noise_pred, layout, guidance_scales):
    return _split(noise_pred, layout, guidance_scales, first_scale=True)


@split_guided.trap("guided from the text prediction: ε_c + s(ε_c − ε_u)",
                   hint="Guidance starts from the unconditional prediction and moves s times the difference: "
                        "ε_u + s(ε_c − ε_u) (at s = 1 it is ε_c, not 2ε_c − ε_u).")
def _(noise_pred, layout, guidance_scales):
    return _split(noise_pred, layout, guidance_scales, from_text=True)


# ---- serve -------------------------------------------------------------------------------------------
serve = Kata(
    "serve",
    hints=(
        "Keep per request its own scheduler copy (set to its step count), its latents from its own seed, and its "
        "step count so far. Every tick: drop the cancelled, admit the arrived (in arrival order, while they fit), one "
        "batch, one call, split, step each.",
        "drop cancel_at ≤ tick (active and waiting); admit arrival ≤ tick, sorted by arrival, while rows fit "
        "max_rows (stop at the first that does not): own = deepcopy(scheduler); own.set_timesteps(n); x = randn((1, *shape), "
        "generator=Generator().manual_seed(seed)) · own.init_noise_sigma. Entries: "
        "sample = own.scale_model_input(x, t), t = own.timesteps[step]. pack_batch → unet(...).sample → "
        "split_guided → own.step(noise, t, x).prev_sample; after n steps: finished[id] = x.",
        "while pending or active: active = [a for a in active if a not cancelled]; pending = [r not cancelled]; "
        "for r in sorted(arrived, key=arrival): if rows + need > max_rows: break; admit r; if active: sample, ts, text, layout = pack_batch(entries); noise = unet(sample, ts, "
        "encoder_hidden_states=text).sample; for a, n in zip(active, split_guided(noise, layout, scales)): "
        "step it; finished ones out; tick += 1",
    ),
    no_answer_key="no diffusers function batches across requests: each request's own StableDiffusionPipeline run "
                  "is the reference, and the pipeline is what the learner replaces",
)


def expected_batches(requests, max_rows=None) -> list[int]:
    """The rows of each denoiser call under the docstring's rules: cancelled requests leave first; arrived ones
    join in list order while their rows fit under max_rows (no overtaking); finished ones leave after their step."""
    return [sum(rows for _id, rows in members) for _tick, members in _schedule(requests, max_rows)[0]]


def finishing(requests, max_rows=None) -> set[str]:
    """The ids of the requests that take their last step (a cancel_at after that tick comes too late to matter)."""
    return _schedule(requests, max_rows)[1]


# The admission rules a learner can get wrong, each as a change to _schedule: (name, hint). A wrong schedule that
# one of them reproduces call by call, and no other, is named.
_REQUESTS_NOT_ROWS = ("max_rows counted in requests, not rows",
                      "A CFG request takes 2 rows of the batch (negative and positive), one without CFG takes 1: the "
                      "sum of rows must stay ≤ max_rows.")
RULE_MISTAKES = {
    "arrival_ignored": ("every request admitted from tick 0, its arrival ignored",
                        "A request joins at the first tick ≥ its arrival (arrival ≤ tick), not before."),
    "arrival_late": ("a request admitted the tick after its arrival (arrival < tick)",
                     "A request that arrives at tick t is in tick t's batch: admit while arrival ≤ tick."),
    "cancel_late": ("a request cancelled at tick t still in that tick's batch (cancel_at < tick)",
                    "cancel_at = t means the request is gone at tick t: drop it (cancel_at ≤ tick) before that "
                    "tick's admissions and batch."),
    "cancel_kept": ("a cancelled request kept in the batches to its last step",
                    "A request cancelled while active leaves at its cancel_at tick and frees its rows: every later "
                    "call would pay for its rows, and the requests waiting for them would wait."),
    "freed_late": ("a cancelled request's rows freed only after that tick's admissions",
                   "Drop the cancelled requests first, then count the rows in use: the rows they free are there for "
                   "the requests admitted at that same tick."),
    "overtaking": ("a request that fits admitted past one that waits (continue for break)",
                   "Admission stops at the first arrived request that does not fit: a later, smaller one waits "
                   "behind it (no overtaking), so that a large request is never starved."),
    "list_order": ("requests admitted in list order, not in order of arrival",
                   "Sort the arrived requests by arrival (ties keep list order) before admitting them."),
    "rows_as_requests": _REQUESTS_NOT_ROWS,
    "rows_as_requests_admitted": _REQUESTS_NOT_ROWS,  # the active requests' rows counted right, each newcomer's as 1
    "two_rows_each": ("every request counted as 2 rows toward max_rows",
                      "Only a request with guidance_scale > 1 is doubled: one without CFG takes 1 row."),
    "limit_ignored": ("max_rows ignored", "Admit an arrived request only while its rows fit: used + rows ≤ max_rows."),
    "limit_strict": ("a request that exactly fills max_rows refused (used + rows < max_rows)",
                     "max_rows is the most rows a batch may hold: a request whose rows bring the batch to exactly "
                     "max_rows fits."),
    "call_each": ("one denoiser call per request, not one per tick",
                  "Pack every active request into one batch (pack_batch) and call the denoiser once per tick."),
}


def _schedule(requests, max_rows=None, mistake=None) -> tuple[list[tuple[int, list]], set[str]]:
    """The denoiser calls as (tick, [(request id, rows)]), and the ids of the requests that take their last step;
    `mistake` (a RULE_MISTAKES key) plays one rule wrong."""
    pending, active, calls, tick, done = list(requests), [], [], 0, set()
    rows = lambda r: 2 if r["guidance_scale"] > 1 else 1  # noqa: E731
    need = {"rows_as_requests": lambda r: 1, "two_rows_each": lambda r: 2}.get(mistake, rows)
    joining = (lambda r: 1) if mistake == "rows_as_requests_admitted" else need
    limit = None if mistake == "limit_ignored" else max_rows
    gone = (lambda r, t: r["cancel_at"] is not None and r["cancel_at"] < t) if mistake == "cancel_late" else \
        (lambda r, t: r["cancel_at"] is not None and r["cancel_at"] <= t)
    arrived = {"arrival_ignored": lambda r, t: True, "arrival_late": lambda r, t: r["arrival"] < t}.get(
        mistake, lambda r, t: r["arrival"] <= t)
    while pending or active:
        if mistake == "freed_late":
            used = sum(need(a[0]) for a in active)
        active = [a for a in active if mistake == "cancel_kept" or not gone(a[0], tick)]
        pending = [r for r in pending if not gone(r, tick)]
        if mistake != "freed_late":
            used = sum(need(a[0]) for a in active)
        order = [r for r in pending if arrived(r, tick)]
        for r in order if mistake == "list_order" else sorted(order, key=lambda r: r["arrival"]):
            if limit is not None and (used + joining(r) >= limit + (mistake != "limit_strict")):
                if mistake == "overtaking":
                    continue
                break
            used += joining(r)
            pending.remove(r)
            active.append([r, 0])
        if active:
            members = [(a[0].get("id"), rows(a[0])) for a in active]
            calls += [(tick, [m]) for m in members] if mistake == "call_each" else [(tick, members)]
            for a in active:
                a[1] += 1
                if a[1] == a[0]["num_inference_steps"]:
                    done.add(a[0].get("id"))
            active = [a for a in active if a[1] < a[0]["num_inference_steps"]]
        tick += 1
    return calls, done


def _rule_mistake(requests, max_rows, got: list[int]) -> tuple[str, str] | None:
    """The one mistake (RULE_MISTAKES' (name, hint)) whose schedule has exactly the learner's rows, call by call; None
    where none or several do."""
    fits = {RULE_MISTAKES[key] for key in RULE_MISTAKES
            if [sum(rows for _id, rows in members) for _tick, members in _schedule(requests, max_rows, key)[0]] == got}
    return fits.pop() if len(fits) == 1 else None


SERVE_CASES = [
    dict(scheduler="ddim", specs=((7.5, 5, 0, None), (1.0, 3, 1, None), (3.0, 6, 2, None), (5.0, 4, 0, 2)),
         latent_shape=(4, 8, 8)),
    # memory pressure: 4 rows hold two CFG requests and the rest queue in order of arrival (r3 is listed before
    # r4 and r5 but arrives after them); r1's cancellation frees its rows at tick 2, when r5 (one row) would fit
    # but waits behind r4 (two rows): no overtaking
    dict(scheduler="ddim", specs=((3.0, 3, 0, None), (5.0, 4, 0, 2), (1.0, 2, 0, None), (2.0, 2, 2, None),
                                  (4.0, 3, 1, None), (1.0, 3, 1, None)), latent_shape=(4, 8, 8), max_rows=4),
    dict(scheduler="euler", specs=((4.0, 4, 0, None), (1.0, 5, 0, None), (6.0, 3, 7, None)), latent_shape=(4, 8, 12)),
    dict(scheduler="ddim", specs=((2.5, 3, 0, None), (3.0, 4, 1, 0)), latent_shape=(4, 4, 4)),
    # Euler (whose scheduler counts its steps) with two requests of the same length in the same ticks: one
    # scheduler per step count, shared, steps twice per tick; and r2, cancelled at tick 9, finished at tick 2
    # and keeps its result
    dict(scheduler="euler", specs=((3.0, 4, 0, None), (5.0, 4, 1, None), (1.0, 3, 0, 9)), latent_shape=(4, 8, 8)),
]


def _verify_batches(probe, requests, expected, max_rows):
    def verify(out):
        from diffusion_katas.engine.comparison import mismatch

        if mismatch(out, expected, SERVED_LATENTS):  # wrong latents: that failure (and its trap) speaks first
            return
        got = list(probe.batch_sizes)
        calls = _schedule(requests, max_rows)[0]
        want = [sum(rows for _id, rows in members) for _tick, members in calls]
        if got == want:
            return
        k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        if k < len(want):
            tick, members = calls[k]
            yours = f"yours had {got[k]} rows" if k < len(got) else f"yours made only {len(got)} call(s)"
            first = (f"call {k + 1} (tick {tick}): {yours}; the rules give {want[k]}: "
                     + ", ".join(f"{i} ({n} row{'s' if n > 1 else ''})" for i, n in members))
        else:
            first = f"call {k + 1}: yours made {len(got) - len(want)} more call(s) than the rules' {len(want)}"
        limit = (f"; at most max_rows = {max_rows} rows, arrived requests admitted in order of arrival (ties: list "
                 "order) while they fit, none overtaking one that waits" if max_rows is not None else "")
        message = (
            f"  the denoiser's batches had {got} rows, call by call; the requests' rules give {want} (one call per "
            f"tick with any active request; 2 rows for a request with CFG, 1 without; a request leaves at its "
            f"cancel_at tick, before that tick's admissions and batch, or after its last step; it joins at the first "
            f"tick ≥ its arrival{limit})\n  first difference: {first}")
        named = _rule_mistake(requests, max_rows, got)
        if named is not None:
            name, hint = named
            message += f"\n  trap: {name}\n    {hint}"
        raise KataFailure(message)
    return verify


@serve.check("vs each request alone through StableDiffusionPipeline", cases=SERVE_CASES, tol=SERVED_LATENTS)
def _(case, g):
    pipe = pipeline(case["scheduler"])
    requests = make_requests(case["specs"], g)
    max_rows = case.get("max_rows")
    done = finishing(requests, max_rows)
    expected = {r["id"]: solo(pipe, r, case["latent_shape"]) for r in requests if r["id"] in done}
    probe = DenoiserProbe(pipe.unet)
    return Scenario(inputs=dict(unet=probe, scheduler=copy.deepcopy(pipe.scheduler), requests=requests,
                                latent_shape=case["latent_shape"], max_rows=max_rows),
                    expected=expected, verify=_verify_batches(probe, requests, expected, max_rows),
                    label=f"{case['scheduler']}" + (f", max_rows {max_rows}" if max_rows else "")
                          + f": {_describe(requests)}")


def _serve(unet, scheduler, requests, latent_shape, max_rows=None, *, shared_scheduler=False, shared_generator=False,
           unscaled=False, sigma_first=False, per_length=False, drop_cancelled=False, scaled_kept=False):
    pending, active, finished, tick = list(requests), [], {}, 0
    by_length = {}
    generator = torch.Generator().manual_seed(requests[0]["seed"]) if shared_generator else None
    while pending or active:
        active = [a for a in active if a["r"]["cancel_at"] is None or a["r"]["cancel_at"] > tick]
        pending = [r for r in pending if r["cancel_at"] is None or r["cancel_at"] > tick]
        used = sum(2 if a["r"]["guidance_scale"] > 1 else 1 for a in active)
        for r in sorted([r for r in pending if r["arrival"] <= tick], key=lambda r: r["arrival"]):
            need = 2 if r["guidance_scale"] > 1 else 1
            if max_rows is not None and used + need > max_rows:
                break
            used += need
            pending.remove(r)
            n = r["num_inference_steps"]
            own = scheduler if shared_scheduler else by_length.setdefault(n, copy.deepcopy(scheduler)) if per_length \
                else copy.deepcopy(scheduler)
            sigma = own.init_noise_sigma  # read before set_timesteps: the trap below keeps it
            own.set_timesteps(n)
            x = torch.randn((1, *latent_shape), generator=generator or torch.Generator().manual_seed(r["seed"]))
            active.append({"r": r, "s": own, "k": 0,
                           "x": x if unscaled else x * (sigma if sigma_first else own.init_noise_sigma)})
        if active:
            entries = []
            for a in active:
                t = a["s"].timesteps[a["k"]]
                scaled = a["s"].scale_model_input(a["x"], t)
                if scaled_kept:
                    a["x"] = scaled
                entries.append(dict(sample=scaled, timestep=t,
                                    prompt_embeds=a["r"]["prompt_embeds"],
                                    negative_prompt_embeds=a["r"]["negative_prompt_embeds"],
                                    guidance_scale=a["r"]["guidance_scale"]))
            sample, ts, text, layout = _pack(entries)
            with torch.no_grad():
                noise = unet(sample, ts, encoder_hidden_states=text).sample
            for a, n, e in zip(active, _split(noise, layout, [e["guidance_scale"] for e in entries]), entries):
                a["x"] = a["s"].step(n, e["timestep"], a["x"]).prev_sample
                a["k"] += 1
                if a["k"] == len(a["s"].timesteps):  # a shared scheduler's length is the last set_timesteps'
                    finished[a["r"]["id"]] = a["x"]
            active = [a for a in active if a["k"] < len(a["s"].timesteps)]
        tick += 1
    if drop_cancelled:
        return {k: v for k, v in finished.items() if next(r for r in requests if r["id"] == k)["cancel_at"] is None}
    return finished


@serve.trap("one scheduler per step count, shared by the requests of that length (Euler counts its steps)",
            hint="Requests of the same length still need schedulers of their own: EulerDiscreteScheduler keeps a step "
                 "index (and its σ's) that every step call advances. copy.deepcopy(scheduler) for each request.")
def _(**kw):
    return _serve(**kw, per_length=True)


@serve.trap("a request cancelled after it finished left without its result",
            hint="A cancel_at only matters while the request is waiting or active: one that took its last step before "
                 "that tick has already finished, and its latents are in the result.")
def _(**kw):
    return _serve(**kw, drop_cancelled=True)


@serve.trap("the scaled model input kept as the request's latents (the step taken from c_in·x)",
            hint="scale_model_input makes what the UNet reads (Euler: x/√(σ² + 1)); the scheduler steps from the "
                 "unscaled latents. Keep them apart: x_in = scale_model_input(x, t) for the batch, x for step.")
def _(**kw):
    return _serve(**kw, scaled_kept=True)


@serve.trap("one scheduler shared by every request (set_timesteps for one resets the others)",
            hint="A scheduler holds one request's state: its timesteps for n steps, Euler's step index and σ's. "
                 "Give each request copy.deepcopy(scheduler) and set that copy to the request's own step count.")
def _(**kw):
    return _serve(**kw, shared_scheduler=True)


@serve.trap("one generator for every request's initial noise",
            hint="A request's initial latents come from torch.Generator().manual_seed(its seed), as its own pipeline "
                 "call would draw them: a shared generator gives every request but the first other noise.")
def _(**kw):
    return _serve(**kw, shared_generator=True)


@serve.trap("initial latents not scaled by the request's scheduler's init_noise_sigma",
            hint="prepare_latents multiplies the noise by scheduler.init_noise_sigma (1 for DDIM, σ_max-ish for "
                 "Euler), read after set_timesteps on the request's own scheduler.")
def _(**kw):
    return _serve(**kw, unscaled=True)


@serve.trap("init_noise_sigma read before set_timesteps (Euler's changes with the step count)",
            hint="Set the request's scheduler to its step count first, then scale its noise: Euler with 'leading' "
                 "spacing starts from the largest σ of the steps it will take (e.g. 14.6 before set_timesteps(4), "
                 "4.24 after), as prepare_latents reads it after set_timesteps.")
def _(**kw):
    return _serve(**kw, sigma_first=True)


# ---- budget ------------------------------------------------------------------------------------------
@serve.budget("one denoiser call per tick, rows of the active requests only")
def _(learner, g):
    pipe = pipeline("ddim")
    specs = ((6.0, 6, 0, None), (1.0, 4, 0, None), (3.0, 5, 1, 3), (2.0, 3, 2, None), (4.5, 2, 4, None))
    requests = make_requests(specs, g)
    probe = DenoiserProbe(pipe.unet)
    learner(unet=probe, scheduler=copy.deepcopy(pipe.scheduler), requests=requests, latent_shape=(4, 8, 8),
            max_rows=None)
    want = expected_batches(requests)
    return [Measurement(f"denoiser calls serving {len(requests)} requests", probe.calls, len(want), "calls",
                        f"one batched call per tick with work ({len(want)} ticks), never one per request"),
            Measurement("denoiser rows over the run", sum(probe.batch_sizes), sum(want), "rows",
                        "2 rows per CFG request, 1 otherwise, and none for a request after its last step or its "
                        "cancellation (request r2 is cancelled at tick 3)")]
