"""Values of the small tensors a model computes from shapes alone, during a pass on meta tensors.

Capture runs models on meta tensors: shapes and dtypes, no data. Most models never look at a value,
but some decide what to compute by reading one, and the values they read are nearly always fixed by
the input's shape: transformers' decoders build `position_ids = arange(s)` and check whether they
describe several packed documents (`(diff(position_ids) != 1).cumsum(-1)[:, -1] == 0).all()`); when
they do not, attention runs SDPA's causal kernel with no mask, and when the check cannot be made (under
tracing or fake tensors) they build and pass an explicit s×s mask, a different and slower kernel than
the one training runs. Charging that mask would price a program that never runs on real data.

`ShapeValues` follows such values: every op whose tensor inputs all have known values (factory ops such
as `arange`, `zeros` and `full` have none) is also run on small real CPU tensors, and reading a scalar
(`bool()`, `.item()`) of a tensor whose value is known answers with it. The example inputs' own values are
known where the user gave them with data (an attention mask of ones lets a model skip its mask, as
the same batch would in training). Values that depend on anything else (parameters, inputs given on
meta, random ops, uninitialised `empty`) stay unknown, and reading one fails as
it does on meta. Only tensors up to `MAX_TRACKED_ELEMENTS` are followed: positions and per-token
indices are, s×s masks are not.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = ["ShapeValues", "MAX_TRACKED_ELEMENTS"]

# Positions and token indices of a capture batch (batch · sequence, 16 × 131,072 = 2^21) are followed;
# anything larger (s × s masks, activations) is left to meta. A CPU pass over 2^21 elements takes ~1 ms.
MAX_TRACKED_ELEMENTS = 1 << 21

aten = torch.ops.aten
_UNINITIALISED = frozenset({aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty,
                            aten.new_empty_strided, aten.empty_permuted})


def _has_data(t: torch.Tensor) -> bool:
    """A real tensor (a constant the model holds on the CPU, say): its value is its own."""
    return t.device.type != "meta" and type(t) in (torch.Tensor, torch.nn.Parameter)


def _small(out: Any) -> bool:
    leaves, _ = tree_flatten(out)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(t.numel() <= MAX_TRACKED_ELEMENTS for t in tensors)


class ShapeValues(TorchDispatchMode):
    """Follow the values of small tensors computed from shapes and constants (see the module docstring)."""

    def __init__(self, known: dict[torch.Tensor, torch.Tensor] | None = None) -> None:
        """`known`: meta tensor → its real value (the example inputs the user gave with data)."""
        super().__init__()
        self.values: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        for meta, real in (known or {}).items():
            self.values[meta] = real

    def _known(self, tensors: list[torch.Tensor]) -> bool:
        return all(t in self.values or _has_data(t) for t in tensors)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        if func is aten._local_scalar_dense.default and inputs and inputs[0] in self.values:
            return self.values[inputs[0]].item()
        out = func(*args, **kwargs)
        computable = (self._known(inputs) and func.overloadpacket not in _UNINITIALISED
                      and torch.Tag.nondeterministic_seeded not in func.tags and _small(out))
        real_out = None
        if computable:
            real_args, real_kwargs = tree_map(self._real, (args, kwargs))
            try:
                real_out = func(*real_args, **real_kwargs)
            except Exception:  # an op the CPU cannot run on these values: the result stays unknown
                real_out = None
        if real_out is None:
            self._forget_written(func, args, kwargs)
            return out
        for fake, real in zip(tree_flatten(out)[0], tree_flatten(real_out)[0], strict=False):
            if isinstance(fake, torch.Tensor) and isinstance(real, torch.Tensor):
                self.values[fake] = real
        return out

    def _real(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x if _has_data(x) else self.values[x]
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    def _forget_written(self, func: Any, args: tuple, kwargs: dict) -> None:
        """An op that wrote into a tensor with a known value, from unknown inputs, makes that value unknown."""
        named = dict(zip((a.name for a in func._schema.arguments), args, strict=False)) | kwargs
        for arg in func._schema.arguments:
            target = named.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write and target in self.values:
                written = self.values[target].untyped_storage().data_ptr()
                for t in [t for t, v in self.values.items() if v.untyped_storage().data_ptr() == written]:
                    del self.values[t]  # the tensor and every view of its storage
