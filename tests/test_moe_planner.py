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
from autopar.capture.graph import MoESpec
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
    with pytest.raises(ConfigError, match="ep=3 must divide dp=4"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(ConfigError, match="ep"):
        PlannerOptions(ep=0)


def test_ep_degrees_follow_dp_and_expert_count(moe) -> None:
    _, g = moe
    assert ep_degrees(g, 8) == [1, 2, 4]  # 4 experts: ep 8 would leave ranks without one
    dense, x = autopar.zoo.build("gpt-tiny", seq_len=8)
    assert ep_degrees(autopar.capture(dense, x), 8) == [1]
    cands = enumerate_candidates(g, world_size=8, devices_per_node=8, global_batch_size=8, options=PlannerOptions())
    assert {c.ep for c in cands if c.dp == 8} == {1, 2, 4}
    with pytest.raises(InfeasiblePlanError, match="does not divide the expert count"):
        enumerate_candidates(g, world_size=8, devices_per_node=8, global_batch_size=8, options=PlannerOptions(ep=8))


def _states(n: float, zero: int, k: int) -> float:
    """ZeRO's per-device bytes of n parameters over k ranks under the bf16 policy (docs/design.md §4): fp32
    masters (4), fp32 gradients (4), two fp32 Adam moments (8), and the 16-bit compute copy (2) that autocast
    holds under ZeRO-0/1 (or on one rank) and FSDP2's gathered weights hold under ZeRO-2."""
    if k == 1:
        return 18 * n
    return {0: 18 * n, 1: 10 * n + 8 * n / k, 2: 2 * n + 16 * n / k, 3: 16 * n / k}[zero]


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
        got = costs.comm.ep_times(ri, 1, mbs, ep)
        f = _busiest(m, ep, mbs * SEQ)
        assert got["forward"] == pytest.approx(2 * a2a * f)
        assert got["backward"] == pytest.approx(2 * a2a * f)
    assert costs.comm.ep_times(ri, 1, mbs, 1) == {"forward": 0.0, "backward": 0.0}
    dense_ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is None)
    assert costs.comm.ep_times(dense_ri, 1, mbs, 2)["forward"] == 0.0


def test_grouped_gemm_is_its_groups() -> None:
    """One launch over g expert GEMMs: g GEMMs of work/g at that size's efficiency, one launch floor."""
    cm = ComputeModel(fake_cluster().device)
    work, g = 4.0e9, 8
    single = cm.kernel_time_s("gemm", work / g)
    assert cm.kernel_time_s("gemm", work, groups=g) == pytest.approx(g * (single - cm.launch_s) + cm.launch_s)
    assert cm.kernel_time_s("gemm", work, groups=g) > cm.kernel_time_s("gemm", work)  # small GEMMs are slower


def test_expert_compute_at_busiest_rank(moe) -> None:
    """Under ep the expert GEMMs of a rank do the busiest rank's share of the routed work over E / ep groups."""
    _, g = moe
    costs = CostModel.for_cluster(g, fake_cluster())
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    layer = costs.memory.runs[ri][0]
    cm = costs.compute.model
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


def test_cli_ep_flag_show_explain_diff(tmp_path, capsys) -> None:
    """`autopar plan --ep`, and the ep degree printed by show, explain (another ep priced) and diff."""
    import dataclasses

    from autopar.cli.main import main

    factory = tmp_path / "moe_factory.py"
    factory.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from hf_families import build_family\n"
        "def make(seq_len=16):\n"
        "    return build_family('mixtral').to(torch.bfloat16), (torch.zeros(1, seq_len, dtype=torch.long),)\n")
    model, a, b = f"{factory}:make", tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", model, "--cluster", "dgx-h100", "--global-batch-size", "16", "--seq-len", "16",
                 "--ep", "2", "--top", "0", "--out", str(a)]) == 0
    plan = autopar.Plan.load(a)
    assert plan.config.ep == 2 and "ep=2" in capsys.readouterr().out
    assert main(["show", str(a)]) == 0 and "ep=2" in capsys.readouterr().out
    dataclasses.replace(plan, config=dataclasses.replace(plan.config, ep=4)).save(b)
    assert main(["diff", str(a), str(b)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if " ep " in line)
    assert row.split() == ["*", "ep", "2", "4"]
    assert main(["explain", str(a), "--config", "ep=4", "--model", model]) == 0
    assert "ep=4" in capsys.readouterr().out
    assert main(["plan", model, "--cluster", "dgx-h100", "--global-batch-size", "16", "--seq-len", "16",
                 "--ep", "3"]) == 1
    assert "ep=3" in capsys.readouterr().err
