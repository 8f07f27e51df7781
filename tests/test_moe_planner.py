"""Expert parallelism in the config, the search space, the cost model and the planner (its runtime:
tests/test_expert_parallel.py).

References are independent of the code under test: the ZeRO state formulas of docs/design.md §4 applied
to the dense and the expert parameters apart, the all-to-all α-β formula written out, a grouped GEMM as
its groups' GEMMs, the busiest rank's load against simulated routing, and a plan that must split the
experts to fit memory.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from statistics import NormalDist

import pytest
import torch

import autopar
from autopar.capture.moe_spec import MoESpec
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.planner.costs import CostModel
from autopar.planner.moe_load import busiest_rank_factor
from autopar.planner.space import Candidate, enumerate_candidates, ep_degrees
from cost_models.compute import ComputeModel

sys.path.insert(0, str(Path(__file__).parent))
from hf_families import build_family  # noqa: E402
from test_planner import fake_cluster  # noqa: E402

SEQ = 16


@pytest.fixture(scope="module")
def moe():
    """Tiny Mixtral (4 experts, top-2) in bf16, captured, and its model (fp32, for parallelize)."""
    model = build_family("mixtral")
    graph = autopar.capture(model.to(torch.bfloat16), (torch.zeros(1, SEQ, dtype=torch.long),))
    return model.float(), graph


def _cand(**kw) -> Candidate:
    base = dict(tp=1, pp=1, dp=4, zero_stage=0, micro_batch_size=2, num_microbatches=1, schedule="1f1b",
                virtual_stages=1, sequence_parallel=False)
    return Candidate(**{**base, **kw})


def test_config_ep_round_trip_and_checks() -> None:
    c = ParallelConfig(dp=4, ep=2, zero_stage=1)
    assert c.edp == 2 and "ep=2" in str(c)
    assert ParallelConfig.parse(str(c)) == c == ParallelConfig.from_dict(c.to_dict())
    assert "ep" not in str(ParallelConfig(dp=4))  # dense layouts print as before
    with pytest.raises(ConfigError, match=r"ep=3 must divide dp=4.*possible ep: \[1, 2, 4\]"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(ConfigError, match="ep"):
        PlannerOptions(ep=0)


def test_config_ep_folds_over_tp() -> None:
    """Parallel Folding at ETP = 1: where tp divides ep the EP group is the tp ranks of ep / tp consecutive
    data-parallel ranks, edp = dp · tp / ep; otherwise ep data-parallel ranks, the bank replicated over tp."""
    qwen = ParallelConfig(tp=2, dp=128, ep=8)  # Megatron's Qwen3-235B row: TP2 EP8 ETP1 EDP32 DP128
    assert qwen.ep_folded and qwen.ep_dp == 4 and qwen.edp == 32
    assert qwen.ep_text() == "ep=8 (over tp2 x dp4, edp=32)"
    two = ParallelConfig(tp=2, dp=1, ep=2)  # ep needs no data parallelism when folded
    assert two.ep_folded and two.edp == 1 and ParallelConfig.parse(str(two)) == two
    assert ParallelConfig(tp=2, dp=2, ep=4).edp == 1
    apart = ParallelConfig(tp=4, dp=2, ep=2)  # tp does not divide ep: over dp, replicated over tp
    assert not apart.ep_folded and apart.edp == 1 and apart.ep_text() == "ep=2 (over dp2 x tp4 replicas, edp=1)"
    with pytest.raises(ConfigError, match=r"ep=3 must divide dp=4 .*or be a multiple of tp=2 dividing dp · tp = 8"
                                          r".*possible ep: \[1, 2, 4, 8\]"):
        ParallelConfig(tp=2, dp=4, ep=3)
    with pytest.raises(ConfigError, match=r"ep=8 must divide dp=2.*possible ep: \[1, 2, 4\]"):
        ParallelConfig(tp=2, dp=2, ep=8)


def test_ep_degrees_follow_dp_and_expert_count(moe) -> None:
    _, g = moe
    assert ep_degrees(g, 8) == [1, 2, 4]  # 4 experts: ep 8 would leave ranks without one
    assert ep_degrees(g, 1, tp=2) == [1, 2]  # folded over the tp pair
    assert ep_degrees(g, 2, tp=2) == [1, 2, 4]  # 4: tp2 x dp2
    assert ep_degrees(g, 2, tp=4) == [1, 2, 4]  # 2: over dp2, replicated over tp4; 4: folded over tp4
    dense, x = autopar.zoo.build("gpt-tiny", seq_len=8)
    assert ep_degrees(autopar.capture(dense, x), 8) == [1]
    cands = enumerate_candidates(g, world_size=8, devices_per_node=8, global_batch_size=8, options=PlannerOptions())
    assert {c.ep for c in cands if c.dp == 8} == {1, 2, 4}
    with pytest.raises(InfeasiblePlanError, match="does not divide the expert count"):
        enumerate_candidates(g, world_size=8, devices_per_node=8, global_batch_size=8, options=PlannerOptions(ep=8))


def _states(n: float, zero: int, k: int) -> float:
    """ZeRO's per-device bytes of n parameters over k ranks under the bf16 policy (docs/design.md §4): fp32
    masters (4), fp32 gradients (4), two fp32 Adam moments (8), and the 16-bit compute copy (2) that autocast
    holds under ZeRO-0 (or on one rank) and FSDP2's gathered weights hold under ZeRO-2. ZeRO-1 is the
    distributed optimizer (autopar/codegen/dist_optimizer.py): 16-bit weights (2) and fp32 main gradients (4)
    whole, fp32 masters and moments (12) over k."""
    if k == 1:
        return 18 * n
    return {0: 18 * n, 1: 6 * n + 12 * n / k, 2: 2 * n + 16 * n / k, 3: 16 * n / k}[zero]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_states_sharded_over_ep_and_edp(moe, zero: int, ep: int) -> None:
    _, g = moe
    costs = CostModel.for_cluster(g, fake_cluster())
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    layer = costs.memory.runs[ri][0]
    dense, experts = layer.num_params - layer.moe.expert_params, layer.moe.expert_params
    want = _states(dense, zero, 4) + _states(experts / ep, zero, 4 // ep)
    assert costs.memory.run_state_bytes(ri, 1, zero, 4, ep) == pytest.approx(want)


def _busiest(m, ep: int, tokens: int) -> float:
    """The busiest rank's load ÷ the mean, written out: skew × (1 + z · sqrt((E−k)/((E−1)·T·k))) for
    multinomial rank loads of k distinct experts a token, z = Φ⁻¹((ep − 0.375)/(ep + 0.25)) (Blom's
    expected maximum of ep normals)."""
    if ep == 1:
        return 1.0
    z = NormalDist().inv_cdf((ep - 0.375) / (ep + 0.25))
    E, k = m.num_experts, m.top_k
    return m.load_imbalance * (1 + z * math.sqrt((E - k) / ((E - 1) * tokens * k)))


@pytest.mark.parametrize("ep,tokens,k", [(8, 512, 2), (4, 256, 2), (16, 128, 8), (2, 256, 1)])
def test_busiest_rank_factor_matches_simulated_routing(ep: int, tokens: int, k: int) -> None:
    """A balanced router (each token picks k distinct experts uniformly at random) simulated on ep ranks of
    E / ep experts each: the mean over trials of the busiest rank's load ÷ the mean is the derived factor
    within the Monte-Carlo error and the normal approximation (8% of the excess over 1)."""
    experts = 2 * ep
    spec = MoESpec(experts="x", router=None, block="b", num_experts=experts, top_k=k, expert_params=1,
                   expert_param_bytes=2, tokens_per_sample=tokens)
    gen = torch.Generator().manual_seed(0)
    trials = 300
    picks = torch.rand(trials, ep * tokens, experts, generator=gen).topk(k, dim=-1).indices  # [trials, T·ep, k]
    load = torch.nn.functional.one_hot(picks // (experts // ep), ep).sum(dim=(1, 2)).float()  # [trials, ep]
    simulated = (load.max(dim=1).values / (tokens * k)).mean().item()
    derived = busiest_rank_factor(spec, ep, tokens)
    assert derived - 1 == pytest.approx(simulated - 1, rel=0.08)
    assert busiest_rank_factor(spec, 1, tokens) == 1.0
    skewed = dataclasses.replace(spec, load_imbalance=1.2)
    assert busiest_rank_factor(skewed, ep, tokens) == pytest.approx(1.2 * derived)


def test_all_to_all_priced_by_links_crossed(moe) -> None:
    """4 all-to-alls per MoE layer and micro-batch (dispatch and combine, forward and backward), each the
    pairwise-exchange formula over the ranks inside the node and across, at the busiest rank's load."""
    _, g = moe
    cluster = fake_cluster(nodes=2, per_node=2, intra_GBps=300, inter_GBps=25)
    costs = CostModel.for_cluster(g, cluster)
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    m = costs.memory.runs[ri][0].moe
    mbs = 2
    n = m.dispatch_bytes_per_sample * mbs
    for ep, local in ((2, 2), (4, 2)):  # tp=1: ep consecutive ranks, 2 per node
        k = ep
        a2a = ((local - 1) * 3e-6 + (local - 1) / k * n / 300e9
               + (k - local) * 1e-5 + (k - local) / k * n / 25e9)
        got = costs.comm.ep_times(ri, 1, False, mbs, ep)
        f = _busiest(m, ep, mbs * SEQ)
        assert got["forward"] == pytest.approx(2 * a2a * f)
        assert got["backward"] == pytest.approx(2 * a2a * f)
    assert costs.comm.ep_times(ri, 1, False, mbs, 1) == {"forward": 0.0, "backward": 0.0}
    dense_ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is None)
    assert costs.comm.ep_times(dense_ri, 1, False, mbs, 2)["forward"] == 0.0


def _deepep_on_two_nodes(g):
    """(cluster, DeepEP-priced cost model, the MoE run's index, mbs, ep): ep 4 over 2 nodes of 2 GPUs."""
    cluster = fake_cluster(nodes=2, per_node=2, intra_GBps=300, inter_GBps=25)
    deepep = CostModel.for_cluster(g, cluster, ep_dispatcher="deepep")
    ri = next(i for i, run in enumerate(deepep.memory.runs) if run[0].moe is not None)
    return cluster, deepep, ri, 2, 4


def _deepep_forward_s(costs: CostModel, ri: int, mbs: int, ep: int, nodes_share: float) -> float:
    """Dispatch + combine forward, written out: each token's InfiniBand copies (nodes_share of a token) at
    25 GB/s plus the 10 µs latency, twice, at the busiest rank's load."""
    m = costs.memory.runs[ri][0].moe
    token_bytes = m.dispatch_bytes_per_sample / (m.top_k * m.tokens_per_sample)
    rdma = 1e-5 + mbs * SEQ * token_bytes * nodes_share / 25e9
    return 2 * rdma * _busiest(m, ep, mbs * SEQ)


def test_deepep_dispatcher_option_prices_each_node_once(moe) -> None:
    """PlannerOptions(ep_dispatcher="deepep") reaches the cost model: across nodes a token crosses InfiniBand
    once per other node its experts sit on (4 experts, top-2, ep 4 over 2 nodes: 1 − C(2,2)/C(4,2) = 5/6 of
    a token, against the all-to-all's 2 copies × 2/4 remote = 1), so the layer's all-to-alls get cheaper;
    an unknown dispatcher is refused."""
    _, g = moe
    cluster, deepep, ri, mbs, ep = _deepep_on_two_nodes(g)
    a2a = CostModel.for_cluster(g, cluster)
    assert deepep.comm.ep_times(ri, 1, False, mbs, ep)["forward"] == pytest.approx(
        _deepep_forward_s(deepep, ri, mbs, ep, nodes_share=5 / 6), rel=0.02)
    assert deepep.comm.ep_times(ri, 1, False, mbs, ep)["forward"] < a2a.comm.ep_times(ri, 1, False, mbs, ep)["forward"]
    cfg = ParallelConfig(dp=4, ep=4, micro_batch_size=1, num_microbatches=1)
    slow = autopar.estimate(g, cluster, cfg)
    fast = autopar.estimate(g, cluster, cfg, options=PlannerOptions(ep_dispatcher="deepep"))
    assert fast.step_time_s < slow.step_time_s
    with pytest.raises(ConfigError, match="ep_dispatcher"):
        PlannerOptions(ep_dispatcher="nvshmem")


def test_group_limited_router_reaches_fewer_nodes(moe) -> None:
    """The same layer with its router opening 1 of 2 groups of 2 experts (one group a node under ep 4 on 2
    nodes): a token's top-2 lands on one node, the other node half the time, so DeepEP's InfiniBand copies
    fall from 5/6 to 1/2 of a token; the all-to-all of every routed copy does not change."""
    _, g = moe
    limited = dataclasses.replace(g, layers=tuple(
        dataclasses.replace(la, moe=dataclasses.replace(la.moe, route_groups=2, route_group_top_k=1))
        if la.moe is not None else la for la in g.layers))
    cluster, deepep, ri, mbs, ep = _deepep_on_two_nodes(limited)
    assert deepep.comm.ep_times(ri, 1, False, mbs, ep)["forward"] == pytest.approx(
        _deepep_forward_s(deepep, ri, mbs, ep, nodes_share=1 / 2), rel=0.02)
    a2a = (CostModel.for_cluster(limited, cluster), CostModel.for_cluster(g, cluster))
    assert a2a[0].comm.ep_times(ri, 1, False, mbs, ep) == a2a[1].comm.ep_times(ri, 1, False, mbs, ep)


def test_grouped_gemm_is_its_groups() -> None:
    """One launch over g expert GEMMs: g GEMMs of work/g at that size's efficiency, one launch floor."""
    cm = ComputeModel(fake_cluster().device)
    work, g = 4.0e9, 8
    single = cm.kernel_time_s("gemm", work / g)
    assert cm.kernel_time_s("gemm", work, groups=g) == pytest.approx(g * (single - cm.launch_s) + cm.launch_s)
    assert cm.kernel_time_s("gemm", work, groups=g) > cm.kernel_time_s("gemm", work)  # small GEMMs are slower


def test_per_expert_launches_are_the_groups_as_gemms_of_their_own() -> None:
    """A framework that issues each expert's GEMM apart (Megatron-Core's TE GroupedLinear: one cuBLAS call per
    expert) runs g GEMMs of work/g, each with its launch floor: g − 1 floors more than one grouped launch."""
    cm = ComputeModel(fake_cluster().device)
    work, g = 4.0e9, 16
    apart = cm.kernel_time_s("gemm", work, groups=g, launch_per_group=True)
    assert apart == pytest.approx(g * cm.kernel_time_s("gemm", work / g))
    assert apart - cm.kernel_time_s("gemm", work, groups=g) == pytest.approx((g - 1) * cm.launch_s)
    assert cm.kernel_time_s("gemm", work, launch_per_group=True) == cm.kernel_time_s("gemm", work)  # one group


def test_megatron_runtime_launches_each_local_expert(moe) -> None:
    """Under pipeline_runtime "megatron" each expert GEMM kernel of a layer pays one launch floor per local expert
    (E / ep of them) where autopar's runtime pays one; nothing else in the layer moves."""
    _, g = moe
    torch_rt = CostModel.for_cluster(g, fake_cluster())
    megatron = CostModel.for_cluster(g, fake_cluster(), pipeline_runtime="megatron")
    ri = next(i for i, run in enumerate(torch_rt.memory.runs) if run[0].moe is not None)
    layer = torch_rt.memory.runs[ri][0]
    launch_s = torch_rt.compute.model.launch_s
    for ep in (1, 2, 4):
        for mix, attr in ((layer.kernels_forward, "forward_s"), (layer.kernels_backward, "backward_s")):
            launches = sum(k.count * (layer.moe.num_experts // ep - 1) for k in mix.kernels if k.expert)
            extra = (getattr(megatron.compute.run(ri, 1, False, 2, False, ep), attr)
                     - getattr(torch_rt.compute.run(ri, 1, False, 2, False, ep), attr))
            assert extra == pytest.approx(launches * launch_s * torch_rt.compute.straggler, abs=1e-12)
    assert layer.moe.num_experts == 4 and any(k.expert for k in layer.kernels_backward.kernels)


def _moe_layer(g):
    """(cost model, run index, layer, compute model) of the first MoE layer of `g` on the fake cluster."""
    costs = CostModel.for_cluster(g, fake_cluster())
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    return costs, ri, costs.memory.runs[ri][0], costs.compute.model


def test_expert_compute_at_busiest_rank(moe) -> None:
    """Under ep the expert GEMMs of a rank do the busiest rank's share of the routed work over E / ep groups."""
    _, g = moe
    costs, ri, layer, cm = _moe_layer(g)
    experts = [k for k in layer.kernels_forward.kernels if k.expert]
    others = [k for k in layer.kernels_forward.kernels if not k.expert]
    rest = sum(k.count * cm.kernel_time_s(k.kind, 2 * k.work, dtype=g.dtype, tensor_bytes=2 * k.tensor_bytes,
                                          layout=k.layout, mnk=k.mnk, causal=k.causal) for k in others)
    for ep in (1, 2, 4):
        load = _busiest(layer.moe, ep, 2 * SEQ)
        want = rest + sum(k.count * cm.kernel_time_s("gemm", 2 * load * k.work, dtype=g.dtype, groups=k.groups // ep)
                          for k in experts)
        # × the lock-step straggler factor of the cluster's world size (cost_models.fleet), as every kernel
        assert costs.compute.run(ri, 1, False, 2, False, ep).forward_s == pytest.approx(want * costs.compute.straggler)


def test_planner_splits_experts_when_memory_needs_it(moe) -> None:
    """Device memory between the peaks of ep=1 and ep=2 (ZeRO off, one sample per rank): only ep ≥ 2 fits."""
    _, g = moe
    big = fake_cluster(nodes=1, per_node=4)
    peak = {ep: autopar.estimate(g, big, ParallelConfig(dp=4, ep=ep), global_batch_size=4).peak_memory_bytes
            for ep in (1, 2)}
    assert peak[2] < peak[1]
    reserve = 0.1
    cluster = fake_cluster(nodes=1, per_node=4, memory_gib=(peak[1] + peak[2]) / 2 / (1 - reserve) / 2**30)
    opts = dict(tp=1, pp=1, zero_stage=0, micro_batch_size=1, memory_reserve_fraction=reserve)
    plan = autopar.plan(g, cluster, global_batch_size=4, options=PlannerOptions(**opts))
    assert plan.config.ep >= 2
    assert autopar.Plan.from_dict(plan.to_dict()).config.ep == plan.config.ep
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(g, cluster, global_batch_size=4, options=PlannerOptions(**opts, ep=1))
    est = autopar.estimate(g, cluster, plan.config, global_batch_size=4)
    assert est.step_time_s == pytest.approx(plan.estimate.step_time_s, rel=1e-6)


def test_folded_states_sharded_over_edp(moe) -> None:
    """Folded (tp2, dp4, ep4): experts E / 4 per rank, their ZeRO states over edp = dp · tp / ep = 2 ranks."""
    _, g = moe
    costs = CostModel.for_cluster(g, fake_cluster())
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    layer = costs.memory.runs[ri][0]
    dense = costs.memory.local_dense_params(layer, 2)
    for zero in (1, 3):
        want = _states(dense, zero, 4) + _states(layer.moe.expert_params / 4, zero, 2)
        assert costs.memory.run_state_bytes(ri, 2, zero, 4, 4) == pytest.approx(want)


def test_folded_all_to_all_stays_in_the_node_and_wins(moe) -> None:
    """tp2 x dp4 on 2 nodes of 4: ep4 folded is the tp pairs of 2 consecutive dp ranks (4 ranks, one node),
    each rank sending half its replicated tokens, plus the tp all-gather of the outputs (forward) and of the
    tokens' gradients (backward). Against the hand-written formula, and cheaper than the same ep4 laid over 4
    data-parallel ranks (8 ranks apart by tp: two nodes, whole tokens), what autopar ran before folding."""
    _, g = moe
    cluster = fake_cluster(nodes=2, per_node=4, intra_GBps=300, inter_GBps=25)
    costs = CostModel.for_cluster(g, cluster)
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    m = costs.memory.runs[ri][0].moe
    mbs, ep = 2, 4
    intra_a, inter_a = 3e-6, 1e-5  # fake_cluster's link latencies

    def a2a(n: float, k: int, local: int) -> float:
        return ((local - 1) * intra_a + (local - 1) / k * n / 300e9
                + (k - local) * inter_a + (k - local) / k * n / 25e9)

    n = m.dispatch_bytes_per_sample * mbs
    out_bytes = n / m.top_k  # the combined outputs: tokens × hidden
    gather = costs.comm.collective_s("all_gather", out_bytes, 2, 2)
    folded = 2 * a2a(n / 2, ep, 4) * _busiest(m, ep, mbs * SEQ // 2) + gather
    got = costs.comm.ep_times(ri, 2, False, mbs, ep)
    assert got["forward"] == pytest.approx(folded) and got["backward"] == pytest.approx(folded)
    assert costs.comm.ep_ranks_per_node(2, ep) == 4
    over_dp = 2 * a2a(n, ep, 2) * _busiest(m, ep, mbs * SEQ)  # ep4 over dp ranks 2 apart: 2 per node
    assert folded < over_dp
    sp = costs.comm.ep_times(ri, 2, True, mbs, ep)  # SP: tokens already split, nothing to gather
    assert sp["forward"] == pytest.approx(2 * a2a(n / 2, ep, 4) * _busiest(m, ep, mbs * SEQ // 2))


def test_folded_expert_compute_on_half_the_tokens(moe) -> None:
    """Folded over tp2 (or under SP) a rank's expert GEMMs run on its half of the tokens, at the busiest
    rank's load of that half; everything else in the layer is priced as at ep = 1."""
    _, g = moe
    costs, ri, layer, cm = _moe_layer(g)
    experts = [k for k in layer.kernels_forward.kernels if k.expert]

    def expert_s(share: float, ep: int) -> float:
        load = _busiest(layer.moe, ep, int(2 * SEQ * share))
        return sum(k.count * cm.kernel_time_s("gemm", 2 * share * load * k.work, dtype=g.dtype,
                                               groups=max(1, k.groups // ep)) for k in experts)

    base = costs.compute.run(ri, 2, False, 2, False, 1).forward_s
    folded = costs.compute.run(ri, 2, False, 2, False, 2).forward_s
    want = (expert_s(0.5, 2) - expert_s(1.0, 1)) * costs.compute.straggler
    assert folded - base == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert folded < base


def test_router_skew_option_prices_and_is_recorded(moe) -> None:
    """PlannerOptions(router_skew=...) prices every MoE layer at that imbalance (the busiest rank's factor,
    moe_load), the plan records it beside the captured model's own fingerprint, and estimate reproduces it."""
    _, g = moe
    cluster = fake_cluster(nodes=1, per_node=4)
    pins = dict(tp=1, pp=1, dp=4, ep=4, zero_stage=0, micro_batch_size=1, top_k=0)
    flat = autopar.plan(g, cluster, global_batch_size=4, options=PlannerOptions(**pins))
    skewed = autopar.plan(g, cluster, global_batch_size=4, options=PlannerOptions(**pins, router_skew=1.5))
    assert skewed.router_skew == 1.5 and flat.router_skew is None
    assert skewed.graph_fingerprint == flat.graph_fingerprint == g.fingerprint  # it still runs on this model
    assert skewed.estimate.step_time_s > flat.estimate.step_time_s
    assert autopar.Plan.from_dict(skewed.to_dict()) == skewed
    est = autopar.estimate(g, cluster, skewed.config, options=PlannerOptions(router_skew=1.5))
    assert est.step_time_s == pytest.approx(skewed.estimate.step_time_s, rel=1e-6)
    same = autopar.estimate(g.with_moe_load_imbalance(1.5), cluster, skewed.config)
    assert same.step_time_s == pytest.approx(est.step_time_s, rel=1e-12)
    with pytest.raises(ConfigError, match="router_skew"):
        PlannerOptions(router_skew=0.5)
    with pytest.raises(ConfigError, match="router_skew=3.*load_imbalance"):  # 4 experts, top-2: at most E/k + 1
        autopar.estimate(g, cluster, skewed.config, options=PlannerOptions(router_skew=3.5))
    dense, x = autopar.zoo.build("gpt-tiny", seq_len=8)
    with pytest.raises(ConfigError, match="no mixture-of-experts layer"):
        autopar.estimate(autopar.capture(dense, x), cluster, ParallelConfig(dp=4),
                         options=PlannerOptions(router_skew=1.2))


def test_plan_with_folded_ep_is_the_brute_force_minimum(moe) -> None:
    """The planner's optimum over a space with folded EP is the minimum of every layout priced one by one
    (tests/test_planner_search.py's enumeration, with ep written out from the fold rule: a divisor of the 4
    experts that divides dp, or a multiple of tp whose ep / tp divides dp) and every cut and recompute
    assignment (test_ilp.brute_force)."""
    from test_ilp import brute_force
    from test_planner_search import every_layout

    _, g = moe
    cluster = fake_cluster(nodes=2, per_node=4, intra_GBps=300, inter_GBps=2.5)
    costs = CostModel.for_cluster(g, cluster)
    best, n = None, 0
    for base in every_layout(g, 8, 4, 8, PlannerOptions().max_virtual_stages):
        for ep in (1, 2, 4):
            folded = base.tp > 1 and ep % base.tp == 0
            if base.dp % (ep // base.tp if folded else ep):
                continue
            n += 1
            val = brute_force(costs.problem(dataclasses.replace(base, ep=ep)))
            if val is not None and (best is None or val < best[0]):
                best = (val, dataclasses.replace(base, ep=ep))
    plan = autopar.plan(g, cluster, global_batch_size=8, options=PlannerOptions(top_k=0, offload="none"))
    assert n > 100 and plan.solver.gap == 0.0
    assert plan.estimate.step_time_s == pytest.approx(best[0], rel=1e-7)


def test_expert_gradients_reduce_over_the_ranks_holding_them(moe) -> None:
    """The experts' gradient tail runs over their own group (autopar.codegen.experts.expert_grad_axes), not
    dp: folded tp2 x dp4 x ep4 on 2 nodes of 4, rank 0's experts are also on rank 4 (the next EP group, in the
    other node), so ZeRO-3's all-gathers (2 per micro-batch) and reduce-scatter of them span 2 ranks, one per
    node; with edp = 1 they are not reduced at all, and a dense layer's tail is unchanged by them."""
    _, g = moe
    cluster = fake_cluster(nodes=2, per_node=4, intra_GBps=300, inter_GBps=25)
    costs = CostModel.for_cluster(g, cluster)
    comm = costs.comm
    assert comm.expert_group_ranks(2, 4, 1, 4, False) == [0, 4]
    assert comm.expert_group_ranks(2, 4, 1, 2, True) == [0, 2, 4, 6]  # folded over the tp pair: 4 dp ranks
    assert comm.expert_group_ranks(4, 2, 1, 2, False) == [0]  # ep over both dp ranks (replicated over tp4): edp 1
    assert comm.expert_group_ranks(4, 4, 1, 2, True) == [0, 1, 2, 3, 8, 9, 10, 11]  # unfolded SP adds tp
    c = _cand(tp=2, dp=4, ep=4, zero_stage=3, num_microbatches=1, micro_batch_size=2)
    tail = comm.expert_tail(c)
    n = 1.0e6
    ag = comm.collective_s("all_gather", n * tail.gather_ratio, 2, 1)
    rs = comm.collective_s("reduce_scatter", n, 2, 1)
    copies = 2 * tail._mem_per_byte * (2 * n * tail.gather_ratio + n)
    assert tail.dp == 2 and tail.layer_s(n) == pytest.approx(2 * ag + rs + copies)
    alone = comm.expert_tail(_cand(tp=2, dp=2, ep=4, zero_stage=1))  # edp = 1: nothing to reduce
    assert alone.layer_s(n) == 0.0 and alone.flat_collectives == 0  # (the norm still reads them: fixed_s)
