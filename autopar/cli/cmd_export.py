"""`autopar export plan.json --to torchtitan|megatron|deepspeed`: the plan as the config file of the framework
that will run it (autopar.interop); what the target cannot express is written into it as notes."""

from __future__ import annotations

import argparse
import sys

from autopar.interop import TARGETS

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write a plan as a torchtitan, Megatron-LM or DeepSpeed config",
                              description="Write a saved plan as a torchtitan job-config TOML, a Megatron-LM/NeMo "
                                          "argument list or a DeepSpeed ds_config JSON. What the target cannot "
                                          "express is listed in the output with the closest setting written.")
    p.add_argument("plan", help="plan.json from `autopar plan --out`")
    p.add_argument("--to", required=True, choices=TARGETS, help="the framework")
    p.add_argument("--out", default=None, help="write here (default: print)")
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from autopar.cli.checks import check_output_path
    from autopar.interop import export_plan
    from autopar.plan import Plan

    if args.out is not None:
        check_output_path(args.out, "--out")
    plan = Plan.load(args.plan)
    plan.check(where=f"plan {args.plan}")
    exported = export_plan(plan, args.to)
    if args.out is None:
        sys.stdout.write(exported.text)
        return 0
    with open(args.out, "w") as f:
        f.write(exported.text)
    print(f"wrote {args.out} ({args.to}); {len(exported.notes)} setting(s) not expressible, written as the closest:")
    for note in exported.notes:
        print(f"  - {note}")
    return 0
