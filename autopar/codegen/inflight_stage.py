"""A pipeline stage that holds buffers for its micro-batches in flight only.

torch.distributed.pipelining's PipelineStage (torch/distributed/pipelining/stage.py) allocates, when a
schedule starts, a receive buffer for every micro-batch index, for its input (`_setup_forward_recv_info`) and
for its output's gradient (`_setup_backward_recv_info` → `_create_grad_recv_info`), and keeps all of them for
the step; it also keeps each micro-batch's output in `fwd_cache` from its forward to its backward, only for
its autograd graph. `InflightStage` keeps torch's schedules (GPipe, 1F1B, interleaved, autopar's grouped
interleaved) and changes what the stage holds:

- receive buffers are allocated when the schedule posts the receive (`get_fwd_recv_ops`, `get_bwd_recv_ops`)
  and dropped once that micro-batch's backward has run (`backward_one_chunk`; after its forward when the
  step has no backward), so a stage holds input buffers for the micro-batches in flight, which are the inputs
  its first layer saves anyway, and a gradient buffer from its receive to its backward;
- a non-last stage returns each output through `_Handoff`, an identity with its own tensor, which the stage
  keeps in `fwd_cache` for the backward; once the send is handed to the schedule (`get_fwd_send_ops`) that
  tensor's data is replaced by a one-element stand-in of the same shape (Megatron-LM's
  deallocate_output_tensor). The graph (`_Handoff`'s backward, then the layers') is kept, so the backward is
  unchanged, and the output's memory is freed unless something else of the stage still holds it (an op that
  saved it for its backward, a view): what backward needs is never released. The tensor the send reads is
  a separate alias torch makes (`to_local_if_dtensor(detach=True)`), alive while the schedule holds the send:
  torch's 1F1B drops it at its next send; GPipe and the multi-stage runtime keep their send works to the end
  of the forwards or of the step, so the alias is also stubbed at the micro-batch's backward, when its gradient
  came back and the send has certainly completed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.stage import _make_tensor_from_meta, _RecvInfo
from torch.utils._pytree import tree_map_only

__all__ = ["InflightStage", "free_data"]


class _Handoff(torch.autograd.Function):
    """Identity whose output is a tensor of its own (same storage, not a view): freeing that tensor's data after
    the send leaves the stage's own tensor, and whatever autograd saved of it, untouched."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _handoff(t: torch.Tensor) -> torch.Tensor:
    return _Handoff.apply(t) if t.requires_grad else t.detach()


def free_data(t: torch.Tensor) -> None:
    """Replace `t`'s data by one element broadcast to its shape: shape, dtype and autograd graph stay (a backward
    from it checks its gradient's shape), its storage is released unless another tensor shares it."""
    t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


def _unbuffered(infos: tuple[_RecvInfo, ...]) -> tuple[_RecvInfo, ...]:
    return tuple(_RecvInfo(i.input_name, i.source, None, i.tensor_meta, is_root_arg=i.is_root_arg) for i in infos)


def _allocate(infos: tuple[_RecvInfo, ...], device: torch.device) -> None:
    for info in infos:
        if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


def _release(infos: tuple[_RecvInfo, ...]) -> None:
    for info in infos:
        if not info.is_root_arg:
            info.buffer = None


class InflightStage(PipelineStage):
    """PipelineStage whose receive buffers and outputs live only while their micro-batch is in flight."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sent: dict[int, list[weakref.ref]] = {}  # micro-batch → the aliases its sends read
        # every receive buffer this stage allocated, for tests that count the live ones
        self.recv_buffers: list[tuple[str, int, weakref.ref]] = []

    # -- receive buffers: allocated when the receive is posted, dropped after the micro-batch's last use --

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        if self.is_first:  # its inputs are the step's arguments: no buffers
            return super()._setup_forward_recv_info(num_microbatches, has_backward)
        super()._setup_forward_recv_info(1, has_backward)  # torch's descriptors, with one buffer that goes at once
        template = _unbuffered(self.args_recv_info[0])
        for chunk in range(num_microbatches):
            self.args_recv_info[chunk] = _unbuffered(template)

    def _create_grad_recv_info(self, act_send_info: dict) -> tuple[_RecvInfo, ...]:
        return _unbuffered(super()._create_grad_recv_info(act_send_info))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._track("input", fwd_chunk_id, self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            self._track("grad", bwd_chunk_id, self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def _track(self, kind: str, chunk: int, infos: tuple[_RecvInfo, ...]) -> None:
        _allocate(infos, self.device)
        self.recv_buffers.extend((kind, chunk, weakref.ref(i.buffer)) for i in infos if i.buffer is not None)
        self.recv_buffers = [b for b in self.recv_buffers if b[2]() is not None]

    # -- outputs: handed to the send as an alias, freed in the stage --

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward_maybe_with_nosync(*args, **kwargs)
        return out if self.is_last else tree_map_only(torch.Tensor, _handoff, out)

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        out = super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        if not self.has_backward or not torch.is_grad_enabled():  # no backward will read the received inputs
            _release(self.args_recv_info[fwd_chunk_id])
        return out

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        if not ops:  # the last stage: its output feeds the loss
            return ops
        self._sent[fwd_chunk_id] = [weakref.ref(op.tensor) for op in ops]
        outputs, _ = self.fwd_cache[fwd_chunk_id]
        for t in outputs:
            if isinstance(t, torch.Tensor):
                free_data(t)
        return ops

    def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                           last_backward: bool = False) -> None:
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        _release(self.args_recv_info[bwd_chunk_id])
        if isinstance(loss, torch.Tensor) and not loss._is_view():
            # the schedule keeps each micro-batch's loss to report it; its graph would keep the inputs (and
            # receive buffers) of the last stage to the end of the step
            loss.detach_()
        if not self.is_last:
            _release(self.grad_recv_info[bwd_chunk_id])
        # the gradient came back, so the peer has this micro-batch's output: a send work still holding the alias
        # (GPipe's until its forwards end, the multi-stage runtime's until the step ends) holds one element
        for ref in self._sent.pop(bwd_chunk_id, []):
            alias = ref()
            if alias is not None:
                free_data(alias)

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        self._sent.clear()
