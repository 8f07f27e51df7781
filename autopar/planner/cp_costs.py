"""Context parallelism's own costs per layer, as codegen/context_parallel.py runs it.

Under cp each rank holds 2 of the 2·cp chunks of every sequence (rank r: chunks r and 2·cp−1−r), so every
per-token cost of a layer (GEMMs, memory-bound kernels, TP collectives, saved activations, p2p sends,
logits) is that of mbs/cp samples (`Candidate.tokens_share`), and causal attention, balanced by the mirrored
chunks, is 1/cp of the layer's too. On top of that, per layer with attention and micro-batch:

  K/V exchange   one all-gather of the layer's keys and values over the cp group in forward (their
                 full-sequence bytes, 2·b·s·(kv_heads/t)·head_dim elements, leave the group's ranks as
                 their sum) and one reduce-scatter of their gradients in backward, each priced as the
                 collective it is over cp ranks (ranks spaced by tp in the mesh ("pp","dp","cp","tp"):
                 inside a node when tp·cp ≤ devices per node, else across nodes, bounded by the slowest
                 link). Codegen issues them blocking (attention needs the keys), so nothing hides them;
                 full recompute gathers again, the selective policies keep the gather's output (one custom op,
                 codegen/context_parallel.py; compiled blocks recompute alike). All-gather rather than
                 a ring: one collective per layer where a ring takes cp − 1 steps each exposed unless
                 overlapped with a block of attention, and with grouped-query attention the K/V bytes are
                 small (Llama 3 ran it so, Dubey et al. 2024 §3.3.2).
  causal blocks  each query chunk attends the keys up to its own end, a c × (g+1)·c block for chunk g:
                 a rank computes c²·(2·cp + 1) scores, (2·cp + 1)/(4·cp) of its 1/cp share of the full score
                 matrix. Only the last c × c block of each rectangle is causal, so the kernels run at the rate
                 of kernels that compute every tile: (2·cp + 1)/(4·cp) of the full-matrix price, in place of
                 the causal price of a whole-sequence triangle that the layer's kernels carry
                 (cost_models.compute.CAUSAL_TIME_FRACTION: its diagonal tiles' masking and its query blocks'
                 unequal work, 0.651 of the forward where the computed half is ~0.5). Priced at the flash
                 kernel's rate, as a kernel that skips masked tiles runs the rectangles (Llama 3's); codegen
                 hands SDPA the lower-right mask explicitly, which it may run on its memory-efficient kernel.
  memory         the gathered K/V stay saved for backward, at the key/value heads the model hands SDPA
                 (codegen/cp_attention.py, as flash saves its inputs), in place of the K/V the layer's own SDPA
                 saves at the shard's length, which capture counts with each KV head repeated to the query
                 heads (capture.kernels._sdpa): under none and selective, the gathered K/V less those
                 (`CPLayerCosts.saved_bytes`); under op_sac, whose policy keeps the gather's output but not
                 SDPA's inputs, all of the gathered K/V; full recompute keeps only the layer input. Nothing
                 of the causal mask: the chunks run as flash kernels without one (codegen/cp_attention.py).
                 Measured per rank and mode on a 16k-token sequence: benchmarks/cp_memory.py,
                 tests/test_cp_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.graph import LayerSpec, ModelGraph

__all__ = ["CPLayerCosts", "kv_exchange_bytes", "cp_ranks_per_node", "cp_layer_costs"]


def kv_exchange_bytes(graph: ModelGraph, layer: LayerSpec, *, tp: int, micro_batch: float, elem: int,
                      repeated: bool = False) -> float:
    """Bytes of a layer's keys and values over the whole sequence on one tensor-parallel rank (what the
    all-gather returns), for `micro_batch` samples; `repeated`: with each KV head repeated to the query heads
    (as capture counts what the layer's SDPA saves)."""
    total = 0.0
    for p in layer.tp_patterns:
        if p.kind == "attention" and graph.seq_len:
            head_dim = p.head_dim or (graph.hidden_size or 0) // p.num_heads
            heads = p.num_heads if repeated else (p.num_kv_heads or p.num_heads)
            total += 2.0 * micro_batch * graph.seq_len * heads / tp * head_dim * elem
    return total


def cp_ranks_per_node(*, tp: int, cp: int, devices_per_node: int) -> int:
    """Ranks of one cp group on a node: cp ranks spaced tp apart, so all of them when tp·cp fits a node."""
    return cp if tp * cp <= devices_per_node else max(1, devices_per_node // tp)


@dataclass(frozen=True, kw_only=True)
class CPLayerCosts:
    """Context parallelism's additions to one layer, per micro-batch."""

    forward_s: float  # the K/V all-gather
    backward_s: float  # the reduce-scatter of their gradients
    attention_extra_forward_s: float  # the rectangles' price less the layer's causal kernels' (negative: cheaper)
    attention_extra_backward_s: float
    gathered_kv_bytes: float = 0.0  # the gathered K/V the attention saves for backward
    shard_kv_bytes: float = 0.0  # the K/V the layer's SDPA saves at the shard, as capture counts them (repeated)
    # selective priced from its policy's cache (LayerSpec.saved_activation_bytes_selective), which holds the
    # shard's K/V once (the fused kernel's head repeat is not cached) and no SDPA saves: nothing to take off
    selective_measured: bool = False

    @property
    def attention_extra_s(self) -> float:
        return self.attention_extra_forward_s + self.attention_extra_backward_s

    def saved_bytes(self, mode: str) -> float:
        """Bytes the layer keeps under cp beyond 1/cp of what it keeps whole, per recompute mode (docstring)."""
        if mode == "full":
            return 0.0
        repeated = mode == "none" or mode == "selective" and not self.selective_measured
        return self.gathered_kv_bytes - (self.shard_kv_bytes if repeated else 0.0)


def cp_layer_costs(graph: ModelGraph, layer: LayerSpec, *, tp: int, cp: int, micro_batch: int, elem: int,
                   attention_s: tuple[float, float], collective_s, devices_per_node: int,
                   attention_full_s: tuple[float, float] | None = None, selective_cache: bool = True
                   ) -> CPLayerCosts:
    """`attention_s`: the layer's attention kernels (forward, backward) at the shard's share of tokens, as the
    layer prices them; `attention_full_s`: the same kernels computing every tile (default `attention_s`);
    `collective_s(op, n_bytes, group_size, ranks_per_node)` prices one collective; `selective_cache`: selective
    recompute keeps torch's checkpoint cache (MemoryCosts.selective_cache)."""
    if cp == 1:
        return CPLayerCosts(forward_s=0.0, backward_s=0.0, attention_extra_forward_s=0.0,
                            attention_extra_backward_s=0.0)
    n = kv_exchange_bytes(graph, layer, tp=tp, micro_batch=micro_batch, elem=elem)
    full = attention_s if attention_full_s is None else attention_full_s
    rpn = cp_ranks_per_node(tp=tp, cp=cp, devices_per_node=devices_per_node)
    return CPLayerCosts(forward_s=collective_s("all_gather", n, cp, rpn),
                        backward_s=collective_s("reduce_scatter", n, cp, rpn),
                        attention_extra_forward_s=full[0] * (2 * cp + 1) / (4 * cp) - attention_s[0],
                        attention_extra_backward_s=full[1] * (2 * cp + 1) / (4 * cp) - attention_s[1],
                        gathered_kv_bytes=n, shard_kv_bytes=kv_exchange_bytes(
                            graph, layer, tp=tp, micro_batch=micro_batch, elem=elem, repeated=True) / cp,
                        selective_measured=selective_cache and layer.saved_activation_bytes_selective is not None)
