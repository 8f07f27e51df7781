"""The inner problem's data and its objective, shared by the bound, the incumbent heuristic and the ILP.

After the outer search fixes tp, pp, dp, ZeRO stage, micro-batching, schedule, virtual stages and
sequence parallelism, what remains is where to cut the layer sequence into S = p·v stages and which
recompute mode each layer uses. `InnerProblem` holds that problem as numbers and names only (no
torch), `evaluate` prices one cut vector and mode assignment with exactly the objective and constraints
the ILP models (see `autopar.planner.ilp` for the math), so every other module can be tested against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from cost_models.memory import RECOMPUTE_MODES

__all__ = ["MODES", "Run", "InnerProblem", "InnerSolution", "StageEval", "evaluate", "mode_label"]

MODES = RECOMPUTE_MODES  # index k of every per-mode tuple below


@dataclass(frozen=True, kw_only=True)
class Run:
    """`count` consecutive identical layers; every number is per layer, per micro-batch, per device."""

    name: str
    count: int
    layer_names: tuple[str, ...]  # len == count
    time_s: tuple[float, ...]  # τ by mode (MODES order)
    compute_s: tuple[float, ...]  # of τ: forward + backward compute (no recompute, no comm)
    recompute_s: tuple[float, ...]  # of τ: recompute compute and its tensor-parallel comm
    tp_comm_s: tuple[float, ...]  # of τ: tensor-parallel comm of forward and backward
    act_bytes: tuple[float, ...]  # a by mode, per in-flight micro-batch
    state_bytes: float  # σ
    backward_s: float  # β
    grad_sync_s: float  # γ
    optimizer_s: float  # ω
    send_s: tuple[float, float]  # π (intra-node, inter-node)
    # of compute_s and optimizer_s: framework host overhead (DTensor dispatch on CPU), which calibration
    # scales apart from kernel time (autopar.calibrate); not a variable of the ILP
    host_s: float = 0.0
    optimizer_host_s: float = 0.0

    def __post_init__(self) -> None:
        if self.count < 1 or len(self.layer_names) != self.count:
            raise ValueError(f"Run {self.name}: count={self.count} with {len(self.layer_names)} layer names")


@dataclass(frozen=True, kw_only=True)
class InnerProblem:
    runs: tuple[Run, ...]
    num_ranks: int  # p
    virtual_stages: int  # v
    num_microbatches: int  # m
    inflight: tuple[float, ...]  # φ per rank
    capacity_bytes: tuple[float, ...]  # M per rank
    inter_node: tuple[bool, ...]  # per boundary between stage s and s+1 (S−1 entries)
    modes: tuple[str, ...] = MODES  # allowed recompute modes
    grad_sync_latency_s: float = 0.0  # γ0: latency part of the gradient collectives (0 when dp = 1)
    per_layer: bool = True  # False: one mode for all layers of a pipeline rank (the space without k of n)
    # a of the pipeline time a·T + Σt/v; None: m − 1/v (1F1B, GPipe, interleaving with N = p); otherwise the
    # order's makespan in units of T (cost_models.pipeline_order.uniform_slots)
    slots: float | None = None

    def __post_init__(self) -> None:
        s = self.num_stages
        if len(self.inflight) != self.num_ranks or len(self.capacity_bytes) != self.num_ranks:
            raise ValueError("InnerProblem: inflight and capacity_bytes need one entry per pipeline rank")
        if len(self.inter_node) != s - 1:
            raise ValueError(f"InnerProblem: inter_node needs {s - 1} entries (one per stage boundary)")
        if not self.modes or any(k not in MODES for k in self.modes):
            raise ValueError(f"InnerProblem.modes={self.modes}; expected a non-empty subset of {MODES}")

    @property
    def bottleneck_slots(self) -> float:
        """a of the pipeline time a·T + Σt/v: slots of the bottleneck rank's per-micro-batch time T."""
        return self.num_microbatches - 1.0 / self.virtual_stages if self.slots is None else self.slots

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.virtual_stages

    @property
    def num_layers(self) -> int:
        return sum(r.count for r in self.runs)

    def workspace_bytes(self, mode: str) -> float:
        return self._workspace[MODES.index(mode)]

    @cached_property
    def _workspace(self) -> tuple[float, ...]:
        return tuple(max(r.act_bytes[0] - r.act_bytes[k] for r in self.runs) for k in range(len(MODES)))


@dataclass(frozen=True, kw_only=True)
class StageEval:
    index: int
    rank: int
    first_layer: int  # position in the layer sequence
    num_layers: int
    mode: str  # the stage's label: its most common layer mode (ties: the heavier)
    layer_modes: tuple[str, ...]  # one per layer of the stage
    time_s: float
    compute_s: float
    recompute_s: float
    tp_comm_s: float
    pp_comm_s: float
    host_s: float  # of compute_s: framework host overhead (Run.host_s)
    memory_bytes: float  # model states + activations (+ workspace) of this stage
    state_bytes: float
    act_bytes: float


@dataclass(frozen=True, kw_only=True)
class InnerSolution:
    """A cut vector and a mode per layer, priced by `evaluate`; ILP status when it came from `solve`."""

    layers_per_stage: tuple[int, ...]
    modes: tuple[str, ...]  # per stage: its label (StageEval.mode)
    layer_modes: tuple[str, ...]  # per layer, in order
    objective_s: float
    pipeline_s: float  # a·T + Σ t / v, a = InnerProblem.bottleneck_slots
    bottleneck_rank: int
    tail_s: float  # E
    tail_optimizer_s: float  # of E: the optimizer step on the rank that sets E
    tail_optimizer_host_s: float  # of that optimizer step: framework host overhead (Run.optimizer_host_s)
    stages: tuple[StageEval, ...]
    rank_memory_bytes: tuple[float, ...]
    feasible: bool
    violated: str = ""  # name of a violated constraint, "" when feasible
    status: str = "evaluated"
    gap: float = 0.0
    solve_time_s: float = 0.0


def _layer_run(problem: InnerProblem) -> list[int]:
    return [ri for ri, r in enumerate(problem.runs) for _ in range(r.count)]


def mode_label(modes: tuple[str, ...] | list[str]) -> str:
    """One name for several layers' modes: the most common (ties: the heavier)."""
    n = {k: 0 for k in MODES}
    for k in modes:
        n[k] += 1
    return max(MODES, key=lambda k: (n[k], MODES.index(k)))


def evaluate(problem: InnerProblem, layers_per_stage: tuple[int, ...], modes: tuple[str, ...] | None = None,
             *, layer_modes: tuple[str, ...] | None = None) -> InnerSolution:
    """Price one cut vector and recompute assignment with the ILP's objective, layer by layer.
    `modes`: one per stage (all its layers), or `layer_modes`: one per layer."""
    p, v, S = problem.num_ranks, problem.virtual_stages, problem.num_stages
    if layer_modes is None:
        if modes is None or len(modes) != S:
            raise ValueError(f"need {S} stage modes, got {None if modes is None else len(modes)}")
        layer_modes = tuple(k for k, n in zip(modes, layers_per_stage, strict=False) for _ in range(n))
    if len(layers_per_stage) != S:
        raise ValueError(f"need {S} stages, got {len(layers_per_stage)} cuts")
    if sum(layers_per_stage) != problem.num_layers or min(layers_per_stage) < 1:
        raise ValueError(f"cuts {layers_per_stage} must be ≥ 1 each and sum to {problem.num_layers} layers")
    if len(layer_modes) != problem.num_layers:
        raise ValueError(f"need {problem.num_layers} layer modes, got {len(layer_modes)}")
    bad = sorted(set(layer_modes) - set(MODES))
    if bad:
        raise ValueError(f"unknown recompute modes {bad}; expected from {MODES}")
    runs, of = problem.runs, _layer_run(problem)
    stages, pos = [], 0
    ranks_t = [0.0] * p
    mem = [0.0] * p
    used_modes: list[set[str]] = [set() for _ in range(p)]
    tail_opt, tail_opt_host, tail_dp = [0.0] * p, [0.0] * p, [problem.grad_sync_latency_s] * p
    for s, n in enumerate(layers_per_stage):
        q = s % p
        mine = layer_modes[pos:pos + n]
        lay = [(runs[of[i]], MODES.index(layer_modes[i])) for i in range(pos, pos + n)]
        comp = sum(r.compute_s[k] for r, k in lay)
        rec = sum(r.recompute_s[k] for r, k in lay)
        tpc = sum(r.tp_comm_s[k] for r, k in lay)
        t = sum(r.time_s[k] for r, k in lay)
        ppc = 0.0
        if s < S - 1:
            ppc += lay[-1][0].send_s[problem.inter_node[s]]
        if s > 0:
            ppc += runs[of[pos - 1]].send_s[problem.inter_node[s - 1]]
        state = sum(r.state_bytes for r, _ in lay)
        act = sum(r.act_bytes[k] for r, k in lay) * problem.inflight[q]
        ranks_t[q] += t + ppc
        mem[q] += state + act
        used_modes[q].update(mine)
        tail_opt[q] += sum(r.optimizer_s for r, _ in lay)
        tail_opt_host[q] += sum(r.optimizer_host_s for r, _ in lay)
        tail_dp[q] += sum(r.grad_sync_s - r.backward_s for r, _ in lay)
        stages.append(StageEval(index=s, rank=q, first_layer=pos, num_layers=n, mode=mode_label(mine),
                                layer_modes=tuple(mine), time_s=t + ppc,
                                compute_s=comp, recompute_s=rec, tp_comm_s=tpc, pp_comm_s=ppc,
                                host_s=sum(r.host_s for r, _ in lay),
                                memory_bytes=state + act, state_bytes=state, act_bytes=act))
        pos += n
    for q in range(p):  # layers recompute one at a time in backward: the largest workspace of the rank's modes
        mem[q] += max(problem.workspace_bytes(k) for k in used_modes[q])
    b = max(range(p), key=lambda q: ranks_t[q])
    T = ranks_t[b]
    pipeline = problem.bottleneck_slots * T + sum(st.time_s for st in stages) / v
    tails = [max(tail_opt[q], tail_opt[q] + tail_dp[q]) for q in range(p)]
    qe = max(range(p), key=lambda q: tails[q])
    violated = ""
    for i, mode in enumerate(layer_modes):
        if mode not in problem.modes:
            violated = f"mode_{i} (recompute {mode!r} not allowed)"
    for q in range(p):
        if not problem.per_layer and len(used_modes[q]) > 1:
            violated = violated or f"mode_{q} (one recompute mode per rank)"
    if v > 1 and max(layers_per_stage) - min(layers_per_stage) > 1:
        violated = violated or "chunk_lo/hi (interleaved chunks differ by at most one layer)"
    for q in range(p):
        if mem[q] > problem.capacity_bytes[q] * (1 + 1e-6):
            violated = violated or f"memory_rank{q}"
    return InnerSolution(layers_per_stage=tuple(layers_per_stage), modes=tuple(st.mode for st in stages),
                         layer_modes=tuple(layer_modes),
                         objective_s=pipeline + tails[qe], pipeline_s=pipeline, bottleneck_rank=b,
                         tail_s=tails[qe], tail_optimizer_s=tail_opt[qe], tail_optimizer_host_s=tail_opt_host[qe],
                         stages=tuple(stages),
                         rank_memory_bytes=tuple(mem), feasible=not violated, violated=violated)
