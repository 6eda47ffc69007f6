"""What a lab's mutant table declares for a mutant that matches no trap (see test_mutants.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fails:
    """What a mutant that matches no trap must fail with: a reason code (results.Reason value) and text the
    message must contain. A mutant that dies of its own typo crashes instead, and no longer counts as caught."""

    reason: str
    text: str = ""

    def __str__(self) -> str:
        return f"fails: {self.reason}" + (f" ({self.text})" if self.text else "")
