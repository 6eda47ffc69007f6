"""Lab 21 · Serving: a step-level batcher that runs many requests through one denoiser call per step

Concept:
    A server that runs each text-to-image request through its own pipeline call uses the accelerator
    badly: a batch of one, and a queue behind it. Diffusion's loop has a natural unit of work, the step,
    so a server can batch *across requests* at every step (continuous, or step-level, batching, as LLM
    servers do per token): each active request contributes its rows to one denoiser call, gets its rows
    back, and takes its own scheduler step. Requests join the batch between steps when they arrive and
    leave it when their last step is done or when they are cancelled; their step counts, schedules and
    guidance scales can all differ. Done right, every request gets exactly the latents it would have got
    alone (up to the denoiser's batch-size rounding), and the server pays one denoiser call per step
    however many requests are in flight.

Mental model:
    - A request r: prompt and negative prompt embeddings, guidance scale s_r, n_r steps, a seed, the tick
      it arrives at and, perhaps, the tick it is cancelled at. Its state: its own scheduler (set_timesteps(n_r):
      timesteps, σ's and step index are per request), its latents, how many steps it has taken.
    - Its rows in the batch: with classifier-free guidance (s_r > 1, as StableDiffusionPipeline decides)
      two rows, [x, x] with text [negative, positive]; otherwise one row, x with the positive prompt. Each
      row carries its request's own timestep: the UNet takes a timestep per sample.
    - One tick: drop the cancelled requests (first, so their rows are free); admit the requests that
      have arrived, in order of arrival (initial latents: randn from the request's own generator × its
      scheduler's init_noise_sigma after set_timesteps, as prepare_latents); build the batch (scale_model_input by each request's scheduler); ONE denoiser call; split the output back
      by the layout; guidance per request (ε_u + s_r(ε_c − ε_u)); each request's own scheduler.step; the
      requests that took their last step leave with their latents.
    - Cost: the denoiser runs once per tick with work to do, on as many rows as the active requests
      need, and never on a request that is gone.
    - Memory: a request holds its rows in every call it is part of (the denoiser's activations grow
      with the rows), so a server caps a call at max_rows. Arrived requests join in order of arrival while
      they fit;
      one that does not fit waits, and the ones behind it wait too (overtaking would starve a large
      request); a cancellation frees its rows at once. Queueing, not failure, is the answer to memory
      pressure, and a request's latents do not depend on when it ran.

Traps:
    - One scheduler shared by every request: set_timesteps for one resets the others' timesteps and
      step index. Each request needs its own copy, set to its own step count.
    - One timestep for the whole batch: requests that joined at different ticks, or with other step
      counts, are at different noise levels.
    - The CFG rows in the wrong order: StableDiffusionPipeline puts [negative, positive] and reads the
      chunks as (uncond, text); a swap turns guidance around.
    - A layout that assumes two rows per request: a request without CFG has one, and every request
      after it would read its neighbour's rows.
    - One generator for every request (or the batch's): each request's initial noise comes from its own
      seed, or it would not reproduce its solo run.
    - Keeping a cancelled request in the batch to the end: its result is thrown away, its rows are paid
      for at every step. The budget counts the rows.
    - Counting max_rows in requests: a CFG request takes two rows, so the batch overflows; and letting a
      small request overtake one that waits: the big one may never run. The check compares the batches
      the denoiser saw, call by call, with these rules.

Precision:
    The course's one policy (lab 01 states it): compute as wide as you like. A batched UNet call rounds a
    sample differently from a call on that sample alone (other matmul blocking), so the served latents are
    judged against each request's solo pipeline run with a tolerance measured for that (SERVED_LATENTS);
    the batch's pieces are judged exactly against the pipeline's own inputs and guided outputs.

Say it out loud:
    "Every tick I drop the cancelled requests, admit the ones that arrived while they fit, and put each active request's
    rows in one batch: two rows with its negative and positive prompt if it uses CFG, one otherwise, each
    with its own timestep. One UNet call; I split the output by the layout, guide each request with its
    own scale and step it with its own scheduler. A request that finishes leaves with its latents, and it
    matches what the pipeline gives it alone."

Graded against: StableDiffusionPipeline (tiny UNet, no text encoder: prompt_embeds and
negative_prompt_embeds), each request run alone with output_type="latent", DDIM and Euler; its own UNet
inputs and guided noise recorded for the batch's pieces; budget: denoiser calls and rows, counted.
Run: python -m pytest katas/21_serving_batcher.py
"""
import copy

import torch


# ---- Worked example --------------------------------------------------------------------------------
def uses_cfg(guidance_scale: float) -> bool:
    """Whether a request runs classifier-free guidance (two rows): StableDiffusionPipeline's
    do_classifier_free_guidance for a UNet without time_cond_proj_dim."""
    return guidance_scale > 1


# ---- Your turn -------------------------------------------------------------------------------------
def pack_batch(entries: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """One denoiser batch from the active requests' pieces, in the order given.

    Graded against: the UNet inputs StableDiffusionPipeline builds for each request alone (the sample
    doubled under CFG, the text [negative, positive]), concatenated in order, with each row's timestep.
    Args:
        entries: one dict per request, with
            sample:                 (1, C, h, w) the request's latents after its scheduler's scale_model_input
            timestep:               0-dim tensor, the request's current timestep (int64 or float32)
            prompt_embeds, negative_prompt_embeds: (1, L, D)
            guidance_scale:         float
    Returns: (sample (R, C, h, w), timesteps (R,) in the entries' timestep dtype, encoder_hidden_states
        (R, L, D), layout): layout[i] = (start, stop), the rows of entry i (2 rows with CFG, else 1).
    """
    # BEGIN SOLUTION: per entry two rows ([negative, positive]) under CFG, else one; a timestep per row; record the rows
    samples, timesteps, texts, layout = [], [], [], []
    start = 0
    for entry in entries:
        # 1. The pipeline's own CFG batch for this request: the sample twice, the text [negative, positive].
        if uses_cfg(entry["guidance_scale"]):
            rows = 2
            texts += [entry["negative_prompt_embeds"], entry["prompt_embeds"]]
        else:
            rows = 1
            texts.append(entry["prompt_embeds"])
        samples += [entry["sample"]] * rows
        # 2. Each row at its own request's noise level.
        timesteps += [entry["timestep"]] * rows
        layout.append((start, start + rows))
        start += rows
    return torch.cat(samples), torch.stack(timesteps), torch.cat(texts), layout
    # END SOLUTION


def split_guided(noise_pred: torch.Tensor, layout: list[tuple[int, int]],
                 guidance_scales: list[float]) -> list[torch.Tensor]:
    """The batch's denoiser output back to each request, guided.

    Graded against: the guided noise StableDiffusionPipeline hands scheduler.step for each request alone.
    Args:
        noise_pred:      (R, C, h, w) the denoiser's output for a batch from `pack_batch`.
        layout:          pack_batch's layout.
        guidance_scales: one per entry.
    Returns: one (1, C, h, w) tensor per entry: ε_u + s(ε_c − ε_u) for a CFG entry (its rows are
        (uncond, text)), its one row otherwise.
    """
    # BEGIN SOLUTION: each entry's own rows; (uncond, text) chunks combined with its own scale
    guided = []
    for (start, stop), scale in zip(layout, guidance_scales):
        rows = noise_pred[start:stop]
        if stop - start == 2:
            # The rows are in the pipeline's order: the negative prompt's first.
            uncond, text = rows.chunk(2)
            rows = uncond + scale * (text - uncond)
        guided.append(rows)
    return guided
    # END SOLUTION


def serve(unet, scheduler, requests: list[dict], latent_shape: tuple[int, int, int],
          max_rows: int | None = None) -> dict[str, torch.Tensor]:
    """Serve every request with one denoiser call per tick, requests joining and leaving between ticks.

    Tick k = 0, 1, 2, ...:
      1. every request with cancel_at ≤ k leaves, admitted or still waiting (it gets no result);
      2. the waiting requests with arrival ≤ k are admitted in order of arrival (equal arrivals: list
         order) while their rows fit: the batch never holds more than max_rows rows (None: no limit); the
         first that does not fit waits, and so does every request queued after it (no overtaking). An
         admitted request gets its own copy of `scheduler` (copy.deepcopy), set_timesteps(its
         num_inference_steps), and its initial latents as prepare_latents draws them:
         torch.randn((1, *latent_shape), generator=torch.Generator().manual_seed(seed)) times its
         scheduler's init_noise_sigma, read after set_timesteps;
      3. if any request is active: pack the active requests, call
         unet(sample, timesteps, encoder_hidden_states=...).sample once, split, and step each request with
         its own scheduler; a request that took its last step leaves with its latents.
    Stop when every request has left.

    Graded against: StableDiffusionPipeline run for each finished request alone (its prompt_embeds,
    negative_prompt_embeds, guidance_scale, num_inference_steps and a generator seeded with its seed,
    output_type="latent"); budget: denoiser calls and rows.
    Args:
        unet:         a UNet2DConditionModel (calls counted).
        scheduler:    a configured scheduler (DDIM or Euler), to copy for each request.
        requests:     dicts with id (str), prompt_embeds and negative_prompt_embeds (1, L, D),
                      guidance_scale, num_inference_steps, seed (int), arrival (tick), cancel_at (tick or None).
        latent_shape: (C, h, w) of one request's latents.
        max_rows:     the most rows one denoiser call may hold (the server's memory), or None; ≥ 2.
    Returns: {id: final latents (1, C, h, w)} for every request that finished (none for a cancelled one).
    """
    # BEGIN SOLUTION: per request its own scheduler and generator; each tick drop, admit what fits, one call, split, step
    pending, active, finished = list(requests), [], {}
    tick = 0
    while pending or active:
        # 1. Cancellation comes first: a cancelled request costs nothing more and frees its rows for this tick.
        active = [a for a in active if a["request"]["cancel_at"] is None or a["request"]["cancel_at"] > tick]
        pending = [r for r in pending if r["cancel_at"] is None or r["cancel_at"] > tick]
        # 2. Admission in order of arrival (sorted is stable: equal arrivals keep the list order) while the rows fit (the rows are the memory a request holds in the
        #    denoiser's batch); a request joins with its own scheduler and its own initial noise
        #    (prepare_latents: randn from its generator × init_noise_sigma).
        rows = sum(2 if uses_cfg(a["request"]["guidance_scale"]) else 1 for a in active)
        for request in sorted([r for r in pending if r["arrival"] <= tick], key=lambda r: r["arrival"]):
            need = 2 if uses_cfg(request["guidance_scale"]) else 1
            if max_rows is not None and rows + need > max_rows:
                break  # no overtaking: the requests behind it wait too
            rows += need
            pending.remove(request)
            own = copy.deepcopy(scheduler)
            own.set_timesteps(request["num_inference_steps"])
            generator = torch.Generator().manual_seed(request["seed"])
            latents = torch.randn((1, *latent_shape), generator=generator) * own.init_noise_sigma
            active.append({"request": request, "scheduler": own, "latents": latents, "step": 0})
        if active:
            # 3. One batch, one call.
            entries = []
            for a in active:
                t = a["scheduler"].timesteps[a["step"]]
                entries.append({"sample": a["scheduler"].scale_model_input(a["latents"], t), "timestep": t,
                                "prompt_embeds": a["request"]["prompt_embeds"],
                                "negative_prompt_embeds": a["request"]["negative_prompt_embeds"],
                                "guidance_scale": a["request"]["guidance_scale"]})
            sample, timesteps, text, layout = pack_batch(entries)
            with torch.no_grad():
                noise_pred = unet(sample, timesteps, encoder_hidden_states=text).sample
            guided = split_guided(noise_pred, layout, [e["guidance_scale"] for e in entries])
            # 4. Each request steps with its own scheduler; the finished ones leave.
            for a, noise, entry in zip(active, guided, entries):
                a["latents"] = a["scheduler"].step(noise, entry["timestep"], a["latents"]).prev_sample
                a["step"] += 1
                if a["step"] == len(a["scheduler"].timesteps):
                    finished[a["request"]["id"]] = a["latents"]
            active = [a for a in active if a["step"] < len(a["scheduler"].timesteps)]
        tick += 1
    return finished
    # END SOLUTION
