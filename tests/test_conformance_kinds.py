"""Conformance beyond causal LMs: transformers' vision transformers, conv nets with batch norm, encoder
masked LMs, encoder–decoders and windowed-attention models (tests/hf_kinds.py) train with single-process
numerics, each given its batch as its forward takes it (a dict of keyword inputs: pixel values; ids with
a padding mask; an encoder–decoder's ids, mask and decoder ids).

One gloo job of 2 ranks runs every case (each family is captured once per job): ZeRO-3 under dp2 (batch
norm synchronised over the ranks per micro-batch, compared with one process on the same micro-batches),
pp2 with 1F1B (a ViT whose later stage reads the patch embedding's dtype; T5 cut inside its decoder, the
encoder's output carried to the second stage and its dropout, called after the embedding and again after
the final norm, run where each call is; a conv net's batch-norm statistics through the
runtime's shape inference) and tp2 (every attention split by head: BERT's post-norm encoder attention, T5's
bias-free self- and cross-attention with its relative position bias cut to each rank's heads, its tied
`shared`/`embed_tokens`/`lm_head` vocab-parallel; Swin v2's window attention beside its position-bias MLP);
a conv net under tp2 is refused (nothing to split). Losses at every step, final weights and buffers (running statistics)
and last gradients within rtol 1e-4 / atol 1e-5 (tests/test_parity.py's checks). The other families of
each kind ran the same layouts by hand (README, "What each model kind gets").
"""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from test_parity import _check

pytestmark = pytest.mark.multiproc

ZERO3 = dict(dp=2, zero_stage=3, num_microbatches=2)
PP = dict(pp=2, num_microbatches=2, schedule="1f1b")
CASES = [("resnet", ZERO3), ("t5", ZERO3), ("swin", ZERO3),
         ("vit", PP), ("t5", dict(PP, stage_sizes=(6, 3))), ("regnet", PP),
         ("deit", dict(tp=2)), ("bert", dict(tp=2)), ("t5", dict(tp=2)), ("swinv2", dict(tp=2))]
REFUSED = (("resnet", dict(tp=2)),)


def test_model_kinds_train_as_one_process():
    from parity_kinds import kind_cases

    per_rank = run_distributed(kind_cases, 2, CASES, 2, REFUSED, timeout_s=600)
    results = [r for r in per_rank[0] if "refused" not in r]
    _check(results)
    for other in per_rank[1:]:
        assert [r["losses"] for r in other if "refused" not in r] == [r["losses"] for r in results]
    for r in per_rank[0]:
        if "refused" in r:
            assert r["refused"] and "tensor parallelism" in r["refused"], r
