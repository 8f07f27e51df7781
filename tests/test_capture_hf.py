"""autopar.capture on Hugging Face models built from configs on the meta device (the export path)."""

from __future__ import annotations

import pytest
import torch

import autopar

transformers = pytest.importorskip("transformers")

S, B = 32, 2


def _build(cls_name: str, cfg_name: str, **cfg) -> torch.nn.Module:
    config = getattr(transformers, cfg_name)(**cfg)
    with torch.device("meta"):
        return getattr(transformers, cls_name)(config)


_SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, autopar.ModelGraph]:
    model = _build("LlamaForCausalLM", "LlamaConfig", **_SMALL)
    return model, autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),))


@pytest.mark.parametrize("cls_name,cfg_name,cfg", [
    ("GPT2LMHeadModel", "GPT2Config", dict(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=128,
                                           bos_token_id=0, eos_token_id=0)),
    ("LlamaForCausalLM", "LlamaConfig", _SMALL),
    ("Qwen2ForCausalLM", "Qwen2Config", _SMALL),
])
def test_hf_params_exact(cls_name: str, cfg_name: str, cfg: dict) -> None:
    model = _build(cls_name, cfg_name, **cfg)
    g = autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),))
    expected = sum(p.numel() for p in model.parameters())  # GPT-2's tied LM head counted once
    # each holding layer counts a shared weight (a replica per pipeline stage): subtract the extra holders
    extra = sum((len(sp.layers) - 1) * sp.num_params for sp in g.shared_params if sp.layers)
    assert g.num_params == expected == sum(layer.num_params for layer in g.layers) - extra
    ties = [sp for sp in g.shared_params if len(sp.names) > 1]
    tied_names = {n for sp in ties for n in sp.names}
    if cls_name == "GPT2LMHeadModel":  # ties its head to the token embedding
        assert tied_names == {"transformer.wte.weight", "lm_head.weight"}
        assert ties[0].layers == ("transformer.wte", "lm_head")
    else:
        assert not ties
    assert g.capture_method == "export"
    assert sum(1 for layer in g.layers if layer.kind == "block") == 3


def test_hf_llama_layers_and_patterns(llama: tuple[torch.nn.Module, autopar.ModelGraph]) -> None:
    _, g = llama
    assert [la.name for la in g.layers] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                            "model.layers.2", "model.norm", "lm_head"]
    assert g.layer("model.embed_tokens").modules == ("model.embed_tokens", "model.rotary_emb")
    attn, mlp = g.layer("model.layers.2").tp_patterns
    p = "model.layers.2"
    assert attn.column == (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj", f"{p}.self_attn.v_proj")
    assert attn.row == (f"{p}.self_attn.o_proj",)
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 16)
    assert mlp.column == (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj") and mlp.row == (f"{p}.mlp.down_proj",)
    assert [pt.kind for pt in g.layer("lm_head").tp_patterns] == ["lm_head"]
    assert (g.hidden_size, g.num_attention_heads, g.num_kv_heads, g.vocab_size) == (64, 4, 2, 512)
    # the hidden state [S, 64] fp32 crosses every block boundary, plus the rotary tables and mask built
    # once before the first block and used by all of them
    assert all(la.boundary_bytes >= S * 64 * 4 for la in g.layers[:-1])
    assert g.layers[1].signature == g.layers[2].signature == g.layers[3].signature


def test_hf_llama_flops_match_formula(llama: tuple[torch.nn.Module, autopar.ModelGraph]) -> None:
    _, g = llama
    h, a, kv, f, V, n = 64, 4, 2, 160, 512, 3
    d = h // a
    per_layer = 4 * S * h * h + 4 * S * h * kv * d + 4 * S * S * h + 6 * S * h * f
    assert g.forward_flops == pytest.approx(n * per_layer + 2 * S * h * V, rel=0.02)


def test_hf_model_untouched(llama: tuple[torch.nn.Module, autopar.ModelGraph]) -> None:
    model, _ = llama
    assert all(p.device.type == "meta" and type(p) is torch.nn.Parameter for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())


def test_a_model_that_checkpoints_its_own_layers_is_refused_saying_how_to_turn_it_off():
    """transformers' gradient checkpointing runs torch.utils.checkpoint inside each decoder layer's forward; its
    replay under capture's measurement failed with torch's own CheckpointError (41 tensors saved, 38 replayed)."""
    from autopar.errors import CaptureError

    model = _build("LlamaForCausalLM", "LlamaConfig", **_SMALL)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    with pytest.raises(CaptureError, match=r"checkpoints its own layers.*activation_checkpointing_disable.*recompute"):
        autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),))
    model.activation_checkpointing_disable()
    assert len(autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),)).layers) == 6
