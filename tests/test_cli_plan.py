"""`autopar plan | show | diff | explain` end to end on a tiny zoo model; exit codes per design.md §3."""

from __future__ import annotations

import json

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


def test_errors_exit_1_and_usage_errors_exit_2(capsys) -> None:
    assert main(["plan", "gpt-tiny", "--cluster", "no-such-cluster", "--global-batch-size", "8"]) == 1
    err = capsys.readouterr().err
    assert "unknown cluster preset" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt-tiny", "--cluster", "dgx-h100"])
    assert e.value.code == 2
