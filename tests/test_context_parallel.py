"""Context parallelism: the sequence layout, what is refused, and parity with one process.

Parity: five transformers families (Llama, Qwen3, Gemma 3, GPT-NeoX, Phi-3) train 3 AdamW steps under
cp2×tp2, cp2×pp2 (1F1B) and cp2×dp2 with ZeRO-3 on 4 gloo ranks, and under cp2 (also with full,
selective and op_sac recompute) on 2, at a sequence of 14 tokens (not a multiple of 2·cp = 4: padded to 16,
the padding never counted), compared with the same model trained on one process on the whole batch: losses,
final weights and last gradients within rtol 1e-4 / atol 1e-5 (tests/test_parity.py's checks). autopar's
own GPT and Llama (positions through `position_ids`) run under cp2, and the Llama under cp2×pp2.
"""

from __future__ import annotations

import pytest
import torch

from autopar.codegen.context_parallel import SequenceShard, _is_shard_causal, check_context_parallel, shard_positions
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import ConfigError, PlanMismatchError

CP_FAMILIES = ("llama", "qwen3", "gemma3", "gpt_neox", "phi3")
ZOO = ("gpt", "llama_zoo")  # autopar's own models: positions through position_ids, like transformers'
SEQ = 14  # not a multiple of 4·cp


# ---- the layout ----

@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_shards_cover_the_sequence_once_and_balance_causal_work(cp):
    seq = 2 * cp * 5
    shards = [shard_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(shards).tolist()) == list(range(seq))
    # rank r holds chunks r and 2·cp−1−r (design.md §8)
    c = seq // (2 * cp)
    for r, pos in enumerate(shards):
        assert pos.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
    # causal work: query at position p attends p + 1 keys; every rank the same (brute force)
    work = [int((pos + 1).sum()) for pos in shards]
    assert len(set(work)) == 1 and sum(work) == seq * (seq + 1) // 2


def test_split_pads_at_the_end_and_selects_the_chunks():
    shard = SequenceShard(cp=2, rank=0, multiple=4)
    x = torch.arange(2 * 14).reshape(2, 14)
    local = shard.split(x, pad_value=-1)  # padded to 16: chunks 0 and 3 are positions 0-3 and 12-15
    assert local.tolist() == [[0, 1, 2, 3, 12, 13, -1, -1], [14, 15, 16, 17, 26, 27, -1, -1]]
    assert shard.local_positions(8).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def test_only_masks_causal_inside_each_chunk_are_taken_for_the_global_causal_mask():
    s, c = 8, 4
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    packed = causal.clone()
    packed[c:, :c] = False  # what transformers builds from the shard's positions (two packed sequences)
    assert _is_shard_causal(causal, s) and _is_shard_causal(packed[None, None], s)
    additive = torch.zeros(s, s).masked_fill(~causal, float("-inf"))
    assert _is_shard_causal(additive, s)
    window = causal & ~torch.ones(s, s, dtype=torch.bool).tril(-2)  # a sliding window of 2 tokens
    padding = causal[None].repeat(2, 1, 1)
    padding[1, :, 0] = False  # the second sample's first token is padding
    alibi = additive - torch.arange(s).float()
    for bad in (window, padding, alibi, torch.ones(s, s, dtype=torch.bool)):
        assert not _is_shard_causal(bad, s)


def test_cp_is_a_config_field_and_an_option():
    cfg = ParallelConfig(tp=2, cp=4, pp=2, dp=2)
    assert cfg.world_size == 32
    assert ParallelConfig.from_dict(cfg.to_dict()) == cfg
    assert ParallelConfig.parse(str(cfg)) == cfg and "cp=4" in str(cfg)
    assert "cp" not in str(ParallelConfig())  # plans without cp print as before
    assert PlannerOptions(cp=2).cp == 2
    with pytest.raises(ConfigError, match="cp"):
        ParallelConfig(cp=0)
    with pytest.raises(ConfigError, match="compile"):
        ParallelConfig(cp=2, compile=True)


# ---- refused at parallelize, naming the module ----

def _graph(model, seq=SEQ):
    import autopar

    return autopar.capture(model, (torch.zeros(1, seq, dtype=torch.long),))


def test_refuses_models_it_cannot_shard_by_sequence():
    import transformers as hf
    from hf_families import build_family
    from parity_models import handmade_graph


    graph = handmade_graph("hf_llama")  # layers and patterns only: the checks below read the model
    from own_models import build_own

    with pytest.raises(PlanMismatchError, match="NanoGPT.forward takes no position_ids"):
        check_context_parallel(build_own("nanogpt"), graph, 16)
    cfg = hf.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, sliding_window=4)
    cfg._attn_implementation = "sdpa"
    with pytest.raises(PlanMismatchError, match=r": a sliding window of 4 tokens over sequences of 16"):
        check_context_parallel(hf.MistralForCausalLM(cfg), graph, 16)
    check_context_parallel(build_family("llama"), graph, 16)  # accepted
    eager = build_family("gemma2")  # attention computed with explicit matmuls and softmax (found by capture)
    with pytest.raises(PlanMismatchError, match=r"layer model\.layers\.0: .*scaled_dot_product_attention"):
        check_context_parallel(eager, _graph(eager), 16)


# ---- parity in gloo jobs ----

def _run(cases, world_size: int) -> None:
    from dist_harness import run_distributed
    from parity_models import parity_cases
    from test_parity import _check

    per_rank = run_distributed(parity_cases, world_size, cases, 3, SEQ, timeout_s=900)
    _check(per_rank[0])
    for other in per_rank[1:]:  # the reported loss is the global mean on every rank
        assert [r["losses"] for r in other] == [r["losses"] for r in per_rank[0]]


@pytest.mark.multiproc
def test_cp2_with_tp2_pp2_and_zero3_dp2_on_four_ranks():
    layouts = (dict(cp=2, tp=2), dict(cp=2, pp=2, num_microbatches=2), dict(cp=2, dp=2, zero_stage=3))
    _run([*[(f, layout) for f in CP_FAMILIES for layout in layouts], ("llama_zoo", layouts[1])], 4)


@pytest.mark.multiproc
def test_cp2_alone_and_with_each_recompute_mode_on_two_ranks():
    _run([*[(f, dict(cp=2)) for f in (*CP_FAMILIES, *ZOO)],
          ("llama", dict(cp=2, recompute="full", num_microbatches=2)), ("llama", dict(cp=2, recompute="selective")),
          ("llama", dict(cp=2, recompute="op_sac"))], 2)


def _checkpoint_across_layouts(root: str) -> dict:
    """Steps 1-2 under cp2 with ZeRO-3 (FSDP shards over the cp group), saved; step 3 under tp2 from it."""
    import copy

    from parity_models import batches, build_model, graph_of, make_plan, optimizer, train_reference

    from autopar.codegen import lm_cross_entropy, parallelize

    data = batches(3, seq=SEQ)
    model = build_model("llama")
    graph = graph_of("llama", model, SEQ)
    ref_losses, ref_state, _ = train_reference(copy.deepcopy(model), data)
    pm = parallelize(model, make_plan(graph, cp=2, zero_stage=3), graph=graph, optimizer=optimizer,
                     loss_fn=lm_cross_entropy)
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data[:2]]
    pm.save(root)
    other = parallelize(build_model("llama", seed=1), make_plan(graph, tp=2), graph=graph, optimizer=optimizer,
                        loss_fn=lm_cross_entropy)
    other.load(root)
    losses += [other.train_step(other.local_batch(x), other.local_batch(t)) for x, t in data[2:]]
    full = other.full_state_dict()
    worst = max(((full[k] - v).abs() - 1e-4 * v.abs()).max().item() for k, v in ref_state.items())
    return {"losses": losses, "ref_losses": ref_losses, "weight_excess": worst}


@pytest.mark.multiproc
def test_checkpoint_saved_under_cp_resumes_under_tp(tmp_path):
    from dist_harness import run_distributed

    out = run_distributed(_checkpoint_across_layouts, 2, str(tmp_path / "ck"), timeout_s=600)[0]
    assert out["losses"] == pytest.approx(out["ref_losses"], rel=1e-4)
    assert out["weight_excess"] <= 1e-5
