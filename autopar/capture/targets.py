"""Which forward argument takes a model's targets, and example targets for capturing it as it trains.

A model whose forward takes its targets (`forward(idx, targets) -> (logits, loss)`, transformers'
`labels=`) trains on the loss it computes when no `loss_fn` is given, and often computes something else
without them (nanoGPT returns only the last position's logits). Planning, pricing and parallelizing it
must all capture the same program, the one that trains, so they share these two rules.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autopar.errors import PlanMismatchError

__all__ = ["TARGET_NAMES", "target_parameter", "example_targets", "with_example_targets", "training_forward_kwargs"]

TARGET_NAMES = ("targets", "labels")


def training_forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments every training forward gets, in capture and at run time alike: no KV cache (it is
    for inference), `use_cache=False` where forward names it, or takes **kwargs while the model's config turns
    the cache on (transformers' convention: `config.use_cache`, read when the argument is not passed)."""
    params = inspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if "use_cache" in params or takes_kwargs and getattr(getattr(model, "config", None), "use_cache", False) is True:
        return {"use_cache": False}
    return {}


def target_parameter(model: nn.Module, target_arg: str | None) -> str | None:
    """The forward parameter that takes the targets: `target_arg` (checked), else `targets` or `labels`."""
    params = inspect.signature(model.forward).parameters
    if target_arg is not None:
        if target_arg not in params:
            raise PlanMismatchError(
                f"target_arg={target_arg!r}, but {type(model).__name__}.forward takes no such argument (it takes "
                f"{', '.join(params)}); name the argument its targets go to, or pass loss_fn=(logits, targets) -> loss")
        return target_arg
    return next((name for name in TARGET_NAMES if name in params), None)


def example_targets(example_inputs: Any) -> torch.Tensor:
    """Targets shaped like the first input tensor (token ids: a language model's targets are token ids too)."""
    first = next((t for t in tree_leaves(example_inputs) if isinstance(t, torch.Tensor) and t.dim() >= 1), None)
    if first is None:
        raise PlanMismatchError("the model's own loss needs example inputs with a tensor (the token ids)")
    return torch.zeros(first.shape, dtype=torch.long, device=first.device)


def with_example_targets(model: nn.Module, example_inputs: tuple, example_kwargs: dict[str, Any], *,
                         own_loss: bool, target_arg: str | None) -> tuple[dict[str, Any], str | None]:
    """`(example_kwargs, target_name)` for capturing `model` as it trains: with `own_loss` (no `loss_fn`
    given) and a forward that takes its targets, the kwargs gain example targets under that name unless
    the caller gave some there already (targets not shaped like the first input: class labels, a decoder's)."""
    target_name = target_parameter(model, target_arg) if own_loss else None
    if target_name is None or target_name in example_kwargs:
        return example_kwargs, target_name
    return {**example_kwargs, target_name: example_targets((example_inputs, example_kwargs))}, target_name
