"""`autopar plan | show | diff | explain` end to end on a tiny zoo model; exit codes per docs/design.md §3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.cli.main import main
from autopar.plan import Plan


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    d = tmp_path_factory.mktemp("plans")
    a, b = d / "a.json", d / "b.json"
    base = ["plan", "gpt-tiny", "--cluster", "dgx-a100-80gb", "--global-batch-size", "16", "--seq-len", "128"]
    assert main([*base, "--out", str(a)]) == 0
    assert main([*base, "--tp", "2", "--pp", "2", "--schedule", "1f1b", "--out", str(b)]) == 0
    return a, b


def test_plan_prints_the_layout_and_saves_it(plans, capsys) -> None:
    a, b = plans
    pa, pb = Plan.load(a), Plan.load(b)
    assert (pb.config.tp, pb.config.pp) == (2, 2)
    assert pa.estimate.step_time_s <= pb.estimate.step_time_s
    assert main(["show", str(a)]) == 0
    out = capsys.readouterr().out
    assert "chosen layout" in out and "runner-ups" in out and "optimal" in out
    assert main(["show", str(a), "--json"]) == 0
    assert Plan.from_dict(json.loads(capsys.readouterr().out)) == pa


def test_diff_and_explain(plans, capsys) -> None:
    a, b = plans
    assert main(["diff", str(a), str(b)]) == 0
    assert "* tp" in capsys.readouterr().out
    pb = Plan.load(b)
    assert main(["explain", str(a), "--config", str(pb.config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    if len({s.recompute for s in pb.stages}) == 1:  # explain prices one recompute mode on every stage
        assert out["alternative"]["estimate"]["step_time_s"] == pytest.approx(pb.estimate.step_time_s, rel=1e-9)
    assert main(["explain", str(a), "--config", "tp=3"]) == 1  # 3 does not divide the node: one-line error


def test_explain_of_the_plans_own_config_reproduces_its_step_time(plans, capsys) -> None:
    a, _ = plans
    pa = Plan.load(a)
    assert main(["explain", str(a), "--config", str(pa.config), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["alternative"]["estimate"]["step_time_s"] == pytest.approx(pa.estimate.step_time_s, rel=1e-12)


def test_timeline_writes_a_png(plans, tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    a, _ = plans
    out = tmp_path / "step.png"
    assert main(["show", str(a), "--timeline", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    assert f"timeline        {out}" in capsys.readouterr().out


@pytest.mark.parametrize("golden", ["gpt3-175b", "llama3-405b"])  # pp = 1 and pp = 32
def test_timeline_ticks_ranks_as_integers_with_legends_outside(golden: str) -> None:
    """Each panel has a title and integer pipeline-rank ticks inside 0..pp-1 (every rank up to 16 ranks),
    and each legend lies wholly below its panel's data area."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from autopar.report.timeline import timeline_figure

    plan = Plan.from_dict(json.loads((Path(__file__).parent / "golden" / f"{golden}.json").read_text()))
    pp = plan.config.pp
    fig = timeline_figure(plan)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        for axis in fig.axes:
            ticks = list(axis.get_yticks())
            assert ticks == list(range(0, pp, -(-pp // 16))) and all(float(t).is_integer() for t in ticks)
            assert axis.get_title()
            legend = axis.get_legend().get_window_extent(renderer)
            assert legend.y1 < axis.get_window_extent(renderer).y0  # below the data, not over it
    finally:
        plt.close(fig)


SMALL_CLUSTER = """
name = "small-mem"
nodes = 1
devices_per_node = 2
[device]
name = "tiny-gpu"
kind = "gpu"
memory_GiB = 0.2
memory_bandwidth_GBps = 1000
peak_TFLOPs = { bfloat16 = 100, float32 = 20 }
source = "test fixture"
[intra_node]
bandwidth_GBps = 100
latency_us = 3
[inter_node]
bandwidth_GBps = 10
latency_us = 6
"""


def test_explain_names_the_constraint_an_infeasible_layout_violates(tmp_path, capsys) -> None:
    """gpt-tiny at 256 tokens fits a 0.2 GiB device with micro-batches of 8, not as one micro-batch of 32."""
    cluster = tmp_path / "small.toml"
    cluster.write_text(SMALL_CLUSTER)
    plan = tmp_path / "p.json"
    assert main(["plan", "gpt-tiny", "--cluster", str(cluster), "--global-batch-size", "64", "--seq-len", "256",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    cfg = "tp=1,pp=1,dp=2,zero=0,mbs=32,recompute=none"
    assert main(["explain", str(plan), "--cluster", str(cluster), "--config", cfg]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "memory_rank0" in out and "GiB per device" in out and "activations" in out
    assert main(["explain", str(plan), "--cluster", str(cluster), "--config", cfg, "--json"]) == 0
    alt = json.loads(capsys.readouterr().out)["alternative"]
    assert "constraint memory_rank0" in alt["violates"]
    assert alt["estimate"]["fits"] is False and alt["estimate"]["violated"] == "memory_rank0"
    est = alt["estimate"]
    assert sum(est["memory_breakdown"].values()) == est["peak_memory_bytes"] > est["memory_capacity_bytes"]


def test_estimate_command_prices_a_layout_and_says_when_it_does_not_fit(tmp_path, capsys) -> None:
    cluster = tmp_path / "small.toml"
    cluster.write_text(SMALL_CLUSTER)
    args = ["estimate", "gpt-tiny", "--cluster", str(cluster), "--seq-len", "256"]
    assert main([*args, "--config", "tp=1,pp=1,dp=2,mbs=32,m=1"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT: constraint memory_rank0" in out and "MFU" in out
    assert main([*args, "--config", "tp=1,pp=1,dp=2,mbs=8,m=4", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)["estimate"]
    assert est["fits"] is True and est["peak_memory_bytes"] <= est["memory_capacity_bytes"]


def test_errors_exit_1_and_usage_errors_exit_2(capsys) -> None:
    assert main(["plan", "gpt-tiny", "--cluster", "no-such-cluster", "--global-batch-size", "8"]) == 1
    err = capsys.readouterr().err
    assert "unknown cluster preset" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt-tiny", "--cluster", "dgx-h100"])
    assert e.value.code == 2
