"""`autopar` entry point. Each sub-command lives in its own module exposing `register(subparsers)`,
which adds a parser whose `func(args) -> int` runs it. User errors (AutoparError) print one line and
exit 1; usage errors exit 2 (argparse).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from autopar.errors import AutoparError

# Sub-command modules, in the order `autopar --help` lists them.
COMMAND_MODULES = (
    "autopar.cli.cmd_capture",
    "autopar.cli.cmd_clusters",
    "autopar.cli.cmd_profile",
    "autopar.cli.cmd_plan",
    "autopar.cli.cmd_report",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Plan and apply parallelism for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `autopar ... --json | head`: the reader left; not an error of ours
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return 0
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # invalid values in our frozen dataclasses, raised from user input
        print(f"autopar: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
