"""Collection: a kata file becomes one pytest item per (kata function, check) of its grader.

`katas/01_forward_noise.py` is graded by `graders/01_forward_noise.py` (same file name: the kata id
is the file stem, never typed anywhere else). With --solutions, the same items load their
functions from `solutions/01_forward_noise.py` instead.
"""
from __future__ import annotations

import dataclasses
import gc
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest

from diffusion_katas.core.course import lab_title
from diffusion_katas.core.results import Reason, Status
from diffusion_katas.pytest_plugin import session as state
from diffusion_katas.pytest_plugin.outcomes import BudgetWaits, KataTodo, LearnerCrash
from diffusion_katas.core.spec import Budget, Check, KataFailure, OverBudget, Scenario


def _grades(config: pytest.Config, file_path: Path) -> bool:
    """Whether a file is a kata (or solution) file of this course with a grader."""
    session = config.stash.get(state.SESSION, None)
    if session is None or file_path.suffix != ".py":
        return False
    if file_path.parent not in (session.kata_dir, session.solutions_dir):
        return False
    return (session.graders_dir / file_path.name).is_file()


def pytest_collect_file(file_path: Path, parent: pytest.Collector):
    if _grades(parent.config, file_path):
        return KataFile.from_parent(parent, path=file_path)
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector):
    """A kata file named on the command line is ours alone: pytest's python collector would import it as
    a test module, running learner code in the grading process (and a syntax error would stop the run)."""
    if _grades(parent.config, module_path):
        return Claimed.from_parent(parent, path=module_path)
    return None


class Claimed(pytest.File):
    """What pytest's python collector gets for a kata file: nothing to import, nothing to collect."""

    def collect(self):
        return []


class KataFile(pytest.File):
    """A kata (or solution) file; its items come from the grader of the same name."""

    def setup(self) -> None:
        """Before the file's first check: what grading the files before it left alive is frozen too (gc.freeze, as
        after collection), its garbage collected first. Graders import diffusers' and transformers' modules as
        their checks first need them; unfrozen, every full collection walked them again (26 of them, 2.1 s of a
        38 s course)."""
        super().setup()
        if self.config.stash[state.SESSION].heap_frozen:  # (gc.get_freeze_count() walks the frozen heap: 60 ms)
            gc.collect()
            gc.freeze()

    def collect(self):
        session = self.config.stash[state.SESSION]
        self.lab = self.path.stem
        self.source = self.path
        if session.grade_solutions and self.path.parent == session.kata_dir:
            self.source = session.solutions_dir / self.path.name
        self.title = lab_title(self.source) if self.source.is_file() else session.course.title(self.lab)
        if self.source.is_file() and not self.untouched():  # the warm parent loads the grader as this process does
            from diffusion_katas.engine.runner import Zygote

            Zygote.preload(self.grader_modules(), (self.source, *self.learner_files()))
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
        # The runner's own wall clock ends a hang at session.timeout; pytest-timeout stays as a backstop
        # for the grader itself.
        if session.timeout and self.config.pluginmanager.hasplugin("timeout"):
            item.add_marker(pytest.mark.timeout(session.timeout + 30))
        return item

    def written_functions(self) -> frozenset[str]:
        """The file's top-level functions whose body (docstring aside) is more than `raise NotImplementedError`,
        read with ast, never run; none where it does not parse. A guess of what the runner will say (only used to
        start work early): the file could change before the runner reads it, or define a function twice."""
        import ast

        try:
            data = self.source.read_bytes()
        except OSError:
            return frozenset()
        cached = getattr(self, "_written", None)
        if cached is not None and cached[0] == data:
            return cached[1]
        try:
            tree = ast.parse(data)
        except (SyntaxError, ValueError):
            written = frozenset()
        else:
            written = frozenset(node.name for node in tree.body if isinstance(node, ast.FunctionDef)
                                and not _stub_body(node.body))
        self._written = (data, written)
        return written

    def grader_modules(self) -> list[tuple[str, str]]:
        """(path, module name) of this lab's grader, as its runners load it."""
        session = self.config.stash[state.SESSION]
        return [(str(session.course.grader(self.lab)), f"diffusion_katas_grader_{self.lab}")]

    def learner_files(self) -> list[Path]:
        """The learner's own files: this kata and its siblings (a later lab may build on earlier ones)."""
        return sorted(self.source.parent.glob("*.py"))

    def untouched(self) -> bool:
        """Whether this kata file is still its pristine self (Course.untouched: the same code, read with ast, never
        run) and runs nothing at import but imports and definitions: then every function is its TODO stub and
        raises NotImplementedError whatever the inputs, and no runner need import it to say so. A file that runs
        code at import (lab 12 loads your earlier labs) is always imported: that code can fail. Read again when
        the file's bytes change (a save during the run)."""
        import ast

        session = self.config.stash[state.SESSION]
        if self.source != session.course.kata(self.lab):  # --solutions: a solution file is never untouched
            return False
        try:
            data = self.source.read_bytes()
        except OSError:
            return False
        cached = getattr(self, "_untouched", None)
        if cached is not None and cached[0] == data:
            return cached[1]
        quiet = False
        if session.course.untouched(self.lab):
            tree = ast.parse(data)
            quiet = all(isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef)) or
                        (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)) or
                        (isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
                        for node in tree.body)
        self._untouched = (data, quiet)
        return quiet

    def import_failure(self, error) -> KataFailure:
        """The verdict for a kata file that could not be imported, from the runner's report of it."""
        rel = self.config.stash[state.SESSION].rel(self.source)
        if error is None:
            message = f"{rel} is missing: restore it with `kata reset {self.lab[:2]}` (or from git)."
            return KataFailure(message, Reason.MISSING_FILE, message.splitlines()[0])
        syntax = error.data.get("syntax")
        if syntax and syntax.get("filename") in ("", str(self.source)):
            message = (f"{rel} does not parse: {syntax['msg']} at line {syntax['lineno']}\n"
                       f"    {syntax['text'].rstrip()}\n"
                       "Fix the syntax error; every kata in this file is graded once it imports.")
        else:
            frames = [f for f in error.frames if f[0] == str(self.source)]
            where = f" at line {frames[-1][1]}" if frames else ""
            message = (f"importing {rel} failed{where}: {error.type_name}: {error.message}\n"
                       "Kata files may import torch and the standard library; fix the import to be graded.")
        return KataFailure(message, Reason.IMPORT_ERROR, message.splitlines()[0])


class KataItem(pytest.Item):
    """One check of one kata function, run over all of its cases."""

    def __init__(self, *, check: Check, hidden: bool = False, **kwargs):
        # The id as pytest writes a parametrized test's, "FILE::FUNCTION[CHECK]", given as text: pytest 9 parses it
        # into the function's name and its parameters, as it parses the ids its cache keeps (--lf, --ff, --sw
        # match items to them; a name holding the brackets would never match).
        if "nodeid" not in kwargs and kwargs.get("parent") is not None:
            kwargs["nodeid"] = f"{kwargs['parent'].nodeid}::{kwargs['name']}"
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
        if self.hidden:  # keyed: a hidden check's seed does not lead back to the instructor's secret
            return state.hidden_check_seed(session.hidden_seed, self.lab, self.kata.name, salt)
        return (session.seed + zlib.crc32(f"{self.lab}:{self.kata.name}:{salt}".encode())) % 2**31

    def open_runner(self) -> None:
        """Fork this check's runner and send it the learner's file to import; its answer is read by
        `learner_function` (the grader may build the first case meanwhile)."""
        from diffusion_katas.engine.runner import Runner, RunnerGone

        session = self.config.stash[state.SESSION]
        kata_file = self.parent
        if not kata_file.source.is_file():
            raise kata_file.import_failure(None)
        self.deadline = time.monotonic() + session.timeout
        try:
            self.runner = Runner(
                kata_file.source, f"_learner_{self.lab}", kata_file.grader_modules(),
                self.kata.answer_key, self.kata.name, session.timeout, self.kata.forbidden_ops,
                tuple(kata_file.learner_files()), self.kata.answer_key_direct,
                memory=None if self.get_closest_marker("cuda") else int(session.memory_gib * 2**30),
                cuda=bool(self.get_closest_marker("cuda")), wait=False)
        except RunnerGone as gone:
            raise self._import_ended(gone) from None

    def _import_ended(self, gone) -> Exception:
        """The kata file ended its process while it was being imported (or the runner's own code failed)."""
        from diffusion_katas.engine.runner_main import RUNNER_FAILED

        session = self.config.stash[state.SESSION]
        rel = session.rel(self.parent.source)
        if gone.how == f"exit {RUNNER_FAILED}":  # the runner's own code failed: never the learner's to fix
            return RuntimeError(f"the runner failed while it prepared this check (exit status {RUNNER_FAILED}), "
                                f"before or while it imported {rel}: a grading problem, not your code. "
                                "KATA_RUNNER_LOG=FILE keeps its traceback.")
        if gone.timed_out:
            message = f"importing {rel} did not finish within {session.timeout:g} s (the process was killed)"
        else:
            message = f"importing {rel} ended the process that imports it ({_how(gone.how)})"
        return KataFailure(message + "\nKata files define functions; code at the top level runs on import.",
                           Reason.IMPORT_ERROR, message)

    def learner_function(self) -> str:
        """This check's runner's answer to opening the learner's file (`open_runner`, here if not yet): the
        function's name once it is there."""
        from diffusion_katas.engine.runner import RemoteError, RunnerGone

        session = self.config.stash[state.SESSION]
        kata_file = self.parent
        if getattr(self, "runner", None) is None:
            self.open_runner()
        try:
            opened = self.runner.open_reply
        except RunnerGone as gone:
            raise self._import_ended(gone) from None
        self._echo()
        if opened.get("kind") == "import_error":
            raise kata_file.import_failure(RemoteError(opened))
        if opened.get("kind") == "grader_error":
            raise RuntimeError(f"the runner could not start: {opened.get('message')}")
        if self.kata.name not in opened.get("functions", ()):
            where = f"{session.rel(kata_file.source)} has no function `{self.kata.name}`"
            raise KataFailure(f"{where} (deleted or renamed?). Keep the name and signature from the kata.",
                              Reason.MISSING_FUNCTION, f"{where} (deleted or renamed?)")
        return self.kata.name

    def runtest(self) -> None:
        if self.parent.untouched():  # every function still its stub: TODO, without a runner (or a reference) built
            raise KataTodo(self.kata.name, "")
        try:
            if getattr(self, "runner", None) is None:
                self.open_runner()
            else:  # opened while the check before it ran (`_open_next`): this check's time counts from now
                self.deadline = time.monotonic() + self.config.stash[state.SESSION].timeout
            ahead = self._built_while_opening(self.check)
            self._open_next()
            self.run_check(self.check, self.learner_function(), ahead)
        finally:
            self.close_runner()

    def _open_next(self) -> None:
        """Open the next check's runner now, where that check grades the same file: its fork and the import of
        the learner's file happen while this check runs (a runner takes tens of milliseconds to be ready; lab 01's
        six checks spent half their time waiting for them). The next check reads its runner's answer as if it had
        opened it itself; one that cannot be opened here is opened again in its own turn, which reports why."""
        following = getattr(self, "next_item", None)
        if type(following) is not KataItem or following.parent is not self.parent \
                or getattr(following, "runner", None) is not None:
            return
        try:
            following.open_runner()
        except Exception:  # noqa: BLE001  (it fails again in its own turn, and says so there)
            following.runner = None
            return
        self.config.stash[state.SESSION].opened_ahead.append(following)

    def close_runner(self) -> None:
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.close()
            self._echo()
            self.runner = None

    def _echo(self) -> None:
        """What the learner's code printed, into this item's captured output (capped by the runner)."""
        runner = getattr(self, "runner", None)
        if runner is not None and runner.printed:
            sys.stdout.write(runner.printed)
            runner.printed = ""

    def _gone(self, gone) -> KataFailure:
        session = self.config.stash[state.SESSION]
        if gone.timed_out:
            return KataFailure(
                f"{self.last_context or self.kata.name}\n  timed out after {session.timeout:g} s: look for a loop that "
                "never ends, or far more work than the kata needs (the process running it was killed)",
                Reason.TIMEOUT, "timed out (per-check limit)")
        return KataFailure(
            f"{self.last_context or self.kata.name}\n  the process running your function ended without answering "
            f"({_how(gone.how)}): look for os._exit, sys.exit in a thread, or a crash in native code",
            Reason.CRASH, f"the runner ended: {gone.how}")

    def call_learner(self, fn: str, inputs: dict, meter=None, rng=None, observe: tuple = ()):
        """The learner's function on fresh inputs in the runner, with its TODO, crash and guard outcomes sorted.
        The call starts from the global RNG state `rng` (Scenario.global_rng), or one of fresh entropy: never a
        state derived from the seed. The state it leaves is kept in `last_rng_after`; the grader's own global RNG
        goes on as if the call had not happened (its later draws do not depend on the learner's)."""
        sent = self.send_learner(fn, inputs, meter, rng, observe)
        return self.learner_reply(fn, sent, meter)

    def send_learner(self, fn: str, inputs: dict, meter=None, rng=None, observe: tuple = ()):
        """`call_learner`'s first half: the call sent, the runner working on it; the inputs as sent returned."""
        from diffusion_katas.engine.helpers import fresh_rng_state
        from diffusion_katas.engine.runner import RunnerGone

        if self.runner is None or self.runner.closed:
            raise KataFailure(f"{self.last_context}\n  (the runner for this check has ended)", Reason.CRASH)
        self.runner.timeout = max(0.1, self.deadline - time.monotonic())
        state_sent = rng if rng is not None else fresh_rng_state()
        self.last_rng_after, self.last_observed = None, {}
        try:
            return self.runner.send_call(fn, inputs, state_sent, meter, observe)
        except RunnerGone as gone:
            self._echo()
            raise self._gone(gone) from None

    def learner_reply(self, fn: str, sent, meter=None):
        """`call_learner`'s second half: the reply to the call `send_learner` sent, sorted."""
        from diffusion_katas.engine.runner import RemoteError, RunnerGone, decode

        try:
            data = self.runner.reply()
        except RunnerGone as gone:
            self._echo()
            raise self._gone(gone) from None
        self._echo()
        self.last_called = data.get("called") or []
        if self.runner.remote_failures:  # a remote model's own check of a call (caught there or not)
            first = self.runner.remote_failures[0]
            raise KataFailure(f"{self.last_context}\n{first}", first.reason, first.detail) from None
        kind = data.get("kind")
        self.last_generators = data.get("generators") or {}
        self.last_state_kept = data.get("state_kept") is True  # untrusted: only a literal True counts
        if kind == "ok":
            self.last_rng_after, self.last_observed = data.get("rng_after"), data.get("observed") or {}
            out = decode(data.get("output"))
            return out if meter is None else (data.get("measurement"), out)
        if kind == "missing_function":
            raise KataFailure(f"{self.last_context}\n  `{fn}` is gone from the kata file", Reason.MISSING_FUNCTION)
        if kind == "grader_error":  # the runner's own failure, before the learner's function ran: an error, no grade
            raise RuntimeError(f"{self.last_context}: {data.get('message')}")
        error = RemoteError(data)
        if data.get("kata_failure"):
            raise KataFailure(f"{self.last_context}\n{error.message}", Reason(data.get("reason") or "wrong"),
                              data.get("detail", "")) from None
        if data.get("answer_key"):
            raise KataFailure(f"{self.last_context}\n{error.message}", Reason.ANSWER_KEY) from None
        if error.is_a("NotImplementedError"):
            where = _todo_origin(error.frames, self.parent.source)
            if where is not None:
                raise KataTodo(self.kata.name, where) from None
        raise LearnerCrash(self.last_context, error, self._crash_trap(sent.inputs(), error))

    def _first_showing_trap(self, scenario, tol, rng, passed, error):
        """Where the learner's function crashed on sizes (a shape or size mismatch) after passing earlier cases, and
        no trap raises its error: the one declared mistake that changes the output's shape on this case and is
        right on every case the function passed (a scale factor hard-coded to 8 is right on every x8 VAE; on the
        first x4 one the learner's own buffers, sized for 8, cannot take the tiles). None where no trap, or more
        than one, fits so; never after a "fix X first" (the crash may be X's)."""
        if self.failing_dependencies() or not any(word in error.message.lower() for word in _SIZE_WORDS):
            return None
        try:
            fitting = []
            expected = _shapes(scenario.expected)
            for i, wrong in enumerate(self._trap_outputs(scenario, self.kata.traps, rng)):
                if wrong is _RAISED or _shapes(wrong) == expected:
                    continue  # it does not change the output's size here
                trap = self.kata.traps[i]
                if all(w is not _RAISED and _passes(w, before, before_tol)
                       for before, before_tol, before_rng, _ in passed
                       for w in self._trap_outputs(before, [trap], before_rng)):
                    fitting.append(trap)
                    if len(fitting) > 1:
                        return None
        except Exception:  # noqa: BLE001  (naming a mistake is advice: it never hides the verdict)
            return None
        return fitting[0] if fitting else None

    def _crash_trap(self, inputs: dict, error):
        """The first trap that, run on the same inputs, raises the same error (its type and message): the mistake
        that explains a crash (lab 21's Euler scheduler shared by two requests steps past its last σ)."""
        from diffusion_katas.engine.isolation import fresh

        for trap in self.kata.traps:
            try:
                trap.fn(**fresh(inputs))
            except Exception as exc:  # noqa: BLE001  (a trap's own error is what is compared)
                if type(exc).__name__ == error.type_name and str(exc) == error.message:
                    return trap
        return None

    def _built_while_opening(self, check: Check) -> tuple | None:
        """The check's first case, built while the runner imports the learner's file (two cores at work), where
        the file, read with ast, shows the function written: a TODO stub gets nothing built (lab 12's references
        cost seconds a case). The runner's answer still decides; this only saves the wait. (scenarios, the first
        built, its context); `last_context` is left as it was, for a failed import's message."""
        if self.kata.name not in self.parent.written_functions():
            return None
        context = self.last_context
        scenarios = self._scenarios(check)
        following = _Built.next_of(scenarios)
        built_context, self.last_context = self.last_context, context
        return scenarios, following, built_context

    def run_check(self, check: Check, fn, ahead: tuple | None = None) -> None:
        """Every case of `check` through the learner's function, against the reference (the first one perhaps
        built already: `_built_while_opening`)."""
        import torch

        from diffusion_katas.engine.comparison import scenario_mismatch

        runner = getattr(self, "runner", None)
        if runner is not None and fn in runner.open_reply.get("stubs", ()):
            # untouched (it only raises NotImplementedError, as the runner read its code): TODO, and nothing
            # is built for it (lab 12's references cost seconds a case)
            raise KataTodo(self.kata.name, "")
        if ahead is not None:
            scenarios, following, self.last_context = ahead
        else:
            scenarios = self._scenarios(check)
            following = _Built.next_of(scenarios)
        passed = []  # the scenarios the learner's function got right, for naming a mistake it makes later
        while following is not None:
            scenario, tol, rng = following.result()
            context = self.last_context
            sent = self.send_learner(fn, scenario.inputs, rng=rng, observe=scenario.observe)
            # The next case is built while the runner computes this one (two cores at work, not one after the
            # other), except where this call's remote models run here: their calls come in while the grader waits.
            # From here on this scenario's inputs are read as they were sent (`_AsSent`): a build may configure a
            # model it shares between cases. The next case's context is its own; this one's is restored.
            ahead = not sent.remote
            if ahead:
                following, following_context = _Built.next_of(scenarios), self.last_context
                self.last_context = context
            try:
                out = self.learner_reply(fn, sent)
            except LearnerCrash as crash:
                if crash.trap is None and passed:
                    crash.trap = self._first_showing_trap(_AsSent(scenario, sent), tol, rng, passed, crash.exc)
                    crash.first_shows_after = len(passed) if crash.trap is not None else 0
                if crash.trap is None and getattr(self, "last_state_kept", False) and not self.failing_dependencies():
                    crash.trap = STATE_KEPT
                raise
            scenario = _AsSent(scenario, sent)
            if scenario.verify is not None:
                own = torch.random.get_rng_state()
                # verify sees the global RNG as the call left it (where the reference drew from it)
                torch.random.set_rng_state(self.last_rng_after if self.last_rng_after is not None else rng)
                try:
                    if scenario.observe:
                        scenario.verify(out, self.last_observed)
                    else:
                        scenario.verify(out)
                except KataFailure as exc:
                    raise KataFailure(f"{self.last_context}\n{exc}", exc.reason, exc.detail) from None
                finally:
                    torch.random.set_rng_state(own)
            problem = scenario_mismatch(out, scenario, tol)
            if problem:
                later = self._then(following, following_context, scenarios) if ahead else scenarios
                raise KataFailure(self._failure(problem, scenario, out, tol, rng, fn, passed, later))
            self._check_generators(scenario)
            passed.append((scenario, tol, rng, self.last_context.splitlines()[0]))
            if ahead:
                self.last_context = following_context
            else:
                following = _Built.next_of(scenarios)

    def _then(self, following: "_Built | None", context: str, rest):
        """The scenarios after a failing one: the one built ahead (with its context), then the rest."""
        if following is not None:
            item = following.result()
            self.last_context = context
            yield item
        yield from rest

    def _scenarios(self, check: Check):
        """Every scenario of `check`, case by case: (scenario, its tolerance, the global RNG state the learner's
        call starts from, which traps replay: the scenario's, else fresh entropy). `last_context` follows along."""
        import torch

        from diffusion_katas.engine import builds
        from diffusion_katas.engine.helpers import fresh_rng_state, seed_global
        from diffusion_katas.core.tolerances import for_dtype, output_dtype

        session = self.config.stash[state.SESSION]
        seed = self.seed(check.name)
        # Models and adapters built inside a check draw from the global RNG; inputs from `g`. Distinct
        # seeds: a learner who forgets `generator=` must not redraw the grader's own inputs by luck.
        seed_global(seed ^ 0x5EED)
        g = torch.Generator().manual_seed(seed)
        total = len(check.cases)
        for number, case in enumerate(check.cases, 1):
            if session.reuse_builds:  # a warm process: the references of an unchanged case are kept
                built = builds.build(self.lab, check, number, case, g)
            else:
                built = check.build(case, g)
            for scenario in [built] if isinstance(built, Scenario) else list(built):
                self.last_context = self._context(check, number, total, case, scenario)
                rng = scenario.global_rng if scenario.global_rng is not None else fresh_rng_state()
                yield scenario, for_dtype(check.tol, output_dtype(scenario.expected)), rng

    def _generators_off(self, scenario: Scenario) -> list[str]:
        """The generators the learner's call left in another state than the reference leaves them (other draws)."""
        import torch

        off = []
        for name, reference in (scenario.generators_after or {}).items():
            mine = getattr(self, "last_generators", {}).get(name)
            theirs = [r.get_state() for r in reference] if isinstance(reference, list) else reference.get_state()
            if isinstance(theirs, list):  # a generator per sample: each must be left as diffusers leaves it
                same = isinstance(mine, list) and len(mine) == len(theirs) and all(map(torch.equal, mine, theirs))
            else:
                same = isinstance(mine, torch.Tensor) and torch.equal(mine, theirs)
            if not same:
                off.append(name)
        return off

    def _check_generators(self, scenario: Scenario) -> None:
        """The values are right: were the generators left as the reference leaves them (the same draws)?"""
        off = self._generators_off(scenario)
        if off:
            name = off[0]
            raise KataFailure(
                f"{self.last_context}\n  the values are right, but `{name}` was left in a different state than "
                "diffusers leaves it: your code drew a different amount of noise from it (more, fewer, or "
                "none where diffusers draws). In a pipeline that shares the generator, every later draw "
                "would then differ.", Reason.WRONG, f"`{name}` left in another state")

    def _context(self, check: Check, number: int, total: int, case: dict, scenario: Scenario) -> str:
        from diffusion_katas.engine.comparison import describe

        parts = [f"{self.kata.name} · check '{check.name}' · case {number}/{total}"]
        if case:
            parts.append("(" + ", ".join(f"{k}={v}" for k, v in case.items()) + ")")
        if scenario.label:
            parts.append(f"· {scenario.label}")
        inputs = ", ".join(f"{k}={describe(v)}" for k, v in scenario.inputs.items())
        return " ".join(parts) + f"\n  inputs: {inputs}"

    def _failure(self, problem: str, scenario: Scenario, out: Any, tol, rng=None, fn: str = "", before=(),
                 later=()) -> str:
        lines = [self.last_context, f"  {problem}"]
        also = [f"  also: `{name}` was left in a different state than diffusers leaves it: your code drew a different "
                "amount of noise from it (more, fewer, or none where diffusers draws), which alone changes every "
                "value drawn after it" for name in self._generators_off(scenario)]
        # wrong values AND other draws: the draws may be the cause (read before the trap's confirming calls)
        if scenario.on_mismatch is not None:
            session = self.config.stash[state.SESSION]
            try:
                also.append("  " + scenario.on_mismatch(out, session.root / ".kata" / "diffs"))
            except Exception as exc:  # an artefact or a diagnosis must never hide the verdict
                also.append(f"  (the extra diagnosis failed: {type(exc).__name__}: {exc})")
        try:
            named = self._explaining_trap(scenario, out, tol, rng, fn, before, later)
        except Exception:  # noqa: BLE001  (naming a mistake is advice: it never hides the verdict)
            named = None
        if named is None:
            try:
                generic = self._generic_trap(scenario, out, tol, lines[1])
            except Exception:  # noqa: BLE001  (naming a mistake is advice: it never hides the verdict)
                generic = None
            if generic is not None:
                from diffusion_katas.engine.comparison import PRECISION_NOTE

                name, hint = generic
                lines[1] = lines[1].replace(PRECISION_NOTE, "")  # the trap line says it, with its fix
                lines.append(f"  trap: {name}\n    {hint}")
        if named is not None:
            from diffusion_katas.engine.comparison import PRECISION_NOTE

            trap, near, missed = named
            lines[1] = lines[1].replace(PRECISION_NOTE, "")  # a formula mistake explains it, not rounding
            lines.append(f"  trap: {trap.name}\n    {trap.hint}")
            if near:
                lines.append(f"    (your output is a near variant of this mistake's: {near:.0%} of the way from its "
                             "output to the right answer)")
            if missed is not None:
                where, right = missed
                what = "right" if right else "wrong in another way"
                lines.append(f"    (it explains this case; on {where.split(' · ', 1)[-1]} your output is {what}, where "
                             "this mistake would show: look for it in what this case does differently)")
        return "\n".join(lines + also)

    def _trap_outputs(self, scenario: Scenario, traps, rng) -> list:
        """Each trap's output on the scenario's inputs (_RAISED where it raises), from the global RNG state the
        learner's call started from (a trap without `generator=` draws what the learner drew)."""
        import torch

        from diffusion_katas.engine.isolation import fresh

        outputs = []
        own = torch.random.get_rng_state()
        for trap in traps:
            if rng is not None:
                torch.random.set_rng_state(rng)
            try:
                outputs.append(trap.fn(**fresh(scenario.inputs)))
            except Exception:  # noqa: BLE001  (a trap that cannot run here explains nothing)
                outputs.append(_RAISED)
            finally:
                torch.random.set_rng_state(own)
        return outputs

    @staticmethod
    def _explains(out, wrong, scenario: Scenario, tol) -> float | None:
        """How well a trap's output `wrong` explains the learner's wrong `out`: 0.0 within tolerance, else its
        closeness (comparison.closeness) where at most TRAP_NEAR; None where it does not explain it, or where the
        trap's output is itself right (a trap that does not show on these inputs names nothing)."""
        from diffusion_katas.core.tolerances import TRAP_NEAR
        from diffusion_katas.engine.comparison import closeness, matches

        expected = scenario.expected
        if wrong is _RAISED or _passes(wrong, scenario, tol):
            return None
        if matches(out, wrong, tol):
            return 0.0
        near = closeness(out, wrong, expected)
        return near if near <= TRAP_NEAR else None

    def _generic_trap(self, scenario: Scenario, out, tol, problem: str) -> tuple[str, str] | None:
        """The mistakes any kata can make, named where no declared trap explains the output (and no earlier function
        fails), first that fits: right values in another dtype; state kept between calls; right values at other
        indices, with a size-1 axis dropped or added, or in another order; an error of rounding's size. (name, hint)."""
        from diffusion_katas.engine.comparison import PRECISION_NOTE

        if self.failing_dependencies():
            return None
        finders = (lambda: self._dtype_trap(scenario, out, tol),
                   lambda: (STATE_KEPT.name, STATE_KEPT.hint) if getattr(self, "last_state_kept", False) else None,
                   lambda: self._layout_trap(scenario, out, tol),
                   lambda: PRECISION_TRAP if PRECISION_NOTE in problem else None)
        for find in finders:
            try:
                found = find()
            except Exception:  # noqa: BLE001  (one finder's trouble never stops the next)
                found = None
            if found is not None:
                return found
        return None

    def _dtype_trap_in_sequence(self, scenario: Scenario, out, tol) -> tuple[str, str] | None:
        """`_dtype_trap` for a tuple or list output: its first tensor in another dtype, where the whole output is right
        once that tensor is cast (floats computed wider and never cast back; integers returned as floats, or the
        other way)."""
        import torch

        from diffusion_katas.engine.comparison import scenario_mismatch

        for i, (mine, theirs) in enumerate(zip(out, scenario.expected)):
            if not (type(mine) is torch.Tensor and type(theirs) is torch.Tensor and mine.dtype != theirs.dtype):
                continue
            if mine.shape != theirs.shape or (mine.is_floating_point() and theirs.is_floating_point()
                                              and torch.finfo(mine.dtype).eps >= torch.finfo(theirs.dtype).eps):
                return None
            if not _casts_exactly(mine, theirs):
                return None
            cast = list(out)
            cast[i] = mine.to(theirs.dtype)
            if scenario_mismatch(type(out)(cast), scenario, tol):
                return None
            wide, narrow = str(mine.dtype).removeprefix("torch."), str(theirs.dtype).removeprefix("torch.")
            if mine.is_floating_point() and theirs.is_floating_point():
                return (f"output[{i}] computed in {wide} and never cast back to {narrow}",
                        f"Its values are right once cast: compute as wide as you like, then cast output[{i}] to "
                        f"{narrow} once, where the reference casts.")
            return _retyped(f"output[{i}]", wide, narrow)
        return None

    def _dtype_trap(self, scenario: Scenario, out, tol) -> tuple[str, str] | None:
        """The mistake any kata can make where a tensor comes back in the wrong floating dtype with the right values:
        computed wider and never cast back (right once cast), or left in a half dtype where the reference returns a
        wider one (right to the half dtype's precision). (name, hint), or None."""
        import torch

        from diffusion_katas.engine.comparison import scenario_mismatch

        expected = scenario.expected
        if type(out) in (tuple, list) and type(expected) is type(out) and len(out) == len(expected):
            return self._dtype_trap_in_sequence(scenario, out, tol)
        if type(out) is not torch.Tensor or type(expected) is not torch.Tensor:
            return None
        if out.shape != expected.shape or out.dtype == expected.dtype:
            return None
        mine, theirs = str(out.dtype).removeprefix("torch."), str(expected.dtype).removeprefix("torch.")
        if not (out.is_floating_point() and expected.is_floating_point()):
            if not _casts_exactly(out, expected) or scenario_mismatch(out.to(expected.dtype), scenario, tol):
                return None
            return _retyped("output", mine, theirs)
        if torch.finfo(out.dtype).eps < torch.finfo(expected.dtype).eps:
            if scenario_mismatch(out.to(expected.dtype), scenario, tol):
                return None
            return (f"computed in {mine} and never cast back to {theirs}",
                    f"Your values are right once cast: compute as wide as you like, then cast the result to {theirs} "
                    "once, where the reference casts (the caller's tensors stay in their dtype).")
        eps = torch.finfo(out.dtype).eps
        e, a = expected.double(), out.double()
        if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
            return None
        if ((a - e).abs() > 4 * eps * e.abs() + 4 * eps * e.abs().max().clamp_min(1e-30)).any():
            return None
        return (f"the result left in {mine} where diffusers returns {theirs}",
                f"Your values are right to {mine}'s precision: the reference computes (or upcasts to) {theirs}. "
                f"Convert to {theirs} before the arithmetic, as the docstring says, and return that.")

    def _layout_trap(self, scenario: Scenario, out, tol) -> tuple[str, str] | None:
        """The mistake any kata can make where a tensor has the reference's shape, dtype and values, each at
        another index: axes reshaped where they needed a permute, transposed, or reversed. Judged on the first
        tensor (of the output, or of a tuple/list output) that is wrong: its sorted values match the reference's
        sorted values within the tolerance. Needs 4 or more distinct values (on a mask, the same values at other
        indices says nothing). (name, hint), or None."""
        import torch

        from diffusion_katas.engine.comparison import mismatch

        expected = scenario.expected
        pairs = [("output", out, expected)]
        if type(out) in (tuple, list) and type(expected) is type(out) and len(out) == len(expected):
            pairs = [(f"output[{i}]", a, e) for i, (a, e) in enumerate(zip(out, expected))]
        if _numbers(out) and _numbers(expected) and len(out) == len(expected) and type(out) is type(expected) \
                and list(out) != list(expected) and sorted(out) == sorted(expected) and len(set(expected)) > 1:
            return (f"the right values in another order (output: {list(out)}, expected {list(expected)})",
                    "Every value is right, each in another place: check the order the docstring gives "
                    "(diffusers' layouts put channels before frames and spatial sizes: (B, C, F, H, W)).")
        for where, mine, theirs in pairs:
            if not (type(mine) is torch.Tensor and type(theirs) is torch.Tensor):
                continue
            if mismatch(mine, theirs, tol) is None:
                continue
            axis = _size_one_axis(mine, theirs)
            if axis is not None and mismatch(mine.reshape(theirs.shape), theirs, tol) is None:
                return axis[0].format(where=where), axis[1]
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype or theirs.numel() < 4 \
                    or theirs.is_complex() or theirs.unique().numel() < 4:
                return None
            if mismatch(mine.flatten().sort().values, theirs.flatten().sort().values, tol) is not None:
                return None
            how = "they were moved (a reshape where the axes needed a permute, another order, a roll)"
            for d in range(theirs.dim()):
                if theirs.shape[d] > 1 and mismatch(mine, theirs.flip(d), tol) is None:
                    how = f"{where} is the reference reversed along dimension {d}"
            for i in range(theirs.dim()):
                for j in range(i + 1, theirs.dim()):
                    if theirs.shape[i] == theirs.shape[j] > 1 and mismatch(mine, theirs.transpose(i, j), tol) is None:
                        how = f"{where} is the reference with dimensions {i} and {j} swapped"
            return (f"the right values at the wrong indices ({where}: a layout mistake)",
                    f"Every value is right, each in another place: {how}. A reshape or view regroups elements in "
                    "memory order; to move an axis, permute (or transpose, movedim) it first. Check the order of "
                    "the dimensions against the docstring's shapes.")
        return None

    def _explaining_trap(self, scenario: Scenario, out, tol, rng, fn: str, before, later):
        """The declared mistake that explains the learner's output, as (trap, closeness, first scenario where it
        does not), or None.

        A trap explains a scenario's output where it matches it within tolerance, or the output is a near variant
        of it (core.tolerances.TRAP_NEAR). The candidates are then tried on the scenarios the learner got
        right before (a mistake that shows there is not the learner's) and on the check's next TRAP_CONFIRM
        scenarios, the learner's function called on each: a candidate holds on a scenario where it explains the
        learner's output there, or where both are right. One that the learner's wrong outputs contradict as
        often as they agree with it is dropped; of the rest, the one contradicted least is named, the nearest
        among equals; where two explain every scenario tried alike (the same outputs), neither is: naming one
        would be a guess. A named trap that did not hold somewhere says where: the mistake may be in one
        branch of the learner's code, or another mistake that coincides with it on this case.
        After a failing function the learner's code calls ("fix X first"), nothing is named: the output is X's."""
        from diffusion_katas.core.tolerances import TRAP_CONFIRM
        from diffusion_katas.engine.comparison import distance, has_finite, scenario_mismatch

        if self.failing_dependencies():
            return None
        finite = has_finite(out)
        traps = [t for t in self.kata.traps if finite or t.nonfinite]
        wrongs = self._trap_outputs(scenario, traps, rng)
        scores = {i: self._explains(out, w, scenario, tol) for i, w in enumerate(wrongs)}
        alive = [i for i, sc in scores.items() if sc is not None]
        if not alive:
            return None
        seen = [{i: wrongs[i] for i in alive}]  # the candidates' outputs on every scenario tried
        worst = {i: scores[i] for i in alive}  # a candidate's largest closeness where it explained the output
        missed = {i: [] for i in alive}  # the scenarios where it did not hold: (context line, learner right there)
        explained = {i: 1 for i in alive}  # the learner's wrong outputs it explains
        for earlier, earlier_tol, earlier_rng, where in before:  # the learner was right there
            theirs = dict(zip(alive, self._trap_outputs(earlier, [traps[i] for i in alive], earlier_rng)))
            for i, w in theirs.items():
                if w is _RAISED or not _passes(w, earlier, earlier_tol):
                    missed[i].append((where, True))
            seen.append(theirs)
        saved = (self.last_context, getattr(self, "last_called", []), getattr(self, "last_generators", {}),
                 self.last_rng_after, self.last_observed)
        try:
            for _, (other, other_tol, other_rng) in zip(range(TRAP_CONFIRM), later):
                try:
                    mine = self.call_learner(fn, other.inputs, rng=other_rng, observe=other.observe)
                except Exception:  # noqa: BLE001  (a crash or timeout further on: judged on what was seen)
                    break
                theirs = dict(zip(alive, self._trap_outputs(other, [traps[i] for i in alive], other_rng)))
                right = scenario_mismatch(mine, other, other_tol) is None
                for i, w in theirs.items():
                    if right:  # the learner is right here: the mistake holds if it does not show here either
                        holds = w is not _RAISED and _passes(w, other, other_tol)
                    else:
                        sc = self._explains(mine, w, other, other_tol)
                        holds = sc is not None
                        worst[i] = max(worst[i], sc) if holds else worst[i]
                        explained[i] += holds
                    if not holds:
                        missed[i].append((self.last_context.splitlines()[0], right))
                seen.append(theirs)
        finally:
            (self.last_context, self.last_called, self.last_generators, self.last_rng_after,
             self.last_observed) = saved
        # A candidate the learner's wrong outputs contradict as often as they agree with it is not theirs (a
        # hard-coded 16 where this case's factor happens to be 16); one contradicted only where the learner is
        # right may be a mistake in one branch of their code, and is named, saying where.
        alive = [i for i in alive if sum(not right for _, right in missed[i]) < explained[i]]
        if not alive:
            return None
        alive.sort(key=lambda i: (sum(not right for _, right in missed[i]), len(missed[i]), worst[i],
                                  distance(out, wrongs[i]), i))
        tied = [i for i in alive if missed[i] == missed[alive[0]] and worst[i] == worst[alive[0]]
                and all(distance(outputs[alive[0]], outputs[i]) == 0 for outputs in seen)]
        if len(tied) > 1:  # one output, several names: the function's other checks it passed may tell them apart
            shows = self._shows_where_passed([traps[i] for i in tied])
            tied = [i for i, show in zip(tied, shows) if not show]
            if len(tied) != 1:
                return None  # a guess either way
            alive = tied
        best = alive[0]
        return traps[best], worst[best], (missed[best][0] if missed[best] else None)

    def _shows_where_passed(self, traps) -> list[bool]:
        """For each trap, whether its mistake shows in another check of this function that the learner's code
        passed in this run (so it is not the learner's mistake). Those checks' scenarios are rebuilt as graded."""
        import torch

        session = self.config.stash[state.SESSION]
        passed = {r.check for r in session.results if r.lab == self.lab and r.function == self.kata.name
                  and r.status == Status.PASSED and not r.hidden}
        shows = [False] * len(traps)
        own, context = torch.random.get_rng_state(), self.last_context
        try:
            for check in self.kata.checks:
                if check is self.check or check.name not in passed:
                    continue
                for scenario, tol, rng in self._scenarios(check):
                    for i, w in enumerate(self._trap_outputs(scenario, traps, rng)):
                        shows[i] = shows[i] or w is _RAISED or not _passes(w, scenario, tol)
        except Exception:  # noqa: BLE001  (evidence only: a check that cannot be rebuilt here tells nothing)
            pass
        finally:
            torch.random.set_rng_state(own)
            self.last_context = context
        return shows

    def failing_dependencies(self) -> list[str]:
        """Other kata functions the learner's call ran that have already failed their own checks in this run
        (merge_lora calling a wrong lora_delta), or, where this run did not grade them, when their lab was last
        graded with its files as they are (lab 12 calling lab 07's prepare_latents): the failure is probably
        theirs."""
        session = self.config.stash[state.SESSION]
        called = {(Path(file).stem, name) for file, name in getattr(self, "last_called", ())
                  if name != self.kata.name or Path(file) != self.parent.source}
        failed, graded = [], set()

        def name(lab: str, function: str) -> str:
            return function if lab == self.lab else f"{lab}.py::{function}"

        for r in session.results:
            if r.hidden:
                continue
            graded.add((r.lab, r.function))
            if (r.lab, r.function) in called and r.status == Status.FAILED and name(r.lab, r.function) not in failed:
                failed.append(name(r.lab, r.function))
        ungraded = called - graded - {(self.lab, self.kata.name)}
        if ungraded:
            failed += sorted(name(*key) for key in ungraded & session.recorded_failures())
        return failed

    def failing_dependencies_note(self) -> list[str]:
        names = self.failing_dependencies()
        if not names:
            return []
        listed = ", ".join(f"`{n}`" for n in names)
        first = names[0]
        return [f"fix {listed} first: `{self.kata.name}` calls {listed}, which already fail(s) its own checks (above, "
                "or when its lab was last graded), "
                f"so this failure is probably {'its' if len(names) == 1 else 'theirs'}; re-grade after fixing "
                f"`{first}`."]

    def repr_failure(self, excinfo, style=None):
        from diffusion_katas.pytest_plugin import reporting

        return reporting.failure_text(self, excinfo)

    def reportinfo(self):
        return self.path, 0, f"{self.lab}::{self.name}"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Tell a check which item runs after it (its runner may be opened ahead: KataItem._open_next)."""
    if isinstance(item, KataItem):
        item.next_item = nextitem


class BudgetItem(KataItem):
    """A cost budget of one kata function: judged only once the function passes all its checks."""

    def __init__(self, *, budget: Budget, **kwargs):
        super().__init__(check=budget.kata.checks[0], **kwargs)
        self.budget = budget

    @property
    def check_name(self) -> str:
        return f"budget: {self.budget.name}"

    def runtest(self) -> None:
        if self.parent.untouched():
            raise KataTodo(self.kata.name, "")
        try:
            self._judge()
        finally:
            self.close_runner()

    def _judge(self) -> None:
        fn = None
        verdict = self._verdict_from_this_run()
        if verdict is None:  # its checks were not all graded in this run (-m budget, -k ...): run them once
            session = self.config.stash[state.SESSION]
            key = (self.lab, self.kata.name)
            if key not in session.gates:
                fn = self.learner_function()
                session.gates[key] = self._run_checks(fn)
            verdict = session.gates[key]
        if verdict[0] == "file":  # the file itself is missing or broken: the same verdict, not a wait
            raise KataFailure(verdict[1], verdict[2], verdict[3])
        if verdict[0] == "todo":
            raise KataTodo(self.kata.name, verdict[1])
        if verdict[0] == "failed":
            raise BudgetWaits(self.kata.name, self.budget.name, verdict[1], verdict[2])
        if fn is None:
            fn = self.learner_function()
        self.last_context = f"{self.kata.name} · budget '{self.budget.name}'"

        import torch

        from diffusion_katas.engine.helpers import seed_global

        seed = self.seed(f"budget:{self.budget.name}")
        seed_global(seed)
        measurements = self.budget.measure(Learner(self, fn), torch.Generator().manual_seed(seed))
        self.measurements = measurements
        if any(m.over for m in measurements):
            raise OverBudget(self.last_context)


    def _verdict_from_this_run(self) -> tuple | None:
        """Whether the function passes its checks, from this run's results when every check ran (None when
        some did not): a budget never re-runs a failing check, nor pays its time-out again."""
        session = self.config.stash[state.SESSION]
        mine = [r for r in session.results if r.lab == self.lab and r.function == self.kata.name
                and not r.hidden and not r.check.startswith("budget: ")]
        bad = next((r for r in mine if r.status not in (Status.PASSED, Status.SKIPPED)), None)
        if bad is not None:
            if bad.reason in (Reason.IMPORT_ERROR, Reason.MISSING_FILE, Reason.MISSING_FUNCTION):
                return ("file", bad.detail or bad.message.splitlines()[0], bad.reason, bad.detail)
            if bad.status == Status.TODO:
                return ("todo", bad.detail if bad.reason == Reason.WAITS_ON else "")
            return ("failed", bad.check, True)
        passed = {r.check for r in mine}
        return ("ok",) if all(c.name in passed for c in self.kata.checks) else None

    def _run_checks(self, fn) -> tuple:
        """The function's checks, run here once for all its budgets (they were not part of this run)."""
        for check in self.kata.checks:
            try:
                self.run_check(check, fn)
            except KataTodo as todo:
                return ("todo", todo.waits_on)
            except (KataFailure, LearnerCrash):
                return ("failed", check.name, False)
        return ("ok",)


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


_RAISED = object()  # a trap's output where it raised: it explains nothing


def _passes(output, scenario, tol) -> bool:
    """Whether a trap's output would pass this scenario as the learner's would (the float64 shadow included): a
    mistake that does not show here is judged by the same rule as an answer."""
    from diffusion_katas.engine.comparison import scenario_mismatch

    try:
        return scenario_mismatch(output, scenario, tol) is None
    except Exception:  # noqa: BLE001  (a trap's odd output must never break grading)
        return False


def _stub_body(body: list) -> bool:
    """A function body that is a TODO stub: an optional docstring, then `raise NotImplementedError` (called or not)."""
    import ast

    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    if len(body) != 1 or not isinstance(body[0], ast.Raise):
        return False
    exc = body[0].exc
    if isinstance(exc, ast.Call):
        exc = exc.func
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


class _Built:
    """The next scenario of a check, or the error its build raised: raised in its turn, after the scenario
    before it is judged, as building one case after the other would."""

    def __init__(self, item=None, error: BaseException | None = None):
        self.item, self.error = item, error

    @classmethod
    def next_of(cls, scenarios) -> "_Built | None":
        try:
            return cls(next(scenarios))
        except StopIteration:
            return None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001  (a grader's error, a skip: kept for its turn)
            return cls(error=exc)

    def result(self):
        if self.error is not None:
            raise self.error
        return self.item


# What a crash about sizes says (torch's shape and size errors, numpy's broadcasting ones).
_SIZE_WORDS = ("size", "shape", "dimension", "broadcast")


def _shapes(value):
    """The structure of an output as shapes: a tensor's shape, a sequence's items' (None for anything else)."""
    if hasattr(value, "shape") and not isinstance(value, type):
        return tuple(value.shape)
    if isinstance(value, (tuple, list)):
        return tuple(_shapes(v) for v in value)
    return None


class _AsSent:
    """A scenario whose inputs are read back as they were sent to the runner (a copy, made when first read): a
    later case's build may have configured a model the cases share (lab 11's VAE tiling) since."""

    def __init__(self, scenario: Scenario, sent):
        self._scenario, self._sent, self._inputs = scenario, sent, None

    def __getattr__(self, name):
        return getattr(self._scenario, name)

    @property
    def inputs(self) -> dict:
        if self._inputs is None:
            self._inputs = self._sent.inputs()
        return self._inputs


def _how(how: str) -> str:
    """'signal 11' -> 'killed by signal 11 (SIGSEGV)'; 'exit 0' -> 'it exited with status 0'."""
    import signal as signals

    kind, _, number = how.partition(" ")
    if kind == "signal" and number.isdigit():
        try:
            return f"killed by signal {number} ({signals.Signals(int(number)).name})"
        except ValueError:
            return f"killed by signal {number}"
    if kind == "exit":
        return f"it exited with status {number}"
    return how


def _todo_origin(frames, source: Path) -> str | None:
    """Where a NotImplementedError comes from: "" for the learner's own file (its TODO stub),
    "lab.py::function" for another kata file beside it, None for anywhere else (a real crash).
    `frames` are (file, line, function, text), innermost last."""
    if not frames:
        return None
    filename, _line, function, _text = frames[-1]
    last = Path(filename)
    if last == source:
        return ""
    if last.parent == source.parent and last.name[:2].isdigit():
        return f"{last.name}::{function}"
    return None


def missing_lab_items(session: pytest.Session, items: list) -> list:
    """Items for every graded lab whose kata file is missing from a kata folder this run collects: it is
    graded as missing (0 of its points), never silently dropped."""
    kata_session = session.config.stash[state.SESSION]
    folder = kata_session.solutions_dir if kata_session.grade_solutions else kata_session.kata_dir
    args = [Path(str(a).split("::")[0]).resolve() for a in session.config.args] or [session.config.rootpath]
    if not any(a == kata_session.kata_dir or a in kata_session.kata_dir.parents for a in args):
        return []
    present = {getattr(i, "lab", None) for i in items}
    added = []
    for lab in session.config.getini("kata_labs") or kata_session.course.graded_labs():
        if lab in present or (folder / f"{lab}.py").is_file():
            continue
        node = KataFile.from_parent(session, path=kata_session.kata_dir / f"{lab}.py")
        added.extend(node.collect())
    return added


def _casts_exactly(mine, theirs) -> bool:
    """Whether `mine` holds the same numbers once cast to `theirs`' dtype, where one of the two is not floating
    (integer timesteps returned as floats, or the other way): no rounding, no truncation."""
    import torch

    if mine.is_floating_point() and theirs.is_floating_point():
        return True
    if mine.is_complex() or theirs.is_complex():
        return False
    if mine.is_floating_point() and not bool(torch.isfinite(mine).all()):
        return False
    return bool((mine.double() == mine.to(theirs.dtype).double()).all())


def _retyped(where: str, mine: str, theirs: str) -> tuple[str, str]:
    """The trap for right numbers in another kind of dtype (an integer dtype for a floating one, or the other way)."""
    return (f"{where} holds the right numbers as {mine} where the reference returns {theirs}",
            f"Keep the dtype the reference returns ({theirs}): build the tensor from the inputs' own tensors "
            "(torch.stack and torch.cat keep their dtype; torch.tensor of Python numbers picks its own), or pass "
            f"dtype=torch.{theirs}.")


def _numbers(value) -> bool:
    """A tuple or list of plain Python numbers (a shape, a schedule of ints)."""
    return type(value) in (tuple, list) and len(value) > 1 and all(
        type(v) in (int, float) for v in value)


def _size_one_axis(mine, theirs) -> tuple[str, str] | None:
    """(name, hint) where `mine` is `theirs`' shape with one size-1 axis dropped, or one added; else None."""
    got, want = tuple(mine.shape), tuple(theirs.shape)
    if len(got) + 1 == len(want) and any(want[:i] + want[i + 1:] == got for i in range(len(want)) if want[i] == 1):
        i = next(i for i in range(len(want)) if want[i] == 1 and want[:i] + want[i + 1:] == got)
        return ("{where}: the right values with the size-1 axis " + str(i) + " dropped",
                f"The reference keeps it: shape {want}, not {got}. x[i] drops an axis where x[i:i + 1] keeps it; so "
                "do squeeze() and a reduction without keepdim=True.")
    if len(got) == len(want) + 1 and any(got[:i] + got[i + 1:] == want for i in range(len(got)) if got[i] == 1):
        i = next(i for i in range(len(got)) if got[i] == 1 and got[:i] + got[i + 1:] == want)
        return ("{where}: the right values with an extra size-1 axis " + str(i),
                f"The reference has shape {want}, not {got}: an unsqueeze, x[None] or keepdim=True too many "
                "(or a slice x[i:i + 1] where x[i] was meant).")
    return None


class _StateKept:
    """The mistake any kata can make where the learner's function changed what it keeps between calls (a mutable
    default argument, a module-level dict or list) in the call that failed: named where no declared trap is."""

    name = "state kept between calls (a mutable default argument, or a module-level dict or list, changed by the call)"
    hint = ("Your function changed something that outlives the call, and the next call starts from it: `def f(cache={})` "
            "creates that dict once, when the file is loaded, not on every call. Create it inside the function "
            "(cache = {} if cache is None else cache), or pass it in and out as the docstring says.")


STATE_KEPT = _StateKept()

# Named where the only fault is an error of rounding's size (comparison.PRECISION_NOTE said so) and no trap explains it.
PRECISION_TRAP = ("a precision mistake: the right formula, rounded more than diffusers rounds",
                  "Your error is of rounding's size. Compute in the dtype diffusers computes in (float32 coefficients, the "
                  "float16 tensor left as it is; float64 where it builds a table in float64) and cast once, at the end, "
                  "if at all: a coefficient cast to the tensor's half dtype before a square root, or a step done in "
                  "float16 where diffusers upcasts, is the usual cause.")
