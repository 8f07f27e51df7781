"""Tiny configs of Hugging Face causal-LM families for the conformance suite (transformers' own classes).

Each config is the family's architecture at test size: 2 layers, hidden 64, 4 query heads (2 key/value
heads where the family has grouped-query attention), vocabulary 128, fp32, dropout 0, SDPA attention
(eager where the family has no SDPA path). Tied embeddings are kept where the family ties them by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, POSITIONS = 128, 64, 4, 2, 2, 96, 64


def _common(**extra) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, max_position_embeddings=POSITIONS, bos_token_id=0, eos_token_id=1,
                pad_token_id=2)
    base.update(extra)
    return base


def _families() -> dict[str, Callable[[], nn.Module]]:
    import transformers as hf

    def make(config_cls, model_cls, attention="sdpa", **kw):
        def build(**over):
            cfg = config_cls(**{**kw, **over})
            cfg._attn_implementation = attention
            return model_cls(cfg)
        return build

    gqa = dict(num_key_value_heads=KV_HEADS)
    return {
        "gpt2": make(hf.GPT2Config, hf.GPT2LMHeadModel, vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                     n_positions=POSITIONS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=1),
        "gpt_neox": make(hf.GPTNeoXConfig, hf.GPTNeoXForCausalLM, **_common(hidden_dropout=0.0,
                                                                             attention_dropout=0.0)),
        "gemma": make(hf.GemmaConfig, hf.GemmaForCausalLM, **_common(**gqa, head_dim=HIDDEN // HEADS)),
        "llama": make(hf.LlamaConfig, hf.LlamaForCausalLM, **_common(**gqa, tie_word_embeddings=False)),
        "llama_tied": make(hf.LlamaConfig, hf.LlamaForCausalLM, **_common(**gqa, tie_word_embeddings=True)),
        "mistral": make(hf.MistralConfig, hf.MistralForCausalLM, **_common(**gqa, sliding_window=None)),
        "qwen2": make(hf.Qwen2Config, hf.Qwen2ForCausalLM, **_common(**gqa, tie_word_embeddings=True)),
        "qwen3": make(hf.Qwen3Config, hf.Qwen3ForCausalLM, **_common(**gqa, head_dim=HIDDEN // HEADS)),
        "olmo": make(hf.OlmoConfig, hf.OlmoForCausalLM, **_common(**gqa)),
        "phi3": make(hf.Phi3Config, hf.Phi3ForCausalLM, **_common(**gqa)),
        "stablelm": make(hf.StableLmConfig, hf.StableLmForCausalLM, **_common(**gqa)),
        "granite": make(hf.GraniteConfig, hf.GraniteForCausalLM, **_common(**gqa)),
        "gemma2": make(hf.Gemma2Config, hf.Gemma2ForCausalLM, attention="eager",
                       **_common(**gqa, head_dim=HIDDEN // HEADS)),
        "phi": make(hf.PhiConfig, hf.PhiForCausalLM, **_common(resid_pdrop=0.0, embd_pdrop=0.0)),
        # interleaved sliding-window and global layers (the window here spans the whole test sequence), q/k norms
        "gemma3": make(hf.Gemma3TextConfig, hf.Gemma3ForCausalLM, **_common(**gqa, head_dim=HIDDEN // HEADS,
                                                                           sliding_window=POSITIONS)),
        # multi-query attention in one fused projection, parallel attention/MLP, residual added in place
        "falcon": make(hf.FalconConfig, hf.FalconForCausalLM, vocab_size=VOCAB, hidden_size=HIDDEN,
                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, multi_query=True,
                       new_decoder_architecture=False, hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0,
                       eos_token_id=1),
    }


def _moe_families() -> dict[str, Callable[[], nn.Module]]:
    """Mixture-of-experts families at test size: 4 experts, top-2, expert FFN 32 (DeepSeek-V3: multi-head
    latent attention, one shared expert, its first layer dense; Qwen2-MoE: a gated shared expert)."""
    import transformers as hf

    def make(config_cls, model_cls, attention="sdpa", **kw):
        def build(**over):
            cfg = config_cls(**_common(**{**kw, **over}))
            cfg._attn_implementation = attention
            return model_cls(cfg)
        return build

    moe = dict(num_experts_per_tok=2, num_key_value_heads=KV_HEADS)
    return {
        "mixtral": make(hf.MixtralConfig, hf.MixtralForCausalLM, **moe, num_local_experts=4, intermediate_size=32),
        "qwen3_moe": make(hf.Qwen3MoeConfig, hf.Qwen3MoeForCausalLM, **moe, num_experts=4, moe_intermediate_size=32,
                          head_dim=HIDDEN // HEADS),
        "qwen2_moe": make(hf.Qwen2MoeConfig, hf.Qwen2MoeForCausalLM, **moe, num_experts=4, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48),
        "deepseek_v3": make(hf.DeepseekV3Config, hf.DeepseekV3ForCausalLM, **{**moe, "num_key_value_heads": HEADS},
                            n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                            n_group=2, topk_group=1),
        "gpt_oss": make(hf.GptOssConfig, hf.GptOssForCausalLM, "eager", **moe, num_local_experts=4,
                        intermediate_size=32, head_dim=HIDDEN // HEADS, sliding_window=8),
        # PhiMoE routes by sparsemixer (repeated max and Gumbel sampling, no topk): found by its bank's call
        "phimoe": make(hf.PhimoeConfig, hf.PhimoeForCausalLM, **moe, num_local_experts=4, intermediate_size=32),
        # OLMoE: q and k normalised over all heads at once (OLMo 2's pattern): its attention stays replicated
        "olmoe": make(hf.OlmoeConfig, hf.OlmoeForCausalLM, **moe, num_experts=4, intermediate_size=32),
    }


MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "qwen2_moe", "phimoe", "olmoe")

FAMILIES = ("gpt2", "gpt_neox", "gemma", "llama", "llama_tied", "mistral", "qwen2", "qwen3", "olmo", "phi3",
            "stablelm", "granite", "gemma2", "phi", "falcon")
OTHER_FAMILIES = ("gemma3",)  # built here, run by other suites (tests/test_context_parallel.py)


def build_family(name: str, seed: int = 0, **config) -> nn.Module:
    """The tiny model of family `name`, in fp32, with weights drawn from `seed`; `config`: fields of its
    transformers config set otherwise (an odd `vocab_size`)."""
    torch.manual_seed(seed)
    builders = _moe_families() if name in MOE_FAMILIES else _families()
    return builders[name](**config).float()


class SkipLM(nn.Module):
    """A user's own model, not a transformers family: separate token and position embeddings summed at
    top level, a root-level parameter read by top-level code (a learned output scale), a skip connection
    from the embeddings to the head across every block, and an LM head tied to the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(POSITIONS, HIDDEN)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(HIDDEN, HEADS, FFN, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(3))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.out_scale = nn.Parameter(torch.ones(HIDDEN))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.size(1), device=ids.device)
        x0 = self.tok(ids) + self.pos(positions)
        x = x0
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1), device=ids.device)
        for block in self.blocks:
            x = block(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x + x0) * self.out_scale)


def mixed_attention_lm() -> nn.Module:
    """Llama whose middle block is Phi-3's: its q|k|v in one projection of unequal blocks (4 query heads,
    1 key/value head), which tensor parallelism keeps whole, between two blocks whose attention it splits."""
    import transformers as hf

    kw = _common(num_key_value_heads=KV_HEADS, tie_word_embeddings=False, num_hidden_layers=3)
    cfg, phi3 = hf.LlamaConfig(**kw), hf.Phi3Config(**{**kw, "num_key_value_heads": 1})
    cfg._attn_implementation = phi3._attn_implementation = "sdpa"
    model = hf.LlamaForCausalLM(cfg)
    model.model.layers[1] = hf.models.phi3.modeling_phi3.Phi3DecoderLayer(phi3, 1)
    return model


def build_custom(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return {"skip_tied": SkipLM, "mixed_attention": mixed_attention_lm}[name]().float()
