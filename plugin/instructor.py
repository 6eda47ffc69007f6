"""Instructor commands of `kata`: class, gradescope-bundle, classroom."""
from __future__ import annotations


def add_commands(commands) -> None:
    """Add the instructor subcommands to the `kata` parser."""
