"""The tensor-parallel collectives of one layer, exactly as codegen issues them (the planner prices these).

Per layer at TP degree t > 1, micro-batch b (payloads are the TPPattern's per-sample bytes × b), as
autopar/codegen/tensor_parallel.py and loss.py run them on DTensor (Megatron-LM, Shoeybi et al. 2019 §3;
sequence parallelism, Korthikanti et al. 2022 §4.2.2):

  attention / mlp    forward all-reduce of the row output, backward all-reduce of the input gradient;
                     with SP: all-gather of the input + reduce-scatter of the row output, each way
  per-head tables    an attention's tensors of all heads computed from parameters (T5's relative bias,
                     Swin's window-bias table), cut to the rank's heads (codegen/head_bias.py): backward
                     all-gathers their gradients: head_table_bytes + head_table_bytes_per_sample × b
  embedding          forward all-reduce of its output (vocab-parallel lookup); with SP it is also where
                     the sequence is split: free forward, an all-gather of the gradient backward
  lm_head            backward all-reduce of its input gradient; with SP and sequence-shard input (no
                     gather before it): all-gather of the input forward, reduce-scatter backward
  whole vocabulary   an embedding or head whose vocabulary tp does not divide stays replicated
                     (capture.vocab_split): none of the two rows above, nor the loss's all-reduces below
  loss on lm_head    the vocab-parallel cross-entropy: two forward all-reduces of fp32 per-token values
                     (row max; sum of exponentials stacked with the target logit)
  last SP layer      when no vocab-parallel head follows: an all-gather of its output forward
  full-sequence      a layer inside the SP span that mixes positions in a replicated part (SequenceSpan.
  layer under SP     whole_layers: attention TP keeps whole) runs on the full sequence: an all-gather of its
                     input forward, one of its output's gradient backward (the split after it); its patterns
                     as without SP, its norms on the whole sequence (nothing summed at the step). Such layers
                     at either end of the stack stay outside the span: nothing extra
  norms under SP     their weights stay replicated while the activations are sequence shards, so each
                     norm parameter's gradient is a partial sum, all-reduced once per step when the
                     runtime gives it its parameter's placement (codegen.tensor_parallel.
                     align_grad_placements), in the gradients' dtype (cost_models.precision; phase "step")

Phases: "forward" and "backward" run once per micro-batch, "step" once per optimizer step.
"""

from __future__ import annotations

from typing import NamedTuple

from autopar.capture.graph import LayerSpec, ModelGraph
from autopar.capture.sequence import SequenceSpan, sequence_span
from autopar.capture.vocab_split import layer_at_tp
from cost_models.precision import DTYPE_BYTES, REDUCE_DTYPE

__all__ = ["CE_BYTES_PER_TOKEN", "TPCollective", "tp_collectives"]

# loss.py _VocabParallelCrossEntropy: the fp32 row max [tokens] (4 B) and the stacked sum of exponentials
# and target logit [2, tokens] (8 B).
CE_BYTES_PER_TOKEN = (4, 8)


class TPCollective(NamedTuple):
    op: str  # "all_reduce" | "all_gather" | "reduce_scatter"
    phase: str  # "forward" | "backward" (per micro-batch) | "step" (per optimizer step)
    n_bytes: float  # nccl-tests convention: all-reduce the buffer, all-gather the output, reduce-scatter the input


def tp_collectives(graph: ModelGraph, layer: LayerSpec, *, tp: int, sp: bool, micro_batch: int,
                   span: SequenceSpan | None = None) -> tuple[TPCollective, ...]:
    """The collectives `layer` issues over its TP group (module docstring), in order of appearance."""
    if tp <= 1:
        return ()
    layer = layer_at_tp(layer, tp)  # without the vocabulary patterns tp keeps whole: none of their collectives
    span = span or (sequence_span(graph, tp) if sp else None)
    b = micro_batch
    out: list[TPCollective] = []
    if sp and span is not None and layer.name in span.whole_layers:
        before = graph.layers[[la.name for la in graph.layers].index(layer.name) - 1]
        out += [TPCollective("all_gather", "forward", before.boundary_bytes * b),
                TPCollective("all_gather", "backward", layer.boundary_bytes * b)]
    sharded = sp and span is not None and span.runs_sharded(layer.name)
    for p in layer.tp_patterns:
        n = p.allreduce_bytes_per_sample * b
        if p.kind in ("attention", "mlp"):
            if sharded:
                out += [TPCollective("all_gather", "forward", n), TPCollective("reduce_scatter", "forward", n),
                        TPCollective("all_gather", "backward", n), TPCollective("reduce_scatter", "backward", n)]
            else:
                out += [TPCollective("all_reduce", "forward", n), TPCollective("all_reduce", "backward", n)]
            if p.head_table_bytes or p.head_table_bytes_per_sample:
                tables = p.head_table_bytes + p.head_table_bytes_per_sample * b
                out.append(TPCollective("all_gather", "backward", tables))
        elif p.kind == "embedding":
            out.append(TPCollective("all_reduce", "forward", n))
        elif p.kind == "lm_head":
            if sp and span is not None and span.gather_after is None:
                out += [TPCollective("all_gather", "forward", n), TPCollective("reduce_scatter", "backward", n)]
            else:
                out.append(TPCollective("all_reduce", "backward", n))
            if graph.seq_len:
                out += [TPCollective("all_reduce", "forward", c * b * graph.seq_len) for c in CE_BYTES_PER_TOKEN]
    if sp and span is not None:
        if layer.name == span.scatter_after:
            out.append(TPCollective("all_gather", "backward", layer.boundary_bytes * b))
        if layer.name == span.gather_after:
            out.append(TPCollective("all_gather", "forward", layer.boundary_bytes * b))
        if layer.name in span.sharded_layers:
            elem = DTYPE_BYTES[REDUCE_DTYPE]  # the gradients of fp32 masters under every policy
            out += [TPCollective("all_reduce", "step", n * elem) for n in layer.norm_param_numels]
    return tuple(out)
