"""One forward pass on meta tensors that records, for every unit call, what it was given.

Each unit's `forward` is wrapped for the duration of the pass. The first call with a given signature
(module structure + input shapes) runs for real, on meta; a later call with the same signature is
not run again: it returns fresh meta tensors shaped like the first call's output. That is what makes
an 80-block model cost about as much as a 2-block one. Ops outside every unit (top-level code such as
`wte(ids) + wpe(pos)`) are measured here, forward only, and charged to the unit that ran last.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from autopar.capture.probe import ModelState, storage_key, tensor_bytes
from autopar.capture.trace import CHECKPOINT_REGION, CheckpointRegions, placeholder_values
from autopar.capture.units import Unit, call_signature
from autopar.errors import CaptureError
from cost_models.optrace import describe_op

__all__ = ["Call", "TopLevelCost", "Recording", "record"]


@dataclass(frozen=True, kw_only=True)
class Call:
    unit: str
    signature: str
    ran: bool  # False: a repeat whose output was reconstructed from the first call's shapes
    # the activation-checkpointing region the call ran in (torch.utils.checkpoint in the model's own forward:
    # its saved-tensor hooks were the innermost), numbered in order of appearance; None outside any
    region: int | None = None
    # the tensors it was handed (args and kwargs, model state excluded) as (storage key, storage bytes): what
    # full recompute's checkpoint keeps of the call (capture.layers.retained_inputs)
    inputs: tuple[tuple[int, int], ...] = ()
    outputs: tuple[int, ...] = ()  # the storage keys of the tensors it returned


@dataclass
class TopLevelCost:
    """Forward cost of code outside units, whole example batch."""

    forward_flops: float = 0.0
    bytes_read: int = 0
    bytes_written: int = 0
    saved_bytes: int = 0


@dataclass
class Recording:
    calls: list[Call] = field(default_factory=list)
    first_inputs: dict[str, tuple[str, tuple, dict]] = field(default_factory=dict)  # signature → (unit, args, kw)
    top_level: dict[str | None, TopLevelCost] = field(default_factory=dict)  # key: the unit that ran last
    node_bytes: dict[str, int] = field(default_factory=dict)  # fx path: bytes of each top-level node
    # every tensor a call was handed, held for the pass so no storage key in Call.inputs is reused (meta: no bytes)
    held: list[torch.Tensor] = field(default_factory=list)


class _TopLevelProbe(TorchDispatchMode):
    def __init__(self, state: ModelState) -> None:
        super().__init__()
        self.state = state
        self.depth = 0
        self.last_unit: str | None = None
        self.costs: dict[str | None, TopLevelCost] = {}
        self.saved: set[int] = set()
        self.keep: list[torch.Tensor] = []

    def _cost(self) -> TopLevelCost:
        return self.costs.setdefault(self.last_unit, TopLevelCost())

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth == 0:
            op = describe_op(func, args, kwargs, out)  # FlopCounterMode's formulas; a kernel's bytes
            if not op.is_view:  # views and metadata queries move no data and do no arithmetic
                cost = self._cost()
                cost.forward_flops += op.flops
                cost.bytes_read += op.bytes_read
                cost.bytes_written += op.bytes_written
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.depth > 0 or t in self.state:
            return t
        key = storage_key(t)
        if key not in self.saved:
            self.saved.add(key)
            self.keep.append(t)
            self._cost().saved_bytes += t.untyped_storage().nbytes()
        return t


def _shape_spec(out: Any) -> tuple[Any, list[Any]]:
    leaves, spec = tree_flatten(out)
    metas = [(tuple(x.shape), x.dtype, x.device, x.requires_grad) if isinstance(x, torch.Tensor) else ("v", x)
             for x in leaves]
    return spec, metas


def _rebuild(spec: Any, metas: list[Any]) -> Any:
    leaves = [m[1] if m[0] == "v" else torch.empty(m[0], dtype=m[1], device=m[2]).requires_grad_(m[3])
              for m in metas]
    return tree_unflatten(leaves, spec)


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, node_bytes: dict[str, int]) -> None:
        super().__init__(gm)
        self.node_bytes = node_bytes
        self.node: fx.Node | None = None  # the node running

    def run_node(self, n: fx.Node) -> Any:
        self.node = n
        result = super().run_node(n)
        self.node_bytes[n.name] = tensor_bytes(result)
        return result


def record(model: nn.Module, runner: Callable[..., Any] | fx.GraphModule, units: tuple[Unit, ...],
           structures: dict[str, str], example_inputs: tuple, forward_kwargs: dict[str, Any],
           state: ModelState) -> Recording:
    """Run `runner` (the model, or its unit-leaf GraphModule) once with every unit's forward wrapped."""
    rec = Recording()
    probe = _TopLevelProbe(state)
    outputs: dict[str, tuple[Any, list[Any]]] = {}
    originals: list[tuple[nn.Module, Any]] = []
    regions = CheckpointRegions(own=probe.pack)
    recorder = _Recorder(runner, rec.node_bytes) if isinstance(runner, fx.GraphModule) else None

    def handed(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple[int, int], ...]:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t not in state]
        rec.held.extend(tensors)
        return tuple(dict.fromkeys((storage_key(t), t.untyped_storage().nbytes()) for t in tensors))

    def returned(out: Any) -> tuple[int, ...]:
        tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        rec.held.extend(tensors)
        return tuple(dict.fromkeys(storage_key(t) for t in tensors))

    def region() -> int | None:
        """The checkpointing region this call runs in: as traced (the graph module runs no checkpoint), or as
        the model's own forward runs it."""
        return recorder.node.meta.get(CHECKPOINT_REGION) if recorder is not None else regions.of_current()

    def wrap(unit: Unit, module: nn.Module) -> Callable[..., Any]:
        forward = module.forward

        def recorded_forward(*args: Any, **kwargs: Any) -> Any:
            if probe.depth > 0:  # a unit used inside another unit belongs to that unit's measurement
                return forward(*args, **kwargs)
            sig = call_signature(structures[unit.name], args, kwargs)
            if sig in outputs:
                probe.last_unit = unit.name
                probe.depth += 1  # building the stand-in output is not top-level work
                try:
                    out = _rebuild(*outputs[sig])
                finally:
                    probe.depth -= 1
                rec.calls.append(Call(unit=unit.name, signature=sig, ran=False, region=region(),
                                      inputs=handed(args, kwargs), outputs=returned(out)))
                return out
            probe.depth += 1
            try:
                out = forward(*args, **kwargs)
            except CaptureError:
                raise
            except Exception as e:
                raise CaptureError(
                    f"running module {unit.name!r} ({type(module).__name__}) on meta tensors failed: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}. Capture runs the model "
                    "on the meta device; code that reads tensor values (.item(), .tolist(), printing) cannot "
                    "run there. Move that code out of forward or make it depend on shapes only."
                ) from e
            finally:
                probe.depth -= 1
            outputs[sig] = _shape_spec(out)
            rec.calls.append(Call(unit=unit.name, signature=sig, ran=True, region=region(),
                                  inputs=handed(args, kwargs), outputs=returned(out)))
            rec.first_inputs[sig] = (unit.name, args, kwargs)
            probe.last_unit = unit.name
            return out

        return recorded_forward

    for unit in units:
        module = model.get_submodule(unit.name)
        originals.append((module, module.__dict__.get("forward")))
        module.forward = wrap(unit, module)
    try:
        with torch.enable_grad(), probe, saved_tensors_hooks(probe.pack, lambda t: t):
            if recorder is not None:
                recorder.run(*placeholder_values(runner, model, example_inputs,
                                                                          forward_kwargs))
            else:
                runner(*example_inputs, **forward_kwargs)
    finally:
        for module, previous in originals:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
    rec.top_level = probe.costs
    return rec
