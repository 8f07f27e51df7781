"""Expert parallelism through the CLI: `autopar plan --ep`, the fold over tp and the router skew as `show`,
`explain`, `diff` and `estimate` print and price them (the planner's side: tests/test_moe_planner.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import autopar


def _mixtral_factory(tmp_path: Path) -> str:
    """A `FILE:FUNCTION` model spec for the CLI: the tiny Mixtral of tests/hf_families.py in bf16."""
    factory = tmp_path / "moe_factory.py"
    factory.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from hf_families import build_family\n"
        "def make(seq_len=16):\n"
        "    return build_family('mixtral').to(torch.bfloat16), (torch.zeros(1, seq_len, dtype=torch.long),)\n")
    return f"{factory}:make"


def test_cli_ep_flag_show_explain_diff(tmp_path, capsys) -> None:
    """`autopar plan --ep`, and the ep degree printed by show, explain (another ep priced) and diff."""
    import dataclasses

    from autopar.cli.main import main

    model, a, b = _mixtral_factory(tmp_path), tmp_path / "a.json", tmp_path / "b.json"
    assert main(["plan", model, "--cluster", "dgx-h100", "--global-batch-size", "16", "--seq-len", "16",
                 "--ep", "2", "--tp", "1", "--pp", "1", "--top", "0", "--out", str(a)]) == 0
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


def test_cli_fold_and_router_skew(tmp_path, capsys) -> None:
    """`autopar plan --ep 4 --tp 2 --router-skew`: show, explain and diff print the fold and do not refuse a
    plan priced at a non-default skew; `autopar estimate --router-skew` prices the same layout the same."""
    import json

    from autopar.cli.main import main

    model, a, b = _mixtral_factory(tmp_path), tmp_path / "a.json", tmp_path / "b.json"
    common = ["--cluster", "dgx-h100", "--global-batch-size", "16", "--seq-len", "16", "--top", "0"]
    assert main(["plan", model, *common, "--tp", "2", "--pp", "1", "--ep", "4", "--router-skew", "1.25",
                 "--out", str(a)]) == 0
    assert "experts ep=4 (over tp2 x dp2, edp=2)" in capsys.readouterr().out
    plan = autopar.Plan.load(a)
    assert plan.router_skew == 1.25 and plan.config.ep_folded
    assert main(["show", str(a)]) == 0
    out = capsys.readouterr().out
    assert "ep=4 (over tp2 x dp2, edp=2)" in out and "router skew 1.25" in out
    assert main(["explain", str(a), "--config", "ep=2", "--model", model]) == 0
    out = capsys.readouterr().out
    assert "experts ep=4 (over tp2 x dp2, edp=2)" in out and "experts ep=2 (over tp2 x dp1, edp=4)" in out
    assert main(["plan", model, *common, "--tp", "2", "--pp", "1", "--ep", "2", "--out", str(b)]) == 0
    capsys.readouterr()
    assert main(["diff", str(a), str(b)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if "ep_over" in line)
    assert row.split() == ["*", "ep_over", "tp2", "x", "dp2,", "edp=2", "tp2", "x", "dp1,", "edp=4"]
    assert main(["estimate", model, "--cluster", "dgx-h100", "--seq-len", "16", "--config", str(plan.config),
                 "--router-skew", "1.25", "--json"]) == 0
    est = json.loads(capsys.readouterr().out)["estimate"]
    assert est["step_time_s"] == pytest.approx(plan.estimate.step_time_s, rel=1e-6)
