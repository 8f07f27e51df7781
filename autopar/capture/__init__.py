"""`capture(model, example_inputs)`: a model as ordered, measured layers (`ModelGraph`), on meta tensors.

Stages, each in its own module:
  units.discover_units   which modules are indivisible pieces of layers (blocks, embedding, head, ...)
  trace.trace_model      torch.fx.symbolic_trace (units as leaves), else torch.export(strict=False)
  record.record          one meta forward pass; repeated blocks are run once and replayed by shape
  probe.measure_call     per distinct unit call: FLOPs, traffic, saved activations, TP structure
  layers                 units → layers; liveness of values across layer boundaries
  assemble               LayerSpec / ModelGraph, per sample

Attention is measured as the kernels GPU training runs (`kernels.py`): with SDPA, the flash kernel
keeps q, k, v, its output and a fp32 log-sum-exp [b, heads, s] instead of Korthikanti's
5·a·s²·b bytes of scores, softmax and dropout mask, so a GPT block saves about 34·s·b·h bytes plus
4·a·s·b; eager attention (explicit softmax) saves s·b·h·(34 + 5as/h).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.checkpoint import CheckpointError

from autopar.capture.assemble import assemble
from autopar.capture.graph import LayerSpec, ModelGraph, TPPattern
from autopar.capture.layers import group_layers, liveness
from autopar.capture.loss_mode import loss_mode
from autopar.capture.meta import on_meta, swap_tensors, to_meta
from autopar.capture.moe import grouped_mm_any_dtype
from autopar.capture.probe import ModelState, measure_call
from autopar.capture.record import record
from autopar.capture.targets import training_forward_kwargs, with_example_targets
from autopar.capture.trace import flow_from_export, flow_from_fx, trace_model
from autopar.capture.units import discover_units, structure_signature
from autopar.capture.values import MAX_TRACKED_ELEMENTS, ShapeValues
from autopar.errors import CaptureError

__all__ = ["capture", "ModelGraph", "LayerSpec", "TPPattern"]


def _normalise_inputs(example_inputs: Any, example_kwargs: Any) -> tuple[tuple, dict[str, Any]]:
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if example_inputs is None:
        example_inputs = ()
    if not isinstance(example_inputs, (tuple, list)):
        raise CaptureError(
            f"example_inputs is a {type(example_inputs).__name__}; pass a tuple of the positional inputs of "
            "model.forward, e.g. (input_ids,) or (pixel_values, None), and keyword inputs as "
            "example_kwargs={'attention_mask': mask}")
    if example_kwargs is None:
        example_kwargs = {}
    if not isinstance(example_kwargs, dict) or not all(isinstance(k, str) for k in example_kwargs):
        raise CaptureError(f"example_kwargs is a {type(example_kwargs).__name__}; pass a dict of model.forward's "
                           "keyword inputs, e.g. {'decoder_input_ids': ids}")
    return tuple(example_inputs), dict(example_kwargs)


def _first_tensor(inputs: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    tensors = [t for t in tree_leaves((inputs, kwargs)) if isinstance(t, torch.Tensor) and t.dim() >= 1]
    if not tensors:
        raise CaptureError("example_inputs and example_kwargs hold no tensor; capture needs one whose dim 0 is "
                           "the batch")
    return tensors[0]


def _sequence_length(first: torch.Tensor, rec: Any, units: tuple[Any, ...]) -> int | None:
    """Tokens per sample: dim 1 of token ids; for other inputs (images), dim 1 of the hidden states
    [batch, tokens, width] that the first block of a stack reads (patches of a vision transformer, windows'
    tokens of Swin), or None when those are not a sequence (a conv net's [batch, channels, h, w])."""
    if not first.is_floating_point():
        return int(first.shape[1]) if first.dim() >= 2 else None
    stacked = {u.name for u in units if u.in_container}
    for call in rec.calls:
        if call.unit in stacked and call.signature in rec.first_inputs:
            _, args, kwargs = rec.first_inputs[call.signature]
            hidden = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            return int(hidden[0].shape[1]) if hidden and hidden[0].dim() == 3 else None
    return None


def capture(model: nn.Module, example_inputs: Any = (), example_kwargs: dict[str, Any] | None = None, *,
            own_loss: bool = False, target_arg: str | None = None) -> ModelGraph:
    """Trace and measure `model` called as `model(*example_inputs, **example_kwargs)`, in training mode.

    example_inputs: a tensor or a tuple of positional inputs (None where the model takes None);
    example_kwargs: keyword inputs (an attention mask, decoder ids). Tensors may nest in tuples and dicts.
    own_loss: capture it as it trains without a `loss_fn`: a forward that takes its targets (`targets`,
    `labels`, or `target_arg`) gets example targets (token ids shaped like the first input, unless
    example_kwargs holds them), so the loss it computes is priced as the one that trains.
    Runs on meta tensors whatever the model's device (real weights are swapped for meta stand-ins and
    restored), so no weight is allocated. Numbers are per sample: dim 0 of the first tensor is the batch.
    """
    if not isinstance(model, nn.Module):
        raise CaptureError(f"capture() needs an nn.Module, got {type(model).__name__}")
    inputs, forward_kwargs = _normalise_inputs(example_inputs, example_kwargs)
    given = set(forward_kwargs)
    forward_kwargs, target_name = with_example_targets(model, inputs, forward_kwargs, own_loss=own_loss,
                                                       target_arg=target_arg)
    mode = loss_mode(target_name)
    if target_name is not None and target_name not in given:
        try:
            return dataclasses.replace(_capture(model, inputs, forward_kwargs), loss_mode=mode)
        except Exception as e:  # the example targets may not fit the model: say so, and how to give real ones
            shape = list(forward_kwargs[target_name].shape)
            first_line = str(e).splitlines()[0] if str(e) else ""
            raise CaptureError(
                f"{type(e).__name__}: {first_line}\n(captured as {type(model).__name__} trains without a loss_fn, "
                f"on its own loss, with example "
                f"{target_name}= token ids of shape {shape}, like its first input; if its targets are shaped "
                f"otherwise (class labels, a decoder's tokens) put them in example_kwargs={{{target_name!r}: ...}}, "
                "or pass loss_fn= to plan/estimate/parallelize (CLI: --external-loss))") from e
    return dataclasses.replace(_capture(model, inputs, forward_kwargs), loss_mode=mode)


def _measure(model: nn.Module, runner: Any, units: tuple[Any, ...], structures: dict[str, str], inputs: tuple,
             kwargs: dict[str, Any], *, known: dict[torch.Tensor, torch.Tensor],
             fake_fallback: bool) -> tuple[Any, dict[str, Any]]:
    """The recording pass and each distinct unit call's measurement, on meta tensors.

    Small values computed from shapes and from the example inputs given with data (`known`: meta
    input → its value) are followed (`ShapeValues`), so a model that reads one (Hugging
    Face's packed-sequence check on its positions) takes the branch it takes on real data. Models that
    needed export may also read values that depend on data; for them, a pass that fails is run again on
    fake tensors, which such models recognise and answer without reading (at the price of the branch
    they take when tracing, an explicit attention mask for instance).
    """
    def run(fake: FakeTensorMode | None) -> tuple[Any, dict[str, Any]]:
        with fake or nullcontext(), swap_tensors(model, fake.from_tensor) if fake else nullcontext(), \
                grouped_mm_any_dtype(), ShapeValues({} if fake else known):
            args, kw = (tree_map_only(torch.Tensor, fake.from_tensor, (inputs, kwargs)) if fake
                        else (inputs, kwargs))
            state = ModelState(model)
            rec = record(model, runner, units, structures, args, kw, state)
            return rec, {sig: measure_call(model.get_submodule(name), a, k, state)
                         for sig, (name, a, k) in rec.first_inputs.items()}

    if not fake_fallback:
        return run(None)
    try:
        return run(None)
    except Exception:  # a value read that only data can answer: measure on fake tensors instead
        return run(FakeTensorMode(allow_non_fake_inputs=True))


def _capture(model: nn.Module, inputs: tuple, forward_kwargs: dict[str, Any]) -> ModelGraph:
    start = time.perf_counter()
    first = _first_tensor(inputs, forward_kwargs)
    batch = int(first.shape[0])
    for name, value in training_forward_kwargs(model).items():
        forward_kwargs.setdefault(name, value)
    units = discover_units(model)
    modes = {m: m.training for m in model.modules()}
    if not all(modes.values()):
        model.train()
    # Capture allocates many small, short-lived objects and no cycles worth collecting; pausing the
    # cyclic collector keeps its full passes over a 100-block module tree out of the timing.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with on_meta(model), grouped_mm_any_dtype():
            given = (inputs, forward_kwargs)
            inputs, kwargs = to_meta(inputs), to_meta(forward_kwargs)
            known = {meta: real.detach().cpu()
                     for real, meta in zip(tree_leaves(given), tree_leaves((inputs, kwargs)), strict=True)
                     if type(real) is torch.Tensor and real.device.type != "meta"
                     and real.numel() <= MAX_TRACKED_ELEMENTS}
            structures = {u.name: structure_signature(model.get_submodule(u.name)) for u in units}
            traced = trace_model(model, inputs, kwargs, units, structures)
            single = len(units) == 1 and not units[0].name
            runner = traced.graph_module if traced.graph_module is not None and not single else model
            try:
                rec, stats = _measure(model, runner, units, structures, inputs, kwargs, known=known,
                                      fake_fallback=traced.exported is not None)
            except CheckpointError as e:
                raise CaptureError(
                    f"{type(model).__name__} checkpoints its own layers (torch.utils.checkpoint inside a module's "
                    f"forward, e.g. transformers' gradient checkpointing), whose replay capture cannot measure "
                    f"({str(e).splitlines()[0]}). Turn it off before capturing and parallelizing "
                    "(transformers: model.activation_checkpointing_disable(); older: "
                    "gradient_checkpointing_disable()): autopar prices and applies activation recompute itself "
                    "(PlannerOptions(recompute=...), CLI --recompute)") from e
            groups = group_layers(model, units, [(call.unit, call.region) for call in rec.calls])
            unit_names = frozenset(u.name for u in units)
            flow = (flow_from_fx(traced.graph_module, rec.node_bytes, unit_names) if runner is not model
                    else flow_from_export(traced.exported, unit_names) if traced.exported is not None else [])
            layer_of = {u: i for i, g in enumerate(groups) for u in g.units}
            param_units = frozenset(u.name for u in units
                                    if any(True for _ in model.get_submodule(u.name).parameters()))
            boundary_bytes = liveness(flow, layer_of, len(groups), param_units)
            return assemble(
                model=model, model_name=getattr(model, "zoo_name", None) or type(model).__name__,
                groups=groups, rec=rec, stats=stats, boundary_bytes=boundary_bytes,
                batch=batch, seq_len=_sequence_length(first, rec, units), method=traced.method,
                seconds=time.perf_counter() - start,
                metadata={"distinct_calls_measured": len(stats), "unit_calls": len(rec.calls),
                          "torch_version": torch.__version__},
            )
    finally:
        if gc_was_enabled:
            gc.enable()
        if not all(modes.values()):
            for m, training in modes.items():
                m.training = training
