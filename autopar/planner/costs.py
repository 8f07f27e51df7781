"""The ILP's numbers for one outer `Candidate`: a graph priced on a cluster, assembled into an `InnerProblem`.

The planner's adapter to `cost_models` (docs/design.md §2) reads as its parts, each a module with one
entry, which this module builds and joins:

  memory_costs.MemoryCosts    how much memory: parameters and model states per device, activations per
                              recompute mode, logits and FSDP buffers per pipeline rank, shared weights
  compute_costs.ComputeCosts  how long the kernels take: each layer's passes, recompute, optimizer, host
  comm_costs.CommCosts        how long communication takes: TP collectives per layer, p2p sends per
                              boundary, the data-parallel tail per step, shared weights' cross-stage sum
  fp8_costs, offload_costs    FP8 GEMMs and their casts (inside compute_costs' passes), float8 gathers and
                              amax reductions; the host's part of an offloaded step and its copies
  cp_costs                    context parallelism's K/V exchange, causal-block overhead and gathered K/V;
                              under cp every per-token cost above is priced at mbs/cp samples
                              (Candidate.tokens_share) and weights are averaged and sharded over dp·cp

`CostModel.problem(c)` turns them into one `Run` per run of identical layers (time by recompute mode,
activation and model-state bytes, gradient-sync, optimizer and p2p time) and each pipeline rank into
its in-flight micro-batches and memory capacity. Data-parallel collectives overlap compute only where
communication runs beside it (NCCL on its own CUDA stream) and the runtime issues them during the
passes: FSDP2 (ZeRO-2/3) prefetches all-gathers during forward and reduce-scatters during backward, so
one micro-batch's forward and backward (β) hide them; autopar's ZeRO-0/1 all-reduce the dense gradients
by bucket during the last micro-batch's backward (autopar.codegen.grad_overlap), which hides each layer's
share behind that layer's backward, and ZeRO-1 broadcasts the updated parameters by bucket into the next
step's first forward (autopar.codegen.param_prefetch), which hides each layer's share behind a layer's forward;
gloo shares the CPU cores. Under sequence parallelism a layer that
must see the whole sequence (capture.sequence.full_sequence_reason: attention TP keeps whole) has its
kernels, activations and expert tokens priced at the full sequence; comm_costs prices the gather and split
around it.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from autopar.capture.graph import ModelGraph
from autopar.capture.sequence import full_sequence_reason
from autopar.config import ParallelConfig
from autopar.planner.comm_costs import CommCosts
from autopar.planner.compute_costs import ADAM_BYTES_PER_PARAM, ComputeCosts
from autopar.planner.cp_costs import cp_layer_costs
from autopar.planner.memory_costs import MemoryCosts
from autopar.planner.offload_costs import OffloadSummary
from autopar.planner.problem import MODES, InnerProblem, Run
from autopar.planner.space import Candidate
from cost_models import fleet, memory, pipeline
from cost_models.comm import CommModel, Topology
from cost_models.compute import ComputeModel
from cost_models.hardware import DeviceSpec, HostSpec, LinkSpec
from cost_models.pipeline_order import bottleneck_slots
from cost_models.precision import default_precision
from cost_models.profile import Profile

__all__ = ["CostModel"]


class CostModel:
    """Prices a graph on one cluster: `memory`, `compute` and `comm` (the parts), `problem(c)` (the ILP)."""

    def __init__(self, graph: ModelGraph, *, device: DeviceSpec, devices_per_node: int, nodes: int,
                 intra_node: LinkSpec, inter_node: LinkSpec, profile: Profile | None = None,
                 memory_reserve_fraction: float = memory.ALLOCATOR_RESERVE_FRACTION, backend: str = "nccl",
                 host: HostSpec | None = None, loss_kernel: str | None = None,
                 precision: str | None = None, pipeline_runtime: str = "autopar",
                 ep_dispatcher: str = "all_to_all", fp8_runtime: str = "torchao") -> None:
        """precision: the policy every layout is priced in (ParallelConfig.precision; default: the device's
        practitioner default, cost_models.precision.default_precision). pipeline_runtime: the runtime
        that runs pp > 1 (cost_models.pipeline.PIPELINE_RUNTIMES): how it issues stage-boundary transfers,
        what it holds in memory and how its framework launches expert GEMMs. ep_dispatcher: how
        expert-parallel groups move routed tokens (cost_models.comm.EP_DISPATCHERS). fp8_runtime: the framework
        running FP8 GEMMs (PlannerOptions.fp8_runtime; autopar.planner.fp8_costs)."""
        runtime = pipeline.runtime(pipeline_runtime)
        self.runtime = runtime
        self.graph = graph
        self.backend = backend
        self.device = device
        self.devices_per_node = devices_per_node
        self.nodes = nodes
        comm = CommModel(Topology(devices_per_node=devices_per_node, intra=intra_node, inter=inter_node), profile)
        profile = comm.profile
        cpu_cores = getattr(getattr(profile, "machine", None), "cpu_count", 0)
        cpu_cores = cpu_cores if backend == "gloo" and device.kind == "cpu" else 0
        # framework host overheads (DTensor TP, FSDP2 hooks) are priced in the profile's host floor on CPU with
        # gloo (not divided among processes, scaled by its own calibration), else not at all
        host_floor_s = profile.host_overhead_floor_s if cpu_cores and profile is not None else 0.0
        self.memory = MemoryCosts(graph, memory_bytes=device.memory_bytes,
                                  precision=precision or default_precision(device.kind, device.peak_flops),
                                  memory_reserve_fraction=memory_reserve_fraction, host=host,
                                  devices_per_node=devices_per_node, loss_kernel=loss_kernel,
                                  pipeline_memory=runtime.memory,
                                  host_adam_bytes_per_param=ADAM_BYTES_PER_PARAM, fp8_runtime=fp8_runtime)
        self.precision = self.memory.precision
        # a step over many GPUs in lock step runs at its slowest GPU's speed (cost_models.fleet)
        straggler = fleet.straggler_factor(devices_per_node * nodes) if device.kind == "gpu" else 1.0
        self.compute = ComputeCosts(graph, self.memory, compute=ComputeModel(device, profile),
                                    host_floor_s=host_floor_s, straggler=straggler, expert_gemm=runtime.expert_gemm,
                                    fp8_runtime=fp8_runtime)
        self.comm = CommCosts(graph, self.memory, comm=comm, compute=self.compute.model,
                              devices_per_node=devices_per_node, nodes=nodes, cpu_cores=cpu_cores,
                              host_floor_s=host_floor_s, pipeline_p2p=runtime.p2p, ep_dispatcher=ep_dispatcher)
        # runs that run on the full sequence under SP (priced without it, but for their gather and split)
        self._full_sequence = tuple(full_sequence_reason(g[0]) is not None for g in self.memory.runs)
        self._runs = lru_cache(maxsize=None)(self._run_list)
        self._run_of = lru_cache(maxsize=None)(self._one_run)
        self._passes = lru_cache(maxsize=None)(self._layer_passes)
        self._floor = lru_cache(maxsize=None)(self._floor_key)
        self._accumulate = lru_cache(maxsize=None)(self._accumulation_sum)
        self._optimizer = lru_cache(maxsize=None)(self._optimizer_sum)

    @classmethod
    def for_cluster(cls, graph: ModelGraph, cluster, profile: Profile | None = None,
                    memory_reserve_fraction: float = memory.ALLOCATOR_RESERVE_FRACTION,
                    loss_kernel: str | None = None, precision: str | None = None,
                    pipeline_runtime: str = "autopar", ep_dispatcher: str = "all_to_all",
                    fp8_runtime: str = "torchao") -> CostModel:
        return cls(graph, device=cluster.device, devices_per_node=cluster.devices_per_node, nodes=cluster.nodes,
                   intra_node=cluster.intra_node, inter_node=cluster.inter_node,
                   profile=profile if profile is not None else getattr(cluster, "profile", None),
                   memory_reserve_fraction=memory_reserve_fraction, backend=getattr(cluster, "backend", "nccl"),
                   host=getattr(cluster, "host", None), loss_kernel=loss_kernel, precision=precision,
                   pipeline_runtime=pipeline_runtime, ep_dispatcher=ep_dispatcher, fp8_runtime=fp8_runtime)

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.nodes

    def offload_summary(self, config: ParallelConfig) -> OffloadSummary | None:
        """Where a device's states live under config.offload and the copies and CPU step it costs (None without
        offload): what `autopar plan` prints beside an offload plan."""
        if config.offload == "none":
            return None
        self.memory.offload.check(config.offload)
        return self.memory.offload_summary(Candidate.of(config), overlapped=self.backend == "nccl")

    def problem(self, c: Candidate, modes: tuple[str, ...] = MODES, per_layer: bool = True) -> InnerProblem:
        """The stage-cut and recompute ILP of candidate `c`, every number priced by the parts."""
        # runs do not depend on the schedule: candidates that differ only in it share them
        runs = self._runs(dataclasses.replace(c, schedule="1f1b", virtual_stages=1))
        ranks = self.memory.rank_memory(c)
        return InnerProblem(runs=runs, num_ranks=c.pp, virtual_stages=c.virtual_stages,
                            num_microbatches=c.num_microbatches, inflight=self.memory.inflight(c),
                            capacity_bytes=tuple(r.capacity_bytes for r in ranks), inter_node=self.comm.inter_node(c),
                            modes=modes, per_layer=per_layer,
                            slots=(None if c.microbatch_group is None else
                                   bottleneck_slots(c.pp, c.virtual_stages, c.num_microbatches, c.microbatch_group)),
                            grad_sync_latency_s=self.comm.dp_tail(c).fixed_s + self.comm.expert_tail(c).fixed_s)

    def floor(self, c: Candidate) -> tuple[float, float]:
        """(W, Ω): lower bounds on Σ over c's layers of each one's least time per micro-batch (min over modes
        of Run.time_s) and of its optimizer seconds (Run.optimizer_s), from the parts' cached terms alone,
        without pricing c's runs. Each is a sum of some of the non-negative terms `_one_run` adds up (passes,
        the runtime's gradient accumulation, TP and expert collectives, cp's K/V exchange; not recompute,
        FSDP hooks, FP8 amax or batch-norm reductions, offload's copies), shaved by 1e-12 for rounding, so the
        search may order and prune candidates by it before building their problems (search: level −1)."""
        gathered = self.memory.fp8_gathered(c)
        work = self._floor(c.tp, c.sequence_parallel, c.micro_batch_size, c.cp, c.compile, c.ep, c.etp, c.fp8,
                           gathered, c.shard_group if gathered else 1)
        if self.runtime.accumulation == "autograd_16bit" and c.pp > 1 and c.num_microbatches > 1:
            m = c.num_microbatches
            work += self._accumulate(c.tp, c.ep, c.etp) * (m - 1) / m
        shards = c.shard_group if c.zero_stage >= 1 else 1
        opt = self._optimizer(c.tp, shards, c.ep, c.etp, c.offload, c.zero_stage == 1)
        return work * (1 - 1e-12), opt * (1 - 1e-12)

    def over_memory(self, c: Candidate, modes: tuple[str, ...]) -> bool:
        """Whether c's layers under their leanest allowed modes (model states, and activations at the fewest
        micro-batches any rank holds in flight, without cp's K/V), pooled over its pipeline ranks, exceed
        their memory: then `bound.lower_bound` of its problem is +inf, known without pricing its runs."""
        phi = min(self.memory.inflight(c))
        pipelined = self.memory.pipelined(c)
        ks = [MODES.index(k) for k in modes]
        need = 0.0
        for ri, group in enumerate(self.memory.runs):
            ep, etp = (c.ep, c.etp) if group[0].moe is not None else (1, 1)
            acts = self.memory.activation_bytes(ri, c.tp, self._run_sp(ri, c.sequence_parallel, c.tp),
                                                c.micro_batch_size, c.compile)
            need += len(group) * (self.memory.run_state_bytes(ri, c.tp, c.zero_stage, c.shard_group, ep, c.offload,
                                                              pipelined, etp)
                                  + phi * min(acts[k] for k in ks) / c.cp)
        capacity = sum(r.capacity_bytes for r in self.memory.rank_memory(c))
        return need * (1 - 1e-12) > capacity * (1 + 1e-9)

    def _layers_sum(self, per_layer, ep: int, etp: int) -> float:
        """Σ over the graph's layers of per_layer(ri, ep, etp), a dense run priced at ep = etp = 1 as in
        `_run_list`."""
        return sum(len(group) * per_layer(ri, *((ep, etp) if group[0].moe is not None else (1, 1)))
                   for ri, group in enumerate(self.memory.runs))

    def _accumulation_sum(self, tp: int, ep: int, etp: int) -> float:
        return self._layers_sum(lambda ri, e, et: self.compute.grad_accumulation_s(ri, tp, e, et), ep, etp)

    def _optimizer_sum(self, tp: int, shards: int, ep: int, etp: int, offload: str, zero1: bool = False) -> float:
        """The layers' optimizer steps: on the device, or the host's part of an offloaded one (Run.optimizer_s)."""
        def one(ri: int, e: int, et: int) -> float:
            if offload == "none":
                return self.compute.optimizer_s(ri, tp, shards, e, et, whole_tensors=zero1)
            return self.memory.offload.step_s(self.memory.run_local_params(ri, tp, e, et) / shards, offload)
        return self._layers_sum(one, ep, etp)

    def _floor_key(self, tp: int, sp: bool, mbs: int, cp: int, compiled: bool, ep: int, etp: int, fp8: str,
                   gathered: bool, dp: int) -> float:
        def layer(ri: int, e: int, et: int) -> float:
            t, tp_s, ep_s, cp_s = self._passes(ri, tp, sp, mbs, cp, compiled, e, et, fp8, gathered, dp)
            return (t.compute_s + cp_s.attention_extra_s + tp_s["forward"] + tp_s["backward"] + ep_s["forward"]
                    + ep_s["backward"] + cp_s.forward_s + cp_s.backward_s)
        return self._layers_sum(layer, ep, etp)

    def _layer_passes(self, ri: int, tp: int, sp: bool, mbs: int, cp: int, compiled: bool, ep: int, etp: int,
                      fp8: str, gathered: bool, dp: int) -> tuple:
        """One layer of run ri's kernels, TP and expert collectives and context-parallel terms per micro-batch
        (what `_one_run` and `floor` share)."""
        share = mbs / cp  # Candidate.tokens_share: each rank runs 1/cp of every sequence
        tp_s = self.comm.tp_times(ri, tp, sp, share)  # the span says which layers run sharded
        sp = self._run_sp(ri, sp, tp)
        t = self.compute.run(ri, tp, sp, share, compiled, ep, fp8, gathered, dp, etp)
        ep_s = self.comm.ep_times(ri, tp, sp, share, ep, cp, etp)
        cp_s = cp_layer_costs(self.graph, self.memory.runs[ri][0], tp=tp, cp=cp, micro_batch=mbs,
                              elem=self.memory.elem,
                              attention_s=tuple(self.compute.attention_s(ri, tp, sp, share, backward=b)
                                                for b in (False, True)) if cp > 1 else (0.0, 0.0),
                              attention_full_s=tuple(self.compute.attention_s(ri, tp, sp, share, False, b)
                                                     for b in (False, True)) if cp > 1 else (0.0, 0.0),
                              collective_s=self.comm.collective_s, devices_per_node=self.devices_per_node,
                              selective_cache=self.memory.selective_cache)
        return t, tp_s, ep_s, cp_s

    def _run_sp(self, ri: int, sp: bool, tp: int) -> bool:
        """Whether run ri computes on sequence shards under a layout with sequence parallelism `sp` at degree tp:
        not a layer that must see the whole sequence, nor an embedding or head whose vocabulary tp leaves whole
        (capture.vocab_split: the hidden states are gathered before such a head, split after such an embedding)."""
        return sp and not self._full_sequence[ri] and self.memory.run_layer(ri, tp) is self.memory.runs[ri][0]

    def _run_list(self, c: Candidate) -> tuple[Run, ...]:
        # a run without experts is priced alike at every ep and etp: one Run shared by those candidates
        dense = dataclasses.replace(c, ep=1, etp=1)
        return tuple(self._run_of(ri, c if group[0].moe is not None else dense)
                     for ri, group in enumerate(self.memory.runs))

    def _one_run(self, ri: int, c: Candidate) -> Run:
        mem, comm = self.memory, self.comm
        tail, expert_tail = comm.dp_tail(c), comm.expert_tail(c)  # dense gradients over dp·cp, experts' apart
        group_size = c.shard_group  # ranks averaging gradients and sharding ZeRO states: dp·cp
        shards = group_size if c.zero_stage >= 1 else 1
        overlaps = self.backend == "nccl" and group_size > 1  # module docstring: what hides
        sp, mbs = c.sequence_parallel, c.tokens_share  # each rank runs 1/cp of every sequence
        gathered = mem.fp8_gathered(c)
        group = mem.runs[ri]
        # kernels; TP collectives; expert all-to-alls (and etp sums), priced as tp_comm; cp's terms
        t, tp, ep, cp = self._passes(ri, c.tp, sp, c.micro_batch_size, c.cp, c.compile, c.ep, c.etp, c.fp8, gathered,
                                     c.shard_group if gathered else 1)
        amax = comm.fp8_amax_s(ri, c)  # tensorwise scales of TP-sharded tensors: 2 forward, 1 backward
        bn_fwd, bn_bwd = comm.batch_norm_s(ri, c)  # batch-norm statistics over dp: counted as tp_comm too
        # the K/V exchange is context parallelism's collective, priced (and reported) beside TP's
        tp_fwd = tp["forward"] + ep["forward"] + amax * 2 / 3 + bn_fwd + cp.forward_s
        tp_bwd = tp["backward"] + ep["backward"] + amax / 3 + bn_bwd + cp.backward_s
        # a mode that runs the forward again runs its TP collectives again; of the K/V exchange only full
        # recompute gathers again (both selective policies keep the gather's output: cp_costs), eager or compiled
        rec = tuple(r + (tp_fwd - cp.forward_s if again else 0.0) + (cp.forward_s if k == "full" else 0.0)
                    for r, again, k in zip(t.recompute_s, t.recompute_tp, MODES, strict=True))
        compute_s = t.compute_s + cp.attention_extra_s
        # the runtime's sum of the micro-batches' weight gradients (cost_models.pipeline.GRAD_ACCUMULATION):
        # a pass in every backward but the first micro-batch's, spread over the m micro-batches
        if self.runtime.accumulation == "autograd_16bit" and c.pp > 1 and c.num_microbatches > 1:
            m = c.num_microbatches
            compute_s += self.compute.grad_accumulation_s(ri, c.tp, c.ep, c.etp) * (m - 1) / m
        saved = mem.activation_bytes(ri, c.tp, self._run_sp(ri, sp, c.tp), c.micro_batch_size, c.compile, c.ep, c.etp)
        acts = tuple(a / c.cp + cp.saved_bytes(k)  # a sample's activations ÷ cp, and the gathered K/V
                     for a, k in zip(saved, MODES, strict=True))
        local = mem.run_local_params(ri, c.tp, c.ep, c.etp)
        grad_bytes = mem.grad_bytes(local)
        # the experts' gradients (their share of the layer's) reduce over the ranks holding them
        expert_share = mem.local_expert_params(group[0], c.ep, c.etp) / local if local > 0 else 0.0
        gather = mem.gathered_bytes(ri, c.tp, True, c.ep, c.etp) if gathered else None
        # offload="params": every gather copies the shard in from the host, the reduce-scatter's goes back
        copy = (mem.offload.gather_copy_s(grad_bytes / group_size) if c.offload == "params" and grad_bytes > 0
                else 0.0)
        parts = tuple((pt, grad_bytes * s, gather * s if gather is not None else None,
                       mem.offload.gather_copy_s(grad_bytes * s / pt.dp) if copy else 0.0)
                      for pt, s in ((tail, 1.0 - expert_share), (expert_tail, expert_share)) if s > 0)
        host_step = mem.offload.step_s(local / shards, c.offload)
        if c.offload == "params" and tail.gathers_per_step == 0:  # one rank: FSDP copies without collectives
            host_step += (2 * c.num_microbatches + 1) * copy
        # FSDP2's host work lands where the runtime spends it: hooks in the passes, DTensor in the step
        hooks, opt_host = (tail.hooks_s, tail.optimizer_host_s) if grad_bytes > 0 else (0.0, 0.0)
        device_opt = (0.0 if c.offload != "none" else
                      self.compute.optimizer_s(ri, c.tp, shards, c.ep, c.etp, whole_tensors=c.zero_stage == 1))
        device_opt += self.compute.fp8_weight_cast_s(ri, c.tp, c.fp8)  # TE's, once per step (fp8_costs)
        return Run(
            name=group[0].name, count=len(group), layer_names=tuple(la.name for la in group),
            time_s=tuple(compute_s + tp_fwd + tp_bwd + r + hooks for r in rec),
            compute_s=(compute_s + hooks,) * len(MODES),
            recompute_s=rec, tp_comm_s=(tp_fwd + tp_bwd,) * len(MODES),
            act_bytes=acts, state_bytes=mem.run_state_bytes(ri, c.tp, c.zero_stage, group_size, c.ep, c.offload,
                                                         mem.pipelined(c), c.etp),
            # FSDP2 issues each micro-batch's gathers in that micro-batch's passes, ZeRO-0/1 its all-reduce in the
            # last micro-batch's backward, ZeRO-1 its broadcast into the next step's first forward (DPTail.hidden_s)
            backward_s=_hidden_s(parts, t.forward_s + cp.attention_extra_forward_s,
                                 t.backward_s + cp.attention_extra_backward_s)
            if overlaps else 0.0,
            grad_sync_s=(sum(pt.layer_s(g, gb, cs) for pt, g, gb, cs in parts) + tp["step"]
                         + comm.shared_sync_s(ri, c) + (comm.fp8_scales_s(c) if ri == 0 else 0.0)),
            optimizer_s=device_opt + host_step + opt_host,
            send_s=comm.send_s(ri, c.tp, sp, mbs), host_s=t.host_s + hooks,
            optimizer_host_s=self.compute.optimizer_host_s(ri, c.tp, shards) + opt_host)


def _hidden_s(parts: tuple, forward_s: float, backward_s: float) -> float:
    """What a layer's passes hide of its FSDP collectives (DPTail.hidden_s) when its gradients reduce in
    parts over different groups (dense over dp·cp, experts over the ranks holding them): each part hides
    behind what of the passes the parts before it left."""
    hidden = 0.0
    for tail, grad_bytes, gather_bytes, copy_s in parts:
        hidden += tail.hidden_s(grad_bytes, forward_s, backward_s, gather_bytes, copy_s)
        ag, ag_b, rs = tail.overlapped_s(grad_bytes, gather_bytes, copy_s)
        forward_s, backward_s = max(0.0, forward_s - ag), max(0.0, backward_s - ag_b - rs)
    return hidden
