"""The zoo's reference architectures: sizes from their papers, meta by default, runnable when real."""

from __future__ import annotations

import pytest
import torch

import autopar
from autopar import AutoparError

# Published sizes: GPT-3 (Brown et al. 2020, Table 2.1, tied LM head) and Llama 3 (Dubey et al. 2024,
# Table 3: 8B, 70B, 405B, untied head). GPT-2 shapes are checked through the per-block count below.
PUBLISHED = {"gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9,
             "llama3-8b": 8.03e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9}


def _num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_sizes_match_papers(name: str) -> None:
    model, _ = autopar.zoo.build(name, seq_len=16)
    n = _num_params(model)
    if name.startswith("gpt3"):  # the paper's models tie the LM head to the embedding; ours is untied
        n -= model.lm_head.weight.numel()
    assert n == pytest.approx(PUBLISHED[name], rel=0.02)


@pytest.mark.parametrize("name", [n for n in autopar.zoo.names() if n.startswith("gpt")])
def test_gpt_block_is_12h2(name: str) -> None:
    cfg = autopar.zoo.config(name)
    model, _ = autopar.zoo.build(name, seq_len=16)
    block = _num_params(model.blocks[0])
    h = cfg.hidden_size
    assert block == 12 * h * h + 13 * h  # weights 12h² plus biases and two LayerNorms (Kaplan et al. 2020)


def test_build_defaults_and_inputs() -> None:
    model, (ids,) = autopar.zoo.build("llama3-70b", seq_len=4096, batch_size=2)
    assert ids.shape == (2, 4096) and ids.dtype == torch.long and ids.device.type == "meta"
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.zoo_name == "llama3-70b"
    assert autopar.zoo.build("gpt2-small")[1][0].shape == (1, 1024)  # min(context, 2048)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_real_tiny_models_run_forward_and_backward(name: str) -> None:
    torch.manual_seed(0)
    model, (ids,) = autopar.zoo.build(name, seq_len=16, batch_size=2, device="cpu")
    logits = model(ids)
    assert logits.shape == (2, 16, model.config.vocab_size) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_eager_and_sdpa_attention_agree() -> None:
    torch.manual_seed(0)
    a, (ids,) = autopar.zoo.build("gpt-tiny", seq_len=16, device="cpu", dropout=0.0, attn_impl="eager")
    b, _ = autopar.zoo.build("gpt-tiny", seq_len=16, device="cpu", dropout=0.0, attn_impl="sdpa")
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(ids), b(ids), atol=1e-5, rtol=1e-5)


def test_config_errors() -> None:
    with pytest.raises(AutoparError, match="unknown model"):
        autopar.zoo.config("gpt5")
    with pytest.raises(AutoparError, match="unknown config field"):
        autopar.zoo.config("gpt-tiny", n_layer=3)
    with pytest.raises(ValueError, match="divisible"):
        autopar.zoo.config("gpt-tiny", n_heads=3)
