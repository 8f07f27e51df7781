"""`Plan` and `Estimate`: the planner's answer, saved as JSON and read back by codegen and the CLI.

A plan is self-describing: its config, its stage cuts (layer names per pipeline stage, in order),
its predicted cost, the runner-ups, solver status, and fingerprints of the model graph and cluster
it was made for (codegen refuses a plan for another model or world size).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.checks import MAX_DEVICES, REL_TOL, check_flags, check_number, close, is_int, is_real
from autopar.config import RECOMPUTE_MODES, SCHEDULES, ZERO_STAGES, ParallelConfig
from autopar.errors import PlanMismatchError

__all__ = ["Estimate", "StagePlan", "SolverInfo", "Plan", "PLAN_SCHEMA_VERSION", "BREAKDOWN_KEYS", "PLAN_FIX",
           "plan_error"]

PLAN_SCHEMA_VERSION = 1

# The components of a step, in seconds, that sum to step_time_s (docs/design.md §3).
BREAKDOWN_KEYS = ("compute", "recompute", "tp_comm", "pp_comm", "pipeline_bubble", "dp_comm", "optimizer")


@dataclass(frozen=True, kw_only=True)
class Estimate:
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float  # model FLOPs (no recompute) per second per device, in TFLOP/s
    mfu: float  # model FLOPs utilisation against the device's peak
    peak_memory_bytes: int  # the largest stage's peak per device
    breakdown: dict[str, float]  # keys from BREAKDOWN_KEYS, seconds, summing to step_time_s
    # of breakdown's compute and optimizer: framework host overhead (DTensor dispatch on CPU), priced from
    # the profile's host floor rather than its kernel tables; calibration scales the two apart
    host_s: float = 0.0
    # whether the layout fits device memory; a layout over memory is still priced (autopar.estimate), with
    # the constraint it breaks (e.g. "memory_rank0") and what it needs against what is usable
    fits: bool = True
    violated: str = ""
    memory_breakdown: dict[str, int] = field(default_factory=dict)  # the peak rank's bytes by category
    memory_capacity_bytes: int = 0  # usable per device (device memory less the reserve); 0 when unknown
    # the predicted torch.cuda.max_memory_reserved: the peak plus the caching allocator's fragmentation
    # (cost_models.memory.reserved_bytes); 0 in plans written before it
    reserved_bytes: int = 0
    notes: tuple[str, ...] = ()  # how the model was priced where it matters, e.g. its unfused eager kernels
    # the error band of published runs like this layout (cost_models.error_band): their published step times
    # fell within step_time_s · [1 + band_lo, 1 + band_hi]; band_runs = 0 when no band applies (a measured
    # profile, a CPU, or plans written before bands)
    band_lo: float = 0.0
    band_hi: float = 0.0
    band_runs: int = 0
    band_basis: str = ""  # what those runs share with the layout, e.g. "fsdp on a100"

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(self.notes))
        if not -1.0 < self.band_lo <= self.band_hi or self.band_runs < 0:
            raise ValueError(f"Estimate band [{self.band_lo}, {self.band_hi}] over {self.band_runs} runs: "
                             "need −1 < band_lo ≤ band_hi and band_runs ≥ 0")
        unknown = set(self.breakdown) - set(BREAKDOWN_KEYS)
        if unknown:
            raise ValueError(f"Estimate.breakdown has unknown keys {sorted(unknown)}; expected {BREAKDOWN_KEYS}")
        total = sum(self.breakdown.values())
        if self.breakdown and abs(total - self.step_time_s) > 1e-6 * max(1.0, self.step_time_s):
            raise ValueError(f"Estimate.breakdown sums to {total} s but step_time_s is {self.step_time_s} s")


    @property
    def pessimistic_step_time_s(self) -> float:
        """The step time at the slow end of the band (step_time_s without a band)."""
        return self.step_time_s * (1.0 + self.band_hi)


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage (with virtual stages: one model chunk), layers in execution order."""

    index: int
    layers: tuple[str, ...]
    pp_rank: int  # which pipeline rank holds this chunk
    recompute: str  # the stage's recompute mode (RECOMPUTE_MODES); with layer_recompute, its most common one
    time_per_microbatch_s: float  # forward + backward (+ recompute) incl. TP comm, one micro-batch
    peak_memory_bytes: int  # per device
    memory_breakdown: dict[str, int] = field(default_factory=dict)  # weights, grads, optimizer, activations, ...
    # one mode per layer when the stage mixes modes (k of its n layers recompute); () when every layer
    # uses `recompute` (and in plans written before per-layer recompute)
    layer_recompute: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        object.__setattr__(self, "layer_recompute", tuple(self.layer_recompute))
        bad = sorted({self.recompute, *self.layer_recompute} - set(RECOMPUTE_MODES))
        if bad:
            raise ValueError(f"stage {self.index}: unknown recompute modes {bad}; expected from {RECOMPUTE_MODES}")
        if self.layer_recompute and len(self.layer_recompute) != len(self.layers):
            raise ValueError(f"stage {self.index}: {len(self.layer_recompute)} layer recompute modes for "
                             f"{len(self.layers)} layers")

    @property
    def layer_modes(self) -> tuple[str, ...]:
        """The recompute mode of each layer, in order."""
        return self.layer_recompute or (self.recompute,) * len(self.layers)

    def recompute_of(self, layer: str) -> str:
        """The recompute mode of one of this stage's layers (by name)."""
        return self.layer_modes[self.layers.index(layer)]


@dataclass(frozen=True, kw_only=True)
class SolverInfo:
    status: str  # "optimal" | "time_limit" | ...
    gap: float  # relative optimality gap, 0.0 when proved optimal
    solver: str  # e.g. "HiGHS", "CBC"
    solve_time_s: float  # wall time of the whole search
    configs_considered: int
    ilps_solved: int = 0  # stage-cut ILPs the search had to solve (the rest were pruned by bounds)
    ilp_time_s: float = 0.0  # of solve_time_s: inside the ILP solver (model building included)


@dataclass(frozen=True, kw_only=True)
class Plan:
    config: ParallelConfig
    stages: tuple[StagePlan, ...]
    estimate: Estimate
    model_name: str
    graph_fingerprint: str
    cluster_name: str
    cluster_fingerprint: str
    global_batch_size: int
    seq_len: int | None
    solver: SolverInfo | None = None
    alternatives: tuple[tuple[ParallelConfig, Estimate], ...] = ()
    schema_version: int = PLAN_SCHEMA_VERSION
    # the router load imbalance the MoE layers were priced at (PlannerOptions.router_skew); None: the captured
    # graph's own. graph_fingerprint is the captured model's either way, so the plan runs on it
    router_skew: float | None = None
    # how the priced program trains (autopar.capture.targets: "loss_fn" or "own:<arg>"); "" in plans written
    # before it was recorded. Not part of the layout: a run under the other loss trains this plan (plan_fit.py)
    loss_mode: str = ""

    def __post_init__(self) -> None:
        expected = self.config.pp * self.config.virtual_stages
        if len(self.stages) != expected:
            raise ValueError(f"plan has {len(self.stages)} stages; pp × virtual_stages = {expected}")
        if self.config.global_batch_size != self.global_batch_size:
            raise ValueError(
                f"config's dp·mbs·m = {self.config.global_batch_size} ≠ global_batch_size {self.global_batch_size}"
            )

    @property
    def world_size(self) -> int:
        return self.config.world_size

    # ---- serialization ----
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["config"] = self.config.to_dict()
        d["alternatives"] = [{"config": c.to_dict(), "estimate": dataclasses.asdict(e)} for c, e in self.alternatives]
        if d["router_skew"] is None:  # plans priced at the captured graph's own imbalance read as before
            del d["router_skew"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        d = dict(d)
        version = d.get("schema_version")
        if version != PLAN_SCHEMA_VERSION:
            raise ValueError(f"plan schema version {version}; this autopar reads version {PLAN_SCHEMA_VERSION}")
        d["config"] = ParallelConfig.from_dict(d["config"])
        d["stages"] = tuple(StagePlan(**{**s, "layers": tuple(s["layers"])}) for s in d["stages"])
        d["estimate"] = Estimate(**d["estimate"])
        d["solver"] = SolverInfo(**d["solver"]) if d.get("solver") else None
        d["alternatives"] = tuple(
            (ParallelConfig.from_dict(a["config"]), Estimate(**a["estimate"])) for a in d.get("alternatives", ())
        )
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """The plan in a JSON file, refused unless whole and consistent (`check`): nothing in it is trusted."""
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise TypeError(f"the file holds a JSON {type(data).__name__}, not a plan object")
            plan = cls.from_dict(data)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                AttributeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise PlanMismatchError(
                f"cannot read plan {path}: {what}; write one with `autopar plan ... --out {path}`"
            ) from e
        plan.check(where=f"plan {path}")
        return plan

    def check(self, *, where: str = "plan") -> None:
        """Refuse a plan that is not whole: degrees and stages agree, every number is finite, non-negative and
        consistent with the others (a plan file is JSON a person can edit). Its fit to a model graph is
        checked where the two meet (`autopar.codegen.check.check_plan`), to a cluster by the CLI command."""
        _check_plan(self, where)


# ---------------------------------------------------------------- a plan on its own: Plan.check

# how to get a sound plan, the end of every message that refuses one
PLAN_FIX = "make a fresh plan with `autopar plan MODEL --cluster ... --out plan.json` and do not edit it by hand"


def plan_error(where: str, what: str) -> PlanMismatchError:
    """The error refusing a plan: where, what is wrong, and how to get a sound plan."""
    return PlanMismatchError(f"{where}: {what}; {PLAN_FIX}")


def _nonneg(where: str, name: str, v: Any) -> None:
    check_number(name, v, error=PlanMismatchError, where=where, fix=PLAN_FIX)


def _check_config(cfg: ParallelConfig, where: str) -> None:
    for f in ("tp", "pp", "dp", "micro_batch_size", "num_microbatches", "virtual_stages"):
        v = getattr(cfg, f)
        if not is_int(v) or v < 1:
            raise plan_error(where, f"config.{f} = {v!r} must be a positive integer")
    if not is_int(cfg.zero_stage) or cfg.zero_stage not in ZERO_STAGES:
        raise plan_error(where, f"config.zero_stage = {cfg.zero_stage!r} must be one of {ZERO_STAGES}")
    if cfg.schedule not in SCHEDULES:
        raise plan_error(where, f"config.schedule = {cfg.schedule!r} must be one of {SCHEDULES}")
    if not isinstance(cfg.recompute, str) or cfg.recompute not in RECOMPUTE_MODES:
        raise plan_error(where, f"config.recompute = {cfg.recompute!r} must be one of {RECOMPUTE_MODES}")
    check_flags(cfg, error=PlanMismatchError, where=f"{where}: config", fix=PLAN_FIX)  # flags added later too
    if cfg.world_size > MAX_DEVICES:
        raise plan_error(where, f"tp·pp·dp = {cfg.world_size:,} devices exceeds autopar's bound of {MAX_DEVICES:,}")


def _check_estimate(est: Estimate, where: str, *, tokens_per_step: int | None) -> None:
    step = est.step_time_s
    check_number("step_time_s", step, positive=True, error=PlanMismatchError, where=where, fix=PLAN_FIX)
    for name in ("tokens_per_s", "tflops_per_device", "mfu", "host_s"):
        _nonneg(where, name, getattr(est, name))
    if est.mfu > 1.0:
        raise plan_error(where, f"mfu = {est.mfu:.9g}: no layout uses more than the devices' peak FLOP/s")
    for f in dataclasses.fields(est):  # every other figure, including fields added after this check was written
        v = getattr(est, f.name)
        if f.name in ("breakdown", "band_lo", "band_hi") or isinstance(v, (bool, str)):
            continue
        if isinstance(v, dict):
            for k, x in v.items():
                _nonneg(where, f"{f.name}[{k!r}]", x)
        elif isinstance(v, (tuple, list)):
            if not all(isinstance(x, str) for x in v):
                raise plan_error(where, f"{f.name} = {v!r} must be a list of strings")
        else:
            _nonneg(where, f.name, v)
    for name in ("band_lo", "band_hi"):  # signed: published runs of a kind were faster or slower than priced
        v = getattr(est, name)
        if not (is_real(v) and math.isfinite(v)):
            raise plan_error(where, f"{name} = {v!r} must be a finite number")
    if not -1.0 < est.band_lo <= est.band_hi:
        raise plan_error(where, f"band [{est.band_lo:.9g}, {est.band_hi:.9g}] must satisfy −1 < band_lo ≤ band_hi")
    if getattr(est, "fits", True) is not True:
        raise plan_error(where, f"fits = {est.fits!r}: a plan holds a layout that fits device memory "
                         f"({getattr(est, 'violated', '') or 'no constraint named'})")
    check_number("peak_memory_bytes", est.peak_memory_bytes, integer=True, error=PlanMismatchError, where=where,
                  fix=PLAN_FIX)
    if set(est.breakdown) != set(BREAKDOWN_KEYS):
        raise plan_error(where, f"breakdown has keys {sorted(est.breakdown)}; expected exactly {list(BREAKDOWN_KEYS)}")
    for k, v in est.breakdown.items():
        _nonneg(where, f"breakdown[{k!r}]", v)
    total = sum(est.breakdown.values())
    if not close(total, step):
        raise plan_error(where, f"breakdown sums to {total:.9g} s but step_time_s is {step:.9g} s")
    if est.host_s > step * (1 + REL_TOL):
        raise plan_error(where, f"host_s = {est.host_s:.9g} s exceeds the step time {step:.9g} s it is part of")
    if tokens_per_step is not None and not close(est.tokens_per_s, tokens_per_step / step):
        raise plan_error(where, f"tokens_per_s = {est.tokens_per_s:.9g} but global batch × seq_len / step_time_s = "
                         f"{tokens_per_step / step:.9g}")


def _check_solver(info: Any, where: str) -> None:
    if not isinstance(info.status, str) or not isinstance(info.solver, str):
        raise plan_error(where, f"status {info.status!r} and solver {info.solver!r} must be strings")
    for name in ("gap", "solve_time_s", "ilp_time_s"):
        _nonneg(where, name, getattr(info, name))
    for name in ("configs_considered", "ilps_solved"):
        if not is_int(getattr(info, name)) or getattr(info, name) < 0:
            raise plan_error(where, f"{name} = {getattr(info, name)!r} must be a non-negative integer")


def _check_plan(plan: Plan, where: str) -> None:
    cfg = plan.config
    _check_config(cfg, where)
    for name in ("global_batch_size",):
        if not is_int(getattr(plan, name)) or getattr(plan, name) < 1:
            raise plan_error(where, f"{name} = {getattr(plan, name)!r} must be a positive integer")
    if plan.seq_len is not None and (not is_int(plan.seq_len) or plan.seq_len < 1):
        raise plan_error(where, f"seq_len = {plan.seq_len!r} must be a positive integer or null")
    for name in ("model_name", "graph_fingerprint", "cluster_name", "cluster_fingerprint"):
        if not isinstance(getattr(plan, name), str) or not getattr(plan, name):
            raise plan_error(where, f"{name} = {getattr(plan, name)!r} must be a non-empty string")
    if not isinstance(plan.loss_mode, str):
        raise plan_error(where, f"loss_mode = {plan.loss_mode!r} must be a string (\"loss_fn\" or \"own:labels\")")
    if plan.router_skew is not None and (not is_real(plan.router_skew) or not 1.0 <= plan.router_skew < 1e6):
        raise plan_error(where, f"router_skew = {plan.router_skew!r} must be a number ≥ 1 or null")
    n = len(plan.stages)
    if [st.index for st in plan.stages] != list(range(n)):
        raise plan_error(where, f"stage indices {[st.index for st in plan.stages]} must be 0..{n - 1} in order")
    seen: dict[str, int] = {}
    for st in plan.stages:
        w = f"{where}: stage {st.index}"
        if not is_int(st.pp_rank) or st.pp_rank != st.index % cfg.pp:
            raise plan_error(where, f"stage {st.index} is on pp_rank {st.pp_rank!r}; the schedules place stage i on "
                             f"rank i mod pp = {st.index % cfg.pp}")
        if not st.layers:
            raise plan_error(where, f"stage {st.index} holds no layer; every pipeline stage needs at least one")
        for name in st.layers:
            if not isinstance(name, str) or not name:
                raise plan_error(where, f"stage {st.index} lists layer {name!r}; layer names are non-empty strings")
            if name in seen:
                raise plan_error(where, f"layer {name!r} is in stage {seen[name]} and again in stage {st.index}")
            seen[name] = st.index
        if not isinstance(st.recompute, str) or st.recompute not in RECOMPUTE_MODES:
            raise plan_error(where, f"stage {st.index} recompute = {st.recompute!r} must be one of {RECOMPUTE_MODES}")
        _nonneg(w, "time_per_microbatch_s", st.time_per_microbatch_s)
        check_number("peak_memory_bytes", st.peak_memory_bytes, integer=True, error=PlanMismatchError, where=w,
                      fix=PLAN_FIX)
        if not isinstance(st.memory_breakdown, dict):
            raise plan_error(w, f"memory_breakdown = {st.memory_breakdown!r} must be an object of byte counts")
        for k, v in st.memory_breakdown.items():
            _nonneg(w, f"memory_breakdown[{k!r}]", v)
        parts = sum(st.memory_breakdown.values())
        if st.peak_memory_bytes and not st.memory_breakdown:
            raise plan_error(w, f"peak_memory_bytes = {st.peak_memory_bytes:,} has no memory_breakdown")
        if st.memory_breakdown and abs(parts - st.peak_memory_bytes) > 1 + REL_TOL * parts:
            raise plan_error(w, f"memory_breakdown sums to {parts:,.0f} bytes but peak_memory_bytes is "
                             f"{st.peak_memory_bytes:,}")
    if plan.solver is not None:
        _check_solver(plan.solver, f"{where}: solver")
    tokens = plan.global_batch_size * (plan.seq_len or 1)
    _check_estimate(plan.estimate, f"{where}: estimate", tokens_per_step=tokens)
    slow = [st.index for st in plan.stages if st.time_per_microbatch_s > plan.estimate.step_time_s * (1 + REL_TOL)]
    if slow:
        raise plan_error(where, f"stage(s) {slow} take longer per micro-batch than the whole step "
                         f"({plan.estimate.step_time_s:.9g} s)")
    peak = max(st.peak_memory_bytes for st in plan.stages)
    if plan.estimate.peak_memory_bytes != peak:
        raise plan_error(where, f"estimate.peak_memory_bytes = {plan.estimate.peak_memory_bytes:,} but the largest "
                         f"stage peak is {peak:,}")
    for i, (alt, est) in enumerate(plan.alternatives):
        _check_config(alt, f"{where}: alternatives[{i}]")
        if alt.world_size != cfg.world_size or alt.global_batch_size != plan.global_batch_size:
            raise plan_error(where, f"config {cfg} uses {cfg.world_size} devices and global batch "
                             f"{plan.global_batch_size} but runner-up {i} ({alt}) uses {alt.world_size} and "
                             f"{alt.global_batch_size}: the config or its runner-ups were edited")
        _check_estimate(est, f"{where}: alternatives[{i}].estimate", tokens_per_step=tokens)
