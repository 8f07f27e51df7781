"""`ParallelModel`: one training step of a parallelised model, as the user calls it on every rank.

A step takes this data-parallel rank's share of the global batch (`local_batch`), runs its
micro-batches (through the pipeline schedule when pp > 1), averages gradients over the
data-parallel group (ZeRO-0/1: by bucket during the last micro-batch's backward, autopar.codegen.grad_overlap;
FSDP does it for ZeRO-2/3), unscales them (fp16), takes the global
gradient norm and clips by it (`max_grad_norm`), steps the user's optimizer (ZeRO-1: on the
parameters this rank owns, then broadcasts them, asynchronously into the next forward:
autopar.codegen.param_prefetch) and returns the global mean loss — identical on
every rank and equal to the single-device mean loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils._pytree import tree_map_only

from autopar.capture.targets import targets_in_batch
from autopar.codegen import state as state_io
from autopar.codegen.batch import MicroBatches, as_call, slice_batch, split_batch
from autopar.codegen.clipping import clip_grads_, global_grad_norm
from autopar.codegen.context_parallel import ContextParallel
from autopar.codegen.data_parallel import Zero1Partition, grad_of, local
from autopar.codegen.dist_optimizer import DistributedOptimizer
from autopar.codegen.experts import ExpertParallel, TokenShardGradients
from autopar.codegen.failures import named_failures
from autopar.codegen.float8 import precompute_fsdp_scales
from autopar.codegen.grad_overlap import OverlappedGradReduce
from autopar.codegen.loss import gather_vocab
from autopar.codegen.model_loss import LossWatch
from autopar.codegen.offload import HostOptimizer
from autopar.codegen.param_prefetch import ParamPrefetch
from autopar.codegen.precision import LossScaler, policy, weight_cast_cache
from autopar.codegen.shared import SharedGradients
from autopar.codegen.tensor_parallel import align_grad_placements
from autopar.codegen.timing import CommClock, StepTimer
from autopar.config import ParallelConfig
from autopar.errors import AutoparError

__all__ = ["ParallelModel"]


class ParallelModel:
    """This rank's share of the model, its optimizer, and the step that trains them.

    `parts` are this rank's pipeline stages `(stage_index, module)` (one when pp = 1), already
    tensor-parallel, recomputing and data-parallel as planned.
    """

    def __init__(self, *, config: ParallelConfig, mesh: DeviceMesh, parts: Sequence[tuple[int, nn.Module]],
                 num_stages: int, schedule, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 optimizer: torch.optim.Optimizer | HostOptimizer | DistributedOptimizer, vocab_parallel: bool,
                 device: torch.device, feed: MicroBatches, shared_gradients: SharedGradients | None = None,
                 float8_fsdp_scales: bool = False, target_name: str | None = None,
                 context: ContextParallel | None = None, grad_mesh: DeviceMesh | None = None,
                 experts: ExpertParallel | None = None,
                 token_shard_gradients: TokenShardGradients | None = None,
                 zero1: Zero1Partition | None = None, max_grad_norm: float | None = None,
                 loss_scaler: LossScaler | None = None) -> None:
        self.config = config
        self.mesh = mesh
        self.parts = tuple(parts)
        self.num_stages = num_stages
        self.schedule = schedule
        self.loss_fn = loss_fn
        # the user's optimizer (LR schedulers drive it); under offload="optimizer" it steps host masters and
        # the HostOptimizer around it (`stepper`) moves gradients and weights; under ZeRO-1 with a 16-bit policy
        # it steps the owned fp32 masters, the DistributedOptimizer around it holding them and the main gradients
        self.optimizer: torch.optim.Optimizer = (optimizer.optimizer if isinstance(
            optimizer, (HostOptimizer, DistributedOptimizer)) else optimizer)
        self.stepper = optimizer  # what zeroes, steps and checkpoints the optimizer state
        self.vocab_parallel = vocab_parallel
        self.device = device
        self.feed = feed
        self.shared_gradients = shared_gradients
        # FSDP gathers float8 weights: their scales are computed once per step, after the optimizer (torchtitan)
        self.float8_fsdp_scales = float8_fsdp_scales
        self.context = context
        self.grad_mesh = grad_mesh if grad_mesh is not None else mesh["dp"]  # ("dp", "cp") flattened
        self.zero1 = zero1
        self.max_grad_norm = max_grad_norm
        self.loss_scaler = loss_scaler
        # the global gradient norm of the last step, before clipping (None before the first step; inf when
        # an fp16 step overflowed and was skipped)
        self.grad_norm: float | None = None
        self._replicas = (shared_gradients.replicas_counted_elsewhere(self.parts)
                          if shared_gradients is not None else set())
        self.timer: StepTimer | None = None
        self.experts = experts  # expert banks split over EP ranks: their gradients reduced on their own
        self.token_shard_gradients = token_shard_gradients  # MoE blocks on sequence shards: summed over tp
        # the model's own loss (autopar.codegen.model_loss): targets go to forward(..., target_name=targets)
        self.target_name = target_name
        self._watch = LossWatch() if target_name else None
        self._counts: list[torch.Tensor] = []  # tokens each micro-batch's loss averaged over, in order
        # ZeRO-0/1: the dense gradients' all-reduce, by bucket, overlapped with the last micro-batch's backward
        # (autopar.codegen.grad_overlap; `grad_reduce.overlap = False` reduces after backward instead). Built
        # after the optimizer, so its hooks run after the distributed optimizer's main-gradient hook. One rank
        # (dp·cp = 1) averages nothing.
        self.grad_reduce: OverlappedGradReduce | None = None
        if config.zero_stage < 2 and self.grad_mesh.size() > 1:
            expert_ids = {id(p) for p in experts.parameters()} if experts is not None else set()
            uses: dict[int, int] = {}
            for m in self.modules:
                for p in {id(q): q for q in m.parameters()}.values():
                    uses[id(p)] = uses.get(id(p), 0) + 1
            self.grad_reduce = OverlappedGradReduce(
                [p for p in self._parameters() if id(p) not in expert_ids], uses, self.grad_mesh,
                micro_batches=config.num_microbatches)
        # ZeRO-1: the owners' broadcasts after the step run asynchronously, by bucket, each waited for in the
        # next forward by the first module that needs it (autopar.codegen.param_prefetch; `param_prefetch.overlap
        # = False` broadcasts after the step instead). Whatever reads parameters outside a forward calls
        # `wait_pending` first.
        self.param_prefetch = ParamPrefetch(zero1, self.modules) if zero1 is not None else None

    # ---- where this rank sits ----
    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.config.dp

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def modules(self) -> tuple[nn.Module, ...]:
        return tuple(m for _, m in self.parts)

    @property
    def has_first_stage(self) -> bool:
        return any(i == 0 for i, _ in self.parts)

    @property
    def has_last_stage(self) -> bool:
        return any(i == self.num_stages - 1 for i, _ in self.parts)

    @property
    def local_batch_size(self) -> int:
        return self.config.micro_batch_size * self.config.num_microbatches

    def local_batch(self, batch: Any) -> Any:
        """This data-parallel rank's contiguous slice of a global batch: a tensor, a tuple or a dict, nested
        (`autopar.codegen.batch`); tensors without the batch's dim 0 are kept whole."""
        n, size = self.local_batch_size, self.config.global_batch_size
        return slice_batch(batch, self.dp_rank * n, (self.dp_rank + 1) * n, size, what="the global batch",
                           how=f"The plan is for {size} samples (dp·mbs·m = {self.config.dp}·"
                               f"{self.config.micro_batch_size}·{self.config.num_microbatches}).")

    def _micro_batches(self, batch: Any, what: str) -> list[Any]:
        return split_batch(batch, self.config.num_microbatches, self.local_batch_size, what=what,
                           how=f"This rank's share is {self.local_batch_size} samples (mbs·m = "
                               f"{self.config.micro_batch_size}·{self.config.num_microbatches}); "
                               "pass pm.local_batch(global_batch).")

    def _parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once (stages on one rank may share some)."""
        return list({id(p): p for m in self.modules for p in m.parameters()}.values())

    # ---- training ----
    def train(self, mode: bool = True) -> ParallelModel:
        for m in self.modules:
            m.train(mode)
        return self

    def eval(self) -> ParallelModel:
        return self.train(False)

    def _loss_context(self):
        """Around every forward and backward of a step on the model's own loss: its loss calls are watched, and
        under tensor parallelism a cross-entropy of vocab-sharded logits runs vocab-parallel (DTensor's
        loss_parallel, Megatron's parallel cross-entropy)."""
        stack = ExitStack()
        stack.enter_context(self._watch)
        if self.vocab_parallel:
            stack.enter_context(loss_parallel())
        return stack

    def own_loss(self, out: torch.Tensor) -> torch.Tensor:
        """Backward target of one micro-batch on the model's own loss: its loss summed over its tokens (the
        token count is kept for the step's divisor)."""
        loss = out.reshape(())  # a stage's last part returns model_loss.stage_loss: the loss, shape [1]
        summed, count = self._watch.take(loss)
        self._counts.append(count.cpu())
        return summed

    def _batch(self, inputs: Any, targets: Any, what: str) -> tuple[Any, Any]:
        """(inputs, targets) of a step: on the model's own loss the targets may sit in the inputs dict."""
        inputs, targets = targets_in_batch(inputs, targets, self.target_name, where=what)
        if targets is None:
            inside = (f", or in the inputs dict as {self.target_name!r} (what a data collator yields)"
                      if self.target_name is not None else "")
            raise AutoparError(f"{what}(inputs, targets) got no targets; pass them as its second argument{inside}")
        return inputs, targets

    def _run(self, inputs: Any, targets: Any, *, backward: bool) -> torch.Tensor:
        """This rank's mean loss over its micro-batches (0 on ranks without the last stage); on the model's own
        loss, the sum over this rank's tokens (`_counts` counts them). The weights are cast to the compute
        dtype once for all micro-batches (precision.weight_cast_cache)."""
        with weight_cast_cache(self.device, policy(self.config.precision)):
            return self._run_passes(inputs, targets, backward=backward)

    def _run_passes(self, inputs: Any, targets: Any, *, backward: bool) -> torch.Tensor:
        m = self.config.num_microbatches
        if self.context is not None:  # this cp rank's two chunks of every sequence (padded to a multiple)
            inputs, targets = self.context.split(inputs, targets)
        self.feed.set(self._micro_batches(inputs, "train_step's inputs"),
                      self._micro_batches(targets, "train_step's targets"), self.device)
        if self.target_name is not None:
            self._counts = []
            with self._loss_context():
                return self._run_own_loss(backward=backward)
        if self.schedule is None:
            # FSDP keeps its gradient sync on: each micro-batch's backward reduce-scatters and the shards sum,
            # rather than every rank holding the whole unsharded gradient in fp32 until the step's last
            # (autopar.planner.dp_costs prices the reduce-scatters, memory_costs the sharded gradients)
            part = self.modules[0]
            total = torch.zeros((), device=self.device)
            for i in range(m):
                args, kwargs = self.feed.call(i)
                if backward:
                    loss = self.loss_fn(part(*args, **kwargs), self.feed.target(i))
                    (loss * (self._scale / m)).backward()
                else:
                    loss = self.loss_fn(part(*args, **kwargs), self.feed.target(i))
                total += loss.detach().float()
            return total / m
        losses: list[torch.Tensor] = []
        index = torch.arange(m, device=self.device)  # stages and the loss read micro-batch i from the feed
        args = (index,) if self.has_first_stage else ()
        target = index if self.has_last_stage else None
        run = self.schedule.step if backward else self.schedule.eval
        run(*args, target=target, losses=losses)
        if not self.has_last_stage:
            return torch.zeros((), device=self.device)
        # each is loss / m (build_schedule), times the loss scale under fp16 (train and eval alike)
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self._scale

    def _run_own_loss(self, *, backward: bool) -> torch.Tensor:
        m = self.config.num_microbatches
        if self.schedule is None:
            part = self.modules[0]
            total = torch.zeros((), device=self.device)
            for i in range(m):
                args, kwargs = self.feed.call(i)
                summed = self.own_loss(part(*args, **{**kwargs, self.target_name: self.feed.target(i)}))
                if backward:
                    (summed * self._scale).backward()
                total += summed.detach().float()
            return total
        losses: list[torch.Tensor] = []
        index = torch.arange(m, device=self.device)  # stages read micro-batch i's inputs and targets from the feed
        run = self.schedule.step if backward else self.schedule.eval
        run(*((index,) if self.has_first_stage else ()), target=index if self.has_last_stage else None,
            losses=losses)
        if not self.has_last_stage:
            return torch.zeros((), device=self.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self._scale  # fp16: scaled

    def _own_loss_totals(self, local_sum: torch.Tensor) -> tuple[float, float]:
        """(global loss, gradient divisor) of a step on the model's own loss: the summed losses and token counts
        of the last stage's ranks over the whole job (tp ranks hold copies of both); a loss with reduction="sum"
        counts no tokens and is divided by nothing."""
        last = 1.0 if self.has_last_stage else 0.0
        # the step's micro-batches are the last m losses computed: a pipeline's first step also runs the loss
        # once in the stage's shape inference, which the schedule leaves out of its losses
        counts = self._counts[-self.config.num_microbatches:]
        tokens = torch.stack(counts).sum() if counts else torch.zeros(())
        totals = torch.stack([t.reshape(()).float().to(self.device) * last for t in (local_sum, tokens)])
        dist.all_reduce(totals)
        loss_sum, tokens_all = float(totals[0]) / self.config.tp, float(totals[1]) / self.config.tp
        if tokens_all == 0:  # a sum-reduced loss (or a batch whose every target is ignored)
            return loss_sum, 1.0
        return loss_sum / tokens_all, tokens_all

    @torch.no_grad()
    def _scale_gradients(self, factor: float) -> None:
        for p in self._parameters():
            if (g := grad_of(p)) is not None:
                g.mul_(factor)

    def _global_mean(self, local_loss: torch.Tensor) -> float:
        """Mean over data-parallel ranks; every tensor-parallel rank of the last stage holds a copy, and the
        values of a context-parallel group sum to cp times its mean (`ContextParallel.loss`)."""
        loss = local_loss.reshape(1).to(self.device)
        dist.all_reduce(loss)
        return float(loss.item() / (self.config.dp * self.config.tp * self.config.cp))

    def train_step(self, inputs: Any, targets: Any = None) -> float:
        """One optimizer step on this rank's local batch; returns the global mean loss.

        inputs: a tensor (`model(x)`), a tuple (`model(*inputs)`) or a dict (`model(**inputs)`), nested;
        targets: whatever `loss_fn(logits, targets)` takes. Both are split along dim 0 into micro-batches.
        On the model's own loss the targets may instead sit in the inputs dict under the forward's target
        argument (`labels`, as a data collator yields them): `train_step(batch)` trains on `model(**batch).loss`.
        """
        self.train()
        timer = self.timer
        # checked before the step's failure watch: bad input raises alike on every rank before any collective,
        # and must not be read as the standing failure of a peer that raised the same a moment earlier
        inputs, targets = self._batch(inputs, targets, "train_step")
        with named_failures("train_step"), timer.step() if timer else nullcontext():
            self.stepper.zero_grad(set_to_none=True)
            if self.grad_reduce is not None:
                self.grad_reduce.start()
            with timer.phase("forward_backward") if timer else nullcontext():
                local_loss = self._run(inputs, targets, backward=True)
            with timer.phase("grad_sync") if timer else nullcontext():
                if self.config.tp > 1:
                    align_grad_placements(self._parameters())
                if self.grad_reduce is not None:  # ZeRO-0/1: what backward did not launch, then wait for all
                    self.grad_reduce.finish()
                if self.experts is not None:
                    self.experts.sync_gradients()
                if self.token_shard_gradients is not None:
                    self.token_shard_gradients.sync()
                if self.shared_gradients is not None:
                    self.shared_gradients.sync(self.modules)
                if self.target_name is not None:  # gradients are dp-averaged sums over tokens: make them the mean
                    own_loss, divisor = self._own_loss_totals(local_loss)
                    self._scale_gradients(self.config.dp / divisor)
            with timer.phase("optimizer") if timer else nullcontext():
                self._step()
                if self.float8_fsdp_scales:
                    precompute_fsdp_scales(self.modules)
            with timer.phase("loss") if timer else nullcontext():
                return own_loss if self.target_name is not None else self._global_mean(local_loss)

    @property
    def _scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def _step(self) -> None:
        """Unscale (fp16), take the global norm and clip, step the optimizer (skipped on overflow), ZeRO-1's
        broadcast."""
        self.wait_pending("optimizer step")  # the buckets no forward waited for (modules that did not run)
        params = self._parameters()
        scaler = self.loss_scaler
        if scaler is not None:
            scaler.unscale_(local(g) for p in params if (g := grad_of(p)) is not None)
        # every step: what practitioners log, what fp16's overflow check needs, what clipping scales by
        self.grad_norm = global_grad_norm(params, self.mesh, self._replicas, self.experts)
        if self.zero1 is not None:  # counted in the norm; stepped by their owners (and none left for next step)
            self.zero1.drop_unowned_grads()
        if scaler is not None:
            overflow = not math.isfinite(self.grad_norm)
            scaler.update(overflow)
            if overflow:  # every rank saw the same sum: all skip this step together
                return
        if self.max_grad_norm is not None:
            clip_grads_(params, self.max_grad_norm, self.grad_norm)
        self.stepper.step()
        if self.param_prefetch is not None:  # in flight into the next forward (autopar.codegen.param_prefetch)
            self.param_prefetch.launch()

    def wait_pending(self, where: str = "user") -> None:
        """Complete ZeRO-1's parameter broadcasts still in flight from the last step (they finish in the next
        forward otherwise): call it before reading the weights yourself; state dicts, saves, loads, eval and
        forward call it. A no-op without ZeRO-1 or with nothing in flight."""
        if self.param_prefetch is not None:
            self.param_prefetch.wait_pending(where)

    def updates(self, p: torch.nn.Parameter) -> bool:
        """Whether this rank's optimizer steps `p` (ZeRO-1: the parameters it owns; otherwise all)."""
        return self.zero1 is None or self.zero1.owns(p)

    @contextmanager
    def timing(self) -> Iterator[StepTimer]:
        """Time every `train_step` inside the block, phase by phase and wait by wait (autopar.codegen.timing).

        The process-group entry points are wrapped only inside the block; samples stay on the timer.
        """
        groups = {self.mesh[axis].get_group(): axis for axis in ("tp", "dp", "pp") if self.mesh[axis].size() > 1}
        with CommClock(groups) as clock:
            self.timer = StepTimer(clock)
            try:
                yield self.timer
            finally:
                self.timer = None

    @torch.no_grad()
    def eval_loss(self, inputs: Any, targets: Any = None) -> float:
        """The global mean loss on this rank's local batch (as `train_step` takes it), updating nothing."""
        self.eval()
        inputs, targets = self._batch(inputs, targets, "eval_loss")  # before the watch, as in train_step
        with named_failures("eval_loss"):
            self.wait_pending("eval_loss")
            local = self._run(inputs, targets, backward=False)
            return self._own_loss_totals(local)[0] if self.target_name is not None else self._global_mean(local)

    @torch.no_grad()
    def forward(self, inputs: Any) -> torch.Tensor:
        """Full logits for `inputs` (as `train_step` takes them; the whole batch at once, no pipelining)."""
        self.eval()
        if self.schedule is not None or self.context is not None:
            raise AutoparError("forward() of a pipelined or context-parallel model is not supported; use "
                               "eval_loss(inputs, targets)")
        args, kwargs = as_call(tree_map_only(torch.Tensor, lambda t: t.to(self.device), inputs))
        with named_failures("forward"):
            self.wait_pending("forward")
            logits = self.modules[0](*args, **kwargs)
            return gather_vocab(logits, self.mesh["tp"]) if self.vocab_parallel else logits

    __call__ = forward

    # ---- state ----
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's sharded model state (DTensors where sharded), under the original parameter names: the live
        parameters (16-bit under ZeRO-1 with a 16-bit policy; `full_state_dict` and checkpoints hold the fp32
        masters)."""
        self.wait_pending("state_dict")
        return state_io.model_state(self.modules)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full single-device model state dict on every rank (collective: call it on all ranks)."""
        with named_failures("full_state_dict"):
            self.wait_pending("full_state_dict")
            return state_io.full_model_state(self.modules, self.mesh["pp"], self.stepper)

    def save(self, path: str) -> None:
        """Sharded checkpoint of model and optimizer through torch.distributed.checkpoint (collective)."""
        with named_failures("save"):
            self.wait_pending("save")
            state_io.save(path, self.modules, self.stepper)

    def load(self, path: str) -> None:
        """Load a checkpoint saved by `save` under any layout (tp, pp, dp, ZeRO stage, world size), resharded
        by parameter name (collective). For atomic, verified, resumable checkpoints use
        `autopar.codegen.checkpoint.Checkpointer`."""
        with named_failures("load"):
            self.wait_pending("load")
            state_io.load(path, self.modules, self.stepper, self.updates)
