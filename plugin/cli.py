"""The `kata` command: the learner's loop and the instructor's tools, wrapped around pytest.

pytest stays the engine: every command that grades runs `python -m pytest` with the plugin's
options and reads its --kata-json report. Learner commands live in plugin/learner.py, instructor
commands in plugin/instructor.py; each module adds its subcommands through `add_commands`.
"""
from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from plugin import instructor, learner

    parser = argparse.ArgumentParser(prog="kata", description="Diffusion katas: grade, watch, hint, reset; "
                                     "for instructors: grade a class, build a Gradescope autograder.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    learner.add_commands(commands)
    instructor.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
