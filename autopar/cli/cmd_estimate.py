"""`autopar estimate MODEL --cluster ... --config ...`: price one given layout, as `autopar.estimate` does.
A layout over memory is priced all the same and shown as not fitting, with where its bytes go."""

from __future__ import annotations

import argparse
import dataclasses
import json

from autopar.checks import MAX_GLOBAL_BATCH, check_positive_int
from autopar.cli.cmd_plan import add_model_and_cluster, add_precision, add_router_skew
from autopar.cli.from_flags import add_from_flags, from_source
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import AutoparError
from cost_models.precision import default_precision

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("estimate", help="price one layout of a model on a cluster (step time, MFU, memory)",
                              description="Price a given layout with the planner's objective; a layout over "
                                          "memory is priced too and reported as not fitting.")
    add_model_and_cluster(p, example="llama3-8b")
    layout = p.add_mutually_exclusive_group(required=True)
    layout.add_argument("--config",
                        help='the layout, e.g. "tp=8,pp=16,dp=128,mbs=1,m=16,schedule=interleaved_1f1b,v=8,sp=1"')
    add_from_flags(layout)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="zoo or transformers config field, e.g. num_hidden_layers=4 (repeatable)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="training dtype of a zoo MODEL (default as `autopar plan`)")
    p.add_argument("--profile", default=None, help="a profile.json measured by `autopar profile`")
    add_precision(p, "the layout's precision (or precision= in --config; default: bf16 on GPUs with bf16 tensor "
                     "throughput, fp32 on CPU)")
    add_router_skew(p)
    p.add_argument("--json", action="store_true", help="print the layout and its estimate as JSON")
    p.set_defaults(func=_estimate)


def _estimate(args: argparse.Namespace) -> int:
    import autopar
    from autopar.cli.cmd_plan import _cluster, _graph
    from autopar.models import training_dtype
    from autopar.report.text import render_estimate

    if args.seq_len is not None:
        check_positive_int("--seq-len", args.seq_len, bound=MAX_GLOBAL_BATCH, error=AutoparError)
    cluster = _cluster(args.cluster, args.nodes, args.nproc, args.profile)
    if args.config is None:
        return _estimate_imported(args, cluster)
    try:
        given = ParallelConfig.parse_fields(args.config).get("precision")
        if given is not None and args.precision is not None and given != args.precision:
            raise AutoparError(f"--config {args.config!r} says precision={given} but --precision says "
                               f"{args.precision}; give it once")
        precision = given or args.precision or default_precision(cluster.device.kind, cluster.device.peak_flops)
        config = ParallelConfig.parse(args.config, precision=precision)
    except (ValueError, TypeError) as e:
        raise AutoparError(f"--config {args.config!r}: {e}") from None
    dtype = training_dtype("local" if args.cluster == "local" else "cluster", args.dtype)
    if ":" not in args.model:  # a zoo model: refuse before capture (estimate checks a factory's after)
        cluster.check_trains(dtype)
    est = autopar.estimate(_graph(args.model, args.seq_len, dtype, args.override, args=args), cluster, config,
                           options=PlannerOptions(router_skew=args.router_skew))
    if args.json:
        print(json.dumps({"config": config.to_dict(), "estimate": dataclasses.asdict(est)}, indent=1))
    else:
        print(render_estimate(config, est))
    return 0


def _estimate_imported(args: argparse.Namespace, cluster) -> int:
    """Price the layout a framework config runs, with that framework's runtime options."""
    import autopar
    from autopar.cli.cmd_plan import _graph
    from autopar.interop import import_layout
    from autopar.models import training_dtype
    from autopar.report.text import render_estimate

    target, source = from_source(args)
    first = import_layout(target, source, cluster.world_size, precision=args.precision)
    seq_len = args.seq_len
    if first.seq_len is not None and seq_len is not None and first.seq_len != seq_len:
        raise AutoparError(f"--seq-len {seq_len} but the {target} config says {first.seq_len}; give one")
    seq_len = seq_len or first.seq_len
    dtype = training_dtype("local" if args.cluster == "local" else "cluster", args.dtype)
    if ":" not in args.model:
        cluster.check_trains(dtype)
    graph = _graph(args.model, seq_len, dtype, args.override, args=args)
    blocks = sum(1 for la in graph.layers if la.kind == "block")
    got = import_layout(target, source, cluster.world_size, precision=args.precision, blocks=blocks)
    options = dataclasses.replace(got.options, router_skew=args.router_skew)
    est = autopar.estimate(graph, cluster, got.config, options=options)
    if args.json:
        print(json.dumps({"config": got.config.to_dict(), "from": target, "notes": list(got.notes),
                          "options": {"pipeline_runtime": options.pipeline_runtime, "loss_kernel": options.loss_kernel,
                                      "ep_dispatcher": options.ep_dispatcher, "fp8_runtime": options.fp8_runtime},
                          "estimate": dataclasses.asdict(est)}, indent=1))
        return 0
    print(f"read from {target} ({source}): {got.config}")
    print(f"priced as {target} runs it: pipeline_runtime={options.pipeline_runtime}, "
          f"loss_kernel={options.loss_kernel}, ep_dispatcher={options.ep_dispatcher}, "
          f"fp8_runtime={options.fp8_runtime}")
    for note in got.notes:
        print(f"note: {note}")
    print(render_estimate(got.config, est))
    return 0
