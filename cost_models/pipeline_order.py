"""The interleaved 1F1B order with a tunable group of N micro-batches, and a discrete-event replay of any order.

Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", §2.2) gives each of p pipeline ranks v model chunks (stage s on rank s mod p) and runs the m
micro-batches depth-first in groups: a rank runs N consecutive micro-batches through one chunk, then the same N
through its next chunk, and so on, before the next group. Megatron-LM fixes N = p; torch.distributed.pipelining's
ScheduleInterleaved1F1B fixes N = m // max(1, m // p) (`cost_models.memory.interleaved_round`); Meta's Llama 3
trainer makes N a knob between depth-first N = p and breadth-first N = m (Dubey et al. 2024, "The Llama 3 Herd of
Models", §3.3.2 and Fig. 6: N = 5 with p = 4). Here N runs from 1 to m; below p it holds less and stalls.

Each rank's order (`interleaved_order`): forwards in (group, chunk, micro-batch) order, backwards the same with
the chunks reversed, merged as torch and Megatron-LM merge them — a warm-up of W_r = (v − 1)·N + 2·(p − 1 − r)
forwards (capped at m·v): (v − 1)·N forwards bring micro-batch 0 to its last chunk, and its backward needs two
more slots per rank it passes on its way back — then one forward and one backward in turn, then the remaining
backwards. At torch's N it is torch's order (tests/test_pipeline_order.py). Where that merge deadlocks (most
N < p: a rank waits on a backward while the forwards the others need sit behind it), the order is built by list
scheduling the same sequences (`_list_schedule`): the action that can start earliest runs, backwards first,
forwards only while the rank holds fewer than W_r + 1 chunk-micro-batches (raised where every rank would wait).
Such an N holds less and stalls: a group's first micro-batch needs p forward slots to come round to the next
chunk while the rank has only N forwards to run.

`replay` runs an order as a discrete-event simulation (a rank runs its actions in order, each once its input
has arrived; sends do not block), the reference for its makespan and for what each rank holds: the peak of
forwards run and not yet backwarded (`peak_inflight`), which does not depend on the durations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Action", "Replay", "interleaved_order", "replay", "peak_inflight", "group_peaks", "uniform_slots",
           "bottleneck_slots",
           "torch_group", "BACKWARD_PER_FORWARD"]

# Backward time over forward time of one chunk and micro-batch, for the order's makespan in `uniform_slots`:
# two matmuls per forward matmul (the input and the weight gradient; Narayanan et al. 2021, §3.2: 2 forward
# FLOPs per parameter per token, 4 backward).
BACKWARD_PER_FORWARD = 2.0


@dataclass(frozen=True)
class Action:
    """One compute action: "F" (forward) or "B" (full backward) of `microbatch` through `stage` (0..p·v−1)."""

    kind: str
    stage: int
    microbatch: int


class _Deadlock(ValueError):
    def __init__(self, waiting: list[tuple[int, Action]]) -> None:
        self.waiting = waiting
        super().__init__("the order deadlocks: " + ", ".join(f"rank {r} waits to run {a.kind}{a.stage}.{a.microbatch}"
                                                             for r, a in waiting))


@dataclass(frozen=True)
class Replay:
    makespan_s: float
    finish_s: tuple[float, ...]  # per rank: when its last action ends
    peak_inflight: tuple[int, ...]  # per rank: chunk-micro-batches forwarded and not yet backwarded, at most


def torch_group(pp: int, num_microbatches: int) -> int:
    """torch.distributed.pipelining's N for ScheduleInterleaved1F1B: m // max(1, m // p)."""
    _check(pp=pp, num_microbatches=num_microbatches)
    return num_microbatches // max(1, num_microbatches // pp)


def _check(**values: int) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r}; it must be a positive integer")


def _groups(m: int, n: int) -> list[range]:
    return [range(g, min(g + n, m)) for g in range(0, m, n)]


@lru_cache(maxsize=256)
def interleaved_order(pp: int, virtual_stages: int, num_microbatches: int,
                      group: int) -> tuple[tuple[Action, ...], ...]:
    """Each rank's forward and backward actions of interleaved 1F1B with groups of `group` micro-batches
    (the module docstring): pp lists, rank r's chunks being stages r, r + p, …, r + (v − 1)·p."""
    _check(pp=pp, virtual_stages=virtual_stages, num_microbatches=num_microbatches, group=group)
    p, v, m = pp, virtual_stages, num_microbatches
    if group > m:
        raise ValueError(f"group={group} exceeds num_microbatches={m}: a group is at most all micro-batches")
    warm = [min((v - 1) * group + 2 * (p - 1 - r), m * v) for r in range(p)]
    strict = _one_forward_one_backward(p, v, m, group, warm)
    try:
        replay(strict, (1.0,) * (p * v), (BACKWARD_PER_FORWARD,) * (p * v))
        return strict
    except _Deadlock:
        pass
    cap = [w + 1 for w in warm]
    while True:
        order, capped = _list_schedule(p, v, m, group, cap)
        if order is not None:
            return order
        for r in capped:
            cap[r] += 1


def _sequences(p: int, v: int, m: int, group: int, r: int) -> tuple[list[Action], list[Action]]:
    """Rank r's forwards in (group, chunk, micro-batch) order and its backwards with the chunks reversed."""
    fwd = [Action("F", j * p + r, x) for g in _groups(m, group) for j in range(v) for x in g]
    bwd = [Action("B", j * p + r, x) for g in _groups(m, group) for j in reversed(range(v)) for x in g]
    return fwd, bwd


def _one_forward_one_backward(p: int, v: int, m: int, group: int,
                              warm: list[int]) -> tuple[tuple[Action, ...], ...]:
    """warm[r] forwards, then one forward and one backward in turn, then the remaining backwards."""
    out = []
    for r in range(p):
        fwd, bwd = _sequences(p, v, m, group, r)
        order = fwd[:warm[r]]
        for k in range(warm[r], m * v):
            order += [fwd[k], bwd[k - warm[r]]]
        out.append(tuple(order + bwd[m * v - warm[r]:]))
    return tuple(out)


def _list_schedule(p: int, v: int, m: int, group: int,
                   cap: list[int]) -> tuple[tuple[tuple[Action, ...], ...] | None, list[int]]:
    """List scheduling of each rank's forward and backward sequences, chunks alike (forward 1, backward
    BACKWARD_PER_FORWARD): the action that can start earliest runs next, a backward before a forward at the
    same time, a forward only while its rank holds fewer than cap[r] chunk-micro-batches. Returns
    (order, []), or (None, the capped ranks) when every rank waits."""
    S = p * v
    seqs = [_sequences(p, v, m, group, r) for r in range(p)]
    f_end: list[list[float | None]] = [[None] * m for _ in range(S)]  # when F(stage, micro-batch) ended
    b_end: list[list[float | None]] = [[None] * m for _ in range(S)]
    nf, nb, free, held = [0] * p, [0] * p, [0.0] * p, [0] * p
    out: list[list[Action]] = [[] for _ in range(p)]
    for _ in range(2 * m * S):
        best: tuple[float, int, int] | None = None  # (start, 0 for a backward / 1 for a forward, rank)
        for r, (fwd, bwd) in enumerate(seqs):
            if nb[r] < len(bwd):
                a = bwd[nb[r]]
                own, down = f_end[a.stage][a.microbatch], b_end[a.stage + 1][a.microbatch] if a.stage < S - 1 else 0.0
                if own is not None and down is not None:
                    t = max(free[r], own, down)
                    if best is None or (t, 0) < best[:2]:
                        best = (t, 0, r)
            if nf[r] < len(fwd) and held[r] < cap[r]:
                a = fwd[nf[r]]
                up = f_end[a.stage - 1][a.microbatch] if a.stage else 0.0
                if up is not None and (best is None or (max(free[r], up), 1) < best[:2]):
                    best = (max(free[r], up), 1, r)
        if best is None:
            return None, [r for r in range(p) if held[r] >= cap[r] and nf[r] < m * v]
        t, is_f, r = best
        if is_f:
            a = seqs[r][0][nf[r]]
            free[r] = f_end[a.stage][a.microbatch] = t + 1.0
            nf[r], held[r] = nf[r] + 1, held[r] + 1
        else:
            a = seqs[r][1][nb[r]]
            free[r] = b_end[a.stage][a.microbatch] = t + BACKWARD_PER_FORWARD
            nb[r], held[r] = nb[r] + 1, held[r] - 1
        out[r].append(a)
    return tuple(tuple(o) for o in out), []


def peak_inflight(order: tuple[Action, ...]) -> int:
    """Most chunk-micro-batches one rank's order holds: forwards run whose backward has not yet run."""
    held = peak = 0
    for a in order:
        held += 1 if a.kind == "F" else -1
        peak = max(peak, held)
    return peak


def replay(order: tuple[tuple[Action, ...], ...], forward_s: tuple[float, ...], backward_s: tuple[float, ...],
           send_s: float = 0.0) -> Replay:
    """Run `order` (one action list per rank) with per-stage forward and backward durations: an action starts
    when its rank's previous action has ended and its input has arrived (`send_s` after the neighbour stage's
    action ended; a stage's backward also needs its own forward). ValueError naming the stuck actions when the
    order deadlocks or is incomplete."""
    S = len(forward_s)
    if len(backward_s) != S or S % len(order):
        raise ValueError(f"{len(forward_s)} forward and {len(backward_s)} backward durations for "
                         f"{len(order)} ranks: need one per stage, a multiple of the ranks")
    done: dict[Action, float] = {}
    pos, clock = [0] * len(order), [0.0] * len(order)
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(order):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                if a.kind == "F":
                    dep = Action("F", a.stage - 1, a.microbatch) if a.stage > 0 else None
                    need = [dep] if dep else []
                else:
                    need = [Action("F", a.stage, a.microbatch)]
                    if a.stage < S - 1:
                        need.append(Action("B", a.stage + 1, a.microbatch))
                if any(d not in done for d in need):
                    break
                ready = max([clock[r]] + [done[d] + (send_s if d.stage != a.stage else 0.0) for d in need])
                clock[r] = ready + (forward_s if a.kind == "F" else backward_s)[a.stage]
                done[a] = clock[r]
                pos[r] += 1
                progress = True
    stuck = [(r, acts[pos[r]]) for r, acts in enumerate(order) if pos[r] < len(acts)]
    if stuck:
        raise _Deadlock(stuck)
    m = 1 + max(a.microbatch for acts in order for a in acts)
    want = {Action(k, s, x) for k in "FB" for s in range(S) for x in range(m)}
    if set(done) != want:
        raise ValueError(f"the order runs {len(done)} distinct actions; every stage's F and B of {m} micro-batches "
                         f"are {len(want)}")
    return Replay(makespan_s=max(clock), finish_s=tuple(clock), peak_inflight=tuple(peak_inflight(o) for o in order))


def bottleneck_slots(pp: int, virtual_stages: int, num_microbatches: int, group: int | None) -> float:
    """a of the pipeline time a·T + Σ_stages t / v: m − 1/v for torch's and Megatron-LM's N = p (`group`
    None; Narayanan et al. 2021 §2.2), else the makespan of the order for N = `group` (`uniform_slots`)."""
    if group is None:
        return num_microbatches - 1.0 / virtual_stages
    return uniform_slots(pp, virtual_stages, num_microbatches, group)


@lru_cache(maxsize=4096)
def group_peaks(pp: int, virtual_stages: int, num_microbatches: int, group: int) -> tuple[int, ...]:
    """Per rank, the most chunk-micro-batches the order for N = `group` holds (`peak_inflight`)."""
    return tuple(peak_inflight(o) for o in interleaved_order(pp, virtual_stages, num_microbatches, group))


@lru_cache(maxsize=4096)
def uniform_slots(pp: int, virtual_stages: int, num_microbatches: int, group: int) -> float:
    """The makespan of the order in units of one rank's per-micro-batch time T (all v chunks, forward and
    backward), chunks all alike, less the p/v of T that Σ_stages t / v adds: the coefficient a of
    a·T + Σt/v, the pipeline time the planner's objective charges (autopar.planner.problem). At N = p (and
    v = 1) it is m − 1/v, Narayanan et al.'s (m·v + p − 1) chunk slots."""
    p, v = pp, virtual_stages
    f = 1.0 / (1.0 + BACKWARD_PER_FORWARD)  # a chunk's forward, its forward + backward being 1
    S = p * v
    res = replay(interleaved_order(p, v, num_microbatches, group), (f,) * S, (1.0 - f,) * S)
    return (res.makespan_s - p) / v
