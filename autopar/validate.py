"""Checks of what users hand autopar — plans, options, output paths — before any work is done.

A plan file is JSON a person can edit, so nothing in it is trusted: `check_plan` verifies that it is
whole (types, degrees, stage numbering, finite and non-negative estimates that agree with their
breakdowns), `check_plan_for_graph` that its stages cover the model's layers exactly once and in order
with a tensor-parallel degree that splits every pattern, and `check_plan_for_cluster` that its layout
fits the cluster's shape. Each failure is a `PlanMismatchError` that says what is wrong and how to get
a sound plan (`autopar plan ... --out plan.json`). Codegen runs these checks before it shards anything,
so a tampered plan never trains.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from pathlib import Path
from typing import Any

from autopar.config import RECOMPUTE_MODES, SCHEDULES, ZERO_STAGES, ParallelConfig, PlannerOptions
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import BREAKDOWN_KEYS, Estimate, Plan

__all__ = [
    "MAX_DEVICES",
    "MAX_GLOBAL_BATCH",
    "MAX_TOP_K",
    "check_plan",
    "check_plan_for_graph",
    "check_plan_for_cluster",
    "check_device_runs",
    "check_options",
    "check_positive_int",
    "check_output_path",
    "check_saved_plan",
    "check_stages_for_graph",
    "rebuild_graph",
]

# The largest world size autopar plans for. The biggest published training runs use ~10^5 GPUs
# (Llama 3 405B: 16,384 H100, Dubey et al. 2024, §3.3); 2^20 leaves room above that and keeps the
# outer search (divisor enumeration over the world size) within seconds.
MAX_DEVICES = 2**20
# The largest global batch, in samples: Llama 3 405B trained on 16M tokens per step (Dubey et al. 2024,
# §3.4.1), 8,192 samples of 2,048 tokens; 2^24 samples is far beyond any published run and keeps the outer
# search's enumeration of micro-batch divisors at ~3 s (1e8 samples took 15 s on this repository's machine).
MAX_GLOBAL_BATCH = 2**24
# Runner-ups a plan keeps; each one can cost the search one more ILP, and a report shows a handful.
MAX_TOP_K = 100

_FIX = "make a fresh plan with `autopar plan MODEL --cluster ... --out plan.json` and do not edit it by hand"
_REL_TOL = 1e-6  # JSON keeps 17 significant digits; a recomputed figure agrees to far better than this


def _bad(where: str, what: str) -> PlanMismatchError:
    return PlanMismatchError(f"{where}: {what}; {_FIX}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _nonneg(where: str, name: str, v: Any) -> None:
    if not _is_real(v) or not math.isfinite(v) or v < 0:
        raise _bad(where, f"{name} = {v!r} must be a finite non-negative number")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL_TOL * max(abs(a), abs(b), 1e-12)


# ---------------------------------------------------------------- the plan on its own


def _check_config(cfg: ParallelConfig, where: str) -> None:
    for f in ("tp", "pp", "dp", "micro_batch_size", "num_microbatches", "virtual_stages"):
        v = getattr(cfg, f)
        if not _is_int(v) or v < 1:
            raise _bad(where, f"config.{f} = {v!r} must be a positive integer")
    if not _is_int(cfg.zero_stage) or cfg.zero_stage not in ZERO_STAGES:
        raise _bad(where, f"config.zero_stage = {cfg.zero_stage!r} must be one of {ZERO_STAGES}")
    if cfg.schedule not in SCHEDULES:
        raise _bad(where, f"config.schedule = {cfg.schedule!r} must be one of {SCHEDULES}")
    if not isinstance(cfg.recompute, str) or cfg.recompute not in RECOMPUTE_MODES:
        raise _bad(where, f"config.recompute = {cfg.recompute!r} must be one of {RECOMPUTE_MODES}")
    for f in dataclasses.fields(cfg):  # sequence_parallel, and flags added after this check was written
        if isinstance(f.default, bool) and not isinstance(getattr(cfg, f.name), bool):
            raise _bad(where, f"config.{f.name} = {getattr(cfg, f.name)!r} must be true or false")
    if cfg.world_size > MAX_DEVICES:
        raise _bad(where, f"tp·pp·dp = {cfg.world_size:,} devices exceeds autopar's bound of {MAX_DEVICES:,}")


def _check_estimate(est: Estimate, where: str, *, tokens_per_step: int | None) -> None:
    step = est.step_time_s
    if not _is_real(step) or not math.isfinite(step) or step <= 0:
        raise _bad(where, f"step_time_s = {step!r} must be a finite positive number of seconds")
    for name in ("tokens_per_s", "tflops_per_device", "mfu", "host_s"):
        _nonneg(where, name, getattr(est, name))
    if est.mfu > 1.0:
        raise _bad(where, f"mfu = {est.mfu:.9g}: no layout uses more than the devices' peak FLOP/s")
    for f in dataclasses.fields(est):  # every other figure, including fields added after this check was written
        v = getattr(est, f.name)
        if f.name == "breakdown" or isinstance(v, (bool, str)):
            continue
        if isinstance(v, dict):
            for k, x in v.items():
                _nonneg(where, f"{f.name}[{k!r}]", x)
        elif isinstance(v, (tuple, list)):
            if not all(isinstance(x, str) for x in v):
                raise _bad(where, f"{f.name} = {v!r} must be a list of strings")
        else:
            _nonneg(where, f.name, v)
    if getattr(est, "fits", True) is not True:
        raise _bad(where, f"fits = {est.fits!r}: a plan holds a layout that fits device memory "
                          f"({getattr(est, 'violated', '') or 'no constraint named'})")
    if not _is_int(est.peak_memory_bytes) or est.peak_memory_bytes < 0:
        raise _bad(where, f"peak_memory_bytes = {est.peak_memory_bytes!r} must be a non-negative integer")
    if set(est.breakdown) != set(BREAKDOWN_KEYS):
        raise _bad(where, f"breakdown has keys {sorted(est.breakdown)}; expected exactly {list(BREAKDOWN_KEYS)}")
    for k, v in est.breakdown.items():
        _nonneg(where, f"breakdown[{k!r}]", v)
    total = sum(est.breakdown.values())
    if not _close(total, step):
        raise _bad(where, f"breakdown sums to {total:.9g} s but step_time_s is {step:.9g} s")
    if est.host_s > step * (1 + _REL_TOL):
        raise _bad(where, f"host_s = {est.host_s:.9g} s exceeds the step time {step:.9g} s it is part of")
    if tokens_per_step is not None and not _close(est.tokens_per_s, tokens_per_step / step):
        raise _bad(where, f"tokens_per_s = {est.tokens_per_s:.9g} but global batch × seq_len / step_time_s = "
                          f"{tokens_per_step / step:.9g}")


def _check_solver(info: Any, where: str) -> None:
    if not isinstance(info.status, str) or not isinstance(info.solver, str):
        raise _bad(where, f"status {info.status!r} and solver {info.solver!r} must be strings")
    for name in ("gap", "solve_time_s", "ilp_time_s"):
        _nonneg(where, name, getattr(info, name))
    for name in ("configs_considered", "ilps_solved"):
        if not _is_int(getattr(info, name)) or getattr(info, name) < 0:
            raise _bad(where, f"{name} = {getattr(info, name)!r} must be a non-negative integer")


def check_plan(plan: Plan, *, where: str = "plan") -> None:
    """A plan is whole: degrees and stages agree, every number is finite, non-negative and consistent."""
    cfg = plan.config
    _check_config(cfg, where)
    for name in ("global_batch_size",):
        if not _is_int(getattr(plan, name)) or getattr(plan, name) < 1:
            raise _bad(where, f"{name} = {getattr(plan, name)!r} must be a positive integer")
    if plan.seq_len is not None and (not _is_int(plan.seq_len) or plan.seq_len < 1):
        raise _bad(where, f"seq_len = {plan.seq_len!r} must be a positive integer or null")
    for name in ("model_name", "graph_fingerprint", "cluster_name", "cluster_fingerprint"):
        if not isinstance(getattr(plan, name), str) or not getattr(plan, name):
            raise _bad(where, f"{name} = {getattr(plan, name)!r} must be a non-empty string")
    n = len(plan.stages)
    if [st.index for st in plan.stages] != list(range(n)):
        raise _bad(where, f"stage indices {[st.index for st in plan.stages]} must be 0..{n - 1} in order")
    seen: dict[str, int] = {}
    for st in plan.stages:
        w = f"{where}: stage {st.index}"
        if not _is_int(st.pp_rank) or st.pp_rank != st.index % cfg.pp:
            raise _bad(where, f"stage {st.index} is on pp_rank {st.pp_rank!r}; the schedules place stage i on "
                              f"rank i mod pp = {st.index % cfg.pp}")
        if not st.layers:
            raise _bad(where, f"stage {st.index} holds no layer; every pipeline stage needs at least one")
        for name in st.layers:
            if not isinstance(name, str) or not name:
                raise _bad(where, f"stage {st.index} lists layer {name!r}; layer names are non-empty strings")
            if name in seen:
                raise _bad(where, f"layer {name!r} is in stage {seen[name]} and again in stage {st.index}")
            seen[name] = st.index
        if not isinstance(st.recompute, str) or st.recompute not in RECOMPUTE_MODES:
            raise _bad(where, f"stage {st.index} recompute = {st.recompute!r} must be one of {RECOMPUTE_MODES}")
        _nonneg(w, "time_per_microbatch_s", st.time_per_microbatch_s)
        if not _is_int(st.peak_memory_bytes) or st.peak_memory_bytes < 0:
            raise _bad(w, f"peak_memory_bytes = {st.peak_memory_bytes!r} must be a non-negative integer")
        if not isinstance(st.memory_breakdown, dict):
            raise _bad(w, f"memory_breakdown = {st.memory_breakdown!r} must be an object of byte counts")
        for k, v in st.memory_breakdown.items():
            _nonneg(w, f"memory_breakdown[{k!r}]", v)
        parts = sum(st.memory_breakdown.values())
        if st.peak_memory_bytes and not st.memory_breakdown:
            raise _bad(w, f"peak_memory_bytes = {st.peak_memory_bytes:,} has no memory_breakdown")
        if st.memory_breakdown and abs(parts - st.peak_memory_bytes) > 1 + _REL_TOL * parts:
            raise _bad(w, f"memory_breakdown sums to {parts:,.0f} bytes but peak_memory_bytes is "
                          f"{st.peak_memory_bytes:,}")
    if plan.solver is not None:
        _check_solver(plan.solver, f"{where}: solver")
    tokens = plan.global_batch_size * (plan.seq_len or 1)
    _check_estimate(plan.estimate, f"{where}: estimate", tokens_per_step=tokens)
    slow = [st.index for st in plan.stages if st.time_per_microbatch_s > plan.estimate.step_time_s * (1 + _REL_TOL)]
    if slow:
        raise _bad(where, f"stage(s) {slow} take longer per micro-batch than the whole step "
                          f"({plan.estimate.step_time_s:.9g} s)")
    peak = max(st.peak_memory_bytes for st in plan.stages)
    if plan.estimate.peak_memory_bytes != peak:
        raise _bad(where, f"estimate.peak_memory_bytes = {plan.estimate.peak_memory_bytes:,} but the largest "
                          f"stage peak is {peak:,}")
    for i, (alt, est) in enumerate(plan.alternatives):
        _check_config(alt, f"{where}: alternatives[{i}]")
        if alt.world_size != cfg.world_size or alt.global_batch_size != plan.global_batch_size:
            raise _bad(where, f"config {cfg} uses {cfg.world_size} devices and global batch "
                              f"{plan.global_batch_size} but runner-up {i} ({alt}) uses {alt.world_size} and "
                              f"{alt.global_batch_size}: the config or its runner-ups were edited")
        _check_estimate(est, f"{where}: alternatives[{i}].estimate", tokens_per_step=tokens)


# ---------------------------------------------------------------- the plan against its model and cluster


def check_plan_for_graph(plan: Plan, graph: Any, *, where: str = "plan") -> None:
    """The plan was made for this graph: same fingerprint, its stages hold every layer of the graph
    exactly once and in order, and its tp splits every tensor-parallel pattern."""
    check_plan(plan, where=where)
    if plan.graph_fingerprint != graph.fingerprint:
        raise PlanMismatchError(
            f"{where} was made for model {plan.model_name!r} (graph fingerprint {plan.graph_fingerprint}) but "
            f"this model is {graph.model_name!r} (fingerprint {graph.fingerprint}); make a plan for this model "
            "with `autopar plan` or autopar.plan(model, cluster, ...)")
    check_stages_for_graph(plan.stages, graph, where=where)
    for layer in graph.layers:
        for pattern in layer.tp_patterns:
            if not pattern.max_degree_ok(plan.config.tp):
                raise _bad(where, f"layer {layer.name}: tp={plan.config.tp} does not divide its {pattern.kind} "
                                  f"pattern (heads={pattern.num_heads}, kv heads={pattern.num_kv_heads}, "
                                  f"vocab={pattern.vocab_size})")
    if plan.seq_len != graph.seq_len:
        raise _bad(where, f"seq_len = {plan.seq_len} but the model's example input has {graph.seq_len} tokens")
    flops = plan.global_batch_size * (graph.forward_flops + graph.backward_flops)
    for name, est in [("estimate", plan.estimate), *((f"alternatives[{i}]", e) for i, (_, e) in
                                                     enumerate(plan.alternatives))]:
        want = flops / est.step_time_s / plan.config.world_size / 1e12
        if est.tflops_per_device and not _close(est.tflops_per_device, want):  # 0: not priced (a hand-made plan)
            raise _bad(where, f"{name}.tflops_per_device = {est.tflops_per_device:.9g} but the model's FLOPs per step "
                              f"over step_time_s and {plan.config.world_size} devices give {want:.9g}")


def check_stages_for_graph(stages: Any, graph: Any, *, where: str = "plan") -> None:
    """`stages` (StagePlans, in index order) hold the graph's layers exactly once and in order."""
    expected = [la.name for la in graph.layers]
    known = set(expected)
    got = [name for st in stages for name in st.layers]
    unknown = [n for n in got if n not in known]
    if unknown:
        raise _bad(where, f"layer(s) {unknown[:5]} are not layers of {graph.model_name!r} (its layers: "
                          f"{_names(expected)})")
    missing = [n for n in expected if n not in set(got)]
    if missing:
        raise _bad(where, f"layer(s) {missing[:5]} of {graph.model_name!r} are in no stage; every layer must be "
                          "in exactly one stage")
    dup = sorted({n for n in got if got.count(n) > 1})
    if dup:
        raise _bad(where, f"layer(s) {dup[:5]} are in more than one stage")
    if got != expected:
        first = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        raise _bad(where, f"stages hold the layers out of order: position {first} is {got[first]!r} but the "
                          f"model runs {expected[first]!r} there; stages must follow the model's layer order")


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])}, …, {', '.join(names[-2:])}"


def check_plan_for_cluster(plan: Plan, cluster: Any, *, where: str = "plan") -> None:
    """The plan's layout fits the cluster: same world size, tensor parallelism inside one node."""
    tp, world = plan.config.tp, plan.config.world_size
    if world != cluster.world_size:
        raise PlanMismatchError(f"{where} is a layout of {world} devices (tp·pp·dp) but cluster {cluster.name} has "
                                f"{cluster.world_size}; plan for this cluster with `autopar plan`")
    per_node = cluster.devices_per_node
    if per_node % tp:
        raise _bad(where, f"tp={tp} does not divide the {per_node} devices of a {cluster.name} node, so a "
                          "tensor-parallel group would straddle nodes")


def rebuild_graph(plan: Plan) -> Any:
    """The graph of a plan's zoo model, rebuilt as `autopar plan` captured it, or None when the plan's model
    is not a zoo name or no rebuild matches its fingerprint (a factory model, or zoo options we cannot see)."""
    from autopar import zoo

    if plan.model_name not in zoo.names():
        return None
    from autopar.capture import capture
    from autopar.models import DTYPES, training_dtype

    first = training_dtype("local" if plan.cluster_name == "local" else "cluster")
    for dtype in [first, *(d for d in DTYPES.values() if d != first)]:
        try:
            graph = capture(*zoo.build(plan.model_name, seq_len=plan.seq_len, dtype=dtype))
        except AutoparError:
            return None
        if graph.fingerprint == plan.graph_fingerprint:
            return graph
    return None


# ---------------------------------------------------------------- options and paths


def check_device_runs(cluster: Any, dtype: Any) -> None:
    """The cluster's device lists a throughput for `dtype` (a torch.dtype or its name), so it can be priced."""
    name = str(dtype).removeprefix("torch.")
    try:
        cluster.device.peak_flops_for(name)
    except KeyError:
        runs = [d for d in ("float32", "bfloat16", "float16") if d in cluster.device.peak_flops]
        raise AutoparError(f"the model trains in {name} but device {cluster.device.name} of cluster {cluster.name!r} "
                           f"has no {name} throughput in the catalog; train in {' or '.join(runs)} (CLI: --dtype)"
                           ) from None


def check_positive_int(name: str, value: Any, *, bound: int | None = None) -> int:
    """`value` as a positive integer, or an AutoparError naming `name`, the value and the expected form."""
    if not _is_int(value):
        raise AutoparError(f"{name}={value!r} ({type(value).__name__}); it must be a positive integer")
    if value < 1:
        raise AutoparError(f"{name}={value}; it must be a positive integer")
    if bound is not None and value > bound:
        raise AutoparError(f"{name}={value:,} exceeds autopar's bound of {bound:,}")
    return value


def check_options(options: Any) -> PlannerOptions:
    """PlannerOptions whose every field has the right type and a usable value."""
    if options is None:
        return PlannerOptions()
    if not isinstance(options, PlannerOptions):
        raise AutoparError(f"options={options!r} ({type(options).__name__}); pass autopar.PlannerOptions(...) "
                           "or None")
    o = options
    for f in ("tp", "pp", "dp", "micro_batch_size", "num_microbatches", "virtual_stages"):
        if getattr(o, f) is not None:
            check_positive_int(f"PlannerOptions.{f}", getattr(o, f), bound=MAX_DEVICES if f in ("tp", "pp", "dp")
                               else None)
    check_positive_int("PlannerOptions.max_virtual_stages", o.max_virtual_stages)
    if not _is_int(o.top_k) or not 0 <= o.top_k <= MAX_TOP_K:
        raise AutoparError(f"PlannerOptions.top_k={o.top_k!r}; it must be an integer from 0 to {MAX_TOP_K} "
                           "(runner-up layouts kept)")
    t = o.time_limit_s
    if not _is_real(t) or not math.isfinite(t) or t <= 0:
        raise AutoparError(f"PlannerOptions.time_limit_s={t!r}; it must be a finite positive number of seconds")
    r = o.memory_reserve_fraction
    if not _is_real(r) or not 0.0 <= r < 1.0:
        raise AutoparError(f"PlannerOptions.memory_reserve_fraction={r!r}; it must be in [0, 1)")
    if o.sequence_parallel is not None and not isinstance(o.sequence_parallel, bool):
        raise AutoparError(f"PlannerOptions.sequence_parallel={o.sequence_parallel!r}; it must be True, False or "
                           "None")
    if o.zero_stage is not None and not _is_int(o.zero_stage):
        raise AutoparError(f"PlannerOptions.zero_stage={o.zero_stage!r}; it must be one of {ZERO_STAGES}")
    return o


def check_output_path(path: str | Path, flag: str) -> Path:
    """An output file that can be written: its folder is created when missing; refused when the path is a
    folder or the folder cannot be created or written — before any work is done."""
    p = Path(path)
    if str(path) == "" or p.is_dir():
        raise AutoparError(f"{flag} {str(path)!r} is a folder, not a file; give a file name such as plan.json")
    folder = p.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AutoparError(f"{flag} {path}: cannot create its folder {folder} ({e.strerror}); pick a writable "
                           "location") from e
    existed = p.exists()
    try:  # the one sure test (permissions, read-only and special file systems): open it as the writer will
        with open(p, "ab"):
            pass
    except OSError as e:
        raise AutoparError(f"{flag} {path}: cannot write there ({e.strerror}); pick a writable location") from e
    if not existed:
        p.unlink()
    return p


def check_saved_plan(plan: Plan, *, where: str = "plan") -> None:
    """What can be checked of a plan file without the user's model and cluster: the plan itself, its
    stages against its zoo model rebuilt as it was captured, its layout against its preset's node size."""
    from autopar.cluster import PRESETS

    check_plan(plan, where=where)
    graph = rebuild_graph(plan)
    if graph is not None:
        check_plan_for_graph(plan, graph, where=where)
    if plan.cluster_name in PRESETS:
        per_node = PRESETS[plan.cluster_name][3]
        world, tp = plan.config.world_size, plan.config.tp
        if world % per_node or per_node % tp:
            raise _bad(where, f"a {plan.cluster_name} node has {per_node} devices, so the world size "
                              f"(tp·pp·dp = {world}) must be a multiple of {per_node} and tp={tp} must divide it")
