"""Run a model on the meta device whatever device its weights are on.

Capture needs only shapes and dtypes. A model built on meta is used as is; a model with real (or
fake) weights gets its parameters and buffers swapped for meta stand-ins for the duration of the
capture and restored afterwards, so no weight is copied and no kernel runs on real data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["on_meta", "swap_tensors", "to_meta"]


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def to_meta(value: Any) -> Any:
    """A meta tensor of the same shape and dtype for every tensor in `value` (nested containers kept)."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not (x.device.type == "meta" and type(x) is torch.Tensor):
            return _meta_like(x).requires_grad_(x.requires_grad and x.is_floating_point())
        return x

    return tree_map(convert, value)


@contextmanager
def on_meta(model: nn.Module) -> Iterator[nn.Module]:
    """Temporarily replace every non-meta parameter and buffer of `model` by a meta tensor; tied stay tied."""
    with swap_tensors(model, _meta_like,
                      lambda t: not (t.device.type == "meta" and type(t) in (torch.Tensor, nn.Parameter))):
        yield model


@contextmanager
def swap_tensors(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor],
                 select: Callable[[torch.Tensor], bool] = lambda t: True) -> Iterator[nn.Module]:
    """Temporarily replace the selected parameters and buffers by `make(t)` (one stand-in per tensor)."""
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    memo: dict[int, Any] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or not select(t):
                    continue
                if id(t) not in memo:
                    stand_in = make(t.detach())
                    memo[id(t)] = nn.Parameter(stand_in, t.requires_grad) if isinstance(t, nn.Parameter) \
                        else stand_in
                swapped.append((store, name, t))
                store[name] = memo[id(t)]
    try:
        yield model
    finally:
        for store, name, original in reversed(swapped):
            store[name] = original
