"""KernelMix: a layer's kernels by kind add up to the layer's measured totals, and split as the model says."""

import pytest

import autopar


@pytest.mark.parametrize("name, seq", [("gpt3-175b", 2048), ("llama3-8b", 4096), ("gpt-tiny", 128)])
def test_kernel_flops_add_up_to_the_layer_flops(name, seq):
    graph = autopar.capture(*autopar.zoo.build(name, seq_len=seq))
    for layer in graph.layers:
        passes = ((layer.kernels_forward, layer.forward_flops), (layer.kernels_backward, layer.backward_flops))
        for mix, total in passes:
            assert mix.gemm_flops + mix.attention_flops == pytest.approx(total, rel=1e-9, abs=1.0)
            assert mix.gemm_flops_tp_sharded <= mix.gemm_flops * (1 + 1e-9)


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


def test_vocab_parallel_head_is_sharded_and_graph_round_trips():
    graph = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=128))
    head = graph.layer("lm_head").kernels_forward
    assert head.gemm_flops_tp_sharded == pytest.approx(head.gemm_flops)
    assert autopar.ModelGraph.from_json(graph.to_json()) == graph
