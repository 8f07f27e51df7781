"""The optimizer phase as it runs: the profile records the CPU and times the optimizer's per-tensor loops,
the planner prices a rank's share from that law, and the gradient norm costs no per-parameter mesh work."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from dist_harness import run_distributed

import autopar
from autopar.cluster import Cluster
from autopar.config import ParallelConfig
from cost_models.optimizer_step import OptimizerLaws, fit_loop
from cost_models.profile import (
    CpuKind,
    ElementwiseSample,
    GemmSample,
    OptimizerSample,
    Profile,
    ProfileMismatch,
)
from cost_models.profiler import machine_info
from cost_models.profiler.cpu import cpu_kind, parse_cpuinfo
from cost_models.profiler.optimizer import measure_optimizer

# (per-tensor seconds, seconds per element) of each loop in the synthetic profile: one rate at every size
LAW = {"adamw": (50e-6, 10e-9), "grad_norm": (10e-6, 0.5e-9), "scale": (5e-6, 1e-9)}
SWEEP = ((64, 64), (16, 2**14), (4, 2**17))


def _samples() -> tuple[OptimizerSample, ...]:
    return tuple(OptimizerSample(kind=k, tensors=n, params=n * size, time_s=n * c + n * size * b,
                                 implementation="for-loop" if k == "adamw" else "")
                 for k, (c, b) in LAW.items() for n, size in SWEEP)


def _profile(**kw) -> Profile:
    gemm = tuple(GemmSample(m=n, n=n, k=n, dtype=dt, time_s=2.0 * n**3 / 5e10) for n in (64, 256, 1024)
                 for dt in ("float32", "float16"))  # float16 measured: an fp16 plan may be priced here
    elem = tuple(ElementwiseSample(op=op, dtype="float32", n_bytes=b, time_s=2e-6 + b / 1e10)
                 for op in ("add", "sum") for b in (2**12, 2**20, 2**26))
    base = dict(machine=machine_info(), device_name="cpu", device_kind="cpu", device_count=2,
                torch_version=torch.__version__, created="2026-01-01T00:00:00+00:00", backend="gloo",
                threads_per_process=1, launch_overhead_s=5e-6, gemm=gemm, elementwise=elem,
                process_slowdown={2: 1.5}, optimizer=_samples(), cpu=cpu_kind())  # this machine's
    return Profile(**{**base, **kw})


XEON = CpuKind(vendor="GenuineIntel", model_name="Intel(R) Xeon(R) Platinum 8480+",
               flags=("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"), torch_isa="AVX512")


def test_cpu_kind_and_optimizer_samples_round_trip_and_old_profiles_load(tmp_path):
    p = _profile(cpu=XEON)
    p.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back == p and back.cpu.flags == ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
    assert "Xeon" in back.cpu.describe() and "amx_bf16" in back.cpu.describe()
    old = p.to_dict()
    del old["cpu"], old["optimizer"]  # a file written before either was recorded
    (tmp_path / "old.json").write_text(json.dumps(old))
    back = Profile.load(tmp_path / "old.json")
    assert back.cpu is None and back.optimizer == () and OptimizerLaws.from_profile(back) is None


def test_a_profile_of_another_cpu_model_is_refused():
    p = _profile(cpu=XEON)
    p.check_matches(cpu_model="Intel(R) Xeon(R) Platinum 8480+")
    with pytest.raises(ProfileMismatch, match="CPU 'Intel.*here: 'AMD EPYC'"):
        p.check_matches(cpu_model="AMD EPYC")
    dataclasses.replace(p, cpu=None).check_matches(cpu_model="AMD EPYC")  # older files did not record it


def test_cpuinfo_names_vendor_model_and_the_flags_that_matter():
    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\n"
            "flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8 avx512_fp16\n\n"
            "processor\t: 1\nvendor_id\t: OtherVendor\n")
    assert parse_cpuinfo(text) == ("GenuineIntel", "Intel(R) Xeon(R) Platinum 8480+",
                                   ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16",
                                    "amx_int8"))


def test_law_is_per_tensor_cost_plus_elements_at_their_size():
    law = fit_loop([s for s in _samples() if s.kind == "adamw"])
    c, b = LAW["adamw"]
    assert law.per_tensor_s == pytest.approx(c + 64 * b)  # the tiny point: its 64 elements ride along
    for tensors, params in ((69, 1_088_256), (3, 10), (1, 2**22)):
        # each sweep point's elements take b less the tiny point's 64 elements per tensor counted in c
        assert law.time_s(tensors, params) == pytest.approx(tensors * (c + 64 * b) + params * b, rel=0.005)
    # the rate by tensor size: slow large tensors (DRAM) and fast small ones interpolate in log size
    two = [OptimizerSample(kind="adamw", tensors=64, params=64 * 64, time_s=64e-6),
           OptimizerSample(kind="adamw", tensors=4, params=4 * 2**10, time_s=4e-6 + 4 * 2**10 * 1e-9),
           OptimizerSample(kind="adamw", tensors=1, params=2**20, time_s=1e-6 + 2**20 * 4e-9)]
    law = fit_loop(two)
    assert law.seconds_per_param(2**15) == pytest.approx(2e-9, rel=1e-6)  # midway in log size: the geometric mean
    assert law.rate_Bps(2**20, 80) == pytest.approx(80 / 4e-9, rel=1e-6)


@pytest.fixture(scope="module")
def graph():
    model, x = autopar.zoo.build("gpt-tiny", seq_len=64, device="meta", dtype=torch.float32, dropout=0.0)
    return autopar.capture(model, x)


def test_planner_prices_a_ranks_optimizer_share_from_the_law(graph):
    """ZeRO-0 steps every tensor on every rank; ZeRO-1 whole tensors, half of them on each of 2 ranks, and
    copies every tensor for its broadcast; the gradient norm reads every local gradient either way. Times ×
    the profile's 2-process slowdown (1.5)."""
    tensors = graph.metadata["param_tensors"]
    assert sum(tensors.values()) == 69 == len(list(autopar.zoo.build("gpt-tiny", device="meta")[0].parameters()))
    prof = _profile()
    laws = OptimizerLaws.from_profile(prof)
    cluster = Cluster.local(nproc=2, profile=prof)
    for zero in (0, 1):
        cfg = ParallelConfig(dp=2, zero_stage=zero, micro_batch_size=2, num_microbatches=1)
        est = autopar.estimate(graph, cluster, cfg, global_batch_size=4)
        shards = 2 if zero else 1
        expected = 0.0
        for layer in graph.layers:
            n, p = tensors[layer.name], layer.num_params
            c_a, b_a = laws.laws["adamw"].per_tensor_s, laws.laws["adamw"].seconds_per_param(p / n)
            c_n, b_n = laws.laws["grad_norm"].per_tensor_s, laws.laws["grad_norm"].seconds_per_param(p / n)
            expected += (n / shards) * c_a + (p / shards) * b_a + n * c_n + p * b_n
            if zero == 1:  # the broadcast's pack and unpack: a copy of every held tensor
                expected += laws.time_s("scale", n, p)
        assert est.breakdown["optimizer"] == pytest.approx(1.5 * expected, rel=1e-9)
        if zero == 0:
            zero0 = est.breakdown["optimizer"]
    # the per-tensor cost does not halve with ZeRO-1's elements: more than half of ZeRO-0's step remains
    assert est.breakdown["optimizer"] > 0.5 * zero0
    # fp16 unscales every local gradient too
    fp16 = autopar.estimate(graph, cluster, dataclasses.replace(cfg, precision="fp16"), global_batch_size=4)
    scale = sum(laws.time_s("scale", tensors[la.name], la.num_params) for la in graph.layers)
    assert fp16.breakdown["optimizer"] == pytest.approx(est.breakdown["optimizer"] + 1.5 * scale, rel=1e-9)


def test_profiler_times_the_loops_on_a_sweep_and_the_models_shapes(monkeypatch):
    from cost_models.profiler import optimizer

    monkeypatch.setattr(optimizer, "SWEEP", ((8, 8), (2, 2**10)))
    messages = []
    samples = measure_optimizer(torch.device("cpu"), lambda m, _left: messages.append(m), budget_s=5.0,
                                model_shapes=[(16, 8), (16,), (4, 4)])
    kinds = [(s.kind, s.tensors, s.params, s.model_shapes) for s in samples]
    # the per-tensor point first, then by expected time; the model's shapes for adamw and the norm
    assert kinds == [("adamw", 8, 64, False), ("adamw", 2, 2**11, False), ("adamw", 3, 16 * 8 + 16 + 16, True),
                     ("grad_norm", 8, 64, False), ("grad_norm", 2, 2**11, False), ("grad_norm", 3, 160, True),
                     ("scale", 8, 64, False), ("scale", 2, 2**11, False)]
    # torch's own default on a CPU: its for-loop AdamW (foreach and fused are GPU defaults)
    assert {s.implementation for s in samples if s.kind == "adamw"} == {"for-loop"}
    assert all(s.time_s > 0 for s in samples) and len(messages) == len(samples)


def _norm_mesh_slices(n_params: int) -> tuple[float, float, int]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from autopar.codegen.clipping import global_grad_norm

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (1, 2, 1, 1), mesh_dim_names=("pp", "dp", "cp", "tp"))
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(n_params)]
    for p in params:
        p.grad = torch.randn(3)
    slices = [0]
    original = DeviceMesh.__getitem__

    def counting(self, key):
        slices[0] += 1
        return original(self, key)

    DeviceMesh.__getitem__ = counting
    try:
        norm = global_grad_norm(params, mesh)
    finally:
        DeviceMesh.__getitem__ = original
    reference = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])).item()
    return norm, reference, slices[0]


@pytest.mark.multiproc
def test_gradient_norm_slices_the_mesh_once_per_step_not_per_parameter():
    """A sub-mesh costs 0.1-0.3 ms to build on a CPU: per parameter and axis it was most of gpt-tiny's
    optimizer phase (34 ms on rank 0 where AdamW took 2.5 ms)."""
    for norm, reference, slices in run_distributed(_norm_mesh_slices, 2, 40):
        assert norm == pytest.approx(reference, rel=1e-6)  # replicated over dp: counted once
        assert slices == 0
