"""Error bands and leave-one-source-out validation: the LOSO arithmetic against brute force, bands on
estimates and in the printed plan, and the pessimistic objective (a layout whose advantage is inside its
band loses to a safer one)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import autopar
from autopar import Cluster, PlannerOptions
from autopar.errors import ConfigError
from autopar.report.text import band_text
from cost_models import error_band
from cost_models.error_band import ErrorBand

_BENCH = Path(__file__).parent.parent / "benchmarks"


def _loso():
    spec = importlib.util.spec_from_file_location("loso_under_test", _BENCH / "loso.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


loso = _loso()


def _row(name, source, published, predicted, ideal=1.0, kind="fsdp", hw="a100"):
    return loso.Row(name=name, source_id=source, kind=kind, hardware=hw, published_s=published,
                    predicted_s=predicted, ideal_s=ideal)


def test_fitted_mfu_is_the_mape_minimum_by_brute_force():
    rows = [_row(f"r{i}", "s", published=p, predicted=1.0, ideal=i_s)
            for i, (p, i_s) in enumerate([(2.0, 0.9), (3.0, 1.1), (2.5, 1.3), (4.0, 1.2), (1.8, 0.8)])]
    c = loso.fit_constant_mfu(rows)
    grid = [k / 10000 for k in range(1000, 9000)]
    brute = min(loso.mape([r.ideal_s / g / r.published_s - 1 for r in rows]) for g in grid)
    assert loso.mape([r.ideal_s / c / r.published_s - 1 for r in rows]) <= brute + 1e-12


def test_loso_fits_the_sustained_fraction_without_the_held_out_source():
    # every run's predicted time is 1/g of its time at g = 1; sources a and c ran at 0.8 of burst, b at 1.0:
    # held out, b is priced at a's and c's fraction (0.8, so 25% too slow), and a at what b and c jointly favour
    def row(name, source, true_g):
        curve = tuple((g, 1.0 / g) for g in loso.SUSTAINED_GRID)
        return loso.Row(name=name, source_id=source, kind="fsdp", hardware="a100", published_s=1.0 / true_g,
                        predicted_s=1.0, ideal_s=0.5, curve=curve)

    rows = [row(f"a{i}", "a", 0.8) for i in range(3)] + [row(f"c{i}", "c", 0.8) for i in range(3)] + [
        row(f"b{i}", "b", 1.0) for i in range(3)]
    assert loso.fit_sustained(rows) == pytest.approx(0.8)
    res = {r.source_id: r for r in loso.leave_one_source_out(rows)}
    assert res["b"].sustained == pytest.approx(0.8)
    assert res["b"].model_mape == pytest.approx(1.0 / 0.8 - 1.0)
    assert res["c"].sustained in (pytest.approx(0.8), pytest.approx(1.0))  # a's 3 runs against b's 3: a tie
    assert rows[0].at(0.9).predicted_s == pytest.approx(1 / 0.9)  # linear in 1/g: exact for compute-bound runs
    assert loso.fit_sustained([_row("x", "s", 1.0, 1.0)]) is None  # no curve: nothing to fit


def test_loso_derives_without_the_held_out_source():
    # source "b" is 50% slower than predicted everywhere; the others are exact: held out, b's runs must fall
    # outside the band (derived from a and c only), and the baseline MFU must come from a and c only
    rows = ([_row(f"a{i}", "a", 1.02, 1.0, ideal=0.5) for i in range(4)]
            + [_row(f"c{i}", "c", 1.0, 1.0, ideal=0.5) for i in range(4)]
            + [_row(f"b{i}", "b", 1.5, 1.0, ideal=0.5) for i in range(4)])
    res = {r.source_id: r for r in loso.leave_one_source_out(rows)}
    assert res["b"].inside_band == 0
    assert res["b"].model_mape == pytest.approx(1 - 1 / 1.5)
    assert res["b"].baseline_mfu in (pytest.approx(0.5), pytest.approx(0.5 / 1.02))  # a's or c's: never b's 1/3
    assert res["a"].inside_band == 4  # a's +2% lies within [0, +50%] from b and c
    model, base = loso.overall(list(res.values()))
    assert model == pytest.approx(sum(abs(r.error) for r in rows) / len(rows))


def test_band_falls_back_from_hardware_to_kind_to_all():
    # a basis needs runs of BAND_MIN_SOURCES sources: many runs of one source do not show the next source's error
    n = loso.BAND_MIN_SOURCES
    rows = ([_row(f"f{i}", f"s{i}", 1.0 + 0.1 * i, 1.0, kind="fsdp", hw="a100") for i in range(n)]
            + [_row(f"g{i}", "s0", 1.0, 1.0, kind="fsdp", hw="h100") for i in range(n)]
            + [_row("p0", "s0", 2.0, 1.0, kind="pipeline", hw="h100")])
    assert loso.derive_band(rows, kind="fsdp", hardware="a100").basis == "kind+hardware"
    assert loso.derive_band(rows, kind="fsdp", hardware="h100").basis == "kind"  # n runs, but of one source
    b = loso.derive_band(rows, kind="pipeline", hardware="h100")
    assert (b.basis, b.runs, b.lo, b.hi) == ("all", 2 * n + 1, pytest.approx(0.0), pytest.approx(1.0))


def test_estimates_carry_the_band_of_their_kind():
    graph = autopar.capture(*autopar.zoo.build("gpt3-1.3b", seq_len=2048, n_layers=2))
    est = autopar.estimate(graph, Cluster.preset("dgx-a100-80gb", nodes=1),
                           autopar.ParallelConfig(dp=8, zero_stage=3, micro_batch_size=2, num_microbatches=1))
    band = error_band.error_band(kind="fsdp", hardware="a100")
    assert band is not None and (est.band_lo, est.band_hi, est.band_runs) == (band.lo, band.hi, band.runs)
    assert est.pessimistic_step_time_s == pytest.approx(est.step_time_s * (1 + band.hi))
    assert band_text(est).startswith(", runs of this kind ") and "published runs" in band_text(est)
    cpu = autopar.estimate(autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=16)), Cluster.local(nproc=2),
                           autopar.ParallelConfig(dp=2, micro_batch_size=1, num_microbatches=1))
    assert cpu.band_runs == 0 and band_text(cpu) == ""  # published GPU runs say nothing about a CPU


def test_every_shipped_band_is_consistent():
    bands = error_band._bands()
    assert bands, "cost_models/catalog/error_bands.toml is missing: python benchmarks/published_runs.py --write-bands"
    assert ("*", "*") in bands
    for (kind, _), b in bands.items():
        assert kind in (*error_band.KINDS, "*") and b.lo <= b.hi and b.runs >= 1


def _two_layouts(monkeypatch, data_hi: float, fsdp_hi: float):
    """gpt3-1.3b on 8 A100 with everything pinned but the ZeRO stage (2: kind data, 3: kind fsdp), under
    synthetic bands; returns (fastest plan, pessimistic plan)."""
    bands = {("data", "*"): ErrorBand(lo=0.0, hi=data_hi, runs=5, basis="data, any hardware"),
             ("fsdp", "*"): ErrorBand(lo=0.0, hi=fsdp_hi, runs=5, basis="fsdp, any hardware")}
    monkeypatch.setattr(error_band, "_bands", lambda: bands)
    graph = autopar.capture(*autopar.zoo.build("gpt3-1.3b", seq_len=2048))
    cluster = Cluster.preset("dgx-a100-80gb", nodes=1)
    pins = dict(tp=1, pp=1, dp=8, micro_batch_size=2, recompute="none", exclude_zero_stages=(0, 1), top_k=1)
    fast = autopar.plan(graph, cluster, global_batch_size=64, options=PlannerOptions(**pins))
    safe = autopar.plan(graph, cluster, global_batch_size=64, options=PlannerOptions(**pins, objective="pessimistic"))
    return fast, safe


def test_pessimistic_objective_prefers_the_safer_layout_when_the_advantage_is_inside_the_band(monkeypatch):
    fast, _ = _two_layouts(monkeypatch, 0.0, 0.0)
    (alt_cfg, alt), = fast.alternatives
    winner, loser = fast.config.zero_stage, alt_cfg.zero_stage
    advantage = alt.step_time_s / fast.estimate.step_time_s - 1
    assert {winner, loser} == {2, 3} and advantage > 0
    kind = {2: "data", 3: "fsdp"}
    # the winner's band reaches twice its advantage past the other's: the safer layout must win
    his = {kind[winner]: 2 * advantage + 0.01, kind[loser]: 0.0}
    fast, safe = _two_layouts(monkeypatch, his["data"], his["fsdp"])
    assert fast.config.zero_stage == winner and safe.config.zero_stage == loser
    assert safe.estimate.pessimistic_step_time_s < fast.estimate.pessimistic_step_time_s
    # an advantage larger than the band survives the pessimistic objective
    his = {kind[winner]: advantage / 2, kind[loser]: 0.0}
    _, safe = _two_layouts(monkeypatch, his["data"], his["fsdp"])
    assert safe.config.zero_stage == winner


def test_bad_objective_is_refused():
    with pytest.raises(ConfigError, match="objective"):
        PlannerOptions(objective="optimistic")
    with pytest.raises(ConfigError, match="loss_kernel"):
        PlannerOptions(loss_kernel="chunky")


def test_band_weighs_every_source_alike():
    # 40 runs of one sweep, all exact, and one run of each of 10 other sources, slowdowns 0.05..0.50: weighted
    # by run the band would stop near the sweep; each source weighing alike, the 11 sources' slowdowns decide
    sweep = [_row(f"s{i}", "sweep", 1.0, 1.0) for i in range(40)]
    others = [_row(f"o{k}", f"src{k}", 1.0 + 0.05 * k, 1.0) for k in range(1, 11)]
    lo, hi = loso._spread(sweep + others)
    # brute force: replicate every source to 40 runs, then the plain inverted-CDF quantiles of the 440 values
    replicated = [0.0] * 40 + [0.05 * k for k in range(1, 11) for _ in range(40)]
    assert (lo, hi) == (pytest.approx(float(np.quantile(replicated, 0.10, method="inverted_cdf"))),
                        pytest.approx(float(np.quantile(replicated, 0.90, method="inverted_cdf"))))
    assert hi == pytest.approx(0.45)
    # one source: the plain inverted-CDF quantiles of its runs
    alone = [_row(f"a{i}", "a", 1.0 + 0.01 * i, 1.0) for i in range(20)]
    values = [0.01 * i for i in range(20)]
    assert loso._spread(alone) == (pytest.approx(float(np.quantile(values, 0.10, method="inverted_cdf"))),
                                   pytest.approx(float(np.quantile(values, 0.90, method="inverted_cdf"))))
