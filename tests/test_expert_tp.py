"""Expert tensor parallelism (ParallelConfig.etp = tp): the config, the search space, the cost model and the
planner (the runtime's parity: the etp rows of tests/test_expert_parallel.py's shared gloo jobs).

References are independent of the code under test: ZeRO's state formulas (docs/design.md §4) on 1/(ep·etp)
of the experts over edp = dp / ep ranks, the expert GEMMs written out at half their work, the all-to-all and
ring all-reduce α-β formulas written out, and plans that must (or must not) split the experts over tp.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.planner.costs import CostModel
from autopar.planner.space import enumerate_candidates, etp_degrees

sys.path.insert(0, str(Path(__file__).parent))
from hf_families import build_family  # noqa: E402
from test_moe_planner import SEQ, _busiest, _moe_layer, _states  # noqa: E402
from test_planner import fake_cluster  # noqa: E402

INTRA_ALPHA_S, INTER_ALPHA_S = 3e-6, 1e-5  # fake_cluster's link latencies


@pytest.fixture(scope="module")
def moe():
    """Tiny Mixtral (4 experts, top-2, FFN width 32) captured in bf16."""
    model = build_family("mixtral")
    return autopar.capture(model.to(torch.bfloat16), (torch.zeros(1, SEQ, dtype=torch.long),))


def test_config_etp_round_trip_and_checks() -> None:
    c = ParallelConfig(tp=2, dp=4, ep=2, etp=2, zero_stage=1)
    assert not c.ep_folded and c.ep_dp == 2 and c.edp == 2  # tp divides ep, but etp = tp keeps tp for the FFN
    assert c.ep_text() == "ep=2 (over dp2 x etp2 FFN shards, edp=2)" and "etp=2" in str(c)
    assert ParallelConfig.parse(str(c)) == c == ParallelConfig.from_dict(c.to_dict())
    assert "etp" not in ParallelConfig(tp=2, dp=4, ep=2).to_dict()  # plans written before etp read the same
    assert ParallelConfig(tp=2, dp=2, etp=2).ep_text() == "ep=1 (over dp1 x etp2 FFN shards, edp=2)"
    with pytest.raises(ConfigError, match=r"etp=4 must be 1 .* or tp=2 .*set etp=1 or etp=2"):
        ParallelConfig(tp=2, dp=4, ep=2, etp=4)
    with pytest.raises(ConfigError, match=r"ep=4 must divide dp=2 \(possible ep: \[1, 2\]\); or set etp=1"):
        ParallelConfig(tp=2, dp=2, ep=4, etp=2)  # folding over tp needs etp = 1
    with pytest.raises(ConfigError, match="etp=0"):
        ParallelConfig(tp=2, dp=2, etp=0)
    with pytest.raises(ConfigError, match="etp=4 with tp=2"):
        PlannerOptions(tp=2, etp=4)


def test_etp_degrees_and_candidates(moe) -> None:
    g = moe
    assert etp_degrees(g, 2, 2, 2) == [1, 2]  # ep2 over the dp pair, experts split over the tp pair
    assert etp_degrees(g, 1, 2, 2) == [1]  # ep2 on one dp rank must fold over tp
    assert etp_degrees(g, 4, 1, 2) == [1]
    assert etp_degrees(g, 2, 64, 2) == [1]  # 64 does not divide the FFN width 32
    cands = enumerate_candidates(g, world_size=4, devices_per_node=4, global_batch_size=4, options=PlannerOptions())
    assert {(c.tp, c.ep, c.etp) for c in cands if c.tp == 2 and c.dp == 2} == {(2, 1, 1), (2, 1, 2), (2, 2, 1),
                                                                             (2, 2, 2), (2, 4, 1)}
    dense, x = autopar.zoo.build("gpt-tiny", seq_len=8)
    with pytest.raises(InfeasiblePlanError, match="etp=2 needs mixture-of-experts layers"):
        enumerate_candidates(autopar.capture(dense, x), world_size=4, devices_per_node=4, global_batch_size=4,
                             options=PlannerOptions(etp=2))


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_expert_states_split_over_etp(moe, zero: int) -> None:
    """tp2 x dp4, ep2, etp2: 1/(ep · etp) of the experts per rank, their ZeRO states over edp = dp / ep = 2."""
    costs, ri, layer, _ = _moe_layer(moe)
    dense = costs.memory.local_dense_params(layer, 2)
    want = _states(dense, zero, 4) + _states(layer.moe.expert_params / 4, zero, 2)
    assert costs.memory.run_state_bytes(ri, 2, zero, 4, 2, etp=2) == pytest.approx(want)


@pytest.mark.parametrize("sp", [False, True])
def test_expert_gemms_at_their_tp_slice(moe, sp: bool) -> None:
    """At etp = tp every tp rank runs all the micro-batch's tokens (gathered under SP) through half of each
    expert: the expert GEMMs at half their whole-token work (E / ep groups at the busiest rank's load), the
    rest of the layer priced as at etp = 1 (SP still shards its memory-bound kernels)."""
    g = moe
    costs, ri, layer, cm = _moe_layer(g)
    experts = [k for k in layer.kernels_forward.kernels if k.expert]

    def expert_s(ep: int, split: int) -> float:
        load = _busiest(layer.moe, ep, 2 * SEQ)
        return sum(k.count * cm.kernel_time_s("gemm", 2 * load * k.work / split, dtype=g.dtype,
                                               groups=max(1, k.groups // ep)) for k in experts)

    s = costs.compute.straggler
    whole = costs.compute.run(ri, 2, False, 2, False, 1).forward_s  # ep1, etp1: every tp rank all experts
    sp_rest = costs.compute.run(ri, 2, sp, 2, False, 1).forward_s - whole - (
        (expert_s(1, 2) - expert_s(1, 1)) * s if sp else 0.0)  # SP's sharded kernels (experts on half the tokens)
    for ep in (1, 2):
        split = costs.compute.run(ri, 2, sp, 2, False, ep, etp=2).forward_s
        want = (expert_s(ep, 2) - expert_s(1, 1)) * s + sp_rest
        assert split - whole == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_etp_collectives_priced_by_formula(moe) -> None:
    """ep2 over 2 dp ranks (tp2 apart: 2 per node of 4) and etp2: the all-to-alls of all the tokens, plus
    (no SP) the ring all-reduce over the tp pair of the combined outputs [T, H] forward and of the tokens' and
    routing weights' gradients backward, α-β written out."""
    g = moe
    cluster = fake_cluster(nodes=1, per_node=4, intra_GBps=300, inter_GBps=25)
    costs = CostModel.for_cluster(g, cluster)
    ri = next(i for i, run in enumerate(costs.memory.runs) if run[0].moe is not None)
    m = costs.memory.runs[ri][0].moe
    mbs, ep, beta = 2, 2, 300e9
    n = m.dispatch_bytes_per_sample * mbs
    a2a = (ep - 1) * INTRA_ALPHA_S + (ep - 1) / ep * n / beta
    tokens = n / m.top_k
    weights = tokens / g.hidden_size * m.top_k

    def ring_ar(b: float) -> float:
        return 2 * INTRA_ALPHA_S + b / beta  # 2 ranks: 2(K−1)α + 2(K−1)/K · n/β

    got = costs.comm.ep_times(ri, 2, False, mbs, ep, 1, etp=2)
    moved = 2 * a2a * _busiest(m, ep, mbs * SEQ)
    assert got["forward"] == pytest.approx(moved + ring_ar(tokens))
    assert got["backward"] == pytest.approx(moved + ring_ar(tokens) + ring_ar(weights))
    alone = costs.comm.ep_times(ri, 1, False, mbs, ep, 1)  # tp1: the same tokens moved, nothing summed over tp
    assert alone["forward"] == pytest.approx(moved)
    assert costs.comm.ep_times(ri, 2, False, mbs, 1, 1, etp=2)["forward"] == pytest.approx(ring_ar(tokens))
    # the experts' gradients reduce over edp only: tp ranks hold different slices, even under SP
    assert costs.comm.expert_group_ranks(4, 4, 1, 2, True, 4) == [0, 8]
    assert costs.comm.expert_group_ranks(4, 4, 1, 2, True) == [0, 1, 2, 3, 8, 9, 10, 11]


PINS = dict(tp=2, pp=1, dp=2, ep=2, zero_stage=0, micro_batch_size=1, sequence_parallel=False, top_k=0)


def test_planner_splits_experts_over_tp_when_they_do_not_fit(moe) -> None:
    """Device memory between the peaks of etp=2 and etp=1 (tp2 x dp2, ep2, ZeRO off): only splitting each
    expert over the tp pair fits, so the planner takes etp = 2; pinned to etp = 1 nothing fits."""
    g = moe
    big = fake_cluster(nodes=1, per_node=4)
    peak = {etp: autopar.estimate(g, big, ParallelConfig(tp=2, dp=2, ep=2, etp=etp), global_batch_size=2
                                  ).peak_memory_bytes for etp in (1, 2)}
    assert peak[2] < peak[1]
    reserve = 0.1
    cluster = fake_cluster(nodes=1, per_node=4, memory_gib=(peak[1] + peak[2]) / 2 / (1 - reserve) / 2**30)
    plan = autopar.plan(g, cluster, global_batch_size=2, options=PlannerOptions(**PINS,
                                                                                memory_reserve_fraction=reserve))
    assert plan.config.etp == 2 and autopar.Plan.from_dict(plan.to_dict()).config.etp == 2
    with pytest.raises(InfeasiblePlanError):
        autopar.plan(g, cluster, global_batch_size=2, options=PlannerOptions(**PINS, etp=1,
                                                                             memory_reserve_fraction=reserve))


def test_planner_keeps_experts_whole_when_memory_allows(moe) -> None:
    """With memory to spare (tp2 x dp2, no EP, 8 micro-batches of 4): the tiny experts' GEMMs gain nothing
    from halving (launch-bound), while splitting them adds the tp all-reduces of every micro-batch's expert
    outputs and token gradients, more than the halved expert-gradient reduction saves once a step. The
    planner keeps etp = 1; etp = 2 is priced slower by its tp comm."""
    g = moe
    cluster = fake_cluster(nodes=1, per_node=4)
    pins = {**PINS, "ep": 1, "micro_batch_size": 4}
    plan = autopar.plan(g, cluster, global_batch_size=64, options=PlannerOptions(**pins))
    assert plan.config.etp == 1 and plan.config.num_microbatches == 8
    split = autopar.estimate(g, cluster, dataclasses.replace(plan.config, etp=2), global_batch_size=64)
    assert split.step_time_s > plan.estimate.step_time_s
    assert split.breakdown["tp_comm"] > plan.estimate.breakdown["tp_comm"]
    assert split.breakdown["dp_comm"] < plan.estimate.breakdown["dp_comm"]
    assert split.peak_memory_bytes < plan.estimate.peak_memory_bytes


def test_cli_etp_flag_show_explain_diff(tmp_path, capsys) -> None:
    """`autopar plan --etp 2`, and etp printed by show, explain (etp=1, the EP pair then folded over tp, priced
    beside it) and diff."""
    from test_moe_cli import _mixtral_factory

    from autopar.cli.main import main

    model, a, b = _mixtral_factory(tmp_path), tmp_path / "a.json", tmp_path / "b.json"
    common = ["--cluster", "dgx-h100", "--global-batch-size", "16", "--seq-len", "16", "--top", "0", "--tp", "2",
              "--pp", "1", "--ep", "2"]
    assert main(["plan", model, *common, "--etp", "2", "--out", str(a)]) == 0
    assert "experts ep=2 (over dp2 x etp2 FFN shards" in capsys.readouterr().out
    assert autopar.Plan.load(a).config.etp == 2
    assert main(["show", str(a)]) == 0 and "etp=2" in capsys.readouterr().out
    assert main(["explain", str(a), "--config", "etp=1", "--model", model]) == 0
    out = capsys.readouterr().out
    assert "etp2 FFN shards" in out and "ep=2 (over tp2 x dp1, edp=4)" in out  # etp=1: folded over tp
    assert main(["plan", model, *common, "--etp", "1", "--out", str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if " etp " in line)
    assert row.split() == ["*", "etp", "2", "1"]
    assert main(["plan", model, *common, "--etp", "4"]) == 1
    assert "etp=4" in capsys.readouterr().err


def test_plan_with_etp_is_the_brute_force_minimum(moe) -> None:
    """With tp pinned to 2 on 4 ranks, the planner's optimum over ep and etp is the minimum of every layout
    priced one by one (tests/test_planner_search.py's enumeration, ep and etp written out from their rules:
    etp = 2 needs ep to divide dp; at etp = 1, ep folds over tp where tp divides it) and every cut and
    recompute assignment (test_ilp.brute_force)."""
    from test_ilp import brute_force
    from test_planner_search import every_layout

    g = moe
    cluster = fake_cluster(nodes=1, per_node=4, intra_GBps=50)
    costs = CostModel.for_cluster(g, cluster)
    best, n = None, 0
    for base in (b for b in every_layout(g, 4, 4, 4, PlannerOptions().max_virtual_stages) if b.tp == 2):
        for ep, etp in ((e, t) for e in (1, 2, 4) for t in (1, 2)):
            fits = base.dp % ep == 0 if etp == 2 else base.dp % (ep // 2 if ep % 2 == 0 else ep) == 0
            if not fits:
                continue
            c = dataclasses.replace(base, ep=ep, etp=etp)
            n += 1
            val = brute_force(costs.problem(c))
            if val is not None and (best is None or val < best[0]):
                best = (val, c)
    plan = autopar.plan(g, cluster, global_batch_size=4, options=PlannerOptions(tp=2, top_k=0, offload="none"))
    assert n > 50 and plan.solver.gap == 0.0
    assert plan.estimate.step_time_s == pytest.approx(best[0], rel=1e-7)
