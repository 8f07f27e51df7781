"""`autopar report`: components more than 25% off are flagged; a real 2-process run records and reports."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from dist_harness import free_port

import autopar
from autopar.cli.main import main as cli
from autopar.cluster import Cluster
from autopar.config import PlannerOptions
from autopar.plan import BREAKDOWN_KEYS
from autopar.record import RankTiming, RunRecord, build_record
from autopar.report.run_report import compare, render_text

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def plan():
    import torch

    model, x = autopar.zoo.build("gpt-tiny", seq_len=32, device="meta", dtype=torch.float32, dropout=0.0,
                                 n_layers=2)
    graph = autopar.capture(model, x)
    return autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=4,
                        options=PlannerOptions(tp=2, dp=1, sequence_parallel=False, top_k=0))


def _record(plan, factors: dict[str, float], peak_memory_bytes: tuple[int, int] = (0, 0)) -> RunRecord:
    """Each component measured as factor × predicted (compute includes the predicted recompute)."""
    pred = dict(plan.estimate.breakdown)
    pred["compute"] += pred.pop("recompute")
    measured = {k: pred.get(k, 0.0) * factors.get(k, 1.0) for k in BREAKDOWN_KEYS if k != "recompute"}
    measured["recompute"] = 0.0
    ranks = [RankTiming(rank=r, pp_rank=0, dp_rank=0, tp_rank=r, step_s=(sum(measured.values()),) * 3,
                        components_s={k: (measured[k],) * 3 for k in BREAKDOWN_KEYS},
                        peak_memory_bytes=peak_memory_bytes[r]) for r in range(2)]
    return build_record(plan, ranks, hostname=socket.gethostname(), device_name="cpu", torch_version="t",
                        backend="gloo", threads_per_process=1, created="c", warmup_steps=1)


def test_flags_components_more_than_25_percent_off(plan):
    assert plan.estimate.breakdown["tp_comm"] > 0 and plan.estimate.breakdown["optimizer"] > 0
    c = compare(plan, _record(plan, {"compute": 1.10, "tp_comm": 1.40, "optimizer": 0.70}))
    rows = {r.name: r for r in c.components}
    assert rows["compute"].error == pytest.approx(0.10) and not rows["compute"].flagged
    assert rows["tp_comm"].error == pytest.approx(0.40) and rows["tp_comm"].flagged
    assert rows["optimizer"].error == pytest.approx(-0.30) and rows["optimizer"].flagged
    assert set(c.flagged) == {"tp_comm", "optimizer"}
    exact = compare(plan, _record(plan, {}))
    assert exact.flagged == () and exact.step_error == pytest.approx(0.0, abs=1e-9)


def test_measured_peak_memory_is_the_largest_ranks_beside_the_prediction(plan, tmp_path):
    """A GPU run records torch.cuda.max_memory_allocated per rank: the report sets the largest beside the plan's
    peak, survives the record's JSON round trip, and says nothing of memory for a CPU run (0: not measured)."""
    predicted = plan.estimate.peak_memory_bytes
    _record(plan, {}, peak_memory_bytes=(int(predicted * 0.9), int(predicted * 1.1))).save(tmp_path / "run.json")
    c = compare(plan, RunRecord.load(tmp_path / "run.json"))
    assert c.predicted_peak_memory_bytes == predicted
    assert c.measured_peak_memory_bytes == int(predicted * 1.1)
    line = next(x for x in render_text(c).splitlines() if x.startswith("peak memory"))
    assert "+10.0%" in line
    assert "peak memory" not in render_text(compare(plan, _record(plan, {})))


def test_report_cli_json(plan, tmp_path, capsys):
    plan.save(tmp_path / "plan.json")
    _record(plan, {"tp_comm": 2.0}).save(tmp_path / "run.json")
    assert cli(["report", str(tmp_path / "plan.json"), str(tmp_path / "run.json"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_step_time_s"] == pytest.approx(plan.estimate.step_time_s)
    assert out["measured_step_time_s"] > out["predicted_step_time_s"]
    assert {r["name"] for r in out["components"]} == {"compute", "tp_comm", "pipeline", "dp_comm", "optimizer"}
    assert out["flagged"] == ["tp_comm"]


def test_end_to_end_two_processes(tmp_path):
    """profile-free plan → torchrun train_gpt --record → autopar report, on 2 gloo processes."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_gpt import build_model

    model, x = build_model("gpt-tiny", 32, "meta", n_layers=2)
    plan = autopar.plan(autopar.capture(model, x), Cluster.local(nproc=2), global_batch_size=4,
                        options=PlannerOptions(dp=2, zero_stage=0, top_k=0))
    plan.save(tmp_path / "plan.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(ROOT / "examples" / "train_gpt.py"), "--seq-len", "32", "--override", "n_layers=2",
           "--global-batch-size", "4", "--steps", "4", "--warmup", "1", "--plan", str(tmp_path / "plan.json"),
           "--record", str(tmp_path / "run.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rec = RunRecord.load(tmp_path / "run.json")
    assert rec.steps == 3 and rec.world_size == 2
    b = rec.breakdown()
    assert b["compute"] > 0 and b["optimizer"] > 0 and b["dp_comm"] > 0 and b["tp_comm"] == 0
    c = compare(plan, rec)
    assert c.measured_step_time_s == pytest.approx(rec.measured_step_time_s)
    assert cli(["report", str(tmp_path / "plan.json"), str(tmp_path / "run.json")]) == 0
