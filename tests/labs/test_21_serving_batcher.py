"""Lab 21: wrong-but-plausible step-level batchers fail, the commonest by name; the reference is each request alone."""
from pathlib import Path

import torch

from diffusion_katas.core.course import load_module
from expect import Fails

LAB = "21_serving_batcher"
REPO = Path(__file__).resolve().parents[2]


def pack_body(text="[e['negative_prompt_embeds'], e['prompt_embeds']]", rows="2 if uses_cfg(e['guidance_scale']) else 1",
              t="e['timestep']", span="(start, start + n)") -> str:
    """A body for pack_batch with one line swapped for a wrong one."""
    return f"""
    samples, ts, texts, layout, start = [], [], [], [], 0
    for e in entries:
        n = {rows}
        texts += {text} if n == 2 else [e['prompt_embeds']]
        samples += [e['sample']] * n
        ts += [{t}] * n
        layout.append({span})
        start += n
    return torch.cat(samples), torch.stack(ts), torch.cat(texts), layout
    """


def split_body(rows="noise_pred[a:b]", combine="u + s * (c - u)", scale="s") -> str:
    """A body for split_guided with one line swapped."""
    return f"""
    out = []
    for i, ((a, b), s) in enumerate(zip(layout, guidance_scales)):
        s = {scale}
        r = {rows}
        if r.shape[0] == 2:
            u, c = r.chunk(2)
            r = {combine}
        out.append(r)
    return out
    """


def serve_body(own="copy.deepcopy(scheduler)", gen="torch.Generator().manual_seed(r['seed'])",
               noise="* own.init_noise_sigma", admit="r['arrival'] <= tick",
               alive="r['cancel_at'] is None or r['cancel_at'] > tick", keep_result="True",
               call="one", need="2 if r['guidance_scale'] > 1 else 1", full="break") -> str:
    """A body for serve with one rule swapped for a wrong one."""
    return f"""
    pending, active, done, tick = list(requests), [], {{}}, 0
    while pending or active:
        for a in active:
            r = a['r']
            a['cancelled'] = a['cancelled'] or not ({alive})
        active = [a for a in active if not a['cancelled'] or {keep_result} is False]
        pending = [r for r in pending if {alive}]
        used = sum(2 if a['r']['guidance_scale'] > 1 else 1 for a in active if not a['cancelled'])
        for r in sorted([r for r in pending if {admit}], key=lambda r: r['arrival']):
            need = {need}
            if max_rows is not None and used + need > max_rows:
                {full}
            used += need
            pending.remove(r)
            own = {own}
            own.set_timesteps(r['num_inference_steps'])
            x = torch.randn((1, *latent_shape), generator={gen}) {noise}
            active.append(dict(r=r, s=own, x=x, k=0, cancelled=False))
        if active:
            entries = []
            for a in active:
                t = a['s'].timesteps[a['k']]
                entries.append(dict(sample=a['s'].scale_model_input(a['x'], t), timestep=t,
                                    prompt_embeds=a['r']['prompt_embeds'],
                                    negative_prompt_embeds=a['r']['negative_prompt_embeds'],
                                    guidance_scale=a['r']['guidance_scale']))
            if "{call}" == "one":
                sample, ts, text, layout = pack_batch(entries)
                noise_pred = unet(sample, ts, encoder_hidden_states=text).sample
                guided = split_guided(noise_pred, layout, [e['guidance_scale'] for e in entries])
            else:  # one call per request
                guided = []
                for e in entries:
                    sample, ts, text, layout = pack_batch([e])
                    guided += split_guided(unet(sample, ts, encoder_hidden_states=text).sample, layout,
                                           [e['guidance_scale']])
            for a, n, e in zip(active, guided, entries):
                a['x'] = a['s'].step(n, e['timestep'], a['x']).prev_sample
                a['k'] += 1
                if a['k'] == len(a['s'].timesteps) and not a['cancelled']:
                    done[a['r']['id']] = a['x']
            active = [a for a in active if a['k'] < len(a['s'].timesteps)]
        tick += 1
    return done
    """


MUTANTS = [
    ("pack_batch", pack_body(text="[e['prompt_embeds'], e['negative_prompt_embeds']]"),
     "the CFG text rows as [positive, negative]"),
    ("pack_batch", pack_body(t="entries[0]['timestep']"), "one timestep for the whole batch"),
    ("pack_batch", pack_body(rows="2"), "two rows for every request (CFG assumed)"),
    ("pack_batch", pack_body(rows="2 if e['guidance_scale'] >= 1 else 1"), "CFG at guidance_scale = 1 too"),
    ("pack_batch",  # timesteps rebuilt from Python floats: float32 where the requests' are int64 (DDIM)
     pack_body().replace("torch.stack(ts)", "torch.tensor([float(t) for t in ts])"),
     "output[1] holds the right numbers as float32 where the reference returns int64"),
    ("pack_batch",  # a blind learner's: [negative, positive][:rows], the negative prompt for a one-row request
     pack_body().replace("texts += [e['negative_prompt_embeds'], e['prompt_embeds']] if n == 2 else [e['prompt_embeds']]",
                         "texts += [e['negative_prompt_embeds'], e['prompt_embeds']][:n]"),
     "a request without CFG given its negative prompt"),
    ("serve",  # a blind learner's: the scaled input written back into the latents (Euler steps from it)
     serve_body().replace("entries.append(dict(sample=a['s'].scale_model_input(a['x'], t), timestep=t,",
                          "a['x'] = a['s'].scale_model_input(a['x'], t)\n"
                          "                entries.append(dict(sample=a['x'], timestep=t,"),
     "the scaled model input kept as the request's latents"),
    ("pack_batch",  # the layout as (start, number of rows)
     pack_body(span="(start, n)"), Fails("wrong", "")),
    ("split_guided", split_body(combine="c + s * (u - c)"), "uncond and text rows swapped"),
    ("split_guided", split_body(rows="noise_pred[2 * i:2 * i + (b - a)]"), "two rows assumed per request"),
    ("split_guided", split_body(scale="guidance_scales[0]"), "the first request's guidance scale for every request"),
    ("split_guided",  # a blind learner's: a one-row request's row taken with an integer index
     split_body(rows="noise_pred[a:b] if b - a == 2 else noise_pred[a]"), "output[1]: the right values with the size-1 axis 0 dropped"),
    ("split_guided", split_body(combine="c + s * (c - u)"), "guided from the text prediction"),
    ("serve", serve_body(own="scheduler"), "one scheduler shared by every request"),
    ("serve",  # one scheduler per step count: fine for DDIM, whose step keeps no count; Euler's does
     serve_body(own="by_length.setdefault(r['num_inference_steps'], copy.deepcopy(scheduler))").replace(
         "pending, active, done, tick = list(requests), [], {}, 0",
         "pending, active, done, tick = list(requests), [], {}, 0\n    by_length = {}"),
     "one scheduler per step count, shared by the requests of that length"),
    ("serve",  # every request with a cancel_at left out of the result, even one that finished before it
     serve_body().replace("    return done", "    return {k: v for k, v in done.items() "
                                           "if next(r for r in requests if r['id'] == k)['cancel_at'] is None}"),
     "a request cancelled after it finished left without its result"),
    ("serve", serve_body(gen="shared_generator"
                         ).replace("pending, active, done, tick = list(requests), [], {}, 0",
                                   "pending, active, done, tick = list(requests), [], {}, 0\n"
                                   "    shared_generator = torch.Generator().manual_seed(requests[0]['seed'])"),
     "one generator for every request's initial noise"),
    ("serve", serve_body(noise=""), "initial latents not scaled by the request's scheduler's init_noise_sigma"),
    ("serve",  # every request admitted at tick 0, arrival ignored: right latents, the wrong batches
     serve_body(admit="True"), "every request admitted from tick 0, its arrival ignored"),
    ("serve",  # admitted the tick after arrival
     serve_body(admit="r['arrival'] < tick"), "a request admitted the tick after its arrival"),
    ("serve",  # cancelled one tick late: still in the batch of its cancel_at tick
     serve_body(alive="r['cancel_at'] is None or r['cancel_at'] >= tick"),
     "a request cancelled at tick t still in that tick's batch"),
    ("serve",  # a cancelled request kept in the batch to its end, its result dropped
     serve_body(keep_result="False"), "a cancelled request kept in the batches to its last step"),
    ("serve",  # the rows in use counted before the cancelled requests leave: their rows free up a tick late
     serve_body().replace("        used = sum(2 if a['r']['guidance_scale'] > 1 else 1 for a in active if not a['cancelled'])\n",
                          "").replace("        active = [a for a in active if not a['cancelled']",
                                      "        used = sum(2 if a['r']['guidance_scale'] > 1 else 1 for a in active)\n"
                                      "        active = [a for a in active if not a['cancelled']"),
     "a cancelled request's rows freed only after that tick's admissions"),
    ("serve",  # a cancelled request's latents returned as if it had finished
     serve_body(alive="True"), Fails("wrong", "")),
    ("serve",  # one denoiser call per request: right latents, the wrong cost
     serve_body(call="each"), "one denoiser call per request, not one per tick"),
    ("serve",  # max_rows counted in requests, not rows: two CFG requests and a third in a batch of 4 "requests"
     serve_body(need="1"), "max_rows counted in requests, not rows"),
    ("serve",  # every request as two rows, CFG or not
     serve_body(need="2"), "every request counted as 2 rows toward max_rows"),
    ("serve",  # max_rows never read
     serve_body(full="pass"), "max_rows ignored"),
    ("serve",  # a request that would fill the batch exactly is refused
     serve_body().replace("used + need > max_rows", "used + need >= max_rows"),
     "a request that exactly fills max_rows refused"),
    ("serve",  # a request that fits overtakes one that waits
     serve_body(full="continue"), "a request that fits admitted past one that waits"),
    ("serve",  # admitted in list order instead of order of arrival
     serve_body().replace("key=lambda r: r['arrival']", "key=lambda r: 0"),
     "requests admitted in list order, not in order of arrival"),
    ("serve",  # the scale read before set_timesteps
     serve_body().replace("            own.set_timesteps(r['num_inference_steps'])\n",
                          "").replace("x = torch.randn(", "own_sigma = own.init_noise_sigma\n            "
                                      "own.set_timesteps(r['num_inference_steps'])\n            x = torch.randn(")
     .replace("{noise}", "").replace(") * own.init_noise_sigma", ") * own_sigma"),
     "init_noise_sigma read before set_timesteps"),
]

ALTERNATIVES = [
    ("pack_batch", """
     layout, start = [], 0
     for e in entries:
         n = 2 if e["guidance_scale"] > 1 else 1
         layout.append((start, start + n))
         start += n
     rows = [n for a, b in layout for n in [b - a]]
     sample = torch.cat([e["sample"].expand(n, -1, -1, -1) for e, n in zip(entries, rows)])
     timesteps = torch.cat([e["timestep"].reshape(1).repeat(n) for e, n in zip(entries, rows)])
     text = torch.cat([torch.cat([e["negative_prompt_embeds"], e["prompt_embeds"]]) if n == 2 else e["prompt_embeds"]
                       for e, n in zip(entries, rows)])
     return sample, timesteps, text, layout
     """, "the layout first, expand and repeat instead of lists of rows"),
    ("split_guided", """
     return [noise_pred[a:b] if b - a == 1 else
             (1 - s) * noise_pred[a:a + 1] + s * noise_pred[a + 1:b]
             for (a, b), s in zip(layout, guidance_scales)]
     """, "(1 − s)·ε_u + s·ε_c: the same combination, factored"),
]


def _grader():
    return load_module(REPO / "graders" / f"{LAB}.py", f"_test_grader_{LAB}")


def test_the_batch_rules_give_one_call_per_tick_with_work():
    grader = _grader()
    requests = [dict(guidance_scale=7.5, num_inference_steps=3, arrival=0, cancel_at=None),
                dict(guidance_scale=1.0, num_inference_steps=2, arrival=1, cancel_at=None),
                dict(guidance_scale=3.0, num_inference_steps=4, arrival=0, cancel_at=2),
                dict(guidance_scale=2.0, num_inference_steps=1, arrival=6, cancel_at=None)]
    # tick 0: r0 + r2 (2 + 2); tick 1: r0, r1, r2 (5); tick 2: r2 cancelled: r0, r1 (3); ticks 3-5 idle; tick 6: r3
    assert grader.expected_batches(requests) == [4, 5, 3, 2]
    # at most 4 rows: r1 waits at tick 1 (4 + 1 > 4) and joins at tick 2, when r2's cancellation frees its rows
    assert grader.expected_batches(requests, max_rows=4) == [4, 4, 3, 1, 2]


def test_the_memory_case_queues_frees_rows_on_cancel_and_never_overtakes():
    grader = _grader()
    case = next(c for c in grader.SERVE_CASES if c.get("max_rows"))
    requests = [dict(guidance_scale=s, num_inference_steps=n, arrival=a, cancel_at=c) for s, n, a, c in case["specs"]]
    # tick 2: r1's cancellation frees 2 rows for r2, and r5 (1 row) would fit but waits behind r4 (2 rows, arrived
    # at the same tick, listed first); tick 3: r4 and r5 join before r3, which is listed first but arrived later
    assert grader.expected_batches(requests, max_rows=4) == [4, 4, 3, 4, 3, 3, 2, 2]


def test_a_request_served_alone_by_the_solution_is_its_pipeline_run():
    grader = _grader()
    solution = load_module(REPO / "solutions" / f"{LAB}.py", f"_test_solution_{LAB}")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    pipe = grader.pipeline("euler")
    (request,) = grader.make_requests([(5.0, 4, 0, None)], g)
    served = solution.serve(pipe.unet, pipe.scheduler, [request], (4, 8, 8))
    assert torch.allclose(served["r0"], grader.solo(pipe, request, (4, 8, 8)), atol=1e-6, rtol=1e-6)


def test_the_cases_vary_what_the_lesson_teaches():
    # both schedulers, CFG and not, late arrivals, an idle gap, a cancellation (also one before arrival)
    grader = _grader()
    specs = [s for c in grader.SERVE_CASES for s in c["specs"]]
    assert {c["scheduler"] for c in grader.SERVE_CASES} == {"ddim", "euler"}
    assert any(s[0] <= 1 for s in specs) and any(s[0] > 1 for s in specs)
    assert any(s[2] > 0 for s in specs) and any(s[3] is not None and s[3] <= s[2] for s in specs)
    # a cancellation that comes after the request finished; two Euler requests of one length side by side
    assert any(s[3] is not None and s[3] > s[2] + s[1] for s in specs)
    assert any(c["scheduler"] == "euler" and len({s[1] for s in c["specs"]}) < len(c["specs"])
               for c in grader.SERVE_CASES)
    assert len({s[1] for s in specs}) >= 3


def test_every_admission_rule_mistake_shows_in_some_case_and_is_told_apart_where_it_first_does():
    # the cases are chosen so that each wrong rule changes the batches somewhere, and at the first case where it
    # does, no other wrong rule gives the same rows (that case's failure names it)
    grader = _grader()
    g = torch.Generator().manual_seed(0)
    cases = [(grader.make_requests(c["specs"], g), c.get("max_rows")) for c in grader.SERVE_CASES]
    for key, (name, _hint) in grader.RULE_MISTAKES.items():
        for requests, max_rows in cases:
            rows = [sum(n for _id, n in members) for _tick, members in grader._schedule(requests, max_rows, key)[0]]
            if rows != grader.expected_batches(requests, max_rows):
                assert grader._rule_mistake(requests, max_rows, rows) == (name, _hint), key
                break
        else:
            raise AssertionError(f"no case shows the mistake {key!r}")
