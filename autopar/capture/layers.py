"""Group units into layers and find what crosses each layer boundary.

Layers follow execution order. Every unit with parameters starts a new layer (embedding, each
block of a stack, final norm, head); a unit without parameters (dropout, activation, rotary-table
module) joins the layer before it. Units that never ran keep their parameters in the
layer of the unit registered just before them.

A unit with parameters that the forward calls again after units of later layers ran (one block applied
several times in a loop over other modules, as ALBERT-style weight sharing does) ties those layers
together: a pipeline cut between them would put a stage's module after a later stage's in call order,
which no pipeline can run (codegen.dataflow refuses it). Such layers are merged into one, so every cut
the planner can place is one codegen can run; each call's work is still counted (capture.assemble).
Likewise the layers whose units run inside one call of the model's own activation checkpointing
(torch.utils.checkpoint: its backward replays the whole checkpointed function on the stage that runs it,
which a cut inside would leave half on another stage) are merged into one.

Liveness: a value produced in layer i (or a model input, "layer -1") and used in layer j > i is live
across every boundary i..j-1. Pipeline stages run the model's own code, so what a cut sends is the
outputs of the units that later units read (directly or through top-level glue, which each stage
recomputes; values computed from the inputs alone — positions, masks, rotary tables — are never
sent): those bytes are the boundary bytes, exactly what codegen sends (`autopar/codegen/dataflow.py`).
A layer's input bytes are what full recompute keeps of it (Korthikanti et al. 2022, §5: "2sbh", the layer
input, per transformer layer): the storages of the tensors its units' calls were handed as the model's own
forward ran (`retained_inputs`, from the recording pass, not the trace: torch.export's trace of a model may
build tensors the eager forward never does, such as the [s, s] causal mask transformers leaves to SDPA's
is_causal); a storage that several layers are handed (rotary tables, a mask, an encoder's output) is one
tensor, charged to the first of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from autopar.capture.trace import FlowNode
from autopar.capture.units import Unit

__all__ = ["LayerGroup", "group_layers", "liveness", "retained_inputs"]


@dataclass(frozen=True, kw_only=True)
class LayerGroup:
    name: str  # the first unit's name: a module path prefix that codegen can cut at
    units: tuple[str, ...]  # in execution order, then units that never ran
    in_container: bool


def _has_params(model: nn.Module, name: str) -> bool:
    return any(True for _ in model.get_submodule(name).parameters())


def group_layers(model: nn.Module, units: tuple[Unit, ...], calls: list[tuple[str, int | None]]) -> list[LayerGroup]:
    """Layers from the units in the order they first ran (`calls`: the unit of every top-level call, repeats
    included, with the checkpointing region it ran in or None), see the module docstring."""
    called = list(dict.fromkeys(unit for unit, _ in calls))
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
    with_params = {u for u in called if _has_params(model, u)}
    groups = _merge_interleaved(groups, [(u, r) for u, r in calls if u in with_params])
    return [LayerGroup(name=next((u for u in g if _has_params(model, u)), g[0]), units=tuple(g),
                       in_container=by_name[g[0]].in_container) for g in groups]


def _merge_interleaved(groups: list[list[str]], calls: list[tuple[str, int | None]]) -> list[list[str]]:
    """Merge the groups across every boundary that a call crosses backwards or a checkpointing region spans
    (module docstring): the boundary after group j is kept only if every call of a unit in groups ≤ j comes
    before every call of one in > j, and no region holds calls of both. `calls`: (unit, region) of every call
    of a unit with parameters, in call order."""
    layer_of = {u: i for i, g in enumerate(groups) for u in g}
    tied = [False] * len(groups)  # tied[j]: no cut may follow group j
    highest = -1
    spans: dict[int, tuple[int, int]] = {}  # region → (first, last) group it calls
    for unit, region in calls:
        j = layer_of[unit]
        for b in range(j, highest):  # a call of group j after one of group `highest` > j
            tied[b] = True
        highest = max(highest, j)
        if region is not None:
            lo, hi = spans.get(region, (j, j))
            spans[region] = (min(lo, j), max(hi, j))
    for lo, hi in spans.values():
        for b in range(lo, hi):
            tied[b] = True
    merged: list[list[str]] = []
    for j, g in enumerate(groups):
        if merged and tied[j - 1]:
            merged[-1].extend(g)
        else:
            merged.append(list(g))
    return merged


def _unit_sources(flow: list[FlowNode], param_units: frozenset[str], num_layers: int,
                  layer_of_unit: dict[str, int]) -> list[int]:
    """Boundary bytes as codegen sends them: the outputs of unit calls, not the glue computed from them.

    Each value carries the set of units it was computed from (its taint): a unit with parameters is a
    source; top-level glue and parameter-free units (run on every stage that calls them: a dropout called
    at several depths) propagate their inputs' taints. A source of
    layer i read by a unit of layer j > i (or by the model's output) crosses the cuts i..j-1 — the
    same rule `autopar/codegen/dataflow.py` applies to the model's eager forward.
    """
    producers: list[list[int]] = [[] for _ in flow]
    for i, node in enumerate(flow):
        for u in node.users:
            if u > i:
                producers[u].append(i)
    taint: list[frozenset[str]] = []
    source_bytes: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for i, node in enumerate(flow):
        outside = [p for p in producers[i] if flow[p].unit != node.unit or node.unit is None]
        read = frozenset().union(*(taint[p] for p in outside)) if outside else frozenset()
        if node.is_input:
            taint.append(frozenset())
            continue
        if node.unit is not None and node.unit in layer_of_unit and node.unit not in param_units:
            taint.append(frozenset().union(*(taint[p] for p in producers[i])) if producers[i] else frozenset())
        elif node.unit is not None and node.unit in layer_of_unit:
            here = layer_of_unit[node.unit]
            for src in read:
                if layer_of_unit[src] < here:
                    last_use[src] = max(last_use.get(src, -1), here)
            taint.append(frozenset({node.unit}))
            if any(flow[u].unit != node.unit for u in node.users):
                source_bytes[node.unit] = source_bytes.get(node.unit, 0) + node.nbytes
        elif node.is_output:
            for src in read:
                last_use[src] = max(last_use.get(src, -1), num_layers - 1)
            taint.append(read)
        else:
            taint.append(read)
    diff = [0] * (num_layers + 1)
    for src, last in last_use.items():
        diff[layer_of_unit[src]] += source_bytes.get(src, 0)
        diff[last] -= source_bytes.get(src, 0)
    boundary, running = [], 0
    for i in range(num_layers):
        running += diff[i]
        boundary.append(running)
    return boundary


def retained_inputs(calls: Iterable[tuple[str, tuple[tuple[int, int], ...], tuple[int, ...]]],
                    layer_of_unit: dict[str, int], checkpointed: frozenset[int], num_layers: int) -> list[int]:
    """Input bytes per layer, whole example batch (module docstring). `calls`: each top-level unit call's unit,
    the (storage key, bytes) of the tensors it was handed and the storage keys it returned, in call order. A
    storage is charged to the first layer handed it other than the one that made it, a checkpointed one
    (`checkpointed`: the blocks codegen recomputes) first: what a layer that is not checkpointed is handed it
    need not keep (a rotary-table module handed the hidden states for their dtype)."""
    made: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    for unit, handed, returned in calls:
        layer = layer_of_unit.get(unit)
        if layer is None:
            continue
        for key, nbytes in handed:
            if made.get(key) != layer:
                readers.setdefault(key, []).append(layer)
                size[key] = nbytes
        for key in returned:
            made.setdefault(key, layer)
    inputs = [0] * num_layers
    for key, layers in readers.items():
        inputs[next((la for la in layers if la in checkpointed), layers[0])] += size[key]
    return inputs


def liveness(flow: list[FlowNode], layer_of_unit: dict[str, int], num_layers: int,
             param_units: frozenset[str] | None = None) -> list[int]:
    """Boundary bytes per layer, whole example batch; see the module docstring.

    `param_units`: units holding parameters; when given, boundary bytes are the unit outputs that
    codegen sends (see `_unit_sources`), else every live value.
    """
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
    diff = [0] * (num_layers + 1)
    for i, node in enumerate(flow):
        if not node.nbytes or not node.users:
            continue
        last = max(level[u] for u in node.users)
        if last > level[i]:
            diff[max(level[i], 0)] += node.nbytes
            diff[min(last, num_layers)] -= node.nbytes
    boundary = []
    running = 0
    for i in range(num_layers):
        running += diff[i]
        boundary.append(running)
    if param_units is not None:
        boundary = _unit_sources(flow, param_units, num_layers, layer_of_unit)
    return boundary
