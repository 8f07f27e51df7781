"""Selective recompute on transformers families with eager attention: the attention core followed through each
family's own code (autopar.capture.kernels.AttentionCore: GQA repeats, rotary, masks added or filled,
softcapping, in-place residuals, fused q|k|v projections, MoE blocks writing in place) is recomputed exactly —
the gradients of every parameter equal those of the same model without recompute. Blocks are the ones capture
finds (as codegen wraps them)."""

from __future__ import annotations

import pytest
import torch
from hf_families import POSITIONS, VOCAB, build_family

import autopar
from autopar.codegen.pipeline import layer_modules
from autopar.codegen.recompute import apply_recompute

pytest.importorskip("transformers")

# MoE families write into tensors in place (an output accumulated per expert, router weights divided in place),
# which torch's selective-checkpoint cache refused before AttentionCore recomputed fresh buffers and writes and the
# policy released what a write changes: all seven failed in backward on the previous commit
FAMILIES = ("gpt2", "gpt_neox", "llama", "qwen3", "gemma2", "phi", "falcon", "olmo", "mixtral", "qwen3_moe",
            "deepseek_v3", "gpt_oss", "olmoe")


def _grads(family: str, mode: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model = build_family(family)
    model.config._attn_implementation = "eager"  # the explicit softmax path, where the core's s² tensors live
    graph = autopar.capture(model, (ids,))
    blocks = [p for la in graph.layers if la.kind == "block" for p in layer_modules(graph, la.name)]
    assert blocks, f"{family}: capture found no block"
    for path in blocks:
        apply_recompute(model.get_submodule(path), mode)
    logits = model(ids).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten()).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", FAMILIES)
def test_selective_recompute_reproduces_eager_attention_gradients(family: str) -> None:
    ids = torch.randint(3, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(0))
    none, selective = _grads(family, "none", ids), _grads(family, "selective", ids)
    assert none.keys() == selective.keys() and none
    for name, g in none.items():
        torch.testing.assert_close(selective[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
