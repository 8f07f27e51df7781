"""Prices layers of a `ModelGraph` on a cluster for one outer `Candidate`, as the ILP's numbers.

This is the only planner module that talks to `cost_models` (the adapter of docs/design.md §2): it turns
each run of identical layers into a `Run` (time by recompute mode, activation and model-state bytes,
gradient-sync, optimizer and p2p time) and each pipeline rank into its in-flight micro-batches and
memory capacity. Per layer at tensor-parallel degree t, sequence parallelism and micro-batch b:

  compiled blocks (Candidate.compile): each chain of memory-bound kernels between matmuls is one kernel
                  reading its inputs and writing its outputs once (KernelMix.fused: TorchInductor's fusion,
                  Ansel et al. 2024 §5); GEMMs and attention are priced as in eager
  pass time       the sum of the pass's kernels (LayerSpec.kernels_forward / kernels_backward, a KernelMix),
                  each at b × its per-sample work (÷ t inside a TP pattern; every memory-bound kernel ÷ t
                  with SP, which shards norms, dropouts and residuals along the sequence: Korthikanti et al.
                  2022 §4.2.2), priced one by one by ComputeModel.kernel_time_s at its own size, layout and
                  memory class; mixes without a kernel list by their totals (kernels_time_s); graphs without
                  kernel mixes fall back to one roofline over the layer's FLOPs and bytes
  TP comm         exactly the collectives codegen issues for the layer (autopar.planner.tp_costs.tp_collectives:
                  Megatron's all-reduces per pattern, forward-only for a vocab-parallel embedding, backward and
                  the parallel cross-entropy's for the LM head, SP's all-gathers and reduce-scatters), over t
                  ranks inside one node; per-step ones (SP norm-gradient reductions) join the layer's γ
  recompute       selective: the attention core again: its captured kernels (Kernel.attention_core), else
                  4·b·s²·(heads·head_dim)/t FLOPs (Narayanan et al. 2021 eq. 3's attention term, forward);
                  op_sac: the forward kernels its policy does not save (Kernel.op_sac_saved: every second
                  matmul, pointwise ops, norms) and the forward TP collectives (functional collectives are
                  not in its save list); full: the whole forward and its TP comm again. Only blocks are
                  checkpointed by codegen, so other layers price op_sac as none; graphs captured before
                  op_sac price it as none's memory with full's time (never preferred)
  activations     cost_models.memory.layer_activation_bytes (Korthikanti et al. 2022)
  model states    cost_models.memory.model_state_bytes on the layer's parameters ÷ t where TP shards them
  DP / ZeRO       the collectives the runtime issues, counted and priced one by one (autopar.planner.dp_costs)
  optimizer       AdamW streaming ADAM_BYTES_PER_PARAM per local (ZeRO: owned) parameter
  p2p             one send of the boundary tensor per micro-batch and direction

Collectives are priced by the profile's table for that op and group size when it has one; an all-gather,
reduce-scatter or broadcast the profile did not measure at that size is half the measured all-reduce
(ring all-gather and reduce-scatter are each half of a ring all-reduce, in latency and in bytes;
Thakur, Rabenseifner & Gropp 2005); otherwise the α-β formulas. On gloo over N CPU processes sharing C
cores a collective of g ranks runs slower than the profiler measured it (g processes busy) by
max(1, N/C) / max(1, g/C): its copies, reductions and socket wake-ups need CPU time, and each process
gets C/N of a core when all N are busy (the same time-slicing Cluster.local applies to compute).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from autopar.capture.graph import KernelMix, LayerSpec, ModelGraph, sequence_span
from autopar.planner.dp_costs import FLOOR_S, DPTail
from autopar.planner.ilp import MODES, InnerProblem, Run
from autopar.planner.shared_costs import shared_duplicate_states, shared_sync_s
from autopar.planner.space import Candidate
from autopar.planner.tp_costs import tp_collectives
from cost_models import memory
from cost_models.comm import CommModel, Topology
from cost_models.compute import ComputeModel

__all__ = ["CostModel", "RankMemory", "group_runs"]

# Bytes an AdamW step streams per parameter (fp32 states): PyTorch's multi-tensor AdamW
# (torch/optim/adamw.py, _multi_tensor_adam) runs nine memory-bound passes over the parameter list —
# decay (r+w param, 8 B), lerp of the first moment (grad + m in, m out, 12 B), scale and addcmul of the
# second moment (8 + 12 B), sqrt, divide and add-eps on a temporary (3 × 8 B) and the addcdiv update
# (m, temporary, param in, param out, 16 B) — 80 B in all. Measured on this machine: a gpt-tiny step
# (1.1 M parameters) took 11 ms ≈ 88 MB at the profile's ~8 GB/s streaming rate
# (`python benchmarks/predict_vs_measure.py`, optimizer component).
ADAM_BYTES_PER_PARAM = 80
# CPU time DTensor tensor parallelism adds per forward GEMM of a TP-sharded layer (a linear whose weight is
# a DTensor): dispatch and sharding propagation in forward + backward, per micro-batch, and AdamW on its
# DTensor parameters, per step. Measured with `python benchmarks/host_overhead.py` (gpt-tiny, one thread,
# thread CPU time, 1-rank mesh, 2-vCPU development machine): 0.80–0.86 ms at micro-batch 1 and 4 (a cost
# per call, not per sample) and 0.29 ms. Kept as multiples of that machine's eager-op floor (dp_costs.FLOOR_S)
# so that they follow the profile's host floor (Profile.host_overhead_floor_s: the CPU's speed and its own
# calibration factor, but not core sharing: a TP rank dispatches while its peers wait in the latency-bound
# TP collectives, and on 2 vCPUs the measured host share stayed at 1.4–2.0× this constant for 2, 4 and 8
# processes where dividing the cores would have needed 2.0, 0.87 and 0.34 of a shared floor; see
# `benchmarks/predict_vs_measure.py`). Charged on CPU only; GPUs run it on the host ahead of the device.
TP_HOST_FLOORS_PER_GEMM = 0.85e-3 / FLOOR_S
TP_OPTIMIZER_FLOORS_PER_GEMM = 0.29e-3 / FLOOR_S
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


def _has_kernels(layer: LayerSpec) -> bool:
    """Whether capture recorded the layer's kernels (graphs written by hand or by older versions may not)."""
    k = layer.kernels_forward
    return k.gemm_count + k.attention_count + k.memory_count > 0


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


class CostModel:
    """Prices a graph on one cluster; results are cached per (tp, sp, micro-batch) and per layout."""

    def __init__(self, graph: ModelGraph, *, device, devices_per_node: int, nodes: int, intra_node, inter_node,
                 profile=None, memory_reserve_fraction: float = memory.ALLOCATOR_RESERVE_FRACTION,
                 backend: str = "nccl") -> None:
        self.graph = graph
        # Data-parallel collectives overlap compute only where communication runs beside it (NCCL on its
        # own CUDA stream) and the runtime issues them during the passes: FSDP2 (ZeRO-2/3) prefetches
        # all-gathers during forward and reduce-scatters during backward, so one micro-batch's forward and
        # backward (β) hide them; autopar's ZeRO-0/1 reduce after backward; gloo shares the CPU cores.
        self.backend = backend
        self.device = device
        self.devices_per_node = devices_per_node
        self.nodes = nodes
        self.compute = ComputeModel(device, profile)
        self.comm = CommModel(Topology(devices_per_node=devices_per_node, intra=intra_node, inter=inter_node),
                              profile)
        self.usable_bytes = device.memory_bytes * (1.0 - memory_reserve_fraction)
        self.dtype = graph.dtype
        self.elem = _DTYPE_BYTES.get(graph.dtype, 2)
        self.runs = group_runs(graph.layers)
        # Thousands of candidates share these pieces; caching them keeps pricing all of them cheap.
        self._time = lru_cache(maxsize=None)(self._run_times)
        self._local_run = lru_cache(maxsize=None)(lambda ri, tp: self.local_params(self.runs[ri][0], tp))
        self._state_run = lru_cache(maxsize=None)(self._run_states)
        self._opt_run = lru_cache(maxsize=None)(self._run_optimizer_s)
        self._sync = lru_cache(maxsize=None)(self._dp_tail_key)
        self._runs = lru_cache(maxsize=None)(self._run_list)
        self.profile = self.comm.profile
        prof_cores = getattr(getattr(self.profile, "machine", None), "cpu_count", 0)
        self.cpu_cores = prof_cores if backend == "gloo" and device.kind == "cpu" else 0
        self._inflight = lru_cache(maxsize=None)(
            lambda sched, pp, m, v: tuple(memory.inflight_microbatches(sched, pp, m, q, v) for q in range(pp)))
        self._ranks = lru_cache(maxsize=None)(self._rank_memory_key)
        self._inter = lru_cache(maxsize=None)(self._inter_node_key)
        self._span = sequence_span(graph)

    @classmethod
    def for_cluster(cls, graph: ModelGraph, cluster, profile=None,
                    memory_reserve_fraction: float = memory.ALLOCATOR_RESERVE_FRACTION) -> CostModel:
        return cls(graph, device=cluster.device, devices_per_node=cluster.devices_per_node, nodes=cluster.nodes,
                   intra_node=cluster.intra_node, inter_node=cluster.inter_node,
                   profile=profile if profile is not None else getattr(cluster, "profile", None),
                   memory_reserve_fraction=memory_reserve_fraction, backend=getattr(cluster, "backend", "nccl"))

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    # ---- per layer ----
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
        f = self.tp_param_fraction(layer)
        return layer.num_params * (1.0 - f + f / tp)

    def _run_times(self, ri: int, tp: int, sp: bool, mbs: int, compiled: bool = False) -> dict[str, object]:
        layer = self.runs[ri][0]
        compiled = compiled and layer.kind == "block" and bool(layer.kernels_forward.fused)  # codegen compiles blocks
        f = layer.forward_flops_tp_sharded / layer.forward_flops if layer.forward_flops > 0 else 0.0
        share = 1.0 - f + f / tp
        fp = self.tp_param_fraction(layer)
        param_bytes = layer.param_bytes * (1.0 - fp + fp / tp)
        if _has_kernels(layer):
            fwd = self._pass_s(layer.kernels_forward, tp, sp, mbs, compiled)
            bwd = self._pass_s(layer.kernels_backward, tp, sp, mbs, compiled)
            if tp == 1 and not compiled:
                fwd = max(fwd, self._measured_floor_s(layer, "fwd", mbs))
                bwd = max(bwd, self._measured_floor_s(layer, "bwd", mbs))
        else:
            act_traffic = max(0.0, layer.bytes_read + layer.bytes_written - layer.param_bytes) * mbs * share
            fwd = self.compute.op_time_s(mbs * layer.forward_flops * share, param_bytes + act_traffic, self.dtype)
            # Backward reads weights and activations and writes both gradients: twice the forward traffic.
            bwd = self.compute.op_time_s(mbs * layer.backward_flops * share, 2 * (param_bytes + act_traffic),
                                         self.dtype)
        tp_s = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        for c in tp_collectives(self.graph, layer, tp=tp, sp=sp, micro_batch=mbs, span=self._span):
            tp_s[c.phase] += self.collective_s(c.op, c.n_bytes, tp, tp)
        tp_fwd, tp_bwd = tp_s["forward"], tp_s["backward"]
        if tp > 1 and layer.tp_patterns:  # DTensor dispatch on CPU (TP_HOST_FLOORS_PER_GEMM), in the passes
            host = self.host_floor_s * TP_HOST_FLOORS_PER_GEMM * layer.kernels_forward.gemm_count
            bwd += host
        else:
            host = 0.0
        core_flops = 0.0
        if self.graph.seq_len:
            for pat in layer.tp_patterns:
                if pat.kind == "attention":
                    width = pat.num_heads * (pat.head_dim or (self.graph.hidden_size or 0) // pat.num_heads)
                    core_flops += 4.0 * mbs * self.graph.seq_len ** 2 * width / tp
        core_bytes = layer.saved_activation_bytes_attention_core * mbs / tp
        core = [k for k in layer.kernels_forward.kernels if k.attention_core]
        if core:  # the captured attention-core kernels, priced as the pass prices them
            sel = self._pass_s(dataclasses.replace(layer.kernels_forward, kernels=tuple(core)), tp, sp, mbs)
        elif _has_kernels(layer) and (core_flops or core_bytes):
            kf = layer.kernels_forward
            sel = self.compute.kernels_time_s(
                gemm_flops=0.0, gemm_count=0, attention_flops=core_flops, attention_count=kf.attention_count,
                memory_bytes=2 * core_bytes, memory_count=max(1, kf.attention_count), dtype=self.dtype)
        else:
            sel = self.compute.op_time_s(core_flops, core_bytes, self.dtype) if core_flops or core_bytes else 0.0
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

        sac_known = layer.kind == "block" and layer.saved_activation_bytes_op_sac is not None
        if sac_known:
            kf = layer.kernels_forward
            rerun = [k for k in kf.kernels if not k.op_sac_saved and (not compiled or k.kind in ("gemm", "attention"))]
            sac = self._pass_s(dataclasses.replace(kf, kernels=tuple(rerun) + (kf.fused if compiled else ())),
                               tp, sp, mbs) + tp_fwd
        else:
            sac = 0.0 if layer.kind != "block" else fwd + tp_fwd
        recompute = tuple({"none": 0.0, "selective": sel, "op_sac": sac, "full": fwd + tp_fwd}[k] for k in MODES)
        acts = tuple(acts_of(k) if k != "op_sac" or layer.kind == "block" else acts_of("none") for k in MODES)
        send_bytes = layer.boundary_bytes * mbs / (tp if sp else 1)
        return {"compute": fwd + bwd, "host": host, "backward": bwd, "tp_comm": tp_fwd + tp_bwd,
                "tp_step": tp_s["step"],
                "recompute": recompute, "act": acts, "names": tuple(la.name for la in self.runs[ri]),
                "time": tuple(fwd + bwd + tp_fwd + tp_bwd + r for r in recompute),
                "send": (self.p2p_s(send_bytes, False), self.p2p_s(send_bytes, True))}

    def layer_compute_s(self, name: str, *, tp: int = 1, sp: bool = False, micro_batch: int = 1,
                        compiled: bool = False) -> float:
        """Forward + backward compute of layer `name` on one device, as the planner charges it (no comm,
        no recompute; `compiled`: as a compiled block): what benchmarks/cost_model_accuracy.py and
        benchmarks/compile_gain_cpu.py set against a measured layer step."""
        ri = next((i for i, g in enumerate(self.runs) if any(la.name == name for la in g)), None)
        if ri is None:
            raise KeyError(f"no layer named {name!r}; layers are {[la.name for la in self.graph.layers]}")
        return self._time(ri, tp, sp, micro_batch, compiled)["compute"]

    def eager_memory_share(self, *, tp: int, sp: bool, mbs: int) -> tuple[int, float]:
        """(memory-bound kernels per forward, their share of forward + backward time) of the model's first
        block, run eagerly: each norm, activation, rotary and residual op a kernel of its own that reads and
        writes HBM, as the model's code runs them (0, 0.0 without a captured kernel list)."""
        block = next((la for la in self.graph.layers if la.kind == "block" and la.kernels_forward.kernels), None)
        if block is None:
            return 0, 0.0
        memory_bound = [k for k in block.kernels_forward.kernels if k.kind not in ("gemm", "attention")]
        total = self._pass_s(block.kernels_forward, tp, sp, mbs) + self._pass_s(block.kernels_backward, tp, sp, mbs)
        mem = sum(self._pass_s(dataclasses.replace(mix, kernels=tuple(k for k in mix.kernels
                                                                       if k.kind not in ("gemm", "attention"))),
                               tp, sp, mbs) for mix in (block.kernels_forward, block.kernels_backward))
        return sum(k.count for k in memory_bound), (mem / total if total > 0 else 0.0)

    def _measured_floor_s(self, layer: LayerSpec, phase: str, mbs: int) -> float:
        """The profile's own timing of one pass of `layer` (`autopar profile MODEL`: Profile.layer_times, one
        process, scaled to this process count as the kernel tables are) at the largest micro-batch ≤ mbs it
        measured, else 0. A pass at a larger micro-batch takes no less, so it bounds the kernel sum from
        below where framework time the kernels do not see (module calls, autograd, eager dispatch) dominates:
        gpt-tiny at one sample, a block's forward and backward measured 5.8 ms where its kernels price
        2.3 ms, and a plan of 4 micro-batches of 1 ran 2.4× its prediction (`autopar report`)."""
        prof = self.compute.profile
        best_b, best_t = 0, 0.0
        for key, t in (prof.layer_times.items() if prof is not None else ()):
            sig, ph, b, tp = key.rsplit(":", 3)
            if sig == layer.signature and ph == phase and tp == "t1" and b[1:].isdigit() and best_b < int(b[1:]) <= mbs:
                best_b, best_t = int(b[1:]), t
        return best_t

    def _pass_s(self, mix: KernelMix, tp: int, sp: bool, mbs: int, compiled: bool = False) -> float:
        """One forward or backward pass of a layer on one device: its kernels at micro-batch `mbs`, each
        priced at its own size, layout and class (ComputeModel.kernel_time_s); mixes without a kernel
        list by their per-kind totals (ComputeModel.kernels_time_s). `compiled`: the memory-bound kernels
        as TorchInductor fuses them (KernelMix.fused), GEMMs and attention unchanged."""
        if mix.kernels:
            total = 0.0
            kernels = mix.kernels
            if compiled and mix.fused:
                kernels = tuple(k for k in mix.kernels if k.kind in ("gemm", "attention")) + mix.fused
            for k in kernels:
                memory = k.kind not in ("gemm", "attention")
                share = 1.0 / tp if k.tp_sharded or (memory and sp) else 1.0
                total += k.count * self.compute.kernel_time_s(
                    k.kind, mbs * share * k.work, dtype=self.dtype, tensor_bytes=mbs * share * k.tensor_bytes,
                    layout=k.layout, mnk=k.mnk)
            return total

        def work(total: float, sharded: float, all_sharded: bool = False) -> float:
            return mbs * (total / tp if all_sharded else total - sharded + sharded / tp)

        return self.compute.kernels_time_s(
            gemm_flops=work(mix.gemm_flops, mix.gemm_flops_tp_sharded), gemm_count=mix.gemm_count,
            attention_flops=work(mix.attention_flops, mix.attention_flops_tp_sharded),
            attention_count=mix.attention_count,
            memory_bytes=work(mix.memory_bytes, mix.memory_bytes_tp_sharded, all_sharded=sp and tp > 1),
            memory_count=mix.memory_count, dtype=self.dtype)

    # ---- per candidate ----
    def model_states(self, num_params: float, zero_stage: int, dp: int) -> memory.ModelStateBytes:
        """Weights, gradients and optimizer states of num_params on one device, in this model's dtype."""
        w = self.elem
        opt = 12 if w == 2 else 8  # mixed precision: fp32 master + 2 moments; fp32 training: 2 moments
        return memory.model_state_bytes(num_params, zero_stage=zero_stage, dp=dp, weight_bytes=w, grad_bytes=w,
                                        optimizer_bytes=opt)

    def _states(self, layer: LayerSpec, c: Candidate) -> memory.ModelStateBytes:
        return self.model_states(self.local_params(layer, c.tp), c.zero_stage, c.dp)

    def _run_states(self, ri: int, tp: int, zero_stage: int, dp: int) -> float:
        return self.model_states(self._local_run(ri, tp), zero_stage, dp).total_bytes

    def _run_optimizer_s(self, ri: int, tp: int, shards: int) -> float:
        local = self._local_run(ri, tp) / shards
        return self.compute.op_time_s(0.0, ADAM_BYTES_PER_PARAM * local, "float32") + self._opt_host_s(ri, tp, shards)

    def _opt_host_s(self, ri: int, tp: int, shards: int) -> float:
        """Of the optimizer step: AdamW's DTensor dispatch over tensor-parallel parameters (on CPU)."""
        layer = self.runs[ri][0]
        if tp <= 1 or not layer.tp_patterns:
            return 0.0
        return self.host_floor_s * TP_OPTIMIZER_FLOORS_PER_GEMM * layer.kernels_forward.gemm_count / shards

    @property
    def host_floor_s(self) -> float:
        """The floor framework host overheads are counted in (DTensor TP, FSDP2 hooks): the profile's host
        floor on CPU with gloo (not divided among processes, scaled by its own calibration), else 0."""
        return self.profile.host_overhead_floor_s if self.cpu_cores and self.profile is not None else 0.0

    # ---- communication as the runtime issues it ----
    def sharing_factor(self, group_size: int) -> float:
        """How much slower a g-rank collective runs in this job than the profiler measured it (module
        docstring): 1 unless gloo processes outnumber the cores."""
        c = self.cpu_cores
        if not c:
            return 1.0
        return max(1.0, self.world_size / c) / max(1.0, group_size / c)

    def collective_s(self, op: str, n_bytes: float, group_size: int, ranks_per_node: int | None = None) -> float:
        """One collective of n_bytes over group_size ranks (module docstring: tables, fallbacks, sharing)."""
        if group_size <= 1 or n_bytes <= 0:
            return 0.0
        prof = self.profile
        fn = {"all_reduce": self.comm.all_reduce_time_s, "all_gather": self.comm.all_gather_time_s,
              "reduce_scatter": self.comm.reduce_scatter_time_s, "broadcast": self.comm.broadcast_time_s}[op]
        local = group_size <= self.devices_per_node and (ranks_per_node in (None, group_size))
        if (prof is not None and local and op != "all_reduce" and not prof.collective_table(op, group_size)
                and prof.collective_table("all_reduce", group_size)):
            t = 0.5 * self.comm.all_reduce_time_s(n_bytes, group_size, ranks_per_node)
        else:
            t = fn(n_bytes, group_size, ranks_per_node)
        return t * self.sharing_factor(group_size)

    def p2p_s(self, n_bytes: float, inter_node: bool) -> float:
        return self.comm.p2p_time_s(n_bytes, inter_node) * self.sharing_factor(2)

    def dp_tail(self, c: Candidate) -> DPTail:
        return self._sync(c.tp, c.pp, c.dp, c.zero_stage, c.num_microbatches)

    def _dp_tail_key(self, tp: int, pp: int, dp: int, zero_stage: int, m: int) -> DPTail:
        rpn = math.gcd(dp, max(1, self.devices_per_node // tp))
        grad_bytes = sum(len(g) * self._local_run(ri, tp) for ri, g in enumerate(self.runs)) * self.elem / pp

        def coll(op: str, n: float, k: int) -> float:
            return self.collective_s(op, n, k, rpn if k == dp else None)

        return DPTail(zero_stage=zero_stage, dp=dp, world=self.world_size, microbatches=m,
                      rank_grad_bytes=grad_bytes, collective_s=coll,
                      memory_s=lambda n: self.compute.op_time_s(0.0, n, self.dtype),
                      host_floor_s=self.host_floor_s)

    def problem(self, c: Candidate, modes: tuple[str, ...] = MODES, per_layer: bool = True) -> InnerProblem:
        # runs do not depend on the schedule: candidates that differ only in it share them
        runs = self._runs(dataclasses.replace(c, schedule="1f1b", virtual_stages=1))
        ranks = self.rank_memory(c)
        return InnerProblem(runs=runs, num_ranks=c.pp, virtual_stages=c.virtual_stages,
                            num_microbatches=c.num_microbatches,
                            inflight=self._inflight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages),
                            capacity_bytes=tuple(r.capacity_bytes for r in ranks), inter_node=self.inter_node(c),
                            modes=modes, grad_sync_latency_s=self.dp_tail(c).fixed_s, per_layer=per_layer)

    def _run_list(self, c: Candidate) -> tuple[Run, ...]:
        tail = self.dp_tail(c)
        shards = c.dp if c.zero_stage >= 1 else 1
        overlaps = self.backend == "nccl" and c.zero_stage >= 2 and c.dp > 1  # see __init__: what hides
        runs = []
        for ri, group in enumerate(self.runs):
            layer = group[0]
            tm = self._time(ri, c.tp, c.sequence_parallel, c.micro_batch_size, c.compile)
            rec = tm["recompute"]
            grad_bytes = self._local_run(ri, c.tp) * self.elem
            # FSDP2's host work lands where the runtime spends it: hooks in the passes, DTensor in the step
            hooks, opt_host = (tail.hooks_s, tail.optimizer_host_s) if grad_bytes > 0 else (0.0, 0.0)
            runs.append(Run(
                name=layer.name, count=len(group), layer_names=tm["names"],
                time_s=tuple(t + hooks for t in tm["time"]), compute_s=(tm["compute"] + hooks,) * len(MODES),
                recompute_s=rec, tp_comm_s=(tm["tp_comm"],) * len(MODES), act_bytes=tm["act"],
                state_bytes=self._state_run(ri, c.tp, c.zero_stage, c.dp),
                # FSDP2 issues each micro-batch's gathers in that micro-batch's passes (DPTail.hidden_s)
                backward_s=tail.hidden_s(grad_bytes, tm["compute"] - tm["backward"], tm["backward"])
                if overlaps else 0.0,
                grad_sync_s=tail.layer_s(grad_bytes) + tm["tp_step"] + shared_sync_s(self, ri, c),
                optimizer_s=self._opt_run(ri, c.tp, shards) + opt_host, send_s=tm["send"],
                host_s=tm["host"] + hooks, optimizer_host_s=self._opt_host_s(ri, c.tp, shards) + opt_host))
        return tuple(runs)

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
        shared = shared_duplicate_states(self, tp, zero_stage, dp).total_bytes if pp == 1 else 0.0
        ranks = [RankMemory(logits_bytes=lg, zero3_buffer_bytes=zero3_bytes,
                            capacity_bytes=self.usable_bytes - lg - zero3_bytes + shared) for lg in (0.0, logits)]
        return (ranks[0],) * (pp - 1) + (ranks[1],)  # only the last rank holds the logits

    def inter_node(self, c: Candidate) -> tuple[bool, ...]:
        """Whether the p2p between stage s and s+1 crosses nodes (mesh (pp, dp, tp), tp innermost)."""
        return self._inter(c.pp, c.virtual_stages, c.dp * c.tp)

    def _inter_node_key(self, pp: int, v: int, block: int) -> tuple[bool, ...]:
        dpn = self.devices_per_node

        def crosses(a: int, b: int) -> bool:
            return any((a * block + j) // dpn != (b * block + j) // dpn for j in range(min(block, dpn)))

        return tuple(crosses(s % pp, (s + 1) % pp) for s in range(pp * v - 1))

    def memory_breakdown(self, c: Candidate, layer_names_by_rank: list[list[str]], act_bytes_by_rank: list[float],
                         workspace_by_rank: list[float]) -> list[dict[str, int]]:
        """Per rank: weights, grads, optimizer, activations, workspace, logits, zero3_buffer (bytes/device)."""
        ranks = self.rank_memory(c)
        out = []
        for q, names in enumerate(layer_names_by_rank):
            st = [self._states(self.graph.layer(n), c) for n in names]
            if c.pp == 1:  # held once (see _rank_memory_key)
                dup = shared_duplicate_states(self, c.tp, c.zero_stage, c.dp)
                st.append(type(dup)(weights_bytes=-dup.weights_bytes, grads_bytes=-dup.grads_bytes,
                                    optimizer_bytes=-dup.optimizer_bytes))
            out.append({"weights": int(sum(s.weights_bytes for s in st)), "grads": int(sum(s.grads_bytes for s in st)),
                        "optimizer": int(sum(s.optimizer_bytes for s in st)), "activations": int(act_bytes_by_rank[q]),
                        "workspace": int(workspace_by_rank[q]), "logits": int(ranks[q].logits_bytes),
                        "zero3_buffer": int(ranks[q].zero3_buffer_bytes)})
        return out
