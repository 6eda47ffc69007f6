"""The vocabulary graders are written in: a kata function, its checks, its traps.

A grader module (graders/NN_lab.py in a course) declares one `Kata` per learner function. Each check is
written once, micrograd-style: it builds seeded inputs, computes the expected output with the real
diffusers/peft object, and returns both; the plugin runs the same inputs through the learner's
function (and through each declared trap when the learner's output is wrong) and compares.

    add_noise = Kata("add_noise", hints=("nudge", "math", "near code"),
                     answer_key=("diffusers.schedulers.scheduling_ddpm.DDPMScheduler.add_noise",))

    @add_noise.check("a noised batch", cases=[dict(dtype="float32"), dict(dtype="float16")], tol=EXACT)
    def _(case, g):
        ...
        return Scenario(inputs=dict(x0=x0, ...), expected=scheduler.add_noise(x0, noise, t))

    @add_noise.trap("ᾱ_t used where √ᾱ_t belongs", hint="...")
    def _(x0, noise, alphas_cumprod, timesteps): ...
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from diffusion_katas.core.results import Reason
from diffusion_katas.core.tolerances import Tol


class KataFailure(AssertionError):
    """A graded check did not hold; the message is written for the learner, the reason for tools."""

    def __init__(self, message: str = "", reason: Reason = Reason.WRONG, detail: str = ""):
        super().__init__(message)
        self.reason = reason
        self.detail = detail


class OverBudget(AssertionError):
    """The function is correct but costs more than its budget allows."""


@dataclass
class Scenario:
    """One call to grade: the keyword arguments, the reference's answer, and what it is."""

    inputs: dict[str, Any]
    expected: Any
    label: str = ""
    # The float64 shadow of `expected`: the same math on the same inputs in float64 (diffusers' own code
    # on float64 tensors where it runs so). When given, a value also passes when it is no further from
    # exact math than diffusers' own rounding allows (tolerances.REFERENCE_ERROR): a more accurate
    # answer than diffusers is never wrong. None: only the check's tolerance against diffusers applies.
    # A function of no arguments that computes it defers it: called (once) only where a value is outside the
    # tolerance, for a shadow as costly as the reference itself (lab 11's float64 VAE decodes). It must compute
    # from what it closes over alone (a shared model configured per case is configured inside it).
    exact: Any = None
    # The reference's generators after its call, by input name (torch.Generator objects): once the values
    # match, the learner's copies of those inputs must be left in the same state, i.e. the same draws taken
    # (a step that skips its draw where σ = 0 gives the same values but shifts every later draw). A list
    # of generators (one per sample, as pipelines take them) is compared generator by generator.
    generators_after: dict[str, Any] | None = None
    # Extra assertions on the learner's output (call counts, say); raise KataFailure to fail. With `observe`,
    # verify(output, observed) also gets what those inputs recorded of the call in the runner.
    verify: Callable[..., None] | None = None
    # Names of inputs (a grader's own class with `kata_observe()`) whose record of the call the runner sends back:
    # plain data from the learner's process, checked and handed to verify, never copied onto the grader's objects.
    observe: tuple[str, ...] = ()
    # Called with (learner output, a folder for artefacts) when the values differ; returns extra
    # message text (e.g. the path of a PNG of |yours - reference|).
    on_mismatch: Callable[[Any, Any], str] | None = None
    # The torch global RNG state the learner's call starts from, where the reference drew from the global RNG
    # (engine.helpers.fresh_rng_state(): no seed in it); `verify` then sees the state the call left. None: the
    # call gets a state of fresh entropy that nothing graded depends on.
    global_rng: Any = None

    def __post_init__(self):
        if callable(self.exact) and not isinstance(self.exact, _Deferred):
            self.exact = _Deferred(self.exact)

    def shadow(self) -> Any:
        """The float64 shadow (`exact`), computed now where it was deferred."""
        return self.exact.value() if isinstance(self.exact, _Deferred) else self.exact


class _Deferred:
    """A deferred shadow: computed on first use, then kept (a kept build's copies share it). torch's global RNG is
    left as it was: whenever the shadow is computed, if ever, what the grader draws after it does not change."""

    def __init__(self, compute: Callable[[], Any]):
        self._compute, self._value, self._done = compute, None, False

    def value(self) -> Any:
        if not self._done:
            import sys

            torch = sys.modules.get("torch")
            state = torch.random.get_rng_state() if torch is not None else None
            try:
                self._value, self._done = self._compute(), True
            finally:
                if state is not None:
                    torch.random.set_rng_state(state)
        return self._value


@dataclass
class Trap:
    """A wrong-but-plausible implementation: if the learner's output matches it, name it."""

    name: str
    hint: str
    fn: Callable[..., Any]
    # An output with no finite number matches every trap as broken, so no trap is named on one; except a trap
    # whose misconception IS such an output (a float16 decode that overflows to NaN), declared so.
    nonfinite: bool = False


@dataclass
class Check:
    """A family of scenarios for one kata function, expanded over `cases`.

    `build(case, g)` makes a case's scenario(s) from the case, `g` and the global RNG alone. The plugin builds the
    next case while the runner computes the current one, so a build must not change what an earlier scenario's
    closures (verify, on_mismatch, a deferred exact) or traps read outside its inputs: state a trap needs goes in
    the scenario (Scenario.global_rng, the inputs), never in a module global that the next build overwrites. The
    inputs themselves are safe: after the call they are read back as they were sent (a shared model configured
    per case included)."""

    kata: "Kata"
    name: str
    build: Callable[[dict, Any], Scenario | Sequence[Scenario]]
    cases: list[dict]
    tol: Tol
    marks: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.kata.name}[{self.name}]"


@dataclass
class Measurement:
    """One measured cost against its allowance, e.g. peak live bytes of a tiled decode."""

    what: str
    measured: float
    allowed: float
    unit: str  # "bytes", "FLOPs", "calls", "ms", "x"
    why: str  # where the allowance comes from
    at_least: bool = False  # the allowance is a floor (a batch at least 2B wide), not a ceiling
    # the mistake that explains this measurement over its allowance, where one does: (name, hint)
    trap: tuple[str, str] | None = None

    @property
    def over(self) -> bool:
        return self.measured < self.allowed if self.at_least else self.measured > self.allowed


@dataclass
class Budget:
    """A cost check for a kata function, run only once the function passes its checks.

    The decorated function takes (learner, g): `learner(**inputs)` calls the learner's function with
    the answer key locked and fresh inputs, and `learner.measure(meter, **inputs)` returns
    (measurement, output) of one call under a meter from diffusion_katas.engine.meters (input copies not measured).
    It returns a list of Measurement.
    """

    kata: "Kata"
    name: str
    measure: Callable[[Callable[..., Any], Any], list[Measurement]]
    marks: tuple = ()

    @property
    def id(self) -> str:
        return f"{self.kata.name}[budget: {self.name}]"


@dataclass
class Kata:
    """A learner function to grade: its name in the kata file, hints, traps and answer key."""

    name: str
    hints: tuple[str, ...] = ()
    # Dotted paths to the diffusers/peft callables this kata is graded against. They raise while
    # learner code runs: calling the answer key is not solving the kata.
    answer_key: tuple[str, ...] = ()
    # Refused only when the learner's own code calls them: diffusers code the kata may use calls them too
    # (scheduler.step draws its noise with randn_tensor).
    answer_key_direct: tuple[str, ...] = ()
    # Where diffusers computes the answer inline (no callable to lock), say so here instead.
    no_answer_key: str = ""
    # Where the answer is a single torch operator, its name (matched in the op's name): refused while
    # learner code runs, at the Python API and at the kernel level.
    forbidden_ops: tuple[str, ...] = ()
    points: float = 1.0
    checks: list[Check] = field(default_factory=list)
    traps: list[Trap] = field(default_factory=list)
    budgets: list[Budget] = field(default_factory=list)

    def check(self, name: str, *, cases: Sequence[dict] = ({},), tol: Tol, marks: Sequence = ()):
        """Declare a check; the decorated function maps (case, generator) to Scenario(s)."""

        def register(build):
            self.checks.append(Check(self, name, build, [dict(c) for c in cases], tol, tuple(marks)))
            return build

        return register

    def budget(self, name: str, *, marks: Sequence = ()):
        """Declare a cost budget; the decorated function maps (learner, generator) to Measurements."""

        def register(measure):
            self.budgets.append(Budget(self, name, measure, tuple(marks)))
            return measure

        return register

    def trap(self, name: str, *, hint: str, nonfinite: bool = False):
        """Declare a misconception; the decorated function takes the same inputs as the kata. `nonfinite`: its
        signature is an output with no finite number (it is named on one, where other traps are not)."""

        def register(fn):
            self.traps.append(Trap(name, hint, fn, nonfinite))
            return fn

        return register
