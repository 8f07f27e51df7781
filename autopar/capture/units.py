"""Which modules become layers, and when two module calls are the same computation.

A *unit* is a module that capture treats as one indivisible piece of a layer: every child of a
container (`nn.ModuleList`, `nn.Sequential`, `nn.ModuleDict`: the repeated blocks) and every other
module on the way down to those containers (embeddings, final norm, LM head, ...). Modules below a
unit are never split across layers, so pipeline cuts fall only between units.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["Unit", "discover_units", "structure_signature", "call_signature", "common_parent", "is_norm"]

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
PARAMETER_CONTAINERS = (nn.ParameterList, nn.ParameterDict)  # hold parameters, have no forward: never units

# Attributes that number a block inside its stack (HF `layer_idx`, Megatron `layer_number`) differ
# between otherwise identical blocks; they are left out of the signature so those blocks dedupe.
_POSITION_ATTR = re.compile(r"(idx|index|_id|_number)$")


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, RMSNorm and look-alikes (class names ending in "Norm"): per-token ops that tensor
    parallelism keeps replicated."""
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


@dataclass(frozen=True, kw_only=True)
class Unit:
    name: str  # fully qualified module name ("" for a model that is a single leaf module)
    in_container: bool  # a child of a ModuleList/Sequential/ModuleDict, i.e. one of a stack of blocks


def _holds_container(module: nn.Module) -> bool:
    return any(isinstance(m, CONTAINERS) for m in module.modules())


def discover_units(model: nn.Module) -> tuple[Unit, ...]:
    """Units in registration order: descend through plain modules until containers, whose children are units."""
    units: list[Unit] = []

    def expand(module: nn.Module, prefix: str, in_container: bool) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, PARAMETER_CONTAINERS):
                continue  # never called: its parameters are read by the code around it, as a root parameter is
            if isinstance(child, CONTAINERS):
                expand(child, f"{fqn}.", True)
            elif not in_container and _holds_container(child):
                expand(child, f"{fqn}.", False)
            else:
                units.append(Unit(name=fqn, in_container=in_container))

    if isinstance(model, CONTAINERS) or _holds_container(model):
        expand(model, "", isinstance(model, CONTAINERS))
    else:
        children = list(model.named_children())
        if children:
            units.extend(Unit(name=n, in_container=False) for n, _ in children)
    if not units:
        units.append(Unit(name="", in_container=False))
    return tuple(units)


def _simple_attrs(module: nn.Module) -> list[tuple[str, Any]]:
    return sorted(
        (k, v) for k, v in vars(module).items()
        if not k.startswith("_") and k != "training" and isinstance(v, (int, float, str, bool, type(None)))
        and not _POSITION_ATTR.search(k)
    )


def structure_signature(module: nn.Module) -> str:
    """Hash of module classes, their settings and parameter/buffer shapes: equal ⇒ same code and weights' shapes."""
    parts = []
    for name, m in module.named_modules():
        parts.append((name, type(m), m.extra_repr(), _simple_attrs(m), m.training,
                      [(n, p.shape, p.dtype, p.requires_grad) for n, p in m._parameters.items() if p is not None],
                      [(n, b.shape, b.dtype) for n, b in m._buffers.items() if b is not None]))
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}{value.requires_grad}"
    if isinstance(value, (int, float, str, bool, type(None))):
        return repr(value)[:64]
    return type(value).__qualname__


def call_signature(structure: str, args: tuple, kwargs: dict[str, Any]) -> str:
    """Signature of one call: the module structure plus the shapes and dtypes of what it was given."""
    h = hashlib.sha1(structure.encode())
    for leaf in tree_leaves((args, kwargs)):
        h.update(_describe(leaf).encode())
    h.update(repr(sorted(kwargs)).encode())
    return h.hexdigest()[:16]


def common_parent(names: list[str] | tuple[str, ...]) -> str:
    """The longest common parent module path of module paths `names` ("" for the root)."""
    split = [n.split(".")[:-1] for n in names]
    common: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)
