"""Collection: a kata file becomes one pytest item per (kata function, check) of its grader.

`katas/01_forward_noise.py` is graded by `graders/01_forward_noise.py` (same file name: the kata id
is the file stem, never typed anywhere else). With --solutions, the same items load their
functions from `solutions/01_forward_noise.py` instead.
"""
from __future__ import annotations

import dataclasses
import traceback
import zlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from diffusion_katas.core.course import lab_title, load_module
from diffusion_katas.core.results import Reason
from diffusion_katas.pytest_plugin import session as state
from diffusion_katas.core.spec import Budget, Check, Kata, KataFailure, OverBudget, Scenario


class KataTodo(Exception):
    """The learner's function still raises NotImplementedError: not attempted yet.

    `waits_on` names the earlier kata function it builds on that is still TODO, if that is where the
    NotImplementedError came from (lab 12 is built from the learner's own labs 04, 06 and 07)."""

    def __init__(self, name: str, waits_on: str = ""):
        super().__init__(name)
        self.waits_on = waits_on


class LearnerCrash(Exception):
    """The learner's function raised; the original exception is the __cause__."""

    def __init__(self, context: str, exc: BaseException):
        super().__init__(context)
        self.context = context
        self.exc = exc


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    session = parent.config.stash.get(state.SESSION, None)
    if session is None or file_path.suffix != ".py":
        return None
    if file_path.parent not in (session.kata_dir, session.solutions_dir):
        return None
    grader = session.graders_dir / file_path.name
    if not grader.is_file():
        return None
    return KataFile.from_parent(parent, path=file_path)


class KataFile(pytest.File):
    """A kata (or solution) file; its items come from the grader of the same name."""

    def collect(self):
        session = self.config.stash[state.SESSION]
        self.lab = self.path.stem
        self.source = self.path
        if session.grade_solutions and self.path.parent == session.kata_dir:
            self.source = session.solutions_dir / self.path.name
        self.title = lab_title(self.source)
        self._module: ModuleType | None = None
        self._import_error: BaseException | None = None
        self._imported = False
        for kata in session.course.graders_of(self.lab):
            for check in kata.checks:
                item = KataItem.from_parent(self, name=check.id, check=check)
                for mark in check.marks:
                    item.add_marker(mark)
                yield self._limited(item, session)
            if session.hidden_seed is not None:
                for check in kata.checks:
                    cases = check.cases + session.hidden_cases.get(f"{self.lab}::{kata.name}::{check.name}", [])
                    hidden = dataclasses.replace(check, cases=cases)
                    item = KataItem.from_parent(self, name=f"{kata.name}[{check.name} · hidden]", check=hidden,
                                                hidden=True)
                    for mark in check.marks:
                        item.add_marker(mark)
                    yield self._limited(item, session)
            for budget in kata.budgets:
                item = BudgetItem.from_parent(self, name=budget.id, budget=budget)
                item.add_marker(pytest.mark.budget)
                for mark in budget.marks:
                    item.add_marker(mark)
                yield self._limited(item, session)

    def _limited(self, item: pytest.Item, session) -> pytest.Item:
        if session.timeout and self.config.pluginmanager.hasplugin("timeout"):
            item.add_marker(pytest.mark.timeout(session.timeout))
        return item

    def learner_module(self) -> ModuleType:
        """Import the learner's file once; a syntax or import error fails each item plainly."""
        if not self._imported:
            self._imported = True
            kind = "solution" if self.source.parent.name != self.path.parent.name else "kata"
            try:
                self._module = load_module(self.source, f"_{kind}_{self.lab}")
            except FileNotFoundError as exc:
                self._import_error = exc
            except BaseException as exc:  # SyntaxError, ImportError, a crash at import time
                self._import_error = exc
        if self._import_error is not None:
            message = self._import_message(self._import_error)
            reason = Reason.MISSING_FILE if isinstance(self._import_error, FileNotFoundError) else Reason.IMPORT_ERROR
            raise KataFailure(message, reason, message.splitlines()[0])
        return self._module

    def _import_message(self, exc: BaseException) -> str:
        rel = self.config.stash[state.SESSION].rel(self.source)
        if isinstance(exc, FileNotFoundError):
            return f"{rel} is missing: restore it with `kata reset {self.lab[:2]}` (or from git)."
        if isinstance(exc, SyntaxError):
            return (f"{rel} does not parse: {exc.msg} at line {exc.lineno}\n"
                    f"    {(exc.text or '').rstrip()}\n"
                    "Fix the syntax error; every kata in this file is graded once it imports.")
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(self.source)]
        where = f" at line {frames[-1].lineno}" if frames else ""
        return (f"importing {rel} failed{where}: {type(exc).__name__}: {exc}\n"
                "Kata files may import torch and the standard library; fix the import to be graded.")


class KataItem(pytest.Item):
    """One check of one kata function, run over all of its cases."""

    def __init__(self, *, check: Check, hidden: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.check = check
        self.kata = check.kata
        self.hidden = hidden  # drawn from the instructor's seed (and case file): learners never see it
        self.last_context = ""

    @property
    def lab(self) -> str:
        return self.parent.lab

    @property
    def check_name(self) -> str:
        return f"{self.check.name} · hidden" if self.hidden else self.check.name

    def seed(self, salt: str = "") -> int:
        session = self.config.stash[state.SESSION]
        base = session.hidden_seed if self.hidden else session.seed
        return (base + zlib.crc32(f"{self.lab}:{self.kata.name}:{salt}".encode())) % 2**31

    def learner_function(self):
        module = self.parent.learner_module()
        fn = getattr(module, self.kata.name, None)
        if not callable(fn):
            where = f"{self.config.stash[state.SESSION].rel(self.parent.source)} has no function `{self.kata.name}`"
            raise KataFailure(f"{where} (deleted or renamed?). Keep the name and signature from the kata.",
                              Reason.MISSING_FUNCTION, where)
        return fn

    def runtest(self) -> None:
        self.run_check(self.check, self.learner_function())

    def call_learner(self, fn, inputs: dict, meter=None):
        """The learner's function on fresh inputs, with its TODO, crash and guard outcomes sorted."""
        from diffusion_katas.engine.isolation import AnswerKeyError, call_learner

        try:
            return call_learner(fn, inputs, self.kata.answer_key, self.kata.name, meter)
        except KataFailure as exc:
            raise KataFailure(f"{self.last_context}\n{exc}", exc.reason, exc.detail) from None
        except NotImplementedError as exc:
            where = _todo_origin(exc, self.parent.source)
            if where is not None:
                raise KataTodo(self.kata.name, where) from None
            raise LearnerCrash(self.last_context, exc) from exc
        except AnswerKeyError as exc:
            raise KataFailure(f"{self.last_context}\n{exc}", Reason.ANSWER_KEY) from None
        except Exception as exc:
            raise LearnerCrash(self.last_context, exc) from exc

    def run_check(self, check: Check, fn) -> None:
        """Every case of `check` through the learner's function, against the reference."""
        import torch

        from diffusion_katas.engine.comparison import mismatch
        from diffusion_katas.core.tolerances import for_dtype, output_dtype

        seed = self.seed(check.name)
        # Models and adapters built inside a check draw from the global RNG; inputs from `g`. Distinct
        # seeds: a learner who forgets `generator=` must not redraw the grader's own inputs by luck.
        torch.manual_seed(seed ^ 0x5EED)
        g = torch.Generator().manual_seed(seed)
        total = len(check.cases)
        for number, case in enumerate(check.cases, 1):
            built = check.build(case, g)
            scenarios = [built] if isinstance(built, Scenario) else list(built)
            for scenario in scenarios:
                self.last_context = self._context(check, number, total, case, scenario)
                rng = torch.random.get_rng_state()  # traps replay the learner's call from here
                out = self.call_learner(fn, scenario.inputs)
                if scenario.verify is not None:
                    try:
                        scenario.verify(out)
                    except KataFailure as exc:
                        raise KataFailure(f"{self.last_context}\n{exc}", exc.reason, exc.detail) from None
                tol = for_dtype(check.tol, output_dtype(scenario.expected))
                problem = mismatch(out, scenario.expected, tol)
                if problem:
                    raise KataFailure(self._failure(problem, scenario, out, tol, rng))

    def _context(self, check: Check, number: int, total: int, case: dict, scenario: Scenario) -> str:
        from diffusion_katas.engine.comparison import describe

        parts = [f"{self.kata.name} · check '{check.name}' · case {number}/{total}"]
        if case:
            parts.append("(" + ", ".join(f"{k}={v}" for k, v in case.items()) + ")")
        if scenario.label:
            parts.append(f"· {scenario.label}")
        inputs = ", ".join(f"{k}={describe(v)}" for k, v in scenario.inputs.items())
        return " ".join(parts) + f"\n  inputs: {inputs}"

    def _failure(self, problem: str, scenario: Scenario, out: Any, tol, rng=None) -> str:
        import torch

        from diffusion_katas.engine.comparison import matches
        from diffusion_katas.engine.isolation import fresh

        lines = [self.last_context, f"  {problem}"]
        for trap in self.kata.traps:
            if rng is not None:  # a trap that draws from the global RNG (no `generator=`) draws what the learner drew
                torch.random.set_rng_state(rng)
            try:
                wrong = trap.fn(**fresh(scenario.inputs))
            except Exception:
                continue
            if matches(out, wrong, tol) and not matches(scenario.expected, wrong, tol):
                lines.append(f"  trap: {trap.name}\n    {trap.hint}")
                break
        if scenario.on_mismatch is not None:
            session = self.config.stash[state.SESSION]
            try:
                lines.append("  " + scenario.on_mismatch(out, session.root / ".kata" / "diffs"))
            except Exception as exc:  # an artefact must never hide the verdict
                lines.append(f"  (could not write the difference image: {exc})")
        return "\n".join(lines)

    def repr_failure(self, excinfo, style=None):
        from diffusion_katas.pytest_plugin import reporting

        return reporting.failure_text(self, excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.lab}::{self.name}"


class BudgetItem(KataItem):
    """A cost budget of one kata function: judged only once the function passes all its checks."""

    def __init__(self, *, budget: Budget, **kwargs):
        super().__init__(check=budget.kata.checks[0], **kwargs)
        self.budget = budget

    @property
    def check_name(self) -> str:
        return f"budget: {self.budget.name}"

    def runtest(self) -> None:
        fn = self.learner_function()
        for check in self.kata.checks:
            try:
                self.run_check(check, fn)
            except KataFailure as exc:
                raise KataFailure(
                    f"{self.kata.name} · budget '{self.budget.name}' is judged once the function is "
                    f"correct, and it is not yet:\n{exc}", exc.reason, exc.detail) from None
        self.last_context = f"{self.kata.name} · budget '{self.budget.name}'"

        import torch

        seed = self.seed(f"budget:{self.budget.name}")
        torch.manual_seed(seed)
        measurements = self.budget.measure(Learner(self, fn), torch.Generator().manual_seed(seed))
        self.measurements = measurements
        if any(m.over for m in measurements):
            raise OverBudget(self.last_context)


class Learner:
    """The learner's function as a budget sees it: `learner(**inputs)` calls it (guarded, on fresh
    inputs); `learner.measure(meter, **inputs)` returns (measurement, output) of one metered call."""

    def __init__(self, item: KataItem, fn):
        self._item = item
        self._fn = fn

    def __call__(self, **inputs):
        return self._item.call_learner(self._fn, inputs)

    def measure(self, meter, **inputs):
        return self._item.call_learner(self._fn, inputs, meter)


def _todo_origin(exc: BaseException, source: Path) -> str | None:
    """Where a NotImplementedError comes from: "" for the learner's own file (its TODO stub),
    "lab.py::function" for another kata file beside it, None for anywhere else (a real crash)."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return None
    last = Path(frames[-1].filename)
    if last == source:
        return ""
    if last.parent == source.parent and last.name[:2].isdigit():
        return f"{last.name}::{frames[-1].name}"
    return None
