"""The kernels of one measured module call (autopar.capture.probe): each op a dispatch mode saw, what bounds
it (a GEMM, attention, a memory-bound pass, a view), and the forward and backward `KernelMix` the planner prices."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from autopar.capture.fusion import Step, fused_kernels
from autopar.capture.graph import Kernel, KernelMix, merge_kernels
from autopar.capture.kernels import SDPA_OPS
from autopar.capture.moe import GROUPED_MM_OPS
from autopar.capture.tensors import storage_key
from cost_models.optrace import OpRecord

__all__ = ["MATMUL_OPS", "SDPA_BACKWARD_OPS", "Op", "op_kind", "kernel_of", "forward_mix", "backward_mix",
           "storages"]

aten = torch.ops.aten
MATMUL_OPS = frozenset({aten.mm, aten.bmm, aten.baddbmm, aten.addmm, aten.addbmm, aten.matmul}) | GROUPED_MM_OPS
SDPA_BACKWARD_OPS = frozenset(
    getattr(aten, name) for name in (
        "_scaled_dot_product_flash_attention_backward",
        "_scaled_dot_product_efficient_attention_backward",
        "_scaled_dot_product_cudnn_attention_backward",
        "_scaled_dot_product_flash_attention_for_cpu_backward",
        "_scaled_dot_product_fused_attention_overrideable_backward",
    ) if hasattr(aten, name)
)


@dataclass
class Op:
    flops: float
    src: frozenset[str] | None
    linear: str | None
    head_dim: int | None
    kind: str = "memory"  # "gemm" | "attention" | "memory" | "view" (see KernelMix)
    bytes_moved: int = 0
    record: OpRecord | None = None  # shape, layout, memory class and largest tensor (cost_models.optrace)
    core: bool = False  # in the attention core (Kernel.attention_core)
    sac_saved_bytes: int = 0  # output bytes op_sac keeps (0: op_sac runs the op again in backward)
    selective_saved: tuple[int, ...] = ()  # storage keys selective's policy first caches here
    groups: int = 0  # > 0: a grouped GEMM over this many experts (Kernel.groups, Kernel.expert)


def op_kind(packet: Any, rec: OpRecord, n_active: int) -> str:
    """What bounds a kernel: a matmul with a weight is a GEMM, one between two activations (or a fused
    attention kernel) is attention, a view (an alias of an input) launches nothing, everything else
    streams memory."""
    if rec.is_view:
        return "view"
    if packet in SDPA_OPS or packet in SDPA_BACKWARD_OPS:
        return "attention"
    if packet in MATMUL_OPS:
        return "attention" if n_active >= 2 else "gemm"
    return "memory"


def kernel_of(kind: str, work: float, rec: OpRecord, tp_sharded: bool, core: bool = False,
            sac_saved: bool = False, groups: int = 0) -> Kernel:
    """One kernel as the planner prices it: a memory-bound op in its measured class at its largest
    tensor's size, a GEMM with its layout, a batched attention matmul with its per-matrix shape, a grouped
    GEMM (an expert bank's) with its number of groups."""
    if kind == "memory":
        return Kernel(kind=rec.kind, count=1, work=work, tensor_bytes=rec.tensor_bytes, tp_sharded=tp_sharded,
                      attention_core=core, op_sac_saved=sac_saved)
    if groups:
        return Kernel(kind="gemm", count=1, work=work, tp_sharded=tp_sharded, op_sac_saved=sac_saved,
                      groups=groups, expert=True)
    batched = rec.gemm_mnk is not None and rec.gemm_batch > 1
    return Kernel(kind=kind, count=1, work=work, layout=rec.gemm_layout, tp_sharded=tp_sharded,
                  mnk=rec.gemm_mnk if kind == "attention" and batched else None, attention_core=core,
                  op_sac_saved=sac_saved, causal=kind == "attention" and rec.is_causal)


def forward_mix(ops: list[Op], sharded: Any, tp_linears: set[str], steps: list[Step],
                saved_ids: set[int]) -> KernelMix:
    """Forward kernels by kind; an op inside a TP pattern (its linear, or data from column linears) is sharded.
    `steps` (one per op) give the chains TorchInductor fuses (KernelMix.fused). Under op_sac an op runs
    again in backward unless its output is saved or it follows the last op whose output backward needs
    (non-reentrant checkpointing stops recomputing there: torch.utils.checkpoint's early stop)."""
    sums: dict[str, float] = {}
    kernels = []
    steps = list(steps)
    last_needed = max((i for i, (op, st) in enumerate(zip(ops, steps, strict=True))
                       if not op.sac_saved_bytes and any(w in saved_ids for w, _ in st.writes)), default=-1)
    for i, op in enumerate(ops):
        if op.kind == "view":
            continue
        work = float(op.bytes_moved) if op.kind == "memory" else op.flops
        key = {"gemm": "gemm_flops", "attention": "attention_flops", "memory": "memory_bytes"}[op.kind]
        sums[key] = sums.get(key, 0.0) + work
        count_key = key.split("_")[0] + "_count"
        sums[count_key] = sums.get(count_key, 0) + 1
        in_tp = op.linear in tp_linears or sharded(op.src)
        if in_tp:
            sums[key + "_tp_sharded"] = sums.get(key + "_tp_sharded", 0.0) + work
        if op.record is not None:
            rerun_stops = op.sac_saved_bytes > 0 or i > last_needed
            kernels.append(kernel_of(op.kind, work, op.record, in_tp, op.core, rerun_stops, groups=op.groups))
            steps[i] = dataclasses.replace(steps[i], kernel=kernels[-1])
    return KernelMix(**{k: (int(v) if k.endswith("count") else v) for k, v in sums.items()},
                     kernels=merge_kernels(kernels), fused=fused_kernels(steps, frozenset(saved_ids)))


def backward_mix(log: list[tuple[str, float, int]], forward: KernelMix, kernels: list[Kernel]) -> KernelMix:
    """Backward kernels; matmul FLOPs split between GEMM and attention as in forward (each forward
    matmul has two backward matmuls of its size: Narayanan et al. 2021, eq. 3), and the TP-sharded
    shares of each kind taken from forward (a backward op runs on its forward op's shards). `kernels`,
    the same ops one by one from probe's backward log, is kept as the pass's kernel list."""
    mm = [f for k, f, _ in log if k == "matmul"]
    fused = [f for k, f, _ in log if k == "attention"]
    mem = [b for k, _, b in log if k == "memory"]
    # With a fused attention kernel its backward is fused too and every backward matmul is a GEMM;
    # with eager attention the backward matmuls split as the forward ones do.
    fwd_mm = forward.gemm_flops + forward.attention_flops
    attn_share = forward.attention_flops / fwd_mm if fwd_mm and not fused else 0.0
    n_attn_mm = 0 if fused else round(
        len(mm) * forward.attention_count / max(1, forward.gemm_count + forward.attention_count))

    def share(part: float, whole: float) -> float:
        return part / whole if whole else 0.0

    gemm = sum(mm) * (1 - attn_share)
    attention = sum(mm) * attn_share + sum(fused)
    return KernelMix(
        kernels=merge_kernels(kernels),
        gemm_flops=gemm, gemm_count=len(mm) - n_attn_mm,
        attention_flops=attention, attention_count=n_attn_mm + len(fused),
        memory_bytes=float(sum(mem)), memory_count=len(mem),
        gemm_flops_tp_sharded=gemm * share(forward.gemm_flops_tp_sharded, forward.gemm_flops),
        attention_flops_tp_sharded=attention * share(forward.attention_flops_tp_sharded, forward.attention_flops),
        memory_bytes_tp_sharded=sum(mem) * share(forward.memory_bytes_tp_sharded, forward.memory_bytes),
    )


def storages(tensors: Any) -> list[tuple[int, int]]:
    """(storage key, bytes) of each tensor: what a fused kernel would read or write."""
    return [(storage_key(t), t.numel() * t.element_size()) for t in tensors if isinstance(t, torch.Tensor)]
