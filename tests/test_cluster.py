"""autopar.Cluster: presets, cluster files (TOML/JSON) with explained errors, local(), round trips."""

import json

import pytest

from autopar import Cluster, ClusterSpecError, ProfileMismatchError
from cost_models import catalog
from cost_models.profile import CollectiveSample, GemmSample, Profile
from cost_models.profiler import machine_info

REQUIRED = ["dgx-a100-40gb", "dgx-a100-80gb", "dgx-h100", "dgx-h200", "hgx-b200", "pcie-a100-8x", "pcie-h100-8x"]


def test_presets_build_and_round_trip():
    assert set(REQUIRED) <= set(Cluster.presets())
    for name in Cluster.presets():
        c = Cluster.preset(name, nodes=4)
        assert c.world_size == 32 and c.backend == "nccl"
        back = Cluster.from_dict(json.loads(json.dumps(c.to_dict())))
        assert back == c and back.fingerprint == c.fingerprint
    c = Cluster.preset("dgx-a100-80gb", nodes=128)
    assert c.world_size == 1024
    assert c.device.peak_flops_for("bfloat16") == pytest.approx(312e12)
    assert repr(c) == "Cluster(dgx-a100-80gb: 128x8 a100-sxm-80gb, nvlink3-nvswitch | ib-hdr, nccl)"


def test_fingerprint_changes_with_anything_that_changes_cost():
    a = Cluster.preset("dgx-h100", nodes=2)
    assert a.fingerprint != Cluster.preset("dgx-h100", nodes=4).fingerprint
    assert a.fingerprint != Cluster.preset("dgx-h200", nodes=2).fingerprint


def test_models_come_from_the_cluster():
    c = Cluster.preset("dgx-h100", nodes=2)
    topo = c.topology()
    assert topo.devices_per_node == 8 and topo.intra.name == "nvlink4-nvswitch"
    comm = c.comm_model()
    assert comm.all_reduce_time_s(1e9, 8) < comm.all_reduce_time_s(1e9, 16, 8)
    assert c.compute_model().gemm_time_s(8192, 8192, 8192) > 2 * 8192**3 / 989e12


def test_unknown_preset_lists_the_names():
    with pytest.raises(ClusterSpecError, match="dgx-h100"):
        Cluster.preset("dgx-h1000")
    with pytest.raises(ClusterSpecError, match="nodes=0"):
        Cluster.preset("dgx-h100", nodes=0)


DESIGN_EXAMPLE = """
name = "my-cluster"
nodes = 4
devices_per_node = 8
device = "h100-sxm-80gb"
[intra_node]
bandwidth_GBps = 450
latency_us = 3
[inter_node]
bandwidth_GBps = 50
latency_us = 6
"""


def test_design_md_cluster_file_toml_and_json(tmp_path):
    toml_path = tmp_path / "cluster.toml"
    toml_path.write_text(DESIGN_EXAMPLE)
    c = Cluster.from_file(toml_path)
    assert (c.name, c.nodes, c.devices_per_node, c.world_size) == ("my-cluster", 4, 8, 32)
    assert c.intra_node.bandwidth_Bps == pytest.approx(450e9) and c.intra_node.latency_s == pytest.approx(3e-6)
    assert c.inter_node.bandwidth_Bps == pytest.approx(50e9)
    json_path = tmp_path / "cluster.json"
    json_path.write_text(json.dumps({"name": "j", "nodes": 2, "devices_per_node": 4,
                                     "device": {"name": "mygpu", "memory_GiB": 24, "memory_bandwidth_GBps": 1000,
                                                "peak_TFLOPs": {"bfloat16": 165}},
                                     "intra_node": "pcie4-x16", "inter_node": "roce-100g"}))
    j = Cluster.from_file(json_path)
    assert j.device.peak_flops_for("bfloat16") == pytest.approx(165e12) and j.device.memory_bytes == 24 * 2**30
    assert j.intra_node == catalog.link("pcie4-x16")


@pytest.mark.parametrize("edit,match", [
    (lambda s: s.replace('device = "h100-sxm-80gb"', 'device = "h100"'), r"device = 'h100'.*h100-sxm-80gb"),
    (lambda s: s.replace("nodes = 4", 'nodes = "four"'), r"'nodes' = 'four' must be a positive integer"),
    (lambda s: s.replace("nodes = 4\n", ""), r"missing field 'nodes'"),
    (lambda s: 'backend = "mpi"\n' + s, r"backend = 'mpi'; accepted values: nccl, gloo"),
    (lambda s: s + 'backend = "nccl"\n', r"\[inter_node\] has unknown field\(s\) \['backend'\]"),
    (lambda s: s.replace("devices_per_node", "gpus_per_node"), r"unknown field\(s\) \['gpus_per_node'\]"),
    (lambda s: s.replace("bandwidth_GBps = 50", "bw = 50"), r"\[inter_node\].*bandwidth_GBps"),
    (lambda s: s.replace("[inter_node]", "[inter_node\n"), r"not valid toml"),
])
def test_bad_cluster_files_name_the_field_and_accepted_values(tmp_path, edit, match):
    path = tmp_path / "bad.toml"
    path.write_text(edit(DESIGN_EXAMPLE))
    with pytest.raises(ClusterSpecError, match=match):
        Cluster.from_file(path)


def test_missing_file():
    with pytest.raises(ClusterSpecError, match="cannot read cluster file"):
        Cluster.from_file("/nonexistent/cluster.toml")


def _local_profile(**kw):

    import torch

    base = dict(machine=machine_info(),  # this machine: the profile describes it
                device_name="cpu", device_kind="cpu", device_count=2, torch_version=torch.__version__,
                created="2026-01-01T00:00:00+00:00", backend="gloo", threads_per_process=2, launch_overhead_s=2e-6,
                gemm=(GemmSample(m=1024, n=1024, k=1024, dtype="float32", time_s=2 * 1024**3 / 300e9),),
                collectives=tuple(CollectiveSample(op="all_reduce", group_size=g, n_bytes=n,
                                                   time_s=2 * (g - 1) * 1e-4 + 2 * (g - 1) / g * n / 1e9)
                                  for g in (2, 4) for n in (1024, 2**20, 2**24)))
    return Profile(**{**base, **kw})


def test_local_cpu_uses_the_profile(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert Cluster.local().world_size == 1
    c = Cluster.local(nproc=4, profile=_local_profile())
    assert c.backend == "gloo" and c.world_size == 4 and c.device.kind == "cpu"
    assert c.device.memory_bytes == machine_info().ram_bytes // 4  # a fair share of this machine's RAM
    # profiled at 300 GFLOP/s with 2 threads on 2 cores; each of 4 processes gets half a core: 4x slower
    assert c.device.peak_flops_for("float32") == pytest.approx(300e9 / 4)
    assert c.intra_node.latency_s == pytest.approx(1e-4) and c.intra_node.bandwidth_Bps == pytest.approx(1e9)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert Cluster.local().world_size == 2


def test_local_refuses_a_foreign_profile(tmp_path):
    path = tmp_path / "p.json"
    _local_profile(torch_version="1.0.0").save(path)
    with pytest.raises(ProfileMismatchError, match="torch 1.0.0"):
        Cluster.local(profile=path)
    with pytest.raises(ProfileMismatchError, match="cannot price 'h100-sxm-80gb'"):
        Cluster.preset("dgx-h100", profile=_local_profile())
