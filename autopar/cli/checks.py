"""The CLI's checks of what a command is handed: output paths tried before any work, and a plan file held
against the cluster and model the command names (a plan checks itself on load, `Plan.check`; against a
model graph with `autopar.planner.plan_fit`)."""

from __future__ import annotations

from pathlib import Path

from autopar.capture.graph import ModelGraph
from autopar.cluster import PRESETS, Cluster
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import Plan, plan_error
from autopar.planner.plan_fit import check_plan_for_graph

__all__ = ["check_output_path", "check_plan_for_cluster", "check_saved_plan", "rebuild_graph"]


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


def check_plan_for_cluster(plan: Plan, cluster: Cluster, *, where: str = "plan") -> None:
    """The plan's layout fits the cluster: same world size, tensor parallelism inside one node."""
    tp, world = plan.config.tp, plan.config.world_size
    if world != cluster.world_size:
        raise PlanMismatchError(f"{where} is a layout of {world} devices (tp·pp·dp) but cluster {cluster.name} has "
                                f"{cluster.world_size}; plan for this cluster with `autopar plan`")
    per_node = cluster.devices_per_node
    if per_node % tp:
        raise plan_error(where, f"tp={tp} does not divide the {per_node} devices of a {cluster.name} node, so a "
                         "tensor-parallel group would straddle nodes")


def check_saved_plan(plan: Plan, *, where: str = "plan") -> None:
    """What can be checked of a plan file without the user's model and cluster: the plan itself, its
    stages against its zoo model rebuilt as it was captured, its layout against its preset's node size."""
    plan.check(where=where)
    graph = rebuild_graph(plan)
    if graph is not None:
        check_plan_for_graph(plan, graph, where=where)
    if plan.cluster_name in PRESETS:
        per_node = PRESETS[plan.cluster_name][3]
        world, tp = plan.config.world_size, plan.config.tp
        if world % per_node or per_node % tp:
            raise plan_error(where, f"a {plan.cluster_name} node has {per_node} devices, so the world size "
                             f"(tp·pp·dp = {world}) must be a multiple of {per_node} and tp={tp} must divide it")


def rebuild_graph(plan: Plan) -> ModelGraph | None:
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
