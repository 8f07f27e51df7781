"""Collective communication time over a process group laid out on a cluster (α-β model).

Each algorithm is a sum of phases; a phase over K ranks on one link class (latency α, achieved
bandwidth β = bandwidth × efficiency) costs, for an n-byte buffer (Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH"; docs/design.md §4):

    ring all-reduce           2(K−1)·α + 2(K−1)/K · n/β
    ring all-gather / reduce-scatter  (K−1)·α + (K−1)/K · n/β      (n = the full, gathered buffer)
    tree all-reduce (pipelined double binary tree, as NCCL's)   2⌈log2 K⌉·α + 2·n/β
    broadcast (pipelined ring / tree)  min(K−1, ⌈log2 K⌉)·α + n/β
    all-to-all (pairwise exchange)     (K−1)·α + (K−1)/K · n/β
    two-level ("hierarchical", L ranks per node × N nodes): all-reduce = reduce-scatter inside the node,
        all-reduce of n/L across nodes on each rank's own NIC (rails), all-gather inside the node.

A flat ring or tree that crosses nodes runs at its slowest link. Reaching another node's device goes
through the local fabric as well, so the inter-node link used is (max α, min β) of the two — which
also makes a group inside one node never slower than the same group spread over nodes. "auto" takes
the fastest algorithm; each is monotone in n and β, so is their minimum.

When a `Profile` measured the same collective over the same number of local processes, its table
(interpolated in log-size, made monotone) takes precedence over the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import numpy as np

from cost_models.hardware import LinkSpec
from cost_models.monotone import nondecreasing_fit
from cost_models.profile import CollectiveSample, Profile

__all__ = ["Topology", "CommModel", "ALGORITHMS", "EP_DISPATCHERS", "PIPELINE_P2P", "fit_link", "hit_probability",
           "expected_units_hit", "interpolate_time_s"]

ALGORITHMS = ("auto", "ring", "tree", "hierarchical")

# How a pipeline runtime moves a stage-boundary tensor, as (transfer times per boundary and micro-batch, TP
# slices): in the 1F1B steady state the activation goes forward and its gradient comes back across every
# boundary once per micro-batch.
#   batched         the send and the receive of a boundary are issued together and run at once on the two
#                   directions of the full-duplex link (torch.distributed.batch_isend_irecv: autopar's
#                   runtime, torch.distributed.pipelining's schedules): one transfer time
#   scatter_gather  batched, and each of the t tensor-parallel ranks, which all hold the same boundary
#                   tensor, sends only its 1/t slice; the receiver all-gathers the slices over the TP group
#                   inside the node (Narayanan et al. SC'21 §4.1, "scatter/gather optimization"; Megatron-LM
#                   p2p_communication, --scatter-gather-tensors-in-pipeline, on by default); with sequence
#                   parallelism the tensor is already sharded and nothing changes
#   blocking        every send and every receive is a call of its own that blocks the compute stream until
#                   the peer has matched it: the activation and the gradient of a boundary cross one after
#                   the other, two transfer times. A discrete-event replay of DeepSpeed's TrainSchedule
#                   with rendezvous transfers (tests/test_pipeline_p2p.py) gives 4 transfer times per
#                   micro-batch on a middle stage and 2 on the last, where batched issue gives 2 and 1
#   blocking_scatter_gather  both: DeepSpeed's PipelineEngine (deepspeed/runtime/pipe/p2p.py send/recv assert
#                   async_op == False and call dist.send / dist.recv; schedule.py TrainSchedule issues
#                   RecvActivation then SendGrad, SendActivation then RecvGrad; engine.py partitions the
#                   boundary tensors over the model-parallel group, PartitionedTensor, and all-gathers them
#                   with `full()` on arrival, and the sender re-gathers its own output before backward)
PIPELINE_P2P = {"batched": (1, False), "scatter_gather": (1, True), "blocking": (2, False),
                "blocking_scatter_gather": (2, True)}

# How an expert-parallel group moves the routed tokens of a mixture-of-experts layer (dispatch, and the
# combine that returns them, CommModel.dispatch_time_s):
#   all_to_all  one copy per (token, chosen expert), an all-to-all over the group (NCCL all_to_all_single:
#               autopar's runtime, Megatron-Core's "alltoall" token dispatcher; GShard, Lepikhin et al. 2021)
#   deepep      DeepEP's normal kernels (Megatron-Core's "flex" dispatcher with the DeepEP backend): a token
#               crosses InfiniBand once per destination node, to the GPU of its own local index there, which
#               forwards it over NVLink once to each destination GPU of that node (its own node's over NVLink
#               directly); both links run at once (deepseek-ai/DeepEP docs/legacy.md, "Normal kernels with
#               NVLink and RDMA forwarding"). Its published bottleneck bandwidths are logical, counting the
#               node's own share as sent (README.md, V2 table note): at EP 8 x 2 90 GB/s (x 1/2 remote = 45),
#               8 x 4 61 GB/s (x 3/4 = 46), V1 EP32 58 GB/s (x 3/4 = 44) and EP64 51 GB/s (x 7/8 = 45) of a
#               CX7's 50 GB/s, the ~90% of the line rate the NIC sustains for NCCL too (links.toml ib-ndr
#               efficiency); V1's EP16, 43 GB/s (x 1/2 = 22), is the exception, which V2 doubles on 2 nodes
EP_DISPATCHERS = ("all_to_all", "deepep")


def hit_probability(num_experts: int, top_k: int, group_experts: int) -> float:
    """The chance that a token's top_k distinct experts, drawn uniformly from num_experts, include at least one
    of a group of group_experts (the experts of one rank or one node): 1 − C(E − g, k) / C(E, k)."""
    if not 1 <= top_k <= num_experts or not 0 <= group_experts <= num_experts:
        raise ValueError(f"hit_probability: top_k={top_k}, group_experts={group_experts} of "
                         f"num_experts={num_experts}; expected 1 ≤ top_k ≤ E and 0 ≤ g ≤ E")
    miss = 1.0
    for i in range(top_k):  # C(E − g, k) / C(E, k) as a product, no big integers
        miss *= max(0, num_experts - group_experts - i) / (num_experts - i)
    return 1.0 - miss


@cache
def expected_units_hit(num_experts: int, top_k: int, units: int, groups: int = 1, group_top_k: int = 1) -> float:
    """Expected number of distinct units (the ranks or nodes an EP group's experts are split over, E / units
    consecutive experts each) one token's top_k experts land on, under a balanced router (every expert alike,
    as hit_probability assumes). A router that opens only group_top_k = m of `groups` groups of E / groups
    consecutive experts to a token (group-limited routing, MoESpec.route_groups; m = groups: every expert
    open) opens a group for its best experts (DeepSeek-V3 §2.1.2 ranks nodes by the sum of their top
    K_r / M = 2 experts' affinities): each set of m groups alike, one expert of each open group chosen (when
    top_k ≥ m) and the other top_k − m alike among the rest of the open experts. DeepSeek-V3's router (8 groups
    of 32 experts, 4 open, top-8; one group a node under EP64 on 8 nodes) then reaches 4.0 nodes, its own
    rule on independent scores 3.96 (tests/test_cost_comm.py), where picking all 8 alike among the open
    experts would give 3.63 and every group open 5.29.

    Per unit u, with a_j of its experts in group j and the open set S: P(u missed | S) = Π_{j∈S}(1 − a_j / w)
    · C(n − m − a_S, k − m) / C(n − m, k − m), w = E / groups, n = m · w, a_S = Σ_{j∈S} a_j (no forced
    picks, the product empty and m → 0 in the binomials, when top_k < m); the open sets are summed by
    (groups taken, a_S), so the expectation is exact without enumerating them."""
    e, k, g, m = num_experts, top_k, groups, group_top_k
    if units < 1 or e % units or g < 1 or e % g or not 1 <= m <= g or not 1 <= k <= m * (e // g):
        raise ValueError(f"expected_units_hit: num_experts={e}, top_k={k}, units={units}, groups={g}, "
                         f"group_top_k={m}; expected units and groups dividing the experts, 1 ≤ group_top_k ≤ "
                         "groups and 1 ≤ top_k ≤ the open experts")
    if m == g:
        return units * hit_probability(e, k, e // units)
    size, width = e // units, e // g
    total = 0.0
    for u in range(units):
        lo, hi = u * size, (u + 1) * size
        overlaps = [min(hi, (j + 1) * width) - max(lo, j * width) for j in range(g)]
        total += 1.0 - _miss_probability(tuple(sorted(a for a in overlaps if a > 0)), g, m, width, k)
    return total


@cache
def _miss_probability(overlaps: tuple[int, ...], groups: int, open_groups: int, width: int, k: int) -> float:
    """P(a unit with `overlaps` experts in some groups of `width` (none in the rest) gets none of a token's k
    experts), routed as expected_units_hit describes."""
    forced = open_groups if k >= open_groups else 0  # one expert of each open group
    ways: dict[tuple[int, int], float] = {(0, 0): 1.0}  # (unit's groups open, its experts in them) → Σ Π(1 − a/w)
    for a in overlaps:
        nxt = dict(ways)
        keep = 1.0 - a / width if forced else 1.0
        for (c, s), w in ways.items():
            if c < open_groups:
                nxt[(c + 1, s + a)] = nxt.get((c + 1, s + a), 0.0) + w * keep
        ways = nxt
    others, pool, extra = groups - len(overlaps), open_groups * width - forced, k - forced
    miss = 0.0
    for (c, s), w in ways.items():
        count = w * math.comb(others, open_groups - c)
        if count:
            p = 1.0
            for i in range(extra):  # C(pool − s, extra) / C(pool, extra) as a product
                p *= max(0, pool - s - i) / (pool - i)
            miss += count * p
    return miss / math.comb(groups, open_groups)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """devices_per_node devices share the `intra` fabric; nodes talk over `inter` (one port per device)."""

    devices_per_node: int
    intra: LinkSpec
    inter: LinkSpec

    def __post_init__(self) -> None:
        if self.devices_per_node < 1:
            raise ValueError(f"Topology.devices_per_node={self.devices_per_node}; it must be ≥ 1")


@dataclass(frozen=True)
class _Link:
    alpha_s: float
    beta_Bps: float

    @classmethod
    def of(cls, spec: LinkSpec) -> _Link:
        return cls(spec.latency_s, spec.effective_bandwidth_Bps)

    def worst(self, other: _Link) -> _Link:
        return _Link(max(self.alpha_s, other.alpha_s), min(self.beta_Bps, other.beta_Bps))


def _log2ceil(k: int) -> int:
    return max(1, math.ceil(math.log2(k))) if k > 1 else 0


# ---- one phase of each collective on one link class (k ranks, n-byte buffer) ----
def _ring_ar(n: float, k: int, li: _Link) -> float:
    return 0.0 if k <= 1 else 2 * (k - 1) * li.alpha_s + 2 * (k - 1) / k * n / li.beta_Bps


def _tree_ar(n: float, k: int, li: _Link) -> float:
    return 0.0 if k <= 1 else 2 * _log2ceil(k) * li.alpha_s + 2 * n / li.beta_Bps


def _ring_ag(n: float, k: int, li: _Link) -> float:  # also reduce-scatter and all-to-all
    return 0.0 if k <= 1 else (k - 1) * li.alpha_s + (k - 1) / k * n / li.beta_Bps


def _bcast(n: float, k: int, li: _Link) -> float:
    return 0.0 if k <= 1 else min(k - 1, _log2ceil(k)) * li.alpha_s + n / li.beta_Bps


def _divisors(k: int) -> list[int]:
    return [d for d in range(1, k + 1) if k % d == 0]


def interpolate_time_s(table: list[tuple[int, float]], n_bytes: float) -> float:
    """Time for n_bytes from measured (size, time) rows: log-log interpolation inside the range, the
    smallest time below it, and the last measured slope (bytes/s) beyond it. Times are first made
    non-decreasing in size (the least-squares monotone fit), so a larger message is never predicted faster."""
    table = sorted(table)
    sizes = np.array([float(s) for s, _ in table])
    times = np.array(nondecreasing_fit([t for _, t in table]))
    if n_bytes <= sizes[0]:
        return float(times[0])
    if n_bytes >= sizes[-1]:
        if len(sizes) == 1:
            return float(times[-1] * n_bytes / sizes[-1])
        slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        return float(times[-1] + slope * (n_bytes - sizes[-1]))
    return float(np.exp(np.interp(np.log(n_bytes), np.log(sizes), np.log(times))))


def fit_link(samples: list[CollectiveSample], *, name: str, source: str) -> LinkSpec:
    """The α and β that best explain measured all-reduces with the ring formula, in relative least
    squares over every size and group size (each row divided by its measured time)."""
    rows = [s for s in samples if s.op == "all_reduce"]
    if len(rows) < 2:
        raise ValueError(f"fitting link {name!r} needs ≥ 2 all_reduce samples; the profile has {len(rows)}")
    a = np.array([[2.0 * (s.group_size - 1), 2.0 * (s.group_size - 1) / s.group_size * s.n_bytes] for s in rows])
    t = np.array([s.time_s for s in rows])
    coef, *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    alpha_s = max(float(coef[0]), 0.0)
    inv_beta = float(coef[1])
    if inv_beta <= 0:  # latency-only data: take the best measured bus bandwidth
        inv_beta = 1.0 / max(s.busbw_Bps for s in rows)
    return LinkSpec(name=name, bandwidth_Bps=1.0 / inv_beta, latency_s=alpha_s, source=source,
                    extra={"efficiency": 1.0})


class CommModel:
    """Time of collectives on a `Topology`; `profile` tables take precedence for local groups.

    ranks_per_node: how many members of the group sit on each node (default: as many as fit on one
    node); a group with group_size > ranks_per_node spans group_size / ranks_per_node nodes.
    """

    def __init__(self, topo: Topology, profile: Profile | None = None, algorithm: str = "auto") -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}; expected one of {ALGORITHMS}")
        self.topo = topo
        self.profile = profile
        self.algorithm = algorithm
        self._intra = _Link.of(topo.intra)
        self._inter = _Link.of(topo.inter).worst(self._intra)

    def __repr__(self) -> str:
        return f"CommModel({self.topo.devices_per_node}/node, {self.topo.intra.name} | {self.topo.inter.name}, " \
               f"{self.algorithm}, profile={'yes' if self.profile else 'no'})"

    # ---- layout ----
    def _layout(self, group_size: int, ranks_per_node: int | None) -> tuple[int, int]:
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r}; it must be a positive integer")
        rpn = min(group_size, self.topo.devices_per_node) if ranks_per_node is None else ranks_per_node
        if rpn < 1 or rpn > self.topo.devices_per_node or group_size % rpn:
            raise ValueError(
                f"ranks_per_node={rpn} must divide group_size={group_size} and be at most "
                f"devices_per_node={self.topo.devices_per_node}"
            )
        return rpn, group_size // rpn

    def _measured(self, op: str, n_bytes: float, group_size: int, nodes: int) -> float | None:
        if self.profile is None or nodes != 1:
            return None
        table = self.profile.collective_table(op, group_size)
        return interpolate_time_s(table, n_bytes) if table else None

    def _priced(self, op: str, n_bytes: float, group_size: int, ranks_per_node: int | None,
                model: Callable[[int, int], float]) -> float:
        """The time of collective `op`: zero for one rank or no bytes, else the profile's measured table,
        else `model(ranks_per_node, nodes)` (the α-β formulas)."""
        rpn, nodes = self._layout(group_size, ranks_per_node)
        if group_size == 1 or n_bytes <= 0:
            return 0.0
        measured = self._measured(op, n_bytes, group_size, nodes)
        return measured if measured is not None else model(rpn, nodes)

    def _pick(self, candidates: dict[str, float]) -> float:
        if self.algorithm == "auto":
            return min(candidates.values())
        return candidates.get(self.algorithm, min(candidates.values()))

    def _two_level(self, k: int, nodes: int) -> list[tuple[int, int, _Link]]:
        """(local ranks L, outer groups N, outer link) splits to consider. A group inside one node may
        split itself L × N over its own fabric, so it always has every split a spanning group has."""
        if nodes > 1:
            return [(k // nodes, nodes, self._inter)]
        return [(d, k // d, self._intra) for d in _divisors(k) if 1 < d < k]

    # ---- collectives ----
    def all_reduce_time_s(self, n_bytes: float, group_size: int, ranks_per_node: int | None = None) -> float:
        return self._priced("all_reduce", n_bytes, group_size, ranks_per_node,
                            lambda rpn, nodes: self._all_reduce_model(n_bytes, group_size, nodes))

    def _all_reduce_model(self, n_bytes: float, group_size: int, nodes: int) -> float:
        flat = self._inter if nodes > 1 else self._intra
        cands = {"ring": _ring_ar(n_bytes, group_size, flat), "tree": _tree_ar(n_bytes, group_size, flat)}
        hier = [
            _ring_ag(n_bytes, loc, self._intra) * 2
            + min(_ring_ar(n_bytes / loc, outer, link), _tree_ar(n_bytes / loc, outer, link))
            for loc, outer, link in self._two_level(group_size, nodes)
        ]
        if hier:
            cands["hierarchical"] = min(hier)
        return self._pick(cands)

    def _gather_like(self, op: str, n_bytes: float, group_size: int, ranks_per_node: int | None) -> float:
        return self._priced(op, n_bytes, group_size, ranks_per_node,
                            lambda rpn, nodes: self._gather_model(n_bytes, group_size, nodes))

    def _gather_model(self, n_bytes: float, group_size: int, nodes: int) -> float:
        flat = self._inter if nodes > 1 else self._intra
        cands = {"ring": _ring_ag(n_bytes, group_size, flat)}
        hier = [_ring_ag(n_bytes / loc, outer, link) + _ring_ag(n_bytes, loc, self._intra)
                for loc, outer, link in self._two_level(group_size, nodes)]
        if hier:
            cands["hierarchical"] = min(hier)
        return self._pick(cands)

    def all_gather_time_s(self, n_bytes: float, group_size: int, ranks_per_node: int | None = None) -> float:
        """n_bytes is the gathered (output) buffer; each rank contributes n_bytes / group_size."""
        return self._gather_like("all_gather", n_bytes, group_size, ranks_per_node)

    def reduce_scatter_time_s(self, n_bytes: float, group_size: int, ranks_per_node: int | None = None) -> float:
        """n_bytes is the input buffer; each rank keeps n_bytes / group_size of the sum."""
        return self._gather_like("reduce_scatter", n_bytes, group_size, ranks_per_node)

    def broadcast_time_s(self, n_bytes: float, group_size: int, ranks_per_node: int | None = None) -> float:
        return self._priced("broadcast", n_bytes, group_size, ranks_per_node,
                            lambda rpn, nodes: self._broadcast_model(n_bytes, group_size, nodes))

    def _broadcast_model(self, n_bytes: float, group_size: int, nodes: int) -> float:
        flat = self._inter if nodes > 1 else self._intra
        cands = {"ring": _bcast(n_bytes, group_size, flat)}
        hier = [_bcast(n_bytes, outer, link) + _bcast(n_bytes, loc, self._intra)
                for loc, outer, link in self._two_level(group_size, nodes)]
        if hier:
            cands["hierarchical"] = min(hier)
        return self._pick(cands)

    def all_to_all_time_s(self, n_bytes: float, group_size: int, ranks_per_node: int | None = None) -> float:
        """n_bytes is one rank's send buffer; (K−1)/K of it leaves the rank. Traffic to other nodes and
        inside the node are counted one after the other (conservative: NICs and NVLink may overlap)."""
        k = group_size

        def model(rpn: int, nodes: int) -> float:
            local = (rpn - 1) * self._intra.alpha_s + (rpn - 1) / k * n_bytes / self._intra.beta_Bps
            remote = (k - rpn) * self._inter.alpha_s + (k - rpn) / k * n_bytes / self._inter.beta_Bps
            return local + remote

        return self._priced("all_to_all", n_bytes, group_size, ranks_per_node, model)

    def dispatch_time_s(self, dispatcher: str, *, tokens: float, token_bytes: float, num_experts: int, top_k: int,
                        group_size: int, ranks_per_node: int | None = None, route_groups: int = 1,
                        route_group_top_k: int = 1) -> float:
        """One dispatch (or combine: the same bytes back) of one rank's `tokens` tokens of token_bytes each,
        each routed to top_k of num_experts experts split evenly over the group's ranks in order, by
        `dispatcher` (EP_DISPATCHERS). "all_to_all": an all-to-all of the tokens · top_k copies. "deepep":
        over InfiniBand one copy per token and destination node other than its own, over NVLink one per
        token and destination GPU other than the one the copy reaches the node on (its own index); the two
        at once, so the slower of them. Destinations per token: expected_units_hit (route_groups /
        route_group_top_k: a router that opens only some expert groups to a token), the token's own node
        (and GPU) one of them as often as any other."""
        if dispatcher not in EP_DISPATCHERS:
            raise ValueError(f"dispatcher={dispatcher!r}; expected one of {EP_DISPATCHERS}")
        rpn, nodes = self._layout(group_size, ranks_per_node)
        if dispatcher == "all_to_all":
            return self.all_to_all_time_s(tokens * top_k * token_bytes, group_size, ranks_per_node)
        if group_size == 1 or tokens <= 0:
            return 0.0
        routing = (num_experts, top_k)
        node_hits = expected_units_hit(*routing, nodes, route_groups, route_group_top_k)
        rank_hits = expected_units_hit(*routing, group_size, route_groups, route_group_top_k)
        rdma_bytes = tokens * token_bytes * node_hits * (nodes - 1) / nodes
        nvlink_bytes = tokens * token_bytes * rank_hits * (rpn - 1) / rpn
        rdma = self._inter.alpha_s + rdma_bytes / self._inter.beta_Bps if nodes > 1 else 0.0
        nvlink = self._intra.alpha_s + nvlink_bytes / self._intra.beta_Bps if rpn > 1 else 0.0
        return max(rdma, nvlink)

    def p2p_time_s(self, n_bytes: float, inter_node: bool) -> float:
        """One send/recv of n_bytes between two ranks (pipeline stage boundaries)."""
        if n_bytes <= 0:
            return 0.0
        if not inter_node:
            measured = self._measured("p2p", n_bytes, 2, 1)
            if measured is not None:
                return measured
        link = self._inter if inter_node else self._intra
        return link.alpha_s + n_bytes / link.beta_Bps
