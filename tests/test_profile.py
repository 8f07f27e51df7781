"""Profile format, mismatch detection, and the profiler pipeline (kept small and fast here; the full
sweep is `autopar profile --quick`, timed in the README)."""

import argparse
import json

import pytest
import torch

from autopar.capture.graph import LayerSpec, ModelGraph
from autopar.errors import ProfileMismatchError
from autopar.profiling import layer_cases, load_local_profile
from autopar.zoo import build
from cost_models import catalog
from cost_models.compute import ComputeModel
from cost_models.profile import (
    CollectiveSample,
    ElementwiseSample,
    GemmSample,
    MachineInfo,
    Profile,
    ProfileMismatch,
    bus_bandwidth_factor,
    layer_key,
)
from cost_models.profiler import kernels, optimizer, profile_machine
from cost_models.profiler.collectives import measure_collectives


def _profile(**kw):
    base = dict(machine=MachineInfo(hostname="box", platform="Linux", processor="x86_64", cpu_count=2,
                                    ram_bytes=2**34),
                device_name="cpu", device_kind="cpu", device_count=2, torch_version="2.13.0+cpu",
                created="2026-01-01T00:00:00+00:00", backend="gloo", threads_per_process=2, launch_overhead_s=3e-6,
                gemm=(GemmSample(m=64, n=64, k=64, dtype="float32", time_s=1e-5, layout="tn"),),
                elementwise=(ElementwiseSample(op="add", dtype="float32", n_bytes=3072, time_s=2e-6),),
                collectives=(CollectiveSample(op="all_reduce", group_size=4, n_bytes=2**20, time_s=1e-3),),
                layer_times={layer_key("abc", "fwd", 2): 0.01})
    return Profile(**{**base, **kw})


def test_json_round_trip(tmp_path):
    p = _profile()
    p.save(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back == p and back.fingerprint == p.fingerprint
    assert json.loads((tmp_path / "p.json").read_text())["schema_version"] == 1


def test_files_without_batch_or_tensor_bytes_still_load(tmp_path):
    """Fields added later (GemmSample.batch, ElementwiseSample.tensor_bytes) default to the old meaning."""
    d = _profile().to_dict()
    for g in d["gemm"]:
        del g["batch"]
    for e in d["elementwise"]:
        del e["tensor_bytes"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    back = Profile.load(tmp_path / "old.json")
    assert back == _profile() and back.gemm[0].batch == 1 and back.elementwise[0].tensor_bytes == 0


def test_bus_bandwidth_as_nccl_tests_defines_it():
    s = CollectiveSample(op="all_reduce", group_size=4, n_bytes=2**20, time_s=1e-3)
    assert s.algbw_Bps == pytest.approx(2**20 / 1e-3)
    assert s.busbw_Bps == pytest.approx(2**20 / 1e-3 * 2 * 3 / 4)
    assert bus_bandwidth_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert bus_bandwidth_factor("broadcast", 8) == 1.0


@pytest.mark.parametrize("kw,match", [
    (dict(device_name="NVIDIA H100 80GB HBM3"), "device 'cpu'"),
    (dict(torch_version="2.5.0"), "torch 2.13.0"),
    (dict(hostname="elsewhere"), "machine 'box'"),
    (dict(cpu_count=64), "CPUs"),
    (dict(processor="arm64-elsewhere"), "processor"),
])
def test_foreign_profiles_are_reported(kw, match):
    with pytest.raises(ProfileMismatch, match=match):
        _profile().check_matches(**kw)
    _profile().check_matches(device_name="cpu", torch_version="2.13.0+cpu", hostname="box")


def test_unreadable_or_old_profiles(tmp_path):
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({**_profile().to_dict(), "schema_version": 0}))
    with pytest.raises(ProfileMismatch, match="schema version 0"):
        Profile.load(bad)
    with pytest.raises(ProfileMismatch, match="cannot read profile"):
        Profile.load(tmp_path / "missing.json")
    with pytest.raises(ProfileMismatchError, match="Re-measure here"):
        load_local_profile(_save(_profile(), tmp_path / "foreign.json"))  # hostname "box" is not this machine


def _save(p, path):
    p.save(path)
    return path


def _gpt_tiny_graph():
    """A hand-written ModelGraph of gpt-tiny (capture is tested elsewhere); blocks share a signature."""
    def spec(name, kind, sig):
        return LayerSpec(name=name, kind=kind, signature=sig, modules=(name,), num_params=1, param_bytes=2,
                         forward_flops=1.0, backward_flops=2.0, forward_flops_tp_sharded=0.0, bytes_read=1,
                         bytes_written=1, input_bytes=1, saved_activation_bytes=1, saved_activation_bytes_tp_sharded=0,
                         saved_activation_bytes_attention_core=0, boundary_bytes=1)
    layers = [spec("embed", "embedding", "emb")] + [spec(f"blocks.{i}", "block", "blk") for i in range(4)] + \
        [spec("ln_f", "norm", "norm"), spec("lm_head", "head", "head")]
    return ModelGraph(model_name="gpt-tiny", layers=tuple(layers), dtype="bfloat16", seq_len=64,
                      example_batch_size=2, num_params=4)


def test_profile_machine_times_each_distinct_layer(monkeypatch):
    monkeypatch.setattr(kernels, "gemm_shapes", lambda quick: [(64, 64, 64), (128, 64, 32)])
    monkeypatch.setattr(kernels, "attention_shapes", lambda quick: [(32, 32, 16, "nt"), (32, 16, 32, "tn")])
    monkeypatch.setattr(kernels, "elementwise_sizes", lambda quick: [2**14, 2**16])
    monkeypatch.setattr(optimizer, "SWEEP", ((8, 8), (2, 2**10)))
    model, x = build("gpt-tiny", seq_len=64, batch_size=2)
    cases = layer_cases(model, x, _gpt_tiny_graph(), torch.device("cpu"))
    assert [c.signature for c in cases] == ["emb", "blk", "norm", "head"]
    messages = []
    prof = profile_machine(quick=True, layers=cases, dtypes=["float32"], progress=messages.append,
                           collectives=False, model_name="gpt-tiny")
    plain = prof.gemm_samples("float32")
    assert len(plain) == 6 and {g.layout for g in plain} == {"nn", "nt", "tn"}
    batched = prof.gemm_samples("float32", batched=True)
    assert [(g.m, g.n, g.k, g.layout, g.batch) for g in batched] == [(32, 32, 16, "nt", kernels.ATTENTION_BATCH),
                                                                      (32, 16, 32, "tn", kernels.ATTENTION_BATCH)]
    assert {e.op for e in prof.elementwise} == {"add", "exp", "sum", "transpose_copy"}
    assert {e.tensor_bytes for e in prof.elementwise} == {2**14, 2**16}
    for sig in ("blk", "head"):
        for phase in ("fwd", "bwd"):
            assert prof.layer_times[layer_key(sig, phase, 2)] > 0
    assert any("layer blocks.0" in m for m in messages) and messages[0].startswith("[1]")
    cm = ComputeModel(catalog.device("cpu"), prof)
    key = layer_key("blk", "fwd", 2)
    assert cm.op_time_s(1e12, 1e12, "float32", key=key) == prof.layer_times[key]
    assert Profile.from_dict(json.loads(prof.to_json())) == prof


@pytest.mark.multiproc
def test_gloo_collectives_over_two_processes():
    msgs = []
    samples = measure_collectives(2, backend="gloo", quick=True, progress=msgs.append, sizes=[1024, 2**18],
                                  plan=[("all_reduce", 2), ("p2p", 2)]).samples
    assert [(s.op, s.n_bytes) for s in samples] == [("all_reduce", 1024), ("all_reduce", 2**18), ("p2p", 1024),
                                                     ("p2p", 2**18)]
    assert all(0 < s.time_s < 5 for s in samples) and len(msgs) == 4 and "busbw" in msgs[0]


def test_profile_command_writes_a_profile(monkeypatch, tmp_path, capsys):
    from autopar.cli import cmd_profile

    monkeypatch.setattr(kernels, "gemm_shapes", lambda quick: [(32, 32, 32)])
    monkeypatch.setattr(kernels, "attention_shapes", lambda quick: [(32, 32, 16, "nn")])
    monkeypatch.setattr(kernels, "elementwise_sizes", lambda quick: [2**14])
    monkeypatch.setattr(optimizer, "SWEEP", ((8, 8), (2, 2**10)))
    parser = argparse.ArgumentParser()
    cmd_profile.register(parser.add_subparsers())
    args = parser.parse_args(["profile", "--quick", "--no-collectives", "--out", str(tmp_path / "p.json"), "--json"])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["gemm_peak_GFLOPs"]["float32"] > 0 and summary["device"] == "cpu"
    # the CPU kind and the optimizer's measured law are part of the profile and its summary
    assert summary["cpu"] and summary["optimizer"]["adamw_implementation"] == "for-loop"
    assert summary["optimizer"]["adamw_per_tensor_us"] > 0
    assert Profile.load(tmp_path / "p.json").device_kind == "cpu"


@pytest.mark.multiproc
def test_collectives_profile_in_a_process_that_holds_a_process_group():
    """A process that ran a one-process `parallelize` holds a default group; the profiler's forked workers
    inherit it and must start their own (they failed with "trying to initialize the default process group
    twice", which the suite met depending on which tests its worker had run)."""
    import torch.distributed as dist

    from cost_models.profiler.collectives import measure_collectives

    # An earlier test on this pytest worker may already have left a one-process group; hold one either way.
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world_size = dist.get_world_size()
    try:
        sweep = measure_collectives(2, backend="gloo", quick=True, progress=lambda _m: None, sizes=[1024, 4096],
                                    plan=[("all_reduce", 2)], budget_s=10.0)
        assert [s.n_bytes for s in sweep.samples if not s.extrapolated] == [1024, 4096]
        assert dist.is_initialized() and dist.get_world_size() == world_size  # the parent's group untouched
    finally:
        if owned:
            dist.destroy_process_group()
