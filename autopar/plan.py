"""`Plan` and `Estimate`: the planner's answer, saved as JSON and read back by codegen and the CLI.

A plan is self-describing: its config, its stage cuts (layer names per pipeline stage, in order),
its predicted cost, the runner-ups, solver status, and fingerprints of the model graph and cluster
it was made for (codegen refuses a plan for another model or world size).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.config import ParallelConfig
from cost_models.memory import RECOMPUTE_MODES

__all__ = ["Estimate", "StagePlan", "SolverInfo", "Plan", "PLAN_SCHEMA_VERSION", "BREAKDOWN_KEYS"]

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "notes", tuple(self.notes))
        unknown = set(self.breakdown) - set(BREAKDOWN_KEYS)
        if unknown:
            raise ValueError(f"Estimate.breakdown has unknown keys {sorted(unknown)}; expected {BREAKDOWN_KEYS}")
        total = sum(self.breakdown.values())
        if self.breakdown and abs(total - self.step_time_s) > 1e-6 * max(1.0, self.step_time_s):
            raise ValueError(f"Estimate.breakdown sums to {total} s but step_time_s is {self.step_time_s} s")


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
        d["alternatives"] = [{"config": c.to_dict(), "estimate": dataclasses.asdict(e)} for c, e in self.alternatives]
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
        from autopar.errors import PlanMismatchError
        from autopar.validate import check_plan  # validate imports this module

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
        check_plan(plan, where=f"plan {path}")
        return plan
