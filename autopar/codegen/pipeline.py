"""Pipeline stages that run the model's own forward, and the `torch.distributed.pipelining` schedule over them.

A stage is a pruned copy of the model (same class, same module paths, so parameter names, state
dicts and checkpoints stay those of the single-device model) in which the units of other stages
are replaced by stand-ins. Its forward is the model's own `forward`, run from the top:

- a unit of an earlier stage returns what that stage sent for this call (`dataflow.py` decides
  which calls' outputs cross each cut), or, when nothing downstream reads it, a zero tensor of its
  shape (the glue computed from it is never used);
- the units of this stage run for real; their outputs that later stages read are kept;
- the first call of a unit of a later stage ends the stage, which returns what it must send.
Glue between units (position embeddings added beside the token embedding, scaled embeddings,
masks, rotary tables, a tied head) therefore runs exactly as the model wrote it, on every stage
that needs it. With pp = 1 the one stage is the model itself.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from autopar.capture.graph import ModelGraph
from autopar.capture.meta import swap_tensors
from autopar.capture.moe import grouped_mm_any_dtype
from autopar.codegen.batch import MicroBatches
from autopar.codegen.dataflow import CallKey, DataFlow, LeafMeta, StageIO, forward_kwargs, model_logits
from autopar.codegen.grouped_schedule import ScheduleGroupedInterleaved1F1B
from autopar.codegen.inflight_stage import InflightStage
from autopar.codegen.model_loss import stage_loss
from autopar.errors import PlanMismatchError
from autopar.plan import Plan

__all__ = ["layer_modules", "stage_of_units", "build_stage", "dry_run_stage", "check_stage_placement",
           "build_schedule"]


def layer_modules(graph: ModelGraph, name: str) -> tuple[str, ...]:
    """Module paths (units) making up layer `name`: the layer's own path when it is a module, else its modules."""
    layer = graph.layer(name)
    return layer.modules or (layer.name,)


def stage_of_units(graph: ModelGraph, plan: Plan) -> dict[str, int]:
    """unit path → index of the stage holding it."""
    return {unit: stage.index for stage in plan.stages for name in stage.layers for unit in layer_modules(graph, name)}


def _index_of(t: torch.Tensor) -> int:
    """The micro-batch index a stage received (-1 for the runtime's shape-inference run on empty buffers)."""
    with unset_fake_temporarily():  # the dry run (dry_run_stage) passes a real index under FakeTensorMode
        value = float(t.reshape(-1)[0])
    return int(value) if math.isfinite(value) and value == int(value) else -1


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on its gradient in one block of memory: the gradient a stage sends back
    for what it received comes out of autograd in whatever layout the stage's first ops give it (a transpose
    for a batch norm over channels, an attention's permute), and a send needs it contiguous."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class _StageExit(Exception):  # noqa: N818 - control flow, never seen by users
    """Raised by the first unit of a later stage: this stage's part of the forward is done."""


class _StandIn(nn.Module):
    """Takes the place of a unit that lives on another stage (holds no parameters).

    What the model's forward reads of it other than calling it (a parameter's dtype, device or shape, a
    config attribute, a submodule) is read from the unit itself, which this stage does not own: its
    weights are in none of this stage's parameters, state dict or optimizer.
    """

    def __init__(self, unit: str, runner: _StageRunner, original: nn.Module) -> None:
        super().__init__()
        self.unit = unit
        object.__setattr__(self, "_runner", runner)  # not a submodule: no state of its own
        object.__setattr__(self, "_original", original)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_original"], name)

    def forward(self, *args, **kwargs):
        return self._runner.stand_in(self.unit)

    def extra_repr(self) -> str:
        return f"stand-in for {self.unit}"


def _prune(module: nn.Module, prefix: str, replace: Mapping[str, nn.Module]) -> nn.Module:
    """A shallow copy of `module` whose descendants named in `replace` are swapped; kept subtrees are shared.

    Copied modules get their own parameter, buffer, child and hook tables, so hooks and sharding
    applied to one stage's copy never leak into another's or into the original model.
    """
    if prefix in replace:
        return replace[prefix]
    if not any(d.startswith(prefix + ".") or not prefix for d in replace):
        return module
    clone = copy.copy(module)
    clone.__dict__ = {k: (copy.copy(v) if k.startswith("_") and isinstance(v, (dict, set)) else v)
                      for k, v in module.__dict__.items()}
    clone._modules = {name: _prune(child, f"{prefix}.{name}" if prefix else name, replace)
                      for name, child in module._modules.items()}
    return clone


class _StageRunner:
    """Per-forward bookkeeping of one stage: calls seen, values received, outputs to send."""

    def __init__(self, *, flow: DataFlow, io: StageIO, stage_of_unit: Mapping[str, int], num_stages: int,
                 device: torch.device, forward: Callable[..., Any], kwargs: dict[str, Any],
                 feed: MicroBatches, target_name: str | None = None) -> None:
        self.flow, self.io, self.stage_of_unit = flow, io, stage_of_unit
        # the forward argument that takes each micro-batch's targets, when the model computes its own loss: the
        # last stage then returns that loss (model_loss.stage_loss) rather than the logits
        self.target_name = target_name
        self.index, self.num_stages = io.index, num_stages
        self.forward, self.kwargs, self.feed = forward, kwargs, feed
        self._sends = set(io.sends)
        self.counts: dict[str, int] = {}
        self.received: dict[CallKey, Any] = {}
        self.produced: dict[CallKey, Any] = {}
        self.device = device

    def _next_key(self, unit: str) -> CallKey:
        key = (unit, self.counts.get(unit, 0))
        self.counts[unit] = key[1] + 1
        return key

    def stand_in(self, unit: str) -> Any:
        if torch._C._current_graph_task_id() != -1:  # called again by a backward: a checkpoint replaying
            raise PlanMismatchError(
                f"module {unit!r}, which the plan puts on another pipeline stage, was called again during "
                f"backward on stage {self.index}: the model checkpoints its own activations "
                "(torch.utils.checkpoint) around modules this plan cuts between stages, and the replay cannot "
                "reach the other stage. Re-plan with `autopar plan` (capture keeps each checkpointed call in "
                "one layer), or use pp=1")
        if self.stage_of_unit[unit] > self.index:
            raise _StageExit
        key = self._next_key(unit)
        if key in self.received:
            return self.received[key]
        record = self.flow.calls[key]
        leaves = [torch.zeros(m.shape, dtype=m.dtype, device=self.device) if isinstance(m, LeafMeta) else m
                  for m in record.leaves]
        return tree_unflatten(leaves, record.spec)

    def record_output(self, unit: str, out: Any) -> None:
        key = self._next_key(unit)
        if key in self._sends:
            self.produced[key] = out

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """One micro-batch's forward. With one stage, `args`/`kwargs` are the model's inputs. Pipelined,
        the first stage gets the micro-batch index and the others what the previous stage sent, the index
        last; every stage reads the micro-batch's inputs from `feed` (each rank holds its share of the batch)."""
        self.counts, self.received, self.produced = {}, {}, {}
        index = None
        if self.num_stages > 1:
            index = _index_of(args[-1] if self.index > 0 else args[0])
            if self.index > 0:
                self._unpack(args[:-1])
            args, kwargs = self.feed.call(index)
            if self.target_name is not None:  # every stage: a decoder's ids may be its labels, shifted inside
                kwargs = {**kwargs, self.target_name: self.feed.target(index)}
        own_loss = self.target_name is not None and self.target_name in kwargs
        try:
            out = self.forward(*args, **{**self.kwargs, **kwargs})
        except _StageExit:
            sends = self._pack()
            # nothing of this micro-batch stays here once sent: the runtime frees what it sends (inflight_stage.py)
            self.received, self.produced = {}, {}
            return (*sends, torch.tensor([float(index)], device=self.device))
        self.received, self.produced = {}, {}
        if self.index != self.num_stages - 1:
            raise PlanMismatchError(f"the model's forward ended inside pipeline stage {self.index} of "
                                    f"{self.num_stages}; the later stages' modules were never called. Re-plan "
                                    "for this model with `autopar plan` (or use pp=1)")
        return stage_loss(out) if own_loss else model_logits(out)

    def _unpack(self, args: Sequence[torch.Tensor]) -> None:
        it = iter(args)
        for key in self.io.receives:
            record = self.flow.calls[key]
            leaves = [_received(next(it)) if isinstance(m, LeafMeta) else m for m in record.leaves]
            self.received[key] = tree_unflatten(leaves, record.spec)

    def _pack(self) -> tuple[torch.Tensor, ...]:
        out: list[torch.Tensor] = []
        for key in self.io.sends:
            value = self.received.get(key, self.produced.get(key))
            if value is None and key not in self.received:
                raise PlanMismatchError(f"pipeline stage {self.index} never produced the output of {key[0]!r} "
                                        "that a later stage reads; re-plan with `autopar plan`")
            leaves, _ = tree_flatten(value)
            # a value passed through unchanged leaves as a view, so backward sees an op of this stage; a produced
            # one in one block of memory, as send needs (T5's position bias leaves its block permuted)
            out.extend(t.view_as(t) if key in self.received else t.contiguous() for t in leaves
                       if isinstance(t, torch.Tensor))
        return tuple(out)


def _received(t: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(t) if t.requires_grad else t


def build_stage(model: nn.Module, flow: DataFlow, ios: Sequence[StageIO], stage_of_unit: Mapping[str, int],
                index: int, *, device: torch.device, feed: MicroBatches,
                target_name: str | None = None, kwargs: Mapping[str, Any] | None = None) -> nn.Module:
    """Stage `index` as a pruned copy of `model` whose forward sends/receives what `ios` says and reads
    the model's inputs from `feed`.

    With one stage in all, the model itself (its forward then takes the model's inputs and returns the logits).
    `kwargs`: more keyword arguments of every forward call (the shard's position ids under context parallelism).
    """
    num_stages = len(ios)
    io = ios[index]
    if num_stages > 1 and flow.random_glue:
        raise PlanMismatchError(
            f"the model's forward draws random numbers outside its modules ({', '.join(flow.random_glue)}); under "
            "pipelining that code runs again on later stages and would draw different numbers. Move it into a "
            "module (e.g. nn.Dropout) or use pp=1")
    forward = type(model).forward
    runner = _StageRunner(flow=flow, io=io, stage_of_unit=stage_of_unit, num_stages=num_stages,
                          device=device, forward=lambda *a, **k: None,
                          kwargs={**forward_kwargs(model), **(kwargs or {})}, feed=feed, target_name=target_name)
    others = {u for u, s in stage_of_unit.items() if s != index and u not in flow.replicated}
    stand_ins = {u: _StandIn(u, runner, model.get_submodule(u)) for u in others}
    stage = _prune(model, "", stand_ins) if others else model
    runner.forward = forward.__get__(stage)
    for unit, s in stage_of_unit.items():
        if s == index and any(k[0] == unit for k in io.sends):
            stage.get_submodule(unit).register_forward_hook(
                lambda mod, args, out, unit=unit: runner.record_output(unit, out))
    stage.forward = runner.run  # the instance attribute: the stage protocol around the model's own forward
    return stage


def dry_run_stage(stage: nn.Module, flow: DataFlow, io: StageIO, feed: MicroBatches,
                  call: tuple[tuple, dict[str, Any]], targets: Any = None) -> None:
    """Run pipeline stage `io.index`'s own pruned program once on fake tensors (one micro-batch's inputs
    `call`, its `targets` on the model's own loss, zeros for what it receives), so whatever it cannot run (an
    attribute of a unit it does not hold, a shape it gets wrong) is a clear error at `parallelize`, before any
    rank trains."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    index = torch.zeros(1)  # a real tensor: the stage reads its value
    try:
        with fake, swap_tensors(stage, fake.from_tensor), grouped_mm_any_dtype():  # MoE experts in any dtype
            feed.inputs = [tree_map_only(torch.Tensor, fake.from_tensor, call)]
            feed.targets = [tree_map_only(torch.Tensor, fake.from_tensor, targets)] if targets is not None else []
            received = [torch.zeros(leaf.shape, dtype=leaf.dtype) for key in io.receives
                        for leaf in flow.calls[key].leaves if isinstance(leaf, LeafMeta)]
            stage(*received, index)
    except PlanMismatchError:
        raise
    except Exception as e:
        raise PlanMismatchError(
            f"pipeline stage {io.index} cannot run its part of the model's forward: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:300] if str(e) else ''}. Re-plan with the cut elsewhere, or use pp=1 for this "
            "model") from e
    finally:
        feed.inputs, feed.targets = [], []


def check_stage_placement(plan: Plan) -> None:
    """Schedules place stage i on pipeline rank i mod pp (looping placement for interleaving)."""
    pp = plan.config.pp
    for stage in plan.stages:
        if stage.pp_rank != stage.index % pp:
            raise PlanMismatchError(
                f"plan stage {stage.index} is on pp rank {stage.pp_rank}; the pipelining schedules need "
                f"stage i on rank i mod pp = {stage.index % pp}; re-plan with this autopar version"
            )


def build_schedule(plan: Plan, stage_modules: Sequence[tuple[int, nn.Module]], pp_mesh: DeviceMesh,
                   device: torch.device, loss_fn, feed: MicroBatches, *, per_microbatch_mean: bool = True):
    """The planned schedule over this rank's stages `[(stage_index, module), ...]`.

    Each micro-batch's loss is divided by the number of micro-batches before backward, so the
    gradients are those of the mean over the whole batch (the losses the schedule reports are
    summed, not averaged, to get that mean). The schedule's own `scale_grads` would divide each
    stage's gradients after backward instead, twice for a weight two stages of this rank share.
    Its stages hold receive buffers and outputs for the micro-batches in flight only (inflight_stage.py).
    The schedule is stepped with the micro-batch indices as input and target (`ParallelModel`), and
    the loss reads micro-batch i's targets, whatever their structure, from `feed`.
    With `per_microbatch_mean=False` (the model's own loss, summed over its tokens) nothing is divided here.
    """
    cfg = plan.config
    m = cfg.num_microbatches
    group = pp_mesh.get_group()
    stages = [InflightStage(mod, index, len(plan.stages), device, group=group) for index, mod in stage_modules]

    def scaled_loss(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(output, feed.target(_index_of(index)))
        return loss / m if per_microbatch_mean else loss

    if cfg.schedule == "interleaved_1f1b" and cfg.microbatch_group is not None:
        schedule = ScheduleGroupedInterleaved1F1B(stages, n_microbatches=m, microbatch_group=cfg.microbatch_group,
                                                  loss_fn=scaled_loss, scale_grads=False)
    elif cfg.schedule == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=scaled_loss, scale_grads=False)
    else:
        cls = ScheduleGPipe if cfg.schedule == "gpipe" else Schedule1F1B
        schedule = cls(stages[0], n_microbatches=m, loss_fn=scaled_loss, scale_grads=False)
    _keep_buffers_through_shape_inference(schedule, [mod for _, mod in stage_modules])
    return schedule


def _keep_buffers_through_shape_inference(schedule, modules: Sequence[nn.Module]) -> None:
    """The pipelining runtime infers its stages' shapes by running each once more (at the first step, and
    again after switching between training and evaluation), on uninitialised buffers; buffers a forward
    updates (batch norm's running statistics) must not see that run, so they are restored after it."""
    init = getattr(schedule, "_initialize_pp_stages", None)
    if init is None:
        raise PlanMismatchError(f"this torch ({torch.__version__}) has no pipelining stage initialisation autopar "
                                "can guard; use the torch version in autopar's requirements, or pp=1")
    buffers = list({id(b): b for mod in modules for b in mod.buffers()}.values())

    def initialise(*args, **kwargs):
        saved = [b.detach().clone() for b in buffers]
        try:
            return init(*args, **kwargs)
        finally:
            with torch.no_grad():
                for b, value in zip(buffers, saved, strict=True):
                    b.copy_(value)

    schedule._initialize_pp_stages = initialise
