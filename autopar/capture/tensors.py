"""What a tensor is to capture: its storage, whether it is model state (never an activation), its bytes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["ModelState", "storage_key", "tensor_bytes"]


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class ModelState:
    """Recognises parameters and buffers (and views of them), which are never activations."""

    def __init__(self, model: nn.Module) -> None:
        self.buffer_ids = {id(b) for b in model.buffers()}

    def __contains__(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return isinstance(base, nn.Parameter) or isinstance(t, nn.Parameter) or id(base) in self.buffer_ids \
            or id(t) in self.buffer_ids


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in a (nested) value, by shape and dtype."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(value) if isinstance(t, torch.Tensor))
