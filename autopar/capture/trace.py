"""Turn a model into a graph: `torch.fx.symbolic_trace` first, `torch.export.export(strict=False)` as fallback.

The symbolic trace keeps every unit (see `units.py`) as one `call_module` node, so the top-level graph
has one node per block whatever the depth, and traces each *distinct* unit once on its own to prove
it is traceable. Models whose Python code fx cannot follow (Hugging Face models build masks and caches
from tensor metadata) go through `torch.export` on fake tensors, whose nodes carry the module path
they came from (`nn_module_stack`). Either way the result is a `FlowGraph`: top-level values in
execution order, each with its size, the unit that produced it and who uses it — the input of the
liveness analysis in `layers.py`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from autopar.capture.probe import tensor_bytes
from autopar.capture.units import Unit
from autopar.errors import CaptureError

__all__ = ["FlowNode", "Traced", "trace_model", "placeholder_values", "flow_from_fx", "flow_from_export"]

_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclass(frozen=True, kw_only=True)
class FlowNode:
    """One top-level value: `unit` produced it (None: top-level code or a model input), `users` index nodes."""

    name: str
    nbytes: int  # whole example batch
    unit: str | None
    is_input: bool
    users: tuple[int, ...]
    is_output: bool = False


@dataclass(frozen=True, kw_only=True)
class Traced:
    method: str  # "symbolic_trace" or "export"
    graph_module: fx.GraphModule | None  # symbolic_trace: the top-level graph, units as call_module
    exported: Any = None  # export: the ExportedProgram


CHECKPOINT_REGION = "autopar_checkpoint_region"  # fx node meta: the region a unit call ran in (or None)


class CheckpointRegions:
    """Numbers the activation-checkpointing regions of the model's own forward in order of appearance.

    torch.utils.checkpoint (non-reentrant) runs the checkpointed function under saved-tensor hooks of its
    own, one pair per call, and fx traces straight through it; so a call runs inside a region exactly when
    the innermost saved-tensor hooks are not `own`: those the caller installed itself (by default, whatever
    is installed when the regions start being numbered: capture called under `save_on_cpu` stays outside)."""

    def __init__(self, own: Any = None) -> None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.own = own if own is not None else (top[0] if top is not None else None)
        self._ids: dict[int, tuple[int, Any]] = {}  # id of a region's pack hook → (number, the hook, kept alive)

    def of_current(self) -> int | None:
        top = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if top is None or top[0] == self.own:
            return None
        return self._ids.setdefault(id(top[0]), (len(self._ids), top[0]))[0]


class _UnitTracer(fx.Tracer):
    """fx tracer that keeps `leaves` opaque and remembers the innermost module a failure happened in."""

    def __init__(self, leaves: frozenset[str], prefix: str = "") -> None:
        super().__init__()
        self.leaves = leaves
        self.prefix = prefix
        self.failed_in: str | None = None
        self.regions = CheckpointRegions()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.prefix + self.path_of_module(m)
            raise
        if isinstance(out, fx.Proxy) and out.node.op == "call_module":
            out.node.meta[CHECKPOINT_REGION] = self.regions.of_current()
        return out


class _FxFailure(Exception):
    def __init__(self, module: str, cause: BaseException) -> None:
        super().__init__(module)
        self.module = module
        self.cause = cause


def _user_frame(exc: BaseException) -> str:
    """'file:line: code' of the innermost frame outside torch, where the failing construct is."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_TORCH_DIR)]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno}: `{(f.line or '').strip()}`"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _unbound_defaults(model: nn.Module, example_inputs: tuple, forward_kwargs: dict[str, Any]) -> dict[str, Any]:
    """forward's parameters the call leaves at their defaults (`targets=None`): constants of this call, so a
    branch on them (`if targets is not None`) is traced as the call takes it, not as if a tensor came."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind_partial(*example_inputs, **forward_kwargs).arguments
    except (TypeError, ValueError):
        return {}
    return {name: p.default for name, p in signature.parameters.items()
            if name not in bound and p.default is not inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _symbolic_trace(model: nn.Module, units: tuple[Unit, ...], example_inputs: tuple, forward_kwargs: dict[str, Any],
                    structures: dict[str, str]) -> fx.GraphModule:
    leaves = frozenset(u.name for u in units if u.name)
    tracer = _UnitTracer(leaves)
    # Python values (flags such as use_cache=False) are baked in; tensors stay graph inputs.
    constants = {k: v for k, v in forward_kwargs.items() if not isinstance(v, torch.Tensor)}
    constants.update(_unbound_defaults(model, example_inputs, forward_kwargs))
    try:
        graph = tracer.trace(model, concrete_args=constants or None)
        gm = fx.GraphModule(model, graph, type(model).__name__)  # its code is compiled here (keyword-only
    except Exception as e:                                       # arguments fail here, see torch.fx)
        raise _FxFailure(tracer.failed_in or "", e) from e
    seen: set[str] = set()
    for unit in units:  # each distinct unit once: proves the whole model is symbolically traceable
        if not unit.name:
            continue
        sig = structures[unit.name]
        if sig in seen:
            continue
        seen.add(sig)
        unit_tracer = _UnitTracer(frozenset(), prefix=f"{unit.name}.")
        try:
            unit_tracer.trace(model.get_submodule(unit.name))
        except Exception as e:
            failed = unit_tracer.failed_in.rstrip(".") if unit_tracer.failed_in else unit.name
            raise _FxFailure(failed, e) from e
    return gm


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence what torch.export prints while it tries (graph dumps, symbolic-shape warnings): a failure
    becomes one CaptureError that says what to change, and a success needs no commentary."""
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logging.disable(previous)


def trace_model(model: nn.Module, example_inputs: tuple, forward_kwargs: dict[str, Any],
                units: tuple[Unit, ...], structures: dict[str, str]) -> Traced:
    """Symbolic trace, else export; `CaptureError` naming the module and construct when both fail.

    `structures`: `structure_signature` of every unit, so that each distinct unit is traced once.
    """
    try:
        return Traced(method="symbolic_trace",
                      graph_module=_symbolic_trace(model, units, example_inputs, forward_kwargs, structures))
    except _FxFailure as fx_failure:
        try:
            with _quiet():
                exported = torch.export.export(model, tuple(example_inputs), dict(forward_kwargs), strict=False)
        except Exception as export_error:
            where = fx_failure.module or f"{type(model).__name__} (the model's own forward)"
            raise CaptureError(
                f"cannot capture {type(model).__name__}: module {where!r} is not traceable. "
                f"torch.fx.symbolic_trace failed with {_first_line(fx_failure.cause)}"
                f"{_user_frame(fx_failure.cause)}; torch.export.export(strict=False) then failed with "
                f"{_first_line(export_error)}{_user_frame(export_error)}. Fix: replace Python control flow "
                "that depends on tensor values (`if x.sum() > 0`, `.item()`, data-dependent shapes) in that "
                "module by tensor ops (torch.where, masking) or torch.cond, or pass the deciding value as a "
                "plain Python argument (forward_kwargs) so tracing sees a constant."
            ) from export_error
        return Traced(method="export", graph_module=None, exported=exported)


def placeholder_values(gm: fx.GraphModule, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
    """The positional arguments of `gm` for a call `model(*args, **kwargs)` (defaults where not given)."""
    bound = inspect.signature(model.forward).bind_partial(*args, **kwargs).arguments
    values = []
    for node in gm.graph.find_nodes(op="placeholder"):
        name = node.target.lstrip("*")
        values.append(bound[name] if name in bound else (node.args[0] if node.args else None))
    return values


def flow_from_fx(gm: fx.GraphModule, node_bytes: dict[str, int], unit_names: frozenset[str]) -> list[FlowNode]:
    """FlowNodes of a unit-leaf fx graph; `node_bytes` comes from running it (see `record.py`)."""
    nodes = [n for n in gm.graph.nodes if n.op != "get_attr"]
    index = {n: i for i, n in enumerate(nodes)}
    flow = []
    for n in nodes:
        unit = n.target if n.op == "call_module" and n.target in unit_names else None
        flow.append(FlowNode(name=n.name, nbytes=node_bytes.get(n.name, 0), unit=unit,
                             is_input=n.op == "placeholder", is_output=n.op == "output",
                             users=tuple(index[u] for u in n.users if u in index)))
    return flow


def flow_from_export(exported: Any, unit_names: frozenset[str]) -> list[FlowNode]:
    """FlowNodes of an exported program: parameters and buffers dropped, nodes mapped to units by module path."""
    from torch.export.graph_signature import InputKind

    user_inputs = {spec.arg.name for spec in exported.graph_signature.input_specs
                   if spec.kind == InputKind.USER_INPUT and hasattr(spec.arg, "name")}
    nodes = [n for n in exported.graph.nodes
             if n.op not in ("get_attr",) and (n.op != "placeholder" or n.name in user_inputs)]
    index = {n: i for i, n in enumerate(nodes)}
    flow = []
    for n in nodes:
        unit = None
        for path, _ in (n.meta.get("nn_module_stack") or {}).values():
            if path in unit_names:
                unit = path
                break
        flow.append(FlowNode(name=n.name, nbytes=tensor_bytes(n.meta.get("val")), unit=unit,
                             is_input=n.op == "placeholder", is_output=n.op == "output",
                             users=tuple(index[u] for u in n.users if u in index)))
    return flow
