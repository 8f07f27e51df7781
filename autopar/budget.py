"""`budget`: which GPUs, how many, how long and at what cost, before anyone rents a cluster.

For every cluster kind and size of a sweep, the exact best plan (`autopar.plan`, every dimension of the
planner, gap 0) and the days it takes to train `tokens` at its step time:

    days = tokens / (global_batch · seq_len) × step_time_s / 86,400 / goodput

with the error band of published runs like the layout (`Estimate.band_lo/band_hi`) carried into a
day range; cost = GPUs × 24 × days × the user's price per GPU-hour (autopar holds no prices: none would
stay current). The answer is the Pareto front of (days, cost) (of GPU-hours without prices), the
fastest and cheapest points that meet the deadline and cost cap at the slow end of the band, and the
smallest cluster of each kind that fits the model at all.

The model is captured once; each point reuses the graph (its fingerprint and priced form) and plans only
what depends on the cluster. Runner-ups are not kept (`top_k=0`): a point needs only its optimum.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from autopar.capture.graph import ModelGraph
from autopar.checks import MAX_DEVICES, MAX_GLOBAL_BATCH, is_int, is_real
from autopar.cluster import Cluster
from autopar.config import PlannerOptions, check_options
from autopar.errors import AutoparError, InfeasiblePlanError
from autopar.plan import Plan

__all__ = ["BudgetPoint", "Budget", "budget", "pareto_front", "cluster_kinds", "DEFAULT_BATCH_TOKENS",
           "SECONDS_PER_DAY"]

SECONDS_PER_DAY = 86_400.0
# Llama 2 trained every size on "a global batch-size of 4M tokens" (Touvron et al. 2023, Table 1):
# 1,024 sequences of 4,096 tokens = 4 · 2^20.
DEFAULT_BATCH_TOKENS = 4 * 2**20


@dataclass(frozen=True, kw_only=True)
class BudgetPoint:
    """One cluster kind and size: its best plan and what training the tokens on it takes."""

    cluster: str  # preset name (or the cluster file's name)
    nodes: int
    gpus: int
    global_batch_size: int  # samples per step the plan was made for
    seq_len: int
    plan: Plan | None  # None: no layout fits this cluster (see `why`)
    why: str = ""  # why nothing fits (the planner's message)
    steps: float = 0.0  # tokens / (global_batch_size · seq_len)
    days: float = math.inf  # at the modelled step time, over the goodput
    days_lo: float = math.inf  # at the fast end of the band
    days_hi: float = math.inf  # at the slow end of the band (Estimate.pessimistic_step_time_s)
    gpu_hours: float = math.inf  # gpus × 24 × days
    price_per_gpu_hour: float | None = None
    cost: float | None = None  # gpu_hours × price; None without a price
    cost_hi: float | None = None  # at the slow end of the band
    # why this point predicts a longer time than a smaller cluster of its kind ("" when it does not): the cause,
    # "batch" (the global batch bounds data parallelism), "shape" (the GPU count is no multiple of the faster
    # layout's model-parallel group) or "cost_model" (wider collectives cost more than they save), and a note
    slower_cause: str = ""
    slower_note: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "plan"}
        d = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}
        if self.plan is not None:
            e = self.plan.estimate
            d["config"] = self.plan.config.to_dict()
            d["layout"] = str(self.plan.config)
            d["estimate"] = {"step_time_s": e.step_time_s, "pessimistic_step_time_s": e.pessimistic_step_time_s,
                             "band_lo": e.band_lo, "band_hi": e.band_hi, "band_runs": e.band_runs,
                             "band_basis": e.band_basis, "mfu": e.mfu, "tokens_per_s": e.tokens_per_s,
                             "peak_memory_bytes": e.peak_memory_bytes}
            d["solver"] = {"status": self.plan.solver.status, "gap": self.plan.solver.gap} if self.plan.solver \
                else None
        return d


@dataclass(frozen=True, kw_only=True)
class Budget:
    """A sweep's points and what it answers; indices refer to `points`."""

    model_name: str
    tokens: float
    goodput: float
    deadline_days: float | None
    max_cost: float | None
    points: tuple[BudgetPoint, ...]
    front: tuple[int, ...]  # Pareto front of (days, cost), or of (days, GPU-hours) without every price
    front_axis: str  # "cost" or "gpu_hours"
    fastest: int | None  # least days_hi among the points that meet the deadline and cost cap
    cheapest: int | None  # least cost_hi (GPU-hours at the slow end without prices) among them
    smallest: dict[str, int]  # cluster kind → its smallest swept size that fits (index)
    unmet: str = ""  # why no point meets the deadline / cost cap, and what would
    sweep_s: float = 0.0  # wall time of the sweep (plans), capture excluded
    sweep_cpu_s: float = 0.0  # CPU time of the sweep, forked workers included
    capture_s: float = 0.0
    load_avg: float = 0.0  # the machine's 1-minute load average when the sweep ended (its CPUs are shared)

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model_name, "tokens": self.tokens, "goodput": self.goodput,
                "deadline_days": self.deadline_days, "max_cost": self.max_cost,
                "points": [p.to_dict() for p in self.points], "front": list(self.front),
                "front_axis": self.front_axis, "fastest": self.fastest, "cheapest": self.cheapest,
                "smallest": self.smallest, "unmet": self.unmet, "sweep_s": self.sweep_s,
                "sweep_cpu_s": self.sweep_cpu_s, "capture_s": self.capture_s,
                "load_avg": self.load_avg}


def pareto_front(pairs: Sequence[tuple[float, float]]) -> tuple[int, ...]:
    """Indices of the pairs no other pair beats on both (no worse on each, better on one), by the first
    value; of equal pairs, the first. Infinite pairs are never on it."""
    order = sorted((i for i, (a, b) in enumerate(pairs) if math.isfinite(a) and math.isfinite(b)),
                   key=lambda i: (pairs[i][0], pairs[i][1], i))
    front: list[int] = []
    best_b = math.inf
    for i in order:
        if pairs[i][1] < best_b:
            front.append(i)
            best_b = pairs[i][1]
    return tuple(front)


def _check_inputs(tokens: Any, goodput: Any, deadline_days: Any, max_cost: Any, prices: Mapping[str, Any],
                  nodes: Sequence[int], workers: Any) -> None:
    if not (is_real(tokens) and math.isfinite(tokens) and tokens > 0):
        raise AutoparError(f"tokens = {tokens!r}: give the positive number of tokens to train on, e.g. 2e12")
    if not (is_real(goodput) and 0 < goodput <= 1):
        raise AutoparError(f"goodput = {goodput!r}: give the fraction of wall time spent training, in (0, 1] "
                           "(1.0: no restarts or evaluation; Meta reports >0.9 for Llama 3)")
    if deadline_days is not None and not (is_real(deadline_days) and deadline_days > 0):
        raise AutoparError(f"deadline = {deadline_days!r} days: give a positive duration, e.g. 30d")
    if max_cost is not None and not (is_real(max_cost) and max_cost > 0):
        raise AutoparError(f"max_cost = {max_cost!r}: give a positive amount in the currency of the prices")
    for kind, price in prices.items():
        if not (is_real(price) and math.isfinite(price) and price > 0):
            raise AutoparError(f"price of {kind} = {price!r}: give a positive price per GPU-hour, e.g. {kind}=2.5")
    if not is_int(workers) or workers < 1:
        raise AutoparError(f"workers = {workers!r}: give a positive number of processes (1: plan in this one)")
    if not nodes:
        raise AutoparError("no cluster sizes to sweep; give nodes, e.g. --nodes 8..512 or --nodes 8,16,32")
    for n in nodes:
        if not is_int(n) or n < 1:
            raise AutoparError(f"nodes {n!r}: cluster sizes are positive numbers of nodes, e.g. --nodes 8..512")


def _batch_sizes(batch_tokens: Sequence[int], seq_len: int) -> tuple[int, ...]:
    """Global batches in samples: each token count must be whole sequences."""
    out = []
    for t in batch_tokens:
        if not is_int(t) or t < seq_len or t % seq_len:
            near = max(1, round(t / seq_len)) if is_real(t) and t > 0 else 1
            raise AutoparError(f"global batch of {t!r} tokens is not a whole number of {seq_len}-token sequences; "
                               f"give a multiple of {seq_len}, e.g. {near * seq_len:,} ({near} sequences)")
        if t // seq_len > MAX_GLOBAL_BATCH:
            raise AutoparError(f"global batch of {t:,} tokens is {t // seq_len:,} sequences, above autopar's bound "
                               f"of {MAX_GLOBAL_BATCH:,}")
        out.append(t // seq_len)
    return tuple(sorted(set(out)))


def _file_price(path: str) -> float | None:
    """A cluster file's `price_per_gpu_hour` (Cluster.from_file has checked it), or None."""
    import json
    from pathlib import Path

    try:
        import tomllib
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    text = Path(path).read_bytes()
    data = json.loads(text) if path.lower().endswith(".json") else tomllib.loads(text.decode())
    return data.get("price_per_gpu_hour")


def cluster_kinds(clusters: Sequence[str | Cluster], prices: dict[str, float]) -> list[Cluster]:
    """Each kind as a Cluster (swept over nodes): presets by name, files by path (their price_per_gpu_hour
    into `prices` unless given there), Cluster objects as given."""
    if isinstance(clusters, (str, Cluster)) or not clusters:
        raise AutoparError(f"clusters = {clusters!r}: give a list of preset names (autopar clusters lists them), "
                           "cluster files or Cluster objects, e.g. ['dgx-h100', 'dgx-a100-80gb']")
    out: list[Cluster] = []
    unknown = []
    for c in clusters:
        if isinstance(c, Cluster):
            out.append(c)
        elif isinstance(c, str) and c in Cluster.presets():
            out.append(Cluster.preset(c))
        elif isinstance(c, str) and c.lower().endswith((".toml", ".json")):
            out.append(Cluster.from_file(c))
            price = _file_price(c)
            if price is not None:
                prices.setdefault(out[-1].name, price)
        else:
            unknown.append(c)
    if unknown:
        raise AutoparError(f"unknown cluster(s) {', '.join(map(repr, unknown))}; give preset names "
                           f"({', '.join(Cluster.presets())}) or cluster files (.toml/.json)")
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise AutoparError(f"clusters {names} name a kind twice; give each once")
    return out


def _point(graph: ModelGraph, cluster: Cluster, batches: tuple[int, ...], tokens: float, goodput: float,
           price: float | None, options: PlannerOptions) -> BudgetPoint:
    """The best plan over the global batches on this cluster (least days at the modelled step time)."""
    from autopar.api import plan as make_plan

    seq = graph.seq_len or 1
    best: BudgetPoint | None = None
    why = ""
    for b in batches:
        try:
            p = make_plan(graph, cluster, global_batch_size=b, options=options)
        except InfeasiblePlanError as e:
            why = why or str(e)
            continue
        steps = tokens / (b * seq)
        e = p.estimate
        days = steps * e.step_time_s / SECONDS_PER_DAY / goodput
        gpu_h = cluster.world_size * 24.0 * days
        pt = BudgetPoint(cluster=cluster.name, nodes=cluster.nodes, gpus=cluster.world_size, global_batch_size=b,
                         seq_len=seq, plan=p, steps=steps, days=days, days_lo=days * (1 + e.band_lo),
                         days_hi=steps * e.pessimistic_step_time_s / SECONDS_PER_DAY / goodput, gpu_hours=gpu_h,
                         price_per_gpu_hour=price, cost=None if price is None else gpu_h * price,
                         cost_hi=None if price is None else gpu_h * (1 + e.band_hi) * price)
        if best is None or pt.days < best.days:
            best = pt
    if best is None:
        return BudgetPoint(cluster=cluster.name, nodes=cluster.nodes, gpus=cluster.world_size,
                           global_batch_size=batches[-1], seq_len=seq, plan=None, why=why, price_per_gpu_hour=price)
    return best


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (forked workers)."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


_FORKED: dict[str, Any] = {}  # what forked workers inherit: the graph and the sweep's constants


def _forked_point(job: tuple[Cluster, float | None]) -> tuple[BudgetPoint, dict[str, Any] | None]:
    point = _point(_FORKED["graph"], job[0], *_FORKED["args"], job[1], _FORKED["options"])
    # sent back as JSON-able data: a Plan travels as its dict
    return dataclasses.replace(point, plan=None), (point.plan.to_dict() if point.plan else None)


def _sweep(graph: ModelGraph, jobs: list[tuple[Cluster, float | None]], batches: tuple[int, ...], tokens: float,
           goodput: float, options: PlannerOptions, workers: int) -> list[BudgetPoint]:
    """Each (cluster, price) job's point, in order: in this process, or in `workers` forked processes."""
    import multiprocessing as mp

    if workers <= 1 or len(jobs) < 2 or "fork" not in mp.get_all_start_methods():
        return [_point(graph, c, batches, tokens, goodput, price, options) for c, price in jobs]
    _FORKED.update(graph=graph, args=(batches, tokens, goodput), options=options)
    try:
        with mp.get_context("fork").Pool(min(workers, len(jobs))) as pool:
            done = pool.map(_forked_point, jobs, chunksize=1)
    finally:
        _FORKED.clear()
    return [dataclasses.replace(pt, plan=Plan.from_dict(d) if d else None) for pt, d in done]


def _slower(p: BudgetPoint, q: BudgetPoint, batches: tuple[int, ...]) -> tuple[str, str]:
    """Why p (more GPUs) predicts longer than q (fewer, of its kind), as (cause, note). q's layout spread
    over p's GPUs by data parallelism keeps its model-parallel group (tp·cp·pp) and needs a global batch the
    wider data-parallel degree divides: without one, the batch bounds parallelism ("batch"); when p's GPUs
    are no multiple of that group, the cluster's shape does ("shape"); else the cost model prices the wider
    layout's collectives and stragglers above the compute it saves ("cost_model")."""
    c = q.plan.config
    group = c.world_size // c.dp
    head = f"slower than {q.nodes} node(s) ({_fmt(q.days)} d)"
    if p.gpus % group:
        return "shape", (f"{head}: that layout's model-parallel group (tp·cp·pp = {group}) does not divide {p.gpus} "
                         "GPUs, and no layout of these GPUs does better")
    dp = p.gpus // group
    if not any(b % dp == 0 for b in batches):
        return "batch", (f"batch-bound: {head}; spreading its layout here needs dp={dp}, which does not divide a "
                         f"global batch of {', '.join(map(str, batches))} sequences: a larger or rounder global "
                         "batch lets these GPUs help")
    return "cost_model", (f"{head} though its layout could spread to dp={dp}: the cost model prices the wider "
                          "collectives and stragglers above the compute saved")


def _fmt(x: float) -> str:
    return f"{x:.3g}"


def _up(x: float) -> str:
    """x to 3 significant digits, rounded up (a deadline that is then met)."""
    k = 2 - math.floor(math.log10(x)) if x > 0 else 0
    return f"{math.ceil(x * 10**k) / 10**k:g}"


def _annotate(points: list[BudgetPoint], batches: tuple[int, ...]) -> list[BudgetPoint]:
    """Each point that predicts a longer time than a smaller cluster of its kind, with the reason."""
    out = []
    for p in points:
        smaller = [q for q in points if q.cluster == p.cluster and q.gpus < p.gpus and q.fits]
        faster = min(smaller, key=lambda q: q.days, default=None)
        if p.fits and faster is not None and p.days > faster.days * (1 + 1e-9):
            cause, note = _slower(p, faster, batches)
            p = dataclasses.replace(p, slower_cause=cause, slower_note=note)
        out.append(p)
    return out


def _choose(points: list[BudgetPoint], deadline_days: float | None, max_cost: float | None,
            priced: bool) -> tuple[int | None, int | None, str]:
    """The fastest and cheapest points that meet the deadline and cost cap at the slow end of the band."""
    fit = [i for i, p in enumerate(points) if p.fits]
    ok = [i for i in fit if (deadline_days is None or points[i].days_hi <= deadline_days)
          and (max_cost is None or points[i].cost_hi <= max_cost)]
    if ok:
        def cost(i: int) -> float:  # at the slow end; GPU-hours without prices
            return points[i].cost_hi if priced else points[i].gpus * 24.0 * points[i].days_hi

        return (min(ok, key=lambda i: (points[i].days_hi, cost(i))),
                min(ok, key=lambda i: (cost(i), points[i].days_hi)), "")
    quickest = min(fit, key=lambda i: points[i].days_hi)
    q = points[quickest]
    parts = []
    if deadline_days is not None:
        parts.append(f"the deadline of {deadline_days:g} days is met by no swept cluster at the slow end of the band: "
                     f"the fastest, {q.nodes} × {q.cluster} ({q.gpus} GPUs), needs {_up(q.days_hi)} days "
                     f"({_fmt(q.days)} modelled)")
    if max_cost is not None:
        cheap = min(fit, key=lambda i: points[i].cost_hi)
        parts.append(f"the cost cap of {max_cost:,.0f} is met by none: the cheapest, {points[cheap].nodes} × "
                     f"{points[cheap].cluster}, costs {points[cheap].cost_hi:,.0f} at the slow end")
    if deadline_days is not None and max_cost is not None:
        in_time = [i for i in fit if points[i].days_hi <= deadline_days]
        if in_time:
            c = min(in_time, key=lambda i: points[i].cost_hi)
            parts.append(f"within the deadline the least cost is {points[c].cost_hi:,.0f} ({points[c].nodes} × "
                         f"{points[c].cluster})")
    largest = max(fit, key=lambda i: points[i].gpus)
    hint = (f"; allow ≥ {_up(q.days_hi)} days, more nodes than {points[largest].nodes}, a larger global batch or "
            "faster GPUs")
    return None, None, "; ".join(parts) + hint


def budget(model: Any, *, tokens: float, clusters: Sequence[str | Cluster], nodes: Sequence[int],
           global_batch_tokens: int | Sequence[int] = DEFAULT_BATCH_TOKENS, prices: Mapping[str, float] | None = None,
           deadline_days: float | None = None, max_cost: float | None = None, goodput: float = 1.0,
           example_inputs: tuple | None = None, options: PlannerOptions | None = None, workers: int = 1) -> Budget:
    """Plan `model` (a ModelGraph, or an nn.Module with example_inputs) on every cluster kind × size and
    answer how long training `tokens` takes and what it costs (see the module docstring).

    clusters: preset names, cluster files or Cluster objects (each swept over `nodes`); prices: cluster
    name → price per GPU-hour, from the user only; global_batch_tokens: one global batch or several
    (each a whole number of sequences), each point taking the one that trains fastest; workers: processes
    that plan points at once (forked, sharing the captured graph; 1: this process)."""
    prices = dict(prices or {})
    _check_inputs(tokens, goodput, deadline_days, max_cost, prices, nodes, workers)
    kinds = cluster_kinds(clusters, prices)
    unpriced_keys = sorted(set(prices) - {k.name for k in kinds})
    if unpriced_keys:
        raise AutoparError(f"prices for {unpriced_keys}, which are not among the clusters "
                           f"{[k.name for k in kinds]}; price each swept cluster by its name")
    priced = all(k.name in prices for k in kinds)
    if max_cost is not None and not priced:
        missing = [k.name for k in kinds if k.name not in prices]
        raise AutoparError(f"max_cost needs a price for every cluster; none for {missing}: give --price "
                           f"{missing[0]}=PRICE_PER_GPU_HOUR (autopar holds no prices)")
    for n in nodes:
        for k in kinds:
            if n * k.devices_per_node > MAX_DEVICES:
                raise AutoparError(f"{n} nodes of {k.name} are {n * k.devices_per_node:,} devices; autopar plans "
                                   f"for at most {MAX_DEVICES:,}")
    t0 = time.perf_counter()
    graph = model
    if not isinstance(model, ModelGraph):
        from autopar.capture import capture

        if example_inputs is None:
            raise AutoparError("budget got an nn.Module without example_inputs; pass example_inputs=(x,) or a "
                               "ModelGraph from autopar.capture(model, x)")
        graph = capture(model, example_inputs)
    if not graph.seq_len:
        raise AutoparError(f"{graph.model_name} takes no token sequence (seq_len unknown); budget counts training "
                           "in tokens: capture the model with (batch, seq_len) token inputs")
    capture_s = time.perf_counter() - t0
    batch_tokens = (global_batch_tokens,) if is_real(global_batch_tokens) else tuple(global_batch_tokens)
    batches = _batch_sizes(batch_tokens, graph.seq_len)
    opts = dataclasses.replace(check_options(options), top_k=0)
    graph.fingerprint  # noqa: B018 - hashed once here, not inside the first point's plan
    t1, c1 = time.perf_counter(), _cpu_s()
    jobs = [(dataclasses.replace(k, nodes=n), prices.get(k.name)) for k in kinds for n in sorted(set(nodes))]
    points = _sweep(graph, jobs, batches, tokens, goodput, opts, workers)
    sweep_s, sweep_cpu_s = time.perf_counter() - t1, _cpu_s() - c1
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if not any(p.fits for p in points):
        big = max(points, key=lambda p: p.gpus)
        raise InfeasiblePlanError(f"{graph.model_name} fits on none of the swept clusters "
                                  f"({', '.join(k.name for k in kinds)} × {min(nodes)}..{max(nodes)} nodes). "
                                  f"On the largest, {big.nodes} × {big.cluster}: {big.why}")
    points = _annotate(points, batches)
    pairs = [(p.days, (p.cost if priced else p.gpu_hours) if p.fits else math.inf) for p in points]
    fastest, cheapest, unmet = _choose(points, deadline_days, max_cost, priced)
    smallest = {}
    for k in kinds:
        fitting = [i for i, p in enumerate(points) if p.cluster == k.name and p.fits]
        if fitting:
            smallest[k.name] = min(fitting, key=lambda i: points[i].gpus)
    return Budget(model_name=graph.model_name, tokens=float(tokens), goodput=float(goodput),
                  deadline_days=deadline_days, max_cost=max_cost, points=tuple(points), front=pareto_front(pairs),
                  front_axis="cost" if priced else "gpu_hours", fastest=fastest, cheapest=cheapest,
                  smallest=smallest, unmet=unmet, sweep_s=sweep_s, sweep_cpu_s=sweep_cpu_s, capture_s=capture_s,
                  load_avg=load_avg)
