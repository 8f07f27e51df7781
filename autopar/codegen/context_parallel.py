"""Context parallelism: every sequence split across the ranks of a cp group, attention exchanged by all-gather.

Layout (docs/design.md §8, load-balanced for causal masks as in Llama 3 and Megatron-LM): a sequence of
S tokens (padded to a multiple of 2·cp) is cut into 2·cp chunks of c = S/(2·cp) tokens and cp rank r
holds chunks r and 2·cp−1−r, so under a causal mask every rank has the same attention work.

Attention: each call of `F.scaled_dot_product_attention` inside a stage (the fused path of transformers'
sdpa attention included) is replaced by `ContextParallel.attend`: the local keys and values (at the key/value head count
the model hands SDPA, so grouped-query attention exchanges only its kv heads) are all-gathered over the cp
group in one collective and put in global order; each of the rank's two query chunks then attends only
the keys up to its own end, causally (chunk g of c tokens: a c × (g+1)·c block, lower-right aligned), so
a rank computes c²·(2·cp + 1) scores where the causal triangle holds 2·cp·c² per rank, (1 + 1/(2·cp))×
its share (autopar.planner.cp_costs prices that), not the (2c) × (2·cp·c) rectangle. On the CPU both chunks
run in one custom op (`cp_chunk_attention`, codegen/cp_attention.py) as flash kernels over each chunk's prefix
and its causal diagonal block, merged by log-sum-exp, so no [c, (g+1)·c] mask exists to be saved; elsewhere
(a GPU, dropout) SDPA is handed that mask and saves it, c²·(2·cp + 1) elements per layer that the plan does
not price. Backward returns
the keys' and values' gradients to their owners by a reduce-scatter. Both collectives are custom ops
(`gather_kv`, `scatter_kv_grad`) so that torch.compile traces a block's attention around them (compile.py);
the selective recompute policies keep the gather's output, full recompute runs it again; selective recomputes
the chunks' attention, op_sac keeps its output (codegen/recompute.py). The all-gather is
what Llama 3 ran (Dubey et al. 2024, §3.3.2): with GQA the K/V bytes are small next to the queries, and
an all-gather is one collective per layer where a ring takes cp − 1 steps.

The model sees its shard's tokens and their global positions (`position_ids`), so rotary tables and
position embeddings are those of the global sequence, and, when its forward takes one, an
`attention_mask` of ones (every token is real: padding is dropped by the loss), so that a model that
infers packed sequences from jumps in the positions (transformers does) still masks causally. A mask
the model builds over its shard that is causal inside each chunk is taken for the global causal mask.
Any other mask (padding, sliding windows, prefix-LM) cannot be sliced this way and is refused, naming
the module; so are modules whose attention does not go through SDPA (found in the captured graph) and
local windows shorter than the sequence.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map_only

from autopar.capture.graph import ModelGraph
from autopar.codegen import cp_attention
from autopar.codegen.loss import IGNORE_INDEX
from autopar.errors import PlanMismatchError

__all__ = ["SequenceShard", "padded_length", "shard_positions", "check_context_parallel",
           "ContextParallel"]


def _rank_order(local_len: int, cp: int) -> torch.Tensor:
    """Global position of each index of the gathered sequence (the cp ranks' shards stacked in rank order)."""
    return torch.cat([shard_positions(local_len * cp, cp, r) for r in range(cp)])


_AGREED: set[tuple] = set()  # (group, module, K/V shape) the cp ranks have checked they share
# Names of the modules whose forward is context-parallel. The gather gets a module's index as a 0-d tensor, not
# its name: a compiled block then takes it as an input where a string would be a constant that dynamo guards on,
# compiling every block again (identical blocks otherwise share one compiled graph).
_UNIT_NAMES: list[str] = []


def _unit_index(where: str) -> torch.Tensor:
    if where not in _UNIT_NAMES:
        _UNIT_NAMES.append(where)
    return torch.tensor(_UNIT_NAMES.index(where))


def _agree(where: str, kv: torch.Tensor, key_dim: int, group: dist.ProcessGroup, group_name: str) -> None:
    """Once per module and shape: the cp ranks exchange K/V of one shape (else a clear error, not a crash)."""
    mine = (where, tuple(kv.shape), key_dim)
    if (group_name, *mine) in _AGREED:
        return
    shapes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(shapes, mine, group=group)
    if any(s != mine for s in shapes):
        raise PlanMismatchError(
            f"{where}: the context-parallel ranks attend with keys/values of different shapes (module, keys+values "
            f"[b, kv_heads, s, d_k+d_v], d_k: {shapes}); the model computes attention differently on different "
            "sequence shards. Use cp=1 for this model")
    _AGREED.add((group_name, *mine))


# The K/V exchange as two custom ops: torch.compile (dynamo, AOTAutograd, Inductor) sees each as one opaque op
# with its shape function and traces the rest of the attention (index arithmetic, the chunks' SDPA) as usual;
# eager autograd and the recompute policies see one op too (codegen/recompute.py saves its output under
# selective and op_sac; full recompute runs it again). Collectives are issued with dispatch modes off.
@torch.library.custom_op("autopar::cp_gather_kv", mutates_args=())
def gather_kv(key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, unit: torch.Tensor, group_name: str,
              cp: int) -> torch.Tensor:
    """Keys and values of this rank's shard ([b, kv_heads, s, d_k], [b, kv_heads, s, d_v]) → those of the whole
    sequence in global order, side by side ([b, kv_heads, cp·s, d_k + d_v]). They are joined here, inside the op,
    so no recompute policy keeps a joined copy of the shard's. `mask` (the model's mask over its shard, or None)
    is checked here, on the values, to be causal inside each chunk (`unit`: the index of the module's name,
    for errors)."""
    s, where = key.size(2), _UNIT_NAMES[int(unit)]
    if mask is not None and not _is_shard_causal(mask, s):
        raise PlanMismatchError(
            f"{where}: its attention mask is not causal over the sequence (a padding mask, a sliding window "
            "narrower than a chunk, or a bias), so it cannot be split across context-parallel ranks. Use "
            "cp=1, or drop the mask")
    group = _resolve_process_group(group_name)
    with _disable_current_modes():
        kv = torch.cat([key, value], dim=-1)
        _agree(where, kv, key.size(-1), group, group_name)
        out = kv.new_empty((cp * kv.size(0), *kv.shape[1:]))  # ranks' tensors stacked along dim 0
        dist.all_gather_single(out, kv, group=group)
        del kv
        ranked = torch.cat(out.chunk(cp, dim=0), dim=2)
        del out
        # rank order → global order: position p sits at index order[p] of the gathered sequence
        return ranked.index_select(2, torch.argsort(_rank_order(s, cp)).to(key.device))


@gather_kv.register_fake
def _(key, value, mask, unit, group_name, cp):
    return key.new_empty((*key.shape[:2], cp * key.size(2), key.size(3) + value.size(3)))


@torch.library.custom_op("autopar::cp_scatter_kv_grad", mutates_args=())
def scatter_kv_grad(grad: torch.Tensor, group_name: str, cp: int) -> torch.Tensor:
    """Gradient of the gathered K/V ([b, kv_heads, cp·s, d], global order) → the sum over the cp group of
    this rank's shard's part ([b, kv_heads, s, d]): a reduce-scatter."""
    s = grad.size(2) // cp
    with _disable_current_modes():
        ranked = grad.index_select(2, _rank_order(s, cp).to(grad.device))  # global order → rank order
        parts = torch.cat(ranked.chunk(cp, dim=2), dim=0).contiguous()  # rank r's part: r-th along dim 0
        mine = parts.new_empty((parts.size(0) // cp, *parts.shape[1:]))
        dist.reduce_scatter_single(mine, parts, group=_resolve_process_group(group_name))
        return mine


@scatter_kv_grad.register_fake
def _(grad, group_name, cp):
    return grad.new_empty((*grad.shape[:2], grad.size(2) // cp, grad.size(3)))


def _gather_setup(ctx, inputs, output) -> None:
    ctx.key_dim, ctx.group_name, ctx.cp = inputs[0].size(-1), inputs[4], inputs[5]


def _gather_backward(ctx, grad: torch.Tensor):
    mine = torch.ops.autopar.cp_scatter_kv_grad(grad, ctx.group_name, ctx.cp)
    return mine[..., :ctx.key_dim], mine[..., ctx.key_dim:], None, None, None, None


gather_kv.register_autograd(_gather_backward, setup_context=_gather_setup)


def padded_length(seq_len: int, multiple: int) -> int:
    """The smallest multiple of `multiple` ≥ seq_len (the sequence is padded at its end to that)."""
    return -(-seq_len // multiple) * multiple


def shard_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions held by cp rank `rank` of a sequence of `seq_len` tokens (a multiple of 2·cp):
    chunks `rank` and `2·cp − 1 − rank` of c = seq_len / (2·cp) tokens each."""
    if seq_len % (2 * cp):
        raise PlanMismatchError(f"sequence length {seq_len} is not a multiple of 2·cp = {2 * cp}; pad it first")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


@dataclass(frozen=True, kw_only=True)
class SequenceShard:
    """Where this rank sits in its cp group, and the multiple each sequence is padded to."""

    cp: int
    rank: int
    multiple: int  # 2·cp, times tp under sequence parallelism (each tp rank then holds 1/tp of the shard)

    def local_positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of a local sequence of `local_len` tokens (two chunks of local_len / 2)."""
        return shard_positions(local_len * self.cp, self.cp, self.rank).to(device)

    def split(self, t: torch.Tensor, pad_value: int) -> torch.Tensor:
        """This rank's tokens of `t` [batch, seq, ...]: padded with `pad_value` to a multiple, then its chunks."""
        seq = t.size(1)
        total = padded_length(seq, self.multiple)
        if total != seq:
            pad = t.new_full((t.size(0), total - seq, *t.shape[2:]), pad_value)
            t = torch.cat([t, pad], dim=1)
        return t.index_select(1, shard_positions(total, self.cp, self.rank).to(t.device))


def _allowed(mask: torch.Tensor) -> torch.Tensor | None:
    """A boolean or additive mask as "may attend" booleans, or None if an additive mask carries other values."""
    if mask.dtype == torch.bool:
        return mask
    blocked = torch.isneginf(mask) | (mask <= torch.finfo(mask.dtype).min / 2)
    if not bool(((mask == 0) | blocked).all()):
        return None  # a bias (ALiBi, soft-capping), not only a mask
    return ~blocked


def _is_shard_causal(mask: torch.Tensor, local_len: int) -> bool:
    """Whether a model's mask over its shard (two chunks) is causal inside each chunk, blocks the first chunk
    from the second, and treats the second's view of the first uniformly (all visible or all blocked)."""
    allowed = _allowed(mask)
    if allowed is None or allowed.shape[-2:] != (local_len, local_len):
        return False
    rows = allowed.reshape(-1, local_len, local_len)
    if not bool((rows == rows[:1]).all()):
        return False  # differs by batch or head: a padding mask, not causality
    a = rows[0]
    c = local_len // 2
    tril = torch.ones(c, c, dtype=torch.bool, device=a.device).tril()
    cross = a[c:, :c]
    return (bool((a[:c, :c] == tril).all()) and bool((a[c:, c:] == tril).all()) and not bool(a[:c, c:].any())
            and (bool(cross.all()) or not bool(cross.any())))


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _Attention(TorchFunctionMode):
    """Replaces every SDPA call in a module's forward with context-parallel attention (`ContextParallel.attend`)
    naming the module (`unit`: `_unit_index`). Each wrapped module enters its own mode, so a block's forward
    that activation recompute re-runs in backward (outside the stage's forward) is context-parallel too; the
    chunks' attention is called as the aten op, which no enclosing mode takes for a model's SDPA call. Dynamo
    traces a torch function mode's handler, so a compiled block traces this one with the rest of its forward."""

    def __init__(self, cp: ContextParallel, unit: torch.Tensor) -> None:
        super().__init__()
        self.cp, self.unit = cp, unit

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = dict(zip(_SDPA_ARGS, args, strict=False), **kwargs)
        return self.cp.attend(self.unit, **call)


class ContextParallel:
    """This rank's context-parallel runtime: sequence splitting, attention, position ids and the loss."""

    def __init__(self, cp_mesh: DeviceMesh, shard: SequenceShard) -> None:
        self.mesh, self.shard = cp_mesh, shard
        self.group = cp_mesh.get_group()
        self.group_name = self.group.group_name

    # ---- attention ----
    def attend(self, unit: torch.Tensor, *, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
               scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
        """Local queries [b, h, s, d] against the keys and values of the whole cp group, globally causal
        (`unit`: the running module, `_unit_index`).
        Only shapes and flags are checked here (static under torch.compile); the mask's values are checked
        by the gather (`gather_kv`), which sees real tensors in a compiled block too."""
        s = query.size(-2)
        if key.size(-2) != s or s % 2:
            raise PlanMismatchError(
                f"{_UNIT_NAMES[int(unit)]}: attention of {s} queries over {key.size(-2)} keys is not self-attention "
                "over this rank's sequence shard (e.g. cross-attention or a KV cache); context parallelism cannot "
                "split it. Use cp=1 for this model")
        if attn_mask is None and not is_causal:
            raise PlanMismatchError(
                f"{_UNIT_NAMES[int(unit)]}: bidirectional attention (is_causal=False, no mask); context parallelism "
                "here shards causal attention only (padding would be attended). Use cp=1 for this model")
        cp, c = self.shard.cp, s // 2
        d_k = key.size(-1)
        kv = torch.ops.autopar.cp_gather_kv(key, value, attn_mask, unit, self.group_name, cp)
        chunks = [self.shard.rank, 2 * cp - 1 - self.shard.rank]
        if cp_attention.supported(query, dropout_p):  # no [c, n_keys] mask to save (codegen/cp_attention.py)
            if torch.is_autocast_enabled(query.device.type):  # in autocast's dtype, as it runs SDPA
                dtype = torch.get_autocast_dtype(query.device.type)
                query, kv = query.to(dtype), kv.to(dtype)
            return torch.ops.autopar.cp_chunk_attention(query, kv, chunks, d_k, scale)[0]
        # elsewhere (a GPU, dropout) SDPA gets each chunk's mask, which it saves: c·n_keys elements of the query dtype
        outs = []
        for half, chunk in enumerate(chunks):
            # this query chunk (global chunk `chunk`) sees keys 0 .. (chunk + 1)·c − 1: causal, lower-right aligned
            n_keys = (chunk + 1) * c
            q = query[..., half * c:(half + 1) * c, :]
            keys, values = kv[..., :n_keys, :d_k], kv[..., :n_keys, d_k:]
            rows = torch.arange(c, device=query.device)[:, None] + (n_keys - c)
            mask = rows >= torch.arange(n_keys, device=query.device)[None, :]
            outs.append(torch.ops.aten.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa))
        return torch.cat(outs, dim=-2)

    def wrap(self, fn: Callable, where: str) -> Callable:
        """`fn` with every SDPA call inside it context-parallel, named `where` in errors.

        While torch.compile traces a block the mode is not entered again: dynamo cannot trace entering a mode
        inside activation checkpointing (a mutation of the mode stack in its region), and needs not, since
        the stage's mode, entered eagerly, is active and the compiled backward recomputes from the traced
        graph, not by running this forward again. An eager recompute (a block dynamo left to eager included)
        enters it."""
        mode = _Attention(self, _unit_index(where))

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with mode:
                return fn(*args, **kwargs)
        return run

    def apply(self, part: nn.Module, unit_paths: Iterable[str]) -> None:
        """Context-parallel attention in `part`'s forward and in each unit's own forward (which activation
        recompute re-runs in backward, outside the stage's forward). Call before `apply_recompute`."""
        for path in unit_paths:
            unit = part.get_submodule(path)
            unit.forward = self.wrap(unit.forward, path)
        part.forward = self.wrap(part.forward, type(part).__name__)

    def forward_kwargs(self, model: nn.Module, inputs: Any) -> dict[str, torch.Tensor]:
        """For a call on `inputs` (a shard's micro-batch, any structure): the shard's global `position_ids`
        [1, s] and, if the model's forward takes one, an `attention_mask` of ones [b, s]."""
        tokens = _sequence_leaf(inputs)
        kwargs = {"position_ids": self.position_ids(tokens.size(1), tokens.device)}
        if "attention_mask" in inspect.signature(type(model).forward).parameters:
            kwargs["attention_mask"] = torch.ones(tokens.shape[:2], dtype=torch.long, device=tokens.device)
        return kwargs

    def with_positions(self, model: nn.Module, forward: Callable) -> Callable:
        """`forward` of `model` given `forward_kwargs` for each call's inputs (the caller's own win)."""
        @functools.wraps(forward)
        def run(*args, **kwargs):
            return forward(*args, **{**self.forward_kwargs(model, (args, kwargs)), **kwargs})
        return run

    # ---- inputs ----
    def position_ids(self, local_len: int, device: torch.device) -> torch.Tensor:
        """[1, local_len] global positions for the model's `position_ids`."""
        return self.shard.local_positions(local_len, device).unsqueeze(0)

    def split(self, inputs: Any, targets: Any) -> tuple[Any, Any]:
        """This rank's shard of a batch: every tensor [batch, seq, ...] of the inputs and targets (seq the
        length of the inputs' first such tensor) cut to its two chunks, inputs padded with token 0 and
        targets with IGNORE_INDEX (never counted); other leaves unchanged."""
        seq = _sequence_leaf(inputs).size(1)

        def cut(batch: Any, pad: int) -> Any:
            return tree_map_only(torch.Tensor, lambda t: self.shard.split(t, pad) if t.dim() >= 2 and
                                 t.size(1) == seq else t, batch)
        return cut(inputs, 0), cut(targets, IGNORE_INDEX)

    # ---- loss ----
    def loss(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
             ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The exact global token mean over the cp group, times cp (gradients are then averaged over dp·cp).

        `loss_fn` returns the mean over this shard's counted tokens (targets ≠ IGNORE_INDEX, as
        `lm_cross_entropy`); weighted by the shard's count over the group's, the shards' values sum to
        the mean of the whole sequence.
        """
        cp, group = self.shard.cp, self.group

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            counts = torch.stack([(targets != IGNORE_INDEX).sum()]).float()
            mine = counts.clone()
            dist.all_reduce(counts, group=group)
            if mine.item() == 0:
                return logits.sum() * 0.0  # only padding here: no tokens to count, the graph kept for backward
            return loss_fn(logits, targets) * (cp * mine[0] / counts[0].clamp(min=1))
        return loss


def _sequence_leaf(batch: Any) -> torch.Tensor:
    """The first tensor of `batch` with a sequence dimension ([batch, seq, ...]): the token ids."""
    leaf = next((t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if leaf is None:
        raise PlanMismatchError("context parallelism splits the inputs' sequence dimension, but no input tensor has "
                                "one ([batch, seq, ...]); use cp=1 for this model")
    return leaf


def check_context_parallel(model: nn.Module, graph: ModelGraph, seq_len: int) -> None:
    """Refuse, naming the module, what context parallelism cannot run sharded."""
    if "position_ids" not in inspect.signature(type(model).forward).parameters:
        raise PlanMismatchError(
            f"{type(model).__name__}.forward takes no position_ids; under context parallelism each rank holds two "
            "non-adjacent chunks of the sequence and the model must be told their positions. Add a position_ids "
            "argument (as transformers' models have) or use cp=1")
    for layer in graph.layers:
        eager = [k for k in layer.kernels_forward.kernels if k.kind == "attention" and k.mnk is not None]
        if eager:
            raise PlanMismatchError(
                f"layer {layer.name}: its attention multiplies queries and keys itself (no "
                "scaled_dot_product_attention), which context parallelism cannot split; use SDPA attention "
                "(transformers: attn_implementation='sdpa') or cp=1")
    for name, module in model.named_modules():  # a module's own window, or its config's (transformers)
        window = getattr(module, "sliding_window", getattr(getattr(module, "config", None), "sliding_window", None))
        if isinstance(window, int) and not isinstance(window, bool) and 0 < window < seq_len:
            raise PlanMismatchError(
                f"{name or type(model).__name__}: a sliding window of {window} tokens over sequences of {seq_len}; a "
                "window is relative to global positions and cannot be split across context-parallel ranks. Use cp=1")
