"""Grader for lab 07 · Pipeline components: input checks, prompt repetition, the starting latents.

References are StableDiffusionPipeline's own methods on a tiny offline pipeline (plugin/tiny.py):
check_inputs, encode_prompt (with prompt_embeds, so no text encoder is needed) and prepare_latents,
with Euler schedulers (init_noise_sigma ≈ 11–15) and DDIM (init_noise_sigma = 1).

`input_error` returns a message instead of raising (the plugin reports a raising learner function as a
crash): the reference is whether diffusers raises ValueError, and any non-empty message matches it.

Precision: prepare_latents is bit for bit where it can be (the draw is the draw: the same generator in the
dtype asked for), and its one float operation, σ_init·ε, carries the float64 shadow (Scenario.exact):
diffusers' own ε (or the given latents) widened, times σ_init as a Python float. So ε·σ_init computed in
float64 and cast once passes wherever its rounding differs from diffusers' (which multiplies in the
latents' dtype). Every draw is checked afterwards too: the generator, or each
generator of a list, must be left where diffusers leaves it (Scenario.generators_after).
"""
import functools

import torch
from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import StableDiffusionPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_euler_discrete import EulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import DTYPES, PIPELINES, SD_BETAS, fresh_rng_state, quiet_diffusers, seed_from
from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import EXACT

CPU = torch.device("cpu")
PIPELINE = "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion.StableDiffusionPipeline"


@functools.cache
def pipeline(vae: str = "x2", scheduler: str = "euler") -> StableDiffusionPipeline:
    """A tiny pipeline; `scheduler` is "euler" (σ_init = σ_max), "euler-leading" (√(σ_max² + 1) after
    set_timesteps(20)) or "ddim" (σ_init = 1).

    Cached: the methods graded here read only the pipeline's vae_scale_factor, its scheduler's
    init_noise_sigma and the UNet's dtype, never the random weights, and change none of them.
    """
    if scheduler == "ddim":
        sched = DDIMScheduler(**SD_BETAS)
    else:
        sched = EulerDiscreteScheduler(**SD_BETAS, timestep_spacing="leading" if "leading" in scheduler
                                       else "linspace")
    with quiet_diffusers():
        pipe = tiny.sd_pipeline(sched, vae_model=tiny.vae(int(vae[1:])))
        if scheduler == "euler-leading":
            pipe.scheduler.set_timesteps(20)  # after __init__, which rewrites the scheduler's config
    return pipe


def generators(spec, g: torch.Generator):
    """(for the learner, for the reference): the same seeds twice. spec: None, "one" or a list length."""
    if spec is None:
        return None, None
    if spec == "one":
        s = seed_from(g)
        return torch.Generator().manual_seed(s), torch.Generator().manual_seed(s)
    seeds = [seed_from(g) for _ in range(spec)]
    return ([torch.Generator().manual_seed(s) for s in seeds], [torch.Generator().manual_seed(s) for s in seeds])


# ---- input_error --------------------------------------------------------------------------------------
class _AnyMessage:
    """The expected output where diffusers raises: any non-empty message equals it."""

    def __eq__(self, other):
        return isinstance(other, _AnyMessage) or (isinstance(other, str) and bool(other.strip()))

    def __repr__(self):
        return "a message (a non-empty str)"


A_MESSAGE = _AnyMessage()

input_error = Kata(
    "input_error",
    hints=(
        "Two rules guard the latents: one on the image size (check_inputs), one on a list of generators "
        "(prepare_latents).",
        "Reject when height % 8 or width % 8 is non-zero (Stable Diffusion's 8, not the VAE's f), or when "
        "the generator is a list whose length is not batch_size.",
        "if height % 8 or width % 8: return '…'; "
        "if isinstance(generator, list) and len(generator) != batch_size: return '…'; return None",
    ),
    answer_key=(f"{PIPELINE}.check_inputs", f"{PIPELINE}.prepare_latents", f"{PIPELINES}:*Pipeline*.check_inputs",
                f"{PIPELINES}:*Pipeline*.prepare_latents"),  # every pipeline checks and prepares alike
)


def side(ok: bool, g: torch.Generator, multiple_of: int = 8) -> int:
    """A random image side: a multiple of 8, or 2, 4 or 6 more than one (even, so f = 2 divides it)."""
    base = multiple_of * int(torch.randint(1, 9, (1,), generator=g))
    return base if ok else base + 2 * int(torch.randint(1, 4, (1,), generator=g))


@input_error.check("vs check_inputs and prepare_latents", cases=[
    dict(vae="x2", height_ok=True, width_ok=True, batch=2, generator="one"),
    dict(vae="x2", height_ok=False, width_ok=True, batch=1, generator="one"),
    dict(vae="x8", height_ok=True, width_ok=False, batch=1, generator=None),
    dict(vae="x2", height_ok=True, width_ok=True, batch=3, generator=3),
    dict(vae="x2", height_ok=True, width_ok=True, batch=3, generator=2),
    dict(vae="x8", height_ok=True, width_ok=True, batch=2, generator=1),
    dict(vae="x8", height_ok=True, width_ok=True, batch=1, generator=1),
    dict(vae="x2", height_ok=False, width_ok=False, batch=2, generator=2),
    dict(vae="x8", height_ok=True, width_ok=True, batch=2, generator=3),  # a list longer than the batch: refused too
], tol=EXACT)
def _(case, g):
    pipe = pipeline(case["vae"])
    height, width = side(case["height_ok"], g), side(case["width_ok"], g)
    mine, ref = generators(case["generator"], g)
    embeds = tiny.text_embeddings(1, g)
    try:  # what __call__ runs before its loop, in its order
        pipe.check_inputs(None, height, width, None, prompt_embeds=embeds)
        pipe.prepare_latents(case["batch"], tiny.LATENT_CHANNELS, height, width, torch.float32, CPU, ref)
    except ValueError as exc:
        expected, label = A_MESSAGE, f"diffusers raises ValueError: {exc}"
    else:
        expected, label = None, "diffusers accepts this request"
    inputs = dict(height=height, width=width, vae_scale_factor=pipe.vae_scale_factor, batch_size=case["batch"],
                  generator=mine)
    return Scenario(inputs=inputs, expected=expected, label=label)


def _verdict(bad: bool):
    return A_MESSAGE if bad else None


def _list_mismatch(generator, batch_size):
    return isinstance(generator, list) and len(generator) != batch_size


@input_error.trap("divisibility checked against vae_scale_factor instead of 8",
                  hint="Stable Diffusion's check_inputs requires multiples of 8 whatever the VAE's factor.")
def _(height, width, vae_scale_factor, batch_size, generator):
    return _verdict(height % vae_scale_factor or width % vae_scale_factor or _list_mismatch(generator, batch_size))


@input_error.trap("only the height checked",
                  hint="Both sides must be multiples of 8: check width too.")
def _(height, width, vae_scale_factor, batch_size, generator):
    return _verdict(height % 8 or _list_mismatch(generator, batch_size))


@input_error.trap("a list of one generator accepted for any batch size",
                  hint="prepare_latents checks the length before anything else: a list must hold exactly "
                       "batch_size generators, even a list of one (randn_tensor's special case comes later).")
def _(height, width, vae_scale_factor, batch_size, generator):
    long_list = isinstance(generator, list) and len(generator) > 1
    return _verdict(height % 8 or width % 8 or (long_list and len(generator) != batch_size))


@input_error.trap("only a generator list shorter than the batch refused (a longer one accepted)",
                  hint="One generator per image, exactly: a list longer than batch_size is refused as well "
                       "(len(generator) != batch_size, not <).")
def _(height, width, vae_scale_factor, batch_size, generator):
    return _verdict(height % 8 or width % 8 or (isinstance(generator, list) and len(generator) < batch_size))


@input_error.trap("the generator list's length not checked",
                  hint="A list of generators means one per image: its length must equal batch_size.")
def _(height, width, vae_scale_factor, batch_size, generator):
    return _verdict(height % 8 or width % 8)


# ---- repeat_per_prompt -------------------------------------------------------------------------------
repeat_per_prompt = Kata(
    "repeat_per_prompt",
    hints=(
        "The batch is ordered prompt by prompt: all images of prompt 0, then all of prompt 1.",
        "Row b·n + i of the output is prompt b (for i < n): (B, L, D) -> (B·n, L, D).",
        "B, L, _ = prompt_embeds.shape; "
        "return prompt_embeds.repeat(1, n, 1).view(B * n, L, -1)",
    ),
    answer_key=(f"{PIPELINE}.encode_prompt", f"{PIPELINE}._encode_prompt", f"{PIPELINES}:*Pipeline*.encode_prompt",
                f"{PIPELINES}:*Pipeline*._encode_prompt"),
)


@repeat_per_prompt.check("vs encode_prompt(prompt_embeds=...)",
                         cases=[dict(prompts=2, n=3), dict(prompts=1, n=4), dict(prompts=3, n=1),
                                dict(prompts=3, n=2, tokens=5)], tol=EXACT)
def _(case, g):
    pipe = pipeline()
    embeds = tiny.text_embeddings(case["prompts"], g, tokens=case.get("tokens", tiny.TEXT_TOKENS))
    expected, _ = pipe.encode_prompt(None, CPU, case["n"], False, prompt_embeds=embeds.clone())
    # the shadow: the same copies of the widened embeddings (only data moves: any float error is a bug)
    exact = embeds.double().repeat_interleave(case["n"], dim=0)
    return Scenario(inputs=dict(prompt_embeds=embeds, num_images_per_prompt=case["n"]), expected=expected,
                    exact=exact)


@repeat_per_prompt.trap("the whole batch tiled (p0, p1, p0, p1)",
                        hint="Each prompt's copies sit together (p0, p0, p1, p1): repeat along the token axis, then "
                             "view, or use repeat_interleave(n, dim=0); repeat(n, 1, 1) tiles.")
def _(prompt_embeds, num_images_per_prompt):
    return prompt_embeds.repeat(num_images_per_prompt, 1, 1)


@repeat_per_prompt.trap("repeated along the token axis but not reshaped",
                        hint="After repeat(1, n, 1) the shape is (B, n·L, D): view it as (B·n, L, D).")
def _(prompt_embeds, num_images_per_prompt):
    return prompt_embeds.repeat(1, num_images_per_prompt, 1)


@repeat_per_prompt.trap("each token copied n times in place, then viewed (repeat_interleave on the token axis, or "
                        "repeat on the feature axis)",
                        hint="Both lay out t0 t0 … t1 t1 … in memory: viewed as (B·n, L, D) each copy holds doubled "
                             "tokens. Repeat the whole sequence (repeat(1, n, 1), then view), or interleave the "
                             "batch axis (repeat_interleave(n, dim=0)).")
def _(prompt_embeds, num_images_per_prompt):
    b, length, _ = prompt_embeds.shape
    return prompt_embeds.repeat_interleave(num_images_per_prompt, dim=1).view(b * num_images_per_prompt, length, -1)


@repeat_per_prompt.trap("not repeated at all",
                        hint="Each prompt makes num_images_per_prompt images: the batch must grow to B·n.")
def _(prompt_embeds, num_images_per_prompt):
    return prompt_embeds


# ---- prepare_latents ---------------------------------------------------------------------------------
prepare_latents = Kata(
    "prepare_latents",
    hints=(
        "Noise in latent space, shaped for the UNet, as loud as the scheduler wants it to start.",
        "shape (B, C, H // f, W // f); ε = randn(shape, generator, dtype) (for a list: one (1, C, h, w) draw "
        "per generator, concatenated); return σ_init · ε, or σ_init · latents when latents are given.",
        "shape = (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor); "
        "noise = latents if latents is not None else torch.randn(shape, generator=generator, dtype=dtype); "
        "return noise * init_noise_sigma",
    ),
    answer_key=(f"{PIPELINE}.prepare_latents", "diffusers.utils.torch_utils.randn_tensor",
                f"{PIPELINES}:*Pipeline*.prepare_latents"),
)


def latents_scenario(case, g, given: bool = False) -> Scenario:
    pipe = pipeline(case["vae"], case["scheduler"])
    batch, (height, width) = case["batch"], case["size"]
    channels = case.get("channels", tiny.LATENT_CHANNELS)  # the UNet's in_channels: 4 for SD, 16 for SD3/Flux
    dtype = DTYPES[case["dtype"]]
    mine, ref = generators(case.get("generator", "one"), g)
    latents = None
    if given:
        f = pipe.vae_scale_factor
        latents = torch.randn((batch, channels, height // f, width // f), generator=g).to(dtype)
    rng_after = start = None
    if case.get("generator", "one") is None:
        # No generator: diffusers draws from the global RNG. The learner's call starts from a state of fresh
        # entropy (Scenario.global_rng), so the reference draws from that same state, and the grader's own
        # global RNG is put back as it was.
        start, before = fresh_rng_state(), torch.random.get_rng_state()
        torch.random.set_rng_state(start)
    twin = _twin(ref)  # the reference's generators before they draw: the shadow's ε
    expected = pipe.prepare_latents(batch, channels, height, width, dtype, CPU, ref,
                                    latents=None if latents is None else latents.clone())
    if start is not None:
        rng_after = [torch.random.get_rng_state()]
        torch.random.set_rng_state(before)
    sigma = float(pipe.scheduler.init_noise_sigma)
    f = pipe.vae_scale_factor
    noise = latents if latents is not None else randn_tensor(
        (batch, channels, height // f, width // f), generator=twin, dtype=dtype)
    inputs = dict(batch_size=batch, num_channels_latents=channels, height=height, width=width,
                  vae_scale_factor=pipe.vae_scale_factor, init_noise_sigma=sigma, generator=mine, dtype=dtype,
                  latents=latents)
    label = (f"{type(pipe.scheduler).__name__}, init_noise_sigma {sigma:.6g}, latents "
             f"({batch}, {channels}, {height // f}, {width // f})")
    return Scenario(inputs=inputs, expected=expected, exact=noise.double() * sigma, label=label,
                    verify=None if rng_after is None else global_rng_advanced_like(rng_after, expected),
                    generators_after=None if ref is None else {"generator": ref}, global_rng=start)


def _twin(generator):
    """A copy of a generator (or of each in a list; None: of the global RNG), in its state now."""
    if generator is None:
        return torch.Generator().set_state(torch.random.get_rng_state())
    if isinstance(generator, list):
        return [_twin(gen) for gen in generator]
    return torch.Generator().set_state(generator.get_state())


def global_rng_advanced_like(reference_after: list[torch.Tensor], expected: torch.Tensor):
    """A Scenario.verify: the global RNG stands where diffusers' draw left it (the plugin hands the learner's
    global RNG state back to the grader after the call). A private generator leaves it where it was.
    Judged once the values are right: wrong values are reported (and their trap named) by the comparison."""

    def verify(output):
        if not (isinstance(output, torch.Tensor) and output.shape == expected.shape
                and output.dtype == expected.dtype and torch.equal(output, expected)):
            return
        now = torch.random.get_rng_state()
        if not any(torch.equal(now, state) for state in reference_after):
            raise KataFailure(
                "  with generator=None the noise must come from the global RNG (torch.randn(shape, dtype=dtype), "
                "no generator): after your call the global RNG does not stand where diffusers' draw leaves it "
                "(a private or freshly seeded generator, or a second draw, moves it differently)")

    return verify


# Latent sizes whose C·h·w is not a multiple of 16 (x8 at 72×40 -> 9×5; 3 channels at 56×72 -> 7×9): there,
# one draw for the batch and one draw per sample from the same generator give different numbers (torch fills
# normals in blocks of 16), so drawing sample by sample from one generator shows.
@prepare_latents.check("vs prepare_latents, one generator", cases=[
    dict(vae="x2", scheduler="euler", batch=2, size=(16, 16), dtype="float32"),
    dict(vae="x8", scheduler="euler-leading", batch=3, size=(64, 48), dtype="float16"),
    dict(vae="x8", scheduler="ddim", batch=1, size=(64, 64), dtype="float32"),
    dict(vae="x2", scheduler="euler", batch=2, size=(24, 40), dtype="float32"),
    dict(vae="x8", scheduler="euler", batch=3, size=(72, 40), dtype="float32"),
    dict(vae="x8", scheduler="ddim", batch=2, size=(56, 72), dtype="float32", channels=3),
    dict(vae="x2", scheduler="euler-leading", batch=2, size=(16, 8), dtype="float16", channels=16),
    dict(vae="x8", scheduler="euler-leading", batch=2, size=(56, 40), dtype="float16", channels=3),
], tol=EXACT)
def _(case, g):
    return latents_scenario(case, g)


@prepare_latents.check("vs prepare_latents, a generator per sample", cases=[
    dict(vae="x2", scheduler="euler", batch=3, size=(16, 24), dtype="float32", generator=3),
    dict(vae="x8", scheduler="euler-leading", batch=2, size=(64, 64), dtype="float16", generator=2),
    dict(vae="x2", scheduler="euler", batch=1, size=(16, 16), dtype="float32", generator=1),
    dict(vae="x8", scheduler="ddim", batch=3, size=(72, 40), dtype="float32", generator=3, channels=3),
], tol=EXACT)
def _(case, g):
    return latents_scenario(case, g)


@prepare_latents.check("vs prepare_latents, generator=None (the global RNG)", cases=[
    dict(vae="x2", scheduler="euler", batch=2, size=(16, 24), dtype="float32", generator=None),
    dict(vae="x8", scheduler="ddim", batch=3, size=(72, 40), dtype="float16", generator=None, channels=3),
], tol=EXACT)
def _(case, g):
    return latents_scenario(case, g)


@prepare_latents.check("vs prepare_latents, latents given", cases=[
    dict(vae="x2", scheduler="euler", batch=2, size=(16, 24), dtype="float32"),
    dict(vae="x8", scheduler="euler-leading", batch=2, size=(64, 64), dtype="float16"),
    dict(vae="x8", scheduler="euler", batch=3, size=(72, 40), dtype="float32", channels=16, generator=None),
], tol=EXACT)
def _(case, g):
    return latents_scenario(case, g, given=True)


def _shape(batch_size, num_channels_latents, height, width, vae_scale_factor):
    return (batch_size, num_channels_latents, height // vae_scale_factor, width // vae_scale_factor)


def _draw(shape, generator, dtype):
    if isinstance(generator, list) and len(generator) > 1:
        return torch.cat([torch.randn((1, *shape[1:]), generator=gen, dtype=dtype) for gen in generator])
    return torch.randn(shape, generator=generator[0] if isinstance(generator, list) else generator, dtype=dtype)


@prepare_latents.trap("the given latents not scaled",
                      hint="Given latents skip the draw, not the scaling: return latents · init_noise_sigma.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, vae_scale_factor)
    return latents if latents is not None else _draw(shape, generator, dtype) * init_noise_sigma


@prepare_latents.trap("init_noise_sigma forgotten",
                      hint="Multiply the noise by init_noise_sigma: for Euler x_T must have standard deviation "
                           "σ_max (≈ 14.6), not 1. It only looks right with DDIM, where σ_init = 1.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, vae_scale_factor)
    return latents if latents is not None else _draw(shape, generator, dtype)


@prepare_latents.trap("divided by init_noise_sigma",
                      hint="The starting noise is scaled up to σ_init: multiply (dividing is what the scheduler's "
                           "scale_model_input does to the UNet's input, a different step).")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, vae_scale_factor)
    return (latents if latents is not None else _draw(shape, generator, dtype)) / init_noise_sigma


@prepare_latents.trap("height and width swapped",
                      hint="Latents are (B, C, height // f, width // f): height first, as in images.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, width, height, vae_scale_factor)
    return (latents if latents is not None else _draw(shape, generator, dtype)) * init_noise_sigma


@prepare_latents.trap("the image size used for the latents (no // vae_scale_factor)",
                      hint="The UNet works in latent space: divide height and width by vae_scale_factor.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, 1)
    return (latents if latents is not None else _draw(shape, generator, dtype)) * init_noise_sigma


@prepare_latents.trap("the VAE factor hard-coded to SD's 8 (vae_scale_factor not used)",
                      hint="Pixels per latent depend on the VAE: height // vae_scale_factor (8 for SD's VAE, 2 for "
                           "this tiny one), never a literal 8.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, 8)
    return (latents if latents is not None else _draw(shape, generator, dtype)) * init_noise_sigma


@prepare_latents.trap("a generator list: everything drawn from the first generator",
                      hint="A list gives sample i its own generator: draw (1, C, h, w) from generator[i] for each "
                           "i and concatenate along the batch.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, vae_scale_factor)
    gen = generator[0] if isinstance(generator, list) else generator
    return (latents if latents is not None else torch.randn(shape, generator=gen, dtype=dtype)) * init_noise_sigma


@prepare_latents.trap("fresh noise drawn although latents were given",
                      hint="Given latents replace the draw (that is how a run is replayed): scale them, draw nothing.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, vae_scale_factor)
    return _draw(shape, generator, dtype) * init_noise_sigma


@prepare_latents.trap("4 latent channels hard-coded instead of num_channels_latents",
                      hint="The UNet says how many channels its latents have (unet.config.in_channels): 4 for "
                           "SD 1.x/2.x/XL, 16 for SD3 and Flux. Use num_channels_latents.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, 4, height, width, vae_scale_factor)
    return (latents if latents is not None else _draw(shape, generator, dtype)) * init_noise_sigma


@prepare_latents.trap("one generator drawn sample by sample",
                      hint="One generator draws the whole batch in ONE call, randn((B, C, h, w), generator=g). "
                           "B draws of (1, C, h, w) from it give other numbers whenever C·h·w is not a multiple "
                           "of 16 (torch fills normals in blocks of 16); per-sample draws are for a LIST of "
                           "generators, one each.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    shape = _shape(batch_size, num_channels_latents, height, width, vae_scale_factor)
    if latents is not None:
        return latents * init_noise_sigma
    gens = generator if isinstance(generator, list) else [generator] * batch_size
    return torch.cat([torch.randn((1, *shape[1:]), generator=gen, dtype=dtype) for gen in gens]) * init_noise_sigma


@prepare_latents.trap("the noise drawn in float32 and cast to dtype",
                      hint="Draw in the requested dtype, torch.randn(shape, generator=g, dtype=dtype), as "
                           "randn_tensor does: on a CPU a float16 draw and a float32 draw cast to float16 agree "
                           "only when C·h·w is a multiple of 16 (the tail is drawn differently), and they leave "
                           "the generator in different states.")
def _(batch_size, num_channels_latents, height, width, vae_scale_factor, init_noise_sigma, generator, dtype,
      latents=None):
    if latents is not None:
        return latents * init_noise_sigma
    shape = _shape(batch_size, num_channels_latents, height, width, vae_scale_factor)
    return _draw(shape, generator, torch.float32).to(dtype) * init_noise_sigma
