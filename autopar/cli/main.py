"""`autopar` entry point. Each sub-command lives in its own module exposing `register(subparsers)`,
which adds a parser whose `func(args) -> int` runs it. User errors (AutoparError) print one line and
exit 1; usage errors exit 2 (argparse); any other exception is a bug of autopar's and prints one line
saying so (exit 1), with the traceback under `--debug`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from autopar.errors import AutoparError

# Sub-command modules, in the order `autopar --help` lists them.
COMMAND_MODULES = (
    "autopar.cli.cmd_capture",
    "autopar.cli.cmd_clusters",
    "autopar.cli.cmd_profile",
    "autopar.cli.cmd_plan",
    "autopar.cli.cmd_estimate",
    "autopar.cli.cmd_export",
    "autopar.cli.cmd_budget",
    "autopar.cli.cmd_report",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autopar", description="Plan and apply parallelism for PyTorch training.")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an internal error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    for command in sub.choices.values():  # `autopar plan ... --debug` works as well as `autopar --debug plan ...`
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="show the traceback of an internal error")
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
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # anything else is autopar's fault, not the input's
        if args.debug:
            traceback.print_exc()
        first = str(e).splitlines()[0][:300] if str(e) else ""
        print(f"autopar: internal error: {type(e).__name__}: {first} — this is a bug in autopar; please report it "
              f"with the command line and the output of the same command with --debug "
              f"(autopar {' '.join(sys.argv[1:] if argv is None else argv)} --debug)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
