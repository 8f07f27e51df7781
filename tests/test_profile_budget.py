"""The profile's time budget (cost_models/profiler/budget.py): on a machine where a kernel is 100× slower
than expected the sweeps stop in time and fill the rest from the fitted curve. The slow machine is
simulated: a kernel slowed by a sleep proportional to its work (wall clock), and a simulated clock."""

import time

import pytest
import torch

from cost_models.profile import Profile
from cost_models.profiler import kernels
from cost_models.profiler.budget import PhaseClock, SizeSweep, fitted_time_s, trials_within


def test_fitted_curve_is_the_median_rate_of_the_last_three_points():
    # a saturated kernel (constant rate) is extrapolated exactly
    assert fitted_time_s([(w, w / 5e9) for w in (1e6, 4e6, 1.6e7)], 6.4e7) == pytest.approx(6.4e7 / 5e9)
    # one disturbed point among the last three does not bend the curve (rates 6, 7.4, 0.24 GB/s → 6)
    points = [(2**18, 2**18 / 6e9), (2**20, 2**20 / 7.4e9), (2**22, 2**22 / 0.24e9)]
    assert fitted_time_s(points, 2**26) == pytest.approx(2**26 / 6e9)
    # a rate still rising is not extrapolated as rising further; earlier points do not count
    rising = [(1.0, 1.0), (1e3, 1e-1), (1e4, 1e-1 * 5), (1e5, 1e-1 * 25)]  # rates 1e4, 2e4, 4e4
    assert fitted_time_s(rising, 1e7) == pytest.approx(1e7 / 2e4)
    with pytest.raises(ValueError):
        fitted_time_s([], 1.0)


def test_collectives_extrapolate_on_the_alpha_beta_line():
    from cost_models.profiler.budget import alpha_beta_time_s

    def line(n):  # α = 1 ms, β = 1 GB/s
        return 1e-3 + n / 1e9
    points = [(n, line(n)) for n in (2**20, 2**21, 2**22)]
    assert alpha_beta_time_s(points, 2**28) == pytest.approx(line(2**28))
    # latency points alone (flat): the largest point's rate beyond it, never a faster one
    flat = [(1024, 1e-2), (2048, 1e-2)]
    assert alpha_beta_time_s(flat, 4096) == pytest.approx(2e-2)


def test_trials_shrink_to_fit_but_one_always_runs():
    assert trials_within(1.0, 0.1, trial_s=0.02, most=5) == 5
    assert trials_within(1.0, 0.3, trial_s=0.02, most=5) == 2  # (1.0 - 0.3) // 0.3
    assert trials_within(0.1, 5.0, trial_s=0.02, most=5) == 1


def test_phases_share_what_is_left_by_weight():
    now = [0.0]
    clock = PhaseClock(100.0, {"a": 1.0, "b": 3.0}, clock=lambda: now[0])
    assert clock.begin("a") == pytest.approx(25.0)
    now[0] = 10.0  # "a" finished early: "b" gets everything left
    assert clock.begin("b") == pytest.approx(90.0)
    with pytest.raises(ValueError, match="positive"):
        PhaseClock(0.0, {})


def test_simulated_slow_sweep_stops_within_budget_and_extrapolates_the_law():
    """Sizes ×2 apart whose call time is work / 1 GFLOP/s (a slow bf16 GEMM), each costing a warm-up and
    three trials on a simulated clock; 30 s for a sweep that would take ~430 s in full."""
    now = [0.0]
    works = [2.0 * s**3 for s in (64, 128, 256, 512, 1024, 2048)]
    items = [(layout, w) for layout in ("nn", "nt", "tn") for w in works]
    sweep = SizeSweep(30.0, items, clock=lambda: now[0])
    measured, extrapolated = [], []
    for layout, w in items:
        share = sweep.share_s(layout, w, fallback="dtype")
        if share is None:
            extrapolated.append((w, sweep.predict_s(layout, w, fallback="dtype")))
            continue
        t = w / 1e9
        now[0] += t + trials_within(share, t, trial_s=0.02, most=3) * max(t, 0.02)
        sweep.done(w, t, layout, "dtype")
        measured.append(w)
    assert now[0] <= 30.0
    assert max(measured) < works[-1] and extrapolated  # the large sizes were not run
    for w, t in extrapolated:
        assert t == pytest.approx(w / 1e9, rel=1e-6)  # the fitted law is the true one here


def test_gemm_sweep_on_a_slowed_kernel_stops_in_time(monkeypatch):
    """A real sweep, with torch.mm slowed to 0.02 GFLOP/s (a sleep per call, ≥ 26 ms so that a busy
    machine's scheduling does not dominate it): 1024³ would take 107 s a call."""
    rate = 2e7
    real_mm = torch.mm

    def slow_mm(a, b):
        time.sleep(2.0 * a.shape[0] * a.shape[1] * b.shape[1] / rate)
        return real_mm(a, b)

    monkeypatch.setattr(kernels, "gemm_shapes", lambda quick: [(s, s, s) for s in (64, 128, 256, 512, 1024)])
    monkeypatch.setattr(kernels.torch, "mm", slow_mm)
    messages = []
    t0 = time.monotonic()
    samples = kernels.measure_gemm(torch.device("cpu"), ["float32"], True, lambda m, _left: messages.append(m),
                                   budget_s=3.0)
    took = time.monotonic() - t0
    assert took < 3.0 + 0.5  # the last item may overrun its share by one call
    big = [s for s in samples if s.m >= 512]
    assert len(big) == 6 and all(s.extrapolated for s in big)
    for s in big:  # the sleep dominates, so the fitted curve is the slowed rate; a busy machine only
        true_s = 2.0 * s.m**3 / rate  # oversleeps (48 ms for a 26 ms sleep at load 5, ×3 at load 10)
        assert 0.7 * true_s < s.time_s < 6.0 * true_s
    assert any("extrapolated" in m for m in messages)
    assert all(not s.extrapolated for s in samples if s.m == 64)


def test_extrapolated_samples_survive_a_round_trip(tmp_path):
    from cost_models.profile import GemmSample, MachineInfo

    prof = Profile(machine=MachineInfo(hostname="h", platform="p", processor="x", cpu_count=2, ram_bytes=1),
                   device_name="cpu", device_kind="cpu", device_count=2, torch_version="t", created="c",
                   backend="gloo", threads_per_process=1, launch_overhead_s=1e-6,
                   gemm=(GemmSample(m=8, n=8, k=8, dtype="float32", time_s=1e-5, extrapolated=True),),
                   process_slowdown={2: 1.3, 4: 2.6})
    prof.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back == prof and back.gemm[0].extrapolated and back.process_slowdown == {2: 1.3, 4: 2.6}



def _local_profile(**kw):
    from cost_models.profile import GemmSample
    from cost_models.profiler import local_device_name, machine_info

    return Profile(machine=machine_info(), device_name=local_device_name(), device_kind="cpu", device_count=2,
                   torch_version=torch.__version__, created="c", backend="gloo", threads_per_process=1,
                   launch_overhead_s=1e-6, gemm=(GemmSample(m=64, n=64, k=64, dtype="float32", time_s=1e-4),), **kw)


def test_cluster_local_prices_kernels_with_the_measured_process_slowdown():
    from autopar.cluster import Cluster, cpu_slowdown

    prof = _local_profile(process_slowdown={2: 1.7})
    assert Cluster.local(nproc=2, profile=prof).profile.gemm[0].time_s == pytest.approx(1.7e-4)
    # an unmeasured larger count: the measured slowdown at 2, times the core share from 2 to 4
    cores = prof.machine.cpu_count

    def share(n):
        return cpu_slowdown(nproc=n, cpu_count=cores, profiled_threads=1, run_threads=1)
    assert Cluster.local(nproc=4, profile=prof).profile.gemm[0].time_s == pytest.approx(1.7e-4 * share(4) / share(2))
    # a profile without the measurement keeps the core share
    assert Cluster.local(nproc=4, profile=_local_profile()).profile.gemm[0].time_s == pytest.approx(1e-4 * share(4))


@pytest.mark.multiproc
def test_collective_sweep_keeps_its_budget_and_extrapolates_the_large_sizes():
    """1 KiB to 1 GiB in 4 s, starting the processes included (~1 s): a 256 MiB gloo all-reduce takes
    ~0.3 s here, so the sizes up to 256 MiB fit the budget on a quiet machine (the test measured only up to
    256 MiB before, and failed when nothing was left to extrapolate) and the largest never do."""
    import multiprocessing

    from cost_models.profiler.collectives import measure_collectives

    calls = multiprocessing.get_context("fork").Value("i", 0)  # the workers fork: the step is theirs to call
    a = torch.randn(128, 128)

    def step():
        with calls.get_lock():
            calls.value += 1
        return a @ a

    t0 = time.monotonic()
    sweep = measure_collectives(2, backend="gloo", quick=True, progress=lambda _m: None,
                                sizes=[2**e for e in range(10, 31)], plan=[("all_reduce", 2)], budget_s=4.0,
                                mix_dtype="float32", step=step)
    took = time.monotonic() - t0
    assert took < 4.0 + 3.0
    measured = [s.n_bytes for s in sweep.samples if not s.extrapolated]
    extrapolated = [s for s in sweep.samples if s.extrapolated]
    assert measured and extrapolated and min(s.n_bytes for s in extrapolated) > max(measured)
    assert len(sweep.samples) == 21 and sweep.mix_s[2] > 0 and calls.value > 2  # both ranks timed the step


def test_planner_prices_a_layer_no_faster_than_the_profile_timed_it():
    """A measured layer pass (Profile.layer_times at micro-batch 1) bounds the kernel sum from below at
    micro-batches ≥ 1, without tensor parallelism; no measurement, no change."""
    import autopar
    from autopar.cluster import Cluster
    from autopar.planner.costs import CostModel
    from autopar.zoo import build
    from cost_models.profile import ElementwiseSample, layer_key

    model, x = build("gpt-tiny", seq_len=64, batch_size=1)
    graph = autopar.capture(model, x)
    block = next(la for la in graph.layers if la.kind == "block")
    tables = dict(elementwise=(ElementwiseSample(op="add", dtype=graph.dtype, n_bytes=2**20, time_s=1e-4),))
    plain = CostModel.for_cluster(graph, Cluster.local(nproc=2, profile=_local_profile(**tables)))
    slow = {layer_key(block.signature, "fwd", 1): 0.5, layer_key(block.signature, "bwd", 1): 0.25}
    cluster = Cluster.local(nproc=2, profile=_local_profile(**tables, layer_times=slow))
    timed = CostModel.for_cluster(graph, cluster)
    measured = sum(cluster.profile.layer_times.values())  # 0.75 s scaled as the kernel tables are
    assert plain.compute.layer_compute_s(block.name, micro_batch=1) < 0.1 < measured  # the bound sets the time below
    assert timed.compute.layer_compute_s(block.name, micro_batch=1) == pytest.approx(measured)
    assert timed.compute.layer_compute_s(block.name, micro_batch=4) == pytest.approx(measured)
    assert timed.compute.layer_compute_s(block.name, micro_batch=1, tp=2) == pytest.approx(
        plain.compute.layer_compute_s(block.name, micro_batch=1, tp=2))


def test_layers_are_timed_at_several_micro_batches_smallest_first():
    """A layer's time on a CPU is not proportional to its samples (framework time per call, SDPA with
    dropout on the unfused path), so the profile times each layer at 1, 2, 4 and 8 samples; the budget
    drops the largest first."""
    import autopar
    from autopar.capture import capture
    from autopar.profiling import LAYER_MICRO_BATCHES, layer_cases

    model, x = autopar.zoo.build("gpt-tiny", seq_len=16, device="meta", dtype=torch.float32, n_layers=2)
    graph = capture(model, x)
    cases = layer_cases(model, x, graph, torch.device("cpu"), LAYER_MICRO_BATCHES)
    batches = [c.micro_batch for c in cases]
    assert batches == sorted(batches) and set(batches) == set(LAYER_MICRO_BATCHES)
    assert len(cases) == len(LAYER_MICRO_BATCHES) * len({la.signature for la in graph.layers})
    for case in cases:
        outs = [o for o in case.forward() if isinstance(o, torch.Tensor)]
        assert outs and all(o.shape[0] == case.micro_batch for o in outs)
