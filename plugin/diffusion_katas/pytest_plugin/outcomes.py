"""How a kata item can end besides passing or failing a comparison: written by collection, read by reporting."""
from __future__ import annotations


class KataTodo(Exception):
    """The learner's function still raises NotImplementedError: not attempted yet.

    `waits_on` names the earlier kata function it builds on that is still TODO, if that is where the
    NotImplementedError came from (lab 12 is built from the learner's own labs 04, 06 and 07)."""

    def __init__(self, name: str, waits_on: str = ""):
        super().__init__(name)
        self.waits_on = waits_on


class LearnerCrash(Exception):
    """The learner's function raised: `exc` is the runner's report of it (a RemoteError)."""

    def __init__(self, context: str, exc: BaseException, trap=None):
        super().__init__(context)
        self.context = context
        self.exc = exc
        self.trap = trap  # a declared mistake that raises the same error on the same inputs: it explains the crash
        # or, where none does, the one declared mistake that is right on every case the function passed and first
        # shows on the case it crashed on: how many cases it passed
        self.first_shows_after = 0


class BudgetWaits(Exception):
    """A budget of a function that does not pass its checks yet: judged once it does. `check` is the check it
    waits on, `ran_here` whether that check's failure is reported in this run (above)."""

    def __init__(self, function: str, budget: str, check: str, ran_here: bool):
        super().__init__(f"{function} · budget '{budget}' waits on check '{check}'")
        self.function, self.budget, self.check, self.ran_here = function, budget, check, ran_here
