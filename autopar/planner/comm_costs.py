"""Communication time: tensor-, pipeline- and data-parallel traffic of a layout, as the runtime issues it.

Part of the planner's time pricing (compute_costs prices the kernels; costs.CostModel assembles both):

  TP comm         exactly the collectives codegen issues for a layer (autopar.planner.tp_costs.tp_collectives:
                  Megatron's all-reduces per pattern, forward-only for a vocab-parallel embedding, backward and
                  the parallel cross-entropy's for the LM head, SP's all-gathers and reduce-scatters), over t
                  ranks inside one node; per-step ones (SP norm-gradient reductions) join the layer's γ
  EP comm         a mixture-of-experts layer under expert parallelism: all-to-all dispatch and combine of the
                  routed token copies (MoESpec.dispatch_bytes_per_sample × b, one rank's send buffer) over the
                  ep ranks, twice forward and twice backward (the gradients return the same way; Lepikhin et
                  al. 2021, GShard §3.2; Megatron-Core's MoE token dispatcher), at the links the group crosses
                  (CommModel.all_to_all_time_s: ep consecutive data-parallel ranks, tp · cp apart in the mesh;
                  folded over tp (autopar.config.ep_folds), the tp ranks of ep / tp consecutive data-parallel
                  ranks), the busiest rank receiving more than the mean (autopar.planner.moe_load), each rank
                  sending its own tokens' copies (÷ tp under SP or folding: moe_load.moe_token_share), one
                  per (token, expert) or, priced for DeepEP, one per destination node and GPU
                  (CommModel.dispatch_time_s, PlannerOptions.ep_dispatcher; fewer nodes under a router that
                  opens only some expert groups to a token, MoESpec.route_groups). Folded
                  without SP, the tp ranks hold the same tokens and split them: the combined outputs are
                  all-gathered over tp in forward, the tokens' gradients in backward (autopar.codegen.experts).
                  With the experts tensor-parallel (etp = tp, never folded) every tp index moves all its tp
                  group's tokens through its own EP group, and the partial outputs of the FFN slices are summed
                  over tp (autopar.codegen.expert_tp): without SP an all-reduce of the combined outputs forward
                  and of the tokens' and routing weights' gradients backward; under SP the tokens, weights
                  and expert choices all-gathered forward and the outputs reduce-scattered, the transposes
                  backward (Megatron-Core's ETP layout; Shoeybi et al. 2019 §3's f/g operators)
  p2p             one send of the boundary tensor per micro-batch and direction, inside a node or across;
                  the two directions of a boundary run at once when the runtime batches them, one after
                  the other when each is a blocking call; under TP, Megatron-LM and DeepSpeed send 1/t
                  slices and all-gather them over NVLink (cost_models.comm.PIPELINE_P2P)
  DP / ZeRO       the collectives the runtime issues, counted and priced one by one (autopar.planner.dp_costs)
  batch norm      under data parallelism each batch norm synchronises its statistics over the dp ranks
                  every micro-batch (autopar.codegen.batch_norm): forward, an all-reduce of its C channel
                  sums with the count ((C + 1) fp32 values) and one of its C sums of squared deviations;
                  backward, the same two all-reduces of their gradients; on the critical path (each
                  waits for the ranks' statistics), so in the micro-batch's time (`batch_norm_s`)
  shared weights  with pp > 1 the replicas of a weight several layers share (a head tied to the embedding)
                  sum their gradients over the holding stages after the data-parallel reduction: one
                  all-reduce per step, charged to each holding layer (`shared_sync_s`)

Collectives are priced by the profile's table for that op and group size when it has one; an all-gather,
reduce-scatter or broadcast the profile did not measure at that size is half the measured all-reduce
(ring all-gather and reduce-scatter are each half of a ring all-reduce, in latency and in bytes;
Thakur, Rabenseifner & Gropp 2005); otherwise the α-β formulas. On gloo over N CPU processes sharing C
cores a collective of g ranks runs slower than the profiler measured it (g processes busy) by
max(1, N/C) / max(1, g/C): its copies, reductions and socket wake-ups need CPU time, and each process
gets C/N of a core when all N are busy (the same time-slicing Cluster.local applies to compute).
"""

from __future__ import annotations

import math
from collections import Counter
from functools import lru_cache

from autopar.capture.graph import ModelGraph
from autopar.capture.moe_spec import MoESpec
from autopar.capture.sequence import sequence_span
from autopar.capture.vocab_split import layer_at_tp
from autopar.config import ep_folds
from autopar.planner.dp_costs import DPTail
from autopar.planner.fp8_costs import cast_work, fp8_gemm, is_fp8_layer
from autopar.planner.memory_costs import MemoryCosts
from autopar.planner.moe_load import busiest_rank_factor, moe_token_share
from autopar.planner.space import Candidate
from autopar.planner.tp_costs import tp_collectives
from cost_models import fleet
from cost_models.comm import PIPELINE_P2P, CommModel
from cost_models.compute import ComputeModel

__all__ = ["CommCosts", "AMAX_BYTES", "etp_collectives", "ep_collective_bytes"]

AMAX_BYTES = 4  # one fp32 amax (torchao reduces amaxes in fp32)



def ep_collective_bytes(moe: MoESpec, tp: int, sp: bool, ep: int, mbs: float, etp: int = 1) -> tuple[float, float]:
    """Bytes of one MoE layer's expert-parallel collectives per micro-batch of `mbs` samples, as
    autopar.codegen.experts issues them (tests/test_ep_collectives.py counts them in a real run): one rank's
    dispatch send buffer (its routed token copies; the combine returns as many over the group, the busiest rank
    more), and, folded over tp without SP, the gathered bytes of the outputs' all-gather over tp (0 otherwise).
    With the experts tensor-parallel (etp > 1) every tp rank sends all its tp group's tokens, never folded."""
    send = moe.dispatch_bytes_per_sample * mbs * moe_token_share(tp, sp, ep, etp)
    gathered = moe.dispatch_bytes_per_sample / moe.top_k * mbs if ep_folds(tp, ep, etp) and not sp else 0.0
    return send, gathered

def etp_collectives(moe: MoESpec, mbs: float, sp: bool, hidden: int) -> tuple[tuple[str, str, float], ...]:
    """(phase, op, bytes) of the tp collectives around one MoE layer's bank split over the tp ranks (etp = tp),
    per micro-batch of `mbs` samples, as autopar.codegen.expert_tp issues them (tests/test_ep_collectives.py
    counts them in a real run): on the tokens [T, H] and the routing weights [T, k] in the model dtype and,
    under SP, the expert choices [T, k] in int64. The reduce-scatter's bytes are its input (the gathered rows)."""
    tokens = moe.dispatch_bytes_per_sample / moe.top_k * mbs
    weights = moe.dispatch_bytes_per_sample / hidden * mbs if hidden else 0.0
    choices = 8.0 * moe.tokens_per_sample * moe.top_k * mbs
    if not sp:
        return (("forward", "all_reduce", tokens), ("backward", "all_reduce", tokens),
                ("backward", "all_reduce", weights))
    return (("forward", "all_gather", tokens), ("forward", "all_gather", weights), ("forward", "all_gather", choices),
            ("forward", "reduce_scatter", tokens), ("backward", "reduce_scatter", tokens),
            ("backward", "reduce_scatter", weights), ("backward", "all_gather", tokens))


class CommCosts:
    """Seconds of communication per layer, stage boundary and step; cached per (run, tp, …) and per layout."""

    def __init__(self, graph: ModelGraph, memory: MemoryCosts, *, comm: CommModel, compute: ComputeModel,
                 devices_per_node: int, nodes: int, cpu_cores: int, host_floor_s: float,
                 pipeline_p2p: str = "batched", ep_dispatcher: str = "all_to_all") -> None:
        self.graph = graph
        self.pipeline_p2p = pipeline_p2p
        self.ep_dispatcher = ep_dispatcher  # cost_models.comm.EP_DISPATCHERS
        self.memory = memory
        self.model = comm
        self.compute = compute  # for the memory-bound packing passes of the data-parallel tail
        self.devices_per_node = devices_per_node
        self.world_size = devices_per_node * nodes
        self.cpu_cores = cpu_cores  # > 0 only for gloo on CPU: processes share these cores
        self.host_floor_s = host_floor_s
        self._span = lru_cache(maxsize=None)(lambda tp: sequence_span(graph, tp))
        self._tp = lru_cache(maxsize=None)(self._tp_times)
        self._ep = lru_cache(maxsize=None)(self._ep_times)
        self._sync = lru_cache(maxsize=None)(self._dp_tail_key)
        self._expert_sync = lru_cache(maxsize=None)(self._expert_tail_key)
        self._expert_group = lru_cache(maxsize=None)(self._expert_group_key)
        self._inter = lru_cache(maxsize=None)(self._inter_node_key)

    # ---- one collective, one send ----
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
        prof = self.model.profile
        fn = {"all_reduce": self.model.all_reduce_time_s, "all_gather": self.model.all_gather_time_s,
              "reduce_scatter": self.model.reduce_scatter_time_s, "broadcast": self.model.broadcast_time_s}[op]
        local = group_size <= self.devices_per_node and (ranks_per_node in (None, group_size))
        if (prof is not None and local and op != "all_reduce" and not prof.collective_table(op, group_size)
                and prof.collective_table("all_reduce", group_size)):
            t = 0.5 * self.model.all_reduce_time_s(n_bytes, group_size, ranks_per_node)
        else:
            t = fn(n_bytes, group_size, ranks_per_node)
        return t * self.sharing_factor(group_size)

    def p2p_s(self, n_bytes: float, inter_node: bool) -> float:
        return self.model.p2p_time_s(n_bytes, inter_node) * self.sharing_factor(2)

    # ---- tensor parallelism ----
    def tp_times(self, ri: int, tp: int, sp: bool, mbs: int) -> dict[str, float]:
        """Seconds of one layer of run `ri`'s TP collectives by phase: "forward" and "backward" per
        micro-batch, "step" per optimizer step."""
        return self._tp(ri, tp, sp, mbs)

    def _tp_times(self, ri: int, tp: int, sp: bool, mbs: int) -> dict[str, float]:
        tp_s = {"forward": 0.0, "backward": 0.0, "step": 0.0}
        layer = self.memory.run_layer(ri, tp)
        for c in tp_collectives(self.graph, layer, tp=tp, sp=sp, micro_batch=mbs, span=self._span(tp)):
            tp_s[c.phase] += self.collective_s(c.op, c.n_bytes, tp, tp)
        return tp_s

    # ---- expert parallelism ----
    def ep_times(self, ri: int, tp: int, sp: bool, mbs: float, ep: int, cp: int = 1,
                 etp: int = 1) -> dict[str, float]:
        """Seconds of one layer of run `ri`'s expert-parallel collectives per micro-batch: "forward" (dispatch
        + combine, the folded tp all-gather, the etp reduction) and "backward" (their gradients); zero for a
        dense layer, or ep = etp = 1."""
        return self._ep(ri, tp, sp, mbs, ep, cp, etp)

    def ep_ranks_per_node(self, tp: int, ep: int, cp: int = 1, etp: int = 1) -> int:
        """Ranks of one EP group on one node. Consecutive data-parallel ranks are tp · cp apart in the mesh;
        folded over tp, the group is the tp ranks of ep / tp of them."""
        per_node = self.devices_per_node
        if ep_folds(tp, ep, etp):
            return tp * math.gcd(ep // tp, max(1, per_node // (tp * cp))) if tp <= per_node else per_node
        return math.gcd(ep, max(1, per_node // (tp * cp)))

    def _ep_times(self, ri: int, tp: int, sp: bool, mbs: float, ep: int, cp: int, etp: int = 1) -> dict[str, float]:
        moe = self.memory.runs[ri][0].moe
        if moe is None or (ep == 1 and etp == 1):
            return {"forward": 0.0, "backward": 0.0}
        send, gathered = ep_collective_bytes(moe, tp, sp, ep, mbs, etp)
        tokens = mbs * moe_token_share(tp, sp, ep, etp) * moe.tokens_per_sample  # one rank's, before routing
        token_bytes = send / (tokens * moe.top_k) if tokens > 0 else 0.0  # all_to_all: tokens · top_k of them
        one = 0.0
        if ep > 1:
            one = self.model.dispatch_time_s(self.ep_dispatcher, tokens=tokens, token_bytes=token_bytes,
                                             num_experts=moe.num_experts, top_k=moe.top_k, group_size=ep,
                                             ranks_per_node=self.ep_ranks_per_node(tp, ep, cp, etp),
                                             route_groups=moe.route_groups, route_group_top_k=moe.route_group_top_k)
            one *= busiest_rank_factor(moe, ep, tokens) * self.sharing_factor(ep)
        gather = self.collective_s("all_gather", gathered, tp, tp)
        fwd, bwd = self._etp_reduction_s(moe, mbs, sp, etp)
        return {"forward": 2 * one + gather + fwd, "backward": 2 * one + gather + bwd}

    def _etp_reduction_s(self, moe: MoESpec, mbs: float, sp: bool, etp: int) -> tuple[float, float]:
        """(forward, backward) seconds of the tp collectives around an expert bank split over etp = tp ranks
        (module docstring; `etp_collectives`)."""
        if etp == 1:
            return 0.0, 0.0
        t = {"forward": 0.0, "backward": 0.0}
        for phase, op, n in etp_collectives(moe, mbs, sp, self.graph.hidden_size or 0):
            t[phase] += self.collective_s(op, n, etp, etp)
        return t["forward"], t["backward"]

    # ---- FP8 scales ----
    def fp8_amax_s(self, ri: int, c: Candidate) -> float:
        """Per micro-batch: the scalar all-reduces of tensorwise amaxes over TP-sharded tensors (fp8_costs)."""
        if c.fp8 != "tensorwise" or c.tp == 1 or self.memory.fp8_runtime != "torchao":
            return 0.0
        work = cast_work(self.memory.runs[ri][0], self.graph, recipe=c.fp8, elem_bytes=self.memory.elem,
                         micro_batch=c.micro_batch_size, tp=c.tp, compiled=c.compile, weights_gathered_fp8=False,
                         dp=c.shard_group)
        return work.amax_allreduces * self.collective_s("all_reduce", AMAX_BYTES, c.tp, c.tp)

    def fp8_scales_s(self, c: Candidate) -> float:
        """Per step under FSDP's float8 all-gather: one all-reduce of every converted weight's amax over dp
        (torchao's precompute_float8_dynamic_scale_for_fsdp, after the optimizer step)."""
        if not self.memory.fp8_gathered(c) or c.shard_group == 1:
            return 0.0
        weights = sum(len(g) * sum(k.count for k in g[0].kernels_forward.kernels if fp8_gemm(k))
                      for g in self.memory.runs if is_fp8_layer(g[0]))
        rpn = math.gcd(c.shard_group, max(1, self.devices_per_node // c.tp))
        return self.collective_s("all_reduce", AMAX_BYTES * weights / c.pp, c.shard_group, rpn)

    def batch_norm_s(self, ri: int, c: Candidate) -> tuple[float, float]:
        """Seconds of one layer of run `ri`'s batch-norm statistics all-reduces per micro-batch over the
        dp group: (forward, backward); 0 without batch norm or data parallelism."""
        channels = self.memory.runs[ri][0].batch_norm_channels
        if c.dp <= 1 or not channels:
            return 0.0, 0.0
        rpn = math.gcd(c.dp, max(1, self.devices_per_node // c.tp))
        one = sum(self.collective_s("all_reduce", 4 * (n + 1), c.dp, rpn)
                  + self.collective_s("all_reduce", 4 * n, c.dp, rpn) for n in channels)
        return one, one

    # ---- pipeline parallelism ----
    def send_s(self, ri: int, tp: int, sp: bool, mbs: int) -> tuple[float, float]:
        """A stage boundary's transfers of run `ri`'s boundary tensor per micro-batch, as the runtime issues
        them (PIPELINE_P2P): (inside a node, across nodes)."""
        send_bytes = self.memory.act_scale * self.memory.runs[ri][0].boundary_bytes * mbs / (tp if sp else 1)
        k, sliced = PIPELINE_P2P[self.pipeline_p2p]
        if sliced and tp > 1 and not sp and tp <= self.devices_per_node:
            gather = self.collective_s("all_gather", send_bytes, tp, tp)
            return (k * (self.p2p_s(send_bytes / tp, False) + gather),
                    k * (self.p2p_s(send_bytes / tp, True) + gather))
        return k * self.p2p_s(send_bytes, False), k * self.p2p_s(send_bytes, True)

    def inter_node(self, c: Candidate) -> tuple[bool, ...]:
        """Whether the p2p between stage s and s+1 crosses nodes (mesh (pp, dp, cp, tp), tp innermost)."""
        return self._inter(c.pp, c.virtual_stages, c.dp * c.cp * c.tp)

    def _inter_node_key(self, pp: int, v: int, block: int) -> tuple[bool, ...]:
        dpn = self.devices_per_node

        def crosses(a: int, b: int) -> bool:
            return any((a * block + j) // dpn != (b * block + j) // dpn for j in range(min(block, dpn)))

        return tuple(crosses(s % pp, (s + 1) % pp) for s in range(pp * v - 1))

    # ---- data parallelism ----
    def dp_tail(self, c: Candidate) -> DPTail:
        """The data-parallel tail of the rank's dense gradients, over dp·cp, with the step's loss and norm."""
        return self._sync(c.tp, c.pp, c.shard_group, c.zero_stage, c.num_microbatches, c.offload)

    def expert_tail(self, c: Candidate) -> DPTail:
        """The tail of the rank's expert gradients, over the ranks holding the same experts (edp·cp, tp too
        under unfolded SP: autopar.codegen.experts.expert_grad_axes), which reduce them apart."""
        return self._expert_sync(c.tp, c.pp, c.dp, c.cp, c.zero_stage, c.num_microbatches, c.ep,
                                 c.sequence_parallel, c.etp, c.offload)

    def _dp_tail_key(self, tp: int, pp: int, dp: int, zero_stage: int, m: int, offload: str = "none") -> DPTail:
        """The data-parallel tail over this rank's dense gradients (the experts': `expert_tail`)."""
        rpn = math.gcd(dp, max(1, self.devices_per_node // tp))
        mem = self.memory
        grad_bytes = mem.grad_bytes(sum(len(g) * mem.local_dense_params(g[0], tp)
                                        for g in mem.runs)) / pp

        return self._tail(zero_stage, dp, rpn, m, grad_bytes, pipelined=pp > 1, offload=offload,
                          reduce_in_backward=True, broadcast_in_forward=True)

    def _expert_tail_key(self, tp: int, pp: int, dp: int, cp: int, zero_stage: int, m: int, ep: int,
                         sp: bool, etp: int = 1, offload: str = "none") -> DPTail:
        mem = self.memory
        grad_bytes = mem.grad_bytes(sum(len(g) * mem.local_expert_params(g[0], ep, etp) for g in mem.runs)) / pp
        size, per_node = self._expert_group(tp, dp, cp, ep, sp, etp) if grad_bytes > 0 else (1, 1)

        return self._tail(zero_stage, size, per_node, m, grad_bytes, loss_and_norm=False, pipelined=pp > 1,
                          offload=offload, broadcast_in_forward=True)

    def _tail(self, zero_stage: int, size: int, per_node: int, m: int, grad_bytes: float,
              loss_and_norm: bool = True, pipelined: bool = False, offload: str = "none",
              reduce_in_backward: bool = False, broadcast_in_forward: bool = False) -> DPTail:
        """The DPTail of `grad_bytes` of gradients per rank reduced over a group of `size` ranks, `per_node` of
        them on one node (`loss_and_norm`: the group also reduces the loss and the gradient norm; `pipelined`:
        in pipeline stages, DPTail's reduce-scatter once per step; `reduce_in_backward`: ZeRO-0/1's all-reduce
        runs in backward, the dense gradients' as autopar.codegen.grad_overlap issues it; `broadcast_in_forward`:
        ZeRO-1's broadcast runs in the next step's forward, dense and expert parameters alike, as
        autopar.codegen.param_prefetch issues it). ZeRO-1's broadcast moves the parameters in their dtype: 16-bit
        under a mixed policy (autopar.codegen.dist_optimizer), fp32 under offload="optimizer", whose host steps
        fp32 parameters."""
        mem = self.memory
        pol = mem.precision
        weights = pol.compute_bytes if pol.mixed and offload != "optimizer" else pol.weight_bytes

        def coll(op: str, n: float, k: int) -> float:
            return self.collective_s(op, n, k, per_node if k == size else None)

        return DPTail(zero_stage=zero_stage, dp=size, world=self.world_size, microbatches=m,
                      rank_grad_bytes=grad_bytes, collective_s=coll,
                      memory_s=lambda n: self.compute.op_time_s(0.0, n, mem.precision.compute_dtype),
                      host_floor_s=self.host_floor_s, interference=fleet.overlap_interference(self.compute.device),
                      gather_ratio=mem.gather_bytes(1.0) / mem.grad_bytes(1.0), loss_and_norm=loss_and_norm,
                      pipelined=pipelined, broadcast_ratio=weights / mem.grad_bytes(1.0),
                      reduce_in_backward=reduce_in_backward, broadcast_in_forward=broadcast_in_forward)

    def _expert_group_key(self, tp: int, dp: int, cp: int, ep: int, sp: bool, etp: int = 1) -> tuple[int, int]:
        """(size, most ranks on one node) of the group holding rank 0's experts."""
        ranks = self.expert_group_ranks(tp, dp, cp, ep, sp, etp)
        return len(ranks), max(Counter(r // self.devices_per_node for r in ranks).values())

    @staticmethod
    def expert_group_ranks(tp: int, dp: int, cp: int, ep: int, sp: bool, etp: int = 1) -> list[int]:
        """Global ranks holding rank 0's experts (its slice of them at etp > 1), in the mesh (pp, dp, cp, tp), tp
        innermost: every ep_dp-th data-parallel rank (ep_dp = ep / tp folded, else ep), every cp rank, and every
        tp rank where the tp ranks hold the same experts on other tokens (unfolded SP at etp = 1;
        autopar.codegen.experts)."""
        step = ep // tp if ep_folds(tp, ep, etp) else ep
        tps = range(tp) if sp and tp > 1 and etp == 1 and not ep_folds(tp, ep) else range(1)
        return [(d * cp + c) * tp + t for d in range(0, dp, step) for c in range(cp) for t in tps]

    def shared_sync_s(self, ri: int, c: Candidate) -> float:
        """The cross-stage all-reduce of shared weights held by run `ri`'s layer, per step.

        With pp > 1 contiguous cuts put a tied embedding and head on different stages; a weight only
        top-level code reads is on every stage (charged to the first layer). Gradients are this rank's:
        divided by tp where the vocabulary is split, by dp under ZeRO-2/3."""
        graph = self.graph
        if c.pp == 1 or not graph.shared_params:
            return 0.0
        layer = self.memory.runs[ri][0]
        first = graph.layers[0].name
        total = 0.0
        for sp in graph.shared_params:
            holders = len(sp.layers) if sp.layers else c.pp
            if holders < 2 or layer.name not in (sp.layers or (first,)):
                continue
            split = self.memory.tp_param_fraction(layer_at_tp(layer, c.tp)) > 0
            n = self.memory.grad_bytes(sp.num_params) / (c.tp if split else 1)
            n /= c.shard_group if c.zero_stage >= 2 else 1
            k = min(holders, c.pp)
            total += self.collective_s("all_reduce", n, k, k if c.world_size <= self.devices_per_node else 1)
        return total
