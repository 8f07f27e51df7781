"""`autopar.budget` / `autopar budget`: every point is the planner's exact plan, its days and cost follow by
arithmetic, the front and the chosen points match brute force over the sweep, more GPUs never predict a
longer time unless the batch bounds parallelism (and then the output says so), and bad input is refused
with a message that says what would do."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

import autopar
from autopar import Cluster
from autopar.budget import SECONDS_PER_DAY, Budget, budget
from autopar.cli.cmd_budget import batch_tokens, parse_amount, parse_days, parse_nodes
from autopar.cli.main import main
from autopar.errors import AutoparError, InfeasiblePlanError

KINDS = ["dgx-h100", "dgx-a100-80gb"]
PRICES = {"dgx-h100": 2.5, "dgx-a100-80gb": 1.25}
SEQ = 256  # llama-tiny's default sequence


@pytest.fixture(scope="module")
def tiny():
    return autopar.capture(*autopar.zoo.build("llama-tiny"))


@pytest.fixture(scope="module")
def gpt13():
    return autopar.capture(*autopar.zoo.build("gpt3-1.3b", seq_len=1024))


@pytest.fixture(scope="module")
def sweep(tiny) -> Budget:
    return budget(tiny, tokens=3e9, clusters=KINDS, nodes=[1, 2, 4], global_batch_tokens=[64 * SEQ, 256 * SEQ],
                  prices=PRICES, goodput=0.9, deadline_days=0.004)


def test_points_are_the_planners_exact_plans_and_days_follow_by_arithmetic(tiny, sweep) -> None:
    assert len(sweep.points) == 6 and all(p.fits for p in sweep.points)
    for p in sweep.points:
        e = p.plan.estimate
        assert p.plan.solver.gap == 0.0 and p.plan.solver.status == "optimal"
        steps = 3e9 / (p.global_batch_size * SEQ)
        assert p.days == pytest.approx(steps * e.step_time_s / SECONDS_PER_DAY / 0.9, rel=1e-12)
        assert p.days_hi == pytest.approx(steps * e.step_time_s * (1 + e.band_hi) / 86400 / 0.9, rel=1e-12)
        assert p.days_lo == pytest.approx(p.days * (1 + e.band_lo), rel=1e-12)
        assert p.gpu_hours == pytest.approx(p.gpus * 24 * p.days, rel=1e-12)
        assert p.cost == pytest.approx(p.gpu_hours * PRICES[p.cluster], rel=1e-12)
        assert p.cost_hi == pytest.approx(p.gpu_hours * (1 + e.band_hi) * PRICES[p.cluster], rel=1e-12)
        # the batch of the range that trains fastest, each an exact plan of autopar.plan as it is
        by_batch = {}
        for b in (64, 256):
            alone = autopar.plan(tiny, Cluster.preset(p.cluster, nodes=p.nodes), global_batch_size=b)
            by_batch[b] = 3e9 / (b * SEQ) * alone.estimate.step_time_s
        assert p.global_batch_size == min(by_batch, key=by_batch.get)
        assert p.days * SECONDS_PER_DAY * 0.9 == pytest.approx(by_batch[p.global_batch_size], rel=1e-9)


def test_front_and_choices_match_brute_force(sweep) -> None:
    pts = sweep.points
    dominated = {i for i, p in enumerate(pts) for q in pts
                 if q is not p and q.days <= p.days and q.cost <= p.cost and (q.days < p.days or q.cost < p.cost)}
    assert set(sweep.front) == set(range(len(pts))) - dominated and sweep.front_axis == "cost"
    ok = [i for i, p in enumerate(pts) if p.days_hi <= 0.004]
    assert ok and sweep.fastest == min(ok, key=lambda i: pts[i].days_hi)
    assert sweep.cheapest == min(ok, key=lambda i: pts[i].cost_hi)
    assert sweep.smallest == {"dgx-h100": 0, "dgx-a100-80gb": 3}


def test_front_without_prices_is_over_gpu_hours(tiny) -> None:
    b = budget(tiny, tokens=1e9, clusters=KINDS, nodes=[1, 2], global_batch_tokens=64 * SEQ)
    assert b.front_axis == "gpu_hours" and all(p.cost is None for p in b.points)
    pairs = [(p.days, p.gpu_hours) for p in b.points]
    assert set(b.front) == {i for i, (d, h) in enumerate(pairs)
                            if not any(d2 <= d and h2 <= h and (d2, h2) != (d, h) for d2, h2 in pairs)}


def test_more_gpus_never_predict_longer_on_a_realistic_model(gpt13) -> None:
    g = gpt13
    for batch in (16, 128):
        b = budget(g, tokens=1e12, clusters=KINDS, nodes=[1, 2, 4, 8, 16], global_batch_tokens=batch * 1024)
        for kind in KINDS:
            days = [p.days for p in b.points if p.cluster == kind]
            assert all(later < earlier for earlier, later in zip(days, days[1:], strict=False)), (kind, batch, days)
        assert not any(p.slower_note for p in b.points)


def test_a_longer_time_on_more_gpus_says_why(tiny, capsys) -> None:
    """8 sequences per step cannot spread over 32 or 64 GPUs' data-parallel replicas: those points are slower
    and say the batch bounds them; every slower point names a cause, and the exact plan beats the smaller
    plan's layout widened (the claim 'no layout of these GPUs does better' holds)."""
    b = budget(tiny, tokens=1e9, clusters=KINDS, nodes=[1, 2, 4, 8], global_batch_tokens=8 * SEQ)
    for kind in KINDS:
        pts = [p for p in b.points if p.cluster == kind]
        for i, p in enumerate(pts):
            best_before = min((q.days for q in pts[:i]), default=math.inf)
            assert bool(p.slower_note) == (p.days > best_before), (p.nodes, p.days, best_before)
            assert p.slower_cause in (("batch", "cost_model") if p.slower_note else ("",))
        assert [p.slower_cause for p in pts if p.nodes >= 4] == ["batch", "batch"]
        assert all(p.slower_note.startswith("batch-bound") for p in pts if p.slower_cause == "batch")
    assert main(["budget", "llama-tiny", "--tokens", "1e9", "--clusters", "dgx-h100", "--nodes", "1,4",
                 "--global-batch-tokens", str(8 * SEQ)]) == 0
    assert "! batch-bound" in capsys.readouterr().out


def test_cli_end_to_end_json_and_plot(tmp_path, capsys) -> None:
    plot = tmp_path / "budget.png"
    argv = ["budget", "llama-tiny", "--tokens", "3e9", "--clusters", ",".join(KINDS), "--nodes", "1..2",
            "--global-batch-tokens", "16Ki..64Ki", "--price", "dgx-h100=2.5", "--price", "dgx-a100-80gb=1.25",
            "--deadline", "6h", "--goodput", "0.9"]
    assert main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "goodput         0.90" in out and "fastest" in out and "front" in out and plot.stat().st_size > 1000
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["goodput"] == 0.9 and d["deadline_days"] == 0.25 and len(d["points"]) == 4
    assert {p["global_batch_size"] for p in d["points"]} <= {64, 128, 256}
    assert all(p["solver"]["gap"] == 0.0 for p in d["points"])


def test_parsers() -> None:
    assert parse_nodes("8..512") == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert parse_nodes("1..64") == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert parse_nodes("5..7,100") == [5, 6, 7, 100]
    assert parse_amount("2e12", "--tokens") == 2e12 and parse_amount("2T", "--tokens") == 2e12
    assert parse_amount("4Mi", "x") == 4 * 2**20 and parse_amount("300B", "x") == 3e11
    assert parse_days("30d") == 30 and parse_days("36h") == 1.5 and parse_days("2w") == 14
    assert batch_tokens("4M..16M", 2048) == [2048 * 2048, 4096 * 2048]
    assert batch_tokens("4Mi", 2048) == [4 * 2**20]


@pytest.mark.parametrize(("argv", "says"), [
    (["--tokens=-2e12"], "--tokens '-2e12': give a positive amount"),
    (["--tokens", "1e9", "--price", "dgx-h100=-2"], "give CLUSTER=PRICE_PER_GPU_HOUR with a positive price"),
    (["--tokens", "1e9", "--nodes", "8..4"], "1 ≤ LOW ≤ HIGH"),
    (["--tokens", "1e9", "--nodes", "a..b"], "1 ≤ LOW ≤ HIGH"),
    (["--tokens", "1e9", "--global-batch-tokens", "64Ki..16Ki"], "no power-of-two number of 256-token"),
    (["--tokens", "1e9", "--global-batch-tokens", "1000"], "give a multiple of 256, e.g. 1,024 (4 sequences)"),
    (["--tokens", "1e9", "--deadline=-3d"], "--deadline '-3d': give a positive duration"),
    (["--tokens", "1e9", "--goodput", "1.5"], "--goodput 1.5: give the fraction"),
    (["--tokens", "1e9", "--max-cost", "1e6"], "max_cost needs a price for every cluster"),
    (["--tokens", "1e9", "--clusters", "dgx-h900,dgx-h100"], "unknown cluster(s) 'dgx-h900'; give preset names"),
    (["--tokens", "1e9", "--price", "dgx-b300=3"], "prices for ['dgx-b300'], which are not among the clusters"),
])
def test_bad_input_is_refused_with_what_would_do(argv, says, capsys) -> None:
    base = ["budget", "llama-tiny", "--clusters", "dgx-h100", "--nodes", "1"]
    assert main(base + argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopar: error:") and says in err and "Traceback" not in err


def test_a_deadline_no_cluster_meets_names_the_one_reachable(tiny, capsys) -> None:
    b = budget(tiny, tokens=1e12, clusters=KINDS, nodes=[1, 2], global_batch_tokens=64 * SEQ, deadline_days=0.01)
    quickest = min(b.points, key=lambda p: p.days_hi)
    assert b.fastest is None and b.cheapest is None
    assert f"the fastest, {quickest.nodes} × {quickest.cluster}" in b.unmet and "allow ≥" in b.unmet
    reachable = float(b.unmet.split("allow ≥ ")[1].split(" days")[0])
    assert quickest.days_hi <= reachable <= quickest.days_hi * 1.01
    again = budget(tiny, tokens=1e12, clusters=KINDS, nodes=[1, 2], global_batch_tokens=64 * SEQ,
                   deadline_days=reachable)
    assert again.fastest is not None and again.points[again.fastest].cluster == quickest.cluster
    assert main(["budget", "llama-tiny", "--tokens", "1e12", "--clusters", "dgx-h100", "--nodes", "1,2",
                 "--global-batch-tokens", "64Ki", "--deadline", "0.01"]) == 1
    cap = capsys.readouterr()
    assert "smallest fit" in cap.out and "the deadline of 0.01 days is met by no swept cluster" in cap.err


def test_a_model_that_fits_nowhere_says_how_many_devices(tmp_path, gpt13) -> None:
    small = tmp_path / "small.toml"
    small.write_text('name = "small"\nnodes = 1\ndevices_per_node = 2\nintra_node = "nvlink3-nvswitch"\n'
                     'price_per_gpu_hour = 1.0\n[device]\nname = "tiny-gpu"\nkind = "gpu"\nmemory_GiB = 4\n'
                     'memory_bandwidth_GBps = 1000\nsource = "a test device"\n'
                     'peak_TFLOPs = { bfloat16 = 100, float32 = 20 }\n')
    g = gpt13
    with pytest.raises(InfeasiblePlanError, match=r"fits on none of the swept clusters .* as many devices"):
        budget(g, tokens=1e9, clusters=[str(small)], nodes=[1], global_batch_tokens=16 * 1024)
    fits = budget(g, tokens=1e9, clusters=[str(small)], nodes=[1, 4], global_batch_tokens=16 * 1024)
    assert fits.smallest == {"small": 1} and not fits.points[0].fits and fits.points[1].cost is not None


def test_api_refusals(tiny) -> None:
    with pytest.raises(AutoparError, match="tokens = -1"):
        budget(tiny, tokens=-1, clusters=KINDS, nodes=[1])
    with pytest.raises(AutoparError, match="price of dgx-h100 = -1"):
        budget(tiny, tokens=1e9, clusters=KINDS, nodes=[1], prices={"dgx-h100": -1})
    with pytest.raises(AutoparError, match="nodes 0"):
        budget(tiny, tokens=1e9, clusters=KINDS, nodes=[0])
    with pytest.raises(AutoparError, match="give a list of preset names"):
        budget(tiny, tokens=1e9, clusters="dgx-h100", nodes=[1])


def test_forked_workers_give_the_same_points(tiny, sweep) -> None:
    again = budget(tiny, tokens=3e9, clusters=KINDS, nodes=[1, 2, 4], global_batch_tokens=[64 * SEQ, 256 * SEQ],
                   prices=PRICES, goodput=0.9, deadline_days=0.004, workers=2)
    strip = [dataclasses.replace(p, plan=None) for p in sweep.points]
    assert [dataclasses.replace(p, plan=None) for p in again.points] == strip
    assert [p.plan.config for p in again.points] == [p.plan.config for p in sweep.points]
    assert (again.front, again.fastest, again.cheapest) == (sweep.front, sweep.fastest, sweep.cheapest)
