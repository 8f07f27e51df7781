"""Compute time: the kernels of a layer's passes, its recompute, its optimizer step, framework host time.

Part of the planner's time pricing (comm_costs prices communication; costs.CostModel assembles both into
the ILP's numbers). Per layer at tensor-parallel degree t, sequence parallelism and micro-batch b:

  pass time       the sum of the pass's kernels (LayerSpec.kernels_forward / kernels_backward, a KernelMix),
                  each at b × its per-sample work (÷ t inside a TP pattern; every memory-bound kernel ÷ t
                  with SP, which shards norms, dropouts and residuals along the sequence: Korthikanti et al.
                  2022 §4.2.2), priced one by one by ComputeModel.kernel_time_s at its own size, layout and
                  memory class; mixes without a kernel list by their totals (kernels_time_s); graphs without
                  kernel mixes fall back to one roofline over the layer's FLOPs and bytes
  compiled blocks (Candidate.compile): each chain of memory-bound kernels between matmuls is one kernel
                  reading its inputs and writing its outputs once (KernelMix.fused: TorchInductor's fusion,
                  Ansel et al. 2024 §5); GEMMs and attention are priced as in eager
  recompute       selective: the attention core again: its captured kernels (Kernel.attention_core), else
                  4·b·s²·(heads·head_dim)/t FLOPs (Narayanan et al. 2021 eq. 3's attention term, forward);
                  op_sac: the forward kernels its policy does not save (Kernel.op_sac_saved: every second
                  matmul, pointwise ops, norms) and the forward TP collectives (functional collectives are
                  not in its save list); full: the whole forward and its TP comm again. Only blocks are
                  checkpointed by codegen, so other layers price op_sac as none; graphs captured before
                  op_sac price it as none's memory with full's time (never preferred). The TP collectives a
                  mode runs again are priced by comm_costs; `RunCompute.recompute_tp` says which modes do
  experts         a mixture-of-experts bank's grouped GEMMs (Kernel.expert) run E / ep experts, each a GEMM of
                  its own tokens (ComputeModel.kernel_time_s groups); under expert parallelism (ep > 1) a rank
                  receives the tokens its ep peers route to its experts, on average its own tokens · k, and the
                  busiest rank more than that (autopar.planner.moe_load: the router's skew and the sampling
                  spread of the micro-batch): the step waits for it. A rank's own tokens are the
                  micro-batch's ÷ tp under sequence parallelism or EP folded over tp (moe_token_share); with
                  the experts tensor-parallel (etp = tp) every tp rank runs all the tokens (gathered under SP)
                  through 1/etp of each expert's FFN: the expert GEMMs' work ÷ etp, at that per-rank size;
                  one launch floor per grouped GEMM, or one per local expert where the runtime issues each
                  expert's GEMM apart (cost_models.pipeline.EXPERT_GEMMS: Megatron-Core's TE GroupedLinear,
                  DeepSpeed-MoE)
  FP8             (Candidate.fp8) the weight GEMMs of every layer but the LM head at the device's FP8 peak, plus
                  torchao's casts, amaxes and transposes as memory-bound kernels (fp8_costs); emulated on CPU
  optimizer       with a profile that timed the optimizer's loops (cost_models.optimizer_step), each loop as
                  per-tensor cost × tensors + elements × seconds per element at their size: the gradient
                  norm over every local gradient (`global_grad_norm`; fp16 also unscales them), AdamW over
                  the parameters the rank steps — under ZeRO-1 whole tensors, 1/shards of them, and its
                  broadcast's copies of every held tensor; under ZeRO-2/3 a 1/shards shard of every tensor
                  (the broadcast's and FSDP's waits are dp_comm). Tensors per layer: `param_tensors`. Without
                  one, AdamW streaming ADAM_BYTES_PER_PARAM per local (ZeRO: owned) parameter
  host            DTensor's dispatch of TP-sharded layers on CPU (TP_HOST_FLOORS_PER_GEMM), in the passes
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from autopar.capture.graph import KernelMix, LayerSpec, ModelGraph
from autopar.config import expert_dp
from autopar.planner.dp_costs import FLOOR_S
from autopar.planner.fp8_costs import cast_work, fp8_gemm, is_fp8_layer, te_cast_work, te_weight_cast_bytes
from autopar.planner.fp8_costs import gemm_dtype as fp8_gemm_dtype
from autopar.planner.memory_costs import MemoryCosts
from autopar.planner.moe_load import busiest_rank_factor, moe_token_share
from autopar.planner.problem import MODES
from cost_models.compute import ComputeModel
from cost_models.optimizer_step import OptimizerLaws
from cost_models.pipeline import ACCUMULATE_PASSES, EXPERT_GEMMS

__all__ = ["ComputeCosts", "RunCompute", "ADAM_BYTES_PER_PARAM", "TP_HOST_FLOORS_PER_GEMM",
           "TP_OPTIMIZER_FLOORS_PER_GEMM", "param_tensors"]

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


def param_tensors(graph: ModelGraph, layer: LayerSpec) -> int:
    """Parameter tensors of `layer`: as capture counted them (ModelGraph.metadata["param_tensors"]), else
    (graphs captured before it) one per forward GEMM and per norm tensor, at least one: biases unseen, so
    an undercount (gpt-tiny's blocks: 10 of 16)."""
    counted = graph.metadata.get("param_tensors", {}).get(layer.name)
    if counted is not None:
        return int(counted)
    return max(1, layer.kernels_forward.gemm_count + len(layer.norm_param_numels))


def _has_kernels(layer: LayerSpec) -> bool:
    """Whether capture recorded the layer's kernels (graphs written by hand or by older versions may not)."""
    k = layer.kernels_forward
    return k.gemm_count + k.attention_count + k.memory_count > 0


@dataclass(frozen=True, kw_only=True)
class RunCompute:
    """Compute seconds of one layer of a run, per micro-batch (recompute per mode of MODES)."""

    forward_s: float
    backward_s: float  # host_s included
    host_s: float  # of backward_s: DTensor dispatch on CPU
    recompute_s: tuple[float, ...]  # the kernels each mode runs again, TP collectives not included
    recompute_tp: tuple[bool, ...]  # whether the mode runs the forward TP collectives again

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s


class ComputeCosts:
    """Kernel, recompute, optimizer and host seconds of a graph's layers; cached per (run, tp, sp, b)."""

    def __init__(self, graph: ModelGraph, memory: MemoryCosts, *, compute: ComputeModel,
                 host_floor_s: float, straggler: float = 1.0, expert_gemm: str = "grouped",
                 fp8_runtime: str = "torchao") -> None:
        """expert_gemm: how the runtime launches an expert bank's GEMMs (cost_models.pipeline.EXPERT_GEMMS);
        fp8_runtime: the framework running FP8 GEMMs, whose casts are priced (fp8_costs)."""
        self.fp8_runtime = fp8_runtime
        if expert_gemm not in EXPERT_GEMMS:
            raise ValueError(f"ComputeCosts: expert_gemm={expert_gemm!r}; expected one of {EXPERT_GEMMS}")
        self.expert_launch_per_group = expert_gemm == "per_expert"
        self.graph = graph
        self.memory = memory
        self.model = compute
        self.dtype = memory.precision.compute_dtype  # kernels run at the policy's compute dtype
        # the floor framework host overheads are counted in (DTensor TP, FSDP2 hooks): the profile's host
        # floor on CPU with gloo (not divided among processes, scaled by its own calibration), else 0
        self.host_floor_s = host_floor_s
        # kernel time × the slowest GPU's lag behind the median (cost_models.fleet.straggler_factor; 1 alone)
        self.straggler = straggler
        self._time = lru_cache(maxsize=None)(self._run_compute)
        self._opt_run = lru_cache(maxsize=None)(self._run_optimizer_s)
        self.optimizer_laws = OptimizerLaws.from_profile(compute.profile)

    def run(self, ri: int, tp: int, sp: bool, mbs: int, compiled: bool = False, ep: int = 1, fp8: str = "none",
            fp8_gathered: bool = False, dp: int = 1, etp: int = 1) -> RunCompute:
        """Compute seconds of one layer of run `ri` (memory.runs) at tp, sp, micro-batch mbs, ep and etp; with
        FP8 GEMMs under recipe `fp8` (`fp8_gathered`: FSDP gathers its weights in float8 over dp ranks)."""
        return self._time(ri, tp, sp, mbs, compiled, ep, fp8, fp8_gathered, dp if fp8_gathered else 1, etp)

    def attention_s(self, ri: int, tp: int, sp: bool, mbs: float, causal: bool = True,
                    backward: bool | None = None) -> float:
        """Seconds of one layer of run `ri`'s attention kernels alone (0 without a kernel list): forward +
        backward, or the `backward` (True) or forward (False) pass; `causal` False prices causal kernels as if
        they computed every tile (the full score matrix)."""
        layer = self.memory.runs[ri][0]

        def attention(mix: KernelMix) -> KernelMix:
            ks = tuple(k if causal else dataclasses.replace(k, causal=False)
                       for k in mix.kernels if k.kind == "attention")
            return dataclasses.replace(mix, kernels=ks, fused=())

        passes = [(layer.kernels_forward, False), (layer.kernels_backward, True)]
        return sum(self._pass_s(attention(mix), tp, sp, mbs, backward=b)
                   for mix, b in passes if mix.kernels and backward in (None, b))

    def optimizer_s(self, ri: int, tp: int, shards: int, ep: int = 1, etp: int = 1,
                    whole_tensors: bool = False) -> float:
        """One layer of run `ri`'s optimizer step, its dense parameters split over `shards` owners (ZeRO)
        and its experts' over the ranks of those holding the same experts (autopar.config.expert_dp);
        `whole_tensors`: each owner steps whole tensors (ZeRO-1), not a shard of each (ZeRO-2/3)."""
        return self._opt_run(ri, tp, shards, ep, etp, whole_tensors and shards > 1)

    def grad_accumulation_s(self, ri: int, tp: int, ep: int = 1, etp: int = 1) -> float:
        """One layer of run `ri` adding a micro-batch's weight gradients into the step's held in the compute
        dtype, as autograd's AccumulateGrad does (`grad += new`: cost_models.pipeline.GRAD_ACCUMULATION,
        "autograd_16bit"): one memory-bound kernel per parameter tensor (≈ one per GEMM weight and per norm
        tensor), ACCUMULATE_PASSES gradient elements moved per parameter."""
        layer = self.memory.runs[ri][0]
        params = self.memory.run_local_params(ri, tp, ep, etp)
        if params <= 0:
            return 0.0
        kernels = max(1, layer.kernels_forward.gemm_count + len(layer.norm_param_numels))
        return self._memory_pass_s(ACCUMULATE_PASSES * params * self.memory.elem, kernels) * self.straggler

    def _run_compute(self, ri: int, tp: int, sp: bool, mbs: int, compiled: bool = False, ep: int = 1,
                     fp8: str = "none", fp8_gathered: bool = False, dp: int = 1, etp: int = 1) -> RunCompute:
        layer = self.memory.run_layer(ri, tp)  # a vocabulary tp does not divide: the layer's work whole
        compiled = compiled and layer.kind == "block" and bool(layer.kernels_forward.fused)  # codegen compiles blocks
        # FP8 GEMMs at the FP8 peak where the device has one (emulated on a CPU: the compute dtype)
        gemm_dtype = (fp8_gemm_dtype(self.model.device, fp8) if is_fp8_layer(layer) else None) or self.dtype
        f = layer.forward_flops_tp_sharded / layer.forward_flops if layer.forward_flops > 0 else 0.0
        share = 1.0 - f + f / tp
        fp = self.memory.tp_param_fraction(layer)
        param_bytes = layer.param_bytes * (1.0 - fp + fp / tp)
        if _has_kernels(layer):
            experts = self._experts(layer, ep, mbs, tp, sp, etp)
            fwd = self._pass_s(layer.kernels_forward, tp, sp, mbs, compiled, experts, gemm_dtype)
            bwd = self._pass_s(layer.kernels_backward, tp, sp, mbs, compiled, experts, gemm_dtype, backward=True)
            casts = (cast_work(layer, self.graph, recipe=fp8, elem_bytes=self.memory.elem, micro_batch=mbs, tp=tp,
                               compiled=compiled, weights_gathered_fp8=fp8_gathered, dp=dp)
                     if self.fp8_runtime == "torchao" else
                     te_cast_work(layer, self.graph, recipe=fp8, elem_bytes=self.memory.elem, micro_batch=mbs, tp=tp,
                                  sp=sp))
            fwd += self._memory_pass_s(casts.forward_bytes, casts.forward_kernels)
            bwd += self._memory_pass_s(casts.backward_bytes, casts.backward_kernels)
            if tp == 1 and not compiled:
                fwd = max(fwd, self._measured_floor_s(layer, "fwd", mbs))
                bwd = max(bwd, self._measured_floor_s(layer, "bwd", mbs))
        else:
            act_traffic = max(0.0, layer.bytes_read + layer.bytes_written - layer.param_bytes) * mbs * share
            fwd = self.model.op_time_s(mbs * layer.forward_flops * share, param_bytes + act_traffic, self.dtype)
            # Backward reads weights and activations and writes both gradients: twice the forward traffic.
            bwd = self.model.op_time_s(mbs * layer.backward_flops * share, 2 * (param_bytes + act_traffic),
                                       self.dtype)
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
            sel = self.model.kernels_time_s(
                gemm_flops=0.0, gemm_count=0, attention_flops=core_flops, attention_count=kf.attention_count,
                memory_bytes=2 * core_bytes, memory_count=max(1, kf.attention_count), dtype=self.dtype)
        else:
            sel = self.model.op_time_s(core_flops, core_bytes, self.dtype) if core_flops or core_bytes else 0.0
        if layer.kind == "block" and layer.saved_activation_bytes_op_sac is not None:
            kf = layer.kernels_forward
            rerun = [k for k in kf.kernels if not k.op_sac_saved and (not compiled or k.kind in ("gemm", "attention"))]
            sac = self._pass_s(dataclasses.replace(kf, kernels=tuple(rerun) + (kf.fused if compiled else ())),
                               tp, sp, mbs, experts=self._experts(layer, ep, mbs, tp, sp, etp), gemm_dtype=gemm_dtype)
        else:  # not checkpointed by codegen (none), or captured before op_sac (full's time)
            sac = 0.0 if layer.kind != "block" else fwd
        again = {"none": (0.0, False), "selective": (sel, False), "op_sac": (sac, layer.kind == "block"),
                 "full": (fwd, True)}
        if layer.kind != "block":  # codegen recomputes blocks only (parallelize → codegen.recompute)
            again = dict.fromkeys(again, (0.0, False))
        s = self.straggler
        return RunCompute(forward_s=fwd * s, backward_s=bwd * s, host_s=host,
                          recompute_s=tuple(again[k][0] * s for k in MODES),
                          recompute_tp=tuple(again[k][1] for k in MODES))

    def layer_compute_s(self, name: str, *, tp: int = 1, sp: bool = False, micro_batch: int = 1,
                        compiled: bool = False) -> float:
        """Forward + backward compute of layer `name` on one device, as the planner charges it (no comm,
        no recompute; `compiled`: as a compiled block): what benchmarks/cost_model_accuracy.py and
        benchmarks/compile_gain_cpu.py set against a measured layer step."""
        ri = next((i for i, g in enumerate(self.memory.runs) if any(la.name == name for la in g)), None)
        if ri is None:
            raise KeyError(f"no layer named {name!r}; layers are {[la.name for la in self.graph.layers]}")
        return self.run(ri, tp, sp, micro_batch, compiled).compute_s

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
        prof = self.model.profile
        best_b, best_t = 0, 0.0
        for key, t in (prof.layer_times.items() if prof is not None else ()):
            sig, ph, b, tp = key.rsplit(":", 3)
            if sig == layer.signature and ph == phase and tp == "t1" and b[1:].isdigit() and best_b < int(b[1:]) <= mbs:
                best_b, best_t = int(b[1:]), t
        return best_t

    @staticmethod
    def _experts(layer: LayerSpec, ep: int, mbs: int, tp: int = 1, sp: bool = False,
                 etp: int = 1) -> tuple[int, float, float, int]:
        """(experts per rank's divisor ep, work factor of the busiest rank: autopar.planner.moe_load, share of
        the micro-batch's tokens the rank's experts run on: moe_token_share, the FFN split etp) for the layer's
        expert kernels at micro-batch `mbs`."""
        if layer.moe is None:
            return 1, 1.0, 1.0, 1
        share = moe_token_share(tp, sp, ep, etp)
        if ep == 1:
            return 1, 1.0, share, etp
        return ep, busiest_rank_factor(layer.moe, ep, mbs * share * layer.moe.tokens_per_sample), share, etp

    def fp8_weight_cast_s(self, ri: int, tp: int, fp8: str) -> float:
        """Seconds per step of one layer of run `ri`'s weight casts under Transformer Engine (cast and transposed
        on the first micro-batch, kept for the others: fp8_costs); 0 under torchao (priced per micro-batch)."""
        if self.fp8_runtime == "torchao" or fp8 == "none":
            return 0.0
        n_bytes, kernels = te_weight_cast_bytes(self.memory.run_layer(ri, tp), self.graph, recipe=fp8,
                                                elem_bytes=self.memory.elem, tp=tp)
        return self._memory_pass_s(n_bytes, kernels) * self.straggler

    def _memory_pass_s(self, n_bytes: float, kernels: int) -> float:
        """`kernels` memory-bound kernels moving n_bytes in all (FP8 casts), at the memory tables' rate."""
        if kernels == 0:
            return 0.0
        return self.model.kernels_time_s(gemm_flops=0.0, gemm_count=0, attention_flops=0.0, attention_count=0,
                                         memory_bytes=n_bytes, memory_count=kernels, dtype=self.dtype)

    def _pass_s(self, mix: KernelMix, tp: int, sp: bool, mbs: int, compiled: bool = False,
                experts: tuple[int, float, float, int] = (1, 1.0, 1.0, 1), gemm_dtype: str | None = None,
                backward: bool = False) -> float:
        """One forward or backward pass of a layer on one device: its kernels at micro-batch `mbs`, each
        priced at its own size, layout and class (ComputeModel.kernel_time_s); mixes without a kernel
        list by their per-kind totals (ComputeModel.kernels_time_s). `compiled`: the memory-bound kernels
        as TorchInductor fuses them (KernelMix.fused), GEMMs and attention unchanged. `experts` = (ep,
        imbalance, token share, etp): expert GEMMs run groups / ep experts on imbalance × share × their work,
        ÷ etp (each a 1/etp slice of the FFN) (module docstring).
        `backward`: the mix is a backward pass (a causal attention kernel's time fraction is its pass's)."""
        ep, imbalance, token_share, etp = experts
        if mix.kernels:
            total = 0.0
            kernels = mix.kernels
            if compiled and mix.fused:
                kernels = tuple(k for k in mix.kernels if k.kind in ("gemm", "attention")) + mix.fused
            for k in kernels:
                memory = k.kind not in ("gemm", "attention")
                share = token_share if k.expert else 1.0 / tp if k.tp_sharded or (memory and sp) else 1.0
                load = imbalance / etp if k.expert else 1.0
                dtype = gemm_dtype if gemm_dtype and fp8_gemm(k) else self.dtype
                total += k.count * self.model.kernel_time_s(
                    k.kind, mbs * share * load * k.work, dtype=dtype, tensor_bytes=mbs * share * k.tensor_bytes,
                    layout=k.layout, mnk=k.mnk, groups=max(1, k.groups // ep) if k.expert else k.groups,
                    causal=k.causal, backward=backward, launch_per_group=k.expert and self.expert_launch_per_group)
            return total

        def work(total: float, sharded: float, all_sharded: bool = False) -> float:
            return mbs * (total / tp if all_sharded else total - sharded + sharded / tp)

        return self.model.kernels_time_s(
            gemm_flops=work(mix.gemm_flops, mix.gemm_flops_tp_sharded), gemm_count=mix.gemm_count,
            attention_flops=work(mix.attention_flops, mix.attention_flops_tp_sharded),
            attention_count=mix.attention_count,
            memory_bytes=work(mix.memory_bytes, mix.memory_bytes_tp_sharded, all_sharded=sp and tp > 1),
            memory_count=mix.memory_count, dtype=self.dtype)

    def optimizer_host_s(self, ri: int, tp: int, shards: int, ep: int = 1) -> float:
        """Of the optimizer step: AdamW's DTensor dispatch over tensor-parallel parameters (on CPU)."""
        layer = self.memory.run_layer(ri, tp)
        if tp <= 1 or not layer.tp_patterns:
            return 0.0
        return self.host_floor_s * TP_OPTIMIZER_FLOORS_PER_GEMM * layer.kernels_forward.gemm_count / shards

    def _run_optimizer_s(self, ri: int, tp: int, shards: int, ep: int = 1, etp: int = 1,
                         whole_tensors: bool = False) -> float:
        layer = self.memory.runs[ri][0]
        held = self.memory.local_dense_params(layer, tp) + self.memory.local_expert_params(layer, ep, etp)
        local = (self.memory.local_dense_params(layer, tp) / shards
                 + self.memory.local_expert_params(layer, ep, etp)
                 / (expert_dp(tp, shards, ep, etp) if shards > 1 else 1))
        host = self.optimizer_host_s(ri, tp, shards)
        laws = self.optimizer_laws
        if laws is None:
            return self.model.op_time_s(0.0, ADAM_BYTES_PER_PARAM * local, "float32") + host
        tensors = param_tensors(self.graph, layer)
        # the norm (and fp16's unscaling) reads every gradient the rank holds: ZeRO-1 drops the unowned
        # ones after it; under ZeRO-2/3 the rank holds a shard of each
        grads = local if shards > 1 and not whole_tensors else held
        norm = laws.time_s("grad_norm", tensors, grads)
        if self.memory.precision.loss_scaling:
            norm += laws.time_s("scale", tensors, grads)
        step = laws.time_s("adamw", tensors / shards if whole_tensors else tensors, local)
        if whole_tensors:  # ZeRO-1's broadcast packs the owned tensors and copies the others' in: a pass over
            step += laws.time_s("scale", tensors, held)  # each held tensor (Zero1Partition.broadcast_)
        return (norm + step) * self.straggler + host
