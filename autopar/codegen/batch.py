"""Batches as models take them: a tensor, a tuple of positional inputs or a dict of keyword inputs, nested.

A batch is any pytree of tensors (and other values). A tensor whose dim 0 has the batch's size is split
along it (between data-parallel ranks, then into micro-batches); every other leaf — a tensor without a
batch dim (a shared position bias, a 0-d scale), None, a flag — is given whole to every part. Inputs
map onto the model's call as `model(x)` for a tensor, `model(*inputs)` for a tuple or list and
`model(**inputs)` for a dict (what a data collator yields); targets keep their structure and reach the
loss as they were given, one micro-batch at a time.

`MicroBatches` holds one step's micro-batches on a rank: its pipeline stages take their inputs from it
(every rank reads its own share of the batch, so an input a later stage reads, decoder ids or a mask,
crosses no cut) and the loss its targets, by micro-batch index.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_map_only

from autopar.errors import AutoparError

__all__ = ["batch_size_of", "slice_batch", "split_batch", "as_call", "MicroBatches", "resize_batch"]


def _is_batched(leaf: Any, size: int) -> bool:
    return isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.size(0) == size


def batch_size_of(batch: Any) -> int | None:
    """Dim 0 of the first tensor leaf with at least one dim (None when the batch holds none)."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1:
            return int(leaf.size(0))
    return None


def _check_size(batch: Any, size: int, what: str, how: str) -> None:
    leaves = tree_flatten(batch)[0]
    if not any(_is_batched(t, size) for t in leaves):
        dims = sorted({int(t.size(0)) for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 1})
        found = f"its tensors have dim 0 of {dims}" if dims else "it holds no tensor with a batch dim"
        raise AutoparError(f"{what} must hold {size} samples along dim 0 of its tensors; {found}. {how}")


def slice_batch(batch: Any, start: int, stop: int, size: int, *, what: str = "batch", how: str = "") -> Any:
    """Samples start..stop of every tensor whose dim 0 is `size`; other leaves unchanged."""
    _check_size(batch, size, what, how)
    return tree_map(lambda t: t[start:stop] if _is_batched(t, size) else t, batch)


def split_batch(batch: Any, parts: int, size: int, *, what: str = "batch", how: str = "") -> list[Any]:
    """`parts` equal consecutive slices of a batch of `size` samples (size must divide by parts)."""
    _check_size(batch, size, what, how)
    step = size // parts
    return [tree_map(lambda t, i=i: t[i * step:(i + 1) * step] if _is_batched(t, size) else t, batch)
            for i in range(parts)]


def resize_batch(batch: Any, size: int, new_size: int) -> Any:
    """Zeros shaped like `batch` with `new_size` samples (for dry runs at the micro-batch shape)."""
    return tree_map_only(torch.Tensor, lambda t: (torch.zeros((new_size, *t.shape[1:]), dtype=t.dtype)
                                                  if _is_batched(t, size) else t), batch)


def as_call(inputs: Any) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments that `inputs` stands for (see the module docstring)."""
    if isinstance(inputs, Mapping):
        bad = [k for k in inputs if not isinstance(k, str)]
        if bad:
            raise AutoparError(f"a dict of inputs is passed as keyword arguments; its keys must be strings, "
                               f"got {bad[:3]}")
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


class MicroBatches:
    """One step's micro-batches on this rank, read by micro-batch index (pipeline stages, the loss)."""

    def __init__(self) -> None:
        self.inputs: list[tuple[tuple, dict[str, Any]]] = []
        self.targets: list[Any] = []

    def set(self, inputs: list[Any], targets: list[Any] | None, device: torch.device) -> None:
        to = lambda x: tree_map_only(torch.Tensor, lambda t: t.to(device), x)  # noqa: E731
        self.inputs = [as_call(to(x)) for x in inputs]
        self.targets = [to(t) for t in targets] if targets is not None else []

    def call(self, index: int) -> tuple[tuple, dict[str, Any]]:
        """The arguments of micro-batch `index`; the first one's for an index outside the step (the
        pipelining runtime's shape inference runs the stage once on uninitialised buffers)."""
        return self.inputs[index if 0 <= index < len(self.inputs) else 0]

    def target(self, index: int) -> Any:
        return self.targets[index if 0 <= index < len(self.targets) else 0]
