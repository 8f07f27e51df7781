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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import SAC_IGNORED_OPS
from torch.utils.flop_counter import FlopCounterMode

from autopar.capture.fusion import StepLog, fused_kernels, unread_save_bytes
from autopar.capture.graph import Kernel, KernelMix
from autopar.capture.head_tables import HeadTables
from autopar.capture.kernels import (
    OP_SAC_MATMUL_OPS,
    SDPA_OPS,
    AttentionCore,
    gpu_kernels,
    inside_fused_kernel,
    op_sac_saves,
    written_tensors,
)
from autopar.capture.moe import GROUPED_MM_OPS, grouped_mm_groups, record_bank_calls, record_bank_saves
from autopar.capture.probe_kernels import (
    MATMUL_OPS,
    SDPA_BACKWARD_OPS,
    Op,
    backward_mix,
    forward_mix,
    kernel_of,
    op_kind,
    storages,
)
from autopar.capture.tensors import ModelState, storage_key, tensor_bytes
from autopar.capture.tp_pairs import Tag, merge_sources, tensor_parallel_pairs
from autopar.capture.units import common_parent, is_norm
from cost_models.optrace import describe_op

__all__ = ["CallStats", "ModelState", "PairSpec", "measure_call", "storage_key", "tensor_bytes"]

aten = torch.ops.aten
_REPLICATED: Tag = (None, False)
_CONSTANT: Tag = (frozenset(), False)


@dataclass(frozen=True, kw_only=True)
class PairSpec:
    """A column→row linear group found in a call; names are relative to the measured module."""

    columns: tuple[str, ...]
    row: str
    head_dim: int | None  # set when the region between them contains attention
    column_out_features: int
    row_in_features: int
    row_out_bytes: int  # the row output: the all-reduce payload under TP (whole example batch)
    # per-head tensors from parameters cut to a rank's heads (capture.head_tables): bytes whatever the batch,
    # and bytes for the whole example batch
    head_table_bytes: tuple[int, int] = (0, 0)


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
    saved_bytes_expert: int  # saved inside expert banks' calls, outside TP patterns (capture.moe.record_bank_saves)
    pairs: tuple[PairSpec, ...]
    # (relative linear/embedding name, input bytes, output bytes, forward FLOPs inside it)
    linear_io: tuple[tuple[str, int, int, float], ...]
    kernels_forward: KernelMix = KernelMix()
    kernels_backward: KernelMix = KernelMix()
    # what op-level selective checkpointing keeps (autopar.capture.kernels.op_sac_saves): the call's inputs
    # and the outputs of the ops its policy saves; and of that, the part inside TP patterns
    saved_bytes_op_sac: int = 0
    saved_bytes_op_sac_tp_sharded: int = 0
    saved_bytes_op_sac_unread: int = 0  # of saved_bytes_op_sac, outputs no backward reads (fusion.unread_saves)
    # what selective recompute keeps (autopar.capture.kernels.AttentionCore), alike: the call's inputs and the
    # storages of every output its policy caches (a view's base), less the call's own outputs (charged to the
    # layer that reads them)
    saved_bytes_selective: int = 0
    saved_bytes_selective_tp_sharded: int = 0
    saved_bytes_selective_unread: int = 0
    # (k, width, rows) of each top-k selection over a tensor's last dimension, rows the selections it makes
    # (the other dimensions' product): a router choosing k of `width` experts for each of `rows` tokens, or
    # k of `width` expert groups (autopar.capture.moe.find_moe)
    topks: tuple[tuple[int, int, int], ...] = ()


class _OpLog(TorchDispatchMode):
    """Records each op a backward pass runs: (kind, FLOPs, bytes) and its `Kernel`; FLOPs from a running
    FlopCounterMode. An op is TP-sharded when it reads a forward tensor inside a pattern, a gradient
    computed inside one, or a sharded linear's weight; gradients flowing out of a column linear's input
    are whole again (Megatron's all-reduce), those out of a row linear's input are sharded."""

    def __init__(self, counter: FlopCounterMode, tracker: _Tracker, sharded: Any, linear_of: dict[int, str],
                 tp_linears: set[str], rows: set[str]) -> None:
        super().__init__()
        self.counter, self.tracker, self.sharded = counter, tracker, sharded
        self.linear_of, self.tp_linears, self.rows = linear_of, tp_linears, rows
        self.ops: list[tuple[str, float, int]] = []
        self.kernels: list[Kernel] = []
        self.steps = StepLog()  # for the fused kernels of a compiled block (autopar.capture.fusion)
        # keyed by storage without keeping gradients alive: a kept reference would stop AccumulateGrad from
        # stealing a gradient and make it copy one that training never copies
        self.grad_sharded: dict[int, bool] = {}

    def _is_sharded(self, t: torch.Tensor) -> bool:
        key = storage_key(t)
        if key in self.grad_sharded:
            return self.grad_sharded[key]
        return key in self.tracker.tags and self.sharded(self.tracker.tags[key][0])

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        before = self.counter.get_total_flops()
        out = func(*args, **kwargs)
        flops = float(self.counter.get_total_flops() - before)
        packet = func.overloadpacket
        rec = describe_op(func, args, kwargs, out, flops)
        kind = "view" if rec.is_view else "matmul" if packet in MATMUL_OPS else \
            "attention" if packet in SDPA_BACKWARD_OPS else "memory"
        moved = 0 if rec.is_view else rec.bytes_moved
        self.ops.append((kind, flops, moved))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        weights = [self.linear_of.get(id(t._base if t._base is not None else t)) for t in ins]
        linear = next((w for w in weights if w), None)
        sharded = linear in self.tp_linears if linear else any(self._is_sharded(t) for t in ins)
        out_sharded = linear in self.rows if linear else sharded
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.grad_sharded[storage_key(t)] = out_sharded
        k = "view" if kind == "view" else "attention" if kind == "attention" or (
            kind == "matmul" and rec.gemm_batch > 1) else "gemm" if kind == "matmul" else "memory"
        groups = grouped_mm_groups(args, kwargs) if packet in GROUPED_MM_OPS else 0
        k = "gemm" if groups else k
        kernel = None if k == "view" else kernel_of(k, flops if k != "memory" else float(moved), rec, sharded,
                                                  groups=groups)
        if kernel is not None:
            self.kernels.append(kernel)
        self.steps.record(k, storages(ins), storages(tree_leaves(out)), kernel)
        return out


class _Tracker(TorchDispatchMode):
    """Tags storages with their source linears and records each op (see the module docstring)."""

    def __init__(self, counter: FlopCounterMode, state: ModelState) -> None:
        super().__init__()
        self.counter = counter
        self.state = state
        self.tags: dict[int, Tag] = {}
        self.keep: list[torch.Tensor] = []  # keeps storages alive so that keys are never reused
        self.ops: list[Op] = []
        self.linear_stack: list[str] = []
        self.saved: dict[int, int] = {}
        self.bytes_read = 0
        self.bytes_written = 0
        self.matmuls = 0  # OP_SAC_MATMUL_OPS so far (op_sac's counter)
        self.steps = StepLog()  # one per op in self.ops, for the fused kernels of a compiled block
        self.saved_ids: set[int] = set()  # StepLog names of the tensors saved for backward
        self.topks: list[tuple[int, int, int]] = []  # (k, width, rows) of each top-k over a last dimension
        # storages computed from the call's inputs; the rest derive from parameters, buffers and fresh
        # constants (position tables, a position-bias MLP over fixed coordinates)
        self.from_call: set[int] = set()
        self.heads = HeadTables()
        self.selective: dict[int, int] = {}  # storage key → bytes selective's policy keeps alive
        self.core = AttentionCore()  # what selective recompute runs again
        self.released: set[int] = set()  # storages selective kept until an op wrote into them
        self._entry_of: dict[int, tuple[int, ...]] = {}  # storage → the storages its cache entry holds

    def mark_from_call(self, t: torch.Tensor) -> None:
        self.from_call.add(storage_key(t))
        self.keep.append(t)

    def is_from_call(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self.from_call

    def tag(self, t: torch.Tensor) -> Tag:
        return self.tags.get(storage_key(t), _CONSTANT)

    def set_tag(self, out: Any, tag: Tag) -> None:
        """Tag every tensor of a module's output (a Linear subclass may return several: PhiMoE's router)."""
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tags[storage_key(t)] = tag
                self.keep.append(t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t in self.state:
            return t
        key = storage_key(t)
        self.saved_ids.add(self.steps.ident(key))
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
        rec = describe_op(func, args, kwargs, out, flops)
        self.bytes_read += rec.bytes_read  # what its kernel reads and writes: 0 for views and metadata queries
        self.bytes_written += rec.bytes_written
        in_tags = [self.tag(t) for t in ins]
        packet = func.overloadpacket
        any_core = any(core for _, core in in_tags)
        src = merge_sources(in_tags, bias_ok=any_core or packet in SDPA_OPS)
        active = [t for t, (s, _) in zip(ins, in_tags, strict=True) if s is None or s]
        head_dim = None
        if packet in SDPA_OPS:
            head_dim = ins[0].shape[-1]
            out_tags = [(src, False)] + [(src, True)] * (len(outs) - 1)
        else:
            attention = packet in MATMUL_OPS and packet not in GROUPED_MM_OPS and len(active) >= 2
            if attention and not any_core:  # q·kᵀ: its output starts the attention core
                head_dim = active[0].shape[-1]
            core = (not any_core) if attention else any_core
            out_tags = [(src, core)] * len(outs)
        for t, tag in zip(outs, out_tags, strict=True):
            self.set_tag(t, tag)
        from_call = [self.is_from_call(t) for t in ins]
        self.heads.on_op(packet.__name__, packet in SDPA_OPS, ins, outs, in_tags, from_call)
        if any(from_call):
            for t in outs:
                self.mark_from_call(t)
        linear = self.linear_stack[-1] if self.linear_stack else None
        kind = op_kind(packet, rec, len(active))
        groups = grouped_mm_groups(args, kwargs) if packet in GROUPED_MM_OPS else 0
        kind = "gemm" if groups else kind
        if packet is aten.topk:
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if dim in (-1, ins[0].dim() - 1):
                width = int(ins[0].shape[-1])
                self.topks.append((int(args[1]), width, ins[0].numel() // width if width else 0))
        in_core = kind == "attention" or any(core for _, core in out_tags)
        self.matmuls += packet in OP_SAC_MATMUL_OPS
        sac = tensor_bytes(outs) if op_sac_saves(packet, self.matmuls) else 0
        self.ops.append(Op(flops=flops, src=src, linear=linear, head_dim=head_dim, kind=kind,
                            bytes_moved=0 if kind == "view" else rec.bytes_moved, record=rec, core=in_core,
                            sac_saved_bytes=sac, groups=groups,
                            selective_saved=self._selective_cache(func, outs, func in SAC_IGNORED_OPS
                                                                  or self.core.observe(func, args, kwargs, out),
                                                                  written_tensors(func, args, kwargs))))
        self.steps.record(kind, storages(ins), storages(outs))
        return out


    def _selective_cache(self, func: Any, outs: list[torch.Tensor], recomputed: bool,
                         written: list[torch.Tensor]) -> tuple[int, ...]:
        """Storages selective recompute's policy first keeps alive with this op's outputs: torch's
        selective-checkpoint cache holds a detached alias of each output (its whole storage) of the ops the
        policy saves (`recomputed` False: AttentionCore); ops the cache ignores (detach) and parameters'
        views keep nothing new. A storage this op writes into is kept no longer (the runtime's policy turns
        its entries back to "run again": codegen.recompute), until an op keeps it again."""
        for t in written:  # the whole cache entry holding it (a top-k's indices beside its weights)
            for key in self._entry_of.get(storage_key(t), (storage_key(t),)):
                if self.selective.get(key):
                    self.selective[key] = 0
                    self.released.add(key)
        if func in SAC_IGNORED_OPS or recomputed or inside_fused_kernel():
            return ()
        new = []
        for t in outs:
            key = storage_key(t)
            if key in self.released:  # kept again after a write released it
                self.released.discard(key)
                self.selective[key] = t.untyped_storage().nbytes()
                new.append(key)
            elif t not in self.state and key not in self.selective:
                self.selective[key] = t.untyped_storage().nbytes()
                self.keep.append(t)
                new.append(key)
        for key in new:
            self._entry_of[key] = tuple(new)
        return tuple(new)


def _fresh(x: Any) -> Any:
    """A leaf copy of a recorded input, so backward stops at the call's boundary."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(x.requires_grad)
    return x


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
            tracker.mark_from_call(t)
            if t not in state:  # counted as inputs (tensor bytes), as under op_sac
                tracker.selective[storage_key(t)] = 0
    for t in (*module.parameters(), *module.buffers()):  # cached views of them (a weight's transpose) add nothing
        tracker.selective[storage_key(t)] = 0
    candidates: list[tuple[str, frozenset[str]]] = []
    io: dict[str, tuple[int, int]] = {}
    linears = {name: m for name, m in module.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}

    def pre_hook(name: str) -> Any:
        def hook(mod: nn.Module, inputs: tuple) -> None:
            if isinstance(mod, nn.Linear):
                src = tracker.tag(inputs[0])[0]
                if src and tracker.is_from_call(inputs[0]):
                    candidates.append((name, src))
                tracker.linear_stack.append(name)
        return hook

    def post_hook(name: str) -> Any:
        def hook(mod: nn.Module, inputs: tuple, output: Any) -> None:
            io[name] = (tensor_bytes(inputs), tensor_bytes(output))
            if isinstance(mod, nn.Linear):
                tracker.linear_stack.pop()
            if not tracker.is_from_call(inputs[0]):
                # over parameters and constants only (Swin v2's position-bias MLP over fixed coordinates, T5's
                # bucketed position table): a constant like them, never part of a TP pair
                tracker.set_tag(output, _CONSTANT)
                tracker.heads.on_table(name, output)
            elif isinstance(mod, nn.Linear):
                tracker.set_tag(output, (frozenset({name}), False))
            else:  # an embedding lookup of the call's ids starts the residual stream
                tracker.set_tag(output, _REPLICATED)
        return hook

    norm_sources: dict[str, frozenset[str] | None] = {}

    def norm_hook(name: str) -> Any:
        def hook(mod: nn.Module, inputs: tuple) -> None:
            x = next((t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
            if x is not None:
                norm_sources[name] = tracker.tag(x)[0]
        return hook

    handles = []
    for name, m in linears.items():
        handles.append(m.register_forward_pre_hook(pre_hook(name)))
        handles.append(m.register_forward_hook(post_hook(name)))
    handles.extend(m.register_forward_pre_hook(norm_hook(name)) for name, m in module.named_modules() if is_norm(m))
    bank_keys: list[Any] = []  # storages saved inside expert banks' calls
    handles += [*record_bank_calls(module, tracker.topks), *record_bank_saves(module, tracker.saved, bank_keys)]
    try:
        with torch.enable_grad(), counter, tracker, saved_tensors_hooks(tracker.pack, lambda t: t), gpu_kernels():
            out = module(*args, **kwargs)
        forward_flops = counter.get_total_flops()
        pairs = tensor_parallel_pairs(module, linears, candidates, norm_sources)
        column_sets = [cols for _, cols in pairs]
        tp_linears = {row for row, _ in pairs}.union(*column_sets) if pairs else set()

        def sharded(src: frozenset[str] | None) -> bool:
            return bool(src) and any(src <= cols for cols in column_sets)

        roots = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        seeds = [torch.ones_like(t) for t in roots]  # the loss's gradient arrives from outside the layer
        backward_counter = FlopCounterMode(display=False)
        linear_of = {id(p): name for name, m in linears.items() for p in m.parameters(recurse=False)}
        op_log = _OpLog(backward_counter, tracker, sharded, linear_of, tp_linears, {row for row, _ in pairs})
        with backward_counter, op_log, gpu_kernels():
            if roots:
                torch.autograd.backward(roots, seeds)
        backward_flops = backward_counter.get_total_flops()
    finally:
        for h in handles:
            h.remove()
        for p in module.parameters():
            p.grad = None

    specs = []
    for row, cols in pairs:
        head_dims = [op.head_dim for op in tracker.ops if op.head_dim and op.src and op.src <= cols]
        specs.append(PairSpec(
            columns=tuple(sorted(cols, key=list(linears).index)), row=row,
            head_dim=head_dims[0] if head_dims else None,
            column_out_features=sum(linears[c].out_features for c in cols),
            row_in_features=linears[row].in_features, row_out_bytes=io[row][1],
            head_table_bytes=tracker.heads.gathered_bytes(common_parent((*cols, row)), cols,
                                                          linears[row].in_features // head_dims[0])
            if head_dims else (0, 0),
        ))
    kernels_forward = forward_mix(tracker.ops, sharded, tp_linears, tracker.steps.steps, tracker.saved_ids)
    saved_sharded = sum(n for key, n in tracker.saved.items() if sharded(tracker.tags.get(key, _CONSTANT)[0]))
    saved_core = sum(n for key, n in tracker.saved.items() if tracker.tags.get(key, _CONSTANT)[1])
    inputs = tensor_bytes([t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t not in state])
    out_keys = {storage_key(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
    charged: set[int] = set()  # each storage once: one kept again after a write is listed by two ops
    selective = []
    for op in tracker.ops:
        keys = [k for k in op.selective_saved if k not in out_keys and k not in charged]
        charged.update(keys)
        selective.append(sum(tracker.selective[k] for k in keys))
    selective_sharded = sum(n for k, n in tracker.selective.items()
                            if k not in out_keys and sharded(tracker.tags.get(k, _CONSTANT)[0]))
    sac_sharded = sum(op.sac_saved_bytes for op in tracker.ops if op.linear not in tp_linears and sharded(op.src)
                      or op.linear in tp_linears and op.linear not in {row for row, _ in pairs})
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
        saved_bytes_expert=sum(tracker.saved[k] for k in set(bank_keys)
                               if not sharded(tracker.tags.get(k, _CONSTANT)[0])),
        pairs=tuple(specs),
        linear_io=tuple((name, i, o, sum(op.flops for op in tracker.ops if op.linear == name))
                        for name, (i, o) in io.items()),
        kernels_forward=kernels_forward,
        kernels_backward=dataclasses.replace(backward_mix(op_log.ops, kernels_forward, op_log.kernels),
                                             fused=fused_kernels(op_log.steps.steps)),
        saved_bytes_op_sac=inputs + sum(op.sac_saved_bytes for op in tracker.ops),
        saved_bytes_op_sac_tp_sharded=sac_sharded, saved_bytes_op_sac_unread=unread_save_bytes(
            tracker.steps.steps, tracker.saved_ids, [op.sac_saved_bytes for op in tracker.ops]),
        saved_bytes_selective=inputs + sum(selective), saved_bytes_selective_tp_sharded=selective_sharded,
        saved_bytes_selective_unread=unread_save_bytes(tracker.steps.steps, tracker.saved_ids, selective),
        topks=tuple(tracker.topks),
    )
