"""Every mistake a lesson's "Traps:" section warns about is recognised by its grader, by name.

An explicit, reviewed accounting: each bullet of a lesson's Traps section is matched (by its first words) to
what names that mistake when a learner makes it: one or more grader traps, a budget (a cost mistake), or a
check whose own message names it (a verify, a structural message, the learner's own error). The test fails
on a bullet nobody accounted for, on an entry whose bullet is gone, and on a name the grader does not
declare. tests/labs/test_traps.py holds every trap to being separable on the graded cases.

Labs in UNACCOUNTED (by lab-number prefix) are left out, each with why; any other lab without an entry fails.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
LABS = sorted(p.stem for p in (REPO / "graders").glob("[0-9][0-9]_*.py"))


@dataclass(frozen=True)
class trap:  # noqa: N801  (reads as a declaration in the table)
    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", names)


@dataclass(frozen=True)
class budget:  # noqa: N801
    name: str


@dataclass(frozen=True)
class check:  # noqa: N801
    name: str
    why: str


LESSON_TRAPS = {
    "01_forward_noise": [
        ("ᾱ_t used where √ᾱ_t belongs", trap("ᾱ_t used where √ᾱ_t belongs")),
        ('"scaled_linear" is a linspace over √β', trap("a linspace over β itself (that is the 'linear' schedule)")),
        ("Per-sample timesteps", trap("one timestep for the whole batch (the first sample's ᾱ_t for every sample)")),
        ("float16 samples in add_noise and velocity", trap("computed in float32 and cast to float16 at the end")),
        ("Rescaling to zero terminal SNR by shifting √ᾱ alone",
         trap("shifted but not rescaled (ᾱ_0 moved too)", "shift and scale applied to ᾱ instead of √ᾱ")),
    ],
    "02_denoising_step": [
        ("The model output is not pixels and not x_{t−1}",
         trap("the model output taken as x̂0 (the model predicts noise, not pixels)",
              "v treated as ε (the epsilon formula used for v_prediction)")),
        ("ᾱ_t used where √ᾱ_t belongs", trap("ᾱ_t used where √ᾱ_t belongs")),
        ("v is not ε", trap("v_prediction: √ᾱ·v + √(1−ᾱ)·x_t, which is ε̂, not x̂0", "v treated as ε")),
        ("DDIM's previous timestep is t − T//n",
         trap("prev_t = t − 1 (one training step instead of the stride T//n)",
              "ᾱ_prev read at a negative index (Python wraps it to the noisy end of the table)")),
        ("clip_sample defaults to True", trap("x̂0 not clipped (clip_sample is True by default)",
                                              "ε̂ recomputed from the clipped x̂0")),
        ("DDPM with a strided schedule",
         trap("α_t = 1 − β_t of the training schedule (ᾱ_t/ᾱ_{t−1}) instead of ᾱ_t/ᾱ_prev")),
        ("Noise: std, not variance",
         trap("σ² used where σ belongs (variance instead of std)", "variance used where the std belongs",
              "no noise added (η > 0 needs σ·z)", "no noise added (DDPM adds σ_t·z at every t > 0)")),
        ("Dynamic thresholding", trap("one threshold for the whole batch", "s not floored at 1 (a quiet sample is blown up to ±1)",
                                      "clamped to [−s, s] but not divided by s", "the quantile of x̂0 instead of |x̂0|")),
        ("set_alpha_to_one=False", trap("set_alpha_to_one=False ignored (ᾱ_prev = 1 at the last step)")),
        ('variance_type="fixed_large"', trap("'fixed_large' with β_t of the training table (1 − ᾱ_t/ᾱ_{t−1})")),
    ],
    "03_scheduler_reading": [
        ("A scheduler is not a loop counter",
         trap("the loop counter n−1, …, 0 (range(n) reversed) instead of the scheduler's timesteps")),
        ("The inference schedule is not the training schedule",
         trap("n consecutive training timesteps T−1, T−2, … (the spacing never applied)")),
        ('"leading" uses the integer spacing T//n',
         trap("'leading' with the float spacing T/n", "'trailing' with the integer spacing T//n from T−1",
              "'trailing' without the final −1 (it starts at T)", "steps_offset added for 'trailing'/'linspace' too",
              "steps_offset ignored for 'leading'")),
        ("Forgetting to reverse", trap("ascending order (the grid was not reversed)")),
        ('Rounding Euler\'s "linspace" timesteps, or interpolating ᾱ instead of σ',
         trap("'linspace' rounded to integers (DDIM's rule)", "ᾱ interpolated, then turned into σ")),
        ("The σ ladder has n + 1 entries", trap("no final σ = 0 (n entries instead of n + 1)")),
        ("scale_model_input divides by √(σ² + 1)",
         trap("divided by σ", "multiplied by √(σ² + 1) instead of divided", "divided by σ² + 1 (no square root)")),
        ("The model's output means what `prediction_type` says",
         trap("v-prediction treated as ε", "an x̂0 prediction ('sample') treated as ε")),
        ("σ from ᾱ = 0", trap("σ from ᾱ = 0 (∞ at the zero-terminal-SNR end of the table)")),
        ('final_sigmas_type="sigma_min" ends the ladder at σ_0',
         trap("final σ = 0 whatever final_sigmas_type says", "'log_linear' read as log σ interpolated at the timesteps")),
    ],
    "04_classifier_free_guidance": [
        ("Branches swapped", trap("branches swapped: ε_c + s·(ε_u − ε_c)",
                                  "conditioning batch built text-first (or chunks read in the wrong order)")),
        ("The paper's form with diffusers' scale", trap("the paper's form ε_c + s·(ε_c − ε_u) with diffusers' scale")),
        ("Dropping the base or the difference",
         trap("ε_u + s·ε_c (the difference ε_c − ε_u is missing)", "s·(ε_c − ε_u) without the ε_u base",
              "ε_u + s·ε_c − ε_u (parentheses missing: only the text branch is scaled)")),
        ("Rescale with one σ over the whole batch", trap("one σ for the whole batch instead of one per sample")),
        ("Rescale without the (1 − φ) mix",
         trap("the rescaled prediction returned without the φ blend",
              "φ·rescaled + noise_cfg (the (1 − φ) weight is missing)", "the ratio upside down: σ(ε̂)/σ(ε_c)")),
        ("Two denoiser calls of batch B", budget("one batched denoiser call per step")),
    ],
    "05_sampling_loop": [
        ("The loop is not a progress bar",
         check("vs DDIMPipeline, η 0/½/1, pre-clamp", "the counted UNet says 'That is the loop index' when it "
               "gets t = k at call k")),
        ("A scheduler keeps the timesteps of its last set_timesteps call",
         check("vs DDIMPipeline, η 0/½/1, pre-clamp", "the counted UNet names the earlier run's schedule the "
               "scheduler still held: 'Call scheduler.set_timesteps(num_inference_steps) before the loop'")),
        ("Calling the UNet twice per step",
         check("vs DDPMPipeline, pre-clamp sample", "the counted UNet says 'two UNet calls for one step'")),
        ("scheduler.step without generator=", trap("scheduler.step called without generator=")),
        ("DDIM's eta is a step argument", trap("eta not passed to scheduler.step (DDIM ran with η = 0)")),
        ("Clamping belongs to the very end", trap("the sample clamped to [-1, 1] inside the loop")),
        ("The pipeline draws the initial noise for the whole batch in one torch.randn call",
         trap("one torch.randn call per image")),
        ("Changing the timesteps",
         check("vs DDIMPipeline, η 0/½/1, pre-clamp", "the counted UNet names a run of another length: 'the "
               "schedule has only n timesteps: the pipeline stops after n calls', or the first wrong t")),
    ],
    "06_vae_latents": [
        ("Multiplying by the scaling factor before decoding",
         trap("multiplied by the scaling factor instead of dividing", "the scaling factor forgotten")),
        ("A hard-coded 0.18215", trap("a hard-coded 0.18215")),
        ("Taking the mode when a sample was asked for",
         trap("the mode taken when a sample was asked for", "sampled without the generator (from the global RNG)")),
        ("Postprocessing with (x + 1)/2 and no clamp", trap("(x + 1)/2 without the clamp")),
        ("Truncating to uint8 instead of rounding", trap("truncated instead of rounded")),
        ('Returning NCHW for "np"', trap("'np' left channels first (B, 3, H, W)")),
    ],
    "07_pipeline_components": [
        ("Forgetting init_noise_sigma", trap("init_noise_sigma forgotten")),
        ("Sizing the latents with the image size",
         trap("the image size used for the latents (no // vae_scale_factor)", "height and width swapped")),
        ("A generator list", trap("a generator list: everything drawn from the first generator",
                                  "a list of one generator accepted for any batch size")),
        ("Tiling the embeddings", trap("the whole batch tiled (p0, p1, p0, p1)")),
        ("Checking divisibility by vae_scale_factor", trap("divisibility checked against vae_scale_factor instead of 8")),
        ("Drawing new noise, or skipping the scaling",
         trap("fresh noise drawn although latents were given", "the given latents not scaled")),
    ],
    "08_conditioning": [
        ("Order of the halves",
         trap("[sin | cos] kept although flip_sin_to_cos=True asks for [cos | sin]",
              "the whole vector reversed for flip_sin_to_cos",
              "sin and cos interleaved (sin ω_0, cos ω_0, sin ω_1, …) as in the Transformer paper")),
        ("Frequency shift", trap("frequencies divided by half − 1 (get_timestep_embedding's default shift of 1)",
                                 "downscale_freq_shift ignored (frequencies always divided by half)")),
        ("An odd embedding_dim", trap("an odd embedding_dim not zero-padded")),
        ("Patch feature order", trap("channels last inside a patch, (i, j, c): the unpatchify layout",
                                     "channels first inside a token, (c, i, j): patchify's layout, undone")),
        ("Tokens run row-major", trap("the patch grid transposed (width outer, height inner)",
                                      "the patch grid transposed (tokens read width outer, height inner)")),
        ("Modulation is LN(x)·(1 + scale) + shift",
         trap("the scale used without the 1 +: LN(x)·scale + shift",
              "modulated before the LayerNorm: LN(x·(1 + scale) + shift)",
              "shift and scale swapped: the chunks taken as (scale, shift, gate)",
              "LayerNorm eps 1e-5 (nn.LayerNorm's default) instead of 1e-6")),
    ],
    "09_lora": [
        ("α/r turned upside down", trap("r/α: the ratio turned upside down", "rsLoRA as √(α/r) instead of α/√r",
                                        "rsLoRA ignored: α/r even with use_rslora")),
        ("The adapter weight or the lora_scale left out",
         trap("the adapter weight (set_adapters) left out", "the lora_scale (fuse_lora) left out")),
        ("A @ B instead of B @ A", trap("lora_A @ lora_B instead of lora_B @ lora_A")),
        ("fan_in_fan_out ignored", trap("fan_in_fan_out ignored")),
        ("Unmerging by adding ΔW again", trap("ΔW added again instead of subtracted")),
        ("float16: adding ΔW in float32 and casting the sum",
         trap("ΔW added in float32, the sum cast to float16", "ΔW subtracted in float32, the result cast to float16")),
    ],
    "10_controlnet": [
        ("A down residual added to the running hidden state",
         trap("the down residuals never added to the skips",
              "the last down residual also added to the hidden state (the mid block's input)")),
        ("The mid residual added to the mid block's input",
         trap("the mid residual added to the mid block's input instead of its output")),
        ("Guess-mode scales reversed",
         trap("guess-mode scales reversed (1.0 on the shallowest skip, 0.1 on the mid block)")),
        ("conditioning_scale applied to the mid residual only",
         trap("conditioning_scale applied to the mid residual only",
              "guess mode without conditioning_scale (the bare 0.1 → 1 ladder)")),
        ("The residuals in the wrong order",
         trap("the down residuals added in reversed order (the last residual on the first skip)",
              "the skips returned in the order the up blocks use them (reversed)")),
        ("Under CFG", trap("guess mode: the zero residuals given to the conditional half",
                           "guess mode: ControlNet run on both halves instead of the conditional half only")),
    ],
    "11_memory": [
        ("Comparing tiled with untiled decode", trap("the whole latent decoded at once (untiled decode)")),
        ("Blending against neighbours that were not blended yet",
         trap("blended against neighbours that were not blended yet")),
        ("Holding every decoded tile until the end", budget("peak bytes flat as the image grows")),
        ("SD's 8 pixels per latent written in", trap("the VAE scale factor hard-coded to SD's 8")),
        ("Chunking attention over keys and normalising each chunk's softmax",
         trap("keys chunked, each chunk's softmax normalised on its own")),
        ("The scale 1/√d, and a mask added after the softmax",
         trap("the 1/√d scale is missing", "the mask applied after the softmax instead of before")),
        ("A query whose bool mask keeps no key",
         trap("a query whose keys are all masked left as NaN (a softmax over only −inf)")),
    ],
    "12_end_to_end": [
        ("Treating the UNet as the whole model",
         trap("latents decoded without dividing by the VAE's scaling factor")),
        ("prepare_latents before set_timesteps", trap("init_noise_sigma read before set_timesteps")),
        ("scale_model_input skipped", trap("scale_model_input skipped")),
        ("eta and generator not passed to scheduler.step", trap("eta and generator not passed to scheduler.step")),
        ("The trace's dtypes",
         trap("the image upcast to float32 (a float16 pipeline stays float16 to the image)",
              "the decoder's [−1, 1] output returned without postprocessing",
              "the decoder's output recorded after postprocessing (it is in [−1, 1], the image in [0, 1])")),
    ],
    "13_flow_matching": [
        ("The shift formula is for σ ∈ [0, 1]", trap("shift applied to t instead of σ")),
        ("The ladder has n + 1 entries", trap("no terminal σ = 0 (n sigmas instead of n + 1)")),
        ("μ is measured in tokens", trap("μ from the pixel count instead of the token count",
                                         "μ from the latent pixel count (the patches forgotten)")),
        ('"exponential" means e^μ is the shift', trap("'exponential' with μ instead of e^μ (the linear formula)",
                                                     "'linear' with e^μ (the exponential formula)")),
        ("A flow model's output is a velocity", trap("ε-style (DDIM) update on a velocity model")),
        ("The step is x + (σ_next − σ)·v", trap("σ and σ_next swapped (the step goes back up in noise)")),
        ("scale_noise weighs the *noise* by σ",
         trap("σ and 1 − σ swapped (x_t = (1 − σ)·ε + σ·x₀)", "DDPM's √ coefficients (√(1 − σ)·x₀ + √σ·ε)",
              "Euler's latent x₀ + σ·ε (lab 03's parametrisation)", "one σ for the whole batch (the first sample's)")),
    ],
    "14_multistep_solvers": [
        ("λ from ᾱ instead of √ᾱ", trap("λ from ᾱ instead of √ᾱ (log(ᾱ/(1 − ᾱ)) is 2λ)",
                                        "λ from ᾱ instead of √ᾱ (h doubled)")),
        ("h = λ_s − λ_t", trap("h sign flipped (h = λ_s − λ_t)", "h sign flipped (h = λ_s0 − λ_t)")),
        ("The history in the wrong order", trap("m0 and m1 swapped (model_outputs is oldest first)",
                                                "the x̂0 history passed newest first")),
        ("A second-order first step", trap("the first step taken second order (no history yet: h_0 = 0 and D1 = 0/0)")),
        ("lower_order_final ignored", trap("lower_order_final ignored: the last step taken second order")),
        ("ε used where x̂_0 belongs",
         trap("ε used where x̂0 belongs (the denoiser's output fed to the updates unconverted)",
              "the noise-prediction (DPM-Solver) update fed x̂0: (α_t/α_s)·x − σ_t·(e^h − 1)·x̂0")),
        ('A "second-order" solver that only ever takes first-order steps',
         trap("the first-order update at every step (DDIM: the history is never used)")),
    ],
    "15_karras_edm": [
        ("ρ goes on the interpolation", trap("ρ applied to σ instead of σ^{1/ρ} ((σ^ρ interpolated)^{1/ρ})")),
        ("The ladder runs from σ_max *down* to σ_min",
         trap("ladder ascending (σ_min first)", "no terminal σ = 0 (n sigmas instead of n + 1)")),
        ("The ramp is i/(n − 1)", trap("ramp i/n instead of i/(n − 1) (σ_min never reached)")),
        ("σ → t is interpolated in log σ",
         trap("interpolated linearly in σ, not in log σ", "rounded to the nearest integer timestep",
              "table read backwards (T − 1 − t)", "not clamped: extrapolated beyond the table's ends",
              "the index j never clamped: a σ below the table reads entry −1 (Python wraps to the table's far end)")),
        ("c_in = 1/σ or 1/√(σ² + 1) forgets σ_data",
         trap("c_in = 1/σ (σ_data forgotten)", "c_in = 1/√(σ² + 1) (lab 03's Euler scaling, σ_data taken as 1)",
              "c_noise = σ instead of ¼·ln σ", "c_noise = ln σ (the ¼ dropped)")),
        ("c_skip and c_out swapped", trap("c_skip and c_out swapped")),
        ("v_prediction flips the sign of c_out", trap("c_out's sign the wrong way round for the prediction type")),
    ],
    "16_few_step": [
        ("The LCM ladder built with DDIM's leading spacing",
         trap("DDIM's leading spacing (T//n · j, reversed)", "trailing spacing over all T timesteps")),
        ("c_skip and c_out swapped", trap("c_skip and c_out swapped")),
        ("timestep_scaling forgotten", trap("timestep_scaling forgotten (τ = t)",
                                            "timestep_scaling forgotten in the boundary scalings")),
        ("Re-noising after the last step", trap("re-noised at the last step")),
        ("Guidance applied at guidance_scale 0",
         trap("guidance applied at guidance_scale ≤ 1 (at 0 that is the unconditional prediction)")),
        ("The Turbo loop without init_noise_sigma",
         trap("initial latents not scaled by init_noise_sigma", "UNet input not scaled (scale_model_input skipped)")),
    ],
    "17_mmdit_attention": [
        ("One projection for both streams",
         trap("one projection shared by text and image tokens", "text output through the image's to_out",
              "qk-norm skipped")),
        ("Concatenate in one order and split in the other",
         trap("concatenated [text, image] but split as [image, text]",
              "two separate attentions (image with image, text with text)")),
        ("Rotary on v", trap("rotary applied to v too", "rotary pairs taken as halves (rotate_half) instead of interleaved",
                             "cos/sin repeated as halves [c, c] instead of interleaved (c0 c0 c1 c1 …)",
                             "frequencies θ^(−j/d) instead of θ^(−2j/d)")),
        ("Position ids as (col, row)", trap("position ids from (col, row)")),
        ("APG projects the difference onto the *conditional* prediction",
         trap("APG projection onto the unconditional prediction",
              "APG projection onto the difference itself (no orthogonal part)", "η applied to the orthogonal part",
              "APG applied at s = 1 (the guider switches itself off there)")),
        ("Flux-dev's guidance is an input, not a second pass",
         trap("guidance multiplied by 1000 before the call (the transformer scales it itself)",
              "the timestep passed as t (0 … 1000), not t/1000", "true CFG with its branches swapped: v_c + s·(v_u − v_c)")),
        ("CFG-Zero*'s α is one number *per sample*",
         trap("CFG-Zero* scale computed per batch instead of per sample", "α = ⟨c, u⟩/‖c‖² (the wrong norm)")),
    ],
    "18_text_and_image_prompts": [
        ("clip_skip set but last_hidden_state used",
         trap("last hidden state used although clip_skip is set", "final layer norm skipped after clip_skip",
              "hidden_states[-clip_skip] (one layer too late)")),
        ("Pooling from the last position",
         trap("pooled from the last position (where padding is EOS, that is also the last EOS)",
              "pooled from the first token (BOS)",
              "argmax of the ids whatever the config", "the last EOS (padding) instead of the first")),
        ("CFG batch [positive, negative]",
         trap("CFG batch ordered [positive, negative]", "negative embeds not repeated per image",
              "the batch tiled (p0, p1, p0, p1) instead of per prompt")),
        ("SD's encode_prompt encodes the NEGATIVE prompt", trap("clip_skip applied to the negative prompt too")),
        ("IP-Adapter: image tokens concatenated into the text keys",
         trap("image tokens concatenated into the text K/V (one softmax)", "scale applied to both terms",
              "image K/V through the text projections")),
    ],
    "19_half_precision": [
        ("Picking the dtype by range alone", trap("chosen by range alone (float16 whenever max|x| ≤ 65504)")),
        ('"bfloat16 is always safer"', trap("always bfloat16 (the wider range is always safer)")),
        ("Decoding in float16 although force_upcast is set", trap("decoded in float16 although force_upcast is set")),
        ("Upcasting the latents but not the VAE",
         check("vs the SDXL pipeline's decode step (force_upcast)",
               "the decode raises torch's own dtype-mismatch error in the first convolution, shown under the "
               "check (the learner's frames and message)")),
        ("Forgetting the 1/scaling_factor before the decoder",
         trap("latents not divided by scaling_factor", "image cast back to float16")),
        ("Q8_0 with one scale per row", trap("one scale per row instead of per 32-value block")),
        ("Q8_0 rounding", trap("rounded half to even (torch.round) instead of half away from zero (C's roundf)",
                               "divided by the float16-rounded scale (ggml divides by the float32 d, then stores it "
                               "as float16)",
                               "divided by d (x / d) instead of multiplied by its float32 reciprocal (ggml's x · (1/d))",
                               "rounded as floor(|x| + 0.5) in float32, which rounds up just below a half")),
        ("Reading the quants as uint8", trap("the quants read as uint8 (a negative weight's 0xFF becomes 255, not −1)",
                                             "the scale read from the block's last two bytes (a block is [d, q])")),
    ],
    "20_first_block_cache": [
        ("Refreshing the cached residual on a skipped step",
         trap("the cached residual refreshed on a skipped step (δ against the previous step, not the last "
              "computed one)")),
        ("The tail residual taken from the blocks' input",
         trap("the tail residual taken from the blocks' input (x_N − x) instead of the first block's output (x_N − x₁)")),
        ("δ relative to the current residual",
         trap("δ relative to the current residual (÷ mean|r| instead of mean|r_cached|)",
              "the signed mean of the difference (no abs: positive and negative changes cancel)",
              "an L2 change ‖r − r_cached‖ / ‖r_cached‖ instead of the mean absolute one")),
        ("Caching the image stream only",
         trap("only the image stream restored on a skipped step (the text stream left at b_1's output)")),
        ("One cache for the cond and uncond calls", trap("one cache shared by the cond and uncond calls")),
        ("Deciding to skip but running the other blocks anyway", budget("a skipped call runs the first block only")),
    ],
    "21_serving_batcher": [
        ("One scheduler shared by every request", trap("one scheduler shared by every request (set_timesteps for one "
                                                       "resets the others)")),
        ("One timestep for the whole batch", trap("one timestep for the whole batch (the first request's)")),
        ("The CFG rows in the wrong order",
         trap("the CFG text rows as [positive, negative] (the pipeline puts the negative prompt first)",
              "uncond and text rows swapped: ε_c + s(ε_u − ε_c)")),
        ("A layout that assumes two rows per request",
         trap("two rows assumed per request (the rows found by position, not by the layout)")),
        ("One generator for every request", trap("one generator for every request's initial noise")),
        ("Keeping a cancelled request in the batch to the end",
         budget("one denoiser call per tick, rows of the active requests only")),
        ("Counting max_rows in requests",
         check("vs each request alone through StableDiffusionPipeline",
               "the counted UNet's batch sizes, call by call, are compared with the admission rules (max_rows in "
               "rows, list order, no overtaking); the message states the rules")),
    ],
    "22_offload_schedule": [
        ("Counting parameters only",
         trap("parameters only, or state_dict() (every buffer is moved, non-persistent ones too)")),
        ("Counting elements, or 4 bytes per element",
         trap("elements, not bytes (numel without element_size)", "4 bytes per element whatever the dtype",
              "the first parameter's element size for every tensor")),
        ("Offloading whatever ran last",
         trap("the component that ran last released at each switch (not the chain predecessor)")),
        ("Treating a component outside the chain like a chain member",
         trap("components outside the chain released when another component runs")),
        ("Breaking the chain at a missing component", trap("the chain broken at a missing component (image_encoder=None)")),
        ("Forgetting the end of the call",
         trap("nothing released when the pipeline call ends", "only the last component called released at the end")),
        ("Offloading after every call",
         trap("every component released before the next call (sequential-style offload)")),
        ("A peak of one component", trap("peak as the largest single component on the device")),
        ("Grouping blocks across lists or inside blocks",
         trap("blocks grouped across lists (the model's lists chunked as one sequence)",
              "lists found below the model's own children (every ModuleList not inside another one)")),
        ("Ignoring a model's block modules",
         trap("the model's block modules ignored (_group_offload_block_modules kept whole)")),
        ("A peak without the resident part",
         trap("peak of the largest group alone (the resident part left out)",
              "bytes per forward of the groups only (the resident part assumed to stay between forwards)")),
        ("Every resident part at once",
         trap("every resident part on the device for the whole forward (a block module's counted outside its own "
              "forward)")),
    ],
    "25_video_latents": [
        ("Frame counts that are not 4k + 1",
         trap("rounded up to the next t·k + 1", "rounded to a multiple of t (the + 1 forgotten)",
              "F // t latent frames (the first frame's own latent forgotten)")),
        ("Chunking the encoder in fours from frame 0",
         trap("chunks of four from frame 0 (the first frame not alone)",
              "chunks of four from frame 0, whole groups only (the first frame not alone)",
              "a partial group at the end encoded too")),
        ("The first latent frame decodes to one frame",
         check("vs AutoencoderKLWan.decode and VideoProcessor.postprocess_video's pixels",
               "the video's frame count is checked first (structure): 1 + t·(F' − 1), and the message gives both")),
        ("The rotary split", trap("the remainder of D given to the columns, not the frames",
                                  "cos and sin in the half-split layout (c₀ … c_{d/2−1}, c₀ … c_{d/2−1}), not "
                                  "interleaved")),
        ("Positions per patch", trap("positions per latent voxel, not per patch",
                                     "positions counted in latent voxels (the patch's corner), not in patches")),
        ("Token order", trap("the axes in another order (rows, columns, frames)", "tokens read with columns before rows",
                             "each token's vector read channels first (C, p_t, p_h, p_w)")),
        ("Decoding the whole float video", budget("peak memory: the uint8 video and one chunk, not the float video")),
        ("uint8 pixels are", trap("truncated to uint8 instead of rounded",
                                  "not clamped to [−1, 1] (values outside wrap around in uint8)")),
    ],
    "24_img2img_inpainting": [
        ("SD3's img2img rounds the other way", trap("k rounded the other way (the other pipeline's rule, or round())")),
        ("A second-order scheduler", trap("the scheduler's order ignored (t_start timesteps skipped, not t_start·order)")),
        ("Keeping the head of the schedule",
         trap("the head of the schedule kept (the noisiest steps run, the last skipped)",
              "steps counted as timesteps (len of the kept timesteps)")),
        ("Drawing the noise before the VAE's sample",
         trap("the noise drawn before the encoder's sample", "the encoder's mean (latent_dist.mode()) instead of a sample")),
        ("SD3's latents are", trap("SD3's shift after the scaling: z·scaling_factor − shift_factor",
                                   "SD3's shift_factor ignored")),
        ("The masked image keeps the pixels", trap("the masked image keeps the region to repaint (image·mask)")),
        ("Resizing the mask bilinearly", trap("the mask resized bilinearly (blurred edges)")),
        ("Scaling the 9-channel input", trap("the whole 9-channel stack scaled (mask and masked latents too)")),
        ("The 4-channel blend at the current timestep",
         trap("the known region noised to the current timestep, not the next",
              "the known region noised after the last step too")),
    ],
    "23_training_objective": [
        ("The target of another prediction type",
         trap("ε returned whatever the prediction type (the target of another prediction type)",
              "the ε target for a v model (the target of another prediction type)")),
        ("Min-SNR weights without the prediction-type correction",
         trap("min(SNR, γ) without the prediction-type correction",
              "Min-SNR weights without the prediction-type correction")),
        ("v_prediction divides by SNR + 1", trap("ε's correction on v (÷ SNR instead of ÷ (SNR + 1))")),
        ('"sigma_sqrt" is σ⁻²', trap("'sigma_sqrt' read as √σ", "'sigma_sqrt' read as 1/√σ", "σ⁻¹ for 'sigma_sqrt'")),
        ("The timestep of a flow step is looked up", trap("the ladder not looked up: timestep u·T and σ = u")),
        ("Noise and timesteps drawn from the wrong generator",
         trap("timesteps drawn before the noise", "u drawn before the noise",
              "the offset noise drawn at full size (B, C, H, W), not (B, C, 1, 1)")),
        ("The mean taken over the wrong axes", trap("the weights applied to the batch's overall mean: mean(w)·mean(err²)")),
        ("Preconditioned outputs",
         trap("precondition_outputs ignored", "x̂₀ compared with ε − x₀ (the output preconditioned, the target not)",
              "the raw output compared with x₀ (the target preconditioned, the output not)")),
    ],
}

# Labs left out of the accounting, by lab-number prefix, each with why. Every lab is accounted for today.
UNACCOUNTED: dict[str, str] = {}


def unaccounted(lab: str) -> str | None:
    return next((why for prefix, why in UNACCOUNTED.items() if lab.startswith(prefix)), None)


def lesson_bullets(lab: str) -> list[str]:
    """The lesson's Traps bullets, whitespace-normalised (a bullet runs until the next bullet or section)."""
    source = (REPO / "solutions" / f"{lab}.py").read_text(encoding="utf-8")
    doc = ast.get_docstring(ast.parse(source)) or ""
    section = re.search(r"^Traps:\n(.*?)(?=^\S|\Z)", doc, re.S | re.M)
    if section is None:
        return []
    parts = re.split(r"^\s*- ", section.group(1), flags=re.M)
    return [" ".join(p.split()) for p in parts[1:] if p.strip()]


def declared(lab: str) -> tuple[set[str], set[str], set[str]]:
    from diffusion_katas.core.course import Course

    traps, budgets, checks = set(), set(), set()
    for kata in Course(REPO).graders_of(lab):
        traps.update(t.name for t in kata.traps)
        budgets.update(b.name for b in kata.budgets)
        checks.update(c.name for c in kata.checks)
    return traps, budgets, checks


@pytest.mark.parametrize("lab", LABS)
def test_every_trap_a_lesson_names_is_accounted_for_by_its_grader(lab):
    if unaccounted(lab):
        pytest.skip(f"{lab}: {unaccounted(lab)}")
    bullets = lesson_bullets(lab)
    assert bullets, f"{lab}'s lesson has no Traps bullets"
    assert lab in LESSON_TRAPS, f"{lab}: no entry in LESSON_TRAPS (account for its lesson's Traps bullets)"
    entries = LESSON_TRAPS[lab]
    unmatched = [b for b in bullets if sum(b.startswith(start) for start, _ in entries) != 1]
    assert not unmatched, f"{lab}: bullets matched by no entry (or by several):\n" + "\n".join(unmatched)
    stale = [start for start, _ in entries if not any(b.startswith(start) for b in bullets)]
    assert not stale, f"{lab}: entries whose bullet is gone from the lesson: {stale}"

    traps, budgets, checks = declared(lab)
    missing = []
    for start, covered in entries:
        if isinstance(covered, trap):
            missing += [f"trap '{n}' ({start})" for n in covered.names if n not in traps]
        elif isinstance(covered, budget):
            missing += [f"budget '{covered.name}' ({start})"] if covered.name not in budgets else []
        else:
            assert covered.why, start
            missing += [f"check '{covered.name}' ({start})"] if covered.name not in checks else []
    assert not missing, f"{lab}: named in the accounting but not declared by its grader: {missing}"
    # tests/labs/test_traps.py holds every declared trap of every lab's grader to being separable on the
    # graded cases: a declared name is one it covers (its separability is not re-checked here).
    from test_traps import LABS as SEPARATED

    assert lab in SEPARATED


def test_the_accounting_names_only_labs_that_exist():
    assert set(LESSON_TRAPS) <= set(LABS)


def test_a_bullet_with_no_entry_fails_the_accounting(monkeypatch):
    lab = next(iter(LESSON_TRAPS))
    monkeypatch.setitem(LESSON_TRAPS, lab, LESSON_TRAPS[lab][1:])
    with pytest.raises(AssertionError, match="matched by no entry"):
        test_every_trap_a_lesson_names_is_accounted_for_by_its_grader(lab)


def test_a_lab_with_no_entry_fails_the_accounting(monkeypatch):
    lab = next(iter(LESSON_TRAPS))
    monkeypatch.delitem(LESSON_TRAPS, lab)
    with pytest.raises(AssertionError, match="no entry in LESSON_TRAPS"):
        test_every_trap_a_lesson_names_is_accounted_for_by_its_grader(lab)


def test_a_trap_name_the_grader_does_not_declare_fails_the_accounting(monkeypatch):
    lab = next(iter(LESSON_TRAPS))
    (start, _), *rest = LESSON_TRAPS[lab]
    monkeypatch.setitem(LESSON_TRAPS, lab, [(start, trap("a trap nobody declared")), *rest])
    with pytest.raises(AssertionError, match="a trap nobody declared"):
        test_every_trap_a_lesson_names_is_accounted_for_by_its_grader(lab)


def test_unaccounted_labs_are_matched_by_their_number_prefix(monkeypatch):
    monkeypatch.setitem(UNACCOUNTED, "20_", "being written")
    assert unaccounted("20_anything") == "being written"
    assert unaccounted("01_forward_noise") is None
