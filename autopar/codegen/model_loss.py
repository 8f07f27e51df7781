"""Training on the loss the model computes itself: `forward(idx, targets) -> (logits, loss)`, transformers' `labels=`.

When `parallelize` gets no `loss_fn` and the model's forward takes a targets argument (`targets`, `labels`, or
the one named by `target_arg=`), each micro-batch's targets go to the model and the step trains on the loss
it returns: a scalar tensor, `.loss`, `["loss"]`, or the one 0-dim tensor of a tuple.

One process averages a token loss over the tokens of the whole batch that count (`ignore_index` skipped,
labels shifted inside the model or not); split into micro-batches and data-parallel ranks, each piece averages
over its own tokens. To give the same gradients and loss, every cross-entropy / NLL call the model makes is
watched (`LossWatch`, a torch-function mode): its reduction and the number of targets it counted. Each
micro-batch's backward runs on `loss · n` (a sum over its tokens; `loss` itself for reduction="sum"), and after
the gradients are summed over the data-parallel group they are divided by the global count — exactly the
single-process mean. A model whose loss is not one such call (several calls, a loss built by other code, a
reduction of "none") cannot be split this way and is refused at `parallelize`, naming what was found.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from autopar.capture.meta import swap_tensors
from autopar.capture.targets import example_targets, failure_text
from autopar.errors import PlanMismatchError

__all__ = ["LossWatch", "loss_of", "stage_loss", "check_model_loss"]

_LOSSES = {F.cross_entropy: "cross_entropy", F.nll_loss: "nll_loss"}


def loss_of(out: Any) -> torch.Tensor:
    """The loss in a model's output: a scalar tensor, `.loss`, `["loss"]`, or the one scalar of a tuple (as a
    plain tensor: a vocab-parallel cross-entropy returns a replicated DTensor)."""
    loss = _find_loss(out)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def stage_loss(out: Any) -> torch.Tensor:
    """The loss as the last pipeline stage returns it: shape [1] (the schedule concatenates micro-batches' outputs)."""
    return loss_of(out).reshape(1)


def _find_loss(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor) and out.dim() == 0:
        return out
    candidate = getattr(out, "loss", None)
    if candidate is None and isinstance(out, dict):
        candidate = out.get("loss")
    if isinstance(candidate, torch.Tensor) and candidate.dim() == 0:
        return candidate
    if isinstance(out, (tuple, list)):
        scalars = [t for t in out if isinstance(t, torch.Tensor) and t.dim() == 0]
        if len(scalars) == 1:
            return scalars[0]
    raise PlanMismatchError(
        f"with its targets the model returned a {type(out).__name__} without one scalar loss (a 0-dim tensor, "
        ".loss, ['loss'], or the one 0-dim tensor of a tuple); return the loss, or pass loss_fn=(logits, targets) "
        "-> loss and let forward return the logits")


@dataclass(frozen=True, kw_only=True)
class LossCall:
    function: str
    reduction: str
    count: torch.Tensor  # targets that count (not ignore_index), a 0-dim tensor
    output: torch.Tensor


class LossWatch(TorchFunctionMode):
    """Records every `F.cross_entropy` / `F.nll_loss` call (nn.CrossEntropyLoss and transformers call them)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[LossCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = _LOSSES.get(func)
        if name is not None:
            bound = inspect.signature(func).bind(*args, **kwargs)
            bound.apply_defaults()
            target = bound.arguments["target"]
            reduction = bound.arguments["reduction"]
            if bound.arguments.get("reduce") is not None or bound.arguments.get("size_average") is not None:
                reduction = "legacy"
            count = (target != bound.arguments["ignore_index"]).sum() if not target.is_floating_point() \
                else torch.tensor(target.shape[0] if target.dim() else 1)
            self.calls.append(LossCall(function=name, reduction=reduction, count=count, output=out))
        return out

    def take(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the backward target: the loss summed over its tokens, the token count it adds; 0 for a sum), for the
        micro-batch just run; clears the record."""
        calls, self.calls = self.calls, []
        call = calls[-1]
        if call.reduction == "sum":
            return loss, torch.zeros((), dtype=torch.long, device=loss.device)
        count = call.count.to(loss.device)
        # a micro-batch whose every target is ignored (a masked LM's, a prompt's) means over none: nan, adding nothing
        return torch.where(count > 0, loss * count, torch.zeros_like(loss)), count


def check_model_loss(model: nn.Module, target_name: str, example_inputs: Sequence[Any],
                     forward_kwargs: dict[str, Any], targets: Any = None) -> None:
    """One forward on fake tensors with targets: its loss must be the output of one mean or sum cross-entropy
    (or NLL) call, which is what lets micro-batches and data-parallel ranks average as one process does.
    targets: the example's own (a batch dict's `labels`), else token ids shaped like the first input."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    watch = LossWatch()
    given = targets is not None
    if not given:
        targets = example_targets((example_inputs, forward_kwargs))
    try:
        with fake, swap_tensors(model, fake.from_tensor):
            inputs, kwargs, fake_targets = tree_map_only(torch.Tensor, fake.from_tensor,
                                                         (tuple(example_inputs), forward_kwargs, targets))
            with watch:
                loss = _find_loss(model(*inputs, **kwargs, **{target_name: fake_targets}))
    except PlanMismatchError:
        raise
    except Exception as e:
        if given:
            what, fix = (f"the example's {target_name}",
                         f"check that model(**example_kwargs) runs with its {target_name!r} as one process runs it")
        else:
            what = f"example targets: token ids of shape {list(targets.shape)}, like its first input"
            fix = (f"if its targets are shaped otherwise (class labels, a decoder's tokens), give example ones in "
                   f"example_kwargs={{{target_name!r}: ...}}")
        raise PlanMismatchError(
            f"training on {type(model).__name__}'s own loss (no loss_fn given) runs forward(..., {target_name}=...) "
            f"with {what}, and it failed: {failure_text(e, model)}. {fix[0].upper()}{fix[1:]}; or, to train on a "
            "loss of its logits instead, pass loss_fn=(logits, targets) -> loss") from e
    where = f"{type(model).__name__}.forward(..., {target_name}=targets)"
    if len(watch.calls) != 1:
        found = ", ".join(c.function for c in watch.calls) or "none"
        raise PlanMismatchError(
            f"{where} computes its loss with {len(watch.calls)} cross-entropy/NLL calls ({found}); autopar splits a "
            "model's own loss over micro-batches and ranks when it is one mean (or sum) cross-entropy over tokens. "
            "Pass loss_fn=(logits, targets) -> loss and let forward return the logits")
    call = watch.calls[0]
    if call.reduction not in ("mean", "sum"):
        raise PlanMismatchError(
            f"{where}: its {call.function} has reduction={call.reduction!r}; only 'mean' and 'sum' split exactly over "
            "micro-batches and ranks. Pass loss_fn=(logits, targets) -> loss instead")
    if loss is not call.output:
        raise PlanMismatchError(
            f"{where} returns a loss computed from its {call.function} by further code (a weighted sum, an auxiliary "
            "term); autopar can split only the cross-entropy itself. Pass loss_fn=(logits, targets) -> loss instead")
