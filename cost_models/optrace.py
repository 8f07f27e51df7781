"""Record the aten ops a callable runs (FLOPs, bytes, GEMM shapes) and price them op by op.

This is how a layer's time is predicted from kernel measurements alone, without timing the layer:
every op is a GEMM (priced by `ComputeModel.gemm_time_s` on its shape), a batched matmul (attention's
bmm, `batched_gemm_time_s`), a view (free: its output aliases an input) or a memory-bound kernel
(priced by `op_time_s` on FLOPs and bytes in + out, in the measured table of its kind: plain
elementwise, reduction, transcendental, or a copy out of a strided view). FLOPs come from
torch.utils.flop_counter's registry, the counts FlopCounterMode uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from cost_models.compute import ComputeModel

__all__ = ["OpRecord", "describe_op", "moves_no_data", "read_bytes", "trace_ops", "predict_op_time_s",
           "predict_ops_time_s"]

_GEMMS = {"mm", "addmm"}
_BATCHED_GEMMS = {"bmm", "baddbmm"}
_COPIES = {"clone", "copy_", "_to_copy", "contiguous"}
# Out-of-place ops that ATen runs as two passes over the output: masked_fill clones its input, then
# fills in place (aten/src/ATen/native/TensorAdvancedIndexing.cpp, masked_fill → clone + masked_fill_).
_PASSES = {"masked_fill": 2}
# ops whose per-element cost is an exp/erf/rsqrt rather than a load and a store
_TRANSCENDENTAL = {"_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "gelu",
                   "gelu_backward", "silu", "silu_backward", "exp", "tanh", "tanh_backward", "sigmoid",
                   "sigmoid_backward", "erf", "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
                   "rsqrt", "pow"}


@dataclass(frozen=True, kw_only=True)
class OpRecord:
    name: str  # aten overload packet, e.g. "mm"
    flops: float
    bytes_moved: int  # bytes_read + bytes_written (× passes for ops ATen runs as two)
    gemm_mnk: tuple[int, int, int] | None  # for mm / addmm, and per matrix for bmm / baddbmm
    gemm_layout: str = "nn"  # "t" for an operand stored transposed (column-major)
    is_view: bool  # no kernel runs: outputs alias inputs (views, _unsafe_view, detach) or no tensor out (metadata)
    is_reduction: bool = False  # the largest input is ≥ 4× the largest output (sums, norms' statistics)
    gemm_batch: int = 1  # matrices in a bmm / baddbmm
    is_strided_copy: bool = False  # a copy whose source is not contiguous (a transpose made contiguous)
    tensor_bytes: int = 0  # the largest tensor it reads or writes (sets its cache / allocator regime)
    bytes_read: int = 0  # distinct bytes of its tensor inputs (a broadcast dimension read once)
    bytes_written: int = 0  # bytes of its tensor outputs
    is_causal: bool = False  # a fused attention kernel (forward or backward) told is_causal: it skips masked tiles

    @property
    def kind(self) -> str:
        """The memory-bound class (ComputeModel.MEMORY_KINDS) that prices a non-GEMM kernel."""
        if self.name in _TRANSCENDENTAL:
            return "transcendental"
        if self.is_strided_copy:
            return "copy"
        return "reduction" if self.is_reduction else "elementwise"


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _layout_char(t: torch.Tensor) -> str:
    """'t' when the matrix (the last two dims) is stored column-major, as a transposed view is."""
    return "t" if t.dim() >= 2 and t.stride(-2) == 1 and t.shape[-1] > 1 else "n"


def _is_causal(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether an op takes an `is_causal` argument (the fused attention kernels, forward and backward) and it
    is set: such a kernel computes only the tiles of the score matrix on or below the diagonal."""
    names = [a.name for a in func._schema.arguments]
    if "is_causal" not in names:
        return False
    i = names.index("is_causal")
    return bool(kwargs["is_causal"] if "is_causal" in kwargs else args[i] if i < len(args) else False)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def read_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel reads from `t`: its distinct elements. An expanded (stride-0) dimension addresses
    the same elements again, which a kernel serves from cache, so `x.expand(...)` costs what `x` holds."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


def moves_no_data(func: Any, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """Whether no kernel runs for an op: every tensor it returns aliases an input (a view, `_unsafe_view`
    after a matmul, detach; the op schema marks only some of them as views) or it returns no tensor at all
    (metadata queries: `prim.device`, `aten.sym_size`, which FakeTensorMode dispatches as ops)."""
    if func._schema.is_mutable:
        return False
    in_storages = {_storage(t) for t in ins}
    return all(_storage(t) in in_storages for t in outs)


def describe_op(func: Any, args: tuple, kwargs: dict, out: Any, flops: float | None = None) -> OpRecord:
    """What one dispatched aten op costs: its class, FLOPs (torch's flop registry unless given), bytes,
    GEMM shape and layout. Works on real, meta and fake tensors (capture prices layers with it too)."""
    packet = func.overloadpacket
    ins, outs = _tensors((args, kwargs)), _tensors(out)
    is_view = moves_no_data(func, ins, outs)
    if flops is None:
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
    mnk, layout, batch = None, "nn", 1
    name = packet.__name__
    if name in _GEMMS or name in _BATCHED_GEMMS:
        a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
        mnk = (int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1]))
        layout = _layout_char(a) + _layout_char(b)
        batch = int(a.shape[0]) if name in _BATCHED_GEMMS else 1
    read = 0 if is_view else sum(read_bytes(t) for t in ins)
    written = 0 if is_view else sum(t.numel() * t.element_size() for t in outs)
    moved = _PASSES.get(name, 1) * (read + written)
    largest = max((t.numel() * t.element_size() for t in ins + outs), default=0)
    biggest_in = max((t.numel() for t in ins), default=0)
    reduction = bool(outs) and biggest_in >= 4 * max(t.numel() for t in outs) and mnk is None
    strided = name in _COPIES and not is_view and any(not t.is_contiguous() for t in ins)
    return OpRecord(name=name, flops=float(flops), bytes_moved=int(moved), gemm_mnk=mnk, gemm_layout=layout,
                    is_view=is_view, is_reduction=reduction, gemm_batch=batch, is_strided_copy=strided,
                    tensor_bytes=int(largest), bytes_read=int(read), bytes_written=int(written),
                    is_causal=_is_causal(func, args, kwargs))


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append(describe_op(func, args, kwargs, out))
        return out


def trace_ops(fn: Callable[[], Any]) -> list[OpRecord]:
    """Run fn() once (forward and, if fn calls it, backward) and return every aten op it dispatched."""
    rec = _Recorder()
    with rec:
        fn()
    return rec.ops


def predict_op_time_s(op: OpRecord, cm: ComputeModel, dtype: str) -> float:
    """One op: a GEMM by shape, a bmm by per-matrix shape, a view free, anything else by its kind's table."""
    if op.is_view:
        return 0.0
    if op.gemm_mnk is not None and op.name in _BATCHED_GEMMS:
        return cm.batched_gemm_time_s(op.gemm_batch, *op.gemm_mnk, dtype=dtype, layout=op.gemm_layout)
    if op.gemm_mnk is not None:
        return cm.gemm_time_s(*op.gemm_mnk, dtype=dtype, layout=op.gemm_layout)
    return cm.op_time_s(op.flops, op.bytes_moved, dtype, kind=op.kind, tensor_bytes=op.tensor_bytes or None)


def predict_ops_time_s(ops: list[OpRecord], cm: ComputeModel, dtype: str) -> float:
    """Σ of per-op predictions (`predict_op_time_s`)."""
    return sum(predict_op_time_s(op, cm, dtype) for op in ops)
