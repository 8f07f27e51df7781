"""Parity of op-level selective checkpointing, per-layer recompute mixes and compiled blocks with
single-device training (tests/test_parity.py's cases and tolerances: losses at every step, final weights
and last gradients, rtol 1e-4). Recompute must not change a single number beyond float round-off: the
recomputed forward is the forward. Compiling is slow on 2 cores, so one compiled case, on one rank."""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from parity_models import parity_cases
from test_parity import _check

pytestmark = pytest.mark.multiproc

TWO_RANK = [
    ("gpt", dict(dp=2, recompute="op_sac")),
    ("gpt", dict(tp=2, recompute="op_sac")),  # the policy sees DTensor matmuls and TP all-reduces
    ("hf_llama", dict(dp=2, zero_stage=3, recompute="op_sac")),  # bias-free mm, SDPA, under FSDP2
    # k of n layers: one block recomputes op-level, the other keeps everything (one stage)
    ("gpt", dict(dp=2, layer_recompute={"blocks.0": "op_sac", "blocks.1": "none"})),
    # each pipeline stage its own mix
    ("gpt", dict(pp=2, num_microbatches=2, layer_recompute={"blocks.0": "selective", "blocks.1": "full"})),
]
ONE_RANK_COMPILED = [
    ("gpt", dict(compile=True, recompute="op_sac")),
]


def test_parity_op_sac_and_per_layer_recompute_on_two_ranks():
    per_rank = run_distributed(parity_cases, 2, TWO_RANK)
    _check(per_rank[0])
    assert [r["losses"] for r in per_rank[1]] == [r["losses"] for r in per_rank[0]]


def test_parity_compiled_blocks_with_op_sac():
    _check(run_distributed(parity_cases, 1, ONE_RANK_COMPILED, timeout_s=600)[0])
