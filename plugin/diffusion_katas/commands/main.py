"""The `kata` command: the learner's loop, the instructor's tools and the maintainer's, around pytest.

pytest stays the engine: every command that grades runs `python -m pytest` with the plugin and reads
its --kata-json report. Learner commands live in learner/, instructor commands in instructor/, the
maintainer's in maintainer.py; each adds its subcommands through `add_commands`.
"""
from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    from diffusion_katas.commands import maintainer
    from diffusion_katas.commands.instructor import cli as instructor
    from diffusion_katas.commands.learner import cli as learner

    parser = argparse.ArgumentParser(prog="kata", description="Diffusion katas: grade, watch, hint, reset, explain; "
                                     "for instructors: grade a class, build a Gradescope autograder; for "
                                     "maintainers: derive the katas, build a learner's copy.")
    parser.add_argument("--version", action="version", version=f"kata (diffusion-katas) {version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    learner.add_commands(commands)
    instructor.add_commands(commands)
    maintainer.add_commands(commands)
    return parser


def version() -> str:
    from importlib import metadata

    try:
        return metadata.version("diffusion-katas")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    args = None
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
            if args.command is None:  # bare `kata`: what it can do
                parser.print_help()
                return 0
            return int(args.run(args) or 0)
        finally:
            sys.stdout.flush()  # here, where a reader that left is caught, not at interpreter exit
    except BrokenPipeError:  # `kata explain 03 | head`: the reader left; say nothing more
        _quiet_stdout()
        # A command whose exit code is its answer (`derive --check`: drift) decides it before printing.
        return int(getattr(args, "verdict", 0) or 0)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that what is still buffered is not written (and does not fail) at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
