"""Hint tiers: one record of what the learner has seen, for pytest's failure messages and `kata hint` alike.

`.kata/hints.json` under the course root: {"lab::function": {"shown": tiers shown so far, "failures": the
function's failed gradings (core/record.py) when the last of them was shown}}. Tier 1 is free; each failed
grading of the function earns one more tier than was shown before it, revealed by whichever comes first (the
failure message of that grading, or `kata hint` after it). Tiers once shown stay shown: passing and failing
again never takes a hint back. A grading that is only over budget is correct and earns nothing.

Standard library only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def load(path: Path) -> dict[str, dict]:
    """The record, {} when there is none; entries of the earlier format (a bare tier count) read as shown."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    out = {}
    for key, value in data.items():
        if isinstance(value, int):
            out[key] = {"shown": value, "failures": None}
        elif isinstance(value, dict) and isinstance(value.get("shown"), int):
            failures = value.get("failures")
            out[key] = {"shown": value["shown"], "failures": failures if isinstance(failures, int) else None}
    return out


def save(path: Path, record: dict[str, dict]) -> None:
    """Write the record all at once (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def shown(record: dict[str, dict], key: str, available: int) -> int:
    return min(available, record.get(key, {}).get("shown", 0))


def on_failure(record: dict[str, dict], key: str, available: int) -> int:
    """The tiers a failed grading shows: one more than were shown before it (at least the first)."""
    return min(available, shown(record, key, available) + 1)


def note_shown(record: dict[str, dict], key: str, tier: int, failures: int) -> None:
    """Remember that `tier` tiers have been shown, after `failures` failed gradings of the function."""
    mine = record.get(key, {"shown": 0, "failures": None})
    if tier > mine["shown"] or mine["failures"] is None:
        record[key] = {"shown": max(tier, mine["shown"]), "failures": failures}
