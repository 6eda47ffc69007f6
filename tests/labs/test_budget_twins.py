"""Every budget rejects a twin: an implementation with the right values and the wrong cost.

A budget that a correct-valued, wrong-cost implementation passes measures nothing. Each budget of every
grader has a twin here; the test grades it through the real grader and expects the budget named in the
verdict. A twin may also be stopped by a check that counts the same cost (two denoiser calls for CFG fail
the call-count check). The GPU budgets' twins are marked `cuda`: they run where CUDA is (scripts/gpu-check.sh
runs them on a real GPU), and skip with that reason elsewhere.
"""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
ELEVEN = importlib.import_module("test_11_memory")

# Bodies some twins share: every block run whatever δ says (lab 20); a UNet forward thrown away each step (lab 16).
EVERY_BLOCK = """
        enc1, hid1 = blocks[0](hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                               temb=temb, image_rotary_emb=image_rotary_emb)
        r = hid1 - hidden_states
        hid, enc = run_blocks(blocks[1:], hid1, enc1, temb, image_rotary_emb)  # every block, whatever δ says
        if cache is not None and residual_change(r, cache["head_residual"]) <= threshold:
            tail_hid, tail_enc = cache["tail_residuals"]
            return hid1 + tail_hid, enc1 + tail_enc, {**cache, "should_compute": False}
        return hid, enc, {"head_residual": r, "head_output": (hid1, enc1),
                          "tail_residuals": (hid - hid1, enc - enc1), "should_compute": True}
     """
THROWN_AWAY = """
        guide = guidance_scale > 1
        scheduler.set_timesteps(num_inference_steps)
        x = latents * scheduler.init_noise_sigma
        text = torch.cat([negative_prompt_embeds, prompt_embeds]) if guide else prompt_embeds
        with torch.no_grad():
            for t in scheduler.timesteps:
                x_in = scheduler.scale_model_input(torch.cat([x, x]) if guide else x, t)
                unet(x_in, t, encoder_hidden_states=text)  # a forward thrown away: right values, twice the cost
                noise_pred = unet(x_in, t, encoder_hidden_states=text).sample
                if guide:
                    noise_uncond, noise_text = noise_pred.chunk(2)
                    noise_pred = noise_uncond + guidance_scale * (noise_text - noise_uncond)
                x = scheduler.step(noise_pred, t, x, generator=generator).prev_sample
        return x
     """

# (lab, function, budget name, the twin's body, what the verdict must say)
TWINS = [
    ("04_classifier_free_guidance", "guided_noise", "one batched denoiser call per step", """
        noise_uncond = text_noise(unet, latents, timestep, negative_prompt_embeds)
        noise_text = text_noise(unet, latents, timestep, prompt_embeds)
        guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
        if guidance_rescale > 0:
            guided = rescale_guidance(guided, noise_text, guidance_rescale)
        return guided
     """, "made 2 calls to the denoiser"),
    ("09_lora", "lora_forward", "FLOPs: the rank-r path, never ΔW",  # the merged-weight forward
     "return F.linear(x, weight + (lora_B @ lora_A) * scaling, bias)",
     "OVER FLOPs of one unmerged forward"),
    ("09_lora", "merge_lora", "FLOPs: one low-rank product",  # ΔW through a needless identity product
     """
     eye = torch.eye(lora_A.shape[-1], dtype=lora_A.dtype)
     return weight + lora_delta(lora_A @ eye, lora_B, scaling, fan_in_fan_out).to(weight.dtype)
     """, "OVER FLOPs of merging one"),
    ("11_memory", "tiled_decode", "peak bytes flat as the image grows", ELEVEN.DIFFUSERS_STYLE_TILED_DECODE,
     "trap: every decoded tile held until the end"),
    ("11_memory", "tiled_decode", "FLOPs of one pass over the tiles", None, "OVER FLOPs"),
    ("11_memory", "sliced_decode", "peak bytes of one sample at a time",
     "return vae.decoder(vae.post_quant_conv(latents) if vae.config.use_post_quant_conv else latents)",
     "trap: the whole batch decoded in one call"),
    ("11_memory", "chunked_attention", "peak bytes under the naive score matrix", """
        s = query.shape[-1] ** -0.5 if scale is None else scale
        scores = query @ key.transpose(-2, -1) * s
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
        return scores.softmax(-1).nan_to_num() @ value  # a query with every key masked: 0, as SDPA
     """, "OVER peak"),
    ("20_first_block_cache", "first_block_cache_step", "a skipped call runs the first block only", EVERY_BLOCK,
     "trap: every block run on a skipped call"),
    ("20_first_block_cache", "cached_transformer_calls", "block calls over a cached CFG run", None, "OVER block calls"),
    ("21_serving_batcher", "serve", "one denoiser call per tick, rows of the active requests only",
     importlib.import_module("test_21_serving_batcher").serve_body(call="each"), "call by call"),
    ("17_mmdit_attention", "flux_velocity", "one transformer call a step (two only for true CFG)",
     # true CFG at any true_cfg_scale, 1.0 included: v_u + 1·(v_c − v_u) = v_c, the right values for a second call
     importlib.import_module("test_17_mmdit_attention").flux_body(second="negative_prompt_embeds is not None"),
     "trap: true CFG run at true_cfg_scale = 1"),
    ("16_few_step", "few_step_sample", "one UNet call per step, batch B (no CFG batch at guidance ≤ 1)", THROWN_AWAY, "UNet calls over 5 steps"),
    ("16_few_step", "few_step_sample", "one UNet call per step, batch B (no CFG batch at guidance ≤ 1)",
     # a blind learner's: guidance from s ≥ 1, the doubled batch at s = 1 for the same values (ε_u + 1·(ε_c − ε_u))
     importlib.import_module("test_16_few_step").loop_body(guide="guidance_scale >= 1"),
     "trap: the CFG batch run at guidance_scale = 1"),
    ("25_video_latents", "decode_to_uint8", "peak memory: the uint8 video and one chunk, not the float video",
     importlib.import_module("test_25_video_latents").WHOLE_VIDEO,
     "trap: the whole float video decoded before the conversion"),
]


def twice(lab: str, function: str) -> str:
    """The solution's own block run twice (the answer computed, thrown away, computed again): right values,
    twice the work."""
    import re
    import textwrap

    lines = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s*def {function}\(", line))
    begin = next(i for i in range(start, len(lines)) if "# BEGIN SOLUTION" in lines[i])
    end = next(i for i in range(begin, len(lines)) if "# END SOLUTION" in lines[i])
    block = textwrap.dedent("\n".join(lines[begin + 1:end]))
    return "def _once():\n" + textwrap.indent(block, "    ") + "\n_once()\nreturn _once()\n"


def solution_block(lab: str, function: str) -> str:
    """The solution's body of `function`, dedented, between its BEGIN and END SOLUTION lines."""
    import re
    import textwrap

    lines = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if re.match(rf"\s*def {function}\(", line))
    begin = next(i for i in range(start, len(lines)) if "# BEGIN SOLUTION" in lines[i])
    end = next(i for i in range(begin, len(lines)) if "# END SOLUTION" in lines[i])
    return textwrap.dedent("\n".join(lines[begin + 1:end]))


TWINS.append(
    ("11_memory", "chunked_attention", "peak bytes under the naive score matrix",
     # a blind learner's: the mask made one float bias of the whole (B, H, Lq, Lk) up front, sliced per chunk
     "if attn_mask is not None and attn_mask.dtype == torch.bool:\n"
     "    full = attn_mask.expand(*query.shape[:-1], key.shape[-2]).to(query.dtype)  # held through the loop\n"
     "    attn_mask = full > 0\n"
     + solution_block("11_memory", "chunked_attention"), "trap: the mask expanded to the whole (…, Lq, Lk) score matrix"))


def whole_decoded_too() -> str:
    """tiled_decode's solution after a decode of the WHOLE latent, kept to the end (a preview cropped from it,
    say): the right values, and the untiled decode's memory on top of the tiles'."""
    block = solution_block("11_memory", "tiled_decode")
    assert block.rstrip().endswith("return out"), "the solution's tiled_decode ends otherwise: update this twin"
    head = "whole = vae.decoder(vae.post_quant_conv(latents) if vae.config.use_post_quant_conv else latents)\n"
    return head + block.rstrip()[:-len("return out")] + "del whole\nreturn out\n"


def float32_decode() -> str:
    """tiled_decode's solution run on a float32 copy of the float16 VAE: the same tiles, twice the bytes."""
    import textwrap

    return ("def _tiled(vae, latents):\n" + textwrap.indent(solution_block("11_memory", "tiled_decode"), "    ")
            + "\nreturn _tiled(vae.float(), latents.float()).to(latents.dtype)\n")


# The GPU budgets' twins: (lab, function, budget, body, what the verdict must say)
GPU_TWINS = [
    ("11_memory", "tiled_decode", "SD VAE on a GPU at 2048²", whole_decoded_too, "OVER peak CUDA memory"),
    ("11_memory", "tiled_decode", "SD VAE on a GPU at 1024²", float32_decode, "OVER peak CUDA memory"),
    ("11_memory", "chunked_attention", "16384 tokens on a GPU, float16",
     lambda: next(t[3] for t in TWINS if t[1] == "chunked_attention"), "OVER peak CUDA memory"),
]


def test_every_budget_off_the_gpu_has_a_twin():
    from diffusion_katas.core.course import Course

    course = Course(REPO)
    declared = {(lab, b.kata.name, b.name) for lab in course.graded_labs() for kata in course.graders_of(lab)
                for b in kata.budgets if not any(getattr(m, "name", "") == "cuda" for m in b.marks)}
    covered = {(lab, function, name) for lab, function, name, _, _ in TWINS}
    assert declared <= covered, f"budgets without a twin: {sorted(declared - covered)}"
    assert covered <= declared, f"twins of budgets that do not exist: {sorted(covered - declared)}"


def test_every_gpu_budget_has_a_twin_that_builds():
    from diffusion_katas.core.course import Course

    course = Course(REPO)
    declared = {(lab, b.kata.name, b.name) for lab in course.graded_labs() for kata in course.graders_of(lab)
                for b in kata.budgets if any(getattr(m, "name", "") == "cuda" for m in b.marks)}
    assert declared == {(lab, function, name) for lab, function, name, _, _ in GPU_TWINS}


@pytest.mark.parametrize("lab, function, budget, body, says", GPU_TWINS, ids=[f"{t[1]}-{t[2]}" for t in GPU_TWINS])
def test_a_gpu_budgets_twin_has_the_right_values(grade_mutant, lab, function, budget, body, says):
    # Off the GPU too: a twin that failed a check would only make its budget wait, and measure nothing.
    graded = grade_mutant(lab, function, body(), "-m", "not budget")
    assert graded.status == "passed", graded.text


@pytest.mark.cuda
@pytest.mark.parametrize("lab, function, budget, body, says", GPU_TWINS, ids=[f"{t[1]}-{t[2]}" for t in GPU_TWINS])
def test_a_correct_valued_twin_with_the_wrong_cost_is_rejected_on_a_gpu(grade_mutant, lab, function, budget, body,
                                                                       says):
    import re

    size = re.search(r"\d{4,}", budget).group()  # this budget alone: its image side or token count
    graded = grade_mutant(lab, function, body(), "-m", "cuda", "-k", size)
    assert graded.status == "over budget", graded
    assert f"budget '{budget}'" in graded.text, graded.text
    assert says in graded.text, graded.text


def _twin_ids(twins) -> list[str]:
    """lab-function-budget, with -2, -3 … for a budget's second and later twins."""
    ids, seen = [], {}
    for t in twins:
        base = f"{t[0][:2]}-{t[1]}-{t[2]}"
        seen[base] = seen.get(base, 0) + 1
        ids.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    return ids


@pytest.mark.parametrize("lab, function, budget, body, says", TWINS, ids=_twin_ids(TWINS))
def test_a_correct_valued_twin_with_the_wrong_cost_is_rejected(grade_mutant, lab, function, budget, body, says):
    graded = grade_mutant(lab, function, body if body is not None else twice(lab, function))
    assert graded.status in ("over budget", "failed"), graded
    if graded.status == "over budget":
        assert f"budget '{budget}'" in graded.text, graded.text
    else:  # stopped by a check that counts the same cost: the values themselves must have been right
        assert "worst element" not in graded.text, graded.text
    assert says in graded.text, graded.text


# Twins that hide their cost from the measure instead of paying it: the count rewritten, the counted model
# called around its probe, the work moved to a thread. Each must fail; none may pass or come in under budget.
THREADED = """
import threading
out = []
worker = threading.Thread(target=lambda: out.append({work}))
worker.start()
worker.join()
return out[0]
"""
HIDDEN_COST = [
    ("04_classifier_free_guidance", "guided_noise", """
        noise_uncond = text_noise(unet, latents, timestep, negative_prompt_embeds)
        noise_text = text_noise(unet, latents, timestep, prompt_embeds)
        unet.batch_sizes[:] = [2 * latents.shape[0]]  # two calls of B, recorded as the one call of 2B
        guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
        if guidance_rescale > 0:
            guided = rescale_guidance(guided, noise_text, guidance_rescale)
        return guided
     """, "has no attribute 'batch_sizes'"),
    ("16_few_step", "few_step_sample", THROWN_AWAY.replace(  # the thrown-away forward, around the probe
        "unet(x_in, t, encoder_hidden_states=text)  #", "unet.denoiser(x_in, t, encoder_hidden_states=text)  #"),
     "has no attribute 'denoiser'"),
    ("09_lora", "lora_forward", THREADED.format(work="F.linear(x, weight + (lora_B @ lora_A) * scaling, bias)"),
     "started a thread"),
    ("11_memory", "sliced_decode", THREADED.format(work="vae.decoder(vae.post_quant_conv(latents) if vae.config.use_post_quant_conv else latents)"),
     "started a thread"),
    ("20_first_block_cache", "first_block_cache_step", EVERY_BLOCK.replace(  # and the log emptied after
        "        if cache is not None", "        blocks.calls.clear()\n        if cache is not None", 1), "OVER block calls"),
]


@pytest.mark.parametrize("lab, function, body, says", HIDDEN_COST, ids=[f"{t[0][:2]}-{t[1]}" for t in HIDDEN_COST])
def test_a_twin_that_hides_its_cost_from_the_measure_fails(grade_mutant, lab, function, body, says):
    graded = grade_mutant(lab, function, body)
    assert graded.status in ("failed", "over budget"), graded  # refused, or its cost counted after all
    assert says in graded.text, graded.text
