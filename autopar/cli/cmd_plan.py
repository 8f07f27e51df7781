"""`autopar plan | show | diff | explain`: make a plan and inspect plans. A thin mirror of
`autopar.plan`, `autopar.estimate`, `PlannerOptions` and `Plan`; rendering lives in autopar.report."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from autopar.checks import MAX_DEVICES, MAX_GLOBAL_BATCH, MAX_TOP_K, check_positive_int
from autopar.cli.checks import check_output_path, check_plan_for_cluster, check_saved_plan
from autopar.cli.from_flags import add_from_flags, from_source
from autopar.config import (
    FP8_RUNTIME_RECIPES,
    OBJECTIVES,
    OFFLOAD_MODES,
    PRECISIONS,
    RECOMPUTE_MODES,
    SCHEDULES,
    ZERO_STAGES,
    ParallelConfig,
    PlannerOptions,
    ep_fits,
)
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import Plan

__all__ = ["register", "add_model_and_cluster", "add_precision"]


def add_model_and_cluster(p: argparse.ArgumentParser, *, example: str) -> None:
    """MODEL and the cluster flags, as `plan` and `estimate` both take them."""
    p.add_argument("model", metavar="MODEL", help=f"zoo name (e.g. {example}), path/file.py:factory, pkg.mod:factory, "
                                                  "or a transformers config: a folder with config.json, a .json "
                                                  "file, or a Hub name (org/name) in the local Hugging Face cache")
    p.add_argument("--cluster", required=True, help="preset name (autopar clusters), a TOML/JSON file, or 'local'")
    p.add_argument("--nodes", type=int, default=None, help="nodes of a preset cluster (default 1)")
    p.add_argument("--nproc", type=int, default=None, help="processes of the local cluster")
    add_loss_args(p)


def add_loss_args(p: argparse.ArgumentParser) -> None:
    """Which loss MODEL trains on, as `parallelize` will be told (it decides what is captured and priced), and
    --trust-remote-code for a transformers config whose model is remote code."""
    add_trust_remote_code(p)
    p.add_argument("--target-arg", default=None, metavar="NAME",
                   help="the forward argument that takes the targets (default: `targets` or `labels` when the "
                        "forward takes one; the model then trains on the loss it returns)")
    p.add_argument("--external-loss", action="store_true",
                   help="the model will train on a loss_fn given to parallelize, not on its own loss: capture it "
                        "without targets")


def add_trust_remote_code(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="a transformers config MODEL may run the modelling code its auto_map names (off by default)")


def add_router_skew(p: argparse.ArgumentParser) -> None:
    """--router-skew: the MoE router load imbalance to price at (PlannerOptions.router_skew)."""
    p.add_argument("--router-skew", type=float, default=None, metavar="FACTOR",
                   help="price mixture-of-experts layers at this router load imbalance (busiest expert-parallel "
                        "rank's routed tokens ÷ the mean, ≥ 1; default: the captured model's, balanced)")


def add_precision(p: argparse.ArgumentParser, help_text: str) -> None:
    """`--precision`, as plan, estimate and explain take it (ParallelConfig.precision)."""
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help=f"{help_text}; bf16/fp16: 16-bit compute over fp32 master weights, optimizer states and "
                        "gradient reduction")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="plan the fastest layout of a model on a cluster",
                              description="Search tp/pp/dp, ZeRO, micro-batching, schedule, recompute and stage "
                                          "cuts for the fastest layout that fits memory (exact ILP).")
    add_model_and_cluster(p, example="gpt3-175b")
    p.add_argument("--global-batch-size", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="zoo config field, e.g. dropout=0 (repeatable; as examples/train_gpt.py takes it)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="training dtype of a zoo MODEL (default: float32 for --cluster local without a GPU, "
                        "as examples/train_gpt.py trains there; else bfloat16)")
    p.add_argument("--profile", default=None, help="a profile.json measured by `autopar profile`")
    p.add_argument("--out", default=None, help="write the plan as JSON here")
    p.add_argument("--top", type=int, default=5, help="runner-up layouts to keep")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit in seconds")
    p.add_argument("--tp", type=int, help="pin tensor parallelism")
    p.add_argument("--pp", type=int, help="pin pipeline parallelism")
    p.add_argument("--dp", type=int, help="pin data parallelism")
    p.add_argument("--cp", type=int, help="pin context parallelism (each sequence split over cp ranks)")
    p.add_argument("--zero", type=int, choices=ZERO_STAGES, help="pin the ZeRO stage")
    p.add_argument("--ep", type=int, help="pin expert parallelism (mixture-of-experts models; a divisor of dp, or "
                                         "folded over tp: a multiple of tp whose ep/tp divides dp)")
    p.add_argument("--etp", type=int, help="pin the experts' tensor parallelism: 1 (experts replicated over tp) or tp "
                                          "(each expert's FFN split over the tp ranks; ep must then divide dp)")
    add_router_skew(p)
    p.add_argument("--mbs", type=int, help="pin the micro-batch size")
    p.add_argument("--schedule", choices=SCHEDULES, help="pin the pipeline schedule")
    p.add_argument("--microbatch-group", type=int, dest="microbatch_group",
                   help="pin interleaved 1F1B's group N: micro-batches a rank runs through one chunk before its next "
                        "(default: torch's N = pp)")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, help="pin recompute on every layer")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=("on", "off", "auto"),
                   help="compile each block with torch.compile: --compile (on), off (eager, the default) or "
                        "auto (the planner prices both and picks)")
    p.add_argument("--fp8", default="none", choices=("none", *FP8_RUNTIME_RECIPES["torchao"], "auto"),
                   help="FP8 GEMMs through float8 training (autopar.codegen.float8): none (the default: it changes "
                        "numerics), tensorwise or rowwise scaling, or auto (the planner prices each and picks)")
    p.add_argument("--offload", default="auto", choices=(*OFFLOAD_MODES, "auto"),
                   help="model states in host memory: none, optimizer (fp32 masters and moments, the step on the "
                        "CPU), params (FSDP2 CPU offload of everything), or auto (the default: the planner takes "
                        "one where it fits and nothing else does, or where it is faster)")
    p.add_argument("--objective", choices=OBJECTIVES, default="fastest",
                   help="fastest: least modelled step time; pessimistic: least step time at the slow end of the "
                        "error band of published runs like each layout")
    add_precision(p, "pin the training precision (default: bf16 on GPUs with bf16 tensor throughput, fp32 on CPU)")
    p.add_argument("--timeline", default=None, help="draw one step per rank and memory per stage (png/svg)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_plan)

    s = subparsers.add_parser("show", help="print a saved plan")
    s.add_argument("plan", help="plan.json")
    s.add_argument("--timeline", default=None, help="draw one step per rank and memory per stage (png/svg)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_show)

    d = subparsers.add_parser("diff", help="compare two plans")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=_diff)

    e = subparsers.add_parser("explain", help="why the plan is not another layout")
    e.add_argument("plan", help="plan.json")
    alternative = e.add_mutually_exclusive_group(required=True)
    alternative.add_argument("--config", help='the alternative, e.g. "tp=4,pp=8,mbs=1,schedule=1f1b"')
    add_from_flags(alternative)  # the layout a team runs today, priced as its framework runs it
    e.add_argument("--model", default=None, help="MODEL, when it is not a zoo name equal to the plan's model")
    e.add_argument("--cluster", default=None, help="cluster; default: the plan's preset")
    e.add_argument("--nodes", type=int, default=None)
    add_trust_remote_code(e)
    add_precision(e, "the alternative's precision (default: the plan's, or precision= in --config)")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=_explain)


def _cluster(spec: str, nodes: int | None, nproc: int | None, profile: str | None):
    from autopar.cluster import Cluster

    for flag, value in (("--nodes", nodes), ("--nproc", nproc)):
        if value is not None:
            check_positive_int(flag, value, bound=MAX_DEVICES, error=AutoparError)
    if nproc is not None and spec != "local":
        raise AutoparError(f"--nproc applies to --cluster local only; for {spec!r} give --nodes "
                           "(devices per node come from the preset or file)")
    if spec == "local":
        if nodes not in (None, 1):
            raise AutoparError(f"--nodes {nodes} does not apply to --cluster local (one machine); give --nproc "
                               "for its number of processes")
        return Cluster.local(nproc=nproc, profile=profile)
    if Path(spec).suffix.lower() in (".toml", ".json") or Path(spec).exists():
        for flag, value in (("--nodes", nodes), ("--profile", profile)):
            if value is not None:
                raise AutoparError(f"{flag} does not apply to the cluster file {spec}: its nodes and numbers are "
                                   "its own; edit the file (or use a preset with --nodes and --profile)")
        return Cluster.from_file(spec)
    return Cluster.preset(spec, nodes=nodes or 1, profile=profile)


def _check_plan_flags(args: argparse.Namespace) -> None:
    """Numbers and output paths of `autopar plan`, checked before any capture or search."""
    for flag in ("global_batch_size", "seq_len", "tp", "pp", "dp", "cp", "mbs", "ep", "microbatch_group"):
        value = getattr(args, flag)
        if value is not None:
            check_positive_int(f"--{flag.replace('_', '-')}", value, error=AutoparError,
                               bound=MAX_GLOBAL_BATCH if flag in ("global_batch_size", "mbs") else None)
    if args.dtype is not None and ":" in args.model:
        raise AutoparError(f"--dtype applies to zoo models; MODEL {args.model} is a factory, which builds the model in "
                           "its own dtype: set it there (the plan follows the dtype the factory returns)")
    if not 0 <= args.top <= MAX_TOP_K:
        raise AutoparError(f"--top {args.top}: keep 0 to {MAX_TOP_K} runner-up layouts")
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise AutoparError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    _check_outputs(args)


def _check_outputs(args: argparse.Namespace) -> None:
    if getattr(args, "out", None) is not None:
        check_output_path(args.out, "--out")
    if args.timeline is not None:
        if not args.timeline.lower().endswith((".png", ".svg")):
            raise AutoparError(f"--timeline {args.timeline}: use a .png or .svg file name")
        check_output_path(args.timeline, "--timeline")


def _graph(model: str, seq_len: int | None, dtype=None, overrides: tuple[str, ...] | list[str] = (), *,
           seq_len_optional: bool = False, args: argparse.Namespace | None = None, trust_remote_code: bool = False):
    """The captured MODEL, as it trains (`args`: --external-loss, --target-arg); seq_len_optional: seq_len
    comes from a plan, not from --seq-len (a factory without a seq_len parameter then ignores it)."""
    from autopar.capture import capture
    from autopar.models import resolve_model
    from autopar.zoo import parse_overrides

    if args is not None and args.external_loss and args.target_arg is not None:
        raise AutoparError(f"pass --external-loss or --target-arg {args.target_arg}, not both: --target-arg trains "
                           "on the model's own loss")
    trust = trust_remote_code or bool(getattr(args, "trust_remote_code", False))
    return capture(*resolve_model(model, seq_len, dtype=dtype, overrides=parse_overrides(overrides),
                                  seq_len_optional=seq_len_optional, trust_remote_code=trust),
                   own_loss=args is None or not args.external_loss, target_arg=args and args.target_arg)


_COMPILE = {"on": True, "off": False, "auto": None}  # --compile → PlannerOptions.compile

def _plan(args: argparse.Namespace) -> int:
    import autopar

    _check_plan_flags(args)
    opts = PlannerOptions(tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp, zero_stage=args.zero,
                          micro_batch_size=args.mbs, microbatch_group=args.microbatch_group,
                          ep=args.ep, etp=args.etp, schedule=args.schedule, recompute=args.recompute,
                          compile=_COMPILE[args.compile],
                          fp8=None if args.fp8 == "auto" else args.fp8,
                          offload=None if args.offload == "auto" else args.offload,
                          top_k=args.top, time_limit_s=args.time_limit, objective=args.objective,
                          precision=args.precision, router_skew=args.router_skew)
    from autopar.models import training_dtype

    cluster = _cluster(args.cluster, args.nodes, args.nproc, args.profile)
    dtype = training_dtype("local" if args.cluster == "local" else "cluster", args.dtype)
    if ":" not in args.model:  # a zoo model trains in `dtype`: refuse before capturing it (a factory: after)
        cluster.check_trains(dtype)
    graph = _graph(args.model, args.seq_len, dtype, args.override, args=args)
    plan = autopar.plan(graph, cluster, global_batch_size=args.global_batch_size,
                        options=opts)
    if args.out:
        plan.save(args.out)
    code = _emit(plan, args)
    if plan.config.offload != "none" and not args.json:
        from autopar.planner.costs import CostModel

        print("\n".join(CostModel.for_cluster(graph, cluster).offload_summary(plan.config).lines()))
    return code


def _emit(plan: Plan, args: argparse.Namespace) -> int:
    from autopar.report.text import render_plan

    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
    else:
        print(render_plan(plan))
        if getattr(args, "out", None):
            print(f"saved           {args.out}")
    if args.timeline:
        from autopar.report.timeline import draw_timeline

        draw_timeline(plan, args.timeline)
        if not args.json:
            print(f"timeline        {args.timeline}")
    return 0


def _load(path: str) -> Plan:
    """A plan file, checked against what can be rebuilt of its model and cluster (autopar.cli.checks)."""
    plan = Plan.load(path)
    check_saved_plan(plan, where=f"plan {path}")
    return plan


def _show(args: argparse.Namespace) -> int:
    _check_outputs(args)
    return _emit(_load(args.plan), args)


def _diff(args: argparse.Namespace) -> int:
    from autopar.report.text import render_diff

    a, b = _load(args.a), _load(args.b)
    if args.json:
        print(json.dumps({"a": a.to_dict(), "b": b.to_dict(),
                          "changed": sorted(k for k, v in dataclasses.asdict(a.config).items()
                                            if getattr(b.config, k) != v)}))
    else:
        print(render_diff(a, b))
    return 0


def _explain(args: argparse.Namespace) -> int:
    import autopar
    from autopar.models import training_dtype
    from autopar.planner.plan_fit import check_plan_for_graph
    from autopar.report.text import render_explain

    plan = Plan.load(args.plan)
    alt = _alternative(plan, args.config, args.precision) if args.config is not None else None
    spec = args.cluster or plan.cluster_name
    from autopar.cluster import Cluster

    nodes = args.nodes if args.nodes is not None or spec not in Cluster.presets() else _nodes(plan)
    nproc = plan.world_size if spec == "local" else None
    cluster = _cluster(spec, nodes, nproc, None)
    dtype = training_dtype("local" if plan.cluster_name == "local" else "cluster")
    trust = args.trust_remote_code
    graph = _graph(args.model or plan.model_name, plan.seq_len, dtype, seq_len_optional=True, trust_remote_code=trust)
    if graph.fingerprint != plan.graph_fingerprint:  # a plan made with --external-loss: captured without targets
        graph = _graph(args.model or plan.model_name, plan.seq_len, dtype, seq_len_optional=True,
                       args=argparse.Namespace(external_loss=True, target_arg=None), trust_remote_code=trust)
    if graph.fingerprint != plan.graph_fingerprint:
        raise PlanMismatchError(
            f"{args.plan} was made for model {plan.model_name!r} (graph fingerprint {plan.graph_fingerprint}), "
            f"but MODEL {args.model or plan.model_name!r} captures to fingerprint {graph.fingerprint}; pass "
            "--model with the model the plan was made from (same factory, sequence length and dtype)")
    check_plan_for_graph(plan, graph, where=f"plan {args.plan}")
    check_plan_for_cluster(plan, cluster, where=f"plan {args.plan}")
    if alt is None:
        return _explain_imported(args, plan, graph, cluster)
    est, reason = None, None
    try:
        own = plan.stages if alt == plan.config else None  # the plan itself: price its own stages exactly
        est = autopar.estimate(graph, cluster, alt, stages=own, options=PlannerOptions(router_skew=plan.router_skew))
    except AutoparError as e:
        reason = str(e)
    if est is not None and not est.fits:  # priced, but over memory: the constraint it breaks
        reason = f"constraint {est.violated} (per-device memory) is violated"
    if args.json:
        print(json.dumps({"chosen": {"config": plan.config.to_dict(), "estimate": dataclasses.asdict(plan.estimate)},
                          "alternative": {"config": alt.to_dict(),
                                          "estimate": dataclasses.asdict(est) if est else None, "violates": reason}}))
    else:
        print(render_explain(plan, alt, est, reason))
    return 0


def _explain_imported(args: argparse.Namespace, plan: Plan, graph, cluster) -> int:
    """Why the plan differs from the layout a framework config runs: that layout priced as its framework runs it,
    beside the plan, and the same layout under autopar's runtime (what the layout costs, apart from the runtime)."""
    import autopar
    from autopar.interop import import_layout
    from autopar.report.text import render_explain

    target, source = from_source(args)
    blocks = sum(1 for la in graph.layers if la.kind == "block")
    got = import_layout(target, source, plan.world_size, precision=args.precision or plan.config.precision,
                        blocks=blocks)
    if got.seq_len is not None and got.seq_len != plan.seq_len:
        raise AutoparError(f"the {target} config trains {got.seq_len} tokens per sample, the plan {plan.seq_len}; "
                           "compare layouts of one sequence length (plan again with --seq-len)")
    if got.config.global_batch_size != plan.global_batch_size:
        raise AutoparError(f"the {target} config trains a global batch of {got.config.global_batch_size} sequences, "
                           f"the plan {plan.global_batch_size}; compare layouts of one batch (plan again with "
                           f"--global-batch-size {got.config.global_batch_size})")
    theirs = dataclasses.replace(got.options, router_skew=plan.router_skew)
    ours = PlannerOptions(router_skew=plan.router_skew)
    priced: dict[str, tuple] = {}
    # under autopar's runtime a Transformer Engine recipe runs as torchao's per-tensor one
    own = (got.config if got.config.fp8 in ("none", *FP8_RUNTIME_RECIPES["torchao"])
           else dataclasses.replace(got.config, fp8="tensorwise"))
    for name, options, cfg in (("framework", theirs, got.config), ("autopar", ours, own)):
        try:
            priced[name] = (autopar.estimate(graph, cluster, cfg, options=options), None)
        except AutoparError as e:
            priced[name] = (None, str(e))
    est, reason = priced["framework"]
    if est is not None and not est.fits:
        reason = f"constraint {est.violated} (per-device memory) is violated"
    if args.json:
        print(json.dumps({"chosen": {"config": plan.config.to_dict(), "estimate": dataclasses.asdict(plan.estimate)},
                          "from": target, "notes": list(got.notes),
                          "alternative": {"config": got.config.to_dict(),
                                          "estimate": dataclasses.asdict(est) if est else None, "violates": reason},
                          "alternative_on_autopar": dataclasses.asdict(priced["autopar"][0])
                          if priced["autopar"][0] else None}))
        return 0
    print(f"read from {target} ({source}): {got.config}")
    for note in got.notes:
        print(f"note: {note}")
    print(f"priced as {target} runs it (pipeline_runtime={theirs.pipeline_runtime}, loss_kernel={theirs.loss_kernel}, "
          f"ep_dispatcher={theirs.ep_dispatcher}, fp8_runtime={theirs.fp8_runtime})")
    print(render_explain(plan, got.config, est, reason))
    mine = priced["autopar"][0]
    if est is not None and mine is not None:
        print(f"the same layout under autopar's runtime: step {mine.step_time_s:.4g} s "
              f"({mine.step_time_s / plan.estimate.step_time_s - 1:+.2%} against the plan"
              f"{'' if mine.fits else ', over memory'}); {target}'s runtime rules account for "
              f"{est.step_time_s - mine.step_time_s:+.4g} s of the difference, the layout for the rest")
    return 0


def _nodes(plan: Plan) -> int:
    from autopar.cluster import Cluster

    if plan.cluster_name in Cluster.presets():
        per_node = Cluster.preset(plan.cluster_name).devices_per_node
        return max(1, plan.world_size // per_node)
    return 1


def _alternative(plan: Plan, text: str, precision: str | None = None) -> ParallelConfig:
    """`text` over the plan's config; unset dp and m follow from the world size and the global batch."""
    given = ParallelConfig.parse_fields(text)
    if precision is not None and given.get("precision", precision) != precision:
        raise AutoparError(f"--config {text!r} says precision={given['precision']} but --precision says "
                           f"{precision}; give it once")
    base = plan.config.to_dict()
    world, batch = plan.world_size, plan.global_batch_size
    tp, pp, cp = given.get("tp", base["tp"]), given.get("pp", base["pp"]), given.get("cp", base.get("cp", 1))
    mbs = given.get("micro_batch_size", base["micro_batch_size"])
    dp = given.get("dp", max(1, world // (tp * cp * pp)))
    if tp * cp * pp * dp != world or batch % (dp * mbs):
        raise AutoparError(f"--config {text!r}: tp·cp·pp·dp must be {world} and dp·mbs must divide the global batch "
                           f"{batch}; got tp={tp}, cp={cp}, pp={pp}, dp={dp}, mbs={mbs}")
    fill = {**base, "dp": dp, "cp": cp, "num_microbatches": batch // (dp * mbs)}
    if precision is not None:
        fill["precision"] = precision
    if "virtual_stages" not in given and given.get("schedule") == "interleaved_1f1b":
        fill["virtual_stages"] = max(2, base["virtual_stages"])
    inherited_interleave = "schedule" not in given and base["schedule"] == "interleaved_1f1b"
    if pp == 1 or (inherited_interleave and fill["num_microbatches"] % pp):
        fill.update(schedule="1f1b", virtual_stages=1)
    same_pipeline = (pp, fill["num_microbatches"]) == (base["pp"], base["num_microbatches"])
    if "microbatch_group" not in given and (given.get("schedule", fill["schedule"]) != "interleaved_1f1b"
                                            or not same_pipeline):
        fill["microbatch_group"] = None  # the plan's N belongs to its own pp and micro-batches
    if tp == 1:
        fill["sequence_parallel"] = False
    if not ep_fits(tp, dp, fill["ep"]):  # an inherited ep that no longer lays out over tp × dp goes back to 1
        fill["ep"] = 1
    return ParallelConfig.parse(text, **fill)
