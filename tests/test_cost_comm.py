"""Collective model against docs/design.md §4's α-β formulas, plus monotonicity and locality properties."""

import dataclasses
import itertools
import random

import pytest

from cost_models import catalog
from cost_models.comm import CommModel, Topology, expected_units_hit, fit_link, hit_probability, interpolate_time_s
from cost_models.hardware import LinkSpec
from cost_models.profile import CollectiveSample

ALPHA, BW = 5e-6, 100e9
LINK = LinkSpec(name="test", bandwidth_Bps=BW, latency_s=ALPHA, source="test")
SLOW = LinkSpec(name="slow", bandwidth_Bps=BW / 8, latency_s=4 * ALPHA, source="test")


def ring_model(devices_per_node=8, intra=LINK, inter=SLOW):
    return CommModel(Topology(devices_per_node=devices_per_node, intra=intra, inter=inter), algorithm="ring")


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("n", [1e3, 1e6, 1e9])
def test_ring_formulas_of_design_section_4(k, n):
    cm = ring_model()
    assert cm.all_reduce_time_s(n, k) == pytest.approx(2 * (k - 1) * ALPHA + 2 * (k - 1) / k * n / BW)
    assert cm.all_gather_time_s(n, k) == pytest.approx((k - 1) * ALPHA + (k - 1) / k * n / BW)
    assert cm.reduce_scatter_time_s(n, k) == pytest.approx((k - 1) * ALPHA + (k - 1) / k * n / BW)


def test_flat_ring_across_nodes_runs_at_the_slowest_link():
    cm = ring_model()
    k, n = 16, 1e8  # 2 nodes × 8
    expected = 2 * (k - 1) * SLOW.latency_s + 2 * (k - 1) / k * n / SLOW.bandwidth_Bps
    assert cm.all_reduce_time_s(n, k, ranks_per_node=8) == pytest.approx(expected)


def test_hierarchical_all_reduce_is_rs_inside_ar_across_ag_inside():
    cm = CommModel(Topology(devices_per_node=8, intra=LINK, inter=SLOW), algorithm="hierarchical")
    n, loc, nodes = 1e9, 8, 4
    inside = (loc - 1) * ALPHA + (loc - 1) / loc * n / BW
    across = min(2 * (nodes - 1) * SLOW.latency_s + 2 * (nodes - 1) / nodes * (n / loc) / SLOW.bandwidth_Bps,
                 2 * 2 * SLOW.latency_s + 2 * (n / loc) / SLOW.bandwidth_Bps)
    assert cm.all_reduce_time_s(n, 32, ranks_per_node=8) == pytest.approx(2 * inside + across)
    # and it beats the flat ring for large messages, as NCCL's hierarchical/tree algorithms do
    assert cm.all_reduce_time_s(n, 32, 8) < ring_model().all_reduce_time_s(n, 32, 8)


def test_tree_wins_small_messages_ring_wins_large():
    auto = CommModel(Topology(devices_per_node=64, intra=LINK, inter=LINK))
    ring = CommModel(Topology(devices_per_node=64, intra=LINK, inter=LINK), algorithm="ring")
    tree = CommModel(Topology(devices_per_node=64, intra=LINK, inter=LINK), algorithm="tree")
    assert tree.all_reduce_time_s(1e3, 64) < ring.all_reduce_time_s(1e3, 64)
    assert ring.all_reduce_time_s(1e10, 64) < tree.all_reduce_time_s(1e10, 64)
    for n in (1e3, 1e6, 1e10):
        assert auto.all_reduce_time_s(n, 64) <= min(ring.all_reduce_time_s(n, 64), tree.all_reduce_time_s(n, 64))


def test_p2p_and_trivial_groups():
    cm = ring_model()
    assert cm.p2p_time_s(1e6, inter_node=False) == pytest.approx(ALPHA + 1e6 / BW)
    assert cm.p2p_time_s(1e6, inter_node=True) == pytest.approx(SLOW.latency_s + 1e6 / SLOW.bandwidth_Bps)
    assert cm.all_reduce_time_s(1e6, 1) == 0.0


def _ops(cm):
    return [cm.all_reduce_time_s, cm.all_gather_time_s, cm.reduce_scatter_time_s, cm.broadcast_time_s,
            cm.all_to_all_time_s]


PRESET_LINKS = [("nvlink3-nvswitch", "ib-hdr"), ("nvlink4-nvswitch", "ib-ndr"), ("pcie4-x16", "ib-hdr"),
                ("pcie5-x16", "roce-200g")]


def test_properties_on_random_layouts():
    rng = random.Random(0)
    for _ in range(300):
        intra_name, inter_name = rng.choice(PRESET_LINKS)
        intra, inter = catalog.link(intra_name), catalog.link(inter_name)
        per_node = rng.choice([2, 4, 8])
        rpn = rng.choice([d for d in (1, 2, 4, 8) if d <= per_node])
        nodes = rng.choice([2, 4, 16])
        k = rpn * nodes
        n = 10 ** rng.uniform(2, 10)
        base = CommModel(Topology(devices_per_node=per_node, intra=intra, inter=inter))
        faster_inter = CommModel(Topology(devices_per_node=per_node, intra=intra,
                                          inter=dataclasses.replace(inter, bandwidth_Bps=inter.bandwidth_Bps * 2)))
        faster_intra = CommModel(Topology(devices_per_node=per_node, inter=inter,
                                          intra=dataclasses.replace(intra, bandwidth_Bps=intra.bandwidth_Bps * 2)))
        one_node = CommModel(Topology(devices_per_node=k, intra=intra, inter=inter))
        for i, op in enumerate(_ops(base)):
            t = op(n, k, rpn)
            # more bandwidth is never slower
            assert _ops(faster_inter)[i](n, k, rpn) <= t * (1 + 1e-12)
            assert _ops(faster_intra)[i](n, k, rpn) <= t * (1 + 1e-12)
            # a larger message is never faster
            assert op(n * 1.5, k, rpn) >= t
            # the same group inside one node is never slower
            assert _ops(one_node)[i](n, k, k) <= t * (1 + 1e-12)


def test_measured_table_takes_precedence_and_is_monotone():
    samples = [CollectiveSample(op="all_reduce", group_size=2, n_bytes=s, time_s=t)
               for s, t in [(1024, 4e-4), (2**20, 2e-3), (2**22, 1.9e-3), (2**25, 3e-2)]]
    from cost_models.profile import MachineInfo, Profile

    prof = Profile(machine=MachineInfo(hostname="h", platform="p", processor="x", cpu_count=2, ram_bytes=1),
                   device_name="cpu", device_kind="cpu", device_count=2, torch_version="t", created="d",
                   backend="gloo", threads_per_process=1, launch_overhead_s=1e-6, collectives=tuple(samples))
    cm = CommModel(Topology(devices_per_node=2, intra=LINK, inter=LINK), profile=prof)
    pooled = (2e-3 * 1.9e-3) ** 0.5  # the dip and the row before it pooled (geometric mean: log-space fit)
    assert cm.all_reduce_time_s(2**20, 2) == pytest.approx(pooled)
    assert cm.all_reduce_time_s(2**22, 2) == pytest.approx(pooled)
    assert cm.all_reduce_time_s(2**21, 2) == pytest.approx(pooled)
    assert cm.all_reduce_time_s(10, 2) == pytest.approx(4e-4)  # below the table: the latency floor
    slope = (3e-2 - pooled) / (2**25 - 2**22)
    assert cm.all_reduce_time_s(2**26, 2) == pytest.approx(3e-2 + slope * 2**25)
    # a group size that was not measured falls back to the α-β formula
    four = CommModel(Topology(devices_per_node=4, intra=LINK, inter=LINK), profile=prof)
    plain = CommModel(Topology(devices_per_node=4, intra=LINK, inter=LINK))
    assert four.all_reduce_time_s(1e6, 4) == plain.all_reduce_time_s(1e6, 4)
    assert four.all_reduce_time_s(1e6, 2) != plain.all_reduce_time_s(1e6, 2)
    assert interpolate_time_s([(10, 1.0)], 20) == pytest.approx(2.0)


def test_fit_link_recovers_alpha_beta():
    alpha, beta = 50e-6, 2e9
    rows = [CollectiveSample(op="all_reduce", group_size=k, n_bytes=n,
                             time_s=2 * (k - 1) * alpha + 2 * (k - 1) / k * n / beta)
            for k in (2, 4) for n in (1e3, 1e5, 1e7, 1e8)]
    link = fit_link(rows, name="fit", source="test")
    assert link.latency_s == pytest.approx(alpha, rel=1e-6)
    assert link.bandwidth_Bps == pytest.approx(beta, rel=1e-6)


def test_bad_layout_is_explained():
    cm = ring_model()
    with pytest.raises(ValueError, match="ranks_per_node=3 must divide group_size=8"):
        cm.all_reduce_time_s(1e6, 8, ranks_per_node=3)
    with pytest.raises(ValueError, match="algorithm"):
        CommModel(Topology(devices_per_node=8, intra=LINK, inter=LINK), algorithm="magic")


@pytest.mark.parametrize("experts,top_k,group", [(8, 2, 2), (8, 2, 4), (12, 3, 3), (16, 4, 8), (6, 6, 1)])
def test_hit_probability_against_enumeration(experts, top_k, group):
    """1 − C(E − g, k)/C(E, k) against counting the top-k expert sets that touch the first g experts."""
    sets = list(itertools.combinations(range(experts), top_k))
    hits = sum(any(e < group for e in s) for s in sets)
    assert hit_probability(experts, top_k, group) == pytest.approx(hits / len(sets))


def _routings(experts: int, top_k: int, groups: int, open_groups: int) -> list[tuple[float, set[int]]]:
    """Every routing of one token with its probability: each set of open_groups of the groups alike; one
    expert of each open group alike (when top_k ≥ open_groups), the other experts alike among the rest."""
    width = experts // groups
    opens = list(itertools.combinations(range(groups), open_groups))
    out = []
    for chosen in opens:
        members = [list(range(j * width, (j + 1) * width)) for j in chosen]
        firsts = list(itertools.product(*members)) if top_k >= open_groups else [()]
        for first in firsts:
            rest = [e for grp in members for e in grp if e not in first]
            sets = list(itertools.combinations(rest, top_k - len(first)))
            out += [(1.0 / (len(opens) * len(firsts) * len(sets)), set(first) | set(s)) for s in sets]
    return out


@pytest.mark.parametrize("experts,top_k,units,groups,open_groups", [
    (8, 3, 4, 4, 2),     # groups of 2 experts on units of 2: one group a unit
    (16, 4, 4, 8, 3),    # two groups a unit
    (16, 4, 8, 4, 2),    # a group over two units
    (12, 2, 3, 4, 2),    # groups of 3 across units of 4: not nested
    (12, 3, 6, 6, 6),    # every group open: uniform routing
    (8, 2, 8, 2, 1),     # per rank, one group of 4 open
    (16, 2, 4, 8, 3),    # fewer experts than open groups: all alike among the open ones
])
def test_expected_units_hit_against_enumeration(experts, top_k, units, groups, open_groups):
    """Group-limited routing's expected destinations per token against enumerating every routing; with every
    group open, units · hit_probability."""
    got = expected_units_hit(experts, top_k, units, groups, open_groups)
    size = experts // units
    if open_groups == groups:
        want = units * hit_probability(experts, top_k, size)
    else:
        want = sum(p * len({e // size for e in s}) for p, s in _routings(experts, top_k, groups, open_groups))
    assert got == pytest.approx(want)
    assert expected_units_hit(experts, top_k, units) == pytest.approx(units * hit_probability(experts, top_k, size))
    with pytest.raises(ValueError, match="group_top_k"):
        expected_units_hit(256, 8, 8, 8, 0)
    with pytest.raises(ValueError, match="open experts"):
        expected_units_hit(16, 8, 4, 8, 1)  # one group of 2 cannot hold a top-8


def test_deepseek_v3_nodes_a_token_reaches():
    """DeepSeek-V3's router (arXiv 2412.19437 §2.1.2: 256 experts, 8 groups of 32 = one node's under EP64 on 8
    nodes, the 4 groups with the largest sum of their top-2 affinities open, top-8 among them), run on
    independent random scores: the nodes a token reaches average within 2% of expected_units_hit's 4 (at most
    4, fewer than the 5.3 of routing open to all; 3.63 if the 8 were drawn alike among the 128 open experts)."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    tokens = 20000
    scores = torch.randn(tokens, 256, generator=gen).sigmoid()
    best = scores.view(tokens, 8, 32).topk(2, dim=-1).values.sum(-1).topk(4, dim=-1).indices
    open_ = torch.zeros(tokens, 8, dtype=torch.bool).scatter(1, best, True).repeat_interleave(32, dim=1)
    groups = scores.masked_fill(~open_, -1.0).topk(8, dim=-1).indices // 32
    nodes = torch.stack([(groups == j).any(-1) for j in range(8)], -1).sum(-1).double().mean().item()
    assert expected_units_hit(256, 8, 8, 8, 4) == pytest.approx(nodes, rel=0.02)
    assert nodes <= 4 < expected_units_hit(256, 8, 8)


def test_deepep_dispatch_with_group_limited_routes():
    """DeepEP's dispatch over 4 nodes × 1 rank, 8 experts in 4 groups (one a node), top-3 in the 2 groups a
    token may use: InfiniBand bytes per token = the other nodes its routing reaches, enumerated (1.5 a token,
    1.9 with every group open)."""
    cm = ring_model(devices_per_node=1)
    experts, top_k, ranks, tokens, token_bytes = 8, 3, 4, 1000.0, 4096.0
    routes = sum(p * len({e // 2 for e in s} - {0}) for p, s in _routings(experts, top_k, 4, 2))
    got = cm.dispatch_time_s("deepep", tokens=tokens, token_bytes=token_bytes, num_experts=experts, top_k=top_k,
                             group_size=ranks, ranks_per_node=1, route_groups=4, route_group_top_k=2)
    assert got == pytest.approx(SLOW.latency_s + tokens * token_bytes * routes / SLOW.bandwidth_Bps)
    assert got < cm.dispatch_time_s("deepep", tokens=tokens, token_bytes=token_bytes, num_experts=experts,
                                    top_k=top_k, group_size=ranks, ranks_per_node=1)


def test_deepep_dispatch_against_enumerated_routes():
    """DeepEP's dispatch over 2 nodes × 2 ranks, 8 experts (2 a rank), top-2: the bytes a rank sends over
    InfiniBand (one copy per other node its token reaches) and over NVLink (one per destination GPU other than
    the same-index GPU the copy lands on), averaged over every routing, each at its own link, the slower wins."""
    cm = ring_model(devices_per_node=2)
    experts, top_k, ranks, rpn, tokens, token_bytes = 8, 2, 4, 2, 1000.0, 4096.0
    sets = list(itertools.combinations(range(experts), top_k))
    rdma = nvlink = 0.0
    for s in sets:  # the sender is rank 0 (node 0, local index 0); expert e lives on rank e // 2, node e // 4
        dest_ranks = {e // (experts // ranks) for e in s}
        rdma += len({r // rpn for r in dest_ranks} - {0})
        nvlink += sum(1 for r in dest_ranks if r % rpn != 0)
    rdma_s = SLOW.latency_s + tokens * token_bytes * rdma / len(sets) / SLOW.bandwidth_Bps
    nvlink_s = ALPHA + tokens * token_bytes * nvlink / len(sets) / BW
    got = cm.dispatch_time_s("deepep", tokens=tokens, token_bytes=token_bytes, num_experts=experts, top_k=top_k,
                             group_size=ranks, ranks_per_node=rpn)
    assert got == pytest.approx(max(rdma_s, nvlink_s))
    a2a = cm.dispatch_time_s("all_to_all", tokens=tokens, token_bytes=token_bytes, num_experts=experts,
                             top_k=top_k, group_size=ranks, ranks_per_node=rpn)
    assert a2a == pytest.approx(cm.all_to_all_time_s(tokens * top_k * token_bytes, ranks, rpn))
    assert got < a2a  # a token reaching both experts of a node crosses InfiniBand once
    with pytest.raises(ValueError, match="dispatcher"):
        cm.dispatch_time_s("nccl", tokens=tokens, token_bytes=token_bytes, num_experts=experts, top_k=top_k,
                           group_size=ranks)
