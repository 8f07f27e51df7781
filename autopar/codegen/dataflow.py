"""What the model's own forward passes between its units, found by running it once on fake tensors.

Pipeline stages run the model's own `forward` (see `pipeline.py`); this module tells each stage
which values it must receive. One dry run of the forward, on fake tensors at the micro-batch
shape, tags every tensor with the *unit calls* it was computed from (its taint):

- a unit with parameters (embedding, block, norm, head) starts a new taint: its outputs carry
  only its own call;
- every other op (top-level glue: adding a position embedding, scaling, building masks,
  rotary tables, slicing) propagates the union of its inputs' taints;
- a parameter-free unit (a rotary-table module; a dropout the model calls at several depths, T5's
  after its embedding and again after its final norm) is *replicated*: it belongs to each place it is
  called and runs on every stage that calls it, its outputs carrying the union of its inputs' taints
  as glue's do;
- the model inputs carry a taint of their own and never cross a cut: every rank reads its own
  micro-batches (ids, masks, decoder ids), so each stage computes from the inputs what it needs.

A unit call of stage s whose inputs carry the taint of a call of stage r < s needs that call's
outputs on every stage r+1..s; so do the model's outputs on the last stage. Those outputs are
what crosses each cut; everything else (glue) is recomputed from them on the stage that uses it,
which is exact because glue is deterministic (random glue is refused under pipelining).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map_only

from autopar.capture.meta import swap_tensors
from autopar.capture.moe import grouped_mm_any_dtype
from autopar.capture.targets import training_forward_kwargs
from autopar.codegen.model_loss import loss_of
from autopar.errors import PlanMismatchError

__all__ = ["CallKey", "LeafMeta", "DataFlow", "StageIO", "trace_dataflow", "forward_kwargs", "model_logits"]

CallKey = tuple[str, int]  # (unit path, how many times it was called before this call)
INPUT = ("<inputs>", 0)  # taint of the model's inputs
_RANDOM_OPS = ("dropout", "rand", "bernoulli", "multinomial", "normal")


@dataclass(frozen=True, kw_only=True)
class LeafMeta:
    """Shape and dtype of one tensor leaf of a unit call's output (None for a non-tensor leaf)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True)
class CallRecord:
    key: CallKey
    spec: TreeSpec  # pytree structure of the output
    leaves: tuple[LeafMeta | Any, ...]  # LeafMeta for tensors, the value itself otherwise
    inputs_taint: frozenset[CallKey]


@dataclass(frozen=True, kw_only=True)
class StageIO:
    """What stage `index` receives (calls of earlier stages) and sends (for later stages), in call order."""

    index: int
    receives: tuple[CallKey, ...]
    sends: tuple[CallKey, ...]

    def nbytes(self, flow: DataFlow, which: str = "sends") -> int:
        """Bytes of the tensors crossing this stage's outgoing (or incoming) cut, per micro-batch."""
        keys = self.sends if which == "sends" else self.receives
        return sum(math.prod(leaf.shape) * leaf.dtype.itemsize
                   for k in keys for leaf in flow.calls[k].leaves if isinstance(leaf, LeafMeta))


@dataclass(frozen=True, kw_only=True)
class DataFlow:
    """The unit calls of one forward, in order, with what each was computed from."""

    order: tuple[CallKey, ...]  # non-replicated unit calls, in call order
    calls: Mapping[CallKey, CallRecord]
    replicated: frozenset[str]  # parameter-free units: run on every stage that calls them
    output_taint: frozenset[CallKey]
    random_glue: tuple[str, ...]  # random ops outside units (recomputing them would draw new numbers)

    @classmethod
    def single_stage(cls) -> DataFlow:
        """The flow of a one-stage layout: nothing crosses a cut, so no dry run is needed."""
        return cls(order=(), calls={}, replicated=frozenset(), output_taint=frozenset(), random_glue=())

    def stages(self, stage_of_unit: Mapping[str, int], num_stages: int) -> tuple[StageIO, ...]:
        """Receive/send sets per stage for units placed by `stage_of_unit` (contiguous in call order)."""
        self._check_order(stage_of_unit)
        last_use: dict[CallKey, int] = {}

        def use(taint: frozenset[CallKey], stage: int) -> None:
            for src in taint:  # the inputs (INPUT) are on every stage: each rank reads its own micro-batches
                if src != INPUT and stage_of_unit[src[0]] < stage:
                    last_use[src] = max(last_use.get(src, -1), stage)

        for key in self.order:
            use(self.calls[key].inputs_taint, stage_of_unit[key[0]])
        use(self.output_taint, num_stages - 1)
        ios = []
        for s in range(num_stages):
            crossing = [k for k in self.order if stage_of_unit[k[0]] < s <= last_use.get(k, -1)]
            leaving = [k for k in self.order if stage_of_unit[k[0]] <= s < last_use.get(k, -1)]
            ios.append(StageIO(index=s, receives=tuple(crossing), sends=tuple(leaving)))
        for io in ios:
            for key in (*io.receives, *io.sends):
                bad = [leaf for leaf in self.calls[key].leaves
                       if isinstance(leaf, LeafMeta) and not leaf.dtype.is_floating_point]
                if bad:
                    raise PlanMismatchError(
                        f"a pipeline cut before stage {io.index} would carry an integer output of module "
                        f"{key[0]!r} ({bad[0].dtype}); pipelining sends only floating-point activations. "
                        "Re-plan with the cut elsewhere (or pp=1)")
        return tuple(ios)

    def _check_order(self, stage_of_unit: Mapping[str, int]) -> None:
        missing = sorted({k[0] for k in self.order} - set(stage_of_unit))
        if missing:
            raise PlanMismatchError(f"modules {missing} run in the model's forward but are in no stage of the plan; "
                                    "re-plan for this model with `autopar plan`")
        seen = -1
        for key in self.order:
            stage = stage_of_unit[key[0]]
            if stage < seen:
                raise PlanMismatchError(
                    f"module {key[0]!r} (stage {stage}) is called after modules of stage {seen}: the stages do not "
                    "follow the model's call order (a module called twice, or cuts out of order). Re-plan with "
                    "`autopar plan`, or use pp=1 for this model")
            seen = stage


class _Taint(TorchFunctionMode):
    """Tags each tensor produced by a torch function with the union of its tensor inputs' tags."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, frozenset[CallKey]] = {}
        self.alive: list[torch.Tensor] = []  # keeps tagged tensors alive, so ids are not reused
        self.depth = 0  # > 0 inside a unit
        self.random_glue: list[str] = []

    def tag(self, value: Any) -> frozenset[CallKey]:
        out: frozenset[CallKey] = frozenset()
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                out |= self.tags.get(id(t), frozenset())
        return out

    def set(self, value: Any, taint: frozenset[CallKey]) -> None:
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self.tags[id(t)] = taint
                self.alive.append(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        taint = self.tag((args, kwargs))
        name = getattr(func, "__name__", "")
        if self.depth == 0 and any(r in name for r in _RANDOM_OPS) and _is_random_call(name, args, kwargs):
            self.random_glue.append(name)
        mutated = name.endswith("_") and not name.endswith("__") or name == "__setitem__"
        if mutated and args and isinstance(args[0], torch.Tensor):
            self.set(args[0], self.tag(args[0]) | taint)
        if taint:
            self.set(out, taint)
        return out


def _is_random_call(name: str, args: tuple, kwargs: dict) -> bool:
    """Dropout counts only when it is active (p > 0 in training)."""
    if "dropout" not in name:
        return True
    p = kwargs.get("p", args[1] if len(args) > 1 and isinstance(args[1], (int, float)) else 0.5)
    training = kwargs.get("training", args[2] if len(args) > 2 and isinstance(args[2], bool) else True)
    return bool(p) and bool(training)


def forward_kwargs(model: nn.Module) -> dict[str, Any]:
    """Keyword arguments every training forward gets (capture.targets.training_forward_kwargs)."""
    return training_forward_kwargs(model)


def model_logits(out: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, `.logits` of a Hugging Face output, `["logits"]` (or the
    one tensor) of a dict, or item 0 of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, Mapping):
        tensors = {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}
        if isinstance(out.get("logits"), torch.Tensor):
            return out["logits"]
        if len(tensors) == 1:
            return next(iter(tensors.values()))
        raise PlanMismatchError(f"the model returned a dict with tensors {sorted(map(str, tensors))} and no 'logits': "
                                "autopar cannot tell which one the loss reads. Return the logits under the key "
                                "'logits' (or alone, or first in a tuple)")
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise PlanMismatchError(f"the model returned a {type(out).__name__}; autopar trains models whose forward returns "
                            "the logits (a tensor, an object with .logits, a dict with 'logits', or a tuple starting "
                            "with them)")


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def trace_dataflow(model: nn.Module, units: Sequence[str], example_inputs: Sequence[Any],
                   example_kwargs: Mapping[str, Any] | None = None, *, own_loss: bool = False) -> DataFlow:
    """Run `model(*example_inputs, **example_kwargs)` once on fake tensors and record the taint of every
    unit call."""
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    mode = _Taint()
    records: dict[CallKey, CallRecord] = {}
    order: list[CallKey] = []
    replicated: set[str] = set()
    counts: dict[str, int] = {}
    pending: dict[str, list[frozenset[CallKey]]] = {}
    handles = []

    def pre(name: str):
        def hook(module, args, kwargs):
            pending.setdefault(name, []).append(mode.tag((args, kwargs)))
            mode.depth += 1
        return hook

    def post(name: str, with_params: bool):
        def hook(module, args, kwargs, out):
            mode.depth -= 1
            inputs_taint = pending[name].pop()
            if not with_params:
                replicated.add(name)  # glue in a module: runs wherever it is called, its taint propagated inside
                return None
            key = (name, counts.get(name, 0))
            counts[name] = key[1] + 1
            leaves, spec = tree_flatten(out)
            metas = tuple(LeafMeta(shape=tuple(t.shape), dtype=t.dtype) if isinstance(t, torch.Tensor) else t
                          for t in leaves)
            records[key] = CallRecord(key=key, spec=spec, leaves=metas, inputs_taint=inputs_taint)
            order.append(key)
            mode.set(out, frozenset({key}))
            return None
        return hook

    for name in units:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name, _has_params(module)), with_kwargs=True))
    try:
        with fake, swap_tensors(model, fake.from_tensor), grouped_mm_any_dtype():
            inputs, kwargs = tree_map_only(torch.Tensor, fake.from_tensor,
                                           (tuple(example_inputs), dict(example_kwargs or {})))
            with mode:
                mode.set((inputs, kwargs), frozenset({INPUT}))
                out = model(*inputs, **{**forward_kwargs(model), **kwargs})
                output_taint = mode.tag(loss_of(out) if own_loss else model_logits(out))  # what the last stage returns
    except PlanMismatchError:
        raise
    except Exception as e:
        raise PlanMismatchError(
            f"pipelining runs {type(model).__name__}'s forward once on fake tensors to find what crosses each "
            f"stage cut, and it failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}. "
            "A forward that reads tensor values (.item(), data-dependent shapes) cannot be cut into stages; "
            "use pp=1 for this model") from e
    finally:
        for h in handles:
            h.remove()
    return DataFlow(order=tuple(order), calls=records, replicated=frozenset(replicated), output_taint=output_taint,
                    random_glue=tuple(dict.fromkeys(mode.random_glue)))
