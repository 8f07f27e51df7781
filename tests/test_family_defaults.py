"""Each transformers family as a user builds it: the family's default config and attention implementation.

The conformance suites train every family at test size (tests/hf_families.py: hidden 64, 4 heads, SDPA forced).
A user builds `LlamaForCausalLM(LlamaConfig())` — the family's own widths, head counts and default attention
implementation. Here each family is built so on the meta device (two layers, so capture stays quick; DeepSeek-V3
with its first layer dense, as at test size), captured, and planned on one DGX H100 node with tp=2 pinned and
everything else the planner's choice, sequence parallelism included. Checked: the plan's choice of sequence
parallelism is one the graph allows (never SP on a model it refuses it for, and a refusal is said in the plan's
notes); and what decides it agrees with the test-size build, so the suites that train the tiny build exercise
what a user's model gets.
"""

from __future__ import annotations

import pytest
import torch
from hf_families import FAMILIES, MOE_FAMILIES, build_family

LAYER_FIELDS = ("num_hidden_layers", "n_layer")
_CONFIGS = {  # family → (config class, model class) names in transformers
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"), "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "llama_tied": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "olmo": ("OlmoConfig", "OlmoForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM"), "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "phi": ("PhiConfig", "PhiForCausalLM"),
    "falcon": ("FalconConfig", "FalconForCausalLM"), "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "phimoe": ("PhimoeConfig", "PhimoeForCausalLM"), "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
}
SEQ = 256


def _as_a_user_builds_it(name: str) -> torch.nn.Module:
    import transformers as hf

    config_cls, model_cls = (getattr(hf, n) for n in _CONFIGS[name])
    cfg = config_cls()
    for field in LAYER_FIELDS:
        if hasattr(cfg, field):
            setattr(cfg, field, 2)
    if hasattr(cfg, "first_k_dense_replace"):
        cfg.first_k_dense_replace = 1
    if getattr(cfg, "layer_types", None):  # families that list each layer's attention kind
        cfg.layer_types = cfg.layer_types[:2]
    if name == "llama_tied":
        cfg.tie_word_embeddings = True
    with torch.device("meta"):
        return model_cls(cfg)


def _sequence_decision(graph, tp: int = 2) -> tuple[bool, tuple[int, ...]]:
    """Whether SP may split the model at tp, and which block positions must run on the full sequence."""
    from autopar.capture.sequence import full_sequence_reason, sequence_parallel_refusal

    blocks = [la for la in graph.layers if la.kind == "block"]
    return (sequence_parallel_refusal(graph, tp) is None,
            tuple(i for i, la in enumerate(blocks) if full_sequence_reason(la) is not None))


@pytest.mark.parametrize("name", [*FAMILIES, *MOE_FAMILIES])
def test_the_default_build_plans_with_the_planners_sequence_parallelism(name):
    import autopar
    from autopar import Cluster, PlannerOptions

    model = _as_a_user_builds_it(name)
    graph = autopar.capture(model, (torch.zeros(1, SEQ, dtype=torch.long),))
    allowed, whole = _sequence_decision(graph)
    plan = autopar.plan(graph, Cluster.preset("dgx-h100", nodes=1), global_batch_size=64,
                        options=PlannerOptions(tp=2, top_k=0))
    assert plan.config.tp == 2
    notes = " ".join(plan.estimate.notes)
    if not allowed:
        assert not plan.config.sequence_parallel, (name, plan.config)
        assert "sequence parallelism off" in notes, (name, notes)
    tiny = autopar.capture(build_family(name), (torch.zeros(1, 16, dtype=torch.long),))
    tiny_allowed, tiny_whole = _sequence_decision(tiny)
    assert (allowed, whole[:len(tiny_whole)]) == (tiny_allowed, tiny_whole), (
        f"{name}: as a user builds it, SP allowed={allowed} with full-sequence blocks {whole}; the test-size build "
        f"the suites train has allowed={tiny_allowed}, {tiny_whole}")
