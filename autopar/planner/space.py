"""The outer search space (docs/design.md §5): every discrete layout choice except stage cuts and recompute.

A `Candidate` fixes tp, cp, pp, dp, ZeRO stage, micro-batch size and count, schedule, virtual stages,
sequence parallelism, compiled blocks, the expert-parallel degree ep (a divisor of every MoE layer's
expert count that lays out over the stage's ranks: a divisor of dp, or folded over tp, a multiple of tp whose
ep / tp divides dp; 1 for dense models) and the experts' tensor-parallel degree etp (1, or tp where ep
divides dp and tp divides every expert's FFN width: `etp_degrees`); the ILP (`autopar.planner.ilp`) then
places the cuts and picks recompute per layer.
Equivalent layouts are enumerated once: with dp = 1 every ZeRO stage is ZeRO-0, and with pp = 1 GPipe
and 1F1B are the same schedule (named 1f1b).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from autopar.capture.graph import ModelGraph, sequence_parallel_expert_conflict, sequence_parallel_refusal
from autopar.config import SCHEDULES, ZERO_STAGES, ParallelConfig, PlannerOptions, ep_fits, etp_invalid
from autopar.errors import InfeasiblePlanError

__all__ = ["Candidate", "enumerate_candidates", "expert_degrees_invalid",
           "divisors", "tp_degrees", "ep_degrees", "etp_degrees", "cp_degrees",
           "MIN_CP_CHUNK"]

# The shortest chunk (tokens) a context-parallel rank holds (it holds two). Llama 3 ran its 131,072-token
# stage in chunks of 4,096 (cp 16, Dubey et al. 2024 Table 4), the one published CP layout the cost model is
# checked against (benchmarks/published_runs.py); shorter chunks (small attention blocks, K/V exchanges
# dominated by latency) are not searched. It also keeps the search within the planner's time limit: with
# chunks of 128, cp entered every plan of 8K tokens and the llama3-405b problem grew to 46,544 layouts.
MIN_CP_CHUNK = 4096


@dataclass(frozen=True, kw_only=True, order=True)
class Candidate:
    tp: int
    pp: int
    dp: int
    zero_stage: int
    micro_batch_size: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    sequence_parallel: bool
    compile: bool = False
    ep: int = 1
    fp8: str = "none"
    offload: str = "none"
    cp: int = 1
    precision: str = "bf16"
    microbatch_group: int | None = None  # ParallelConfig.microbatch_group
    etp: int = 1  # ParallelConfig.etp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shard_group(self) -> int:
        """Ranks that hold the same weights and average their gradients (ZeRO shards over them): dp·cp."""
        return self.dp * self.cp

    @property
    def tokens_share(self) -> float:
        """Micro-batches' worth of tokens one rank runs per micro-batch: mbs / cp (each sequence split)."""
        return self.micro_batch_size / self.cp

    def config(self, recompute: str) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp, dp=self.dp, cp=self.cp, zero_stage=self.zero_stage,
                              micro_batch_size=self.micro_batch_size, num_microbatches=self.num_microbatches,
                              schedule=self.schedule, virtual_stages=self.virtual_stages, recompute=recompute,
                              sequence_parallel=self.sequence_parallel, compile=self.compile, ep=self.ep,
                              fp8=self.fp8, offload=self.offload, precision=self.precision,
                              microbatch_group=self.microbatch_group, etp=self.etp)

    @classmethod
    def of(cls, config: ParallelConfig) -> Candidate:
        return cls(tp=config.tp, pp=config.pp, dp=config.dp, cp=config.cp, zero_stage=config.zero_stage,
                   micro_batch_size=config.micro_batch_size, num_microbatches=config.num_microbatches,
                   schedule=config.schedule, virtual_stages=config.virtual_stages,
                   sequence_parallel=config.sequence_parallel, compile=config.compile, ep=config.ep,
                   fp8=config.fp8, offload=config.offload, precision=config.precision,
                   microbatch_group=config.microbatch_group, etp=config.etp)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(graph: ModelGraph, devices_per_node: int) -> list[int]:
    """TP degrees that stay inside a node and split every head count and vocabulary evenly."""
    patterns = [pat for layer in graph.layers for pat in layer.tp_patterns]
    if not patterns:
        return [1]
    return [t for t in divisors(devices_per_node) if all(pat.max_degree_ok(t) for pat in patterns)]


def ep_degrees(graph: ModelGraph, dp: int, tp: int = 1) -> list[int]:
    """Expert-parallel degrees that lay out over tp × dp (autopar.config.ep_fits: divisors of dp, or folded
    over tp, multiples of tp whose ep / tp divides dp) and split every MoE layer's experts evenly ([1] when
    dense)."""
    moes = [la.moe for la in graph.layers if la.moe is not None]
    if not moes:
        return [1]
    return [e for e in divisors(dp * tp) if ep_fits(tp, dp, e) and all(m.max_degree_ok(e) for m in moes)]


def etp_degrees(graph: ModelGraph, dp: int, tp: int, ep: int) -> list[int]:
    """Expert tensor-parallel degrees for ep over tp × dp: 1, and tp where the EP group can span data-parallel
    ranks only (autopar.config.etp_invalid) and tp splits every MoE layer's FFN width evenly."""
    moes = [la.moe for la in graph.layers if la.moe is not None]
    split = tp > 1 and moes and etp_invalid(tp, dp, ep, tp) is None and all(m.ffn_split_ok(tp) for m in moes)
    return [1, tp] if split else [1]


def cp_degrees(graph: ModelGraph, ranks: int) -> list[int]:
    """Context-parallel degrees for a model on `ranks` = world / tp ranks: 1, and for a model with attention
    over a sequence, each divisor d > 1 of `ranks` whose 2·d chunks hold at least MIN_CP_CHUNK tokens each."""
    has_attention = any(p.kind == "attention" for la in graph.layers for p in la.tp_patterns)
    if not (has_attention and graph.seq_len):
        return [1]
    return [d for d in divisors(ranks) if d == 1 or graph.seq_len >= 2 * d * MIN_CP_CHUNK]


def _pinned(values: list, pin) -> list:
    return [x for x in values if pin is None or x == pin]


def enumerate_candidates(graph: ModelGraph, *, world_size: int, devices_per_node: int, global_batch_size: int,
                         options: PlannerOptions, fp8s: tuple[str, ...] = ("none",),
                         offloads: tuple[str, ...] = ("none",), precision: str = "bf16") -> list[Candidate]:
    """All outer layouts allowed by the cluster, the batch and `options`; raises when there are none.
    fp8s / offloads: the FP8 recipes and offload modes to consider (the caller knows what the devices and
    hosts allow); offload "params" is FSDP2's CPU offload, so it comes with ZeRO-3 only (at dp = 1 too).
    precision: one policy for all (the CostModel's: options.precision when pinned, else the device's
    default; not searched, as 16 bits is faster and smaller wherever the device has 16-bit throughput, and
    the numerics are the practitioner's choice)."""
    o = options
    out: list[Candidate] = []
    zeros = [z for z in ZERO_STAGES if z not in o.exclude_zero_stages]
    schedules = [s for s in SCHEDULES if s not in o.exclude_schedules]
    # SP where it splits a block (capture.graph.sequence_parallel_refusal)
    sps = {t: [False, True] if t > 1 and not sequence_parallel_refusal(graph, t) else [False]
           for t in tp_degrees(graph, devices_per_node)}
    moe_whole = sequence_parallel_expert_conflict(graph, 2, 2) is not None  # no SP with ep or etp > 1 then
    for tp, cp in ((t, c) for t in _pinned(tp_degrees(graph, devices_per_node), o.tp) if world_size % t == 0
                   for c in _pinned(cp_degrees(graph, world_size // t), o.cp)):
        for pp in _pinned(divisors(world_size // (tp * cp)) if world_size % (tp * cp) == 0 else [], o.pp):
            if pp > graph.num_layers:
                continue
            dp = world_size // (tp * cp * pp)
            if (o.dp is not None and dp != o.dp) or global_batch_size % dp:
                continue
            eps = _pinned(ep_degrees(graph, dp, tp), o.ep)
            etps = {ep: _pinned(etp_degrees(graph, dp, tp, ep), o.etp) for ep in eps}
            for mbs in _pinned(divisors(global_batch_size // dp), o.micro_batch_size):
                m = global_batch_size // (dp * mbs)
                if o.num_microbatches is not None and m != o.num_microbatches:
                    continue
                for zero in _zero_stages(dp * cp, zeros, o.zero_stage):
                    for sched, v, n in _schedules(pp, m, graph.num_layers, schedules, o):
                        for sp in _pinned(sps[tp], o.sequence_parallel):
                            compiles = _pinned([False, True] if cp == 1 else [False], o.compile)
                            for comp, f8, off in itertools.product(compiles, fp8s, offloads):
                                z = 3 if off == "params" else zero
                                if z != zero and not (dp == 1 and o.zero_stage is None and 3 in zeros):
                                    continue
                                out.extend(Candidate(tp=tp, pp=pp, dp=dp, zero_stage=z, micro_batch_size=mbs,
                                                     num_microbatches=m, schedule=sched, virtual_stages=v,
                                                     sequence_parallel=sp, compile=comp, ep=ep, cp=cp, fp8=f8,
                                                     offload=off, precision=precision, microbatch_group=n,
                                                     etp=etp)
                                           for ep in eps for etp in etps[ep]
                                           if not (sp and moe_whole and max(ep, etp) > 1))
    if not out:
        raise InfeasiblePlanError(_why_empty(graph, world_size, devices_per_node, global_batch_size, o))
    return out


def _zero_stages(dp: int, allowed: list[int], pin: int | None) -> list[int]:
    if pin is not None:
        return [pin]
    if dp == 1:  # nothing to shard across: every stage behaves as ZeRO-0; keep one representative
        return allowed[:1]
    return allowed


def _schedules(pp: int, m: int, num_layers: int, schedules: list[str],
               o: PlannerOptions) -> list[tuple[str, int, int | None]]:
    """(schedule, v, N) triples; N (microbatch_group) None is torch's N = pp; the others, from pp/2 to pp − 1,
    trade bubble for warm-up memory (cost_models.pipeline_order): searched where a pipeline is pinned (pp ≥ 4,
    v and m given), and kept only where torch's N cannot fit (search._grouped_where_needed)."""
    if o.microbatch_group is not None and o.schedule not in (None, "interleaved_1f1b"):
        return []
    if pp == 1:  # one stage: every schedule runs the micro-batches back to back
        pick = o.schedule if o.schedule in ("gpipe", "1f1b") else ("1f1b" if "1f1b" in schedules else "gpipe")
        ok = o.virtual_stages in (None, 1) and o.schedule != "interleaved_1f1b" and o.microbatch_group is None
        return [(pick, 1, None)] if ok else []
    out: list[tuple[str, int, int | None]] = []
    for s in _pinned(schedules, o.schedule):
        if s != "interleaved_1f1b":
            if o.virtual_stages in (None, 1) and o.microbatch_group is None:
                out.append((s, 1, None))
            continue
        if m % pp:
            continue
        pinned = None not in (o.pp, o.virtual_stages, o.num_microbatches) and pp >= 4
        groups: list[int | None] = ([o.microbatch_group] if o.microbatch_group is not None
                                    else [None, *range(-(-pp // 2), pp)] if pinned else [None])
        for v in range(2, o.max_virtual_stages + 1):
            if pp * v <= num_layers and o.virtual_stages in (None, v):
                out += [(s, v, None if n == pp else n) for n in groups if n is None or n <= m]
    return out


def expert_degrees_invalid(graph: ModelGraph, ep: int | None, etp: int | None) -> str | None:
    """Why expert parallelism ep or expert tensor parallelism etp cannot split this model's experts (None when
    they can, or are unset): both need MoE layers, ep must divide every layer's expert count and etp every
    expert's FFN width."""
    moes = [la.moe for la in graph.layers if la.moe is not None]
    for name, degree in (("ep", ep), ("etp", etp)):
        if degree is not None and degree > 1 and not moes:
            return (f"{name}={degree} needs mixture-of-experts layers; {graph.model_name} has none: leave {name} "
                    "unset or 1")
    if ep is not None and any(not m.max_degree_ok(ep) for m in moes):
        counts = sorted({m.num_experts for m in moes})
        return f"ep={ep} does not divide the expert count of {graph.model_name} ({counts}); pick a divisor of it"
    if etp is not None and etp > 1 and any(not m.ffn_split_ok(etp) for m in moes):
        widths = sorted({m.ffn_hidden_size for m in moes})
        return (f"etp={etp} does not divide the experts' FFN width of {graph.model_name} ({widths}); set etp=1 "
                "or a tp that divides it")
    return None


def _why_empty(graph: ModelGraph, world_size: int, devices_per_node: int, batch: int, o: PlannerOptions) -> str:
    tps = tp_degrees(graph, devices_per_node)
    if why := expert_degrees_invalid(graph, o.ep, o.etp):
        return why
    if o.tp is not None and o.tp > 1 and (nothing := graph.no_tensor_parallelism()):
        return f"tp={o.tp} is not possible: {nothing}; leave tp unset or 1"
    if o.sequence_parallel and (why := sequence_parallel_refusal(graph, o.tp)
                                or sequence_parallel_expert_conflict(graph, o.ep or 1, o.etp or 1)):
        return f"sequence_parallel=True is not possible: {why}; set sequence_parallel=False or leave it unset"
    if o.tp is not None and o.tp not in tps:
        return (f"tp={o.tp} is not possible: tensor parallelism must divide devices_per_node={devices_per_node} "
                f"and every head count and vocabulary of {graph.model_name}; possible tp: {tps}")
    dps = sorted({world_size // (t * p) for t in tps for p in divisors(world_size // t) if p <= graph.num_layers})
    fitting = [d for d in dps if batch % d == 0]
    if not fitting:
        dp_min = min(dps)
        below, above = (batch // dp_min) * dp_min, (batch // dp_min + 1) * dp_min
        nearest = f"{below} or {above}" if below > 0 else f"{above}"
        return (f"global batch {batch} cannot be split over any data-parallel degree possible on {world_size} "
                f"devices (dp ∈ {dps}); use a global batch divisible by one of them, e.g. {nearest}")
    return (f"no layout satisfies the pinned options ({_pins(o)}) with global batch {batch} on {world_size} "
            f"devices; data-parallel degrees that divide the batch: {fitting}. Unpin some options.")


def _pins(o: PlannerOptions) -> str:
    names = ("tp", "cp", "pp", "dp", "zero_stage", "micro_batch_size", "num_microbatches", "schedule",
             "virtual_stages", "microbatch_group", "recompute", "sequence_parallel", "compile", "ep", "etp", "fp8",
             "offload", "precision")
    return ", ".join(f"{n}={getattr(o, n)}" for n in names if getattr(o, n) is not None) or "none"
