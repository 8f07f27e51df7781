"""Capture's saved-activation bytes against what autograd really keeps when the model runs.

The reference is independent of capture's probe: the zoo model is run for real on the CPU in bf16 and
`torch.autograd.graph.saved_tensors_hooks` counts the unique storages it saves
(`benchmarks/runtime_memory.py`, `saved_bytes_per_block`). A Llama block with llama3-8b's proportions
(head_dim 128, 4 query heads per KV head, ffn = 3.5 h) keeps 48 h bytes per token: the two norms' input,
x·rsqrt and output (6 h each), q, the repeated k and v and the flash output (8 h), and the SwiGLU's gate,
up, silu(gate) and product (4 × 7 h).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

import autopar

_spec = importlib.util.spec_from_file_location(
    "runtime_memory", Path(__file__).resolve().parents[1] / "benchmarks" / "runtime_memory.py")
runtime_memory = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runtime_memory)

_SHAPE = dict(n_layers=1, hidden_size=256, n_heads=2, n_kv_heads=1, ffn_hidden_size=896, vocab_size=512)


@pytest.mark.parametrize("seq,batch", [(256, 1), (128, 2)])
def test_llama_block_saved_bytes_match_autograd(seq: int, batch: int) -> None:
    meta, example = autopar.zoo.build("llama3-8b", seq_len=seq, batch_size=batch, **_SHAPE)
    captured = autopar.capture(meta, example).layer("layers.0").saved_activation_bytes  # per sample
    model, _ = autopar.zoo.build("llama3-8b", seq_len=seq, device="cpu", dtype=torch.bfloat16, **_SHAPE)
    block, h = model.layers[0], _SHAPE["hidden_size"]
    x = torch.randn(batch, seq, h, dtype=torch.bfloat16, requires_grad=True)
    measured = runtime_memory.saved_bytes_per_block(block, lambda: block(x).sum().backward())
    assert "weight copies" not in measured  # the bf16 model computes on its own weights
    real = sum(measured.values()) / batch
    assert captured == pytest.approx(real, rel=1e-3)
    # the count derived in the module docstring, plus flash's fp32 log-sum-exp per head and token
    assert real == pytest.approx(seq * (48 * h + 4 * _SHAPE["n_heads"]), rel=1e-2)
