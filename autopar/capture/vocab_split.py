"""A vocabulary that a tensor-parallel degree does not divide: its embedding and LM head stay whole.

GPT-2 as users build it (`GPT2Config()`) has 50,257 token ids, which no tp > 1 divides. Megatron pads the
vocabulary to a multiple of 128·tp; autopar does not change the user's model, so at such a degree the
vocabulary-parallel patterns (the embedding, the LM head, a tied pair of both: TPPattern.splits) stay
replicated on every tp rank while the heads and MLPs of the blocks are split as usual. Codegen skips those
patterns, the loss is a plain cross-entropy on the full logits, sequence parallelism gathers the hidden states
before such a head (capture.sequence.sequence_span), and the planner prices such a layer through `layer_at_tp`:
its FLOPs, parameters, activations and logits whole on each rank, none of the vocab-parallel collectives.
"""

from __future__ import annotations

import dataclasses

from autopar.capture.graph import VOCAB_KINDS, KernelMix, LayerSpec, ModelGraph, TPPattern

__all__ = ["whole_vocab_patterns", "layer_at_tp", "vocab_parallel_head", "splits_anything", "whole_vocabulary_note"]


def whole_vocab_patterns(graph: ModelGraph, tp: int) -> tuple[tuple[LayerSpec, TPPattern], ...]:
    """(layer, pattern) of each vocabulary pattern that degree tp > 1 keeps replicated (its vocabulary is not
    a multiple of tp)."""
    if tp <= 1:
        return ()
    return tuple((la, p) for la in graph.layers for p in la.tp_patterns
                 if p.kind in VOCAB_KINDS and p.max_degree_ok(tp) and not p.splits(tp))


def vocab_parallel_head(graph: ModelGraph, tp: int) -> bool:
    """Whether degree tp splits an LM head over the vocabulary (its logits sharded, the loss vocab-parallel)."""
    return any(p.kind == "lm_head" and p.splits(tp) for la in graph.layers for p in la.tp_patterns)


def splits_anything(graph: ModelGraph, tp: int) -> bool:
    """Whether degree tp > 1 splits at least one pattern (else its tp ranks would only repeat each other)."""
    return any(p.splits(tp) for la in graph.layers for p in la.tp_patterns)


def _whole(mix: KernelMix) -> KernelMix:
    """The pass with nothing divided by tp."""
    def unsharded(ks):
        return tuple(dataclasses.replace(k, tp_sharded=False) if k.tp_sharded else k for k in ks)
    return dataclasses.replace(mix, gemm_flops_tp_sharded=0.0, attention_flops_tp_sharded=0.0,
                               memory_bytes_tp_sharded=0.0, kernels=unsharded(mix.kernels), fused=unsharded(mix.fused))


def layer_at_tp(layer: LayerSpec, tp: int) -> LayerSpec:
    """`layer` as degree tp runs it: without the vocabulary patterns tp keeps replicated and, when no pattern
    of the layer is left split, with nothing TP-sharded (its FLOPs, parameters and saved activations whole on
    each rank). The layer itself where tp splits every pattern it has (the common case: the same object).

    A layer that holds both a replicated vocabulary pattern and a split head or MLP pattern (capture keeps the
    embedding and the LM head outside the blocks, so none does in the model zoo) keeps its TP-sharded share:
    capture does not record which pattern a kernel belongs to."""
    if tp <= 1 or all(p.splits(tp) or p.kind not in VOCAB_KINDS for p in layer.tp_patterns):
        return layer
    kept = tuple(p for p in layer.tp_patterns if p.kind not in VOCAB_KINDS or p.splits(tp))
    if kept:
        return dataclasses.replace(layer, tp_patterns=kept)
    sac = layer.saved_activation_bytes_op_sac_tp_sharded
    sel = layer.saved_activation_bytes_selective_tp_sharded
    return dataclasses.replace(layer, tp_patterns=(), forward_flops_tp_sharded=0.0,
                               saved_activation_bytes_tp_sharded=0,
                               saved_activation_bytes_op_sac_tp_sharded=None if sac is None else 0,
                               saved_activation_bytes_selective_tp_sharded=None if sel is None else 0,
                               kernels_forward=_whole(layer.kernels_forward),
                               kernels_backward=_whole(layer.kernels_backward))


def whole_vocabulary_note(graph: ModelGraph, tp: int) -> str | None:
    """The plan note for a vocabulary degree tp leaves whole, or None."""
    found = whole_vocab_patterns(graph, tp)
    if not found:
        return None
    vocab = sorted({p.vocab_size for _, p in found if p.vocab_size})
    kinds = {p.kind for _, p in found}
    what = ("the embedding and LM head" if kinds == set(VOCAB_KINDS) else
            "the embedding" if kinds == {"embedding"} else "the LM head")
    sizes = ", ".join(f"{v:,}" for v in vocab)
    verb = "stays" if len(found) == 1 else "stay"
    return (f"vocabulary {sizes} is not divisible by tp={tp}: {what} {verb} replicated on every tp rank "
            "(the rest of the model is split; a vocabulary padded to a multiple of tp would split them too)")
