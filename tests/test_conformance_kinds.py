"""Conformance beyond causal LMs: transformers' vision transformers, conv nets with batch norm, encoder
masked LMs, encoder–decoders and windowed-attention models (tests/hf_kinds.py) train with single-process
numerics, each given its batch as its forward takes it (a dict of keyword inputs: pixel values; ids with
a padding mask; an encoder–decoder's ids, mask and decoder ids).

Two families of each kind under every layout, 3 AdamW steps each, in one gloo job of 2 ranks (each
family is captured once per job): ZeRO-3 under dp2 (batch norm synchronised over the ranks per
micro-batch, compared with one process on the same micro-batches; ResNet with one micro-batch, so its
reference is one process over the whole batch), pp2 with 1F1B (a ViT whose later stage reads the patch
embedding's dtype; T5 cut inside its decoder, the encoder's output carried to the second stage and its
dropout, called after the embedding and again after the final norm, run where each call is; BART cut
where an even split falls; conv nets' batch-norm statistics through the runtime's shape inference) and
tp2 with sequence parallelism wherever the planner may choose it (BERT, RoBERTa, DeiT; the hidden states
gathered before a head that transforms them, BERT's; not ViT's 17 tokens, nor the encoder–decoders' and
Swin's streams that change shape), every attention split by head (BERT's and RoBERTa's post-norm encoder attention,
T5's bias-free self- and cross-attention with its relative position bias cut to each rank's heads, tied
`shared`/`embed_tokens`/`lm_head` vocab-parallel; Swin's and Swin v2's window attention beside their
position-bias tables and MLP); conv nets under tp2 are refused (nothing to split). The encoder–decoders
take their own inputs (ids, mask, decoder ids) under every layout. Losses at every step, final weights
and buffers (running statistics) element-wise and last gradients per tensor (of its largest entry:
tests/parity_kinds.py says why) within rtol 1e-4 / atol 1e-5 (tests/test_parity.py's checks).
tests/test_eight_ranks.py runs T5 under tp2 × pp2 × dp2. The bytes every case's first step all-gathers
(under tp2: the gradients of per-head tables cut to a rank's heads, codegen/head_bias.py, and sequence
parallelism's gathers) equal what the cost model prices (planner/tp_costs.py).
"""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from test_parity import _check

pytestmark = pytest.mark.multiproc

ZERO3 = dict(dp=2, zero_stage=3, num_microbatches=2)
WHOLE = dict(dp=2, zero_stage=3, num_microbatches=1)  # batch norm over the whole batch, as one process
PP = dict(pp=2, num_microbatches=2, schedule="1f1b")
TP = dict(tp=2, sequence_parallel="planner")  # SP wherever the planner may choose it (BERT, RoBERTa, DeiT)
CASES = [  # two families of each kind under every layout (tests/hf_kinds.py)
    ("vit", ZERO3), ("deit", ZERO3), ("resnet", WHOLE), ("regnet", ZERO3), ("bert", ZERO3), ("roberta", ZERO3),
    ("t5", ZERO3), ("bart", ZERO3), ("swin", ZERO3), ("swinv2", ZERO3),
    ("vit", PP), ("deit", PP), ("resnet", PP), ("regnet", PP), ("bert", PP), ("roberta", PP),
    ("t5", dict(PP, stage_sizes=(6, 3))), ("bart", PP), ("swin", PP), ("swinv2", PP),
    ("vit", TP), ("deit", TP), ("bert", TP), ("roberta", TP), ("t5", TP), ("bart", TP), ("swin", TP), ("swinv2", TP),
]
REFUSED = (("resnet", TP), ("regnet", TP))  # conv nets: nothing tensor parallelism can split


def test_model_kinds_train_as_one_process():
    from parity_kinds import kind_cases

    per_rank = run_distributed(kind_cases, 2, CASES, 3, REFUSED, timeout_s=600)
    results = [r for r in per_rank[0] if "refused" not in r]
    _check(results)
    for other in per_rank[1:]:
        assert [r["losses"] for r in other if "refused" not in r] == [r["losses"] for r in results]
    # the all-gathers of per-head tables' gradients (T5, Swin, Swin v2 under tp2) and of sequence parallelism
    # (BERT, RoBERTa, DeiT under tp2), as priced
    for r in results:
        assert r["gathered_bytes"] == r["planned_gathered_bytes"], r
    gathering = {r["case"].split()[0] for r in results if r["gathered_bytes"] > 0}
    assert gathering == {"t5", "swin", "swinv2", "bert", "roberta", "deit"}, gathering
    assert {r["case"].split()[0] for r in results if r["sequence_parallel"]} == {"bert", "roberta", "deit"}
    refusals = [r for r in per_rank[0] if "refused" in r]
    assert len(refusals) == len(REFUSED)
    for r in refusals:
        assert r["refused"] and "has anything tensor parallelism can split" in r["refused"], r
