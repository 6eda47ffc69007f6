"""Lab 10: wrong-but-plausible implementations fail, and the commonest ones are named."""
import pytest

from expect import Fails

LAB = "10_controlnet"

# A guess-mode step with one mistake, for controlnet_cfg_step: {control} builds ControlNet's call,
# {pad} the residuals it returns, {guide} the guided noise.
STEP = """
x2 = scheduler.scale_model_input(torch.cat([latents] * 2), timestep)
xs = scheduler.scale_model_input(latents, timestep)
text = torch.cat([negative_prompt_embeds, prompt_embeds])
{control}
{pad}
noise = unet(x2, timestep, encoder_hidden_states=text, down_block_additional_residuals=down,
             mid_block_additional_residual=mid).sample
u, c = noise.chunk(2)
return scheduler.step({guide}, timestep, latents).prev_sample
"""
BOTH_HALVES = ("down, mid = controlnet(x2, timestep, encoder_hidden_states=text, controlnet_cond="
               "torch.cat([control_image] * 2), conditioning_scale=conditioning_scale, guess_mode=guess_mode, "
               "return_dict=False)")
COND_HALF = ("down, mid = controlnet(xs, timestep, encoder_hidden_states=prompt_embeds, "
             "controlnet_cond=control_image, conditioning_scale=conditioning_scale, guess_mode=guess_mode, "
             "return_dict=False)")
CONTROL = ("if guess_mode:\n    " + COND_HALF + "\nelse:\n    " + BOTH_HALVES)
ZEROS_FIRST = ("if guess_mode:\n    down = [torch.cat([torch.zeros_like(d), d]) for d in down]\n"
               "    mid = torch.cat([torch.zeros_like(mid), mid])")
GUIDED = "u + guidance_scale * (c - u)"

MUTANTS = [
    # (function, wrong body, the trap the message must name, or Fails(reason, text) when no trap fits)
    ("zero_conv",
     'return torch.einsum("co,bchw->bohw", weight[:, :, 0, 0], features) + bias[None, :, None, None]',
     "the weight transposed"),
    ("zero_conv", 'return torch.einsum("oc,bchw->bohw", weight[:, :, 0, 0], features)', "the bias left out"),
    ("zero_conv",  # a blind learner's: channels last by reshape, not permute
     """
     B, C, H, W = features.shape
     w2d = weight[:, :, 0, 0]  # (C_out, C)
     tokens = features.reshape(B, H * W, C)
     out = tokens @ w2d.T + bias  # (B, H*W, C_out)
     return out.reshape(B, w2d.shape[0], H, W)
     """, "channels moved last with reshape"),
    ("zero_conv",
     'return torch.einsum("oc,bchw->bohw", weight[:, :, 0, 0], features + bias[None, :, None, None])',
     "the bias added before the weight"),
    ("zero_conv",  # only the diagonal of the weight: each channel scaled on its own, no mixing
     "return features * weight[:, :, 0, 0].diagonal()[None, :, None, None] + bias[None, :, None, None]",
     Fails("wrong", "values differ")),
    ("scale_control_residuals",
     """
     if not guess_mode:
         return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
     s = torch.logspace(0, -1, len(down_residuals) + 1) * conditioning_scale
     return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]
     """,
     "guess-mode scales reversed"),
    ("scale_control_residuals",
     """
     if not guess_mode:
         return list(down_residuals), mid_residual * conditioning_scale
     s = torch.logspace(-1, 0, len(down_residuals) + 1)
     return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1] * conditioning_scale
     """,
     "conditioning_scale applied to the mid residual only"),
    ("scale_control_residuals",
     """
     s = torch.logspace(-1, 0, len(down_residuals) + 1) * conditioning_scale
     if not guess_mode:
         return [d * conditioning_scale for d in down_residuals], mid_residual
     return [d * k for d, k in zip(down_residuals, s)], mid_residual
     """,
     "conditioning_scale applied to the down residuals only"),
    ("scale_control_residuals",
     """
     if not guess_mode:
         return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
     s = torch.logspace(-1, 0, len(down_residuals) + 1)
     return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]
     """,
     "guess mode without conditioning_scale"),
    ("scale_control_residuals",
     """
     if not guess_mode:
         return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
     s = torch.logspace(-1, 0, len(down_residuals)) * conditioning_scale
     return [d * k for d, k in zip(down_residuals, s)], mid_residual * conditioning_scale
     """,
     "a ladder of n scales"),
    ("scale_control_residuals",
     """
     if not guess_mode:
         return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
     s = torch.linspace(0.1, 1.0, len(down_residuals) + 1) * conditioning_scale
     return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]
     """,
     "a linear ladder"),
    ("scale_control_residuals",  # guess_mode ignored: one flat scale always
     "return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale",
     Fails("wrong", "values differ")),
    ("add_control_residuals",
     """
     skips = tuple(s + r for s, r in zip(skip_samples, down_residuals))
     return skips, mid_block(mid_input + mid_residual)
     """,
     "the mid residual added to the mid block's input"),
    ("add_control_residuals",
     "return tuple(skip_samples), mid_block(mid_input) + mid_residual",
     "the down residuals never added to the skips"),
    ("add_control_residuals",
     """
     skips = tuple(s + r for s, r in zip(skip_samples, down_residuals))
     return skips, mid_block(mid_input + down_residuals[-1]) + mid_residual
     """,
     "the last down residual also added to the hidden state"),
    ("add_control_residuals",
     """
     skips = [s + r for s, r in zip(skip_samples, down_residuals)]
     return skips[::-1], mid_block(mid_input) + mid_residual
     """,
     "the skips returned in the order the up blocks use them"),
    ("add_control_residuals",  # residuals in reverse order: caught by value where every skip has one shape
     """
     skips = tuple(s + r for s, r in zip(skip_samples, reversed(down_residuals)))
     return skips, mid_block(mid_input) + mid_residual
     """,
     "the down residuals added in reversed order"),
    ("add_control_residuals",  # reversed only where the shapes allow it: no shape error anywhere
     """
     rev = list(reversed(down_residuals))
     if all(r.shape == s.shape for r, s in zip(rev, skip_samples)):
         down_residuals = rev
     skips = tuple(s + r for s, r in zip(skip_samples, down_residuals))
     return skips, mid_block(mid_input) + mid_residual
     """,
     "the down residuals added in reversed order"),
    ("controlnet_cfg_step",
     STEP.format(control=BOTH_HALVES, pad="", guide=GUIDED),
     "guess mode: ControlNet run on both halves"),
    ("controlnet_cfg_step",  # a blind learner's: conditioning_scale passed to ControlNet and applied again after
     """
     latent_model_input = scheduler.scale_model_input(torch.cat([latents] * 2), timestep)
     embeds = torch.cat([negative_prompt_embeds, prompt_embeds])
     if guess_mode:
         control_input = scheduler.scale_model_input(latents, timestep)
         control_embeds = prompt_embeds
         image = control_image
     else:
         control_input = latent_model_input
         control_embeds = embeds
         image = torch.cat([control_image] * 2)
     down, mid = controlnet(
         control_input,
         timestep,
         encoder_hidden_states=control_embeds,
         controlnet_cond=image,
         conditioning_scale=conditioning_scale,
         guess_mode=guess_mode,
         return_dict=False,
     )
     down = [d * conditioning_scale for d in down]
     mid = mid * conditioning_scale
     if guess_mode:
         down = [torch.cat([torch.zeros_like(d), d]) for d in down]
         mid = torch.cat([torch.zeros_like(mid), mid])
     noise_pred = unet(
         latent_model_input,
         timestep,
         encoder_hidden_states=embeds,
         down_block_additional_residuals=down,
         mid_block_additional_residual=mid,
     ).sample
     noise_uncond, noise_cond = noise_pred.chunk(2)
     noise_pred = noise_uncond + guidance_scale * (noise_cond - noise_uncond)
     return scheduler.step(noise_pred, timestep, latents).prev_sample
     """, "conditioning_scale applied twice"),
    ("controlnet_cfg_step",  # right with DDIM, whose scale_model_input is the identity; Euler's is not
     STEP.format(control=CONTROL, pad=ZEROS_FIRST, guide=GUIDED)
         .replace("x2 = scheduler.scale_model_input(torch.cat([latents] * 2), timestep)", "x2 = torch.cat([latents] * 2)")
         .replace("xs = scheduler.scale_model_input(latents, timestep)", "xs = latents"),
     "the latents not passed through scheduler.scale_model_input"),
    ("controlnet_cfg_step",  # ControlNet given the raw latents, the UNet the scaled ones (Euler tells them apart)
     STEP.format(control=CONTROL.replace("controlnet(x2,", "controlnet(torch.cat([latents] * 2),")
                                .replace("controlnet(xs,", "controlnet(latents,"), pad=ZEROS_FIRST, guide=GUIDED),
     "ControlNet fed the unscaled latents"),
    ("controlnet_cfg_step",  # the scaled latents kept: scheduler.step starts from x / √(σ² + 1)
     STEP.format(control=CONTROL, pad=ZEROS_FIRST, guide=GUIDED).replace("timestep, latents).prev_sample",
                                                                           "timestep, xs).prev_sample"),
     "scheduler.step given the scaled latents"),
    ("controlnet_cfg_step",
     STEP.format(control=CONTROL, guide=GUIDED,
                 pad=ZEROS_FIRST.replace("[torch.zeros_like(d), d]", "[d, torch.zeros_like(d)]")
                                .replace("[torch.zeros_like(mid), mid]", "[mid, torch.zeros_like(mid)]")),
     "guess mode: the zero residuals given to the conditional half"),
    ("controlnet_cfg_step",
     STEP.format(control=CONTROL.replace("guess_mode=guess_mode, ", ""), pad=ZEROS_FIRST, guide=GUIDED),
     "guess mode not passed to the ControlNet"),
    ("controlnet_cfg_step",
     STEP.format(control=CONTROL.replace("conditioning_scale=conditioning_scale, ", ""), pad=ZEROS_FIRST,
                 guide=GUIDED),
     "conditioning_scale not passed"),
    ("controlnet_cfg_step",
     STEP.format(control=CONTROL, pad=ZEROS_FIRST, guide="c + guidance_scale * (u - c)"),
     "the unconditional and conditional predictions swapped"),
    ("controlnet_cfg_step",  # the control image not duplicated for the CFG batch
     STEP.format(control=CONTROL.replace("torch.cat([control_image] * 2)", "control_image"), pad=ZEROS_FIRST,
                 guide=GUIDED),
     Fails("crash", "raised RuntimeError")),
]

# Right answers written another way: they must pass (the tolerances leave room for them).
EQUIVALENTS = [
    ("zero_conv",
     "return (weight[:, :, 0, 0] @ features.flatten(2)).unflatten(2, features.shape[2:]) + bias[:, None, None]"),
    ("scale_control_residuals",
     """
     n = len(down_residuals)
     if not guess_mode:
         return [d * conditioning_scale for d in down_residuals], mid_residual * conditioning_scale
     s = [conditioning_scale * 10 ** (-1 + i / n) for i in range(n + 1)]
     return [d * k for d, k in zip(down_residuals, s)], mid_residual * s[-1]
     """),
    ("zero_conv",  # computed in float64 and cast once: judged against exact math (issue 10)
     "return (torch.einsum('oc,bchw->bohw', weight[:, :, 0, 0].double(), features.double())"
     " + bias.double()[None, :, None, None]).to(features.dtype)"),
    ("scale_control_residuals",  # a float64 ladder, each residual scaled in float32 and cast once
     """
     n = len(down_residuals)
     s = (torch.logspace(-1, 0, n + 1, dtype=torch.float64) if guess_mode
          else torch.ones(n + 1, dtype=torch.float64)) * conditioning_scale
     scaled = [(r.float() * float(k)).to(r.dtype) for r, k in zip([*down_residuals, mid_residual], s)]
     return scaled[:-1], scaled[-1]
     """),
    ("controlnet_cfg_step",  # the two halves through ControlNet and the UNet one at a time
     """
     x = scheduler.scale_model_input(latents, timestep)
     noises = []
     for text, half in ((negative_prompt_embeds, "uncond"), (prompt_embeds, "cond")):
         if guess_mode and half == "uncond":
             down = mid = None
         else:
             down, mid = controlnet(x, timestep, encoder_hidden_states=text, controlnet_cond=control_image,
                                    conditioning_scale=conditioning_scale, guess_mode=guess_mode, return_dict=False)
         if down is None:
             noises.append(unet(x, timestep, encoder_hidden_states=text).sample)
         else:
             noises.append(unet(x, timestep, encoder_hidden_states=text,
                                down_block_additional_residuals=down, mid_block_additional_residual=mid).sample)
     u, c = noises
     return scheduler.step((1 - guidance_scale) * u + guidance_scale * c, timestep, latents).prev_sample
     """),
]


def mutant_args(function):
    """Extra pytest arguments for grading one mutant (test_mutants.py)."""
    return ("-k", function)


@pytest.mark.parametrize("function, body", EQUIVALENTS, ids=[f"{e[0]}-{i}" for i, e in enumerate(EQUIVALENTS)])
def test_a_right_answer_written_another_way_passes(grade_mutant, function, body):
    graded = grade_mutant(LAB, function, body, "-k", function)
    assert graded.status == "passed", graded


def test_adding_the_residuals_in_place_fails_even_with_the_right_values(grade_mutant):
    graded = grade_mutant(LAB, "add_control_residuals", """
        for skip, residual in zip(skip_samples, down_residuals):
            skip += residual
        return tuple(skip_samples), mid_block(mid_input) + mid_residual
    """, "-k", "add_control_residuals")
    assert graded.status == "failed"
    assert "changed its input(s) skip_samples" in graded.text


def test_calling_a_convolution_for_the_zero_conv_fails_with_a_friendly_message(grade_mutant):
    graded = grade_mutant(LAB, "zero_conv", """
        return torch.nn.functional.conv2d(features, weight, bias)
    """, "-k", "zero_conv")
    assert graded.status == "failed"
    assert "is the answer key this kata is graded against" in graded.text
