"""Memory pricing: the bytes one device holds for a layout — model states, activations, logits, buffers.

The planner's part that answers "how much memory" (its time is priced by compute_costs and comm_costs,
and costs.CostModel assembles both into the ILP's numbers). Per layer at tensor-parallel degree t:

  parameters      a layer's parameters on one device: the TP-sharded share ÷ t (vocab × hidden for
                  embeddings and heads, else the TP-sharded share of its FLOPs: linears do 2 FLOPs per
                  parameter per token, norms stay replicated), the rest whole
  model states    cost_models.memory.model_state_bytes on those parameters, in the model's dtype: weights
                  and gradients of one element each, fp32 Adam states (master weights and two moments,
                  12 bytes, in mixed precision; two moments, 8 bytes, in fp32 training); ZeRO shards them
  activations     cost_models.memory.layer_activation_bytes (Korthikanti et al. 2022) per recompute mode
  per rank        the logits the last rank holds from the head's forward to its backward, FSDP's gathered
                  or unsharded buffers (ZeRO-2/3), the in-flight micro-batches of the schedule
  shared weights  capture charges a weight several layers share (a head tied to the embedding) to every
                  layer holding it; with one stage it is held once, so the duplicates' states are given
                  back (ModelGraph.shared_params; codegen/shared.py)

This module owns the bytes per element of each state (`model_states`); the others ask it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from autopar.capture.graph import LayerSpec, ModelGraph
from autopar.planner.problem import MODES
from autopar.planner.space import Candidate
from cost_models import memory

__all__ = ["MemoryCosts", "RankMemory", "group_runs", "DTYPE_BYTES"]

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def group_runs(layers: tuple[LayerSpec, ...]) -> list[list[LayerSpec]]:
    """Consecutive layers with equal signatures, in order."""
    runs: list[list[LayerSpec]] = []
    for layer in layers:
        if runs and runs[-1][0].signature == layer.signature:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Per-device bytes on one pipeline rank that do not depend on which layers it holds."""

    logits_bytes: float
    zero3_buffer_bytes: float
    capacity_bytes: float  # device memory less the reserve and the two terms above


class MemoryCosts:
    """Bytes per device of a graph's layers and pipeline ranks; cached per (run, tp, …) and per layout."""

    def __init__(self, graph: ModelGraph, *, memory_bytes: float,
                 memory_reserve_fraction: float = memory.ALLOCATOR_RESERVE_FRACTION) -> None:
        self.graph = graph
        self.usable_bytes = memory_bytes * (1.0 - memory_reserve_fraction)
        self.elem = DTYPE_BYTES.get(graph.dtype, 2)  # bytes of one weight, gradient or activation element
        self.runs = group_runs(graph.layers)
        self._local_run = lru_cache(maxsize=None)(lambda ri, tp: self.local_params(self.runs[ri][0], tp))
        self._state_run = lru_cache(maxsize=None)(self._run_states)
        self._acts = lru_cache(maxsize=None)(self._activation_bytes)
        self._inflight = lru_cache(maxsize=None)(
            lambda sched, pp, m, v: tuple(memory.inflight_microbatches(sched, pp, m, q, v) for q in range(pp)))
        self._ranks = lru_cache(maxsize=None)(self._rank_memory_key)

    # ---- parameters and their states ----
    def tp_param_fraction(self, layer: LayerSpec) -> float:
        """Share of a layer's parameters that TP shards: vocab × hidden for embeddings and heads, else the
        TP-sharded share of its FLOPs (linears do 2 FLOPs per parameter per token; norms stay replicated)."""
        kinds = {p.kind for p in layer.tp_patterns}
        if not kinds or layer.num_params == 0:
            return 0.0
        if kinds & {"embedding", "lm_head"} and self.graph.hidden_size:
            vocab = max(p.vocab_size or 0 for p in layer.tp_patterns)
            return min(1.0, vocab * self.graph.hidden_size / layer.num_params)
        return layer.forward_flops_tp_sharded / layer.forward_flops if layer.forward_flops > 0 else 0.0

    def local_params(self, layer: LayerSpec, tp: int) -> float:
        """Parameters of `layer` one device holds at tensor-parallel degree tp."""
        f = self.tp_param_fraction(layer)
        return layer.num_params * (1.0 - f + f / tp)

    def run_local_params(self, ri: int, tp: int) -> float:
        """`local_params` of one layer of run `ri`."""
        return self._local_run(ri, tp)

    def grad_bytes(self, num_params: float) -> float:
        """Bytes of the gradients of num_params parameters (what data-parallel collectives carry)."""
        return num_params * self.elem

    def model_states(self, num_params: float, zero_stage: int, dp: int) -> memory.ModelStateBytes:
        """Weights, gradients and optimizer states of num_params on one device, in this model's dtype."""
        w = self.elem
        opt = 12 if w == 2 else 8  # mixed precision: fp32 master + 2 moments; fp32 training: 2 moments
        return memory.model_state_bytes(num_params, zero_stage=zero_stage, dp=dp, weight_bytes=w, grad_bytes=w,
                                        optimizer_bytes=opt)

    def run_state_bytes(self, ri: int, tp: int, zero_stage: int, dp: int) -> float:
        """Model-state bytes of one layer of run `ri` on one device."""
        return self._state_run(ri, tp, zero_stage, dp)

    def _run_states(self, ri: int, tp: int, zero_stage: int, dp: int) -> float:
        return self.model_states(self._local_run(ri, tp), zero_stage, dp).total_bytes

    def shared_duplicate_states(self, tp: int, zero_stage: int, dp: int) -> memory.ModelStateBytes:
        """Model states of the extra copies the layers' sums count of weights several layers share."""
        n = 0.0
        for sp in self.graph.shared_params:
            if len(sp.layers) > 1:
                split = self.tp_param_fraction(self.graph.layer(sp.layers[0])) > 0
                n += (len(sp.layers) - 1) * sp.num_params / (tp if split else 1)
        return self.model_states(n, zero_stage, dp)

    # ---- activations ----
    def activation_bytes(self, ri: int, tp: int, sp: bool, mbs: int) -> tuple[float, ...]:
        """Saved activation bytes of one layer of run `ri` per micro-batch in flight, per recompute mode
        (MODES). op_sac is priced from the bytes its policy keeps where capture measured them (blocks; other
        layers are not checkpointed by codegen and keep everything), else as none."""
        return self._acts(ri, tp, sp, mbs)

    def _activation_bytes(self, ri: int, tp: int, sp: bool, mbs: int) -> tuple[float, ...]:
        layer = self.runs[ri][0]
        sac_known = layer.kind == "block" and layer.saved_activation_bytes_op_sac is not None

        def acts_of(k: str) -> float:
            saved, sharded = layer.saved_activation_bytes, layer.saved_activation_bytes_tp_sharded
            if k == "op_sac":
                saved = layer.saved_activation_bytes_op_sac if sac_known else saved
                sharded = layer.saved_activation_bytes_op_sac_tp_sharded if sac_known else sharded
            return memory.layer_activation_bytes(
                saved_bytes=saved, tp_sharded_bytes=sharded,
                attention_core_bytes=min(layer.saved_activation_bytes_attention_core, sharded),
                input_bytes=layer.input_bytes, micro_batch=mbs, tp=tp, sequence_parallel=sp,
                recompute=k if sac_known or k != "op_sac" else "none")

        return tuple(acts_of(k) if k != "op_sac" or layer.kind == "block" else acts_of("none") for k in MODES)

    # ---- per pipeline rank ----
    def inflight(self, c: Candidate) -> tuple[float, ...]:
        """Micro-batches whose activations each pipeline rank holds at its peak, under c's schedule."""
        return self._inflight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)

    def rank_memory(self, c: Candidate) -> tuple[RankMemory, ...]:
        return self._ranks(c.tp, c.pp, c.dp, c.zero_stage, c.schedule, c.num_microbatches, c.virtual_stages,
                           c.micro_batch_size)

    def _rank_memory_key(self, tp: int, pp: int, dp: int, zero_stage: int, schedule: str, m: int, v: int,
                         mbs: int) -> tuple[RankMemory, ...]:
        g = self.graph
        zero3_bytes = 0.0
        if zero_stage >= 2 and dp > 1:
            largest = max(self._local_run(ri, tp) for ri in range(len(self.runs))) * self.elem
            # FSDP2 reduce-scatters each layer's gradient out of an unsharded buffer; ZeRO-3 also holds the
            # running and the prefetched layer's gathered weights (ZeRO-2 keeps its weights, already counted)
            zero3_bytes = (memory.zero3_gathered_param_bytes(largest_layer_param_bytes=largest) if zero_stage == 3
                           else largest)
        logits = 0.0
        if g.vocab_size and g.seq_len and g.layers[-1].kind == "head":
            # the loss's logits live from the head's forward to its backward: with interleaving the head is in
            # the last rank's last chunk, whose warm-up holds only earlier chunks, so each head forward is
            # followed by its own backward (one in flight), not the rank's average of all its chunks
            last_inflight = 1.0 if v > 1 else self._inflight(schedule, pp, m, v)[pp - 1]
            logits = last_inflight * memory.logits_bytes(micro_batch=mbs, seq_len=g.seq_len, vocab=g.vocab_size,
                                                         tp=tp, dtype_bytes=self.elem)
        # with one stage, a weight two layers share is counted by both layers but held once: give it back
        shared = self.shared_duplicate_states(tp, zero_stage, dp).total_bytes if pp == 1 else 0.0
        ranks = [RankMemory(logits_bytes=lg, zero3_buffer_bytes=zero3_bytes,
                            capacity_bytes=self.usable_bytes - lg - zero3_bytes + shared) for lg in (0.0, logits)]
        return (ranks[0],) * (pp - 1) + (ranks[1],)  # only the last rank holds the logits

    def memory_breakdown(self, c: Candidate, layer_names_by_rank: list[list[str]], act_bytes_by_rank: list[float],
                         workspace_by_rank: list[float]) -> list[dict[str, int]]:
        """Per rank: weights, grads, optimizer, activations, workspace, logits, zero3_buffer (bytes/device)."""
        ranks = self.rank_memory(c)
        out = []
        for q, names in enumerate(layer_names_by_rank):
            st = [self.model_states(self.local_params(self.graph.layer(n), c.tp), c.zero_stage, c.dp) for n in names]
            if c.pp == 1:  # held once (see _rank_memory_key)
                dup = self.shared_duplicate_states(c.tp, c.zero_stage, c.dp)
                st.append(type(dup)(weights_bytes=-dup.weights_bytes, grads_bytes=-dup.grads_bytes,
                                    optimizer_bytes=-dup.optimizer_bytes))
            out.append({"weights": int(sum(s.weights_bytes for s in st)), "grads": int(sum(s.grads_bytes for s in st)),
                        "optimizer": int(sum(s.optimizer_bytes for s in st)), "activations": int(act_bytes_by_rank[q]),
                        "workspace": int(workspace_by_rank[q]), "logits": int(ranks[q].logits_bytes),
                        "zero3_buffer": int(ranks[q].zero3_buffer_bytes)})
        return out
