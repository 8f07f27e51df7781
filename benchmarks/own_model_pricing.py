"""A self-written Llama-3-8B and transformers' LlamaForCausalLM priced against autopar's own `llama3-8b`.

Same shapes (Dubey et al. 2024, Table 3), bf16, seq 8192, tp1·dp64 ZeRO-3, micro-batch 1, global batch 64 on
8 DGX H100 nodes. Prints per model the capture path, per-block FLOPs and memory-bound bytes (forward, backward)
and the priced step time, and per aten op the forward+backward bytes a block's memory-bound kernels move, so
the difference from `llama3-8b` is attributed op by op.

    python benchmarks/own_model_pricing.py [--ops]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

import autopar
from autopar import Cluster, ParallelConfig

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
import own_llama_8b  # noqa: E402

SEQ = 8192


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=SEQ,
                      rope_theta=500000.0, tie_word_embeddings=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model, (torch.zeros(1, SEQ, dtype=torch.long, device="meta"),)


def _ops(model, x) -> Counter:
    """Bytes per aten op of one block's memory-bound kernels, forward and backward (capture's own records)."""
    from autopar.capture import probe

    seen: Counter = Counter()
    original = probe.describe_op

    def spy(func, args, kwargs, out, flops=None):
        rec = original(func, args, kwargs, out, flops)
        if not rec.is_view and rec.gemm_mnk is None and spy.on:
            seen[str(func.overloadpacket.__name__)] += rec.bytes_moved
        return rec

    spy.on = False
    measure = probe.measure_call

    def measure_blocks(module, *a):
        spy.on = "Block" in type(module).__name__ or "DecoderLayer" in type(module).__name__
        try:
            return measure(module, *a)
        finally:
            spy.on = False

    capture_module = sys.modules["autopar.capture"]
    probe.describe_op, capture_module.measure_call = spy, measure_blocks
    try:
        autopar.capture(model, x)
    finally:
        probe.describe_op, capture_module.measure_call = original, measure
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", action="store_true", help="also print per-op bytes of one block")
    args = parser.parse_args(argv)
    zoo, x = autopar.zoo.build("llama3-8b", seq_len=SEQ)
    models = {"llama3-8b": lambda: (zoo.to(torch.bfloat16), x), "own_llama_8b": lambda: own_llama_8b.build(SEQ),
              "transformers Llama": _hf_llama}
    cluster = Cluster.preset("dgx-h100", nodes=8)
    cfg = ParallelConfig(tp=1, pp=1, dp=64, zero_stage=3, micro_batch_size=1, num_microbatches=1)
    base = None
    per_op = {}
    for name, build in models.items():
        model, inputs = build()
        graph = autopar.capture(model, inputs)
        block = next(la for la in graph.layers if la.kind == "block")
        step = autopar.estimate(graph, cluster, cfg, global_batch_size=64).step_time_s
        base = base or step
        print(f"{name:20s} {graph.capture_method:15s} block {block.forward_flops / 1e12:.3f}+"
              f"{block.backward_flops / 1e12:.3f} TFLOP, memory-bound {block.kernels_forward.memory_bytes / 1e9:.2f}"
              f"+{block.kernels_backward.memory_bytes / 1e9:.2f} GB; step {step:.4f} s ({step / base - 1:+.1%})")
        if args.ops:
            per_op[name] = _ops(*build())
    if args.ops:
        names = sorted(set().union(*per_op.values()), key=lambda n: -max(c[n] for c in per_op.values()))
        print(f"\n{'aten op (one block, fwd+bwd)':34s}" + "".join(f"{n[:18]:>20s}" for n in per_op))
        for op in names:
            print(f"{op:34s}" + "".join(f"{c[op] / 1e9:17.3f} GB" for c in per_op.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
