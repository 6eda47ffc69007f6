"""A pytest process kept warm between gradings (`kata watch`): torch, diffusers, the graders and the
runners' warm parent stay loaded, so a save is graded in about a second instead of paying every import
again.

    python -m diffusion_katas.commands.warm     # reads one JSON list of pytest arguments per line

For each request it runs pytest.main with those arguments (its output goes to stdout as usual) and then
prints a line `\\x00done EXIT_CODE`. Learner code never runs here: pytest grades through the runners.
"""
from __future__ import annotations

import json
import sys

DONE = "\x00done"


def main() -> int:
    import pytest

    # what a first grading imports anyway: import it now, while the learner is still typing (the plugin
    # itself loads through its entry point, on the first pytest.main)
    import torch  # noqa: F401

    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        args = json.loads(line)
        try:
            code = int(pytest.main(args))
        except SystemExit as exc:  # a usage error
            code = exc.code if isinstance(exc.code, int) else 4
        except Exception as exc:  # noqa: BLE001  (the warm process must outlive one broken grading)
            print(f"the warm grader failed: {type(exc).__name__}: {exc}", flush=True)
            code = 3
        sys.stdout.flush()
        sys.stderr.flush()
        print(f"{DONE} {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
