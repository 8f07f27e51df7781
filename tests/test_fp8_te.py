"""FP8 as Transformer Engine runs it (PlannerOptions.fp8_runtime = "transformer_engine"; autopar.planner.fp8_costs).

The cast traffic is checked against formulas written here from TE's module structure and the cited constants,
not read back from the implementation: per micro-batch of T tokens on one device, a standalone cast-transpose
reads each 16-bit element (2 bytes) and writes an FP8 copy and its transpose (1 byte each; MXFP8 adds one
E8M0 scale per 32 elements to each copy; current scaling reads the tensor once more for its amax). Delayed
scaling and MXFP8 fuse the casts of norm- and activation-fed inputs and of the activation's gradient; what
stays standalone is the attention output (T·heads·head_dim), the q/k/v outputs' gradient
(T·(heads + 2·kv)·head_dim) and the two row linears' output gradients (T·h each).
"""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import Cluster, ParallelConfig, PlannerOptions
from autopar.errors import ConfigError, InfeasiblePlanError
from autopar.planner.fp8_costs import te_cast_work, te_weight_cache_bytes, te_weight_cast_bytes

SEQ = 64
MBS = 2
CFG = autopar.zoo.config("llama-tiny")


@pytest.fixture(scope="module")
def graph():
    model, x = autopar.zoo.build("llama-tiny", seq_len=SEQ)
    return autopar.capture(model, x)


@pytest.fixture(scope="module")
def linear_params() -> float:
    """Weight elements of one block's nn.Linear modules, counted on the module itself."""
    model, _ = autopar.zoo.build("llama-tiny", seq_len=SEQ)
    return float(sum(m.weight.numel() for n, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear) and n.startswith("layers.0.")))


def _block(graph):
    return next(la for la in graph.layers if la.kind == "block")


def _widths() -> tuple[float, float, float, float, float]:
    h, heads, kv, ffn = CFG.hidden_size, CFG.n_heads, CFG.n_kv_heads, CFG.ffn_hidden_size
    hd = h // heads
    return float(h), float(heads * hd), float((heads + 2 * kv) * hd), float(ffn), float(MBS * SEQ)


@pytest.mark.parametrize("recipe,per_elem", [("delayed", 2.0 + 2.0), ("mxfp8", 2.0 + 2.0 * (1 + 1 / 32))])
def test_fused_recipes_price_the_standalone_cast_transposes(graph, recipe, per_elem):
    h, out_w, qkv_w, _, tokens = _widths()
    work = te_cast_work(_block(graph), graph, recipe=recipe, elem_bytes=2.0, micro_batch=MBS, tp=1, sp=False)
    assert work.forward_bytes == pytest.approx(tokens * out_w * per_elem, rel=1e-9)
    assert work.backward_bytes == pytest.approx(tokens * (qkv_w + 2 * h) * per_elem, rel=1e-9)
    assert (work.forward_kernels, work.backward_kernels, work.amax_allreduces) == (1, 3, 0)


def test_tp_and_sp_shard_what_each_rank_casts(graph):
    h, out_w, qkv_w, _, tokens = _widths()
    work = te_cast_work(_block(graph), graph, recipe="delayed", elem_bytes=2.0, micro_batch=MBS, tp=2, sp=True)
    assert work.forward_bytes == pytest.approx(tokens * out_w / 2 * 4.0, rel=1e-9)
    assert work.backward_bytes == pytest.approx(tokens * (qkv_w / 2 + 2 * h / 2) * 4.0, rel=1e-9)


def test_current_scaling_casts_every_operand_with_an_amax_pass(graph):
    h, out_w, qkv_w, ffn, tokens = _widths()
    per_elem = 2.0 * 2.0 + 2.0  # amax read, cast read, FP8 copy + transpose written
    work = te_cast_work(_block(graph), graph, recipe="tensorwise", elem_bytes=2.0, micro_batch=MBS, tp=1, sp=False)
    # inputs: attention's norm output, attention output, MLP's norm output, activation output
    assert work.forward_bytes == pytest.approx(tokens * (h + out_w + h + ffn) * per_elem, rel=1e-9)
    # output gradients: q/k/v, attention's row, the gated MLP's two column outputs, its row
    assert work.backward_bytes == pytest.approx(tokens * (qkv_w + h + 2 * ffn + h) * per_elem, rel=1e-9)
    assert (work.forward_kernels, work.backward_kernels) == (8, 8)


def test_weights_cast_once_per_step_and_cached(graph, linear_params):
    block = _block(graph)
    n_bytes, kernels = te_weight_cast_bytes(block, graph, recipe="delayed", elem_bytes=2.0, tp=1)
    assert n_bytes == pytest.approx(linear_params * 4.0, rel=1e-9) and kernels == 7
    assert te_weight_cache_bytes(block, graph, recipe="delayed", tp=1) == pytest.approx(2.0 * linear_params)
    assert te_weight_cache_bytes(block, graph, recipe="mxfp8", tp=1) == pytest.approx(
        2.0 * (1 + 1 / 32) * linear_params)
    head = next(la for la in graph.layers if la.kind == "head")
    assert te_weight_cache_bytes(head, graph, recipe="delayed", tp=1) == 0.0  # the head stays 16-bit


def test_option_validation_names_the_fix():
    with pytest.raises(ConfigError, match=r"fp8_runtime='te'.*'torchao', 'transformer_engine'"):
        PlannerOptions(fp8_runtime="te")
    with pytest.raises(ConfigError, match=r"fp8='delayed' is a transformer_engine recipe.*set "
                                          r"fp8_runtime='transformer_engine'"):
        PlannerOptions(fp8="delayed")
    with pytest.raises(ConfigError, match=r"fp8='rowwise' is a torchao recipe.*fp8_runtime='torchao'"):
        PlannerOptions(fp8="rowwise", fp8_runtime="transformer_engine")
    assert PlannerOptions().fp8_runtime == "torchao"  # what autopar's codegen runs


def _config(fp8: str) -> ParallelConfig:
    return ParallelConfig(dp=8, micro_batch_size=1, num_microbatches=2, fp8=fp8)


def test_mxfp8_refused_without_block_scaled_tensor_cores(graph):
    te = PlannerOptions(fp8_runtime="transformer_engine")
    with pytest.raises(InfeasiblePlanError, match=r"mxfp8.*h100-sxm-80gb lacks.*Blackwell.*'delayed'"):
        autopar.estimate(graph, Cluster.preset("dgx-h100"), _config("mxfp8"), options=te)
    b200 = Cluster.preset("hgx-b200")
    mx = autopar.estimate(graph, b200, _config("mxfp8"), options=te)
    assert mx.step_time_s > 0
    with pytest.raises(InfeasiblePlanError, match=r"fp8='delayed' is a transformer_engine recipe"):
        autopar.estimate(graph, b200, _config("delayed"))  # torchao, autopar's default runtime


def test_te_holds_its_weight_cache_and_torchao_does_not_price_its_casts(graph, linear_params):
    h100 = Cluster.preset("dgx-h100")
    te = autopar.estimate(graph, h100, _config("tensorwise"), options=PlannerOptions(fp8_runtime="transformer_engine"))
    ao = autopar.estimate(graph, h100, _config("tensorwise"))
    assert te.step_time_s != ao.step_time_s
    blocks = sum(la.kind == "block" for la in graph.layers)
    # TE holds every block's FP8 weight + transpose all step; torchao only the running layer's
    assert te.peak_memory_bytes - ao.peak_memory_bytes == pytest.approx(2.0 * linear_params * (blocks - 1), rel=0.05)
