"""Mixture-of-experts families beyond the CI suite: captured, then trained under ep2 × dp2 against one process.

The CI parity suite (tests/test_conformance_hf.py, tests/test_eight_ranks.py) runs Mixtral, Qwen3-MoE,
DeepSeek-V3 and GPT-OSS. This runs the transformers MoE families autopar was not written against, each at
test size (2 layers, hidden 64, 4 experts, top-2 unless the family routes otherwise, expert FFN 32), on 2
gloo ranks with the experts split over both (`ParallelConfig(dp=2, ep=2)`): 3 AdamW steps, and the losses,
final weights and last gradients compared with the same model trained on one process (the checks and
tolerances of tests/parity_models.py: rtol 1e-4, atol 1e-5). A family autopar cannot capture or split is
listed with the error it gives.

    python benchmarks/moe_families.py [FAMILY ...]      # ~1 min a family on 2 CPU cores
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import hf_families  # noqa: E402

_MOE = dict(num_experts_per_tok=2, num_key_value_heads=hf_families.KV_HEADS)


def _configs() -> dict[str, tuple[str, str, dict]]:
    """(config class, model class, config fields) of each family, beside hf_families' common fields."""
    mla = dict(_MOE, num_key_value_heads=hf_families.HEADS, n_routed_experts=4, moe_intermediate_size=32,
               n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=16)
    return {
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(_MOE, num_experts=4, intermediate_size=32)),
        "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(_MOE, num_local_experts=4,
                                                                         intermediate_size=32)),
        "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM", dict(_MOE, num_local_experts=4, intermediate_size=32,
                                                                head_dim=16)),
        "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM", dict(
            _MOE, moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=0)),
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
            _MOE, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, head_dim=16)),
        "hunyuan_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", dict(
            num_key_value_heads=hf_families.KV_HEADS, num_experts=4, moe_topk=2, intermediate_size=32,
            head_dim=16)),
        "dots1": ("Dots1Config", "Dots1ForCausalLM", dict(
            _MOE, n_routed_experts=4, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
            n_group=1, topk_group=1, head_dim=16)),
        "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
            _MOE, num_experts=4, moe_intermediate_size=32, num_dense_layers=1,
            layer_types=["full_attention", "conv"])),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
            _MOE, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32, head_dim=16,
            layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4, linear_num_key_heads=2,
            linear_key_head_dim=16, linear_value_head_dim=16)),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", mla),
        "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(
            num_key_value_heads=hf_families.KV_HEADS, num_local_experts=4, num_experts_per_tok=1,
            intermediate_size=32, intermediate_size_mlp=48, head_dim=16, interleave_moe_layer_step=1)),
        "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(
            num_experts_per_tok=2, num_local_experts=4, intermediate_size=32, kv_channels=16,
            num_key_value_heads=hf_families.HEADS)),
    }


def _builder(config_cls: str, model_cls: str, fields: dict) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_cls)(**hf_families._common(**fields))
        cfg._attn_implementation = "sdpa"
        return getattr(transformers, model_cls)(cfg)
    return build


def register() -> None:
    """Make the families buildable by name in this process (tests/hf_families.build_family)."""
    import parity_models

    if "olmoe" in hf_families.MOE_FAMILIES:
        return
    base = hf_families._moe_families
    extra = {name: _builder(*spec) for name, spec in _configs().items()}
    hf_families._moe_families = lambda: {**base(), **extra}
    hf_families.MOE_FAMILIES = parity_models.MOE_FAMILIES = hf_families.MOE_FAMILIES + tuple(extra)


def parity(family: str, steps: int) -> dict:
    """Run in every rank: the family's ep2 × dp2 parity case, or the error it stopped with."""
    register()
    from parity_models import parity_case

    try:
        return parity_case(family, dict(dp=2, ep=2), steps)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:240]}"}


def main() -> None:
    import torch
    from dist_harness import run_distributed
    from parity_models import ATOL

    import autopar

    register()
    names = sys.argv[1:] or list(_configs())
    print(f"{'family':14} {'MoE layers':>10}  {'ep2 x dp2 vs one process (3 AdamW steps)'}")
    for name in names:
        try:
            graph = autopar.capture(hf_families.build_family(name), (torch.zeros(1, 16, dtype=torch.long),))
        except Exception as e:
            print(f"{name:14} {'-':>10}  capture refused: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
            continue
        layers = sum(la.moe is not None for la in graph.layers)
        r = run_distributed(parity, 2, name, 3, timeout_s=900)[0]
        if "error" in r:
            print(f"{name:14} {layers:>10}  refused: {r['error']}")
            continue
        loss = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref_losses"], strict=True))
        ok = r["weight_excess"] <= ATOL and r["grad_excess"] <= ATOL and not r["missing"] and not r["extra"]
        print(f"{name:14} {layers:>10}  {'parity' if ok else 'MISMATCH'}: losses within {loss:.1e} (relative), "
              f"weights {r['weight_excess']:+.1e} and gradients {r['grad_excess']:+.1e} over rtol·|x| "
              f"(atol {ATOL:g})")


if __name__ == "__main__":
    main()
