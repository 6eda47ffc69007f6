"""Grader for lab 05 · The sampling loop: initial noise, the loop, the output stage, the whole pipeline.

Every reference is a live run of DDPMPipeline or DDIMPipeline on a tiny random UNet2DModel
(diffusion_katas.engine.tiny.unet2d), at the learner's batch size (the UNet's output moves by ~1e-6 with the batch
size, so bitwise checks need equal batches). The run records three things: the first sample the
pipeline feeds its UNet (x_T), the last scheduler.step output (x_0 before the final clamp) and the
images. With the default clip_sample=True the last step of a schedule ending at t=0 returns the clipped
x̂_0, so x_0 stays in [-1, 1] (about a quarter of it exactly ±1) and the final clamp changes nothing;
the to_image check therefore runs with clip_sample=False, where x_0 does leave [-1, 1].

The learner's UNet is a `CountedUNet`: calls pass through to the same model, and each call is checked
against the pipeline's (one call per timestep, in the order of scheduler.timesteps, the whole batch,
the UNet's dtype). A deviation fails at once with a diagnosis; too few calls fail in Scenario.verify.
It is remote (engine/runner.py): it runs, counts and checks in the grader's process, never in the
learner's. The learner's scheduler is an equal fresh copy of the pipeline's that still holds the timesteps
of an earlier 4-step run, as a reused scheduler would; its step asks the grader's `StepWitness` whether
it got the t the UNet just got. The wrappers are defined at the end of the file, after the katas.

Precision: bit for bit, on purpose (tol=EXACT), and so with no float64 shadow for initial_noise,
sampling_loop and generate: the lesson is that one generator, the same draws in the same order and the
pipeline's own components reproduce the pipeline exactly; any other arithmetic is another loop. Only
to_image, one formula, carries its float64 shadow (Scenario.exact). Every check that draws noise also
declares the pipeline's generator after its run (Scenario.generators_after): the right values with a
different number of draws fail ("drew a different amount of noise").
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from diffusers.image_processor import VaeImageProcessor
from diffusers.pipelines.ddim.pipeline_ddim import DDIMPipeline
from diffusers.pipelines.ddpm.pipeline_ddpm import DDPMPipeline
from diffusers.schedulers.scheduling_ddim import DDIMScheduler
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from diffusers.utils.torch_utils import randn_tensor

from diffusion_katas.engine import tiny
from diffusion_katas.engine.helpers import (DTYPES, EVERY_PIPELINE_CALL, IMAGE_POSTPROCESSING, PipelineRecorder, seed_from,
                                           seed_global)
from diffusion_katas.core.spec import Kata, KataFailure, Scenario
from diffusion_katas.core.tolerances import EXACT

PIPELINES = {"ddpm": (DDPMPipeline, DDPMScheduler), "ddim": (DDIMPipeline, DDIMScheduler)}
PIPELINE_CALLS = ("diffusers.pipelines.ddpm.pipeline_ddpm.DDPMPipeline.__call__",
                  "diffusers.pipelines.ddim.pipeline_ddim.DDIMPipeline.__call__",
                  EVERY_PIPELINE_CALL)  # any pipeline's loop is a route to this one


def _unet(case: dict):
    unet = tiny.unet2d(sample_size=case.get("size", 16), channels=case.get("channels", 3))
    # .half(), not .to(torch.float16): ModelMixin.to logs a warning about modules kept in float32.
    return unet.half() if case.get("dtype") == "float16" else unet


# ---- the reference: one pipeline run, recorded ------------------------------------------------------
class Run(NamedTuple):
    images: torch.Tensor  # output_type="pt": (B, C, S, S) in [0, 1]
    sample: torch.Tensor  # the last scheduler.step output: x_0 before the clamp
    first: torch.Tensor  # the first sample fed to the UNet: x_T
    generator: torch.Generator  # the pipeline's generator after its run: every draw it took
    scheduler: object  # pipe.scheduler (DDIMPipeline builds its own from the config)
    name: str


def run_pipeline(kind: str, unet, batch_size: int, steps: int, seed: int, eta=None, **scheduler_config) -> Run:
    pipe_cls, scheduler_cls = PIPELINES[kind]
    pipe = pipe_cls(unet=unet, scheduler=scheduler_cls(**scheduler_config))
    pipe.set_progress_bar_config(disable=True)
    kwargs = {} if eta is None else {"eta": eta}
    generator = torch.Generator().manual_seed(seed)
    with PipelineRecorder(pipe, unet) as rec:
        out = pipe(batch_size=batch_size, generator=generator,
                   num_inference_steps=steps, output_type="pt", **kwargs)
    args = f"batch_size={batch_size}, num_inference_steps={steps}" + ("" if eta is None else f", eta={eta}")
    config = ", ".join(f"{k}={v!r}" for k, v in scheduler_config.items())
    return Run(out.images, rec.final, rec.steps[0].denoiser_input, generator, pipe.scheduler,
               f"{pipe_cls.__name__}({args}) · {scheduler_cls.__name__}({config}) · {unet.dtype}")


# ---- initial_noise -----------------------------------------------------------------------------------
initial_noise = Kata(
    "initial_noise",
    hints=(
        "The pipeline starts from pure Gaussian noise, drawn in a single call from the generator it was given.",
        "x_T ~ N(0, I) with shape (B, C, size, size): one torch.randn call with generator=generator and "
        "dtype=dtype (the UNet's dtype).",
        "return torch.randn((batch_size, channels, size, size), generator=generator, dtype=dtype)",
    ),
    answer_key=("diffusers.utils.torch_utils.randn_tensor",
                "diffusers.pipelines.ddpm.pipeline_ddpm.randn_tensor",
                "diffusers.pipelines.ddim.pipeline_ddim.randn_tensor",
                *PIPELINE_CALLS),
)


@initial_noise.check("vs the pipeline's first UNet input",
                     cases=[dict(pipeline="ddpm", batch=2, channels=3, size=16, dtype="float32"),
                            dict(pipeline="ddim", batch=3, channels=3, size=10, dtype="float32"),
                            dict(pipeline="ddpm", batch=2, channels=4, size=8, dtype="float16")],
                     tol=EXACT)
def _(case, g):
    seed = seed_from(g)
    unet = _unet(case)
    run = run_pipeline(case["pipeline"], unet, case["batch"], 1, seed)  # one step: only x_T matters
    inputs = dict(batch_size=case["batch"], channels=case["channels"], size=case["size"],
                  generator=torch.Generator().manual_seed(seed), dtype=unet.dtype)
    drawn = torch.Generator().manual_seed(seed)  # the pipeline's generator once x_T is drawn
    randn_tensor(run.first.shape, generator=drawn, dtype=unet.dtype)
    return Scenario(inputs=inputs, expected=run.first, label=f"x_T of {run.name}",
                    generators_after={"generator": drawn})


@initial_noise.check("vs randn_tensor, more shapes",
                     cases=[dict(batch=4, channels=4, size=8, dtype="float16"),
                            # float16 with B·C·H·W = 225, not a multiple of 16: torch's CPU sampler then fills
                            # a float16 tensor with other numbers than a float32 draw cast to float16
                            dict(batch=3, channels=3, size=5, dtype="float16"),
                            dict(batch=3, channels=1, size=5, dtype="float32"),
                            dict(batch=1, channels=3, size=32, dtype="float32")],
                     tol=EXACT)
def _(case, g):
    seed = seed_from(g)
    dtype = DTYPES[case["dtype"]]
    shape = (case["batch"], case["channels"], case["size"], case["size"])
    drawn = torch.Generator().manual_seed(seed)
    expected = randn_tensor(shape, generator=drawn, dtype=dtype)
    inputs = dict(batch_size=case["batch"], channels=case["channels"], size=case["size"],
                  generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return Scenario(inputs=inputs, expected=expected, generators_after={"generator": drawn})


@initial_noise.trap("one torch.randn call per image",
                    hint="randn_tensor draws the whole batch in one call. Per-image draws from the same "
                         "generator cut the random stream differently (torch's CPU sampler fills blocks of "
                         "16 values), so they only agree when C·H·W is a multiple of 16.")
def _(batch_size, channels, size, generator, dtype):
    return torch.cat([torch.randn((1, channels, size, size), generator=generator, dtype=dtype)
                      for _ in range(batch_size)])


@initial_noise.trap("drawn in float32, then cast to dtype",
                    hint="randn_tensor draws in the requested dtype: torch.randn(shape, generator=generator, "
                         "dtype=dtype). A float32 draw cast to float16 is other noise: torch's CPU sampler fills a "
                         "float16 tensor differently unless its size is a multiple of 16 (values apart by ~4).")
def _(batch_size, channels, size, generator, dtype):
    return torch.randn((batch_size, channels, size, size), generator=generator).to(dtype)


@initial_noise.trap("drawn from the global RNG: generator= not passed",
                    hint="torch.randn(shape, dtype=dtype) without generator= draws from torch's global RNG: "
                         "another seed's noise, and the pipeline's generator never advances. Pass "
                         "generator=generator.")
def _(batch_size, channels, size, generator, dtype):
    return torch.randn((batch_size, channels, size, size), dtype=dtype)


@initial_noise.trap("uniform noise (torch.rand) instead of Gaussian",
                    hint="Diffusion starts from N(0, I): torch.randn, not torch.rand (uniform on [0, 1)).")
def _(batch_size, channels, size, generator, dtype):
    return torch.rand((batch_size, channels, size, size), generator=generator, dtype=dtype)


@initial_noise.trap("channels last: (B, H, W, C)",
                    hint="diffusers models take (B, C, H, W): channels right after the batch.")
def _(batch_size, channels, size, generator, dtype):
    return torch.randn((batch_size, size, size, channels), generator=generator, dtype=dtype)


# ---- sampling_loop -----------------------------------------------------------------------------------
sampling_loop = Kata(
    "sampling_loop",
    hints=(
        "The scheduler owns the loop: set its timesteps for this run, visit each one, call the UNet once, "
        "and let scheduler.step produce the next sample from that prediction.",
        "set_timesteps(n); for t in scheduler.timesteps: ε̂ = unet(x, t).sample; "
        "x = scheduler.step(ε̂, t, x, generator=generator[, eta=eta]).prev_sample. "
        "Under torch.no_grad(), no clamping; return the last x.",
        "scheduler.set_timesteps(num_inference_steps); kw = {} if eta is None else {'eta': eta}; x = noise; "
        "with torch.no_grad(): for t in scheduler.timesteps: "
        "x = scheduler.step(unet(x, t).sample, t, x, generator=generator, **kw).prev_sample; return x",
    ),
    answer_key=PIPELINE_CALLS,
)

DDPM_CASES = [
    dict(batch=2, steps=10),  # the default leading spacing: 900 … 0
    dict(batch=2, steps=6, dtype="float16", scheduler=dict(timestep_spacing="linspace")),  # 999 … 0
    dict(batch=1, steps=5, scheduler=dict(prediction_type="v_prediction", beta_schedule="squaredcos_cap_v2",
                                          clip_sample=False)),
]
DDIM_CASES = [
    dict(batch=3, steps=8, eta=0.0),  # leading: 875 … 0
    dict(batch=2, steps=8, eta=1.0, scheduler=dict(timestep_spacing="trailing")),  # 999 … 124
    dict(batch=2, steps=5, eta=0.5, dtype="float16", scheduler=dict(timestep_spacing="linspace")),
]


@sampling_loop.check("vs DDPMPipeline, pre-clamp sample", cases=DDPM_CASES, tol=EXACT)
def _(case, g):
    return _loop_scenario("ddpm", case, g, whole_pipeline=False)


@sampling_loop.check("vs DDIMPipeline, η 0/½/1, pre-clamp", cases=DDIM_CASES, tol=EXACT)
def _(case, g):
    return _loop_scenario("ddim", case, g, whole_pipeline=False)


@sampling_loop.trap("scheduler.step called without generator=",
                    hint="DDPM (and DDIM with η > 0) add fresh noise in step. Without generator= it comes "
                         "from the global RNG: pass the same generator that drew the initial noise.")
def _(unet, scheduler, noise, num_inference_steps, generator, eta=None):
    return _loop(unet, scheduler, noise, num_inference_steps, generator, eta, use_generator=False)


@sampling_loop.trap("eta not passed to scheduler.step (DDIM ran with η = 0)",
                    hint="η is an argument of DDIMScheduler.step, not of the scheduler: "
                         "scheduler.step(..., eta=eta, generator=generator) when eta is not None.")
def _(unet, scheduler, noise, num_inference_steps, generator, eta=None):
    return _loop(unet, scheduler, noise, num_inference_steps, generator, eta, pass_eta=False)


@sampling_loop.trap("the sample clamped to [-1, 1] inside the loop",
                    hint="Leave x alone between steps (the scheduler clips only its x_0 estimate, "
                         "internally); clamping belongs to the output stage, after the last step.")
def _(unet, scheduler, noise, num_inference_steps, generator, eta=None):
    return _loop(unet, scheduler, noise, num_inference_steps, generator, eta, clamp=True)


# ---- to_image ----------------------------------------------------------------------------------------
to_image = Kata(
    "to_image",
    hints=(
        "The model works in [-1, 1]; images live in [0, 1]. Rescale, then cut off what falls outside.",
        "image = clamp(x/2 + ½, 0, 1).",
        "return (sample / 2 + 0.5).clamp(0, 1)",
    ),
    answer_key=("diffusers.image_processor.VaeImageProcessor.postprocess",
                "diffusers.image_processor.VaeImageProcessor.denormalize", *IMAGE_POSTPROCESSING, *PIPELINE_CALLS),
)


@to_image.check("vs the pipelines' output_type='pt'",
                cases=[dict(pipeline="ddpm", batch=2, steps=4),
                       dict(pipeline="ddim", batch=2, steps=4, eta=1.0, dtype="float16")],
                tol=EXACT)
def _(case, g):
    # clip_sample=False: otherwise x_0 is the clipped x̂_0, already inside [-1, 1], and the clamp is idle.
    run = run_pipeline(case["pipeline"], _unet(case), case["batch"], case["steps"], seed_from(g), case.get("eta"),
                       clip_sample=False)
    outside = int((run.sample.abs() > 1).sum())
    return Scenario(inputs=dict(sample=run.sample), expected=run.images, exact=image_shadow(run.sample),
                    label=f"the last sample of {run.name} ({outside} of {run.sample.numel()} values outside [-1, 1])")


@to_image.check("vs VaeImageProcessor.postprocess",
                cases=[dict(shape=(3, 3, 8, 8), dtype="float32"), dict(shape=(2, 4, 6, 6), dtype="float16")],
                tol=EXACT)
def _(case, g):
    sample = (1.5 * torch.randn(case["shape"], generator=g)).to(DTYPES[case["dtype"]])  # some beyond ±1
    expected = VaeImageProcessor().postprocess(sample.clone(), output_type="pt")
    return Scenario(inputs=dict(sample=sample), expected=expected, exact=image_shadow(sample))


def image_shadow(sample):
    """(x/2 + ½).clamp(0, 1) in float64."""
    return (sample.double() / 2 + 0.5).clamp(0, 1)


@to_image.trap("rescaled but not clamped",
               hint="x/2 + ½ still leaves values outside [0, 1] where x left [-1, 1]: clamp(0, 1) after rescaling.")
def _(sample):
    return sample / 2 + 0.5


@to_image.trap("clamped but not rescaled",
               hint="Map [-1, 1] onto [0, 1] first (x/2 + ½), then clamp: clamping alone throws away "
                    "the negative half.")
def _(sample):
    return sample.clamp(0, 1)


@to_image.trap("clamped to [-1, 1], never mapped to [0, 1]",
               hint="The sample lives in [-1, 1]; an image in [0, 1]: x/2 + ½ first, then clamp(0, 1).")
def _(sample):
    return sample.clamp(-1, 1)


@to_image.trap("stretched by its own min and max, not mapped from [-1, 1]",
               hint="The map is fixed: x/2 + ½, then clamp(0, 1). Min-max stretching depends on each batch's "
                    "extremes, so the same latent gives another image in another batch.")
def _(sample):
    return (sample - sample.min()) / (sample.max() - sample.min())


@to_image.trap("scaled to 0-255",
               hint="output_type='pt' returns floats in [0, 1]; ×255 and rounding happen only for PIL images.")
def _(sample):
    return (sample / 2 + 0.5).clamp(0, 1) * 255


# ---- generate ----------------------------------------------------------------------------------------
generate = Kata(
    "generate",
    hints=(
        "Chain your three functions the way the pipeline does, with one generator throughout.",
        "noise = initial_noise(B, unet.config.in_channels, unet.config.sample_size, generator, unet.dtype); "
        "image = to_image(sampling_loop(unet, scheduler, noise, n, generator, eta)).",
        "noise = initial_noise(batch_size, unet.config.in_channels, unet.config.sample_size, generator, "
        "unet.dtype); return to_image(sampling_loop(unet, scheduler, noise, num_inference_steps, generator, eta=eta))",
    ),
    answer_key=("diffusers.image_processor.VaeImageProcessor.postprocess", *IMAGE_POSTPROCESSING, *PIPELINE_CALLS),
    # the schedulers' own step draws its noise with randn_tensor: only the learner's direct call is refused
    answer_key_direct=("diffusers.utils.torch_utils.randn_tensor",),
)


@generate.check("vs DDPMPipeline images, end to end", cases=[dict(batch=2, steps=8)], tol=EXACT)
def _(case, g):
    return _loop_scenario("ddpm", case, g, whole_pipeline=True)


@generate.check("vs DDIMPipeline images, end to end",
                cases=[dict(batch=3, steps=6, eta=1.0, size=8, dtype="float16",
                             scheduler=dict(timestep_spacing="trailing")),
                       # B·C·H·W = 600, not a multiple of 16: the noise drawn per image, or in float32 and cast,
                       # is other noise (in the case above, 576 values, it is the same)
                       dict(batch=2, steps=3, eta=0.0, size=10, dtype="float16")],
                tol=EXACT)
def _(case, g):
    return _loop_scenario("ddim", case, g, whole_pipeline=True)


def _draw(unet, batch_size, generator):
    c = unet.config
    return torch.randn((batch_size, c.in_channels, c.sample_size, c.sample_size), generator=generator,
                       dtype=unet.dtype)


@generate.trap("the sample returned before to_image",
               hint="The pipeline's last stage maps x to (x/2 + ½).clamp(0, 1); return images, not x_0.")
def _(unet, scheduler, batch_size, num_inference_steps, generator, eta=None):
    return _loop(unet, scheduler, _draw(unet, batch_size, generator), num_inference_steps, generator, eta)


@generate.trap("scheduler.step called without generator=",
               hint="One generator drives everything: it draws x_T, then every step's noise. Pass it on.")
def _(unet, scheduler, batch_size, num_inference_steps, generator, eta=None):
    x = _loop(unet, scheduler, _draw(unet, batch_size, generator), num_inference_steps, generator, eta,
              use_generator=False)
    return (x / 2 + 0.5).clamp(0, 1)


@generate.trap("eta not passed on to the loop (DDIM ran with η = 0)",
               hint="generate receives eta for the scheduler: hand it to sampling_loop(..., eta=eta).")
def _(unet, scheduler, batch_size, num_inference_steps, generator, eta=None):
    x = _loop(unet, scheduler, _draw(unet, batch_size, generator), num_inference_steps, generator, eta,
              pass_eta=False)
    return (x / 2 + 0.5).clamp(0, 1)


@generate.trap("the initial noise drawn one image at a time",
               hint="randn_tensor draws the whole batch in one call: initial_noise(batch_size, ...), not a "
                    "torch.cat of batch_size one-image draws (torch's CPU sampler fills blocks of 16 values, so "
                    "they agree only when C·H·W is a multiple of 16).")
def _(unet, scheduler, batch_size, num_inference_steps, generator, eta=None):
    x = torch.cat([_draw(unet, 1, generator) for _ in range(batch_size)])
    return (_loop(unet, scheduler, x, num_inference_steps, generator, eta) / 2 + 0.5).clamp(0, 1)


@generate.trap("the initial noise drawn in float32, then cast to the UNet's dtype",
               hint="Draw x_T in unet.dtype: initial_noise(..., unet.dtype), as randn_tensor does. A float32 draw "
                    "cast to float16 is other noise (torch's CPU sampler fills a float16 tensor differently unless "
                    "its size is a multiple of 16).")
def _(unet, scheduler, batch_size, num_inference_steps, generator, eta=None):
    c = unet.config
    x = torch.randn((batch_size, c.in_channels, c.sample_size, c.sample_size), generator=generator).to(unet.dtype)
    return (_loop(unet, scheduler, x, num_inference_steps, generator, eta) / 2 + 0.5).clamp(0, 1)


@generate.trap("a fresh generator with the same seed for the loop",
               hint="One generator drives the whole run: the loop's step noise continues the stream the initial "
                    "noise was drawn from. Re-seeding a new generator replays the initial noise as step noise.")
def _(unet, scheduler, batch_size, num_inference_steps, generator, eta=None):
    x = _draw(unet, batch_size, generator)
    again = torch.Generator().manual_seed(generator.initial_seed())
    return (_loop(unet, scheduler, x, num_inference_steps, again, eta) / 2 + 0.5).clamp(0, 1)


# ---- the learner's scheduler and UNet, checked call by call (after the katas: used at run time) -----
# The learner's scheduler arrives holding the schedule of an earlier run with this many steps.
STALE_STEPS = 4


def _loop_scenario(kind: str, case: dict, g, *, whole_pipeline: bool) -> Scenario:
    seed = seed_from(g)
    unet = _unet(case)
    batch, steps, eta = case["batch"], case["steps"], case.get("eta")
    run = run_pipeline(kind, unet, batch, steps, seed, eta, **case.get("scheduler", {}))
    generator = torch.Generator().manual_seed(seed)
    scheduler = learner_scheduler(run.scheduler)
    counted = CountedUNet(unet, run.scheduler.timesteps, run.first.shape, stale=[int(t) for t in scheduler.timesteps])
    scheduler.kata_unet = StepWitness(counted)  # its step checks the timestep against the UNet's last call
    label = f"{run.name} · timesteps {_short(counted.expected)}"
    if whole_pipeline:
        inputs = dict(unet=counted, scheduler=scheduler, batch_size=batch, num_inference_steps=steps,
                      generator=generator)
        expected = run.images
    else:
        noise = torch.randn(run.first.shape, generator=generator, dtype=unet.dtype)
        if not torch.equal(noise, run.first):  # a grader self-check, not the learner's fault
            raise RuntimeError("grader: the pipeline's initial noise is no longer one torch.randn call")
        inputs = dict(unet=counted, scheduler=scheduler, noise=noise, num_inference_steps=steps,
                      generator=generator)
        expected = run.sample
    if eta is not None:
        inputs["eta"] = eta
    return Scenario(inputs=inputs, expected=expected, label=label, verify=counted.verify,
                    generators_after={"generator": run.generator})


def learner_scheduler(reference):
    """A fresh scheduler equal to the pipeline's, left holding an earlier run's timesteps."""
    scheduler = _learner_class(type(reference)).from_config(reference.config)
    scheduler.set_timesteps(STALE_STEPS)
    return scheduler


@functools.cache
def _learner_class(cls):
    """`cls` as the learner gets it: a one-line repr (failure messages print the inputs, and a
    scheduler's own repr is its whole JSON config), and a step that checks its timestep against the
    UNet's last call (a loop index there crashes DDPM with an IndexError and silently changes DDIM).
    Same name; the same computation otherwise."""

    def __repr__(self):
        c = self.config
        held = (f"holding {len(self.timesteps)} timesteps from an earlier run"
                if self.num_inference_steps else "no timesteps set")
        return f"{cls.__name__}({c.beta_schedule}, {c.timestep_spacing} spacing; {held})"

    def step(self, model_output, timestep, sample, *args, **kwargs):
        witness = self.__dict__.get("kata_unet")
        if witness is not None:
            witness(timestep)  # the grader checks it against the UNet's last call (a KataFailure there fails the check)
        return cls.step(self, model_output, timestep, sample, *args, **kwargs)

    def __reduce__(self):  # the runner receives its inputs pickled; this class is made here, not importable
        return _rebuild_learner_scheduler, (cls, self.__dict__)

    return type(cls.__name__, (cls,), {"__repr__": __repr__, "step": step, "__reduce__": __reduce__,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


def _rebuild_learner_scheduler(cls, state: dict):
    scheduler = object.__new__(_learner_class(cls))
    scheduler.__dict__.update(state)
    return scheduler


def _t_values(timestep) -> list[int]:
    if isinstance(timestep, torch.Tensor):
        return sorted({int(v) for v in timestep.flatten().tolist()})
    return [int(timestep)]


# Not the shared DenoiserProbe: it checks each call against the pipeline's as it comes, and reseeds the global RNG.
class CountedUNet:
    """The tiny UNet as the learner gets it: each call is checked against the pipeline's calls. Remote: the
    learner's runner gets a stand-in (its config, dtype and device), and every call runs here."""

    kata_remote = True
    kata_caller_grad = False  # set by the runner's grader side for each call: autograd on where the learner called

    def __init__(self, unet, timesteps, shape, stale: list[int] | None = None):
        import secrets

        self._unet = unet
        self.expected = [int(t) for t in timesteps]
        self.shape = tuple(shape)
        self.rng_seed = secrets.randbits(30)  # of fresh entropy: the reseeded global RNG reaches the learner's call
        self.stale = stale or []
        self.seen: list = []

    def remote_view(self) -> dict:
        return dict(label=repr(self), config=self._unet.config, dtype=self._unet.dtype, device=self._unet.device)

    def __getattr__(self, name):  # config, dtype, device, … are the real UNet's
        if name.startswith("__") or name == "_unet":
            raise AttributeError(name)
        return getattr(self._unet, name)

    def __repr__(self) -> str:
        c = self._unet.config
        return f"UNet2DModel(sample_size={c.sample_size}, in_channels={c.in_channels}, {self._unet.dtype})"

    def quiet(self, sample, timestep, *args, **kwargs):
        """The UNet forward without the checks (traps call this), then the global RNG reseeded."""
        out = self._unet(sample, timestep, *args, **kwargs)
        # A scheduler.step without generator= draws its noise from the global RNG. Reseeding it from t
        # after each call makes that draw the same for the learner and for the trap imitating the
        # mistake, so the mistake can be named. Nothing else in a correct loop reads the global RNG.
        seed_global(self.rng_seed + _t_values(timestep)[0])
        return out

    def __call__(self, sample, timestep, *args, **kwargs):
        self._check(sample, timestep)
        return self.quiet(sample, timestep, *args, **kwargs)

    forward = __call__

    def _schedule(self) -> str:
        n = len(self.expected)
        return (f"The pipeline calls the UNet {n} times, once per entry of scheduler.timesteps after "
                f"set_timesteps({n}), in order: {_short(self.expected)}.")

    def _check(self, sample, timestep) -> None:
        k, n = len(self.seen), len(self.expected)
        values = _t_values(timestep)
        t = values[0] if len(values) == 1 else values
        previous = self.seen[-1] if self.seen else None
        self.seen.append(t)
        where = f"UNet call {k + 1}"
        if not isinstance(sample, torch.Tensor):
            raise KataFailure(f"  {where} got {type(sample).__name__} as its sample; it takes the (B, C, H, W) tensor x.")
        if tuple(sample.shape) != self.shape:
            if sample.dim() == 4 and sample.shape[0] != self.shape[0]:
                raise KataFailure(
                    f"  {where} got a batch of {sample.shape[0]}; the pipeline sends all {self.shape[0]} images "
                    f"through the UNet together, shape {self.shape}. One forward per step for the whole batch "
                    "(not one image at a time).")
            raise KataFailure(f"  {where} got a sample of shape {tuple(sample.shape)}; the pipeline's is {self.shape}.")
        if self.kata_caller_grad:
            raise KataFailure(
                f"  {where} ran with autograd on: your loop records a graph through every UNet call. Sampling is "
                "inference: run the loop under torch.no_grad(), as the pipelines do (@torch.no_grad() on __call__); "
                "otherwise memory grows with every step.")
        if sample.dtype != self._unet.dtype:
            raise KataFailure(f"  {where} got a {sample.dtype} sample, but the UNet runs in {self._unet.dtype}: "
                              "the pipeline draws the noise in unet.dtype.")
        if k >= n:
            raise KataFailure(f"  {where} got t={t}, but the schedule has only {n} timesteps: the pipeline stops "
                              f"after {n} calls.\n    " + self._schedule())
        if t == self.expected[k]:
            return
        here = f"the pipeline's call {k + 1} uses t={self.expected[k]} (scheduler.timesteps[{k}])"
        name = None
        if k > 0 and t == previous:
            name, why = "the UNet called twice per step", (
                f"That timestep was already used by call {k}: two UNet calls for one step. Call it once per step and "
                "use that output; every extra call is a full forward (the step count is the cost).")
        elif self.stale and self.seen == self.stale[:k + 1]:
            name, why = "set_timesteps not called: the scheduler's earlier schedule used", (
                f"That comes from the scheduler's old schedule {_short(self.stale)}: it still held an earlier run's "
                f"{len(self.stale)} timesteps. Call scheduler.set_timesteps(num_inference_steps) before the loop, as "
                "the pipeline does on every call.")
        elif t == k and t == self.expected[n - 1 - k]:
            name, why = "the loop index as the timestep (range(n)), or the schedule walked backwards", (
                "That is the loop index, or the schedule walked backwards. Iterate over scheduler.timesteps in its "
                "own order (noisiest first) and pass each t itself.")
        elif t == k:
            name, why = "the loop index as the timestep (range(n))", (
                "That is the loop index. The UNet (and scheduler.step) take the timestep itself: iterate over "
                "scheduler.timesteps.")
        elif t == self.expected[n - 1 - k]:
            name, why = "the schedule walked backwards", (
                "That walks the schedule backwards: scheduler.timesteps already runs from the noisiest timestep to "
                "the cleanest.")
        message = f"  {where} got t={t}, but {here}.\n    {self._schedule()}"
        raise KataFailure(message + (f"\n  trap: {name}\n    {why}" if name else ""))

    def verify(self, out) -> None:
        """After the learner's call: every timestep was visited (autograd is checked at each call, `_check`)."""
        n = len(self.expected)
        if len(self.seen) < n:
            missing = self.expected[len(self.seen):]
            stopped = ("\n  trap: the loop stopped before the schedule's end\n    Every entry of scheduler.timesteps "
                       "is one step, the last one (the cleanest t) included: loop over all of them."
                       if self.seen == self.expected[:len(self.seen)] else "")
            raise KataFailure(
                f"  the UNet was called {len(self.seen)} times; the pipeline calls it {n} times. "
                f"Not visited: t = {_short(missing)}. " + self._schedule() + stopped)


class StepWitness:
    """What the learner's scheduler.step asks before it steps: was it given the t the UNet was just called with?
    Remote too: it reads the grader's CountedUNet, where the calls are."""

    kata_remote = True

    def __init__(self, unet: CountedUNet):
        self.unet = unet

    def remote_view(self) -> dict:
        return dict(label="the UNet's record of its calls")

    def __call__(self, timestep):
        seen = self.unet.seen
        if seen:
            values = _t_values(timestep)
            t = values[0] if len(values) == 1 else values
            if t != seen[-1]:
                named = ("\n  trap: the loop index passed to scheduler.step\n    The step takes the timestep t the UNet "
                         "got, not its position in the loop." if t == len(seen) - 1 else "")
                raise KataFailure(
                    f"  scheduler.step got timestep {t}, but the UNet was just called with t={seen[-1]}. "
                    "Pass the same t to both: step looks up ᾱ_t and the previous timestep from it, so the "
                    "loop index (or any other number) is not a timestep." + named)


def _denoise(unet):
    """Traps call the UNet without the learner-facing call checks."""
    return unet.quiet if isinstance(unet, CountedUNet) else unet


def _loop(unet, scheduler, x, steps, generator, eta, *, use_generator=True, pass_eta=True, clamp=False):
    """The reference loop with one mistake switched on (for the traps)."""
    denoise = _denoise(unet)
    scheduler.__dict__.pop("kata_unet", None)  # traps run after the learner: no call checks for them
    scheduler.set_timesteps(steps)
    kwargs = {"eta": eta} if eta is not None and pass_eta else {}
    with torch.no_grad():
        for t in scheduler.timesteps:
            eps = denoise(x, t).sample
            x = scheduler.step(eps, t, x, generator=generator if use_generator else None, **kwargs).prev_sample
            if clamp:
                x = x.clamp(-1, 1)
    return x


def _short(values: list) -> str:
    values = list(values)
    if len(values) <= 8:
        return str(values)
    return "[" + ", ".join(map(str, values[:4])) + ", …, " + ", ".join(map(str, values[-2:])) + "]"
