"""FP8 and offload in the planner: against published ratios, against what codegen runs, and their refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from parity_models import build_model, graph_of

import autopar
from autopar import Cluster, ParallelConfig, PlannerOptions
from autopar.cli.main import main
from autopar.codegen.float8 import float8_linear_names
from autopar.codegen.offload import HostOptimizer
from autopar.errors import ClusterSpecError, InfeasiblePlanError
from autopar.planner.compute_costs import ADAM_BYTES_PER_PARAM
from autopar.planner.costs import CostModel
from autopar.planner.fp8_costs import cast_work, fp8_param_share
from cost_models import catalog, offload, precision

# torchao/float8/README.md, "e2e training benchmarks", NVIDIA H100: torchtitan Llama3-8b on 8xH100, batch 1, seq 8192,
# torch.compile, FSDP2, per-op SAC: bf16 6150 tokens/s, tensorwise with float8 all-gather 7689.5, rowwise 6768
PUBLISHED_8B = {"tensorwise": 7689.5 / 6150, "rowwise": 6768 / 6150}


@pytest.fixture(scope="module")
def llama8b():
    model, x = autopar.zoo.build("llama3-8b", seq_len=8192)
    return autopar.capture(model, x)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_llama3_8b_fp8_speedup_on_one_dgx_h100_is_the_published_one(llama8b, recipe):
    cluster = Cluster.preset("dgx-h100", nodes=1)
    bf16 = autopar.plan(llama8b, cluster, global_batch_size=8, options=PlannerOptions(offload="none", top_k=0))
    fp8 = autopar.estimate(llama8b, cluster, dataclasses.replace(bf16.config, fp8=recipe))
    ratio = bf16.estimate.step_time_s / fp8.step_time_s
    assert ratio == pytest.approx(PUBLISHED_8B[recipe], rel=0.10), (recipe, ratio)


# The same table's step times (8,192 tokens per GPU at its tokens/s), run by its author on torchtitan as his
# torchtitan benchmarks of the same months: Grand Teton H100 96 GB HBM2e at 500 W (torchtitan
# benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, §Hardware)
PUBLISHED_8B_STEP_S = {"none": 8192 / 6150, "tensorwise": 8192 / 7689.5, "rowwise": 8192 / 6768}


def test_torchao_table_layout_on_its_part_prices_its_step_times_and_the_rowwise_speedup(llama8b):
    cluster = Cluster.preset("dgx-h100", nodes=1)
    cluster = dataclasses.replace(cluster, device=catalog.device("h100-sxm-96gb-500w"))
    step = {}
    for recipe in PUBLISHED_8B_STEP_S:
        cfg = ParallelConfig(dp=8, zero_stage=3, micro_batch_size=1, num_microbatches=1, recompute="op_sac",
                             compile=True, fp8=recipe)
        step[recipe] = autopar.estimate(llama8b, cluster, cfg, options=PlannerOptions(fp8=recipe)).step_time_s
        assert step[recipe] == pytest.approx(PUBLISHED_8B_STEP_S[recipe], rel=0.12), (recipe, step[recipe])
    # rowwise's backward GEMMs run cuBLAS plus a rescale of their outputs (fp8_costs): its speedup stays
    # within 10% of the published 1.10x (1.19x, +8.2%, at the sustained fraction refitted to 108 runs, 0.785;
    # it was priced at 1.26x, +14.5%, before that rescale and on the 700 W part)
    assert step["none"] / step["rowwise"] == pytest.approx(PUBLISHED_8B["rowwise"], rel=0.10)


def test_fp8_is_refused_on_a_device_without_fp8_tensor_cores():
    model, x = autopar.zoo.build("gpt-tiny", seq_len=128)
    with pytest.raises(InfeasiblePlanError, match="FP8 tensor cores.*a100"):
        autopar.plan(autopar.capture(model, x), Cluster.preset("dgx-a100-80gb"), global_batch_size=8,
                     options=PlannerOptions(fp8="rowwise"))


def test_llama3_70b_on_one_dgx_h100_fits_only_with_offload(capsys):
    args = ["plan", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch-size", "16",
            "--seq-len", "8192", "--top", "0"]
    assert main([*args, "--offload", "none"]) == 1
    err = capsys.readouterr().err
    assert "no layout of llama3-70b fits" in err and "GiB per device" in err and "--offload auto" in err
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "offload=" in out and "host↔device copies" in out and "GiB per node" in out and "CPU Adam" in out


def test_the_converted_linears_are_the_ones_priced():
    """Weight elements and activation traffic of the linears codegen converts, from their modules, against what
    the planner derives from the captured graph's GEMMs (one side of each transformer linear is the width)."""
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    names = set(float8_linear_names(model, graph, tp=1))
    linears = [m for n, m in model.named_modules() if n in names]
    block = next(la for la in graph.layers if la.kind == "block")
    per_block = [m for m in linears if m in set(dict(model.named_modules())[block.name].modules())]
    assert fp8_param_share(block, graph) * block.num_params == pytest.approx(
        sum(m.weight.numel() for m in per_block), rel=1e-9)
    tokens = 4 * graph.seq_len  # a micro-batch of 4
    work = cast_work(block, graph, recipe="rowwise", elem_bytes=4, micro_batch=4, tp=1, compiled=False,
                     weights_gathered_fp8=False, dp=1)
    # eager rowwise forward: input and weight each read for the amax, read again and written in 1 byte
    assert work.forward_bytes == pytest.approx(
        sum(9 * (tokens * m.in_features + m.weight.numel()) for m in per_block), rel=1e-9)
    assert work.forward_kernels == 4 * len(per_block)


def test_host_optimizer_holds_what_the_planner_charges():
    model = build_model("gpt")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    opt = HostOptimizer(named, lambda masters: torch.optim.AdamW(masters, lr=1e-3))
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    held = sum(m.numel() * m.element_size() + m.grad.numel() * m.grad.element_size()
               + sum(t.numel() * t.element_size() for t in opt.state[m].values() if t.dim() > 0)
               for m in opt.masters)
    costs = CostModel.for_cluster(graph_of("gpt", model), Cluster.local(nproc=1))
    n = sum(p.numel() for p in params)
    assert costs.memory.host_state_bytes(n, 0, 1, "optimizer") == held


def test_offload_time_is_the_host_step_and_its_copies():
    model, x = autopar.zoo.build("llama3-8b", seq_len=4096)
    graph = autopar.capture(model, x)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    cfg = ParallelConfig(dp=8, zero_stage=1, micro_batch_size=1, num_microbatches=1, recompute="full")
    plain = autopar.estimate(graph, cluster, cfg)
    off = autopar.estimate(graph, cluster, dataclasses.replace(cfg, offload="optimizer"))
    stepped = graph.num_params / 8  # ZeRO-1: each rank steps an eighth
    host = cluster.host
    adam = offload.host_adam_s(graph.num_params, host, ADAM_BYTES_PER_PARAM)  # torch's AdamW, on the host
    # bf16 policy: the device holds fp32 masters and fp32 gradients, so both cross as 4 bytes and need no cast
    pol = precision.policy(cfg.precision)
    assert pol.weight_bytes == pol.grad_bytes == 4
    copies = 2 * offload.host_copy_s(stepped * pol.weight_bytes, 8, host)
    assert off.breakdown["optimizer"] == pytest.approx(adam + copies, rel=0.02)
    # without offload ZeRO-1 under bf16 is the distributed optimizer (autopar.codegen.dist_optimizer): 16-bit
    # parameters, fp32 main gradients, fp32 masters and moments ÷ dp on the device; offloaded, the device keeps
    # fp32 parameters (the host steps them), their 16-bit casts and fp32 gradients, so offload costs the device
    # 4 − 12/8 bytes a parameter more here
    n = graph.num_params
    assert off.peak_memory_bytes - plain.peak_memory_bytes == pytest.approx(
        (pol.weight_bytes - (pol.weight_bytes + pol.optimizer_bytes) / 8) * n, rel=0.02)
    # under ZeRO-0 what leaves the device is Adam's two fp32 moments of every parameter (the masters are its weights)
    zero0 = dataclasses.replace(cfg, zero_stage=0)
    kept = autopar.estimate(graph, cluster, zero0).peak_memory_bytes
    moved = autopar.estimate(graph, cluster, dataclasses.replace(zero0, offload="optimizer")).peak_memory_bytes
    assert kept - moved == pytest.approx(pol.optimizer_bytes * n, rel=0.02)


def test_cluster_files_describe_their_host(tmp_path):
    base = 'nodes = 1\ndevices_per_node = 8\ndevice = "h100-sxm-80gb"\nintra_node = "nvlink4-nvswitch"\n'
    (tmp_path / "c.toml").write_text(base + '[host]\nmemory_GiB = 1024\nmemory_bandwidth_GBps = 300\n'
                                     'cpu_cores = 64\ndevice_link = "pcie5-x16"\n')
    c = Cluster.from_file(tmp_path / "c.toml")
    assert c.host.memory_bytes == 1024 * 2**30 and c.host.device_link.name == "pcie5-x16"
    assert Cluster.from_dict(c.to_dict()) == c
    (tmp_path / "bad.toml").write_text(base + '[host]\nmemory_GiB = 1024\n')
    with pytest.raises(ClusterSpecError, match=r"\[host\] lacks"):
        Cluster.from_file(tmp_path / "bad.toml")
    (tmp_path / "none.toml").write_text(base)
    model, x = autopar.zoo.build("gpt-tiny", seq_len=128)
    with pytest.raises(InfeasiblePlanError, match=r"\[host\] table"):
        autopar.plan(autopar.capture(model, x), Cluster.from_file(tmp_path / "none.toml"), global_batch_size=8,
                     options=PlannerOptions(offload="optimizer"))
