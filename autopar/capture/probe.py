"""Measure one module call on meta tensors: FLOPs, memory traffic, saved activations, TP structure.

The call runs forward and backward once under
- `FlopCounterMode` (FLOPs of every ATen op it knows: matmuls, convolutions, fused attention);
- `saved_tensors_hooks`, which sees every tensor autograd keeps for backward; these are deduplicated
  by storage and parameters/buffers are excluded, so the sum is the activation memory of the call;
- a dispatch mode that follows data flow between ops by tagging each storage with
  *the set of linears it is computed from*. A linear output is tagged with that linear's name; an op
  output gets the union of its inputs' tags, or REPLICATED as soon as one input derives from the
  call's differentiable inputs other than through a linear (the residual stream); parameters,
  buffers and tensors built from them (rotary tables, masks) are constant and add nothing.
  A linear whose input is tagged with a set of linears is a row-parallel candidate fed by those
  column-parallel linears (Megatron-LM, Shoeybi et al. 2019, §3): what lies between them (GELU,
  the attention core, rotary embedding, ...) is computed per head / per hidden slice and is divided
  by the TP degree. A matmul of two non-constant tensors is attention; its outputs, up to the next
  such matmul, are the attention core (scores, softmax, dropout: Korthikanti et al. 2022, §4.2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from autopar.capture.kernels import SDPA_OPS, gpu_kernels

__all__ = ["CallStats", "ModelState", "PairSpec", "measure_call", "storage_key", "tensor_bytes"]

aten = torch.ops.aten
_MATMUL_OPS = frozenset({aten.mm, aten.bmm, aten.baddbmm, aten.addmm, aten.addbmm, aten.matmul})

# Tag: (source linears, is attention core). Source None = replicated (from the residual stream);
# an empty frozenset = constant.
Tag = tuple[frozenset[str] | None, bool]
_REPLICATED: Tag = (None, False)
_CONSTANT: Tag = (frozenset(), False)


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class ModelState:
    """Recognises parameters and buffers (and views of them), which are never activations."""

    def __init__(self, model: nn.Module) -> None:
        self.buffer_ids = {id(b) for b in model.buffers()}

    def __contains__(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return isinstance(base, nn.Parameter) or isinstance(t, nn.Parameter) or id(base) in self.buffer_ids \
            or id(t) in self.buffer_ids


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in a (nested) value, by shape and dtype."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


@dataclass(frozen=True, kw_only=True)
class PairSpec:
    """A column→row linear group found in a call; names are relative to the measured module."""

    columns: tuple[str, ...]
    row: str
    head_dim: int | None  # set when the region between them contains attention
    column_out_features: int
    row_in_features: int
    row_out_bytes: int  # the row output: the all-reduce payload under TP (whole example batch)


@dataclass(frozen=True, kw_only=True)
class CallStats:
    """What one call costs, for the whole example batch (capture divides by the batch size)."""

    forward_flops: float
    backward_flops: float
    forward_flops_tp_sharded: float
    bytes_read: int
    bytes_written: int
    saved_bytes: int
    saved_bytes_tp_sharded: int
    saved_bytes_attention_core: int
    pairs: tuple[PairSpec, ...]
    # (relative linear/embedding name, input bytes, output bytes, forward FLOPs inside it)
    linear_io: tuple[tuple[str, int, int, float], ...]


@dataclass
class _Op:
    flops: float
    src: frozenset[str] | None
    linear: str | None
    head_dim: int | None


class _Tracker(TorchDispatchMode):
    """Tags storages with their source linears and records each op (see the module docstring)."""

    def __init__(self, counter: FlopCounterMode, state: ModelState) -> None:
        super().__init__()
        self.counter = counter
        self.state = state
        self.tags: dict[int, Tag] = {}
        self.keep: list[torch.Tensor] = []  # keeps storages alive so that keys are never reused
        self.ops: list[_Op] = []
        self.linear_stack: list[str] = []
        self.saved: dict[int, int] = {}
        self.bytes_read = 0
        self.bytes_written = 0

    def tag(self, t: torch.Tensor) -> Tag:
        return self.tags.get(storage_key(t), _CONSTANT)

    def set_tag(self, t: torch.Tensor, tag: Tag) -> None:
        self.tags[storage_key(t)] = tag
        self.keep.append(t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t in self.state:
            return t
        key = storage_key(t)
        if key not in self.saved:
            self.saved[key] = t.untyped_storage().nbytes()
            self.keep.append(t)
        return t

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        before = self.counter.get_total_flops()
        out = func(*args, **kwargs)
        flops = self.counter.get_total_flops() - before
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not func.is_view:
            self.bytes_read += tensor_bytes(ins)
            self.bytes_written += tensor_bytes(outs)
        in_tags = [self.tag(t) for t in ins]
        src: frozenset[str] | None = frozenset()
        for s, _ in in_tags:
            src = None if s is None or src is None else src | s
        packet = func.overloadpacket
        any_core = any(core for _, core in in_tags)
        active = [t for t, (s, _) in zip(ins, in_tags, strict=True) if s is None or s]
        head_dim = None
        if packet in SDPA_OPS:
            head_dim = ins[0].shape[-1]
            out_tags = [(src, False)] + [(src, True)] * (len(outs) - 1)
        else:
            attention = packet in _MATMUL_OPS and len(active) >= 2
            if attention and not any_core:  # q·kᵀ: its output starts the attention core
                head_dim = active[0].shape[-1]
            core = (not any_core) if attention else any_core
            out_tags = [(src, core)] * len(outs)
        for t, tag in zip(outs, out_tags, strict=True):
            self.set_tag(t, tag)
        linear = self.linear_stack[-1] if self.linear_stack else None
        self.ops.append(_Op(flops=flops, src=src, linear=linear, head_dim=head_dim))
        return out


def _fresh(x: Any) -> Any:
    """A leaf copy of a recorded input, so backward stops at the call's boundary."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


def _resolve_pairs(candidates: list[tuple[str, frozenset[str]]]) -> list[tuple[str, frozenset[str]]]:
    """Keep candidates in execution order while no linear is both a column and a row."""
    used_rows: set[str] = set()
    used_cols: set[str] = set()
    pairs = []
    for row, cols in candidates:
        if row in used_cols or row in used_rows or cols & used_rows or cols & used_cols:
            continue
        pairs.append((row, cols))
        used_rows.add(row)
        used_cols |= cols
    return pairs


def measure_call(module: nn.Module, args: tuple, kwargs: dict[str, Any], state: ModelState) -> CallStats:
    """Run `module(*args, **kwargs)` forward and backward on meta tensors and measure it.

    `state`: the model's parameters and buffers, never counted as activations.
    """
    args, kwargs = tree_map(_fresh, (args, kwargs))
    counter = FlopCounterMode(display=False)
    tracker = _Tracker(counter, state)
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            tracker.set_tag(t, _REPLICATED if t.requires_grad else _CONSTANT)
    candidates: list[tuple[str, frozenset[str]]] = []
    io: dict[str, tuple[int, int]] = {}
    linears = {name: m for name, m in module.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}

    def pre_hook(name: str) -> Any:
        def hook(mod: nn.Module, inputs: tuple) -> None:
            if isinstance(mod, nn.Linear):
                src = tracker.tag(inputs[0])[0]
                if src:
                    candidates.append((name, src))
                tracker.linear_stack.append(name)
        return hook

    def post_hook(name: str) -> Any:
        def hook(mod: nn.Module, inputs: tuple, output: Any) -> None:
            io[name] = (tensor_bytes(inputs), tensor_bytes(output))
            if isinstance(mod, nn.Linear):
                tracker.linear_stack.pop()
                tracker.set_tag(output, (frozenset({name}), False))
            else:  # an embedding lookup starts the residual stream
                tracker.set_tag(output, _REPLICATED)
        return hook

    handles = []
    for name, m in linears.items():
        handles.append(m.register_forward_pre_hook(pre_hook(name)))
        handles.append(m.register_forward_hook(post_hook(name)))
    try:
        with torch.enable_grad(), counter, tracker, saved_tensors_hooks(tracker.pack, lambda t: t), gpu_kernels():
            out = module(*args, **kwargs)
        forward_flops = counter.get_total_flops()
        roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        backward_counter = FlopCounterMode(display=False)
        with backward_counter:
            if roots:
                torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
        backward_flops = backward_counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
        for p in module.parameters():
            p.grad = None

    pairs = _resolve_pairs(candidates)
    column_sets = [cols for _, cols in pairs]
    tp_linears = {row for row, _ in pairs}.union(*column_sets) if pairs else set()

    def sharded(src: frozenset[str] | None) -> bool:
        return bool(src) and any(src <= cols for cols in column_sets)

    specs = []
    for row, cols in pairs:
        head_dims = [op.head_dim for op in tracker.ops if op.head_dim and op.src and op.src <= cols]
        specs.append(PairSpec(
            columns=tuple(sorted(cols, key=list(linears).index)), row=row,
            head_dim=head_dims[0] if head_dims else None,
            column_out_features=sum(linears[c].out_features for c in cols),
            row_in_features=linears[row].in_features, row_out_bytes=io[row][1],
        ))
    saved_sharded = sum(n for key, n in tracker.saved.items() if sharded(tracker.tags.get(key, _CONSTANT)[0]))
    saved_core = sum(n for key, n in tracker.saved.items() if tracker.tags.get(key, _CONSTANT)[1])
    return CallStats(
        forward_flops=float(forward_flops),
        backward_flops=float(backward_flops),
        forward_flops_tp_sharded=float(sum(op.flops for op in tracker.ops
                                           if op.linear in tp_linears or sharded(op.src))),
        bytes_read=tracker.bytes_read,
        bytes_written=tracker.bytes_written,
        saved_bytes=sum(tracker.saved.values()),
        saved_bytes_tp_sharded=saved_sharded,
        saved_bytes_attention_core=saved_core,
        pairs=tuple(specs),
        linear_io=tuple((name, i, o, sum(op.flops for op in tracker.ops if op.linear == name))
                        for name, (i, o) in io.items()),
    )
