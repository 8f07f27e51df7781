"""Conformance: transformers' causal-LM families train under every layout as they do on one process.

Each family (tests/hf_families.py: tied and untied embeddings, position embeddings added beside the
token embedding, model-level rotary tables, fused q|k|v and gate|up projections, parallel
attention/MLP blocks, logit soft-capping) runs 3 AdamW steps under dp2, tp2 (with sequence parallelism
wherever the planner may choose it) and pp2 with 1F1B;
GPT-2 and Gemma also under tp2×dp2, Gemma under tp2×pp2×dp2 with ZeRO-3 (with Llama,
in tests/test_eight_ranks.py). Each is compared with the same initial model trained on one process on the
whole batch: losses at every step, final weights and last gradients within rtol 1e-4 / atol 1e-5,
and the state dict under the single-device names (the checks of tests/test_parity.py). Cases share
their processes (one gloo job per layout), so every family is captured once per job.
"""

from __future__ import annotations

import pytest
from dist_harness import run_distributed
from hf_families import FAMILIES
from test_parity import _check

pytestmark = pytest.mark.multiproc

STEPS = 3
PP = dict(pp=2, num_microbatches=2, schedule="1f1b")
# tp2 with sequence parallelism wherever the planner may choose it: off only for the families it refuses it
# (attention TP keeps whole in every block: GPT-2, GPT-NeoX, Phi-3, Falcon, DeepSeek-V3's MLA)
TP = dict(tp=2, sequence_parallel="planner")


def _run(cases: list, world_size: int, timeout_s: float = 600.0) -> None:
    from parity_models import check_experts_split, parity_cases

    per_rank = run_distributed(parity_cases, world_size, cases, STEPS, timeout_s=timeout_s)
    _check(per_rank[0])
    for i, (_, config) in enumerate(cases):
        check_experts_split([r[i] for r in per_rank], config.get("ep", 1), config.get("etp", 1))
    for other in per_rank[1:]:  # the reported loss is the global mean on every rank
        assert [r["losses"] for r in other] == [r["losses"] for r in per_rank[0]]


@pytest.mark.parametrize("half", [0, 1])
def test_families_data_parallel(half):
    _run([(f, dict(dp=2)) for f in FAMILIES[half::2]], 2)


@pytest.mark.parametrize("half", [0, 1])
def test_families_tensor_parallel(half):
    _run([(f, TP) for f in FAMILIES[half::2]], 2)


@pytest.mark.parametrize("half", [0, 1])
def test_families_pipeline_1f1b(half):
    _run([(f, PP) for f in FAMILIES[half::2]], 2)


def test_tp2_dp2_on_four_ranks():
    """The layouts the bug reports named: GPT-2 (position embedding added beside the token embedding, head
    tied to it) and Gemma (scaled, tied embedding) under tp2 × dp2; Phi-3 (grouped-query attention in one
    fused q|k|v projection of unequal blocks, 4 query and 2 key/value heads) under tp2 × pp2.
    Then expert parallelism (autopar.codegen.experts) on the MoE families: ep2 × edp2 (dp4; ZeRO-1 for
    Mixtral and Qwen3-MoE, expert states owned within the ranks holding them); ep2 under tp2, folded over the
    tp pair (edp2: Mixtral and Qwen3-MoE with sequence parallelism, Qwen3-MoE with ZeRO-2 over edp; DeepSeek,
    whose MLA is refused under SP, splitting its replicated tokens over tp); ep4 folded over tp2 × dp2
    (Mixtral, Qwen3-MoE: the tokens split over tp, dispatched over all four ranks); and under pp2 1F1B.
    Experts tensor-parallel (etp2, autopar.codegen.expert_tp): ep2 over the dp pair, each expert's FFN split
    over the tp pair, on all four MoE families (Mixtral and Qwen3-MoE under sequence parallelism, Qwen3-MoE
    with ZeRO-2 over edp, GPT-OSS's interleaved gate|up with biases under ZeRO-1)."""
    from hf_families import MOE_FAMILIES

    moe = MOE_FAMILIES[:4]
    _run([("gpt2", dict(tp=2, dp=2)), ("gemma", dict(tp=2, dp=2, zero_stage=1)),
          ("phi3", dict(tp=2, pp=2, num_microbatches=2, schedule="1f1b"))]
         + [(f, dict(dp=4, ep=2, zero_stage=1 if f in moe[:2] else 0)) for f in moe]
         + [("mixtral", dict(tp=2, dp=2, ep=2, sequence_parallel=True)),
            ("qwen3_moe", dict(tp=2, dp=2, ep=2, sequence_parallel=True, zero_stage=2)),
            ("deepseek_v3", dict(tp=2, dp=2, ep=2))] + [(f, dict(tp=2, dp=2, ep=4)) for f in moe[:2]]
         + [(f, dict(PP, dp=2, ep=2)) for f in moe]
         + [("mixtral", dict(tp=2, dp=2, ep=2, etp=2, sequence_parallel=True)),
            ("qwen3_moe", dict(tp=2, dp=2, ep=2, etp=2, sequence_parallel=True, zero_stage=2)),
            ("deepseek_v3", dict(tp=2, dp=2, ep=2, etp=2)), ("gpt_oss", dict(tp=2, dp=2, ep=2, etp=2, zero_stage=1))],
         4)


def test_own_model_with_skip_connection_tied_head_and_root_parameter():
    """Not a transformers family: embeddings summed at top level, a skip connection from them to the head
    across every block (three tensors cross the cut), a head tied to the token embedding (a replica on
    each end of the pipeline, including two stages on one rank under interleaving) and a root-level
    parameter read by top-level code (held by every stage)."""
    _run([("skip_tied", dict(dp=2)), ("skip_tied", PP),
          ("skip_tied", dict(pp=2, num_microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)),
          ("skip_tied", dict(pp=2, num_microbatches=2, schedule="gpipe", recompute="full"))], 2)


def test_moe_families_dp_tp_pp():
    """Mixture-of-experts families (tests/hf_families.py MOE_FAMILIES: Mixtral, Qwen3-MoE, DeepSeek-V3 with
    multi-head latent attention, a shared expert and a dense first layer, GPT-OSS with biased, transposed
    experts and attention sinks, one logit per head joined to the scores, cut to a rank's heads:
    autopar.codegen.head_bias) under dp2, tp2 (experts replicated over the TP group; with sequence parallelism
    but for DeepSeek-V3, whose MLA tensor parallelism keeps whole: MoE blocks on sequence shards, the gradients
    of the router and the experts summed over tp) and pp2 1F1B, in one gloo job: the grouped-GEMM experts, the
    router and the permutation run as the model's own code on every layout; Mixtral and Qwen3-MoE also under
    tp2 × ep2, the experts folded over the tp pair (Parallel Folding: each tp rank dispatches half the tokens
    both hold). Expert parallelism runs on four ranks too (test_tp2_dp2_on_four_ranks: ep2 alone inside each
    stage of pp2 × ep2,
    ep2 × edp2, ep2 and ep4 folded over tp2) and eight (tests/test_eight_ranks.py). GPT-OSS also with its
    experts tensor-parallel without EP (etp2: biased, interleaved gate|up split over the tp pair). Mixtral (tp2 × ep2)
    and GPT-OSS (dp2) also with selective recompute, whose blocks write into tensors in place."""
    from hf_families import MOE_FAMILIES

    families = MOE_FAMILIES[:4]
    _run([(f, dict(dp=2)) for f in families] + [(f, TP) for f in families]
         + [(f, PP) for f in families]
         + [(f, dict(tp=2, ep=2)) for f in families[:2]] + [("gpt_oss", dict(tp=2, etp=2))]
         # selective recompute over blocks that write in place (router weights divided, outputs accumulated)
         + [("mixtral", dict(tp=2, ep=2, recompute="selective")), ("gpt_oss", dict(dp=2, recompute="selective"))], 2)
