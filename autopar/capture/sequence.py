"""Sequence parallelism over a captured graph: where the hidden states are split along the sequence, which
layers must run on the whole sequence, and why SP cannot split a model (Korthikanti et al. 2022 §4.2.2).
Codegen applies these and the planner prices them, so both read them from here."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.graph import LayerSpec, ModelGraph

__all__ = ["SequenceSpan", "sequence_span", "full_sequence_reason", "sequence_parallel_refusal",
           "sequence_parallel_expert_conflict"]


@dataclass(frozen=True, kw_only=True)
class SequenceSpan:
    """Where hidden states are split along the sequence under sequence parallelism (Korthikanti et al.
    2022 §4.2.2). Codegen applies it and the planner prices it, so both read it from here.

    scatter_after: the layer before the first sharded layer; the hidden states entering that layer are
      split (at its input, so glue before it, such as positions built from the sequence length, still
      sees the full sequence).
    gather_after: the layer whose output is gathered back to the full sequence, or None when the
      next layer is a vocab-parallel LM head that takes sequence shards (all-gather inside it).
    Layers in between see sequence shards: their norms run on shards and their TP patterns all-gather
    their input and reduce-scatter their output, except `whole_layers`: layers that mix positions in a
    part tensor parallelism keeps replicated (`full_sequence_reason`) run on the full sequence, gathered
    at their input and split again after their output, their TP patterns as plain TP. Such layers at
    either end of the stack are left outside the span instead (no gather, no split).
    """

    scatter_after: str
    gather_after: str | None
    sharded_layers: tuple[str, ...]  # layers whose inputs are sequence shards, the first block first
    whole_layers: tuple[str, ...] = ()  # inside the span, run on the full sequence

    def runs_sharded(self, layer: str) -> bool:
        """Whether `layer` computes on sequence shards (its norms and memory-bound work split over tp)."""
        return layer in self.sharded_layers


def full_sequence_reason(layer: LayerSpec) -> str | None:
    """Why `layer` cannot run on a sequence shard, or None when it can.

    Attention that no TP pattern splits (a fused q|k|v projection of unequal widths, q/k norms over all
    heads: capture.tp_pairs keeps them replicated) relates every position to every other, so a rank's
    shard of the sequence is not enough, and positions built for the whole sequence (rotary tables) do
    not fit it. Found from the captured kernels: an attention core outside every TP pattern."""
    mix = layer.kernels_forward
    if mix.kernels:
        replicated = any(k.attention_core and not k.tp_sharded for k in mix.kernels)
    else:  # graphs without kernel lists: by their totals
        replicated = mix.attention_flops > mix.attention_flops_tp_sharded
    if not replicated:
        return None
    return (f"layer {layer.name!r} runs attention that tensor parallelism keeps whole (capture split none of its "
            "q/k/v projections: a fused q|k|v projection, or norms over all heads), and attention needs every "
            "position of the sequence")


def sequence_parallel_expert_conflict(graph: ModelGraph, ep: int, etp: int) -> str | None:
    """Why sequence parallelism cannot join expert parallelism (ep or etp > 1) on this model, or None: expert
    parallelism under SP takes each tp rank's tokens as its own sequence shard, which a mixture-of-experts layer
    that runs on the full sequence (`full_sequence_reason`) does not have."""
    if ep <= 1 and etp <= 1:
        return None
    whole = next((la for la in graph.layers if la.moe is not None and full_sequence_reason(la)), None)
    if whole is None:
        return None
    return (f"mixture-of-experts layer {whole.name!r} runs on the full sequence under sequence parallelism "
            f"({full_sequence_reason(whole)}), but ep={ep}, etp={etp} under SP expects each tp rank's own tokens; "
            "set ep=1 and etp=1, or sequence_parallel=False")


def _layer_position(graph: ModelGraph):
    """Sort key: a layer name's position in the graph."""
    index = {la.name: i for i, la in enumerate(graph.layers)}
    return index.__getitem__


def sequence_span(graph: ModelGraph, tp: int | None = None) -> SequenceSpan:
    """From the first block layer through the last block/norm layer of the graph, less the layers at either
    end that must see the full sequence (`full_sequence_reason`); those in between are `whole_layers`.
    At degree `tp` a head whose vocabulary tp does not divide stays replicated (TPPattern.splits) and takes
    the gathered full sequence; without tp every LM head pattern counts as split."""
    names = [la.name for la in graph.layers]
    start = next((i for i, la in enumerate(graph.layers) if la.kind == "block" and i > 0), 1)
    last = max(i for i, la in enumerate(graph.layers) if la.kind in ("block", "norm") or i == 0)
    whole = {i for i in range(start, last + 1) if full_sequence_reason(graph.layers[i])}
    while start <= last and start in whole:
        start += 1
    while last >= start and last in whole:
        last -= 1
    # the head takes sequence shards only when it is the vocab-parallel projection alone: a head that transforms
    # the hidden states first (BERT's dense + norm) would compute replicated weights on one rank's tokens
    head_next = last + 1 < len(names) and any(p.kind == "lm_head" and p.column == graph.layers[last + 1].modules
                                              and (tp is None or p.splits(tp))
                                              for p in graph.layers[last + 1].tp_patterns)
    return SequenceSpan(scatter_after=names[start - 1], gather_after=None if head_next else names[last],
                        sharded_layers=tuple(names[i] for i in range(start, last + 1) if i not in whole),
                        whole_layers=tuple(names[i] for i in range(start, last + 1) if i in whole))


def sequence_parallel_refusal(graph: ModelGraph, tp: int | None = None) -> str | None:
    """Why sequence parallelism cannot split this model (at tp ranks, when given), or None when it can: its
    input is no token sequence (a conv net's [batch, channels, h, w], whose dim 1 is not a sequence); the
    hidden states do not keep one [batch, seq_len, width] shape through the span (an encoder–decoder's second
    stream, Swin's merged patches: what a layer passes on differs in size); tp does not divide the sequence;
    or no block can run on a sequence shard, so SP would only add collectives."""
    if not graph.seq_len:
        return (f"{graph.model_name}'s input is not a sequence of tokens (capture found no [batch, tokens, width] "
                "hidden states: a conv net's dim 1 is channels or height), so nothing can be split along a sequence")
    if tp and graph.seq_len % tp:
        return f"tp={tp} does not divide the {graph.seq_len} tokens of {graph.model_name}'s sequence"
    span = sequence_span(graph)
    if any(graph.layer(n).kind == "block" for n in span.sharded_layers):
        stream = (span.scatter_after, *sorted({*span.sharded_layers, *span.whole_layers}, key=_layer_position(graph)))
        sizes = {n: graph.layer(n).boundary_bytes for n in stream}
        if len(set(sizes.values())) > 1:
            first = graph.layer(stream[0])
            other = next(n for n in stream if sizes[n] != first.boundary_bytes)
            return (f"the hidden states of {graph.model_name} do not keep one shape from {first.name!r} to the "
                    f"last block: {first.name!r} passes on {first.boundary_bytes} bytes per sample, {other!r} "
                    f"{sizes[other]} (a second stream, such as an encoder–decoder's, or a sequence that changes "
                    "length, such as merged patches), so no one sequence dimension runs through it")
        return None
    reasons = [r for la in graph.layers if la.kind == "block" and (r := full_sequence_reason(la))]
    more = f" (and {len(reasons) - 1} more block{'s' if len(reasons) > 2 else ''} alike)" if len(reasons) > 1 else ""
    why = f": {reasons[0]}{more}" if reasons else ""
    return f"no block of {graph.model_name} can run on a sequence shard{why}"
