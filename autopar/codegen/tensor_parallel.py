"""Tensor (and sequence) parallelism from the `TPPattern`s of a `ModelGraph` (Shoeybi et al. 2019;
Korthikanti et al. 2022 for sequence parallelism), on DTensor's `parallelize_module` styles.

Per pattern, with tp ranks:
- "mlp" / "attention": `column` linears split their output features (heads, for attention) and the
  `row` linear its input features. The pattern's input is turned into a DTensor once, at the
  module that owns the pattern (the common parent of its linears), so the column linears share one
  input: forward needs one all-reduce (the row output) and backward one (the input gradient).
  With sequence parallelism the input is all-gathered along the tokens (dim -2: the sequence of
  [b, s, h], or the flattened tokens [b·s, h] an MoE block hands its shared expert) and the row output
  reduce-scattered back to token shards instead; norms run on sequence shards. A layer that must see the
  whole sequence (capture.graph.SequenceSpan.whole_layers) is all-gathered at its input and split again
  after it, its patterns as without sequence parallelism.
- "embedding": vocabulary-parallel embedding (one all-reduce forward); with sequence parallelism
  the embedding layer's output is then split along the sequence.
- "lm_head": vocabulary-parallel output projection; the logits stay sharded over the vocabulary
  for `loss.vocab_parallel_cross_entropy`.
An embedding or LM head whose vocabulary tp does not divide (TPPattern.splits) is left whole on every rank
(capture.vocab_split): the loss then runs on full logits, and under sequence parallelism the span gathers
the hidden states before such a head (`sequence_span(graph, tp)`).
Attributes that hold a head count on the attention module (`n_heads`, `num_key_value_heads`, ...)
are divided by tp, so code that views `(b, s, self.n_heads, head_dim)` sees the local head count.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopar.capture.graph import LayerSpec, TPPattern
from autopar.capture.sequence import SequenceSpan, sequence_span
from autopar.capture.units import common_parent, is_norm
from autopar.codegen.float8 import tp_style
from autopar.codegen.head_bias import HEAD_AXIS, cut_head_outputs, slice_rank_blocks
from autopar.errors import PlanMismatchError

__all__ = ["HEAD_COUNT_ATTRS", "HEAD_WIDTH_ATTRS", "SequenceSpan", "sequence_span", "apply_tensor_parallel", "is_norm",
           "align_grad_placements"]

# Attribute names that models use for (local) head counts; rewritten to count / tp.
HEAD_COUNT_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads", "n_local_heads",
                    "num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_local_kv_heads")
# The tokens of a pattern's input and row output under sequence parallelism: the dim before the features,
# the sequence of [b, s, h] or the flattened tokens of [b·s, h] (DTensor normalises the negative dim).
TOKENS = Shard(-2)
# Attribute names for the concatenated width of the heads (BART-style attention reshapes with them).
HEAD_WIDTH_ATTRS = ("embed_dim", "all_head_size", "inner_dim", "kv_dim")


def _first_tensor_slot(args: tuple, kwargs: dict) -> tuple[str, object]:
    if args and isinstance(args[0], torch.Tensor):
        return "arg", 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "kw", "hidden_states"
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            return "kw", key
    raise PlanMismatchError("a tensor-parallel module was called without a tensor input; "
                            "the pattern's parent module must take the hidden states as its first input")


def _shared_input_hook(tp_mesh: DeviceMesh, sequence_parallel: bool, name: str, features: int):
    """Pre-hook: local activation → one replicated DTensor for all column linears of a pattern.

    An input that is not the columns' (`features` wide in its last dim: a ConvNeXt block's channels-first
    image, which the block convolves and permutes before its pointwise MLP) is left as it is: each column
    linear then converts its own input (one more all-reduce of the input gradient per column)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        kind, slot = _first_tensor_slot(args, kwargs)
        x = args[slot] if kind == "arg" else kwargs[slot]
        if isinstance(x, DTensor):
            return None
        if x.dim() < 2 or x.size(-1) != features:
            if sequence_parallel:
                raise PlanMismatchError(
                    f"module {name!r} ({type(module).__name__}) takes {tuple(x.shape)}, not the {features} features "
                    "its tensor-parallel linears read, so its sequence shard cannot be gathered there; re-plan with "
                    "sequence_parallel=False")
            return None
        if sequence_parallel:  # this rank's tokens: the sequence of [b, s, h] or the flattened [b·s, h]
            x = DTensor.from_local(x, tp_mesh, [TOKENS], run_check=False).redistribute(tp_mesh, [Replicate()])
        else:
            x = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
        if kind == "arg":
            return (x, *args[1:]), kwargs
        return args, {**kwargs, slot: x}

    return hook


def _gather(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence shard → the full sequence (backward: keep this rank's shard of the gradient)."""
    return DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()]).to_local()


def _split(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """The full sequence → this rank's shard (backward: all-gather the gradient)."""
    return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()


def _on_first_tensor(out: object, fn) -> object:
    """`out` with fn applied to its tensor, or to the first tensor of a tuple (a layer returning extras)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return (fn(out[0]), *out[1:])
    raise PlanMismatchError(f"a layer returned {type(out).__name__} under sequence parallelism; it must return the "
                            "hidden states (a tensor, or a tuple that starts with them). Re-plan with "
                            "sequence_parallel=False")


def _gather_sequence_hook(tp_mesh: DeviceMesh):
    """Forward hook: sequence-shard local output → full sequence (backward: keep this rank's shard)."""

    def hook(module: nn.Module, args: tuple, out: object) -> object:
        return _on_first_tensor(out, lambda t: _gather(t, tp_mesh))

    return hook


def _whole_sequence_hooks(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """A layer that must see the whole sequence inside the sequence-parallel span: its input is gathered
    from the ranks' shards, its output split again (backward: the reverse)."""

    def gather_input(mod: nn.Module, args: tuple, kwargs: dict):
        kind, slot = _first_tensor_slot(args, kwargs)
        if kind == "arg":
            return (_gather(args[slot], tp_mesh), *args[1:]), kwargs
        return args, {**kwargs, slot: _gather(kwargs[slot], tp_mesh)}

    module.register_forward_pre_hook(gather_input, with_kwargs=True, prepend=True)
    module.register_forward_hook(lambda mod, args, out: _on_first_tensor(out, lambda t: _split(t, tp_mesh)))


def _scatter_input_hook(tp_mesh: DeviceMesh):
    """Pre-hook: the full-sequence hidden states entering the first sharded layer → this rank's sequence
    shard (backward: all-gather)."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        kind, slot = _first_tensor_slot(args, kwargs)
        x = args[slot] if kind == "arg" else kwargs[slot]
        if isinstance(x, DTensor):
            return None
        x = _split(x, tp_mesh)
        if kind == "arg":
            return (x, *args[1:]), kwargs
        return args, {**kwargs, slot: x}

    return hook


def _rewrite_head_counts(owner: nn.Module, pattern: TPPattern, tp: int) -> None:
    """On the pattern's owner and the modules under it (BERT keeps its head count on the attention's
    `self` child), except the sharded linears themselves."""
    counts = {pattern.num_heads, pattern.num_kv_heads or pattern.num_heads}
    widths = {c * pattern.head_dim for c in counts} if pattern.head_dim else set()
    for module in owner.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        for attr in HEAD_COUNT_ATTRS:
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value in counts:
                setattr(module, attr, value // tp)
        for attr in HEAD_WIDTH_ATTRS:  # the heads' concatenated width, used to reshape their output
            value = getattr(module, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value in widths:
                setattr(module, attr, value // tp)


def _called_parent(module: nn.Module, name: str) -> str:
    """`name`, or its nearest ancestor that is called: an `nn.ModuleDict`/`nn.ModuleList` holding the
    column linears has no forward of its own, so a hook on it would never see their shared input."""
    while name and isinstance(module.get_submodule(name), (nn.ModuleDict, nn.ModuleList)):
        name = name.rpartition(".")[0]
    return name


def _explain_failures(name: str, sequence_parallel: bool = False):
    """Wraps a sharded module's forward: an error inside it (code that sizes a tensor with a width the
    rewrite did not know, or, under sequence parallelism, with the length of its own sequence shard) is
    reported as what it is, not as a bare shape error from deep in torch."""

    def wrap(forward):
        @functools.wraps(forward)
        def run(*args, **kwargs):
            try:
                return forward(*args, **kwargs)
            except PlanMismatchError:
                raise
            except RuntimeError as e:
                if sequence_parallel:  # the layer's input is this rank's share of the tokens
                    raise PlanMismatchError(
                        f"module {name!r} failed under sequence parallelism ({str(e).splitlines()[0][:200]}): its "
                        "code likely sizes a tensor from the length of its input, which is one rank's share of the "
                        "sequence there (positions or rotary tables built from x.size(1)) while its attention runs "
                        "on the whole sequence. Re-plan with PlannerOptions(sequence_parallel=False) (sp=0 in a "
                        "--config layout)") from e
                raise PlanMismatchError(
                    f"module {name!r} failed under tensor parallelism ({str(e).splitlines()[0][:200]}): its code "
                    "likely sizes a tensor with the full head count or width, which autopar did not rewrite for "
                    "one rank's heads. Re-plan with tp=1 for this model") from e
        return run

    return wrap


def _check_divisible(layer: LayerSpec, pattern: TPPattern, tp: int) -> None:
    if not pattern.max_degree_ok(tp):
        raise PlanMismatchError(
            f"layer {layer.name}: tp={tp} does not divide its {pattern.kind} pattern (heads={pattern.num_heads}, "
            f"kv heads={pattern.num_kv_heads}); re-plan with a tp that divides them"
        )


def _own_output(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Forward hook after a row-parallel module: its local output is a view made inside DTensor's
    to_local, which autograd forbids modifying in place; models that add to it in place
    (`hidden += residual`, Falcon) get a tensor of their own (one copy of the activation)."""
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor) and out._is_view():
        return out.clone()
    return None


def _width_check(name: str, width: int):
    """Pre-hook: a module inside a pattern that expects full-width inputs must not get a rank's slice."""

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        x = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        if x is not None and not isinstance(x, DTensor) and x.is_floating_point() and x.dim() \
                and x.size(-1) != width:
            raise PlanMismatchError(
                f"module {name!r} ({type(module).__name__}) normalises or projects {width} features, but under "
                f"tensor parallelism it receives one rank's {x.size(-1)}: it mixes all heads (or all hidden "
                "units) and cannot run on a shard. Re-plan with tp=1 for this model")
        return None

    return hook


def _replicate_inner_params(module: nn.Module, owner: str, pattern: TPPattern, tp_mesh: DeviceMesh, *,
                            tight: bool, sharded: frozenset[str]) -> None:
    """Parameters inside a pattern that are not its projections.

    Modules between the column and row linears see only this rank's heads or hidden units, so their
    weights' gradients are partial sums: per-head norms (Qwen3's q/k norms, a weight of head_dim
    elements) and, inside an attention or MLP sub-module, element-wise modules with scalar
    parameters (a learned activation). They become replicated DTensors over local inputs declared
    sharded on dim 0 (row-wise ops: any dim but the last is a valid split), so DTensor sums their
    gradients over the TP group. Any other such module must see full-width inputs (a norm of the
    block's input, when the projections sit in the block itself): checked on every call, refused
    when it would run on a shard. A module of head width or scalar parameters that cannot be placed
    is refused outright. The projections of the layer's other patterns (`sharded`: an MLP in the same block as
    the attention) are theirs to place, whichever pattern comes first. Parameters indexed by all heads
    (position-bias tables and MLPs, per-head logit scales) stay whole: their outputs are cut to a rank's heads
    where they meet its scores (autopar.codegen.head_bias).
    """
    projections = {*pattern.column, *pattern.row, *sharded}
    head_dim = pattern.head_dim if pattern.kind == "attention" else None
    heads = pattern.num_heads if pattern.kind == "attention" else None
    for name, sub in module.get_submodule(owner).named_modules(prefix=owner):
        if name in projections or any(name.startswith(p + ".") for p in projections):
            continue
        own = [p for p in sub.parameters(recurse=False) if not isinstance(p, DTensor)]
        if not own or heads and any(heads in p.shape for p in own):
            continue
        width = own[0].size(-1) if own[0].dim() else 1
        features = name != owner and own[0].dim() <= 2  # a convolution's last dim is its kernel, not features;
        # the owner's own parameters act wherever its code applies them, not on its input
        per_head = head_dim and width == head_dim and is_norm(sub)
        scalar = all(p.numel() == 1 for p in own) and tight and name != owner
        if per_head or scalar:
            parallelize_module(module, tp_mesh, {name: SequenceParallel(sequence_dim=0, use_local_output=True)})
        elif (head_dim and width == head_dim) or all(p.numel() == 1 for p in own):
            raise PlanMismatchError(
                f"module {name!r} ({type(sub).__name__}) holds parameters inside the tensor-parallel region of "
                f"{owner!r} that autopar cannot place (per-head or scalar, not in an attention or MLP "
                "sub-module); re-plan with tp=1 for this model")
        elif features:
            sub.register_forward_pre_hook(_width_check(name, width), with_kwargs=True)


def _layer_module(module: nn.Module, layer: LayerSpec) -> nn.Module:
    try:
        return module.get_submodule(layer.name)
    except AttributeError:
        return module.get_submodule(layer.modules[-1])


def apply_tensor_parallel(module: nn.Module, layers: Iterable[LayerSpec], tp_mesh: DeviceMesh, *,
                          sequence_parallel: SequenceSpan | None, logits_as_dtensor: bool = False) -> None:
    """Shard, in place, the TP patterns of `layers` that live in `module` (a model or one pipeline stage).

    logits_as_dtensor: a vocab-parallel head returns its logits as a DTensor sharded on the vocabulary, for a
    model that computes its own loss: its code then sees the logits' global shape (`view(-1, vocab_size)`,
    label shifting) and its cross-entropy runs vocab-parallel under DTensor's loss_parallel."""
    tp = tp_mesh.size()
    span = sequence_parallel
    for layer in layers:
        sp = span is not None and span.runs_sharded(layer.name)  # this layer's stream is sequence shards
        for pattern in layer.tp_patterns:
            _check_divisible(layer, pattern, tp)
            if not pattern.splits(tp):  # a vocabulary tp does not divide: kept whole on every rank
                continue
            if pattern.kind in ("mlp", "attention"):
                owner = common_parent((*pattern.column, *pattern.row))
                # The pattern's input becomes one DTensor at the columns' parent when that is a sub-module
                # (attention, MLP, BERT's attention.self) that feeds it straight to them; when the linears
                # sit in the block itself, whose residuals and norms run on plain tensors, each column
                # linear converts its own input (one more all-reduce of the input gradient per column).
                inlet = _called_parent(module, common_parent(pattern.column))
                shared_input = inlet not in layer.modules and inlet != layer.name
                col_in = Shard(1) if sp else Replicate()
                # a float8 linear gets torchao's float8 style (tp_style), which casts its input before gathering
                plan: dict[str, object] = {
                    name: tp_style(module.get_submodule(name), "colwise", **({} if shared_input else
                                                                               {"input_layouts": col_in}))
                    for name in pattern.column}
                plan.update({name: tp_style(module.get_submodule(name), "rowwise",
                                            output_layouts=TOKENS if sp else Replicate())
                             for name in pattern.row})
                parallelize_module(module, tp_mesh, plan)
                for name in pattern.row:
                    module.get_submodule(name).register_forward_hook(_own_output)
                owner_module = module.get_submodule(owner)
                _replicate_inner_params(module, owner, pattern, tp_mesh, tight=shared_input,
                                        sharded=frozenset(n for p in layer.tp_patterns for n in (*p.column, *p.row)))
                if shared_input:
                    first = module.get_submodule(pattern.column[0])
                    features = getattr(first, "in_features", None) or first.weight.shape[-1]
                    module.get_submodule(inlet).register_forward_pre_hook(
                        _shared_input_hook(tp_mesh, sp, inlet, features), with_kwargs=True)
                if pattern.kind == "attention":
                    _rewrite_head_counts(owner_module, pattern, tp)
                    cut_head_outputs(owner_module, {module.get_submodule(n) for n in (*pattern.column, *pattern.row)},
                                     tp_mesh, pattern.num_heads)
                    owner_module.forward = slice_rank_blocks(owner_module.forward, tp_mesh, axis=HEAD_AXIS,
                                                             whole=pattern.num_heads)
                owner_module.forward = _explain_failures(owner, sp)(owner_module.forward)
            elif pattern.kind == "embedding":
                parallelize_module(module, tp_mesh, {name: RowwiseParallel(input_layouts=Replicate(),
                                                                          output_layouts=Replicate())
                                                     for name in pattern.column})
                for name in pattern.column:
                    module.get_submodule(name).register_forward_hook(_own_output)
            elif pattern.kind == "lm_head":
                shards_in = span is not None and span.gather_after is None  # the span was made at this tp
                parallelize_module(module, tp_mesh, {name: ColwiseParallel(
                    input_layouts=Shard(1) if shards_in else Replicate(), output_layouts=Shard(-1),
                    use_local_output=not logits_as_dtensor) for name in pattern.column})
                if pattern.vocab_size:  # a per-vocabulary bias the model adds to the logits (BART's
                    # final_logits_bias) meets this rank's share of them (or their DTensor, for its own loss)
                    module.forward = slice_rank_blocks(module.forward, tp_mesh, axis=-1, whole=pattern.vocab_size)
        if span is not None and layer.name in span.sharded_layers:
            for name, sub in _layer_module(module, layer).named_modules(prefix=layer.name):
                if is_norm(sub) and any(not isinstance(p, DTensor) for p in sub.parameters(recurse=False)):
                    parallelize_module(module, tp_mesh, {name: SequenceParallel(use_local_output=True)})
        if span is not None and span.sharded_layers and layer.name == span.sharded_layers[0]:
            _layer_module(module, layer).register_forward_pre_hook(_scatter_input_hook(tp_mesh), with_kwargs=True,
                                                                   prepend=True)
        if span is not None and layer.name in span.whole_layers:
            _whole_sequence_hooks(_layer_module(module, layer), tp_mesh)
        # after the layer's own hooks, so this sees its final (local) output
        if span is not None and layer.name == span.gather_after:
            _layer_module(module, layer).register_forward_hook(_gather_sequence_hook(tp_mesh))


@torch.no_grad()
def align_grad_placements(params: Iterable[nn.Parameter]) -> None:
    """Give each DTensor gradient its parameter's placements: a vocab-parallel embedding's backward leaves a
    replicated (full) gradient for its row-sharded weight; keeping only this rank's rows (a local slice, no
    communication) stores, reduces and steps the shard the plan prices, not the whole table."""
    for p in params:
        g = p.grad  # a main gradient (autopar.codegen.dist_optimizer) already has its parameter's placements
        if isinstance(p, DTensor) and isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
