"""Parity of every layout with single-device training (the definition of correct, docs/design.md §7).

Each job spawns gloo ranks and runs several cases in them; every case trains a tiny zoo GPT or
Hugging Face Llama for 5 AdamW steps in fp32 and compares, against the same model trained on one
process on the whole global batch: the loss at every step, the final weights and the last step's
gradients (gradients catch scaling errors that Adam's scale invariance would hide), rtol 1e-4, atol 1e-5.
"""

from __future__ import annotations

import math

import pytest
from dist_harness import run_distributed
from parity_models import ATOL, RTOL, parity_cases

pytestmark = pytest.mark.multiproc

TWO_RANK_DP_TP = [
    ("gpt", dict(dp=2)),
    ("gpt", dict(dp=2, zero_stage=1)),
    ("gpt", dict(dp=2, zero_stage=2)),
    ("gpt", dict(dp=2, zero_stage=3, num_microbatches=2)),
    ("gpt", dict(tp=2)),
    ("gpt", dict(tp=2, sequence_parallel=True)),
    ("hf_llama", dict(tp=2)),  # GQA (4 query / 2 kv heads) and a vocab-parallel LM head
    ("hf_llama", dict(tp=2, sequence_parallel=True)),
    # the zoo's own Llama: its blocks pick rotary rows in the attention, which SP hands the whole sequence
    ("llama_zoo", dict(tp=2, sequence_parallel=True)),
]
TWO_RANK_PP = [
    ("gpt", dict(pp=2, num_microbatches=4, schedule="gpipe")),
    ("gpt", dict(pp=2, num_microbatches=4, schedule="1f1b")),
    ("gpt", dict(pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)),
    ("gpt", dict(pp=2, num_microbatches=2, recompute="full")),
    ("gpt", dict(pp=2, num_microbatches=2, recompute="selective")),
    ("hf_llama", dict(pp=2, num_microbatches=4, schedule="1f1b", recompute="full")),
    ("hf_llama", dict(pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)),
]
def _check(results: list[dict]) -> None:
    failures = []
    for r in results:
        close = all(math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) for a, b in zip(r["losses"], r["ref_losses"],
                                                                                  strict=True))
        if not close:
            failures.append(f"{r['case']}: losses {r['losses']} vs reference {r['ref_losses']}")
        if r["weight_excess"] > ATOL:
            failures.append(f"{r['case']}: weight {r['weight_key']} off by {r['weight_excess']:.2e} beyond rtol")
        if r["grad_excess"] > ATOL:
            failures.append(f"{r['case']}: gradient {r['grad_key']} off by {r['grad_excess']:.2e} beyond rtol")
        if r["missing"] or r["extra"]:
            failures.append(f"{r['case']}: state dict names missing {r['missing']}, extra {r['extra']}")
    assert not failures, "\n".join(failures)


def test_parity_dp_zero_tp_on_two_ranks():
    per_rank = run_distributed(parity_cases, 2, TWO_RANK_DP_TP)
    _check(per_rank[0])
    # the reported loss is the global mean on every rank
    assert [r["losses"] for r in per_rank[1]] == [r["losses"] for r in per_rank[0]]


def test_parity_pipeline_schedules_and_recompute_on_two_ranks():
    per_rank = run_distributed(parity_cases, 2, TWO_RANK_PP)
    _check(per_rank[0])
    assert [r["losses"] for r in per_rank[1]] == [r["losses"] for r in per_rank[0]]

