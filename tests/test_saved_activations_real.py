"""Capture's saved-activation bytes against what autograd really keeps when the model runs.

The reference is independent of capture's probe: the zoo model is run for real on the CPU in bf16 and
`torch.autograd.graph.saved_tensors_hooks` counts the unique storages it saves
(`benchmarks/runtime_memory.py`, `saved_bytes_per_block`). A Llama block with llama3-8b's proportions
(head_dim 128, 4 query heads per KV head, ffn = 3.5 h) keeps 48 h bytes per token: the two norms' input,
x·rsqrt and output (6 h each), q, the repeated k and v and the flash output (8 h), and the SwiGLU's gate,
up, silu(gate) and product (4 × 7 h).

autopar's own runtime (bf16 policy: autocast over fp32 masters) is measured the same way, with the step's
peak followed storage by storage (torch's MemTracker). Its block saves 62 h: the embedding runs on the fp32
table, so the residual stream and both norms stay fp32 (+2 h for each of the norms' input and x·rsqrt), and
each linear saves its own 16-bit cast of the fp32 norm output (q, k, v: +4 h; gate, up: +2 h). The peak
comes in the loss's backward, before any gradient exists, and autocast never copies an embedding table. The
plan prices none of the three; the last test says so.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import autopar
from tests.dist_harness import run_distributed

_spec = importlib.util.spec_from_file_location(
    "runtime_memory", Path(__file__).resolve().parents[1] / "benchmarks" / "runtime_memory.py")
runtime_memory = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = runtime_memory  # its dataclass resolves its module by name
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


_SMALL = {"llama3-8b": dict(n_layers=2, hidden_size=256, n_heads=2, n_kv_heads=1, ffn_hidden_size=896, vocab_size=4000),
          "gpt3-1.3b": dict(n_layers=2, hidden_size=256, n_heads=2, vocab_size=4000, dropout=0.0)}
# bytes per token and block, in units of h, that autopar's runtime saves (module docstring; GPT: its two
# LayerNorms' fp32 inputs, +2 h each, and its separate q, k, v projections' casts, +4 h, over capture's 32 h)
_RUNTIME_BLOCK_H = {"llama3-8b": 62, "gpt3-1.3b": 40}
_RUNTIME_NORM_H = {"llama3-8b": 8, "gpt3-1.3b": 4}


def _measure_steps() -> dict:
    import dataclasses

    return {name: dataclasses.asdict(runtime_memory.measure(name, seq=256, batch=2, **shape))
            for name, shape in _SMALL.items()}


@pytest.fixture(scope="module")
def steps() -> dict:
    return run_distributed(_measure_steps, 1, timeout_s=300)[0]


@pytest.mark.parametrize("name", sorted(_SMALL))
def test_runtime_peak_is_the_prediction_plus_the_measured_differences(steps: dict, name: str) -> None:
    r = runtime_memory.StepMemory(**steps[name])
    h = r.hidden
    assert r.bf16_block_per_token == pytest.approx(r.captured_block_per_token, rel=1e-3)
    assert r.peak["GRAD"] == 0  # zero_grad(set_to_none=True), one micro-batch: the peak precedes every gradient
    assert r.runtime_block_per_token == pytest.approx(_RUNTIME_BLOCK_H[name] * h, rel=2e-2)
    assert r.runtime_norm_per_token == pytest.approx(_RUNTIME_NORM_H[name] * h, rel=2e-2)
    # the linears' 16-bit copies: every weight but the embedding tables' (F.embedding is on no autocast list)
    assert r.weight_copies_bytes == pytest.approx(r.predicted["compute_copies"] - r.embedding_copy_bytes, rel=2e-2)
    assert sum(v for _, v in r.terms()) == pytest.approx(r.peak["Total"], rel=1e-3)


@pytest.mark.xfail(strict=True, reason="autopar prices its own bf16 runtime as a bf16 module with gradients at the "
                   "activation peak: see benchmarks/runtime_memory.py and the README's 'On a GPU'")
@pytest.mark.parametrize("name", sorted(_SMALL))
def test_runtime_peak_is_priced(steps: dict, name: str) -> None:
    r = runtime_memory.StepMemory(**steps[name])
    assert r.predicted_peak_bytes == pytest.approx(r.peak["Total"], rel=0.02)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_expert_bank_saved_bytes_match_autograd(family: str) -> None:
    """What capture counts as the expert bank's saves (LayerSpec.saved_activation_bytes_expert: the token rows
    and FFN intermediates that expert parallelism's token share and etp divide) against the storages autograd
    keeps while the real bank runs, on random weights and routing (dropless: T·k rows whatever the routing)."""
    from tests.hf_families import build_family

    model, seq = build_family(family).to(torch.bfloat16), 64
    layer = next(la for la in autopar.capture(model, (torch.zeros(1, seq, dtype=torch.long),)).layers if la.moe)
    block = model.get_submodule(layer.moe.experts.rsplit(".", 1)[0])
    x = torch.randn(1, seq, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)

    def run() -> None:
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    measured = runtime_memory.saved_bytes_per_block(block, run)
    # the rows and intermediates are T·k whatever the routing; each expert the routing reaches also keeps its
    # own small index tensor, which capture counts for every expert: a routing that leaves some unreached
    # (DeepSeek-V3's group-limited router, 512 B an expert here) keeps up to 3% less
    assert measured["experts"] <= layer.saved_activation_bytes_expert <= 1.03 * measured["experts"]
    assert 0 < layer.saved_activation_bytes_expert < (layer.saved_activation_bytes
                                                      - layer.saved_activation_bytes_tp_sharded)
