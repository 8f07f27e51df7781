"""Group units into layers and find what crosses each layer boundary.

Layers follow execution order. Every unit with parameters starts a new layer (embedding, each
block of a stack, final norm, head); a unit without parameters (dropout, activation, rotary-table
module) joins the layer before it. Units that never ran keep their parameters in the
layer of the unit registered just before them.

Liveness: a value produced in layer i (or a model input, "layer -1") and used in layer j > i is live
across every boundary i..j-1, so a pipeline cut there must send it — unless it is computed from the
inputs alone (positions, masks, rotary tables), which every stage recomputes; those bytes summed are
the boundary bytes, what codegen sends (`autopar/codegen/dataflow.py`). The values a layer reads
from earlier layers are its input bytes, what full recompute keeps (Korthikanti et al. 2022, §5:
"2sbh", the layer input, per transformer layer).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from autopar.capture.trace import FlowNode
from autopar.capture.units import Unit

__all__ = ["LayerGroup", "group_layers", "liveness"]


@dataclass(frozen=True, kw_only=True)
class LayerGroup:
    name: str  # the first unit's name: a module path prefix that codegen can cut at
    units: tuple[str, ...]  # in execution order, then units that never ran
    in_container: bool


def _has_params(model: nn.Module, name: str) -> bool:
    return any(True for _ in model.get_submodule(name).parameters())


def group_layers(model: nn.Module, units: tuple[Unit, ...], called: list[str]) -> list[LayerGroup]:
    """Layers from the units in the order they first ran (`called`), see the module docstring."""
    by_name = {u.name: u for u in units}
    groups: list[list[str]] = []
    for name in called:
        if not groups or _has_params(model, name):
            groups.append([name])
        else:
            groups[-1].append(name)
    if len(groups) > 1 and not _has_params(model, groups[0][0]):
        # parameter-free units before the first real layer (e.g. an input dropout) join that layer
        first = groups.pop(0)
        groups[0] = first + groups[0]
    ran = set(called)
    layer_of = {u: i for i, g in enumerate(groups) for u in g}
    current = 0
    for unit in units:  # registration order: idle units follow their predecessor
        if unit.name in ran:
            current = layer_of[unit.name]
        elif groups:
            groups[current].append(unit.name)
        else:
            groups.append([unit.name])
    return [LayerGroup(name=next((u for u in g if _has_params(model, u)), g[0]), units=tuple(g),
                       in_container=by_name[g[0]].in_container) for g in groups]


def _from_units(flow: list[FlowNode], param_units: frozenset[str]) -> list[bool]:
    """Whether each value is computed from the output of a unit with parameters (or is one).

    The others (model inputs, positions, masks, rotary tables) depend only on the inputs' shapes or
    values: every pipeline stage recomputes them instead of receiving them (codegen/dataflow.py), so
    they never cross a cut.
    """
    producers: list[list[int]] = [[] for _ in flow]
    for i, node in enumerate(flow):
        for u in node.users:
            producers[u].append(i)
    out = []
    for i, node in enumerate(flow):
        out.append(not node.is_input and (node.unit in param_units or any(out[p] for p in producers[i] if p < i)))
    return out


def liveness(flow: list[FlowNode], layer_of_unit: dict[str, int], num_layers: int,
             param_units: frozenset[str] | None = None) -> tuple[list[int], list[int]]:
    """(input_bytes, boundary_bytes) per layer, whole example batch; see the module docstring.

    `param_units`: units holding parameters; when given, only values computed from their outputs
    count as crossing a boundary (see `_from_units`).
    """
    crosses = _from_units(flow, param_units) if param_units is not None else [True] * len(flow)
    level = []
    current = 0
    for node in flow:
        if node.is_input:
            level.append(-1)
        elif node.is_output:
            level.append(num_layers)
        elif node.unit is not None and node.unit in layer_of_unit:
            current = layer_of_unit[node.unit]
            level.append(current)
        else:
            level.append(current)
    inputs = [0] * num_layers
    diff = [0] * (num_layers + 1)
    for i, node in enumerate(flow):
        if not node.nbytes or not node.users:
            continue
        user_levels = {level[u] for u in node.users}
        last = max(user_levels)
        if last > level[i] and crosses[i]:
            diff[max(level[i], 0)] += node.nbytes
            diff[min(last, num_layers)] -= node.nbytes
        for lv in user_levels:
            if level[i] < lv < num_layers:
                inputs[lv] += node.nbytes
    boundary = []
    running = 0
    for i in range(num_layers):
        running += diff[i]
        boundary.append(running)
    return inputs, boundary
