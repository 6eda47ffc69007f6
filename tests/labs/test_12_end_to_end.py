"""Lab 12: wrong end-to-end loops and traces fail with their trap named; a TODO in an earlier lab is named too."""
from expect import Fails

LAB = "12_end_to_end"


def trace_body(old_boundary=False, **swap):
    """A body for inference_trace, the solution's, with one recorded tensor swapped (boundary name → expression)."""
    record = {"conditioning": "cond", "unet input": "x", "unet output": "out", "guided noise": "guided",
              "decoded": "decoded", "image": 'vae_lab.postprocess(decoded, "pt")', **swap}
    helper = ("""
        def boundary(name, tensor):  # the helper as lab 12 first shipped it: no values
            return {"boundary": name, "shape": tuple(tensor.shape), "dtype": str(tensor.dtype),
                    "device": str(tensor.device)}""" if old_boundary else "")
    return helper + f"""
        trace = []
        scheduler.set_timesteps(num_inference_steps)
        cond = torch.cat([negative_prompt_embeds, prompt_embeds])
        trace.append(boundary("conditioning", {record["conditioning"]}))
        latents = components.prepare_latents(prompt_embeds.shape[0], unet.config.in_channels, height, width,
            vae_lab.vae_scale_factor(vae.config.block_out_channels), float(scheduler.init_noise_sigma),
            generator, prompt_embeds.dtype)
        trace.append(boundary("initial latents", latents))
        extra = step_kwargs(scheduler, generator, 0.0)
        for i, t in enumerate(scheduler.timesteps):
            doubled = torch.cat([latents, latents])
            x = scheduler.scale_model_input(doubled, t)
            out = unet(x, t, encoder_hidden_states=cond).sample
            guided = cfg.guidance_combine(*out.chunk(2), guidance_scale)
            if i == 0:
                trace += [boundary("unet input", {record["unet input"]}),
                          boundary("unet output", {record["unet output"]}),
                          boundary("guided noise", {record["guided noise"]})]
            latents = scheduler.step(guided, t, latents, **extra).prev_sample
        trace.append(boundary("final latents", latents))
        decoded = vae_lab.decode_latents(vae, latents)
        return trace + [boundary("decoded", {record["decoded"]}), boundary("image", {record["image"]})]
    """


def denoise_body(model_input="scheduler.scale_model_input(latents, t)", extra="step_kwargs(scheduler, generator, eta)",
                 texts="prompt_embeds, negative_prompt_embeds", rescale=", guidance_rescale", scaled_kept=False) -> str:
    """A body for denoise, the solution's, with one part swapped for a wrong one (scaled_kept: the scaled input
    kept as the latents, so scheduler.step gets it)."""
    scale = "            latents = scheduler.scale_model_input(latents, t)\n" if scaled_kept else ""
    return f"""
        scheduler.set_timesteps(num_inference_steps)
        extra = {extra}
        for t in scheduler.timesteps:
{scale}            noise_pred = cfg.guided_noise(unet, {"latents" if scaled_kept else model_input}, t, {texts},
                                          guidance_scale{rescale})
            latents = scheduler.step(noise_pred, t, latents, **extra).prev_sample
        return latents
    """


def image_body(channels="unet.config.in_channels", factor="vae_lab.vae_scale_factor(vae.config.block_out_channels)",
               generator_on="generator", out='vae_lab.postprocess(vae_lab.decode_latents(vae, latents), "pt")') -> str:
    """A body for text_to_image, the solution's, with one argument or the last line swapped for a wrong one."""
    return f"""
        scheduler.set_timesteps(num_inference_steps)
        latents = components.prepare_latents(prompt_embeds.shape[0], {channels}, height, width, {factor},
            float(scheduler.init_noise_sigma), generator, prompt_embeds.dtype)
        latents = denoise(unet, scheduler, latents, prompt_embeds, negative_prompt_embeds, num_inference_steps,
                          guidance_scale, {generator_on}, eta, guidance_rescale)
        return {out}
    """


MUTANTS = [
    ("denoise", denoise_body(model_input="latents"), "scale_model_input skipped"),
    ("denoise", denoise_body(extra="{}"), "eta and generator not passed"),
    ("denoise", denoise_body(texts="negative_prompt_embeds, prompt_embeds"),
     "the CFG batch's text ordered [positive, negative]"),  # the prompts swapped: guidance away from the prompt
    ("denoise", denoise_body(rescale=""), "guidance_rescale ignored"),
    ("denoise", denoise_body(scaled_kept=True), "scheduler.step given the scaled model input"),
    ("text_to_image", """
        sigma = float(scheduler.init_noise_sigma)
        scheduler.set_timesteps(num_inference_steps)
        latents = components.prepare_latents(prompt_embeds.shape[0], unet.config.in_channels, height, width,
            vae_lab.vae_scale_factor(vae.config.block_out_channels), sigma, generator, prompt_embeds.dtype)
        latents = denoise(unet, scheduler, latents, prompt_embeds, negative_prompt_embeds, num_inference_steps,
                          guidance_scale, generator, eta, guidance_rescale)
        return vae_lab.postprocess(vae_lab.decode_latents(vae, latents), "pt")
     """, "init_noise_sigma read before set_timesteps"),
    ("text_to_image", image_body(out="vae_lab.decode_latents(vae, latents)"),
     "the decoder's [−1, 1] output returned without postprocessing"),
    ("text_to_image", image_body(out="vae_lab.decode_latents(vae, latents) * 0.5 + 0.5"),
     "the [−1, 1] → [0, 1] mapping not clamped"),
    ("text_to_image", image_body(factor="8"), "the VAE factor hard-coded to SD's 8"),
    ("text_to_image",  # a blind learner's: 2 ** len(block_out_channels), one level too many
     image_body(factor="2 ** len(vae.config.block_out_channels)"), "the VAE factor one level too many"),
    ("text_to_image", image_body(generator_on="None"), "the generator not handed on to denoise"),
    ("text_to_image", image_body(channels="4"),
     Fails("crash", "RuntimeError")),  # SD's 4 latent channels hard-coded: the 3-channel UNet refuses them
    ("inference_trace", trace_body(conditioning="prompt_embeds"), "the conditioning recorded as the prompt alone"),
    ("inference_trace",  # a blind learner's: x_T recorded before prepare_latents scaled it
     trace_body().replace('trace.append(boundary("initial latents", latents))',
                          'trace.append(boundary("initial latents", latents / scheduler.init_noise_sigma))'),
     "the initial latents recorded before the init_noise_sigma scaling"),
    ("inference_trace", trace_body(image='vae_lab.postprocess(decoded.float(), "pt")'),
     "the image upcast to float32"),  # the lesson's trace-dtypes trap: postprocessed in float32
    # Lab 12's trace by value: a tensor of the right shape recorded at the wrong point of the step
    ("inference_trace", trace_body(**{"unet input": "doubled"}), "the UNet input recorded before scale_model_input"),
    ("inference_trace", trace_body(decoded='vae_lab.postprocess(decoded, "pt")'),
     "the decoder's output recorded after postprocessing"),
    ("inference_trace", trace_body(**{"guided noise": "out.chunk(2)[1]"}), "the guided noise recorded before guidance"),
    ("inference_trace", trace_body(old_boundary=True), "records without their values"),
    ("inference_trace",  # a blind learner's: the final latents recorded as the decoder's input
     trace_body().replace('trace.append(boundary("final latents", latents))',
                          'trace.append(boundary("final latents", latents / vae.config.scaling_factor))'),
     "the final latents recorded after ÷ scaling_factor"),
    ("inference_trace",  # a blind learner's: the per-step records overwritten every step (the last step's kept)
     trace_body().replace("if i == 0:", "if i == len(scheduler.timesteps) - 1:"),
     "the per-step records taken at the last step"),
    ("inference_trace", trace_body(**{"unet output": "x"}), Fails("wrong", "output[3] ('unet output')['min']")),
]


def test_a_lab_built_on_an_unwritten_earlier_kata_is_todo_and_names_it(grade_mutant):
    graded = grade_mutant(LAB, "inference_trace", open_solution_block(), todo_siblings=("04_classifier_free_guidance",))
    assert graded.status == "todo", graded
    assert "builds on your `guidance_combine` in katas/04_classifier_free_guidance.py" in graded.text


def open_solution_block():
    """The solution's own inference_trace body, unchanged."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "solutions" / f"{LAB}.py").read_text(encoding="utf-8")
    start = text.index("    # BEGIN SOLUTION: run the generation step by step")
    end = text.index("    # END SOLUTION", start)
    return "\n".join(line for line in text[start:end].splitlines()[1:])


def test_a_loop_that_draws_one_more_number_from_the_generator_fails_although_its_latents_match(grade_mutant):
    # The right latents, then one unused draw: the pipeline's generator would now be somewhere else.
    graded = grade_mutant(LAB, "denoise", """
        scheduler.set_timesteps(num_inference_steps)
        extra = step_kwargs(scheduler, generator, eta)
        for t in scheduler.timesteps:
            noise_pred = cfg.guided_noise(unet, scheduler.scale_model_input(latents, t), t, prompt_embeds,
                                          negative_prompt_embeds, guidance_scale, guidance_rescale)
            latents = scheduler.step(noise_pred, t, latents, **extra).prev_sample
        torch.randn((1,), generator=generator)
        return latents
    """, "-k", "denoise")
    assert graded.status == "failed", graded
    assert "drew a different amount of noise" in graded.text, graded.text


# ---- where a loop first goes wrong (issue 14's localizer) ---------------------------------------------------
DENOISE = """
    scheduler.set_timesteps(num_inference_steps)
    extra = step_kwargs(scheduler, generator, eta)
    for i, t in enumerate(scheduler.timesteps):
        model_input = {model_input}
        {body}
    return latents
"""
GUIDED_STEP = """noise_pred = cfg.guided_noise(unet, model_input, {t}, prompt_embeds, negative_prompt_embeds,
                                      guidance_scale, guidance_rescale)
        latents = scheduler.step(noise_pred, t, latents, **extra).prev_sample"""
# Guidance applied after the step: step the unconditional and the text predictions separately, then mix
# the two next latents (the same for an affine step, not for DDIM's clipped x̂_0 or its noise at η > 0).
GUIDED_AFTER = """both = unet(torch.cat([model_input] * 2), t, encoder_hidden_states=torch.cat([negative_prompt_embeds,
                                                                                prompt_embeds])).sample
        uncond, text = both.chunk(2)
        state = generator.get_state() if generator is not None else None
        x_u = scheduler.step(uncond, t, latents, **extra).prev_sample
        if state is not None:
            generator.set_state(state)
        if getattr(scheduler, "_step_index", None) is not None:
            scheduler._step_index -= 1
        x_c = scheduler.step(text, t, latents, **extra).prev_sample
        latents = x_u + guidance_scale * (x_c - x_u)"""


def localized(graded) -> str:
    lines = [line.strip() for line in graded.text.splitlines() if "where it first differs:" in line]
    assert graded.status == "failed" and lines, graded.text
    return lines[0]


def test_a_failing_loop_is_told_the_step_where_it_first_left_the_pipeline(grade_mutant):
    # 1. the wrong timestep at one step (the second): named there, as the timestep itself
    graded = grade_mutant(LAB, "denoise", DENOISE.format(
        model_input="scheduler.scale_model_input(latents, t)",
        body=GUIDED_STEP.format(t="t - 1 if i == 1 else t")), "-k", "denoise")
    where = localized(graded)
    assert "step 2 of" in where and "the timestep itself" in where, where
    # 2. scale_model_input skipped: Euler's very first UNet input is √(σ² + 1)× too large (DDIM's is not scaled)
    graded = grade_mutant(LAB, "denoise", DENOISE.format(
        model_input="latents", body=GUIDED_STEP.format(t="t")), "-k", "denoise")
    where = localized(graded)
    assert "step 1 of" in where and "× the pipeline's everywhere" in where and "scale_model_input" in where, where
    # 3. guidance applied after the step: every UNet input and output agrees at step 1, the next input not
    graded = grade_mutant(LAB, "denoise", DENOISE.format(model_input="scheduler.scale_model_input(latents, t)",
                                                         body=GUIDED_AFTER), "-k", "denoise")
    where = localized(graded)
    assert "step 2 of" in where and "the update after step 1" in where, where
