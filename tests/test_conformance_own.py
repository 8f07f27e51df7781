"""Conformance: self-written models (tests/own_models.py) train under every layout as on one process.

Eleven models in the styles people write outside transformers — nanoGPT (ModuleDict, fused q|k|v, tied head,
`(logits, loss)`), Meta's Llama (complex rotary tables, grouped-query attention, export-only), hand-written
softmax attention with a cached mask buffer, lambdas and partials held in modules with a label-shifting
`.loss`, a scalar loss under `target_arg="y"`, one block applied at every depth between blocks of its own,
a forward returning a dict, an encoder–decoder of torch's own layers, blocks under its own
torch.utils.checkpoint, `nn.ParameterList` weights read by an einsum MLP beside `nn.MultiheadAttention`, and a
cumsum recurrence with vocabulary-wide projections — each under tp2, pp2 (1F1B) and dp2 with ZeRO-3 (one gloo
job for the 33 cases),
and nanoGPT under tp2×pp2×dp2 with ZeRO-3 on 8 ranks (tests/test_eight_ranks.py).
Models with their own loss train on it (`loss_fn` omitted), with targets partly `ignore_index` so that ranks
and micro-batches average over different token counts. Each is compared with the same initial model trained on
one process on the whole batch: losses at every step, final weights and last gradients within rtol 1e-4 / atol
1e-5 after 3 AdamW steps.
"""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from own_models import MODELS, own_cases
from test_parity import _check

pytestmark = pytest.mark.multiproc

LAYOUTS = (dict(tp=2), dict(pp=2, num_microbatches=2, schedule="1f1b"), dict(dp=2, zero_stage=3))


def _run(cases: list, world_size: int) -> None:
    per_rank = run_distributed(own_cases, world_size, cases, timeout_s=900.0)
    _check(per_rank[0])
    for other in per_rank[1:]:  # the reported loss is the global mean on every rank
        assert [r["losses"] for r in other] == [r["losses"] for r in per_rank[0]]


def test_own_models_under_tp2_pp2_and_zero3():
    _run([(name, layout) for name in MODELS for layout in LAYOUTS], 2)

