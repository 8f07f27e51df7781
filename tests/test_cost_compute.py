"""Compute model: roofline, saturating efficiency, tile quantization, and profile precedence."""

import dataclasses
import math

import pytest

from cost_models import catalog
from cost_models.compute import (
    CAUSAL_TIME_FRACTION,
    GPU_GEMM_RAMP_S,
    GPU_LAUNCH_S,
    GPU_MEM_EFF,
    ComputeModel,
    attention_eff,
    gemm_eff_max,
    sustained_fraction,
)
from cost_models.profile import ElementwiseSample, GemmSample, MachineInfo, Profile

A100 = catalog.device("a100-sxm-80gb")
SUSTAINED = sustained_fraction(A100)  # of the burst rates below, what training sustains (fitted)
GPU_GEMM_EFF_MAX = gemm_eff_max(A100) * SUSTAINED  # 86.9%: the MAMF table's A100 SXM, sustained
GPU_ATTENTION_EFF_MAX = attention_eff(A100) * SUSTAINED  # FlashAttention-2 on A100, sustained


def test_large_gemm_approaches_the_cited_efficiency():
    cm = ComputeModel(A100)
    n = 8192
    t = cm.gemm_time_s(n, n, n)
    achieved = 2 * n**3 / t
    # compute-bound: W / (P · eff_max) + ramp + launch, so ~86% of 312 TFLOP/s at the sustained fraction
    assert t == pytest.approx(2 * n**3 / (312e12 * GPU_GEMM_EFF_MAX) + GPU_GEMM_RAMP_S + GPU_LAUNCH_S, rel=1e-9)
    assert 0.98 * GPU_GEMM_EFF_MAX * 312e12 < achieved < GPU_GEMM_EFF_MAX * 312e12


def test_small_gemm_is_far_from_peak_and_efficiency_is_increasing():
    cm = ComputeModel(A100)
    effs = [cm.efficiency(w) for w in (1e6, 1e8, 1e10, 1e12)]
    assert effs == sorted(effs) and effs[0] < 0.01 and effs[-1] > 0.79 * SUSTAINED
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


def test_kernel_sum_of_a_gpt_block_on_a100_matches_the_hand_roofline():
    """GPT-3 2.7B-like block forward (h=2560, s=2048, b=1, bf16) on an A100 from datasheet numbers only:
    6 GEMMs (q, k, v, o, fc1, fc2), one flash-attention kernel, 7 memory-bound kernels (2 layer norms,
    2 residual adds, GELU, 2 bias adds)."""
    h, s = 2560, 2048
    peak, bw = 312e12, 2039e9  # A100 SXM bf16 dense, HBM2e (NVIDIA A100 datasheet)
    gemm_flops = 2 * s * h * h * 4 + 2 * 2 * s * h * 4 * h  # q, k, v, o + fc1, fc2
    attn_flops = 4 * s * s * h  # QKᵀ and PV
    mem_bytes = 2 * (2 * 2 * s * h + 2 * 3 * s * h + 2 * s * 4 * h + 2 * 2 * s * h)  # bf16 in + out of each
    cm = ComputeModel(A100)
    got = cm.kernels_time_s(gemm_flops=gemm_flops, gemm_count=6, attention_flops=attn_flops, attention_count=1,
                            memory_bytes=mem_bytes, memory_count=7)
    # eff(W) = e·W/(W + P·e·ramp)  ⇒  W / (P·eff(W)) = W/(P·e) + ramp, for each kernel of the group
    gemm = 6 * ((gemm_flops / 6) / (peak * GPU_GEMM_EFF_MAX) + GPU_GEMM_RAMP_S + GPU_LAUNCH_S)
    attn = attn_flops * (attn_flops + peak * GPU_GEMM_EFF_MAX * GPU_GEMM_RAMP_S) / (
        attn_flops * peak * GPU_ATTENTION_EFF_MAX) + GPU_LAUNCH_S
    mem = 7 * ((mem_bytes / 7) / (bw * GPU_MEM_EFF) + GPU_LAUNCH_S)
    assert got == pytest.approx(gemm + attn + mem, rel=1e-9)
    # a fused attention kernel is slower per FLOP than a GEMM of the same work (FlashAttention-2: 50-73%)
    assert cm.kernels_time_s(gemm_flops=0, gemm_count=0, attention_flops=attn_flops, attention_count=1,
                             memory_bytes=0, memory_count=0) > cm.kernels_time_s(
        gemm_flops=attn_flops, gemm_count=1, attention_flops=0, attention_count=0, memory_bytes=0, memory_count=0)
    # the kernel sum exceeds one roofline over the totals (memory kernels cannot hide under GEMMs)
    assert got > cm.op_time_s(gemm_flops + attn_flops, mem_bytes)
    with pytest.raises(ValueError, match="spread over at least one kernel"):
        cm.kernels_time_s(gemm_flops=1e9, gemm_count=0, attention_flops=0, attention_count=0, memory_bytes=0,
                          memory_count=0)


def test_kernel_sum_with_a_profile_uses_the_tables_per_kernel():
    gemm = (GemmSample(m=256, n=256, k=256, dtype="float32", time_s=4e-4),
            GemmSample(m=1024, n=1024, k=1024, dtype="float32", time_s=1.6e-2),
            GemmSample(m=512, n=512, k=64, dtype="float32", time_s=8e-3, layout="nt", batch=8))
    ew = (ElementwiseSample(op="add", dtype="float32", n_bytes=3 * 2**20, time_s=2e-4),
          ElementwiseSample(op="add", dtype="float32", n_bytes=3 * 2**24, time_s=8e-3))
    cm = ComputeModel(catalog.device("cpu"), _profile(gemm=gemm, elementwise=ew))
    got = cm.kernels_time_s(gemm_flops=2 * 2 * 1024**3, gemm_count=2, attention_flops=8 * 2 * 512 * 512 * 64,
                            attention_count=1, memory_bytes=4 * 3 * 2**20, memory_count=4, dtype="float32")
    # two measured 1024³ GEMMs + the one measured attention bmm + four measured 1 MiB adds
    assert got == pytest.approx(2 * 1.6e-2 + 8e-3 + 4 * 2e-4)


def test_batched_matmul_table_by_shape():
    rows = (GemmSample(m=256, n=256, k=64, dtype="float32", time_s=1e-3, layout="nn", batch=8),
            GemmSample(m=1024, n=1024, k=64, dtype="float32", time_s=64e-3, layout="nn", batch=8),
            GemmSample(m=512, n=64, k=512, dtype="float32", time_s=1e-3, layout="nn", batch=8))
    cm = ComputeModel(catalog.device("cpu"), _profile(gemm=rows))
    assert cm.batched_gemm_time_s(24, 256, 256, 64, "float32") == pytest.approx(3e-3)  # exact shape, 3× batch
    # (512, 512, 64) sits midway (in log2 shape) between the two (s, s, 64) rows and far from (512, 64, 512):
    rate_lo, rate_hi = 8 * 2 * 256 * 256 * 64 / 1e-3, 8 * 2 * 1024 * 1024 * 64 / 64e-3
    rate_far = 8 * 2 * 512 * 64 * 512 / 1e-3
    w_near, w_far = 1 / 2**2, 1 / (3**2 + 3**2) ** 2  # 1/d⁴ with d = √2 and √18
    rate = math.exp((w_near * (math.log(rate_lo) + math.log(rate_hi)) + w_far * math.log(rate_far))
                    / (2 * w_near + w_far))
    assert cm.batched_gemm_time_s(8, 512, 512, 64, "float32") == pytest.approx(8 * 2 * 512 * 512 * 64 / rate)
    # without a batched table: one GEMM kernel doing all the heads' work
    plain = ComputeModel(A100)
    assert plain.batched_gemm_time_s(32, 512, 512, 128) == pytest.approx(
        plain.op_time_s(2 * 32 * 512 * 512 * 128, 2 * 32 * (512 * 128 * 2 + 512 * 512)))


def test_memory_rate_is_read_at_the_tensor_size():
    """Rates at 16 and 64 MiB tensors: a 32 MiB tensor gets their geometric mean, applied to its traffic."""
    ew = (ElementwiseSample(op="exp", dtype="float32", n_bytes=2 * 2**24, time_s=2 * 2**24 / 12e9,
                            tensor_bytes=2**24),
          ElementwiseSample(op="exp", dtype="float32", n_bytes=2 * 2**26, time_s=2 * 2**26 / 3e9,
                            tensor_bytes=2**26))
    cm = ComputeModel(catalog.device("cpu"), _profile(elementwise=ew))
    launch = 2e-6  # added: this profile has no GEMM table, so its times are not taken as complete
    assert cm.op_time_s(0, 5 * 2**25, "float32", kind="transcendental", tensor_bytes=2**25) == \
        pytest.approx(5 * 2**25 / 6e9 + launch)
    with pytest.raises(ValueError, match="kind='bogus'"):
        cm.op_time_s(0, 1, "float32", kind="bogus")


def test_optrace_batched_matmuls_strided_copies_and_two_pass_masked_fill():
    import torch

    from cost_models.optrace import trace_ops

    q = torch.randn(2, 8, 3, 16).transpose(1, 2)  # (b, h, s, d) from a (b, s, h, d) projection
    k = torch.randn(2, 3, 16, 8)
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)
    ops = trace_ops(lambda: (q.contiguous() @ k).masked_fill(mask, 0.0))
    copy = next(o for o in ops if o.name == "clone")
    assert copy.is_strided_copy and copy.kind == "copy"
    bmm = next(o for o in ops if o.name == "bmm")
    assert (bmm.gemm_batch, bmm.gemm_mnk) == (6, (8, 8, 16)) and bmm.flops == 2 * 6 * 8 * 8 * 16
    fill = next(o for o in ops if o.name == "masked_fill")
    one_pass = 4 * 2 * 3 * 8 * 8 * 2 + 8 * 8  # scores in + out (float32) and the (s, s) bool mask
    assert fill.bytes_moved == 2 * one_pass and fill.tensor_bytes == 4 * 2 * 3 * 8 * 8


def test_kernel_time_prices_a_kernel_as_the_op_by_op_model_prices_the_op():
    """kernel_time_s (the planner, per captured kernel) and the op-by-op model (optrace: op_time_s,
    batched_gemm_time_s, the GEMM table by layout) give one kernel the same time."""
    gemm = (GemmSample(m=256, n=256, k=256, dtype="float32", time_s=4e-4, layout="nt"),
            GemmSample(m=1024, n=1024, k=1024, dtype="float32", time_s=1.6e-2, layout="nt"),
            GemmSample(m=1024, n=1024, k=1024, dtype="float32", time_s=3.2e-2, layout="tn"),
            GemmSample(m=256, n=256, k=64, dtype="float32", time_s=1e-3, layout="nn", batch=8),
            GemmSample(m=1024, n=1024, k=64, dtype="float32", time_s=64e-3, layout="nn", batch=8))
    ew = tuple(ElementwiseSample(op=op, dtype="float32", n_bytes=n * 2**20, time_s=n * 2**20 / rate,
                                 tensor_bytes=2**20 * size) for op, n, rate, size in
               (("add", 3, 10e9, 1), ("add", 96, 5e9, 32), ("exp", 2, 4e9, 1), ("exp", 64, 2e9, 32)))
    cm = ComputeModel(catalog.device("cpu"), _profile(gemm=gemm, elementwise=ew))
    w = 2.0 * 1024**3
    assert cm.kernel_time_s("gemm", w, dtype="float32", layout="tn") == pytest.approx(3.2e-2)
    assert cm.kernel_time_s("gemm", w, dtype="float32", layout="nt") == pytest.approx(
        cm.gemm_time_s(1024, 1024, 1024, "float32", "nt"))
    attn = 24 * 2.0 * 512 * 512 * 64  # 24 matrices of (512, 512, 64)
    assert cm.kernel_time_s("attention", attn, dtype="float32", layout="nn", mnk=(512, 512, 64)) == \
        pytest.approx(cm.batched_gemm_time_s(24, 512, 512, 64, "float32", "nn"))
    assert cm.kernel_time_s("attention", 24 * 2.0 * 256 * 256 * 64, dtype="float32", layout="nn",
                            mnk=(256, 256, 64)) == pytest.approx(3e-3)
    for kind in ("elementwise", "transcendental"):
        got = cm.kernel_time_s(kind, 5 * 2**22, dtype="float32", tensor_bytes=2**22)
        assert got == pytest.approx(cm.op_time_s(0, 5 * 2**22, "float32", kind=kind, tensor_bytes=2**22))
    # the rate follows the tensor's size: many small kernels are not priced at their mean size
    small = 8 * cm.kernel_time_s("elementwise", 3 * 2**20, dtype="float32", tensor_bytes=2**20)
    assert small == pytest.approx(8 * 3 * 2**20 / 10e9)
    with pytest.raises(ValueError, match="kind='bogus'"):
        cm.kernel_time_s("bogus", 1.0, dtype="float32")


def test_gemm_and_attention_ceilings_follow_the_published_measurements_per_device():
    """MAMF (Bekman, ml-engineering): A100 SXM 271.2/312, H100 SXM 794.5/989; FlashAttention-2 forward +
    backward at 3.5 / (1/0.73 + 2.5/0.63) of an A100 (Dao 2023 §4.1's maxima) and 3.5 / (1/369.9 + 2.5/290.6)
    TFLOP/s of an H100's 989 (flash-attention PR #1791), each at the sustained fraction; a big GEMM reaches the
    device's own MAMF fraction."""
    h100 = catalog.device("h100-sxm-80gb")
    assert gemm_eff_max(A100) == pytest.approx(271.2 / 312, abs=1e-3)
    assert gemm_eff_max(h100) == pytest.approx(794.5 / 989, abs=1e-3)
    work = 1e13
    for dev, eff in ((A100, 3.5 / (1 / 0.73 + 2.5 / 0.63)), (h100, 3.5 / (1 / 369.9 + 2.5 / 290.6) / 989)):
        cm = ComputeModel(dev)
        peak = dev.peak_flops_for("bfloat16")
        t = cm.kernel_time_s("attention", work)
        # eff(W) = attention_eff · W / (W + W½) with W½ = peak · eff_max · ramp: W / (peak · eff) · (1 + W½ / W)
        s = sustained_fraction(dev)
        w_half = peak * gemm_eff_max(dev) * s * GPU_GEMM_RAMP_S
        assert t == pytest.approx(work / (peak * eff * s) * (1 + w_half / work) + GPU_LAUNCH_S, rel=2e-3)


def test_hopper_asynchronous_attention_kernels_run_at_their_measured_rate():
    """FlashAttention-3 on an H100 (tritonbench PRs #1254/#1256: forward 638.6, backward 561.4 TFLOP/s, head dim
    128, 8k): a device whose training runs it (attention_kernel="flash3", as Transformer Engine's cuDNN attention
    does) prices attention 3.5 / (1/638.6 + 2.5/561.4) / 989 of peak; an A100, which has no such kernel, keeps
    FlashAttention-2's rate."""
    h100 = catalog.device("h100-sxm-80gb")
    flash3 = dataclasses.replace(h100, attention_kernel="flash3")
    assert attention_eff(flash3) == pytest.approx(3.5 / (1 / 638.6 + 2.5 / 561.4) / 989, abs=1e-3)
    assert attention_eff(h100) == pytest.approx(3.5 / (1 / 369.9 + 2.5 / 290.6) / 989, abs=1e-3)
    assert attention_eff(dataclasses.replace(A100, attention_kernel="flash3")) == attention_eff(A100)
    work = 1e13
    ratio = ((ComputeModel(h100).kernel_time_s("attention", work) - GPU_LAUNCH_S)
             / (ComputeModel(flash3).kernel_time_s("attention", work) - GPU_LAUNCH_S))
    assert ratio == pytest.approx(attention_eff(flash3) / attention_eff(h100), rel=0.02)
    with pytest.raises(ValueError, match="attention_kernel"):
        dataclasses.replace(h100, attention_kernel="flash4")


def test_a_causal_fused_kernel_takes_the_measured_share_of_its_pass():
    """flash-attention PR #1791 (H100, head dim 128, 8k): causal forward 1.935 of 2.972 ms, backward 4.788 of
    9.460 ms, so a causal kernel of the same captured (full-matrix) FLOPs takes that share of the time; eager
    batched matmuls (mnk known) compute every tile and CPUs price their own measured kernels."""
    h100 = catalog.device("h100-sxm-80gb")
    cm = ComputeModel(h100)
    work = 1e13
    full = cm.kernel_time_s("attention", work) - GPU_LAUNCH_S
    fwd = cm.kernel_time_s("attention", work, causal=True) - GPU_LAUNCH_S
    bwd = cm.kernel_time_s("attention", work, causal=True, backward=True) - GPU_LAUNCH_S
    assert fwd / full == pytest.approx(1.935 / 2.972, abs=1e-3)
    assert bwd / full == pytest.approx(4.788 / 9.460, abs=1e-3)
    assert CAUSAL_TIME_FRACTION["forward"] > CAUSAL_TIME_FRACTION["backward"] > 0.5  # ≥ the computed half
    eager = cm.kernel_time_s("attention", work, mnk=(2048, 2048, 128), causal=True)
    assert eager == pytest.approx(cm.kernel_time_s("attention", work, mnk=(2048, 2048, 128)))


def test_the_sustained_fraction_scales_tensor_core_kernels_only():
    """A device's own sustained fraction overrides the fitted one: GEMMs and attention slow by it, memory-bound
    kernels (HBM bandwidth, not clocks) do not."""
    import dataclasses

    h100 = catalog.device("h100-sxm-80gb")
    full, half = (ComputeModel(dataclasses.replace(h100, sustained_fraction=f)) for f in (1.0, 0.5))
    big = 1e14
    assert half.kernel_time_s("gemm", big) == pytest.approx(2 * full.kernel_time_s("gemm", big), rel=1e-3)
    assert half.kernel_time_s("attention", big) == pytest.approx(2 * full.kernel_time_s("attention", big), rel=1e-3)
    assert half.kernel_time_s("elementwise", 1e9) == full.kernel_time_s("elementwise", 1e9)
    with pytest.raises(ValueError, match="sustained_fraction"):
        dataclasses.replace(h100, sustained_fraction=1.5)
