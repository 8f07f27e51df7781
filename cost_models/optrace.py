"""Record the aten ops a callable runs (FLOPs, bytes, GEMM shapes) and price them op by op.

This is how a layer's time is predicted from kernel measurements alone, without timing the layer:
every op is a GEMM (priced by `ComputeModel.gemm_time_s` on its shape), a view (free: its output
aliases an input) or a memory-bound kernel (priced by `op_time_s` on FLOPs and bytes in + out).
FLOPs come from torch.utils.flop_counter's registry, the counts FlopCounterMode uses.
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

__all__ = ["OpRecord", "trace_ops", "predict_ops_time_s"]

_GEMMS = {"mm", "addmm"}
# ops whose per-element cost is an exp/erf/rsqrt rather than a load and a store
_TRANSCENDENTAL = {"_softmax", "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "gelu",
                   "gelu_backward", "silu", "silu_backward", "exp", "tanh", "tanh_backward", "sigmoid",
                   "sigmoid_backward", "erf", "native_layer_norm", "native_layer_norm_backward", "_fused_rms_norm",
                   "rsqrt", "pow"}


@dataclass(frozen=True, kw_only=True)
class OpRecord:
    name: str  # aten overload packet, e.g. "mm"
    flops: float
    bytes_moved: int  # tensor inputs + outputs
    gemm_mnk: tuple[int, int, int] | None  # for mm / addmm
    gemm_layout: str = "nn"  # "t" for an operand stored transposed (column-major)
    is_view: bool  # output aliases an input: no kernel runs
    is_reduction: bool = False  # the largest input is ≥ 4× the largest output (sums, norms' statistics)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]


def _layout_char(t: torch.Tensor) -> str:
    return "t" if t.dim() == 2 and t.stride(0) == 1 and t.shape[1] > 1 else "n"


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[OpRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        in_ptrs = {t.untyped_storage().data_ptr() for t in ins if t.device.type != "meta"}
        # a view (view, t, _unsafe_view, ...) returns an alias of an input without mutating anything
        is_view = (not func._schema.is_mutable and bool(outs)
                   and all(t.untyped_storage().data_ptr() in in_ptrs for t in outs))
        flops = float(flop_registry[packet](*args, **kwargs, out_val=out)) if packet in flop_registry else 0.0
        mnk, layout = None, "nn"
        name = packet.__name__
        if name in _GEMMS:
            a, b = (args[0], args[1]) if name == "mm" else (args[1], args[2])
            mnk = (a.shape[0], b.shape[1], a.shape[1])
            layout = _layout_char(a) + _layout_char(b)
        moved = sum(t.numel() * t.element_size() for t in ins + outs)
        biggest_in = max((t.numel() for t in ins), default=0)
        reduction = bool(outs) and biggest_in >= 4 * max(t.numel() for t in outs) and mnk is None
        self.ops.append(OpRecord(name=name, flops=flops, bytes_moved=moved, gemm_mnk=mnk, gemm_layout=layout,
                                 is_view=is_view, is_reduction=reduction))
        return out


def trace_ops(fn: Callable[[], Any]) -> list[OpRecord]:
    """Run fn() once (forward and, if fn calls it, backward) and return every aten op it dispatched."""
    rec = _Recorder()
    with rec:
        fn()
    return rec.ops


def predict_ops_time_s(ops: list[OpRecord], cm: ComputeModel, dtype: str) -> float:
    """Σ of per-op predictions: GEMMs by shape, views free, everything else by roofline."""
    total = 0.0
    for op in ops:
        if op.is_view:
            continue
        if op.gemm_mnk is not None:
            total += cm.gemm_time_s(*op.gemm_mnk, dtype=dtype, layout=op.gemm_layout)
        else:
            kind = "transcendental" if op.name in _TRANSCENDENTAL else \
                "reduction" if op.is_reduction else "elementwise"
            total += cm.op_time_s(op.flops, op.bytes_moved, dtype, kind=kind)
    return total
