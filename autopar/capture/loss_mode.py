"""How a captured program trains, recorded beside its fingerprint (`ModelGraph.loss_mode`, `Plan.loss_mode`).

"loss_fn": the model returns logits and a loss_fn of them is the loss; "own:<arg>": the forward takes its targets
as <arg> and returns the loss it computes. The layout and its cuts do not depend on it; the price does, a little
(the last layer computes the loss or not), so a plan made under one mode runs under the other
(autopar/planner/plan_fit.py). Torch-free: the planner reads it.
"""

from __future__ import annotations

__all__ = ["LOSS_FN", "loss_mode", "own_loss_target", "describe_loss_mode", "runtime_loss_kernel"]

LOSS_FN = "loss_fn"
_OWN = "own:"


def loss_mode(target_name: str | None) -> str:
    """The loss mode of a program captured with its targets under `target_name` (None: for a loss_fn)."""
    return LOSS_FN if target_name is None else _OWN + target_name


def own_loss_target(mode: str) -> str | None:
    """The forward argument a loss mode gives the targets to (None for "loss_fn"; "" for "own:", any)."""
    return mode[len(_OWN):] if mode.startswith(_OWN) else None


def describe_loss_mode(mode: str) -> str:
    """A loss mode in words, for messages."""
    if mode == LOSS_FN:
        return "a loss_fn of its logits (lm_cross_entropy unless one is given)"
    if (name := own_loss_target(mode)) is not None:
        return f"its own loss ({name or 'its targets'}= given to its forward, no loss_fn)"
    return "an unrecorded loss (a plan written before plans recorded it)"


def runtime_loss_kernel(loss_mode: str) -> str:
    """What autopar's runtime holds of the logits for the loss (cost_models.memory.LOSS_KERNELS): "chunked"
    for a loss_fn of the logits (lm_cross_entropy, autopar/codegen/loss.py; a loss_fn that upcasts all the
    logits is priced with PlannerOptions(loss_kernel="fp32_logits")); "fp32_logits" for a model's own loss,
    whose code is the model's (typically F.cross_entropy over the upcast logits)."""
    return "fp32_logits" if own_loss_target(loss_mode) is not None else "chunked"
