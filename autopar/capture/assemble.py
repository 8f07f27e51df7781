"""Assemble the measured pieces into `LayerSpec`s and a `ModelGraph`, per sample of the example batch."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from autopar.capture.graph import (
    Kernel,
    KernelMix,
    LayerSpec,
    ModelGraph,
    SharedParam,
    TPPattern,
    merge_kernels,
)
from autopar.capture.layers import LayerGroup, retained_inputs
from autopar.capture.moe import DEFAULT_LOAD_IMBALANCE, find_moe
from autopar.capture.moe_spec import MoESpec
from autopar.capture.probe import CallStats
from autopar.capture.record import Recording
from autopar.capture.units import CONTAINERS
from autopar.errors import CaptureError

__all__ = ["assemble"]

_HIDDEN_ATTRS = ("hidden_size", "n_embd", "d_model", "dim")


@dataclass
class _Sums:
    forward_flops: float = 0.0
    backward_flops: float = 0.0
    forward_flops_tp_sharded: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    saved: int = 0
    saved_tp_sharded: int = 0
    saved_core: int = 0
    saved_expert: int = 0
    saved_op_sac: int = 0
    saved_op_sac_tp_sharded: int = 0
    saved_op_sac_unread: int = 0
    saved_selective: int = 0
    saved_selective_tp_sharded: int = 0
    saved_selective_unread: int = 0
    kernels_forward: KernelMix = field(default_factory=KernelMix)
    kernels_backward: KernelMix = field(default_factory=KernelMix)
    signatures: list[str] = field(default_factory=list)
    patterns: dict[tuple, TPPattern] = field(default_factory=dict)
    moe: MoESpec | None = None


def _pair_patterns(unit: str, stats: CallStats) -> list[TPPattern]:
    out = []
    for pair in stats.pairs:
        cols = tuple(f"{unit}.{c}" if unit else c for c in pair.columns)
        row = f"{unit}.{pair.row}" if unit else pair.row
        if pair.head_dim:
            heads = pair.row_in_features // pair.head_dim
            kv_width = pair.column_out_features - heads * pair.head_dim
            kv = kv_width // (2 * pair.head_dim) if kv_width > 0 and kv_width % (2 * pair.head_dim) == 0 else None
            out.append(TPPattern(kind="attention", column=cols, row=(row,), num_heads=heads, num_kv_heads=kv,
                                 head_dim=pair.head_dim, allreduce_bytes_per_sample=pair.row_out_bytes,
                                 head_table_bytes=pair.head_table_bytes[0],
                                 head_table_bytes_per_sample=pair.head_table_bytes[1]))
        else:
            out.append(TPPattern(kind="mlp", column=cols, row=(row,),
                                 allreduce_bytes_per_sample=pair.row_out_bytes))
    return out


def _shared_params(model: nn.Module, groups: list[LayerGroup], holders: dict[int, list[int]],
                   top_level: set[int]) -> tuple[SharedParam, ...]:
    """Parameters held by several layers, or read by top-level code only (see `SharedParam`)."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        tensors[id(p)] = p
    out = []
    for key, ns in names.items():
        layers = () if key in top_level else tuple(groups[i].name for i in holders.get(key, ()))
        if key in top_level or len(layers) > 1:
            p = tensors[key]
            out.append(SharedParam(names=tuple(ns), layers=layers, num_params=p.numel(),
                                   param_bytes=p.numel() * p.element_size()))
    return tuple(out)


def _vocab_modules(model: nn.Module, vocab: int | None) -> dict[str, str]:
    """Fully qualified name → "embedding" / "lm_head" for modules whose size is the vocabulary.

    Found at any depth (a token embedding kept in an `nn.ModuleDict` beside the blocks, a head under an
    attribute), except inside a stack of blocks (a container child with a sibling of its class) or as a
    member of a stack of projections (siblings of one class and parameter shapes: a `ModuleList` of linears,
    one per depth): a projection can be as wide as the vocabulary by coincidence (a fused q|k|v of a small
    model, a gate|value projection of twice the width).
    """
    found: dict[str, str] = {}
    if vocab is None:
        return found
    in_blocks: set[str] = set()
    for name, c in model.named_modules():
        if not isinstance(c, CONTAINERS):
            continue
        classes = [type(child) for child in c.children()]
        kinds = [(type(child), tuple(p.shape for p in child.parameters())) for child in c.children()]
        for (child_name, child), kind in zip(c.named_children(), kinds, strict=True):
            if classes.count(type(child)) > 1:
                prefix = f"{name}.{child_name}" if name else child_name
                in_blocks.update(f"{prefix}.{sub}" for sub, _ in child.named_modules() if sub)
                if kinds.count(kind) > 1:
                    in_blocks.add(prefix)
    for name, m in model.named_modules():
        if name in in_blocks:
            continue
        if isinstance(m, nn.Embedding) and m.num_embeddings == vocab:
            found[name] = "embedding"
        elif isinstance(m, nn.Linear) and m.out_features == vocab:
            found[name] = "lm_head"
    return found


def _vocab_patterns(unit: str, stats: CallStats, vocab_modules: dict[str, str], vocab: int | None
                    ) -> list[TPPattern]:
    """Vocab-parallel embedding (all-reduce of its output) and LM head (all-reduce of its input gradient)."""
    in_pairs = {c for p in stats.pairs for c in (*p.columns, p.row)}
    out = []
    for rel, in_bytes, out_bytes, _ in stats.linear_io:
        full = f"{unit}.{rel}" if unit and rel else (unit or rel)
        kind = vocab_modules.get(full)
        if kind == "embedding":
            out.append(TPPattern(kind="embedding", column=(full,), vocab_size=vocab,
                                 allreduce_bytes_per_sample=out_bytes))
        elif kind == "lm_head" and rel not in in_pairs:
            out.append(TPPattern(kind="lm_head", column=(full,), vocab_size=vocab,
                                 allreduce_bytes_per_sample=in_bytes))
    return out


def _vocab_sharded(mix: KernelMix, share: float) -> KernelMix:
    """The extra TP-sharded work of a vocab-parallel embedding or LM head: `share` of the call's GEMM
    FLOPs and memory traffic (the logits, the lookups) that the vocabulary split divides."""
    return KernelMix(gemm_flops_tp_sharded=mix.gemm_flops * share - mix.gemm_flops_tp_sharded * share,
                     memory_bytes_tp_sharded=mix.memory_bytes * share - mix.memory_bytes_tp_sharded * share)


def _vocab_kernels(mix: KernelMix, logits_bytes: int) -> KernelMix:
    """The call's kernels with those of a vocab-parallel LM head marked TP-sharded: its GEMMs and the
    memory-bound kernels over logits-sized tensors (the vocabulary split divides both)."""
    if logits_bytes <= 0:
        return mix
    kernels = [dataclasses.replace(k, tp_sharded=True) if k.kind == "gemm" or k.tensor_bytes >= logits_bytes
               else k for k in mix.kernels]
    return dataclasses.replace(mix, kernels=merge_kernels(kernels))


def _weight_split(pattern: TPPattern, module: str) -> str:
    """How a pattern splits `module`'s weight: "rows" (vocab-parallel embedding and head, column-parallel
    linears: the weight's dim 0), "columns" (row-parallel linears: dim 1), or "" when it is not in it."""
    if module in pattern.row:
        return "columns"
    return "rows" if module in pattern.column else ""


def _reconcile_ties(sums: list[_Sums], shared: tuple[SharedParam, ...], called: set[str]) -> list[str]:
    """A weight that several modules share is split alike by all of them or by none: where the patterns found
    split it differently (or on one side only), those patterns are dropped, so the planner prices the weight
    replicated and codegen never meets a tie it would refuse. A module the forward never calls (T5's `shared`,
    whose aliases `encoder.embed_tokens` and `decoder.embed_tokens` do the lookups) splits nothing: it holds
    the weight as its called aliases split it. Returns the modules whose patterns were dropped."""
    dropped: list[str] = []
    patterns = [p for s in sums for p in s.patterns.values()]
    for sp in shared:
        modules = {name.rsplit(".", 1)[0] for name in sp.names if "." in name} & called
        if len(modules) < 2:
            continue
        splits = {m: {_weight_split(p, m) for p in patterns} - {""} for m in modules}
        if len({frozenset(v) for v in splits.values()}) <= 1 and all(len(v) <= 1 for v in splits.values()):
            continue
        for s in sums:
            for key, p in list(s.patterns.items()):
                if any(_weight_split(p, m) for m in modules):
                    del s.patterns[key]
        dropped.extend(sorted(modules))
    return dropped


def _norm_param_numels(model: nn.Module, units: tuple[str, ...]) -> tuple[int, ...]:
    """Elements of each parameter of the norm modules in `units` (LayerNorm, RMSNorm and classes named
    *Norm, the modules codegen keeps replicated and runs sequence-parallel)."""
    out = []
    for u in units:
        for m in model.get_submodule(u).modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) or type(m).__name__.endswith("Norm"):
                out.extend(p.numel() for p in m.parameters(recurse=False))
    return tuple(out)


def _moe(model: nn.Module, unit: str, stats: CallStats, seq_len: int | None) -> MoESpec | None:
    """The unit's mixture-of-experts block (autopar.capture.moe.find_moe), at the default load imbalance."""
    module = model.get_submodule(unit)
    floating = next((p for p in module.parameters() if p.is_floating_point()), None)
    try:
        return find_moe(module, unit, stats.topks, floating.element_size() if floating is not None else 4,
                        tokens_per_sample=seq_len or 1, load_imbalance=DEFAULT_LOAD_IMBALANCE)
    except ValueError as e:
        raise CaptureError(str(e)) from None


def _kind(model: nn.Module, group: LayerGroup, patterns: list[TPPattern], has_params: bool,
          embedding_names: list[str]) -> str:
    if any(p.kind == "lm_head" for p in patterns):
        return "head"
    if any(e == u or e.startswith(f"{u}.") or not u for e in embedding_names for u in group.units):
        return "embedding"
    modules = [m for u in group.units for m in model.get_submodule(u).modules()]
    with_params = [m for m in modules if any(True for _ in m.parameters(recurse=False))]
    if with_params and all("norm" in type(m).__name__.lower() for m in with_params):
        return "norm"  # also a final norm kept beside the blocks in a ModuleDict (nanoGPT's transformer.ln_f)
    if group.in_container and has_params:
        return "block"
    return "other"


def _vocab_size(model: nn.Module, embeddings: list[nn.Embedding]) -> int | None:
    """The vocabulary: the config's, else an embedding whose size an output linear shares (the LM head),
    else the largest embedding. Not simply the largest: a position table can outgrow a small vocabulary."""
    configured = _config_int(model, ("vocab_size",))
    if configured is not None:
        return configured
    out_features = {m.out_features for m in model.modules() if isinstance(m, nn.Linear)}
    tied = [m.num_embeddings for m in embeddings if m.num_embeddings in out_features]
    return max(tied or [m.num_embeddings for m in embeddings], default=None)


def _config_int(model: nn.Module, names: tuple[str, ...]) -> int | None:
    cfg = getattr(model, "config", None)
    for name in names:
        value = getattr(cfg, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def assemble(*, model: nn.Module, model_name: str, groups: list[LayerGroup], rec: Recording,
             stats: dict[str, CallStats], boundary_bytes: list[int], batch: int,
             seq_len: int | None, method: str, seconds: float, metadata: dict[str, Any]) -> ModelGraph:
    layer_of = {u: i for i, g in enumerate(groups) for u in g.units}
    embedding_names = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    embeddings = [model.get_submodule(n) for n in embedding_names]
    vocab = _vocab_size(model, embeddings)
    vocab_modules = _vocab_modules(model, vocab)
    tie_groups: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tie_groups.setdefault(id(p), set()).add(name.rsplit(".", 1)[0] if "." in name else "")
    replicated_ties: list[str] = []
    # the linears and embeddings the forward calls: a tied weight's other holders (T5's never-called `shared`,
    # BERT's prediction head keeping an alias of its decoder's bias) hold it as these split it
    called = {f"{c.unit}.{rel}" if c.unit and rel else c.unit or rel
              for c in rec.calls for rel, _, _, _ in stats[c.signature].linear_io}
    for modules in tie_groups.values():  # a tied weight is vocab-parallel on every side or on none
        if len({m in vocab_modules for m in modules & called}) > 1:
            for m in modules:
                vocab_modules.pop(m, None)
            replicated_ties.extend(sorted(modules))
    sums = [_Sums() for _ in groups]
    for call in rec.calls:
        s, st = sums[layer_of[call.unit]], stats[call.signature]
        s.forward_flops += st.forward_flops
        s.backward_flops += st.backward_flops
        s.forward_flops_tp_sharded += st.forward_flops_tp_sharded
        s.bytes_read += st.bytes_read
        s.bytes_written += st.bytes_written
        s.saved += st.saved_bytes
        s.saved_tp_sharded += st.saved_bytes_tp_sharded
        s.saved_core += st.saved_bytes_attention_core
        s.saved_expert += st.saved_bytes_expert
        s.saved_op_sac += st.saved_bytes_op_sac
        s.saved_op_sac_tp_sharded += st.saved_bytes_op_sac_tp_sharded
        s.saved_op_sac_unread += st.saved_bytes_op_sac_unread
        s.saved_selective += st.saved_bytes_selective
        s.saved_selective_tp_sharded += st.saved_bytes_selective_tp_sharded
        s.saved_selective_unread += st.saved_bytes_selective_unread
        s.signatures.append(call.signature)
        vocab_patterns = _vocab_patterns(call.unit, st, vocab_modules, vocab)
        vocab_names = {c for p in vocab_patterns for c in p.column}
        # a vocab-parallel embedding / LM head splits its own work too
        vocab_flops = sum(f for rel, _, _, f in st.linear_io
                          if (f"{call.unit}.{rel}" if call.unit and rel else call.unit or rel) in vocab_names)
        s.forward_flops_tp_sharded += vocab_flops
        fwd, bwd = st.kernels_forward, st.kernels_backward
        if vocab_patterns:
            share = min(1.0, vocab_flops / st.forward_flops) if st.forward_flops else 0.0
            logits = max((o for rel, _, o, f in st.linear_io if f > 0 and (
                f"{call.unit}.{rel}" if call.unit and rel else call.unit or rel) in vocab_names), default=0)
            fwd = _vocab_kernels(fwd, logits) + _vocab_sharded(fwd, share)
            bwd = _vocab_kernels(bwd, logits) + _vocab_sharded(bwd, share)
        s.kernels_forward += fwd
        s.kernels_backward += bwd
        for p in _pair_patterns(call.unit, st) + vocab_patterns:
            s.patterns.setdefault((p.kind, p.column, p.row), p)
        if st.topks and s.moe is None:
            s.moe = _moe(model, call.unit, st, seq_len)
    for last_unit, cost in rec.top_level.items():
        s = sums[layer_of.get(last_unit, 0) if last_unit is not None else 0]
        s.forward_flops += cost.forward_flops
        # Top-level code runs forward only here; a matmul's backward is two matmuls of the same size
        # (input and weight gradients), the 2x of Narayanan et al. 2021, eq. 3.
        s.backward_flops += 2 * cost.forward_flops
        s.bytes_read += cost.bytes_read
        s.bytes_written += cost.bytes_written
        s.saved += cost.saved_bytes
        s.saved_op_sac += cost.saved_bytes  # top-level glue is never checkpointed
        s.saved_selective += cost.saved_bytes
        moved = float(cost.bytes_read + cost.bytes_written)
        gemm = [Kernel(kind="gemm", count=1, work=cost.forward_flops)] if cost.forward_flops > 0 else []
        top = KernelMix(gemm_flops=cost.forward_flops, gemm_count=len(gemm), memory_bytes=moved, memory_count=1,
                        kernels=(*gemm, Kernel(kind="elementwise", count=1, work=moved)))
        s.kernels_forward += top
        s.kernels_backward += KernelMix(gemm_flops=2 * top.gemm_flops, gemm_count=2 * top.gemm_count,
                                        memory_bytes=2 * top.memory_bytes, memory_count=1,
                                        kernels=(*[dataclasses.replace(k, count=2) for k in gemm],
                                                 Kernel(kind="elementwise", count=1, work=2 * moved)))
        s.signatures.append(f"top:{cost.forward_flops}:{cost.saved_bytes}")

    # Parameters: each in every layer that holds it (a tied head holds the embedding's weight too: on
    # another pipeline stage it is a replica); ones above the units are charged to the first layer.
    params: list[list[torch.Tensor]] = [[] for _ in groups]
    holders: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        here = {id(p): p for u in g.units for p in model.get_submodule(u).parameters()}
        params[i] = list(here.values())
        for key in here:
            holders.setdefault(key, []).append(i)
    top_level = [p for p in model.parameters() if id(p) not in holders]
    params[0].extend(top_level)
    shared = _shared_params(model, groups, holders, {id(p) for p in top_level})
    replicated_ties += _reconcile_ties(sums, shared, called)
    if replicated_ties:
        metadata = {**metadata, "tied_weights_replicated": replicated_ties}
    # parameter tensors per layer: the optimizer's loops cost per tensor (planner/compute_costs.param_tensors)
    metadata = {**metadata, "param_tensors": {g.name: len(params[i]) for i, g in enumerate(groups)}}

    def per_sample(x: float) -> int:
        return int(round(x / batch))

    kinds = [_kind(model, g, list(s.patterns.values()), bool(params[i]), embedding_names)
             for i, (g, s) in enumerate(zip(groups, sums, strict=True))]
    input_bytes = retained_inputs(((c.unit, c.inputs, c.outputs) for c in rec.calls), layer_of,
                                  frozenset(i for i, k in enumerate(kinds) if k == "block"), len(groups))
    layers = []
    for i, (g, s) in enumerate(zip(groups, sums, strict=True)):
        patterns = list(s.patterns.values())
        sig = hashlib.sha1("|".join([*s.signatures, str(sum(p.numel() for p in params[i]))]).encode())
        layers.append(LayerSpec(
            name=g.name, kind=kinds[i],
            signature=sig.hexdigest()[:16],
            modules=g.units, num_params=sum(p.numel() for p in params[i]),
            param_bytes=sum(p.numel() * p.element_size() for p in params[i]),
            forward_flops=s.forward_flops / batch, backward_flops=s.backward_flops / batch,
            forward_flops_tp_sharded=s.forward_flops_tp_sharded / batch,
            bytes_read=per_sample(s.bytes_read), bytes_written=per_sample(s.bytes_written),
            input_bytes=per_sample(input_bytes[i]), saved_activation_bytes=per_sample(s.saved),
            saved_activation_bytes_tp_sharded=per_sample(s.saved_tp_sharded),
            saved_activation_bytes_attention_core=per_sample(s.saved_core),
            saved_activation_bytes_expert=min(per_sample(s.saved_expert),  # per-sample rounding kept in the total
                                              per_sample(s.saved) - per_sample(s.saved_tp_sharded)),
            saved_activation_bytes_op_sac=per_sample(s.saved_op_sac),
            saved_activation_bytes_op_sac_tp_sharded=per_sample(s.saved_op_sac_tp_sharded),
            saved_activation_bytes_op_sac_unread=per_sample(s.saved_op_sac_unread),
            saved_activation_bytes_selective=per_sample(s.saved_selective),
            saved_activation_bytes_selective_tp_sharded=per_sample(s.saved_selective_tp_sharded),
            saved_activation_bytes_selective_unread=per_sample(s.saved_selective_unread),
            boundary_bytes=per_sample(boundary_bytes[i]),
            tp_patterns=tuple(dataclasses.replace(p, allreduce_bytes_per_sample=per_sample(
                p.allreduce_bytes_per_sample), head_table_bytes_per_sample=per_sample(p.head_table_bytes_per_sample))
                for p in patterns),
            kernels_forward=s.kernels_forward.scaled(1 / batch),
            kernels_backward=s.kernels_backward.scaled(1 / batch),
            norm_param_numels=_norm_param_numels(model, g.units),
            moe=s.moe,
            batch_norm_channels=tuple(m.num_features for u in g.units for m in model.get_submodule(u).modules()
                                      if isinstance(m, nn.modules.batchnorm._BatchNorm)),
        ))
    attention = next((p for la in layers for p in la.tp_patterns if p.kind == "attention"), None)
    vocab_embedding = next((m for m in embeddings if m.num_embeddings == vocab), None)
    floating = next((p for p in model.parameters() if p.is_floating_point()), None)
    return ModelGraph(
        model_name=model_name, layers=tuple(layers),
        dtype=str(floating.dtype).removeprefix("torch.") if floating is not None else "float32",
        seq_len=seq_len, example_batch_size=batch, num_params=sum(p.numel() for p in model.parameters()),
        hidden_size=_config_int(model, _HIDDEN_ATTRS) or (vocab_embedding.embedding_dim if vocab_embedding else None),
        num_attention_heads=attention.num_heads if attention else None,
        num_kv_heads=(attention.num_kv_heads or attention.num_heads) if attention else None,
        vocab_size=vocab, shared_params=shared, capture_method=method, capture_time_s=seconds, metadata=metadata,
    )
