"""The outer search space (docs/design.md §5): every discrete layout choice except stage cuts and recompute.

A `Candidate` fixes tp, cp, pp, dp, ZeRO stage, micro-batch size and count, schedule, virtual stages,
sequence parallelism, compiled blocks, the expert-parallel degree ep (a divisor of every MoE layer's
expert count that lays out over the stage's ranks: a divisor of dp, or folded over tp, a multiple of tp whose
ep / tp divides dp; 1 for dense models) and the experts' tensor-parallel degree etp (1, or tp where ep
divides dp and tp divides every expert's FFN width: `etp_degrees`); the ILP (`autopar.planner.ilp`) then
places the cuts and picks recompute per layer.
Rules of thumb (autopar.planner.rules: cp chunks, max_virtual_stages) narrow what is searched, never what is
pinned: a pinned value is enumerated wherever it can run.
Equivalent layouts are enumerated once: with dp = 1 every ZeRO stage is ZeRO-0, and with pp = 1 GPipe
and 1F1B are the same schedule (named 1f1b).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from autopar.capture.graph import ModelGraph
from autopar.capture.sequence import sequence_parallel_expert_conflict, sequence_parallel_refusal
from autopar.capture.vocab_split import splits_anything
from autopar.config import OFFLOAD_MODES, SCHEDULES, ZERO_STAGES, ParallelConfig, PlannerOptions, ep_fits, etp_invalid
from autopar.errors import InfeasiblePlanError
from autopar.planner.rules import MIN_CP_CHUNK, cp_invalid, divisors, tp_invalid

__all__ = ["Candidate", "enumerate_candidates", "expert_degrees_invalid",
           "divisors", "tp_degrees", "ep_degrees", "etp_degrees", "cp_degrees",
           "MIN_CP_CHUNK"]



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


def tp_degrees(graph: ModelGraph, devices_per_node: int) -> list[int]:
    """TP degrees that stay inside a node, split every head count evenly and split something (a vocabulary
    the degree does not divide stays replicated: capture.vocab_split)."""
    patterns = [pat for layer in graph.layers for pat in layer.tp_patterns]
    if not patterns:
        return [1]
    return [t for t in divisors(devices_per_node)
            if t == 1 or (all(pat.max_degree_ok(t) for pat in patterns) and splits_anything(graph, t))]


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
    out = _candidates(graph, world_size=world_size, devices_per_node=devices_per_node,
                      global_batch_size=global_batch_size, options=options, fp8s=fp8s, offloads=offloads,
                      precision=precision)
    if not out:
        raise InfeasiblePlanError(_why_empty(graph, world_size, devices_per_node, global_batch_size, options))
    return out


def _tps(graph: ModelGraph, world_size: int, devices_per_node: int, pin: int | None) -> list[int]:
    """The tp degrees searched, or the pinned one where it can run."""
    if pin is None:
        return [t for t in tp_degrees(graph, devices_per_node) if world_size % t == 0]
    return [pin] if tp_invalid(graph, pin, devices_per_node=devices_per_node, world_size=world_size) is None else []


def _cps(graph: ModelGraph, ranks: int, pin: int | None) -> list[int]:
    """The cp degrees searched over `ranks` = world / tp, or the pinned one where it can run (chunks of any
    length: MIN_CP_CHUNK only bounds the search)."""
    if pin is None:
        return cp_degrees(graph, ranks)
    return [pin] if ranks % pin == 0 and cp_invalid(graph, pin) is None else []


def _candidates(graph: ModelGraph, *, world_size: int, devices_per_node: int, global_batch_size: int,
                options: PlannerOptions, fp8s: tuple[str, ...], offloads: tuple[str, ...],
                precision: str) -> list[Candidate]:
    o = options
    out: list[Candidate] = []
    zeros = [z for z in ZERO_STAGES if z not in o.exclude_zero_stages]
    schedules = [s for s in SCHEDULES if s not in o.exclude_schedules]
    # SP where it splits a block (capture.sequence.sequence_parallel_refusal); none with ep/etp > 1 where an MoE
    # layer must run on the full sequence
    sps = {t: [False, True] if t > 1 and not sequence_parallel_refusal(graph, t) else [False]
           for t in {*tp_degrees(graph, devices_per_node), *([o.tp] if o.tp else [])}}
    moe_whole = sequence_parallel_expert_conflict(graph, 2, 2) is not None
    for tp, cp in ((t, c) for t in _tps(graph, world_size, devices_per_node, o.tp)
                   for c in _cps(graph, world_size // t, o.cp)):
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
                            compiles = _pinned([False, True], o.compile)
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
        for v in range(2, max(o.max_virtual_stages, o.virtual_stages or 1) + 1):  # a pin past the limit runs
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
    """Why no layout satisfies `o`: the pin and the rule that excludes it, with the values that pass; else the
    pins that conflict, each with the values it could take beside the others."""
    if why := expert_degrees_invalid(graph, o.ep, o.etp):
        return why
    if o.tp is not None and (why := tp_invalid(graph, o.tp, devices_per_node=devices_per_node, world_size=world_size)):
        return why
    if o.cp is not None and (why := cp_invalid(graph, o.cp)):
        return why
    if why := _pin_rule(graph, world_size, batch, o):
        return why
    tps = [t for t in tp_degrees(graph, devices_per_node) if world_size % t == 0]
    if o.sequence_parallel and (why := sequence_parallel_refusal(graph, o.tp)
                                or sequence_parallel_expert_conflict(graph, o.ep or 1, o.etp or 1)):
        return f"sequence_parallel=True is not possible: {why}; set sequence_parallel=False or leave it unset"
    dps = sorted({world_size // (t * p) for t in tps for p in divisors(world_size // t) if p <= graph.num_layers})
    fitting = [d for d in dps if batch % d == 0]
    if not fitting:
        dp_min = min(dps)
        below, above = (batch // dp_min) * dp_min, (batch // dp_min + 1) * dp_min
        nearest = f"{below} or {above}" if below > 0 else f"{above}"
        return (f"global batch {batch} cannot be split over any data-parallel degree possible on {world_size} "
                f"devices (dp ∈ {dps}); use a global batch divisible by one of them, e.g. {nearest}")
    return _conflicting_pins(graph, world_size, devices_per_node, batch, o)


def _pin_rule(graph: ModelGraph, world_size: int, batch: int, o: PlannerOptions) -> str | None:
    """The rule a pinned value (or two) breaks on its own, naming the values that pass (None when none does)."""
    layers = graph.num_layers
    if o.pp is not None and o.pp > layers:
        return (f"pp={o.pp} exceeds the {layers} layers of {graph.model_name} (each pipeline stage holds at least "
                f"one); possible pp: {[p for p in divisors(world_size) if p <= layers]}")
    if o.pp is not None and o.virtual_stages is not None and o.pp * o.virtual_stages > layers:
        return (f"pp·virtual_stages = {o.pp}·{o.virtual_stages} = {o.pp * o.virtual_stages} stages exceed the "
                f"{layers} layers of {graph.model_name} (each holds at least one); lower pp or virtual_stages")
    pinned = {n: getattr(o, n) for n in ("tp", "cp", "pp", "dp") if getattr(o, n) is not None}
    product = math.prod(pinned.values())
    if world_size % product or (len(pinned) == 4 and product != world_size):
        degrees = " · ".join(f"{n}={v}" for n, v in pinned.items())
        return (f"the pinned degrees {degrees} = {product} do not fit the {world_size} devices (tp·cp·pp·dp = "
                f"{world_size}); pin degrees whose product divides {world_size}, or unpin one")
    if o.dp is not None and batch % o.dp:
        return (f"dp={o.dp} does not divide the global batch {batch} (each data-parallel rank takes batch / dp "
                f"samples); possible dp: {[d for d in divisors(world_size) if batch % d == 0]}")
    if o.sequence_parallel and o.tp == 1:
        return (f"sequence_parallel=True splits activations over the tp ranks and needs tp > 1, not the pinned "
                f"tp={o.tp}; pin tp > 1 or sequence_parallel=False")
    if o.virtual_stages is not None and o.virtual_stages > 1 and o.schedule not in (None, "interleaved_1f1b"):
        return (f"virtual_stages={o.virtual_stages} needs schedule='interleaved_1f1b', not the pinned "
                f"{o.schedule!r}; unpin one of them")
    return None


# the options enumeration reads (the others price a layout, they do not exclude one)
_ENUMERATED = ("tp", "cp", "pp", "dp", "zero_stage", "micro_batch_size", "num_microbatches", "schedule",
               "virtual_stages", "microbatch_group", "sequence_parallel", "compile", "ep", "etp", "offload")


def _conflicting_pins(graph: ModelGraph, world_size: int, devices_per_node: int, batch: int,
                      o: PlannerOptions) -> str:
    """Which pins, each unpinned alone, would leave layouts, and the values each could take beside the others."""
    ways = []
    for name in (n for n in _ENUMERATED if getattr(o, n) is not None):
        free = replace(o, **{name: None})
        alt = _candidates(graph, world_size=world_size, devices_per_node=devices_per_node, global_batch_size=batch,
                          options=free, fp8s=("none",), precision="fp32",
                          offloads=OFFLOAD_MODES if free.offload is None else (free.offload,))
        values = sorted({getattr(c, name) for c in alt}, key=str)
        if values:
            ways.append(f"{name}={getattr(o, name)} (with the other pins: {name} ∈ {values})")
    change = f"; change one of: {', '.join(ways)}" if ways else ". Unpin some options"
    return (f"no layout satisfies the pinned options ({_pins(o)}) together with global batch {batch} on "
            f"{world_size} devices{change}")


def _pins(o: PlannerOptions) -> str:
    names = ("tp", "cp", "pp", "dp", "zero_stage", "micro_batch_size", "num_microbatches", "schedule",
             "virtual_stages", "microbatch_group", "recompute", "sequence_parallel", "compile", "ep", "etp", "fp8",
             "offload", "precision")
    return ", ".join(f"{n}={getattr(o, n)}" for n in names if getattr(o, n) is not None) or "none"
