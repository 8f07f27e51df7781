"""Which forward argument takes a model's targets, and example targets for capturing it as it trains.

A model whose forward takes its targets (`forward(idx, targets) -> (logits, loss)`, transformers'
`labels=`) trains on the loss it computes when no `loss_fn` is given, and often computes something else
without them (nanoGPT returns only the last position's logits). Planning, pricing and parallelizing it
must all capture the same program, the one that trains, so they share these two rules.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autopar.errors import AutoparError, PlanMismatchError

__all__ = ["TARGET_NAMES", "target_parameter", "example_targets", "with_example_targets", "training_forward_kwargs",
           "targets_in_batch", "failure_text"]

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


def targets_in_batch(inputs: Any, targets: Any, target_name: str | None, *, where: str) -> tuple[Any, Any]:
    """`(inputs, targets)` of a batch for a model trained on its own loss: a dict of keyword inputs that holds
    the target argument (what a data collator yields: `{"input_ids", "attention_mask", "labels"}`) gives its
    targets there, taken out of the dict, so the rest of the step sees them as if passed apart (split into
    micro-batches alike, fed to the stage that computes the loss). Given both ways, it is an error: which
    one trains would be a guess."""
    if target_name is None or not isinstance(inputs, Mapping) or inputs.get(target_name) is None:
        return inputs, targets
    if targets is not None:
        raise AutoparError(
            f"{where} got the targets twice: in the batch dict as {target_name!r} and as its targets argument; "
            f"pass one: {where}(batch) with batch[{target_name!r}], or {where}(inputs, targets) with no "
            f"{target_name!r} key in the inputs")
    return {k: v for k, v in inputs.items() if k != target_name}, inputs[target_name]


def failure_text(e: BaseException, model: nn.Module, limit: int = 400) -> str:
    """`Type: message` of an exception a model's forward raised, on one line: a TypeError from calling the module
    names the callable by its repr (the whole module tree), shortened here to its class name."""
    text = str(e).replace(repr(model), type(model).__name__) if str(e) else ""
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return f"{type(e).__name__}: {text[:limit]}{'…' if len(text) > limit else ''}"
