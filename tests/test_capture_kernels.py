"""KernelMix: a layer's kernels by kind add up to the layer's measured totals, and split as the model says."""

from collections import Counter

import pytest
import torch

import autopar
from cost_models.optrace import trace_ops


@pytest.mark.parametrize("name, seq", [("gpt3-175b", 2048), ("llama3-8b", 4096), ("gpt-tiny", 128)])
def test_kernel_flops_add_up_to_the_layer_flops(name, seq):
    graph = autopar.capture(*autopar.zoo.build(name, seq_len=seq))
    for layer in graph.layers:
        passes = ((layer.kernels_forward, layer.forward_flops), (layer.kernels_backward, layer.backward_flops))
        for mix, total in passes:
            assert mix.gemm_flops + mix.attention_flops == pytest.approx(total, rel=1e-9, abs=1.0)
            assert mix.gemm_flops_tp_sharded <= mix.gemm_flops * (1 + 1e-9)
            # the kernel list is the same kernels one by one
            matmul = sum(k.count * k.work for k in mix.kernels if k.kind in ("gemm", "attention"))
            memory = sum(k.count * k.work for k in mix.kernels if k.kind not in ("gemm", "attention"))
            assert matmul == pytest.approx(total, rel=1e-9, abs=1.0)
            assert memory == pytest.approx(mix.memory_bytes, rel=1e-9, abs=1.0)
            assert sum(k.count for k in mix.kernels if k.kind not in ("gemm", "attention")) == mix.memory_count


def test_gpt_block_kernels_match_the_architecture():
    """GPT block, s tokens, hidden h: 6 weight GEMMs of 24·s·h² FLOPs in all (q, k, v, o: 2sh² each;
    fc, proj: 8sh² each); flash attention 4·s²·h; everything inside the TP patterns."""
    s, h = 2048, 12288
    block = autopar.capture(*autopar.zoo.build("gpt3-175b", seq_len=s)).layer("blocks.0")
    fwd = block.kernels_forward
    assert fwd.gemm_count == 6 and fwd.attention_count == 1
    assert fwd.gemm_flops == pytest.approx(24 * s * h * h, rel=1e-9)
    assert fwd.attention_flops == pytest.approx(4 * s * s * h, rel=1e-9)
    assert fwd.gemm_flops_tp_sharded == fwd.gemm_flops and fwd.attention_flops_tp_sharded == fwd.attention_flops
    # Backward: two GEMMs per forward GEMM (input and weight gradients) of the same size.
    assert block.kernels_backward.gemm_flops == pytest.approx(2 * fwd.gemm_flops, rel=1e-9)
    # Memory-bound kernels (2 LayerNorms, GELU, 2 residual adds, 2 dropouts) stream at least the
    # bytes of their bf16 inputs and outputs: ≥ 2 · 2 bytes · s·h each for the 7 of them.
    assert fwd.memory_count >= 7
    assert fwd.memory_bytes >= 7 * 2 * 2 * s * h


def test_eager_attention_is_two_matmuls_and_its_backward_four():
    graph = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=128, attn_impl="eager"))
    block = graph.layer("blocks.0")
    assert block.kernels_forward.attention_count == 2
    assert block.kernels_backward.attention_count == 4
    assert block.kernels_backward.attention_flops == pytest.approx(2 * block.kernels_forward.attention_flops)
    # what selective recompute runs again: QKᵀ, the scale, mask, softmax and dropout of the scores, and P·V
    core = [k for k in block.kernels_forward.kernels if k.attention_core]
    assert sum(k.count for k in core if k.kind == "attention") == 2
    assert {k.kind for k in core} == {"attention", "elementwise", "transcendental"}
    assert not any(k.attention_core for k in block.kernels_backward.kernels)
    fused = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=128)).layer("blocks.0").kernels_forward
    assert [k.kind for k in fused.kernels if k.attention_core] == ["attention"]  # the flash kernel alone


def test_a_causal_fused_kernel_is_marked_causal_and_eager_matmuls_are_not():
    """SDPA with is_causal=True runs a flash kernel that skips the masked tiles (forward and backward are
    marked); eager attention's matmuls compute every score, the mask applied after them."""
    fused = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=64)).layer("blocks.0")
    for mix in (fused.kernels_forward, fused.kernels_backward):
        attention = [k for k in mix.kernels if k.kind == "attention"]
        assert attention and all(k.causal for k in attention)
        assert not any(k.causal for k in mix.kernels if k.kind != "attention")
    eager = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=64, attn_impl="eager")).layer("blocks.0")
    assert not any(k.causal for mix in (eager.kernels_forward, eager.kernels_backward) for k in mix.kernels)
    q = torch.randn(1, 2, 8, 4)
    ops = trace_ops(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=False))
    assert not any(op.is_causal for op in ops)


def test_vocab_parallel_head_is_sharded_and_graph_round_trips():
    graph = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=128))
    head = graph.layer("lm_head").kernels_forward
    assert head.gemm_flops_tp_sharded == pytest.approx(head.gemm_flops)
    assert autopar.ModelGraph.from_json(graph.to_json()) == graph


def _trace_kernels(ops) -> Counter:
    """(class, work) of each op a real CPU step ran, as the planner's Kernel kinds name them."""
    out: Counter = Counter()
    for o in ops:
        if o.is_view:
            continue
        kind = "attention" if o.gemm_batch > 1 else "gemm" if o.gemm_mnk else o.kind
        out[(kind, round(o.flops if o.gemm_mnk else o.bytes_moved))] += 1
    return out


def test_captured_kernels_are_the_ops_a_cpu_step_runs():
    """Capture runs on meta tensors; the kernels it lists for a GPT block (× the batch) must be, one for
    one, the ops a real fp32 forward + backward of that block dispatches on this CPU (optrace's record),
    with the same memory class, GEMM layout and attention shape. Eager attention: with SDPA capture
    lists the GPU's flash kernel on purpose, which a CPU does not run."""
    attn_impl = "eager"
    torch.manual_seed(0)
    b, s = 2, 64
    model, x = autopar.zoo.build("gpt-tiny", seq_len=s, batch_size=b, dtype=torch.float32, dropout=0.0,
                                 attn_impl=attn_impl)
    layer = autopar.capture(model, x).layer("blocks.0")
    real, _ = autopar.zoo.build("gpt-tiny", seq_len=s, batch_size=b, device="cpu", dropout=0.0, attn_impl=attn_impl)
    block = real.blocks[0]
    h = torch.randn(b, s, real.blocks[0].ln_1.normalized_shape[0], requires_grad=True)
    grad = torch.randn_like(h)
    ops = trace_ops(lambda: block(h).backward(grad))
    captured: Counter = Counter()
    for mix in (layer.kernels_forward, layer.kernels_backward):
        for k in mix.kernels:
            captured[(k.kind, round(b * k.work))] += k.count
    assert captured == _trace_kernels(ops)
    layouts = Counter(o.gemm_layout for o in ops if o.gemm_mnk and o.gemm_batch == 1)
    assert layouts == Counter(
        k.layout for mix in (layer.kernels_forward, layer.kernels_backward) for k in mix.kernels
        for _ in range(k.count) if k.kind == "gemm")
    shapes = sorted(o.gemm_mnk for o in ops if o.gemm_batch > 1)
    assert shapes == sorted(k.mnk for mix in (layer.kernels_forward, layer.kernels_backward) for k in mix.kernels
                            for _ in range(k.count) if k.kind == "attention")
