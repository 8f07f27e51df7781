"""Capture depends on the computation, not on how the model is written, and charges each op its kernel's bytes.

- By hand, op kind by op kind: a matmul reads its operands and writes its output; an elementwise op reads
  each input's distinct elements (a broadcast or expanded parameter once) and writes its output; views,
  `_unsafe_view` after a matmul, `detach` and metadata queries (`x.device`, `x.shape`, which fake tensors
  dispatch as `prim.device` / `aten.sym_size`) run no kernel and are charged nothing. The fx path and the
  torch.export fallback give the same numbers.
- Pairs of equivalent models written in different styles (tests/own_models.py against autopar's zoo): fused
  q|k|v against separate projections, a ModuleDict against attributes, complex against real rotary tables,
  export-only against fx-traceable code. Per block: FLOPs equal, bytes of the memory-bound kernels and saved
  activations within 2%, the priced block time within 2%, and the planner picks the same layout.
"""

from __future__ import annotations

import pytest
import torch
from own_models import MetaLlama, NanoGPT, TargetArgLM
from torch import nn

import autopar
from autopar import Cluster

H, B, S = 16, 2, 8


class _Probe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H, bias=False)
        self.scale = nn.Parameter(torch.ones(H))

    def forward(self, x):
        dev, dt = x.device, x.dtype  # metadata queries
        b, t, h = x.shape
        y = self.lin(x).view(b * t, h).view(b, t, h)  # mm (+ t, view, _unsafe_view: views)
        z = y * self.scale  # broadcast parameter: read once
        e = self.scale.expand(b, t, h)  # a view
        return (z + e + z.detach()).to(dev, dt)  # detach: a view; .to the same device and dtype: nothing


class _FxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Probe()])

    def forward(self, x):
        return self.blocks[0](x)


class _ExportOnlyNet(_FxNet):
    def forward(self, x):
        if x.shape[1] == 0:  # Python control flow on a shape: fx cannot trace it, torch.export can
            raise ValueError("empty sequence")
        return self.blocks[0](x)


@pytest.mark.parametrize("cls, method", [(_FxNet, "symbolic_trace"), (_ExportOnlyNet, "export")])
def test_each_op_is_charged_its_kernels_bytes(cls, method):
    graph = autopar.capture(cls(), (torch.randn(B, S, H),))
    assert graph.capture_method == method
    layer = graph.layer("blocks.0")
    act, param, w = B * S * H * 4, H * 4, H * H * 4  # fp32 bytes: activation, scale, weight
    mm_read, mm_write = act + w, act
    mul_read, mul_write = act + param, act  # y * scale
    add1_read, add1_write = act + param, act  # z + scale.expand(...): the expanded scale's H elements
    add2_read, add2_write = 2 * act, act  # (...) + z.detach()
    assert layer.bytes_read * B == mm_read + mul_read + add1_read + add2_read
    assert layer.bytes_written * B == mm_write + mul_write + add1_write + add2_write
    memory_bound = mul_read + mul_write + add1_read + add1_write + add2_read + add2_write
    assert layer.kernels_forward.memory_bytes * B == memory_bound
    assert layer.kernels_forward.memory_count == 3 and layer.kernels_forward.gemm_count == 1


D, HEADS, SEQ, VOCAB, LAYERS = 2048, 16, 2048, 32000, 2


def _meta(cls, **kw) -> nn.Module:
    with torch.device("meta"):
        return cls(dim=D, n_layers=LAYERS, n_heads=HEADS, vocab=VOCAB, seq=SEQ, **kw).to(torch.bfloat16)


def _zoo(name: str, **kw) -> nn.Module:
    model, _ = autopar.zoo.build(name, seq_len=SEQ, n_layers=LAYERS, hidden_size=D, n_heads=HEADS, vocab_size=VOCAB,
                                 **kw)
    return model.to(torch.bfloat16)


PAIRS = {
    # nanoGPT idiom (ModuleDict, fused q|k|v split in forward, positions added at top level) vs the zoo's GPT
    "fused_qkv_moduledict": (lambda: _zoo("gpt-tiny", dropout=0.0, max_seq_len=SEQ),
                             lambda: _meta(NanoGPT, tie=False)),  # captured with targets, as it trains
    # Meta's reference idiom (complex rotary tables, repeat_kv by expand, shape unpacking: export only)
    "complex_rotary_export": (lambda: _zoo("llama-tiny", n_kv_heads=HEADS // 2, ffn_hidden_size=3 * D,
                                           max_seq_len=2 * SEQ), lambda: _meta(MetaLlama)),
    # rotary tables passed into the blocks, blocks in a ModuleList under an attribute, GQA by SDPA's enable_gqa
    "nested_rotary_args": (lambda: _zoo("llama-tiny", n_kv_heads=HEADS // 2, ffn_hidden_size=3 * D,
                                        max_seq_len=2 * SEQ), lambda: _meta(TargetArgLM)),
}


def _block(graph):
    return next(la for la in graph.layers if la.kind == "block")


@pytest.mark.parametrize("pair", list(PAIRS))
def test_equivalent_models_written_differently_capture_and_plan_alike(pair):
    x = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    a, b = (autopar.capture(m, (x,), {"targets": x} if isinstance(m, NanoGPT) else None)
            for m in (build() for build in PAIRS[pair]))
    ba, bb = _block(a), _block(b)
    assert [la.kind for la in a.layers if la.kind == "block"] == [la.kind for la in b.layers if la.kind == "block"]
    assert bb.forward_flops == pytest.approx(ba.forward_flops, rel=1e-9)
    assert bb.backward_flops == pytest.approx(ba.backward_flops, rel=1e-9)
    assert bb.num_params == ba.num_params

    def memory_bytes(layer):
        return layer.kernels_forward.memory_bytes + layer.kernels_backward.memory_bytes

    assert memory_bytes(bb) == pytest.approx(memory_bytes(ba), rel=0.02)
    assert bb.saved_activation_bytes == pytest.approx(ba.saved_activation_bytes, rel=0.02)
    pa, pb = (autopar.plan(g, Cluster.preset("dgx-h100", nodes=1), global_batch_size=64) for g in (a, b))
    assert pa.config == pb.config


def test_a_block_applied_at_every_depth_is_priced_per_call_and_never_cut_between_its_calls():
    """LoopedLM (tests/own_models_reuse.py) applies `shared` at every depth between blocks of its own: capture
    counts every call's FLOPs and keeps `shared` and the blocks its calls interleave with in one layer, so every
    cut the planner can place runs the units in call order (codegen's DataFlow check: it refused the plan the
    planner made when each of those blocks was a layer of its own)."""
    from own_models_reuse import DIM, LAYERS, SEQ, LoopedLM

    from autopar.codegen.dataflow import trace_dataflow
    from autopar.codegen.pipeline import layer_modules

    model, x = LoopedLM(), torch.zeros(1, SEQ, dtype=torch.long)
    graph = autopar.capture(model, (x,))
    (layer,) = [la for la in graph.layers if "shared.1" in la.modules]
    assert {f"own.{d}.{i}" for d in range(LAYERS) for i in (1, 3)} <= set(layer.modules)  # the last own follows
    # forward matmul FLOPs, 2·tokens·in·out a linear a call: shared (DIM ↔ 4·DIM) at each of the LAYERS + 1 depths,
    # and the own blocks (DIM ↔ 2·DIM) its calls enclose
    assert layer.forward_flops == 2 * SEQ * ((LAYERS + 1) * 2 * DIM * 4 * DIM + LAYERS * 2 * DIM * 2 * DIM)
    units = [u for la in graph.layers for u in layer_modules(graph, la.name)]
    flow = trace_dataflow(model, units, (x,))
    for pp in (2, 4):
        plan = autopar.plan(graph, Cluster.preset("dgx-a100-80gb", nodes=1), global_batch_size=64,
                            options=autopar.PlannerOptions(pp=pp))
        stage_of = {u: s for s, st in enumerate(plan.stages) for name in st.layers
                    for u in layer_modules(graph, name)}
        flow.stages(stage_of, pp)  # raises PlanMismatchError on a cut between calls of one unit


def test_each_call_of_the_models_own_checkpoint_is_one_layer():
    """CheckpointedLM calls each block (norm, two linears, an activation: four units) under its own
    torch.utils.checkpoint, whose backward replays the block on the stage that runs it: capture keeps each
    checkpointed call in one layer (fx traces through the checkpoint under its saved-tensor hooks)."""
    from own_models_reuse import LAYERS, SEQ, CheckpointedLM

    model = CheckpointedLM()
    graph = autopar.capture(model, (torch.zeros(1, SEQ, dtype=torch.long),))
    assert [la.modules for la in graph.layers] == [("embed",), *[tuple(f"blocks.{d}.{i}" for i in range(4))
                                                                 for d in range(LAYERS + 1)], ("head",)]


def test_parameter_lists_are_read_where_used_and_a_vocabulary_wide_projection_per_depth_is_no_head():
    """ParamListLM indexes weights in `nn.ParameterList`s from its forward (never calling them): they belong to
    no layer, and every stage that reads them holds them (a ParameterList taken for a layer was left sharded
    under ZeRO-3 and replaced by a stand-in on the other pipeline stage). GatedScanLM's gate projections are
    2·DIM = VOCAB wide, one per depth: a stack of projections, not the LM head (they were priced and sharded as
    vocab-parallel heads, and tp2 failed on the chunk of a sharded output)."""
    from own_models_reuse import LAYERS, SEQ, GatedScanLM, ParamListLM

    x = torch.zeros(1, SEQ, dtype=torch.long)
    graph = autopar.capture(ParamListLM(), (x,))
    assert not any(m.startswith(("w_in", "w_out")) for la in graph.layers for m in la.modules)
    assert sorted(n for sp in graph.shared_params for n in sp.names) == sorted(
        f"{w}.{i}" for w in ("w_in", "w_out") for i in range(LAYERS))
    graph = autopar.capture(GatedScanLM(), (x,))
    heads = [la.name for la in graph.layers if any(p.kind == "lm_head" for p in la.tp_patterns)]
    assert heads == ["head"] and [la.name for la in graph.layers if la.kind == "head"] == ["head"]
