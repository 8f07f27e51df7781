"""`RunRecord`: what a real training run measured, per rank and step, as a versioned JSON file.

A record is written by `examples/train_gpt.py --record run.json` (or any script: `build_record`) and
read by `autopar report` (predicted beside measured) and `autopar calibrate` (measured folded back into
the profile). It names the plan it ran (a fingerprint of the plan's layout, cuts and prediction) and the
machine (host, device, torch), so neither command can be fed a run of another plan or another machine.

Components are the plan's breakdown keys (plan.BREAKDOWN_KEYS), measured as autopar.codegen.timing
describes; steps before `warmup_steps` are dropped. The step's figure is the median over steps; the
breakdown is that of the *bottleneck* rank (the largest median busy time, as the planner's breakdown is
the bottleneck stage's), with pipeline_bubble taking the rest of the measured median step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.checks import check_flags, check_number, is_int
from autopar.config import ParallelConfig
from autopar.errors import PlanMismatchError, ProfileMismatchError
from autopar.plan import BREAKDOWN_KEYS, Plan

__all__ = ["RECORD_SCHEMA_VERSION", "RankTiming", "RunRecord", "plan_fingerprint", "build_record"]

RECORD_SCHEMA_VERSION = 1


def plan_fingerprint(plan: Plan) -> str:
    """Hash of what makes a plan that plan: layout, stage cuts, predicted estimate, model and cluster."""
    d = plan.to_dict()
    payload = {k: d[k] for k in ("config", "stages", "estimate", "graph_fingerprint", "cluster_fingerprint",
                                 "global_batch_size", "seq_len")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True, kw_only=True)
class RankTiming:
    """One rank's measured steps (after warm-up): wall time and its breakdown, seconds per step."""

    rank: int
    pp_rank: int
    dp_rank: int
    tp_rank: int
    step_s: tuple[float, ...]
    components_s: dict[str, tuple[float, ...]]  # BREAKDOWN_KEYS → one value per step
    # median per step of the collectives / p2p operations issued, by axis (autopar.codegen.timing.AXES)
    calls_per_step: dict[str, float] = field(default_factory=dict)
    # torch.cuda.max_memory_allocated over the run on a GPU (what the plan's peak_memory_bytes prices);
    # 0 where the device has no allocator statistics (CPU)
    peak_memory_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.step_s:
            raise ValueError(f"RankTiming of rank {self.rank} has no measured steps; run more steps than warm-up")
        peak = self.peak_memory_bytes
        if isinstance(peak, bool) or not isinstance(peak, int) or peak < 0:
            raise ValueError(f"RankTiming of rank {self.rank}: peak_memory_bytes={peak!r}; expected a byte count ≥ 0 "
                             "(0: not measured)")
        if set(self.components_s) != set(BREAKDOWN_KEYS):
            raise ValueError(f"RankTiming.components_s keys {sorted(self.components_s)}; expected {BREAKDOWN_KEYS}")
        bad = [k for k, v in self.components_s.items() if len(v) != len(self.step_s)]
        if bad:
            raise ValueError(f"RankTiming of rank {self.rank}: components {bad} do not have one value per step "
                             f"({len(self.step_s)})")

    def median(self, key: str) -> float:
        return statistics.median(self.components_s[key])

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def median_busy_s(self) -> float:
        """Median over steps of the time this rank was not idle (everything but the bubble)."""
        return statistics.median(s - b for s, b in zip(self.step_s, self.components_s["pipeline_bubble"],
                                                         strict=True))

    @property
    def median_work_s(self) -> float:
        """Median over steps of the work that differs between pipeline stages: compute, recompute, tensor-
        parallel and p2p communication, optimizer. Data-parallel waits (and the loss all-reduce) also
        absorb the wait for slower ranks, so they do not decide which rank is the bottleneck."""
        keys = ("compute", "recompute", "tp_comm", "pp_comm", "optimizer")
        return statistics.median(sum(self.components_s[k][i] for k in keys) for i in range(len(self.step_s)))


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    plan_fingerprint: str
    model_name: str
    graph_fingerprint: str
    cluster_fingerprint: str  # of the cluster (and profile) the plan was priced on
    config: ParallelConfig
    predicted_step_time_s: float
    predicted_breakdown: dict[str, float]
    hostname: str
    device_name: str
    torch_version: str
    backend: str
    threads_per_process: int
    created: str
    warmup_steps: int
    ranks: tuple[RankTiming, ...]
    model_spec: str = ""  # how to rebuild the model, e.g. "gpt-tiny seq_len=128 n_layers=4"
    predicted_host_s: float = 0.0  # of the predicted compute and optimizer: host overhead (Estimate.host_s)
    notes: str = ""
    losses: tuple[tuple[int, float], ...] = ()  # (global step from 1, global mean loss) for the steps run
    cpu: str = ""  # the host CPU (cost_models.profile.CpuKind.describe()); "" in older records
    schema_version: int = RECORD_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if len(self.ranks) != self.config.world_size:
            raise ValueError(f"RunRecord has {len(self.ranks)} ranks; the layout {self.config} has "
                             f"{self.config.world_size}")
        if sorted(r.rank for r in self.ranks) != list(range(self.config.world_size)):
            raise ValueError(f"RunRecord ranks {[r.rank for r in self.ranks]} are not 0..{self.config.world_size - 1}")

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def steps(self) -> int:
        return len(self.ranks[0].step_s)

    @property
    def measured_step_time_s(self) -> float:
        """Median over steps of the slowest rank's step (a step ends when its last rank does)."""
        per_step = [max(r.step_s[i] for r in self.ranks) for i in range(self.steps)]
        return statistics.median(per_step)

    @property
    def bottleneck(self) -> RankTiming:
        return max(self.ranks, key=lambda r: (r.median_work_s, -r.rank))

    def breakdown(self, rank: RankTiming | None = None) -> dict[str, float]:
        """Median of each component on `rank` (default: the bottleneck); the bubble is the rest of the
        measured median step, so the values sum to measured_step_time_s."""
        r = rank or self.bottleneck
        out = {k: r.median(k) for k in BREAKDOWN_KEYS if k != "pipeline_bubble"}
        out["pipeline_bubble"] = max(0.0, self.measured_step_time_s - sum(out.values()))
        return {k: out[k] for k in BREAKDOWN_KEYS}

    def stage_breakdowns(self) -> list[dict[str, float]]:
        """Per pipeline rank: the breakdown of its busiest rank."""
        out = []
        for q in range(self.config.pp):
            members = [r for r in self.ranks if r.pp_rank == q]
            out.append(self.breakdown(max(members, key=lambda r: (r.median_work_s, -r.rank))))
        return out

    # ---- refusal of foreign inputs ----
    def check_plan(self, plan: Plan, *, where: str = "run") -> None:
        fp = plan_fingerprint(plan)
        if fp != self.plan_fingerprint:
            raise PlanMismatchError(
                f"{where} ran plan {self.plan_fingerprint} ({self.config}, model {self.model_name!r}) but the plan "
                f"given is {fp} ({plan.config}, model {plan.model_name!r}); pass the plan.json the run was "
                "launched with, or rerun with --plan on this plan"
            )

    def check_machine(self, *, hostname: str, device_name: str, torch_version: str, where: str = "run") -> None:
        wrong = []
        if hostname != self.hostname:
            wrong.append(f"machine {self.hostname!r} (here: {hostname!r})")
        if device_name != self.device_name:
            wrong.append(f"device {self.device_name!r} (here: {device_name!r})")
        if torch_version != self.torch_version:
            wrong.append(f"torch {self.torch_version} (here: {torch_version})")
        if wrong:
            raise ProfileMismatchError(
                f"{where} was measured on {', '.join(wrong)}; its timings do not describe this machine. "
                "Record a run here with `examples/train_gpt.py --record run.json`."
            )

    # ---- serialization ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunRecord:
        version = d.get("schema_version")
        if version != RECORD_SCHEMA_VERSION:
            raise ValueError(f"run record schema version {version!r}; this autopar reads {RECORD_SCHEMA_VERSION}")
        d = dict(d)
        d["config"] = ParallelConfig.from_dict(d["config"])
        d["ranks"] = tuple(RankTiming(**{**r, "step_s": tuple(r["step_s"]),
                                         "calls_per_step": dict(r.get("calls_per_step", {})),
                                         "components_s": {k: tuple(v) for k, v in r["components_s"].items()}})
                           for r in d["ranks"])
        d["losses"] = tuple((int(step), float(loss)) for step, loss in d.get("losses", ()))
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> RunRecord:
        try:
            data = json.loads(Path(path).read_text())
            if not isinstance(data, dict):
                raise TypeError(f"the file holds a JSON {type(data).__name__}, not a run record object")
            record = cls.from_dict(data)
            _check_numbers(record)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                AttributeError) as e:
            what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            raise ProfileMismatchError(
                f"cannot read run record {path}: {what}; write one with "
                f"`torchrun ... examples/train_gpt.py --plan plan.json --record {path}`"
            ) from e
        return record


def _check_numbers(r: RunRecord) -> None:
    """Every time in a record read from a file is a finite number of seconds, every count an integer, every
    name a string and every flag a bool."""
    for f in dataclasses.fields(r):
        named = isinstance(f.default, str) or f.type in ("str", str)
        if named and not isinstance(getattr(r, f.name), str):
            raise ValueError(f"{f.name} = {getattr(r, f.name)!r}; it must be a string")
    check_flags(r.config, where="config")
    check_number("predicted_step_time_s", r.predicted_step_time_s, positive=True)
    check_number("predicted_host_s", r.predicted_host_s)
    if set(r.predicted_breakdown) != set(BREAKDOWN_KEYS):
        raise ValueError(f"predicted_breakdown has keys {sorted(r.predicted_breakdown)}; expected {BREAKDOWN_KEYS}")
    for k, v in r.predicted_breakdown.items():
        check_number(f"predicted_breakdown[{k!r}]", v)
    check_number("warmup_steps", r.warmup_steps, integer=True)
    check_number("threads_per_process", r.threads_per_process, integer=True, positive=True)
    cfg = r.config
    for t in r.ranks:
        where = f"rank {t.rank}"
        for axis, size in (("pp_rank", cfg.pp), ("dp_rank", cfg.dp), ("tp_rank", cfg.tp)):
            v = getattr(t, axis)
            if not is_int(v) or not 0 <= v < size:
                raise ValueError(f"{where}: {axis} = {v!r}; it must be an integer in 0..{size - 1}")
        for i, v in enumerate(t.step_s):
            check_number(f"{where}: step_s[{i}]", v, positive=True)
        for k, vs in t.components_s.items():
            for i, v in enumerate(vs):
                check_number(f"{where}: components_s[{k!r}][{i}]", v)
        for k, v in t.calls_per_step.items():
            check_number(f"{where}: calls_per_step[{k!r}]", v)


def build_record(plan: Plan, ranks: list[RankTiming], *, hostname: str, device_name: str, torch_version: str,
                 backend: str, threads_per_process: int, created: str, warmup_steps: int, model_spec: str = "",
                 notes: str = "", cpu: str = "") -> RunRecord:
    """A RunRecord of `plan` from every rank's RankTiming (gathered on one rank)."""
    return RunRecord(plan_fingerprint=plan_fingerprint(plan), model_name=plan.model_name,
                     graph_fingerprint=plan.graph_fingerprint, cluster_fingerprint=plan.cluster_fingerprint,
                     config=plan.config, predicted_step_time_s=plan.estimate.step_time_s,
                     predicted_breakdown=dict(plan.estimate.breakdown), predicted_host_s=plan.estimate.host_s,
                     hostname=hostname, device_name=device_name,
                     torch_version=torch_version, backend=backend, threads_per_process=threads_per_process,
                     created=created, warmup_steps=warmup_steps, ranks=tuple(sorted(ranks, key=lambda r: r.rank)),
                     model_spec=model_spec, notes=notes, cpu=cpu)
