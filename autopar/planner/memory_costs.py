"""Memory pricing: the bytes one device holds for a layout — model states, activations, logits, buffers.

The planner's part that answers "how much memory" (its time is priced by compute_costs and comm_costs,
and costs.CostModel assembles both into the ILP's numbers). Per layer at tensor-parallel degree t:

  parameters      a layer's parameters on one device: the TP-sharded share ÷ t (vocab × hidden for
                  embeddings and heads, else the TP-sharded share of its dense FLOPs: linears do 2 FLOPs per
                  parameter per token, norms stay replicated), the rest whole (all of an embedding or head
                  whose vocabulary t does not divide: capture.vocab_split); a mixture-of-experts bank's
                  parameters (MoESpec.expert_params) ÷ ep, and ÷ etp where each expert's FFN is split over
                  the tp ranks (ParallelConfig.etp)
  model states    cost_models.memory.model_state_bytes on those parameters, each state at the bytes per
                  element of the layout's precision policy (cost_models.precision, ParallelConfig.precision):
                  the parameters are the fp32 masters, fp32 gradients, AdamW's two fp32 moments; ZeRO shards
                  dense states over dp and expert states over the edp ranks holding the same experts (dp / ep,
                  or dp · t / ep with EP folded over tp: autopar.config.expert_dp). Compute copies, held from a
                  step's first forward to its last backward: ZeRO-2's FSDP2 gathered weights (compute
                  dtype), under ZeRO-0 (and ZeRO-1 on one rank or offloaded) with a 16-bit policy autocast's
                  casts of the weights, cast once per step (codegen.precision.weight_cast_cache), under
                  ZeRO-1 the 16-bit parameters themselves (below); ZeRO-3's gathered layers are its buffers.
                  FSDP under pipeline parallelism (ZeRO-2/3, pp > 1) holds more: torch.distributed.pipelining
                  runs every micro-batch's backward without gradient sync and without resharding
                  (stage.py, backward_maybe_with_nosync: set_requires_gradient_sync(False),
                  set_reshard_after_backward(False)) and reduce-scatters once after the last
                  (perform_reduce_grad), so each stage keeps its gathered 16-bit weights and accumulates its
                  unsharded gradients in the reduce dtype (fsdp/_fully_shard/_fsdp_param.py,
                  to_accumulated_grad_if_needed: fp32 under the mixed policies) from its first backward to the
                  step's end: compute copy and gradients whole, fp32 masters and moments ÷ dp (`pipelined`;
                  under pipeline_memory="megatron" each stage's states are ZeRO's, cost_models.memory).
                  ZeRO-1 with a 16-bit policy is the distributed optimizer in both runtimes (Megatron-LM's;
                  autopar's codegen/dist_optimizer.py), which keeps the fp32 masters with the moments,
                  sharded: 16-bit parameters (charged as the compute copy) and fp32 main gradients whole,
                  2 + 4 + 12/d bytes per parameter against 18 unsharded (Megatron-LM
                  docs/source/api-guide/dist_optimizer.md, its table; ZeRO's P_os, Rajbhandari et al. 2020
                  §5.1, K = 12 alike). autopar's runtime under offload="optimizer" keeps fp32 parameters
                  (the host steps them) and 16-bit casts: 4 + 2 + 4 on the device
  activations     cost_models.memory.layer_activation_bytes (Korthikanti et al. 2022) per recompute mode,
                  in the compute dtype (captured bytes × compute bytes ÷ the model dtype's)
  per rank        the logits the last rank holds from the head's forward to its backward (÷ t when the head
                  is vocab-parallel, whole when t does not divide the vocabulary), FSDP's gathered
                  or unsharded buffers (ZeRO-2/3), the in-flight micro-batches of the schedule, and the
                  pipeline runtime's buffers (`pipeline_buffer_bytes`)
  offload         what stays on the device and what goes to the host (offload_costs.OffloadCosts): under
                  "optimizer" the optimizer states leave the device, under "params" every state does (FSDP2
                  keeps only its gathered buffers); host bytes per node are checked against the host
  FP8             FSDP's gathered buffers hold converted weights in 1 byte under tensorwise scaling, and the
                  FP8 copies of the largest layer's weights live during its passes (fp8_costs)
  shared weights  capture charges a weight several layers share (a head tied to the embedding) to every
                  layer holding it; with one stage it is held once, so the duplicates' states are given
                  back (ModelGraph.shared_params; codegen/shared.py)

This module applies the bytes per element of each state, which cost_models.precision owns, to layouts
(`model_states`, `grad_bytes`, `gather_bytes`); the others ask it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property, lru_cache

from autopar.capture.graph import LayerSpec, ModelGraph
from autopar.capture.loss_mode import runtime_loss_kernel
from autopar.capture.vocab_split import layer_at_tp, vocab_parallel_head
from autopar.config import expert_dp
from autopar.planner.fp8_costs import fp8_copy_bytes, fp8_param_share, te_weight_cache_bytes
from autopar.planner.moe_load import moe_token_share
from autopar.planner.offload_costs import OffloadCosts, OffloadSummary
from autopar.planner.problem import MODES
from autopar.planner.space import Candidate
from cost_models import memory
from cost_models.hardware import HostSpec
from cost_models.precision import DTYPE_BYTES, Precision, policy

__all__ = ["MemoryCosts", "RankMemory", "group_runs", "expert_forward_flops", "DTYPE_BYTES"]


def group_runs(layers: tuple[LayerSpec, ...]) -> list[list[LayerSpec]]:
    """Consecutive layers with equal signatures, in order."""
    runs: list[list[LayerSpec]] = []
    for layer in layers:
        if runs and runs[-1][0].signature == layer.signature:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return runs


def expert_forward_flops(layer: LayerSpec) -> float:
    """Forward FLOPs per sample of the layer's expert GEMMs (Kernel.expert), 0 for a dense layer."""
    if layer.moe is None:
        return 0.0
    return sum(k.work * k.count for k in layer.kernels_forward.kernels if k.expert)


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Per-device bytes on one pipeline rank that do not depend on which layers it holds."""

    logits_bytes: float
    zero3_buffer_bytes: float
    pipeline_buffer_bytes: float = 0.0  # the pipelining runtime's buffers beyond activations (pp > 1)
    capacity_bytes: float  # device memory less the reserve and the three terms above


class MemoryCosts:
    """Bytes per device of a graph's layers and pipeline ranks; cached per (run, tp, …) and per layout."""

    def __init__(self, graph: ModelGraph, *, memory_bytes: float, precision: str,
                 memory_reserve_fraction: float = memory.ALLOCATOR_RESERVE_FRACTION, host: HostSpec | None = None,
                 devices_per_node: int = 1, loss_kernel: str | None = None,
                 host_adam_bytes_per_param: float, pipeline_memory: str = "autopar", fp8_runtime: str = "torchao"
                 ) -> None:
        """host_adam_bytes_per_param: what the optimizer step streams per parameter on the host (offload).
        fp8_runtime: the framework running FP8 (PlannerOptions.fp8_runtime): what FSDP gathers, which copies live."""
        if pipeline_memory not in memory.PIPELINE_MEMORY:
            raise ValueError(f"pipeline_memory={pipeline_memory!r}; expected one of {memory.PIPELINE_MEMORY}")
        self.graph = graph
        # cost_models.memory.LOSS_KERNELS: what the loss holds of the logits (None: as autopar's runtime runs it)
        self.loss_kernel = loss_kernel or runtime_loss_kernel(graph.loss_mode)
        self.pipeline_memory = pipeline_memory  # cost_models.memory.PIPELINE_MEMORY
        self.fp8_runtime = fp8_runtime
        self.usable_bytes = memory_bytes * (1.0 - memory_reserve_fraction)
        self.precision: Precision = policy(precision)
        self.elem = self.precision.compute_bytes  # one activation, logit or gathered-weight element
        # captured activation bytes are in the model's own dtype: rescaled to the compute dtype's
        self.act_scale = self.elem / DTYPE_BYTES.get(graph.dtype, 2)
        self.offload = OffloadCosts(host, devices_per_node=devices_per_node, precision=self.precision,
                                    adam_bytes_per_param=host_adam_bytes_per_param)
        self.runs = group_runs(graph.layers)
        self._local_run = lru_cache(maxsize=None)(
            lambda ri, tp, ep=1, etp=1: self.local_params(self.runs[ri][0], tp, ep, etp))
        self._state_run = lru_cache(maxsize=None)(self._run_states)
        self._acts = lru_cache(maxsize=None)(self._activation_bytes)
        self._inflight = lru_cache(maxsize=None)(
            lambda sched, pp, m, v, n=None: tuple(memory.inflight_microbatches(sched, pp, m, q, v, n)
                                                  for q in range(pp)))
        self._ranks = lru_cache(maxsize=None)(self._rank_memory_key)
        self._host_fits = lru_cache(maxsize=None)(self._host_fits_key)

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
        dense = layer.forward_flops - expert_forward_flops(layer)
        return layer.forward_flops_tp_sharded / dense if dense > 0 else 0.0

    def local_params(self, layer: LayerSpec, tp: int, ep: int = 1, etp: int = 1) -> float:
        """Parameters of `layer` one device holds at tensor-parallel degree tp, expert-parallel ep and expert
        tensor-parallel etp."""
        return self.local_dense_params(layer, tp) + self.local_expert_params(layer, ep, etp)

    def run_layer(self, ri: int, tp: int) -> LayerSpec:
        """A layer of run `ri` as degree tp runs it (capture.vocab_split.layer_at_tp: a vocabulary tp does not
        divide is priced whole)."""
        return layer_at_tp(self.runs[ri][0], tp)

    def local_dense_params(self, layer: LayerSpec, tp: int) -> float:
        """Of `local_params`, the dense ones (everything but the expert bank; of these ÷ tp the TP share)."""
        f = self.tp_param_fraction(layer_at_tp(layer, tp))
        dense = layer.num_params - (layer.moe.expert_params if layer.moe is not None else 0)
        return dense * (1.0 - f + f / tp)

    @staticmethod
    def local_expert_params(layer: LayerSpec, ep: int, etp: int = 1) -> float:
        """Of `local_params`, the expert bank's: E / ep experts (expert parallelism), 1/etp of each (their FFN
        split over the tp ranks)."""
        return layer.moe.expert_params / (ep * etp) if layer.moe is not None else 0.0

    def run_local_params(self, ri: int, tp: int, ep: int = 1, etp: int = 1) -> float:
        """`local_params` of one layer of run `ri`."""
        return self._local_run(ri, tp, ep, etp)

    def grad_bytes(self, num_params: float) -> float:
        """Bytes of the gradients of num_params parameters, in the reduce dtype (what data-parallel
        reductions carry)."""
        return self.precision.reduce_bytes(num_params)

    def gather_bytes(self, num_params: float) -> float:
        """Bytes of one FSDP2 all-gather of num_params parameters (in the compute dtype)."""
        return self.precision.gather_bytes(num_params)

    def model_states(self, num_params: float, zero_stage: int, dp: int, offload: str = "none",
                     pipelined: bool = False) -> memory.ModelStateBytes:
        """Weights, gradients and optimizer states of num_params on one device, in this model's dtype (what
        stays on the device under `offload`); `pipelined`: the layer is in a stage of a pipeline (pp > 1)."""
        return self.offload.device_states(self._all_states(num_params, zero_stage, dp, pipelined, offload), offload)

    def _all_states(self, num_params: float, zero_stage: int, dp: int, pipelined: bool = False,
                    offload: str = "none") -> memory.ModelStateBytes:
        """Each state at the policy's bytes per element, and the compute copies (module docstring): the fp32
        masters are the parameters (sharded by ZeRO-3, and by ZeRO-2's FSDP2, which holds the gathered
        weights from forward to backward instead), except under ZeRO-1 with a 16-bit policy, whose parameters
        are 16-bit and whose fp32 masters live with the moments on their owners (the distributed optimizer,
        both runtimes; autopar's own keeps fp32 parameters under offload="optimizer", whose host steps
        them). Under a pipeline FSDP keeps the gathered weights and accumulates unsharded gradients for the
        whole step (module docstring)."""
        pol = self.precision
        states = memory.model_state_bytes(num_params, zero_stage=zero_stage, dp=dp, weight_bytes=pol.weight_bytes,
                                          grad_bytes=pol.grad_bytes, optimizer_bytes=pol.optimizer_bytes)
        if pipelined and zero_stage >= 2 and dp > 1:
            return dataclasses.replace(states, weights_bytes=num_params * pol.weight_bytes / dp,
                                       grads_bytes=num_params * pol.grad_bytes,
                                       compute_copy_bytes=num_params * pol.compute_bytes)
        if zero_stage == 2 and dp > 1:
            return dataclasses.replace(states, weights_bytes=num_params * pol.weight_bytes / dp,
                                       compute_copy_bytes=num_params * pol.compute_bytes)
        if zero_stage == 1 and dp > 1 and pol.mixed and (offload != "optimizer" or self.pipeline_memory == "megatron"):
            # the distributed optimizer (Megatron-LM's, and autopar.codegen.dist_optimizer; DeepSpeed's ZeRO-1
            # alike) shards the fp32 masters with the moments; the 16-bit parameters are the model's own and
            # count as its compute copy (module docstring, "model states")
            return dataclasses.replace(states, weights_bytes=num_params * pol.weight_bytes / dp,
                                       compute_copy_bytes=num_params * pol.compute_bytes)
        if zero_stage <= 1 or dp == 1:
            return dataclasses.replace(states, compute_copy_bytes=num_params * pol.compute_copy_bytes)
        return states

    def host_state_bytes(self, num_params: float, zero_stage: int, dp: int, offload: str) -> float:
        """Host bytes one rank keeps for num_params of its parameters under `offload` (the sharded states: the
        same with or without a pipeline)."""
        stepped = num_params / (dp if zero_stage >= 1 else 1)
        return self.offload.host_bytes(self._all_states(num_params, zero_stage, dp, offload=offload), stepped, offload)

    def run_state_bytes(self, ri: int, tp: int, zero_stage: int, dp: int, ep: int = 1, offload: str = "none",
                        pipelined: bool = False, etp: int = 1) -> float:
        """Model-state bytes of one layer of run `ri` on one device."""
        return self._state_run(ri, tp, zero_stage, dp, ep, offload, pipelined, etp)

    def _run_states(self, ri: int, tp: int, zero_stage: int, dp: int, ep: int = 1, offload: str = "none",
                    pipelined: bool = False, etp: int = 1) -> float:
        return self.layer_states(self.runs[ri][0], tp, zero_stage, dp, ep, offload, pipelined, etp).total_bytes

    def layer_states(self, layer: LayerSpec, tp: int, zero_stage: int, dp: int, ep: int = 1,
                     offload: str = "none", pipelined: bool = False, etp: int = 1) -> memory.ModelStateBytes:
        """Model states of `layer` on one device: dense ones sharded over dp, expert ones (1/etp of E / ep
        experts) over the ranks holding the same experts (autopar.config.expert_dp: dp / ep, or dp · tp / ep
        folded)."""
        dense = self.model_states(self.local_dense_params(layer, tp), zero_stage, dp, offload, pipelined)
        if layer.moe is None:
            return dense
        expert = self.model_states(self.local_expert_params(layer, ep, etp), zero_stage, expert_dp(tp, dp, ep, etp),
                                   offload, pipelined)
        return memory.ModelStateBytes(weights_bytes=dense.weights_bytes + expert.weights_bytes,
                                      grads_bytes=dense.grads_bytes + expert.grads_bytes,
                                      optimizer_bytes=dense.optimizer_bytes + expert.optimizer_bytes,
                                      compute_copy_bytes=dense.compute_copy_bytes + expert.compute_copy_bytes)

    def offload_summary(self, c: Candidate, *, overlapped: bool) -> OffloadSummary:
        """Where a device's states live under c.offload and what moving them costs (stages taken as even)."""
        params = sum(len(g) * self._local_run(ri, c.tp, c.ep, c.etp) for ri, g in enumerate(self.runs)) / c.pp
        stepped = params / (c.shard_group if c.zero_stage >= 1 else 1)
        gathers = c.num_microbatches * (2 if c.zero_stage == 3 else 1)
        scatters = 1 if c.pp > 1 else c.num_microbatches  # a pipeline stage's FSDP reduce-scatters once a step
        return self.offload.summary(
            mode=c.offload,
            device_state_bytes=self.model_states(params, c.zero_stage, c.shard_group, c.offload,
                                                 self.pipelined(c)).total_bytes,
            host_bytes_per_node=self.host_fits(c)[1], stepped_params=stepped,
            shard_bytes=params * self.precision.weight_bytes / c.shard_group, copies_per_step=gathers + scatters,
            overlapped=overlapped)

    def host_fits(self, c: Candidate) -> tuple[bool, float]:
        """(whether the node's host holds every rank's host states, those bytes per node), stages taken as
        even (a rank holds 1/pp of the model's layers)."""
        if c.offload == "none":
            return True, 0.0
        return self._host_fits(c.tp, c.ep, c.etp, c.pp, c.zero_stage, c.shard_group, c.offload)

    def _host_fits_key(self, tp: int, ep: int, etp: int, pp: int, zero_stage: int, dp: int,
                       offload: str) -> tuple[bool, float]:
        params = sum(len(g) * self._local_run(ri, tp, ep, etp) for ri, g in enumerate(self.runs)) / pp
        per_node = self.offload.devices_per_node * self.host_state_bytes(params, zero_stage, dp, offload)
        return per_node <= self.offload.host_capacity_bytes, per_node

    def shared_duplicate_states(self, tp: int, zero_stage: int, dp: int, offload: str = "none"
                                ) -> memory.ModelStateBytes:
        """Model states of the extra copies the layers' sums count of weights several layers share."""
        n = 0.0
        for sp in self.graph.shared_params:
            if len(sp.layers) > 1:
                split = self.tp_param_fraction(layer_at_tp(self.graph.layer(sp.layers[0]), tp)) > 0
                n += (len(sp.layers) - 1) * sp.num_params / (tp if split else 1)
        return self.model_states(n, zero_stage, dp, offload)

    # ---- activations ----
    def activation_bytes(self, ri: int, tp: int, sp: bool, mbs: int, compiled: bool = False, ep: int = 1,
                         etp: int = 1) -> tuple[float, ...]:
        """Saved activation bytes of one layer of run `ri` per micro-batch in flight, per recompute mode
        (MODES). op_sac and selective are priced from the bytes their policies keep where capture measured
        them (blocks; other layers are not checkpointed by codegen and keep everything), else op_sac as none and
        selective as none less the attention core; a `compiled` block under either keeps only what its backward
        reads (LayerSpec.saved_activation_bytes_op_sac_unread / _selective_unread go, its TP-sharded share taken
        as the policy's). What the expert banks keep (LayerSpec.
        saved_activation_bytes_expert) is priced by `expert_bank_share`."""
        return self._acts(ri, tp, sp, mbs, compiled, ep, etp)

    @property
    def selective_cache(self) -> bool:
        """Selective recompute keeps torch's checkpoint cache (autopar's runtime: every non-core op's output),
        not Megatron-LM's and DeepSpeed's none-less-the-core (pipeline_memory="megatron"; Korthikanti §5)."""
        return self.pipeline_memory != "megatron"

    @staticmethod
    def expert_bank_share(layer: LayerSpec, tp: int, sp: bool, ep: int, etp: int = 1) -> float:
        """Of the bytes the layer's expert banks keep per sample (LayerSpec.saved_activation_bytes_expert), those
        one rank keeps: the rank's share of the tokens its bank runs (moe_load.moe_token_share: 1/tp under SP or
        EP folded over tp, else 1), of which the FFN-wide intermediates ÷ etp. Under etp every tp rank runs all
        its group's (token, slot) pairs through its slice of each expert, and two h-wide rows per pair stay
        whole on each: the tokens entering the first GEMM (its weight gradient reads them) and the expert's
        output, a partial sum over tp that the routing weight multiplies (that weight's gradient reads it):
        2 · MoESpec.dispatch_bytes_per_sample per sample (all ÷ etp missed h of the 2·h + 2·ffn elements per
        pair a gated expert's rank keeps at etp2: 11% at Mixtral-8x7B's h = 4096, ffn = 14336). Measured per
        rank on a real 2-rank run, with the other layouts, in tests/test_moe_expert_memory.py."""
        saved = layer.saved_activation_bytes_expert
        rows = min(saved, 2 * layer.moe.dispatch_bytes_per_sample) if layer.moe is not None else 0
        return moe_token_share(tp, sp, ep, etp) * (rows + (saved - rows) / etp)

    def _activation_bytes(self, ri: int, tp: int, sp: bool, mbs: int, compiled: bool = False, ep: int = 1,
                          etp: int = 1) -> tuple[float, ...]:
        layer = self.run_layer(ri, tp)
        block = layer.kind == "block"
        # the bytes each checkpoint policy keeps, where capture measured them (blocks): (saved, TP-sharded, unread)
        policy = {"op_sac": (layer.saved_activation_bytes_op_sac, layer.saved_activation_bytes_op_sac_tp_sharded,
                             layer.saved_activation_bytes_op_sac_unread),
                  "selective": (layer.saved_activation_bytes_selective,
                                layer.saved_activation_bytes_selective_tp_sharded,
                                layer.saved_activation_bytes_selective_unread)}
        expert = layer.saved_activation_bytes_expert
        expert_share = self.expert_bank_share(layer, tp, sp, ep, etp) / expert if expert else 0.0
        # full recompute keeps each layer's inputs; the tensors the run's layers share (rotary tables, positions)
        # are charged to its first layer (capture.layers.retained_inputs): the run's mean counts them once
        run = self.runs[ri]
        input_bytes = sum(la.input_bytes for la in run) / len(run)

        def acts_of(k: str) -> float:
            saved, sharded = layer.saved_activation_bytes, layer.saved_activation_bytes_tp_sharded
            measured = (block and k in policy and policy[k][0] is not None
                        and (k != "selective" or self.selective_cache))
            if measured:
                saved, sharded, unread = policy[k]
                if compiled and unread and saved > 0:
                    kept = saved - unread
                    saved, sharded = kept, sharded * kept / saved
            # measured policies keep exactly `saved`; graphs captured before op_sac price it as none, before
            # selective's policy bytes as none less the attention core
            mode = "op_sac" if measured else "none" if k == "op_sac" else k
            banks = expert if not measured and mode in ("none", "selective") else 0.0  # policies' are not split
            return self.act_scale * (memory.layer_activation_bytes(
                saved_bytes=saved - banks, tp_sharded_bytes=sharded,
                attention_core_bytes=min(layer.saved_activation_bytes_attention_core, sharded),
                input_bytes=input_bytes, micro_batch=mbs, tp=tp, sequence_parallel=sp,
                recompute=mode) + mbs * banks * expert_share)

        # codegen recomputes blocks only (parallelize → codegen.recompute): any other layer keeps what none keeps
        return tuple(acts_of(k) if layer.kind == "block" else acts_of("none") for k in MODES)

    # ---- per pipeline rank ----
    def inflight(self, c: Candidate) -> tuple[float, ...]:
        """Micro-batches whose activations each pipeline rank holds at its peak, under c's schedule."""
        return self._inflight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages, c.microbatch_group)

    def rank_memory(self, c: Candidate) -> tuple[RankMemory, ...]:
        return self._ranks(c.tp, c.pp, c.shard_group, c.zero_stage, c.schedule, c.num_microbatches,
                           c.virtual_stages, c.micro_batch_size, c.ep, c.fp8, c.offload, c.cp, c.sequence_parallel,
                           c.microbatch_group, c.etp)

    def fp8_gathered(self, c: Candidate) -> bool:
        """Whether FSDP gathers the converted weights in float8 (torchao's tensorwise scaling under ZeRO-2/3)."""
        return c.fp8 == "tensorwise" and self.fp8_runtime == "torchao" and self.fsdp(c.zero_stage, c.shard_group,
                                                                                     c.offload)

    def pipelined(self, c: Candidate) -> bool:
        """Whether c's stages run under torch.distributed.pipelining's FSDP handling (module docstring)."""
        return c.pp > 1 and self.pipeline_memory != "megatron"

    @staticmethod
    def fsdp(zero_stage: int, dp: int, offload: str) -> bool:
        """Whether codegen shards with FSDP2 (ZeRO-2/3 over dp > 1, or any dp under offload="params")."""
        return zero_stage >= 2 and (dp > 1 or offload == "params")

    def gathered_bytes(self, ri: int, tp: int, gathered_fp8: bool, ep: int = 1, etp: int = 1) -> float:
        """Bytes of one layer of run `ri` as FSDP gathers it (its converted weights in 1 byte under fp8)."""
        b = self._local_run(ri, tp, ep, etp) * self.elem
        if gathered_fp8:
            share = fp8_param_share(self.runs[ri][0], self.graph)
            b *= 1.0 - share + share / self.elem
        return b

    def _rank_memory_key(self, tp: int, pp: int, dp: int, zero_stage: int, schedule: str, m: int, v: int,
                         mbs: int, ep: int = 1, fp8: str = "none", offload: str = "none",
                         cp: int = 1, sp: bool = False, group: int | None = None, etp: int = 1
                         ) -> tuple[RankMemory, ...]:
        """dp: the ranks ZeRO shards over (dp·cp); cp: each rank holds 1/cp of every sequence's logits."""
        g = self.graph
        zero3_bytes = reduce_bytes = 0.0  # FSDP's buffers; of them, the gradient reduce-scatter's
        if self.fsdp(zero_stage, dp, offload):
            f8 = fp8 == "tensorwise" and self.fp8_runtime == "torchao"  # torchao's float8 all-gather
            largest = max(self.gathered_bytes(ri, tp, f8, ep, etp) for ri in range(len(self.runs)))
            # FSDP2 reduce-scatters each layer's gradient out of an unsharded buffer (computed in the compute
            # dtype, cast to the reduce dtype when they differ); ZeRO-3 also holds the running and the
            # prefetched layer's gathered weights (ZeRO-2 keeps its weights, counted in the model states)
            pol = self.precision
            grad_ratio = (pol.compute_bytes + pol.grad_bytes) / pol.compute_bytes if pol.mixed else 1.0
            zero3_bytes = (memory.zero3_gathered_param_bytes(largest_layer_param_bytes=largest,
                                                             grad_bytes_ratio=grad_ratio) if zero_stage == 3
                           else largest * grad_ratio)
            reduce_bytes = largest * grad_ratio
            if pp > 1 and self.pipeline_memory != "megatron":
                # gathered weights and accumulated gradients are model states here (module docstring): what
                # remains is the running layer's 16-bit gradient before it is accumulated
                zero3_bytes = reduce_bytes = largest
        logits = 0.0
        if g.vocab_size and g.seq_len and g.layers[-1].kind == "head":
            # the loss's logits live from the head's forward to its backward: with interleaving the head is in
            # the last rank's last chunk, whose warm-up holds only earlier chunks, so each head forward is
            # followed by its own backward (one in flight), not the rank's average of all its chunks
            last_inflight = 1.0 if v > 1 else self._inflight(schedule, pp, m, v, group)[pp - 1]
            # the "fp32_logits" loss's peak (cost_models.memory.logits_bytes) holds the logits too where the
            # runtime keeps them: the pipelining runtime's last stage, and a loss over vocab slices under tp
            # (a head whose vocabulary tp does not divide stays whole: full logits, a plain cross-entropy)
            vtp = tp if vocab_parallel_head(g, tp) else 1
            held = (pp > 1 and self.pipeline_memory != "megatron") or vtp > 1
            shape = dict(micro_batch=mbs, seq_len=-(-g.seq_len // cp), vocab=g.vocab_size, tp=vtp,
                         dtype_bytes=self.elem, loss_kernel=self.loss_kernel, held=held)
            # the micro-batches in flight beyond the running one keep what their loss saved for backward
            logits = (memory.logits_bytes(**shape)
                      + max(0.0, last_inflight - 1.0) * memory.loss_saved_bytes(**shape))
            # a layer's gradient is reduce-scattered in its own backward, after the loss's backward has freed
            # all but the logits' 16-bit gradient: the two peaks do not coincide, and the rank holds the larger
            grad_logits = last_inflight * mbs * -(-g.seq_len // cp) * g.vocab_size / vtp * self.elem
            last_zero3 = zero3_bytes - reduce_bytes + max(0.0, reduce_bytes + grad_logits - logits)
        else:
            last_zero3 = zero3_bytes
        if fp8 != "none" and self.fp8_runtime != "torchao":  # TE's FP8 weight copies of the rank's layers, all step
            copies = sum(len(r) * te_weight_cache_bytes(layer_at_tp(r[0], tp), g, recipe=fp8, tp=tp)
                         for r in self.runs) / pp
            zero3_bytes, last_zero3 = zero3_bytes + copies, last_zero3 + copies
        elif fp8 != "none":  # the FP8 copies of the largest layer's weights, during its passes
            copies = max(fp8_copy_bytes(layer_at_tp(r[0], tp), g, tp) for r in self.runs)
            zero3_bytes, last_zero3 = zero3_bytes + copies, last_zero3 + copies
        # with one stage, a weight two layers share is counted by both layers but held once: give it back
        shared = self.shared_duplicate_states(tp, zero_stage, dp, offload).total_bytes if pp == 1 else 0.0
        inflight = self._inflight(schedule, pp, m, v, group)
        out = []
        for q in range(pp):
            last = q == pp - 1  # only the last rank holds the logits
            lg, z3 = (logits, last_zero3) if last else (0.0, zero3_bytes)
            buf = self.pipeline_buffer_bytes(q, pp=pp, v=v, m=m, inflight=inflight[q], mbs=mbs, tp=tp, sp=sp, cp=cp,
                                             schedule=schedule)
            out.append(RankMemory(logits_bytes=lg, zero3_buffer_bytes=z3, pipeline_buffer_bytes=buf,
                                  capacity_bytes=self.usable_bytes - lg - z3 - buf + shared))
        return tuple(out)

    def pipeline_buffer_bytes(self, q: int, *, pp: int, v: int, m: int, inflight: float, mbs: int, tp: int,
                              sp: bool, cp: int = 1, schedule: str = "1f1b") -> float:
        """Bytes pipeline rank q holds in its pipelining runtime beyond its layers' activations
        (cost_models.memory.pipeline_buffers, in stage-boundary tensors): one is the largest boundary tensor
        the graph has (LayerSpec.boundary_bytes), sharded over tp under sequence parallelism and cp."""
        one = self.act_scale * self._largest_boundary_bytes * mbs / (tp if sp else 1) / cp
        return one * memory.pipeline_buffers(self.pipeline_memory, q=q, pp=pp, v=v, m=m, inflight=inflight,
                                             schedule=schedule)

    @cached_property
    def _largest_boundary_bytes(self) -> int:
        """The largest stage-boundary tensor the graph has (a cut never follows the last layer)."""
        return max((la.boundary_bytes for la in self.graph.layers[:-1]), default=0)

    def memory_breakdown(self, c: Candidate, layer_names_by_rank: list[list[str]], act_bytes_by_rank: list[float],
                         workspace_by_rank: list[float]) -> list[dict[str, int]]:
        """Per rank: weights, grads, optimizer, compute_copies, activations, workspace, logits, zero3_buffer,
        pipeline_buffers (bytes/device)."""
        ranks = self.rank_memory(c)
        out = []
        for q, names in enumerate(layer_names_by_rank):
            st = [self.layer_states(self.graph.layer(n), c.tp, c.zero_stage, c.shard_group, c.ep, c.offload,
                                    self.pipelined(c), c.etp) for n in names]
            if c.pp == 1:  # held once (see _rank_memory_key)
                dup = self.shared_duplicate_states(c.tp, c.zero_stage, c.shard_group, c.offload)
                st.append(type(dup)(weights_bytes=-dup.weights_bytes, grads_bytes=-dup.grads_bytes,
                                    optimizer_bytes=-dup.optimizer_bytes, compute_copy_bytes=-dup.compute_copy_bytes))
            out.append({"weights": int(sum(s.weights_bytes for s in st)), "grads": int(sum(s.grads_bytes for s in st)),
                        "optimizer": int(sum(s.optimizer_bytes for s in st)),
                        "compute_copies": int(sum(s.compute_copy_bytes for s in st)),
                        "activations": int(act_bytes_by_rank[q]),
                        "workspace": int(workspace_by_rank[q]), "logits": int(ranks[q].logits_bytes),
                        "zero3_buffer": int(ranks[q].zero3_buffer_bytes),
                        "pipeline_buffers": int(ranks[q].pipeline_buffer_bytes)})
        return out
