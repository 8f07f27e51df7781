"""Every eight-rank parity case in one gloo job (tp2 × pp2 × dp2 with ZeRO-3).

Starting eight interpreters that import torch and transformers costs tens of seconds on a 2-core CI
machine, so the suites' 3-D cases share one job instead of one job each. A case names the suite that
builds it (`SUITES`: a module and its per-case function, imported in the ranks only when used) and is
checked with the same tests as the two-rank cases of that suite: losses at every step, final weights
and last gradients within rtol 1e-4 / atol 1e-5 of the same model trained on one process.

Cases: the zoo GPT and transformers' Llama (with sequence parallelism) for 5 steps, Gemma (tied,
scaled embedding), the self-written nanoGPT (ModuleDict, tied head, its own `(logits, loss)`) and
transformers' T5 (tests/parity_kinds.py: its own inputs, cut inside its decoder) for 3 steps;
DeepSeek-V3 under expert parallelism (ep2 × pp2 × edp2, ZeRO-3) for 3 steps; and
tests/test_precision.py's 3-D cases, checked with its checks: the zoo GPT under the bf16 policy (5 steps
against one process under autocast, within 2e-2; and 3 steps under ZeRO-1, the distributed optimizer of
autopar/codegen/dist_optimizer.py) and a tied-embedding Llama in fp32 with clipping active
every step (grad_norm within 1e-5 relative of clip_grad_norm_'s).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from dist_harness import run_distributed
from parity_models import check_experts_split
from test_parity import _check

pytestmark = pytest.mark.multiproc

SUITES = {  # suite name → (module in tests/, function(name, layout, steps) → result dict)
    "parity": ("parity_models", "parity_case"),
    "own": ("own_models", "own_case"),
    "precision": ("precision_cases", "policy_suite_case"),
    "kinds": ("parity_kinds", "kind_case"),
}
THREE_D = dict(tp=2, pp=2, dp=2, zero_stage=3, num_microbatches=2)
CASES = [
    ("parity", "gpt", THREE_D, 5),
    ("parity", "hf_llama", dict(THREE_D, sequence_parallel=True), 5),
    ("parity", "gemma", THREE_D, 3),
    ("own", "nanogpt", THREE_D, 3),
    # expert parallelism: DeepSeek-V3 (dense first layer, shared expert, MLA) under ep2 × pp2 × edp2, its banks
    # `fully_shard`ed over the ranks holding their experts, the dense layers over all four data-parallel ranks
    ("parity", "deepseek_v3", dict(pp=2, dp=4, ep=2, zero_stage=3, num_microbatches=2, schedule="1f1b"), 3),
    # an encoder–decoder with its own inputs (ids, mask, decoder ids), cut inside its decoder: T5's tied `shared`
    # vocab-parallel, its relative position bias cut by head, the encoder's output carried to the second stage
    ("kinds", "t5", dict(THREE_D, stage_sizes=(6, 3)), 3),
    ("precision", "gpt:bf16", THREE_D, 5),  # the bf16 policy against one process under autocast
    # ZeRO-1 under bf16: the distributed optimizer (16-bit DTensor parameters, fp32 masters on their owners)
    ("precision", "gpt:bf16", dict(THREE_D, zero_stage=1), 3),
    ("precision", "llama_tied:clip", THREE_D, 3),  # clipping's global norm with tied embeddings
]


def suite_cases(cases: list[tuple[str, str, dict[str, Any], int]]) -> list[dict[str, Any]]:
    """Run each `(suite, name, layout, steps)` case in this rank with its suite's case builder."""
    results = []
    for suite, name, layout, steps in cases:
        module, function = SUITES[suite]
        results.append(getattr(importlib.import_module(module), function)(name, layout, steps))
    return results


def test_three_d_zero3_on_eight_ranks():
    from test_precision import check_policy

    per_rank = run_distributed(suite_cases, 8, CASES, timeout_s=900.0)
    _check([r for case, r in zip(CASES, per_rank[0], strict=True) if case[0] != "precision"])
    check_policy([r for case, r in zip(CASES, per_rank[0], strict=True) if case[0] == "precision"])
    for i, (_, _, layout, _) in enumerate(CASES):
        check_experts_split([r[i] for r in per_rank], layout.get("ep", 1))
    for other in per_rank[1:]:  # the reported loss is the global mean on every rank
        assert [r["losses"] for r in other] == [r["losses"] for r in per_rank[0]]
