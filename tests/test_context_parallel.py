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
    assert ParallelConfig(cp=2, compile=True).compile  # compiled blocks under cp (refused before issue 40)


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


COMPILED = (("llama", dict(cp=2, compile=True, recompute="full")), ("llama", dict(cp=2, compile=True)),
            ("qwen3", dict(cp=2, compile=True, recompute="op_sac")),
            ("qwen3", dict(cp=2, compile=True, recompute="selective")))


def _counted(fn, calls: dict[str, int], name: str):
    def call(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return call


def _compiled_cases(cases) -> list[dict]:
    """Each case (dynamo's caches reset first) with: the compiled graphs and graph breaks dynamo counted, and
    the K/V all-gathers and reduce-scatters the rank ran (the custom ops' collectives, eager or compiled);
    then a mask that is not causal, refused from inside a compiled, checkpointed unit, naming it."""
    import torch._dynamo
    import torch.distributed as dist
    import torch.nn.functional as F
    from parity_models import _GRAPHS, parity_case
    from torch import nn
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen.compile import apply_compile
    from autopar.codegen.context_parallel import ContextParallel
    from autopar.codegen.recompute import apply_recompute

    out = []
    for kind, cfg in cases:
        torch._dynamo.reset()
        counters.clear()
        calls = {"all_gather_single": 0, "reduce_scatter_single": 0}
        originals = {name: getattr(dist, name) for name in calls}
        for name in calls:
            setattr(dist, name, _counted(originals[name], calls, name))
        try:
            result = parity_case(kind, cfg, 3, SEQ)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        blocks = sum(la.kind == "block" for la in _GRAPHS[kind, SEQ].layers)
        out.append({**result, **calls, "blocks": blocks, "graphs": counters["stats"]["unique_graphs"],
                    "breaks": sorted(counters["graph_break"])})

    class Attend(nn.Module):
        def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask) * 2.0

    cp = ContextParallel(init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))["cp"],
                         SequenceShard(cp=2, rank=dist.get_rank(), multiple=4))
    unit = Attend()
    unit.forward = cp.wrap(unit.forward, "blocks.7.attn")
    apply_recompute(unit, "full")
    apply_compile(unit, enters_modes=True)
    padding = torch.ones(1, 1, 8, 8, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
    padding[1, ..., 0] = False  # the second sample's first token is padding
    try:
        unit(torch.randn(2, 2, 8, 4, requires_grad=True), padding)
        out.append({"refused": None})
    except PlanMismatchError as e:
        out.append({"refused": str(e)})
    return out


@pytest.mark.multiproc
def test_cp2_with_compiled_blocks_and_recompute_on_two_ranks():
    """Compiled blocks under cp2 (Llama and Qwen3; none, full, op_sac and selective recompute): single-process
    parity, the attention compiled with its block (no graph break), and the K/V exchanged as priced
    (autopar.planner.cp_costs): one all-gather per block and step, two under full recompute (the compiled
    backward recomputes it), one reduce-scatter."""
    from dist_harness import run_distributed
    from test_parity import _check

    per_rank = run_distributed(_compiled_cases, 2, COMPILED, timeout_s=900)
    for results in per_rank:
        *cases, refusal = results
        _check(cases)
        for r, (_, cfg) in zip(cases, COMPILED, strict=True):
            assert r["graphs"] >= 1 and r["breaks"] == [], (r["case"], r["graphs"], r["breaks"])
            steps = len(r["losses"])
            again = 2 if cfg.get("recompute") == "full" else 1
            assert (r["all_gather_single"], r["reduce_scatter_single"]) == (again * steps * r["blocks"],
                                                                            steps * r["blocks"]), r["case"]
        assert refusal["refused"] is not None and refusal["refused"].startswith(
            "blocks.7.attn: its attention mask is not causal"), refusal
    assert [r["losses"] for r in per_rank[1][:-1]] == [r["losses"] for r in per_rank[0][:-1]]


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
