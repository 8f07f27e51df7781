"""Interleaved 1F1B with a chosen group of N micro-batches per chunk, run by torch's own pipelining runtime.

torch.distributed.pipelining's ScheduleInterleaved1F1B fixes N (micro-batches a rank runs through one chunk
before its next) at m // max(1, m // p), and its order fails torch's own validation for N strictly between 2 and
p − 2, so it cannot be given another N. Here the order of `cost_models.pipeline_order.interleaved_order` (the
one the cost model prices) is handed, as compute actions, to torch's `_PipelineScheduleRuntime`, which adds
the sends and receives (its lowering, `_add_send_recv`, rejects an order that would hang) and runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime
from torch.distributed.pipelining.stage import _PipelineStageBase

from cost_models.pipeline_order import Action, interleaved_order

__all__ = ["ScheduleGroupedInterleaved1F1B", "torch_actions"]


def torch_actions(order: tuple[tuple[Action, ...], ...]) -> dict[int, list[_Action | None]]:
    """`order` (one action list per rank) as torch's compute actions: F → FORWARD, B → FULL_BACKWARD."""
    kinds = {"F": _ComputationType.FORWARD, "B": _ComputationType.FULL_BACKWARD}
    return {r: [_Action(a.stage, kinds[a.kind], a.microbatch) for a in acts] for r, acts in enumerate(order)}


class ScheduleGroupedInterleaved1F1B(_PipelineScheduleRuntime):
    """Interleaved 1F1B over this rank's stages (r, r + p, …) with groups of `microbatch_group` micro-batches."""

    def __init__(self, stages: Sequence[_PipelineStageBase], n_microbatches: int, microbatch_group: int,
                 loss_fn: Callable | None = None, scale_grads: bool = True) -> None:
        super().__init__(stages=list(stages), n_microbatches=n_microbatches, loss_fn=loss_fn,
                         scale_grads=scale_grads)
        order = interleaved_order(self.pp_group_size, len(stages), n_microbatches, microbatch_group)
        self.pipeline_order = torch_actions(order)
        self._prepare_schedule_with_comms(self.pipeline_order)
