"""The diffusion-katas pytest plugin: options, markers and session set-up.

Collection lives in plugin/collection.py, comparison in plugin/comparison.py, reporting in
plugin/reporting.py; this module wires them in.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from plugin import state
from plugin.collection import pytest_collect_file  # noqa: F401  (hook)
from plugin.reporting import (  # noqa: F401  (hooks)
    pytest_report_header,
    pytest_report_teststatus,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# Help texts, defined once and shared by the command-line option and its ini twin.
SOLUTIONS_HELP = "Grade solutions/ instead of katas/ with the same graders (instructors' check)"
SEED_HELP = "Seed for the graders' random inputs; a failure prints the seed that reproduces it"
HINTS_HELP = ("Hint tiers to show with a failure (0-3); default: one more tier each time the same "
              "function fails again")
JSON_HELP = "Write every graded item, the seed and the torch/diffusers versions as JSON to PATH"
TIMEOUT_HELP = "Seconds one kata check may run before it fails as timed out (pytest-timeout)"
KATA_DIR_HELP = "Folder of the learner's kata files, relative to the rootdir"
SOLUTIONS_DIR_HELP = "Folder of the solved kata files, relative to the rootdir"
GRADERS_DIR_HELP = "Folder of the graders, one per kata file and named like it, relative to the rootdir"

MARKERS = (
    "cuda: the test needs a CUDA GPU; it is skipped with the reason 'CUDA not available' elsewhere. "
    "Example: @pytest.mark.cuda",
    "budget: a cost budget (peak bytes, FLOPs, calls; time and memory on a GPU) of a kata function, "
    "judged once the function is correct. Select with -m budget",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("katas", "diffusion katas grading")
    group.addoption("--solutions", action="store_true", default=False, help=SOLUTIONS_HELP)
    group.addoption("--kata-seed", type=int, default=None, metavar="N", help=SEED_HELP)
    group.addoption("--kata-hints", type=int, default=None, metavar="N", help=HINTS_HELP)
    group.addoption("--kata-timeout", type=float, default=None, metavar="SECONDS", help=TIMEOUT_HELP)
    group.addoption("--kata-json", default=None, metavar="PATH", help=JSON_HELP)
    parser.addini("kata_timeout", TIMEOUT_HELP, default="120")
    parser.addini("kata_dir", KATA_DIR_HELP, default="katas")
    parser.addini("kata_solutions_dir", SOLUTIONS_DIR_HELP, default="solutions")
    parser.addini("kata_graders_dir", GRADERS_DIR_HELP, default="plugin/graders")


def pytest_configure(config: pytest.Config) -> None:
    """Register our markers and set up the grading session in the stash."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    root = config.rootpath
    seed = config.getoption("kata_seed")
    timeout = config.getoption("kata_timeout")
    if timeout is None:
        try:
            timeout = float(config.getini("kata_timeout"))
        except ValueError:
            raise pytest.UsageError(f"kata_timeout must be a number of seconds, "
                                    f"got {config.getini('kata_timeout')!r} from the config file")
    hints = config.getoption("kata_hints")
    if hints is not None and not 0 <= hints <= 3:
        raise pytest.UsageError(f"--kata-hints takes 0 to 3, got {hints} from the command line")
    session = state.KataSession(
        root=root,
        kata_dir=(root / config.getini("kata_dir")).resolve(),
        solutions_dir=(root / config.getini("kata_solutions_dir")).resolve(),
        graders_dir=(root / config.getini("kata_graders_dir")).resolve(),
        grade_solutions=config.getoption("solutions"),
        seed=seed if seed is not None else random.SystemRandom().randrange(1, 10**6),
        seed_given=seed is not None,
        hint_tiers=hints,
        timeout=timeout,
        json_path=Path(config.getoption("kata_json")).resolve() if config.getoption("kata_json") else None,
    )
    if getattr(config, "cache", None) is not None:  # absent under -p no:cacheprovider
        session.failures = dict(config.cache.get("katas/failures", {}))
    config.stash[state.SESSION] = session
    config.stash[state.GRADERS] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda` tests where CUDA is not available; keep kata runs to one CPU thread."""
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="CUDA not available")
            for item in items:
                if item.get_closest_marker("cuda"):
                    item.add_marker(skip)
    from plugin.collection import KataItem

    if any(isinstance(item, KataItem) for item in items):
        import torch

        # Tiny forwards on a loaded 2-core machine ran 10-100x slower with two threads.
        torch.set_num_threads(int(os.environ.get("KATA_THREADS", "1")))
