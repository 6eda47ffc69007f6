"""What graders share, written once, so that a grader reads as its lesson.

- `DTYPES`: the dtype names cases use ("float32", "float16", "bfloat16", "float64") -> torch dtypes.
- `SD_BETAS` and `sd_schedule(...)`: Stable Diffusion's training schedule, under one name.
- `quiet_diffusers()`: the warnings diffusers 0.42.1 prints on every pipeline run, silenced in one place.
- `seed_from(g)`: a seed drawn from the check's generator, for a pipeline's own generator or the global RNG.
- `seed_global(seed)`: torch.manual_seed, without the accelerators' queued seeding where there are none.
- `float64_twin(scheduler)`: a copy with float64 tables, whose own code computes a reference's float64 shadow.
- `PipelineRecorder`: what a diffusers pipeline passed to its scheduler and its denoiser, step by step.
- `DenoiserProbe`: a denoiser that counts its calls and records the batch size and timesteps of each.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

# transformers notes once per process, when a diffusers pipeline module imports CLIPImageProcessor, that without
# torchvision its image processors fall back to PIL: these checks never run an image processor, and the note
# would land in the captured output of whichever check imported a pipeline first.
logging.getLogger("transformers.utils.import_utils").setLevel(logging.ERROR)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64}

# Stable Diffusion 1.x/2.x trained with a scaled-linear β ladder from 0.00085 to 0.012 over 1000 steps.
SD_BETAS = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


# Answer-key families (engine/isolation.py: 'MODULES:OBJECTS', matched by module and qualified name when a function
# starts): every library route to an answer, not the one function it is graded against.
SCHEDULERS = "diffusers.schedulers.**"
PIPELINES = "diffusers.pipelines.**"
MODELS = "diffusers.models.**"
EVERY_PIPELINE_CALL = f"{PIPELINES}:*Pipeline*.__call__"
# every image processor's post-processing (VaeImageProcessor's subclasses and siblings, the pipelines' own
# processors and postprocess_image methods, diffusers.utils' PIL helpers)
IMAGE_POSTPROCESSING = (*(f"diffusers.image_processor:*Processor*.{name}"
                          for name in ("postprocess", "denormalize", "pt_to_numpy", "numpy_to_pil")),
                        f"{PIPELINES}:*Processor*.postprocess", f"{PIPELINES}:*Processor*.pt_to_numpy",
                        f"{PIPELINES}:*.postprocess_image", "diffusers.utils.pil_utils:*_to_pil")


def sd_schedule(**overrides) -> dict:
    """Stable Diffusion's scheduler settings (SD_BETAS), with `overrides` on top."""
    return {**SD_BETAS, **overrides}


@contextlib.contextmanager
def quiet_diffusers() -> Iterator[None]:
    """Silence what diffusers 0.42.1 warns on every run: FutureWarnings (deprecations), and numpy 2's
    DeprecationWarning about np.array(copy=...) from EulerDiscreteScheduler.set_timesteps."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


def seed_from(g: torch.Generator) -> int:
    """A seed drawn from the check's generator (so `--kata-seed` reproduces it)."""
    return int(torch.randint(0, 2**31, (1,), generator=g))


def seed_global(seed: int) -> None:
    """torch.manual_seed(seed) at the price of the CPU generator's seeding where this process has no accelerator:
    torch.manual_seed queues each accelerator's seed with the caller's formatted stack (about 0.7 ms under pytest),
    which on a CPU-only machine is never used. Where an accelerator is, it is torch.manual_seed itself."""
    if _accelerator():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(int(seed))


@functools.lru_cache(maxsize=1)
def _accelerator() -> bool:
    mps = getattr(torch.backends, "mps", None)
    xpu = getattr(torch, "xpu", None)
    return bool(torch.cuda.is_available() or (mps is not None and mps.is_available())
                or (xpu is not None and xpu.is_available()))


def fresh_rng_state() -> torch.Tensor:
    """A state of torch's CPU generator drawn from fresh entropy: the global RNG state a learner's call starts
    from carries no seed (the hidden seed above all). A grader whose reference draws from the global RNG (no
    `generator=`) draws it from such a state and hands the same state to the call (Scenario.global_rng)."""
    import secrets

    return torch.Generator().manual_seed(secrets.randbits(63)).get_state()


def float64_twin(scheduler: Any) -> Any:
    """A copy of a diffusers scheduler whose float tensors (ᾱ, β, σ, the final ᾱ) are float64.

    Called with float64 inputs, diffusers' own code then computes the float64 shadow of its answer on
    the same tables (Scenario.exact): the float32 values, widened, so only the arithmetic differs.
    """
    twin = copy.deepcopy(scheduler)
    for name, value in vars(twin).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            setattr(twin, name, value.double())
    return twin


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    return value


@dataclass
class Step:
    """One denoising step as the pipeline's own components saw it."""

    t: Any = None  # the timestep the denoiser got
    denoiser_input: torch.Tensor | None = None  # the sample, as the denoiser saw it (doubled under CFG, scaled)
    conditioning: torch.Tensor | None = None  # encoder_hidden_states, when the denoiser takes them
    denoiser_output: torch.Tensor | None = None
    step_input: torch.Tensor | None = None  # the model_output scheduler.step received (guided)
    step_output: torch.Tensor | None = None  # scheduler.step's prev_sample


@dataclass
class PipelineRecorder:
    """Records a pipeline run: `with PipelineRecorder(pipe, denoiser) as rec: pipe(...)`, then `rec.steps`.

    It wraps this pipeline's scheduler.step (an instance attribute, removed afterwards; `functools.wraps`
    keeps the signature the pipeline inspects for `eta` and `generator`) and hooks the denoiser module.
    """

    pipe: Any
    denoiser: torch.nn.Module
    steps: list[Step] = field(default_factory=list)

    def __enter__(self) -> "PipelineRecorder":
        scheduler_step = self.pipe.scheduler.step

        @functools.wraps(scheduler_step)
        def recording_step(model_output, timestep, sample, *args, **kwargs):
            if not self.steps or self.steps[-1].step_input is not None:
                self.steps.append(Step(t=_clone(timestep)))  # a scheduler stepped without a denoiser call
            self.steps[-1].step_input = _clone(model_output)
            out = scheduler_step(model_output, timestep, sample, *args, **kwargs)
            self.steps[-1].step_output = _clone(out[0] if isinstance(out, tuple) else out.prev_sample)
            return out

        def before(module, args, kwargs):
            sample = args[0] if args else kwargs.get("sample")
            timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
            self.steps.append(Step(t=_clone(timestep), denoiser_input=_clone(sample),
                                   conditioning=_clone(kwargs.get("encoder_hidden_states"))))

        def after(module, args, kwargs, out):
            self.steps[-1].denoiser_output = _clone(out[0] if isinstance(out, tuple) else getattr(out, "sample", out))

        self.pipe.scheduler.step = recording_step
        self._hooks = [self.denoiser.register_forward_pre_hook(before, with_kwargs=True),
                       self.denoiser.register_forward_hook(after, with_kwargs=True)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        del self.pipe.scheduler.step

    @property
    def final(self) -> torch.Tensor:
        """The last scheduler.step output (x₀ before any clamp or decode)."""
        return self.steps[-1].step_output


class DenoiserProbe(torch.nn.Module):
    """A denoiser that counts its calls and records each call's batch size and timesteps.

    Attribute access (config, dtype, device, ...) falls through to the wrapped model, so a kata function
    can use it where it would use the model. It is remote (`kata_remote`): the learner's runner gets a
    stand-in showing `remote_view()`, and each call runs here, in the grader's process, so the counts are
    the grader's own and the model cannot be reached without them. Its work is therefore not in a runner
    meter's reading: budgets on it count calls and batch sizes.
    """

    kata_remote = True

    def __init__(self, model: torch.nn.Module, label: str = ""):
        super().__init__()
        self.denoiser = model
        self.batch_sizes: list[int] = []
        self.timesteps: list[list[int]] = []
        self.label = label or f"{type(model).__name__}(tiny, random weights; calls counted)"

    @property
    def calls(self) -> int:
        return len(self.batch_sizes)

    def remote_view(self) -> dict:
        """What the runner's stand-in shows: the model's config, dtype and device, and this probe's label."""
        model = self.denoiser
        return dict(label=self.label, config=getattr(model, "config", None), dtype=getattr(model, "dtype", None),
                    device=getattr(model, "device", None))

    def forward(self, *args, **kwargs):
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))  # a UNet's, a DiT's
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        self.batch_sizes.append(int(sample.shape[0]) if isinstance(sample, torch.Tensor) else -1)
        try:
            if isinstance(timestep, torch.Tensor):
                self.timesteps.append([int(v) for v in timestep.flatten().tolist()])
            elif timestep is not None:
                self.timesteps.append([int(timestep)])
        except (TypeError, ValueError, OverflowError):  # a NaN or non-number: the model's to reject
            self.timesteps.append([])
        return self.denoiser(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["denoiser"], name)

    def __repr__(self) -> str:
        return self.label


class TrajectoryProbe(DenoiserProbe):
    """A DenoiserProbe that also keeps what each call saw and returned: the timestep, the sample and the
    output (detached copies), for `first_divergence` to compare with a pipeline's recorded steps."""

    def __init__(self, model: torch.nn.Module, label: str = ""):
        super().__init__(model, label)
        self.seen_t: list = []
        self.seen_inputs: list = []
        self.seen_outputs: list = []

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        sample = args[0] if args else kwargs.get("sample")
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        self.seen_t.append(_clone(timestep) if isinstance(timestep, torch.Tensor) else
                           float(timestep) if isinstance(timestep, (int, float)) else None)
        self.seen_inputs.append(_clone(sample) if type(sample) is torch.Tensor else None)
        result = out[0] if isinstance(out, tuple) else getattr(out, "sample", out)
        self.seen_outputs.append(_clone(result) if type(result) is torch.Tensor else None)
        return out


def _close(mine: Any, theirs: Any, rtol: float, atol: float) -> bool:
    if not isinstance(mine, torch.Tensor) or not isinstance(theirs, torch.Tensor) or mine.shape != theirs.shape:
        return False
    return bool(torch.allclose(mine.double(), theirs.double(), rtol=rtol, atol=atol, equal_nan=True))


def _t_value(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        values = t.flatten().tolist()
        return values[0] if values and all(v == values[0] for v in values) else values
    return t


def first_divergence(probe: TrajectoryProbe, steps: list[Step], rtol: float = 1e-3, atol: float = 1e-4) -> str | None:
    """Where the learner's loop first left the pipeline's, call by call: the timestep the denoiser got, its
    input (the latent as scaled and batched for it) and its output, in that order. None when every recorded
    call agrees (the difference is then after the last call: the final step or the output stage).

    The tolerance is loose on purpose: this only says where to look; the check's own comparison judged."""
    reference = [s for s in steps if s.denoiser_input is not None]
    n = len(reference)
    for k, step in enumerate(reference):
        at = f"step {k + 1} of {n}"
        if k >= len(probe.seen_inputs):
            return f"{at}: your loop stopped calling the denoiser after {len(probe.seen_inputs)} call(s)"
        mine_t, their_t = _t_value(probe.seen_t[k]), _t_value(step.t)
        try:
            same_t = abs(float(mine_t) - float(their_t)) <= 1e-3 * (1 + abs(float(their_t)))
        except (TypeError, ValueError):
            same_t = mine_t == their_t
        if not same_t:
            return f"{at}: the denoiser got t = {mine_t}, the pipeline's got t = {their_t} (the timestep itself)"
        mine, theirs = probe.seen_inputs[k], step.denoiser_input
        if not _close(mine, theirs, rtol, atol):
            if not isinstance(mine, torch.Tensor) or mine.shape != theirs.shape:
                shape = tuple(mine.shape) if isinstance(mine, torch.Tensor) else type(mine).__name__
                return (f"{at}: the denoiser's input has shape {shape}, the pipeline's {tuple(theirs.shape)} "
                        "(the batch as the denoiser sees it: doubled for guidance?)")
            what = (f"{at}: the denoiser's input differs from the pipeline's (max |diff| "
                    f"{float((mine.double() - theirs.double()).abs().max()):.3g})")
            ratio = mine.double().flatten() / theirs.double().flatten()
            ratio = ratio[torch.isfinite(ratio) & (theirs.double().flatten().abs() > 1e-3)]
            if ratio.numel() and float(ratio.std(unbiased=False)) <= 1e-3 * float(ratio.abs().mean()) \
                    and abs(float(ratio.mean()) - 1) > 1e-3:
                what += (f"; yours is {float(ratio.mean()):.4g}× the pipeline's everywhere: a missing or extra "
                         + ("scale: of the initial noise (prepare_latents multiplies it by init_noise_sigma) or of "
                            "the input (scheduler.scale_model_input divides by √(σ² + 1))" if k == 0 else
                            "scaling of the input (scheduler.scale_model_input divides by √(σ² + 1))"))
            if k == 0:
                return what + " — already at the first call: x_T, or how it is scaled for the denoiser"
            return what + (f" — while step {k} agreed on t, input and output: the update after step {k} "
                           "(guidance combine, scheduler.step, what is carried to the next step) went wrong")
        if not _close(probe.seen_outputs[k], step.denoiser_output, rtol, atol):
            return (f"{at}: the same input and t gave another denoiser output: the conditioning or the other "
                    "arguments the denoiser got differ")
    if len(probe.seen_inputs) > n:
        return f"the pipeline calls the denoiser {n} time(s); your loop called it {len(probe.seen_inputs)} times"
    return None


def localizer(probe: TrajectoryProbe, steps: list[Step]):
    """A Scenario.on_mismatch for a loop check: where the learner's trajectory first left the pipeline's."""

    def where(_out: Any, _folder: Any) -> str:
        found = first_divergence(probe, steps)
        if found is None:
            return ("where it first differs: every denoiser call agreed with the pipeline's (t, input, output), "
                    "so the difference comes after the last call: the last scheduler.step or what is returned")
        return f"where it first differs: {found}"

    return where
