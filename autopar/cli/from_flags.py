"""The flags that read a layout from another framework's config (`--from`, `--from-megatron`, `--from-deepspeed`),
shared by `autopar estimate` (price it) and `autopar explain` (compare it with a plan)."""

from __future__ import annotations

import argparse

from autopar.errors import AutoparError

__all__ = ["add_from_flags", "from_source"]


def add_from_flags(group: argparse._MutuallyExclusiveGroup) -> None:
    """Add the three flags to `group` (mutually exclusive with the command's own layout flag)."""
    group.add_argument("--from", dest="from_file", metavar="FILE",
                       help="the layout a torchtitan job config (.toml) or a DeepSpeed ds_config (.json) runs, "
                            "priced with that framework's runtime")
    group.add_argument("--from-megatron", metavar="ARGS",
                       help='the layout Megatron-LM arguments run ("--tensor-model-parallel-size 8 ..." or @file)')
    group.add_argument("--from-deepspeed", metavar="FILE", help="the layout a DeepSpeed ds_config JSON runs")


def from_source(args: argparse.Namespace) -> tuple[str, str] | None:
    """(target, source) of the flag given, or None when none was."""
    if args.from_megatron is not None:
        return "megatron", args.from_megatron
    if args.from_deepspeed is not None:
        return "deepspeed", args.from_deepspeed
    if args.from_file is None:
        return None
    suffix = args.from_file.rsplit(".", 1)[-1].lower()
    if suffix not in ("toml", "json"):
        raise AutoparError(f"--from {args.from_file}: expected a torchtitan job config (.toml) or a DeepSpeed "
                           "ds_config (.json); for Megatron-LM arguments use --from-megatron")
    return ("torchtitan" if suffix == "toml" else "deepspeed"), args.from_file
