"""Which linears tensor parallelism splits in models other than causal LMs (tests/hf_kinds.py), found from data
flow: encoder self-attention after a post-norm block (BERT), T5's bias-free attention with a relative position
bias passed from block to block, cross-attention, Swin's window attention with its position-bias table and
Swin v2's with a position-bias MLP over fixed coordinates (never a TP pair); tied aliases (T5's `shared`,
never called, beside `encoder.embed_tokens`, `decoder.embed_tokens` and `lm_head`) split alike; a conv net,
with nothing to split, refused under tp. Training with these patterns: tests/test_conformance_kinds.py.
"""

from __future__ import annotations

import pytest
from hf_kinds import HEADS, build_kind, example

import autopar
from autopar.cluster import Cluster
from autopar.errors import InfeasiblePlanError

_GRAPHS: dict[str, autopar.ModelGraph] = {}


def _patterns(kind: str) -> dict[str, list[tuple[str, tuple[str, ...], tuple[str, ...]]]]:
    if kind not in _GRAPHS:
        _GRAPHS[kind] = autopar.capture(build_kind(kind), (), example(kind))
    return {la.name: [(p.kind, p.column, p.row) for p in la.tp_patterns] for la in _GRAPHS[kind].layers}


def _short(names: tuple[str, ...], prefix: str) -> tuple[str, ...]:
    return tuple(sorted(n.removeprefix(prefix) for n in names))


def test_t5_every_attention_and_the_tied_vocabulary():
    pats = _patterns("t5")
    for stack, attentions in (("encoder", ["layer.0.SelfAttention"]),
                              ("decoder", ["layer.0.SelfAttention", "layer.1.EncDecAttention"])):
        for block in (f"{stack}.block.0", f"{stack}.block.1"):  # block 0 computes the bias, block 1 is given it
            found = {_short(cols, f"{block}.") + _short(rows, f"{block}.") for k, cols, rows in pats[block]
                     if k == "attention"}
            assert found == {(f"{a}.k", f"{a}.q", f"{a}.v", f"{a}.o") for a in attentions}, (block, pats[block])
            assert [k for k, _, _ in pats[block]].count("mlp") == 1
    # shared / encoder.embed_tokens / decoder.embed_tokens / lm_head: one weight, vocab-parallel everywhere used
    assert pats["encoder.embed_tokens"] == [("embedding", ("encoder.embed_tokens",), ())]
    assert pats["decoder.embed_tokens"] == [("embedding", ("decoder.embed_tokens",), ())]
    assert pats["lm_head"] == [("lm_head", ("lm_head",), ())]
    assert "tied_weights_replicated" not in _GRAPHS["t5"].metadata


def test_post_norm_encoder_attention_and_tied_head_bias():
    pats = _patterns("bert")
    block = "bert.encoder.layer.0"
    assert (("attention", tuple(f"{block}.attention.self.{n}" for n in ("query", "key", "value")),
             (f"{block}.attention.output.dense",)) in pats[block])
    assert pats["bert.embeddings"] == [("embedding", ("bert.embeddings.word_embeddings",), ())]
    assert pats["cls"] == [("lm_head", ("cls.predictions.decoder",), ())]  # its bias aliased by cls.predictions


@pytest.mark.parametrize("kind", ["swin", "swinv2"])
def test_window_attention_split_by_head_and_bias_mlp_never_a_pair(kind):
    pats = _patterns(kind)
    blocks = [name for name in pats if ".layers." in name]
    assert blocks
    for name in blocks:
        kinds = sorted(k for k, _, _ in pats[name])
        assert kinds == ["attention", "mlp"], (name, pats[name])
        assert not any("position_bias" in n for _, cols, rows in pats[name] for n in (*cols, *rows))
    heads = {p.num_heads for la in _GRAPHS[kind].layers for p in la.tp_patterns if p.kind == "attention"}
    assert heads == {2, HEADS}  # the two stages' head counts


def test_nothing_to_split_is_refused_saying_so():
    assert not any(_patterns("resnet").values())
    with pytest.raises(InfeasiblePlanError, match="no layer of .* has anything tensor parallelism can split"):
        autopar.plan(_GRAPHS["resnet"], Cluster.preset("dgx-h100"), global_batch_size=8,
                     options=autopar.PlannerOptions(tp=2))
