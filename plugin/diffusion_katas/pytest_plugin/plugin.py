"""The diffusion-katas pytest plugin: options, markers and session set-up.

Collection lives in plugin/collection.py, comparison in plugin/comparison.py, reporting in
plugin/reporting.py; this module wires them in.
"""
from __future__ import annotations

import gc
import os
import random
from pathlib import Path

import pytest

from diffusion_katas.core.course import Course
from diffusion_katas.pytest_plugin import session as state
from diffusion_katas.pytest_plugin.collection import (  # noqa: F401  (hooks)
    pytest_collect_file, pytest_pycollect_makemodule, pytest_runtest_protocol)
from diffusion_katas.pytest_plugin.reporting import (  # noqa: F401  (hooks)
    pytest_deselected,
    pytest_report_header,
    pytest_report_teststatus,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)

# Help texts, defined once and shared by the command-line option and its ini twin.
SOLUTIONS_HELP = "Grade solutions/ instead of katas/ with the same graders (instructors' check)"
UNSEEN_HELP = ("This run's failure texts are not shown as printed (the `kata` commands pass it and show what they "
               "choose): its hint tiers are not remembered as seen")
REUSE_HELP = ("Keep each check's built references between gradings in this process and reuse them where "
              "the case and the random states are the same (the warm grader of `kata watch` passes it)")
SEED_HELP = "Seed for the graders' random inputs; a failure prints the seed that reproduces it"
HINTS_HELP = ("Hint tiers to show with a failure (0-3); default: one more than you have seen (here or with "
              "`kata hint`) each time the function fails")
GRADESCOPE_HELP = "Write Gradescope's results.json to PATH (one test per kata function, points as declared)"
HIDDEN_SEED_HELP = ("Also run hidden checks: every check again on inputs drawn from this instructor secret (any "
                    "text: a long random one cannot be guessed from the hidden inputs; default: $KATA_HIDDEN_SEED)")
HIDDEN_CASES_HELP = 'JSON file of extra hidden cases: {"lab::function::check": [case, ...]}'
SECRET_FD_HELP = ("Read the hidden seed and hidden cases as JSON ({\"hidden_seed\": S, \"hidden_cases\": {...}}) from "
                  "this inherited file descriptor, then close it (how kata class and the autograder pass them: "
                  "never on a command line, in the environment or in a file)")
HIDDEN_OUTPUT_HELP = "What a failing hidden check shows: its name only (default) or the full message"
FUNCTION_HELP = "Grade only this kata function (exact name; repeat for several)"
NO_WARM_HELP = ("Grade in this process, not in the course's warm grader (which later runs of kata files use: "
                "core/warm.py), and start none (also KATA_NO_WARM=1)")
JSON_HELP = "Write every graded item, the seed and the torch/diffusers versions as JSON to PATH"
TIMEOUT_HELP = "Seconds one kata check may run before it fails as timed out (pytest-timeout)"
MEMORY_HELP = ("GiB of memory the learner's code may take beyond what its process starts with (the warm runner's "
               "own); past it an allocation fails, and the check with it (GPU checks are not limited)")
KATA_DIR_HELP = "Folder of the learner's kata files, relative to the rootdir"
SOLUTIONS_DIR_HELP = "Folder of the solved kata files, relative to the rootdir"
GRADERS_DIR_HELP = "Folder of the graders, one per kata file and named like it, relative to the rootdir"
LABS_HELP = ("The labs this course grades (file stems, space-separated; default: every lab with a grader): a "
             "missing kata file of one of them is graded as missing")
# The marker lines are registered in every run (so --strict-markers accepts them); the rest only in a course.

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
    group.addoption("--kata-memory", type=float, default=None, metavar="GIB", help=MEMORY_HELP)
    group.addoption("--kata-function", action="append", default=[], metavar="NAME", help=FUNCTION_HELP)
    group.addoption("--kata-hints-unseen", action="store_true", default=False, help=UNSEEN_HELP)
    group.addoption("--kata-reuse-builds", action="store_true", default=False, help=REUSE_HELP)
    group.addoption("--kata-no-warm", action="store_true", default=False, help=NO_WARM_HELP)
    group.addoption("--kata-json", default=None, metavar="PATH", help=JSON_HELP)
    group.addoption("--gradescope", default=None, metavar="PATH", help=GRADESCOPE_HELP)
    group.addoption("--kata-hidden-seed", default=None, metavar="SECRET", help=HIDDEN_SEED_HELP)
    group.addoption("--kata-hidden-cases", default=None, metavar="PATH", help=HIDDEN_CASES_HELP)
    group.addoption("--kata-secret-fd", type=int, default=None, metavar="FD", help=SECRET_FD_HELP)
    group.addoption("--kata-hidden-output", choices=("name-only", "full"), default="name-only",
                    help=HIDDEN_OUTPUT_HELP)
    parser.addini("kata_timeout", TIMEOUT_HELP, default="120")
    parser.addini("kata_memory", MEMORY_HELP, default="4")
    parser.addini("kata_dir", KATA_DIR_HELP, default="katas")
    parser.addini("kata_solutions_dir", SOLUTIONS_DIR_HELP, default="solutions")
    parser.addini("kata_graders_dir", GRADERS_DIR_HELP, default="graders")
    parser.addini("kata_labs", LABS_HELP, type="args", default=[])


def _number(config: pytest.Config, name: str, unit: str) -> float:
    """An option's number: from the command line, else from the config file's ini key of the same name."""
    value = config.getoption(name)
    if value is not None:
        return value
    try:
        return float(config.getini(name))
    except ValueError:
        raise pytest.UsageError(f"{name} must be a number of {unit}, got {config.getini(name)!r} from the config file")


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> int | None:
    """A learner's run of kata files goes to the course's warm grader when one is running (pytest_plugin/warm.py),
    which runs it exactly as this process would, on this terminal; else it is graded here."""
    from diffusion_katas.pytest_plugin import warm

    return warm.hand_over(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    from diffusion_katas.pytest_plugin import warm

    warm.start_if_asked(config)


_EXIT_FREEZE: list = []


def _freeze_at_exit() -> None:
    """At the process's end (once registered, at the first grading): everything still alive is frozen again, after
    pytest's cleanups unfroze it, so the interpreter's last collections skip torch's and diffusers' heap. Finalizing
    it took a second after the verdict was printed; the process ends either way, and files and streams are still
    flushed and closed."""
    if not _EXIT_FREEZE:
        import atexit

        atexit.register(gc.freeze)
        _EXIT_FREEZE.append(True)


def pytest_configure(config: pytest.Config) -> None:
    """Register our markers and, inside a course, set up the grading session in the stash."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    root = config.rootpath
    course = Course(root, katas=root / config.getini("kata_dir"), solutions=root / config.getini("kata_solutions_dir"),
                    graders=root / config.getini("kata_graders_dir"))
    if not course.has_graders:
        return  # not a course: no header, no session, no items
    # the project's own tests, run from a course's root with xdist, grade nothing themselves
    if getattr(config.option, "numprocesses", None) and _grades_katas(config, (course.katas, course.solutions)):
        raise pytest.UsageError("diffusion katas: -n (pytest-xdist) is not supported: every check already runs the "
                                "learner's code in a process of its own, and the progress table, --kata-json and "
                                "--gradescope need one grading process. Run without -n.")
    seed = config.getoption("kata_seed")
    timeout = _number(config, "kata_timeout", "seconds")
    memory = _number(config, "kata_memory", "GiB")
    if memory <= 0:
        raise pytest.UsageError(f"--kata-memory takes a positive number of GiB, got {memory:g}")
    hints = config.getoption("kata_hints")
    if hints is not None and not 0 <= hints <= 3:
        raise pytest.UsageError(f"--kata-hints takes 0 to 3, got {hints} from the command line")
    secret = _secret(config.getoption("kata_secret_fd"))  # read before any runner starts
    hidden_seed = secret.get("hidden_seed", _hidden_seed(config))
    hidden_cases = secret["hidden_cases"] if "hidden_cases" in secret else \
        _hidden_cases(config.getoption("kata_hidden_cases"))
    session = state.KataSession(
        course=course,
        grade_solutions=config.getoption("solutions"),
        seed=seed if seed is not None else random.SystemRandom().randrange(1, 10**6),
        seed_given=seed is not None,
        hint_tiers=hints,
        timeout=timeout,
        memory_gib=memory,
        json_path=_path(config.getoption("kata_json")),
        gradescope_path=_path(config.getoption("gradescope")),
        hidden_seed=str(hidden_seed) if hidden_seed is not None else ("0" if hidden_cases else None),
        hidden_cases=hidden_cases,
        hidden_output=config.getoption("kata_hidden_output"),
        reuse_builds=config.getoption("kata_reuse_builds"),
        # Tiers count as seen only where pytest prints the failure texts that carry them.
        hints_shown=not config.getoption("kata_hints_unseen") and config.getoption("tbstyle", "auto") not in ("no", "line"),
    )
    if session.keeps_record:  # the learner's own runs: hints go on from the tiers they have seen
        from diffusion_katas.core import tiers

        session.tiers = tiers.load(course.hints_path)
    config.stash[state.SESSION] = session
    # Undone last (cleanups run newest first, and ours is older than pytest's unraisable-exception cleanup,
    # whose five gc.collect() calls walked torch's and diffusers' whole heap: 1.3 s of a 1.9 s warm grading).
    config.add_cleanup(gc.unfreeze)
    if _grades_katas(config, (session.kata_dir, session.solutions_dir)):
        from diffusion_katas.engine import sandbox
        from diffusion_katas.engine.runner import Zygote

        sandbox.open_to_box(course.katas)  # a class's box reads its kata folder (where one was given: KATA_BOX)
        # Start the runners' warm parent now: its imports overlap with this process's collection.
        Zygote.shared()
        # No collections while the graders import torch's, diffusers' and transformers' modules (each full one
        # walked the whole growing heap: eight, 0.9 s, during a course's collection); what they import lives to
        # the end and is frozen once collected (pytest_collection_modifyitems), the collector on again there.
        gc.disable()
        config.add_cleanup(gc.enable)


def _grades_katas(config: pytest.Config, folders) -> bool:
    """Whether this run's paths reach kata files (in `folders`, or a folder holding them)."""
    args = [a.split("::")[0] for a in config.args] or list(config.getini("testpaths")) or ["."]
    folders = [Path(f).resolve() for f in folders]
    for arg in args:
        path = (config.invocation_params.dir / arg).resolve()
        if any(path == f or f in path.parents or path in f.parents for f in folders):
            return True
    return False


def _path(value: str | None) -> Path | None:
    return Path(value).resolve() if value else None


def _hidden_seed(config: pytest.Config) -> str | None:
    seed = config.getoption("kata_hidden_seed")
    if seed:
        return seed
    return os.environ.get("KATA_HIDDEN_SEED") or None


def _hidden_cases(path: str | None) -> dict:
    if not path:
        return {}
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise pytest.UsageError(f"--kata-hidden-cases {path}: {exc}")
    if not _case_table(data):
        raise pytest.UsageError(f'--kata-hidden-cases {path}: expected {{"lab::function::check": [case, ...]}}')
    return data


def _case_table(data) -> bool:
    return isinstance(data, dict) and all(isinstance(v, list) and all(isinstance(c, dict) for c in v)
                                          for v in data.values())


def _secret(fd: int | None) -> dict:
    """The hidden seed and cases handed over on an inherited pipe: read whole, then the pipe is closed, so
    nothing of it is left where the runners (forked later) could find it."""
    if fd is None:
        return {}
    import json

    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
        os.close(fd)
        data = json.loads(b"".join(chunks).decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise pytest.UsageError(f"--kata-secret-fd {fd}: could not read the hidden seed and cases ({exc})")
    seed = data.get("hidden_seed") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not (seed is None or isinstance(seed, (int, str))) \
            or not _case_table(data.get("hidden_cases", {})):
        raise pytest.UsageError(f"--kata-secret-fd {fd}: expected "
                                '{"hidden_seed": S, "hidden_cases": {"lab::function::check": [case, ...]}}')
    return {"hidden_seed": None if seed is None else str(seed), "hidden_cases": data.get("hidden_cases", {})}


def _check_hidden_keys(cases: dict, items: list[pytest.Item]) -> None:
    """A hidden case for a check that does not exist (in a lab this run grades) is the instructor's
    mistake: stop before grading anyone, naming it."""
    if not cases:
        return
    known = {(i.lab, i.kata.name, i.check.name) for i in items if hasattr(i, "check") and hasattr(i, "lab")}
    labs = {lab for lab, _, _ in known}
    unknown = [key for key in cases if key.count("::") != 2
               or (key.split("::")[0] in labs and tuple(key.split("::")) not in known)]
    if unknown:
        raise pytest.UsageError("hidden cases for checks that do not exist: " + ", ".join(sorted(unknown))
                                + ' (keys are "lab::function::check": the lab file stem, the kata function, the check name)')


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cuda` tests without CUDA (in any run: the marker is ours); in a course, grade a lab whose
    kata file is missing as missing (never drop it), select --kata-function, run hidden checks after
    every visible one, and keep kata runs to one CPU thread."""
    if state.SESSION in config.stash:
        from diffusion_katas.pytest_plugin.collection import KataItem, missing_lab_items

        items.extend(missing_lab_items(session, items))
        _check_hidden_keys(config.stash[state.SESSION].hidden_cases, items)
        wanted = set(config.getoption("kata_function"))
        if wanted:
            known = {i.kata.name for i in items if isinstance(i, KataItem)}
            unknown = sorted(wanted - known)
            if unknown:  # a misspelt name would otherwise grade nothing, silently
                raise pytest.UsageError(
                    f"--kata-function {', '.join(unknown)}: no such kata function in the labs collected; their "
                    f"functions are: {', '.join(sorted(known)) or 'none'}")
            keep = [i for i in items if not isinstance(i, KataItem) or i.kata.name in wanted]
            config.hook.pytest_deselected(items=[i for i in items if i not in keep])
            items[:] = keep
        # Hidden checks last: nothing a learner's code sees in a visible check comes after a hidden one.
        items.sort(key=lambda i: bool(getattr(i, "hidden", False)))
        if any(isinstance(item, KataItem) for item in items):
            import torch

            # Tiny forwards on a loaded 2-core machine ran 10-100x slower with two threads.
            torch.set_num_threads(int(os.environ.get("KATA_THREADS", "1")))
            # Everything imported so far (torch, diffusers, the graders) lives until the process ends: move
            # it out of the collector's sight for this run, so collections walk only what grading creates.
            gc.freeze()
            config.stash[state.SESSION].heap_frozen = True
            _freeze_at_exit()
        gc.enable()
    if any(item.get_closest_marker("cuda") for item in items):
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="CUDA not available")
            for item in items:
                if item.get_closest_marker("cuda"):
                    item.add_marker(skip)

