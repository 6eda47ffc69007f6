"""Lab 04: wrong-but-plausible guidance code fails and the commonest mistakes are named; equivalent
rewrites of the right answer pass."""
import pytest

from expect import Fails

LAB = "04_classifier_free_guidance"

def guided_body(doubled="torch.cat([latents, latents])",
                text="torch.cat([negative_prompt_embeds, prompt_embeds])") -> str:
    """A body for guided_noise's CFG branch (one doubled call, combined, rescaled) with its batch swapped."""
    return f"""
noise = unet({doubled}, timestep, encoder_hidden_states={text}).sample
noise_uncond, noise_text = noise.chunk(2)
guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
if guidance_rescale > 0:
    guided = rescale_guidance(guided, noise_text, guidance_rescale)
return guided
"""


MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("guidance_combine",
     "return noise_text + guidance_scale * (noise_uncond - noise_text)",
     "branches swapped"),
    ("guidance_combine",
     "return noise_text + guidance_scale * (noise_text - noise_uncond)",
     "the paper's form"),
    ("guidance_combine",
     "return noise_uncond + guidance_scale * noise_text",
     "ε_u + s·ε_c (the difference"),
    ("guidance_combine",
     "return guidance_scale * (noise_text - noise_uncond)",
     "s·(ε_c − ε_u) without the ε_u base"),
    ("guidance_combine",
     "return noise_uncond + guidance_scale * noise_text - noise_uncond",
     "ε_u + s·ε_c − ε_u (parentheses missing"),
    ("guidance_combine",  # right in float32, off in the float16 case
     "return (1 - guidance_scale) * noise_uncond + guidance_scale * noise_text",
     "(1 − s)·ε_u + s·ε_c"),
    ("guidance_combine",  # the pipeline's "no guidance at s ≤ 1" moved into the formula: wrong at s = 0.5
     """
     if guidance_scale <= 1:
         return noise_text
     return noise_uncond + guidance_scale * (noise_text - noise_uncond)
     """,
     "no guidance below s = 1"),
    ("guidance_combine",  # clamped to s ≥ 1: right at 1 and above, wrong at 0 and 0.5
     "return noise_uncond + max(guidance_scale, 1.0) * (noise_text - noise_uncond)",
     "no guidance below s = 1"),
    ("guidance_combine",  # the average of the branches, scaled: no trap, still wrong
     "return guidance_scale * (noise_uncond + noise_text) / 2",
     'ε_u + s·ε_c − ε_u (parentheses missing'),
    ("rescale_guidance",  # a blind learner's: torch.lerp with its ends swapped
     """
     dims = list(range(1, noise_cfg.ndim))
     r = noise_cfg * (noise_text.std(dim=dims, keepdim=True) / noise_cfg.std(dim=dims, keepdim=True))
     return torch.lerp(r, noise_cfg, guidance_rescale)
     """,
     "the φ blend weights swapped"),
    ("rescale_guidance",  # a blind learner's: SD's 4-D latents assumed; a transformer's (B, L, C) crashes
     """
     r = noise_cfg * (noise_text.std(dim=(1, 2, 3), keepdim=True) / noise_cfg.std(dim=(1, 2, 3), keepdim=True))
     return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg
     """,
     "σ over dims (1, 2, 3): four dimensions assumed"),
    ("rescale_guidance",
     """
     r = noise_cfg * (noise_text.std() / noise_cfg.std())
     return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg
     """,
     "one σ for the whole batch"),
    ("rescale_guidance",
     """
     dims = list(range(2, noise_cfg.ndim))
     r = noise_cfg * (noise_text.std(dim=dims, keepdim=True) / noise_cfg.std(dim=dims, keepdim=True))
     return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg
     """,
     "σ per sample AND channel"),
    ("rescale_guidance",
     """
     dims = list(range(1, noise_cfg.ndim))
     return noise_cfg * (noise_text.std(dim=dims, keepdim=True) / noise_cfg.std(dim=dims, keepdim=True))
     """,
     "the rescaled prediction returned without the φ blend"),
    ("rescale_guidance",
     """
     dims = list(range(1, noise_cfg.ndim))
     r = noise_cfg * (noise_text.std(dim=dims, keepdim=True) / noise_cfg.std(dim=dims, keepdim=True))
     return guidance_rescale * r + noise_cfg
     """,
     "φ·rescaled + noise_cfg"),
    ("rescale_guidance",
     """
     dims = list(range(1, noise_cfg.ndim))
     r = noise_cfg * (noise_text.std(dim=dims, keepdim=True) / noise_cfg.std(dim=dims, keepdim=True))
     return guidance_rescale * r + (1 - guidance_rescale) * noise_text
     """,
     "blended with noise_text"),
    ("rescale_guidance",
     """
     dims = list(range(1, noise_cfg.ndim))
     r = noise_cfg * (noise_cfg.std(dim=dims, keepdim=True) / noise_text.std(dim=dims, keepdim=True))
     return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg
     """,
     "the ratio upside down"),
    ("rescale_guidance",  # rescaled to unit std instead of the text prediction's
     """
     dims = list(range(1, noise_cfg.ndim))
     r = noise_cfg / noise_cfg.std(dim=dims, keepdim=True)
     return guidance_rescale * r + (1 - guidance_rescale) * noise_cfg
     """,
     Fails("wrong", "values differ")),
    ("guided_noise", guided_body(text="torch.cat([prompt_embeds, negative_prompt_embeds])"),
     "conditioning batch built text-first"),
    ("guided_noise",  # a blind learner's: the latents doubled with repeat_interleave
     "if guidance_scale <= 1:\n    return unet(latents, timestep, encoder_hidden_states=prompt_embeds).sample\n"
     + guided_body(doubled="latents.repeat_interleave(2, dim=0)"),
     "the latents doubled sample by sample"),
    ("guided_noise",
     """
     noise = unet(torch.cat([latents, latents]), timestep,
                  encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample
     noise_uncond, noise_text = noise.chunk(2)
     return guidance_combine(noise_uncond, noise_text, guidance_scale)
     """,
     "guidance_rescale ignored"),
    ("guided_noise",
     """
     noise = unet(torch.cat([latents, latents]), timestep,
                  encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample
     noise_uncond, noise_text = noise.chunk(2)
     guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
     if guidance_rescale > 0:
         guided = rescale_guidance(guided, noise_uncond, guidance_rescale)
     return guided
     """,
     "rescaled towards the unconditional"),
    ("guided_noise",
     """
     noise = unet(torch.cat([latents, latents]), timestep,
                  encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample
     return noise.chunk(2)[1]
     """,
     "the text prediction alone"),
    ("guided_noise",  # no shortcut at s ≤ 1: the same as the pipeline at s = 1 only
     """
     noise = unet(torch.cat([latents, latents]), timestep,
                  encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample
     noise_uncond, noise_text = noise.chunk(2)
     guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
     if guidance_rescale > 0:
         guided = rescale_guidance(guided, noise_text, guidance_rescale)
     return guided
     """,
     "guidance applied at guidance_scale ≤ 1"),
    ("guided_noise",  # the shortcut taken only at exactly s = 1
     """
     if guidance_scale == 1:
         return text_noise(unet, latents, timestep, prompt_embeds)
     noise = unet(torch.cat([latents, latents]), timestep,
                  encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample
     noise_uncond, noise_text = noise.chunk(2)
     guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
     if guidance_rescale > 0:
         guided = rescale_guidance(guided, noise_text, guidance_rescale)
     return guided
     """,
     "guidance applied at guidance_scale ≤ 1"),
    ("guided_noise",  # latents not doubled: the UNet sees B latents against 2B prompts and fails
     """
     noise = unet(latents, timestep,
                  encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds])).sample
     noise_uncond, noise_text = noise.chunk(2)
     return guidance_combine(noise_uncond, noise_text, guidance_scale)
     """,
     Fails("crash", "raised RuntimeError")),
]


def test_two_separate_denoiser_calls_fail_say_how_many_calls_were_seen_and_name_the_trap(grade_mutant):
    graded = grade_mutant(LAB, "guided_noise", """
        noise_uncond = text_noise(unet, latents, timestep, negative_prompt_embeds)
        noise_text = text_noise(unet, latents, timestep, prompt_embeds)
        guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
        if guidance_rescale > 0:
            guided = rescale_guidance(guided, noise_text, guidance_rescale)
        return guided
    """)
    assert graded.status == "failed"
    assert "made 2 calls to the denoiser with batch sizes [1, 1]" in graded.text, graded.text
    assert "trap: one denoiser call per branch (two calls of batch B)" in graded.text, graded.text


EQUIVALENT = [
    ("guidance_combine", "return torch.lerp(noise_uncond, noise_text, guidance_scale)"),
    ("guidance_combine",  # float64 then cast: judged against the float64 shadow (float16 at s = 12 too)
     """
     u = noise_uncond.double()
     return ((1 - guidance_scale) * u + guidance_scale * noise_text.double()).to(noise_uncond.dtype)
     """),
    ("rescale_guidance",  # float64 statistics and blend, cast once
     """
     c, t = noise_cfg.double(), noise_text.double()
     dims = list(range(1, c.ndim))
     r = c * (t.std(dim=dims, keepdim=True) / c.std(dim=dims, keepdim=True))
     return (guidance_rescale * r + (1 - guidance_rescale) * c).to(noise_cfg.dtype)
     """),
    ("rescale_guidance",  # biased std via the variance: the ratio cancels the estimator's factor
     """
     dims = tuple(range(1, noise_cfg.ndim))
     ratio = (noise_text.var(dim=dims, correction=0, keepdim=True)
              / noise_cfg.var(dim=dims, correction=0, keepdim=True)).sqrt()
     return noise_cfg * (guidance_rescale * ratio + 1 - guidance_rescale)
     """),
    ("guided_noise",  # the s ≤ 1 shortcut on 2B (accepted), keyword arguments, return_dict=False
     """
     noise = unet(sample=torch.cat([latents] * 2), timestep=timestep,
                  encoder_hidden_states=torch.cat([negative_prompt_embeds, prompt_embeds]),
                  return_dict=False)[0]
     noise_uncond, noise_text = noise.chunk(2)
     if guidance_scale <= 1:
         return noise_text
     guided = guidance_combine(noise_uncond, noise_text, guidance_scale)
     return rescale_guidance(guided, noise_text, guidance_rescale)
     """),
]


@pytest.mark.parametrize("function, body", EQUIVALENT, ids=[f"{m[0]}-{i}" for i, m in enumerate(EQUIVALENT)])
def test_an_equivalent_rewrite_of_the_right_answer_passes(grade_mutant, function, body):
    graded = grade_mutant(LAB, function, body)
    assert graded.status == "passed", graded


def test_calling_the_diffusers_rescale_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "rescale_guidance", """
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import rescale_noise_cfg
        return rescale_noise_cfg(noise_cfg, noise_text, guidance_rescale)
    """)
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
