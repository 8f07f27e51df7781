"""Compute model: roofline, saturating efficiency, tile quantization, and profile precedence."""

import pytest

from cost_models import catalog
from cost_models.compute import GPU_GEMM_EFF_MAX, GPU_GEMM_RAMP_S, GPU_LAUNCH_S, GPU_MEM_EFF, ComputeModel
from cost_models.profile import ElementwiseSample, GemmSample, MachineInfo, Profile

A100 = catalog.device("a100-sxm-80gb")


def test_large_gemm_approaches_the_cited_efficiency():
    cm = ComputeModel(A100)
    n = 8192
    t = cm.gemm_time_s(n, n, n)
    achieved = 2 * n**3 / t
    # compute-bound: W / (P · eff_max) + ramp + launch, so ~79% of 312 TFLOP/s
    assert t == pytest.approx(2 * n**3 / (312e12 * GPU_GEMM_EFF_MAX) + GPU_GEMM_RAMP_S + GPU_LAUNCH_S, rel=1e-9)
    assert 0.75 * 312e12 < achieved < GPU_GEMM_EFF_MAX * 312e12


def test_small_gemm_is_far_from_peak_and_efficiency_is_increasing():
    cm = ComputeModel(A100)
    effs = [cm.efficiency(w) for w in (1e6, 1e8, 1e10, 1e12)]
    assert effs == sorted(effs) and effs[0] < 0.01 and effs[-1] > 0.79
    assert 2 * 256**3 / cm.gemm_time_s(256, 256, 256) < 0.1 * 312e12


def test_memory_bound_op_uses_bandwidth():
    cm = ComputeModel(A100)
    n_bytes = 3 * 2**30
    assert cm.op_time_s(1e6, n_bytes) == pytest.approx(n_bytes / (2039e9 * GPU_MEM_EFF) + GPU_LAUNCH_S)


def test_tile_quantization():
    cm = ComputeModel(A100)
    assert cm.gemm_time_s(129, 4096, 4096) > cm.gemm_time_s(128, 4096, 4096) * 1.5
    assert cm.gemm_time_s(129, 4096, 4096) == pytest.approx(cm.gemm_time_s(256, 4096, 4096), rel=0.01)


def _profile(**kw):
    base = dict(machine=MachineInfo(hostname="h", platform="p", processor="x", cpu_count=2, ram_bytes=2**34),
                device_name="cpu", device_kind="cpu", device_count=2, torch_version="t", created="d", backend="gloo",
                threads_per_process=2, launch_overhead_s=2e-6)
    return Profile(**{**base, **kw})


def test_profile_tables_take_precedence():
    gemm = (GemmSample(m=128, n=128, k=128, dtype="float32", time_s=2e-5),
            GemmSample(m=1024, n=1024, k=1024, dtype="float32", time_s=6e-3))
    ew = (ElementwiseSample(op="add", dtype="float32", n_bytes=3 * 2**20, time_s=1e-4),)
    cm = ComputeModel(catalog.device("cpu"), _profile(gemm=gemm, elementwise=ew, layer_times={"sig:fwd:b1:t1": 0.5}))
    assert cm.gemm_time_s(1024, 1024, 1024, "float32") == 6e-3  # exact shape measured
    # in between: log-log interpolation in work
    w_mid = (2 * 128**3 * 2 * 1024**3) ** 0.5
    assert cm.op_time_s(w_mid, 0, "float32") == pytest.approx((2e-5 * 6e-3) ** 0.5, rel=1e-6)
    # beyond: last time plus the extra work at the best measured rate
    best = 2 * 1024**3 / 6e-3
    assert cm.op_time_s(4 * 2 * 1024**3, 0, "float32") == pytest.approx(6e-3 + 3 * 2 * 1024**3 / best)
    assert cm.op_time_s(0, 6 * 2**20, "float32") == pytest.approx(1e-4 + 3 * 2**20 / (3 * 2**20 / 1e-4))
    assert cm.op_time_s(1.0, 1.0, key="sig:fwd:b1:t1") == 0.5
    assert cm.op_time_s(1.0, 1.0, "float32", key="other") == pytest.approx(1e-4)  # floors of the tables


def test_negative_inputs_are_rejected():
    with pytest.raises(ValueError, match="non-negative"):
        ComputeModel(A100).op_time_s(-1.0, 0.0)
    with pytest.raises(KeyError, match="no peak FLOP/s for dtype"):
        ComputeModel(catalog.device("v100-sxm2-32gb")).op_time_s(1e9, 0.0, "bfloat16")


def test_optrace_records_gemm_shapes_layouts_and_free_views():
    import torch

    from cost_models.optrace import predict_ops_time_s, trace_ops

    lin = torch.nn.Linear(32, 48)
    x = torch.randn(4, 8, 32, requires_grad=True)
    grad = torch.randn(4, 8, 48)
    ops = trace_ops(lambda: lin(x).backward(grad))
    gemms = sorted((o.name, o.gemm_mnk, o.gemm_layout) for o in ops if o.gemm_mnk)
    # forward x·Wᵀ (addmm, weight transposed), input grad g·W, weight grad gᵀ·x
    assert gemms == [("addmm", (32, 48, 32), "nt"), ("mm", (32, 32, 48), "nn"), ("mm", (48, 32, 32), "tn")]
    assert any(o.is_view for o in ops) and all(o.flops == 0 for o in ops if o.is_view)
    addmm = next(o for o in ops if o.name == "addmm")
    assert addmm.flops == 2 * 32 * 48 * 32
    cm = ComputeModel(A100)
    expected = sum(cm.gemm_time_s(*o.gemm_mnk, dtype="float32", layout=o.gemm_layout) if o.gemm_mnk else
                   cm.op_time_s(o.flops, o.bytes_moved, "float32") for o in ops if not o.is_view)
    assert predict_ops_time_s(ops, cm, "float32") == pytest.approx(expected)
