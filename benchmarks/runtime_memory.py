"""What a training step of autopar's own runtime holds in memory, measured on CPU, beside what autopar prices.

    PYTHONPATH=$PWD python benchmarks/runtime_memory.py                      # llama3-8b's shape at h = 512
    PYTHONPATH=$PWD python benchmarks/runtime_memory.py --model gpt3-1.3b    # gpt3-1.3b's, no dropout
    PYTHONPATH=$PWD python benchmarks/runtime_memory.py --override hidden_size=1024 --override n_heads=8 \
        --override n_kv_heads=2 --override ffn_hidden_size=3584 --seq 1024 --batch 2

A zoo model with the proportions of llama3-8b or gpt3-1.3b (SHAPES) is run for real on the CPU, one gloo
rank, under the plan autopar makes for one H200 with tp = pp = dp = 1 and the bf16 policy pinned (16-bit
compute under autocast over fp32 master weights, AdamW), as `benchmarks/gpu_truth.sh` runs them on a GPU.
Printed:

1. the bytes autograd saves per block per token (unique storages, parameters, buffers and the autocast
   copies of weights left out; `torch.autograd.graph.saved_tensors_hooks`): as capture measures them (the
   model run in bf16 on meta), the same model run for real in bf16, and under the runtime's autocast;
2. the step's peak live bytes by kind (`torch.distributed._tools.mem_tracker.MemTracker`, which follows
   every storage's allocation and release) beside the plan's `memory_breakdown`, and the difference term
   by term.

CUDA's autocast casts more ops to fp32 than the CPU's (pow, rsqrt, layer_norm, softmax, ...), but under
this runtime their inputs are fp32 already (the residual stream is), so these models save the same tensors
on both; the GPU's own allocator figures are in `benchmarks/data/gpu_truth/`.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.codegen import parallelize

__all__ = ["StepMemory", "measure", "saved_bytes_per_block", "main"]

MIB = 2 ** 20


class _WeightCasts(TorchDispatchMode):
    """Records the storages autocast casts parameters into (its 16-bit weight copies)."""

    def __init__(self, state: set[int]) -> None:
        super().__init__()
        self.state, self.copies = state, set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in self.state:
            self.copies.add(out.untyped_storage().data_ptr())
        return out


def saved_bytes_per_block(model: nn.Module, run: Any) -> dict[str, int]:
    """Bytes autograd saves while `run()` executes, per top-level module call (blocks as `layers.i`): unique
    storages, model parameters and buffers excluded, and autocast's 16-bit weight copies (storages cast from
    a parameter) reported apart under the key "weight copies"."""
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    current = ["top"]
    hooks = []
    for name, child in model.named_children():
        children = list(enumerate(child)) if isinstance(child, nn.ModuleList) else [(None, child)]
        for i, m in children:
            label = name if i is None else f"{name}.{i}"
            hooks.append(m.register_forward_pre_hook(lambda _m, _a, label=label: current.__setitem__(0, label)))
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in state and key not in seen:
            seen[key] = (current[0], t.untyped_storage().nbytes())
        return t

    casts = _WeightCasts(state)
    try:
        with casts, saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in hooks:
            h.remove()
    copies = casts.copies
    out: dict[str, int] = {}
    for key, (label, n) in seen.items():
        label = "weight copies" if key in copies else label
        out[label] = out.get(label, 0) + n
    return out


@dataclass(frozen=True, kw_only=True)
class StepMemory:
    """One measured step beside its plan (bytes; per token and block where named so)."""

    hidden: int
    captured_block_per_token: float  # capture's saved_activation_bytes of a block, per token
    bf16_block_per_token: float  # the bf16 model's block run for real
    runtime_block_per_token: float  # the same block under autopar's runtime (bf16 policy, autocast)
    runtime_norm_per_token: float
    captured_norm_per_token: float
    weight_copies_bytes: int  # autocast's 16-bit weight copies the runtime saved
    predicted: dict[str, int]  # the plan's memory_breakdown
    predicted_peak_bytes: int
    peak: dict[str, int]  # MemTracker's peak by kind: PARAM, BUFFER, GRAD, ACT, TEMP, OPT, Total
    embedding_copy_bytes: int  # the 16-bit copy of the embedding table the plan prices
    autocast_extra_bytes: float  # what the runtime's blocks and final norm save beyond capture's count

    def terms(self) -> tuple[tuple[str, float], ...]:
        """The measured peak as the prediction plus each difference found."""
        return (("predicted", self.predicted_peak_bytes),
                ("gradients, not allocated yet at the peak", self.peak["GRAD"] - self.predicted["grads"]),
                ("embedding copy, never made", -self.embedding_copy_bytes),
                ("activations under autocast (fp32 residual stream, norms)", self.autocast_extra_bytes),
                ("buffers (rotary tables, fp32 under to_masters)", self.peak["BUFFER"]))


# llama3-8b's proportions at h = 512 (head_dim 128, 4 query heads per KV head, ffn = 3.5 h), and gpt3-1.3b's
# (head_dim 128, ffn = 4 h) without dropout: on a CPU dropout saves a mask in the input's dtype, on a GPU a bool
# mask (capture prices the GPU's kernel), and SDPA with dropout leaves the flash kernel
SHAPES = {
    "llama3-8b": dict(n_layers=2, hidden_size=512, n_heads=4, n_kv_heads=1, ffn_hidden_size=1792, vocab_size=16000),
    "gpt3-1.3b": dict(n_layers=2, hidden_size=512, n_heads=4, vocab_size=16000, dropout=0.0),
}


def measure(model_name: str = "llama3-8b", *, seq: int = 512, batch: int = 4, **overrides: Any) -> StepMemory:
    """Plan, then run three steps of autopar's runtime on this process's CPU (one rank): the second counts the
    saved tensors, the third the peak (module docstring). overrides: the zoo model's shape (SHAPES)."""
    shape = {**SHAPES.get(model_name, {}), **overrides}
    meta, example = autopar.zoo.build(model_name, seq_len=seq, batch_size=batch, **shape)
    graph = autopar.capture(meta, example)
    cluster = dataclasses.replace(autopar.Cluster.preset("dgx-h200"), devices_per_node=1)
    opts = autopar.PlannerOptions(tp=1, pp=1, dp=1, micro_batch_size=batch, recompute="none", zero_stage=0,
                                  precision="bf16")
    plan = autopar.plan(graph, cluster, global_batch_size=batch, options=opts)
    tokens, h = batch * seq, graph.hidden_size
    block = next(la for la in graph.layers if la.kind == "block")
    norm = next(la for la in reversed(graph.layers) if la.kind == "norm")

    bf16, _ = autopar.zoo.build(model_name, seq_len=seq, device="cpu", dtype=torch.bfloat16, **shape)
    x = torch.randn(batch, seq, h, dtype=torch.bfloat16, requires_grad=True)
    one = bf16.get_submodule(block.name)
    plain = saved_bytes_per_block(one, lambda: one(x))

    model, _ = autopar.zoo.build(model_name, seq_len=seq, device="cpu", dtype=torch.bfloat16, **shape)
    pm = parallelize(model, plan, graph=graph, optimizer=lambda named: torch.optim.AdamW([p for _, p in named]))
    vocab = graph.vocab_size
    ids, targets = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    pm.train_step(ids, targets)  # the optimizer's states exist from here on
    runtime = saved_bytes_per_block(model, lambda: pm.train_step(ids, targets))
    tracker = MemTracker()
    tracker.track_external(model, pm.optimizer)
    with tracker:
        pm.train_step(ids, targets)
    peak = {str(k).split(".")[-1]: int(v)
            for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    return StepMemory(
        hidden=h, captured_block_per_token=block.saved_activation_bytes / seq,
        bf16_block_per_token=sum(plain.values()) / tokens, runtime_block_per_token=runtime[block.name] / tokens,
        runtime_norm_per_token=runtime.get(norm.name, 0) / tokens,
        captured_norm_per_token=norm.saved_activation_bytes / seq,
        weight_copies_bytes=runtime.get("weight copies", 0), predicted=dict(plan.estimate.memory_breakdown),
        predicted_peak_bytes=plan.estimate.peak_memory_bytes, peak=peak,
        embedding_copy_bytes=2 * sum(la.num_params for la in graph.layers if la.kind == "embedding"),
        autocast_extra_bytes=sum(runtime.get(la.name, 0) - la.saved_activation_bytes * batch
                                 for la in graph.layers if la.kind in ("block", "norm")))


def _override(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    for kind in (int, float):
        try:
            return key, kind(value)
        except ValueError:
            pass
    return key, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--override", action="append", default=[], type=_override, metavar="K=V",
                    help="a zoo shape field over SHAPES' (e.g. hidden_size=1024)")
    args = ap.parse_args()
    r = measure(args.model, seq=args.seq, batch=args.batch, **dict(args.override))
    h = r.hidden
    shape = {**SHAPES[args.model], **dict(args.override)}
    print(f"{args.model} shaped {shape}, batch {args.batch} x {args.seq}; bytes per token per block, in units of h:")
    print(f"  capture (bf16 model on meta)            {r.captured_block_per_token / h:7.2f}")
    print(f"  the bf16 model run for real             {r.bf16_block_per_token / h:7.2f}")
    print(f"  autopar's runtime, bf16 policy          {r.runtime_block_per_token / h:7.2f}   (final norm "
          f"{r.runtime_norm_per_token / h:.2f}, captured {r.captured_norm_per_token / h:.2f})")
    pred, peak = r.predicted, r.peak
    print("peak of a step, MiB:             predicted   measured at the peak")
    rows = (("weights (fp32 masters)", pred["weights"], peak["PARAM"]),
            ("gradients", pred["grads"], peak["GRAD"]),
            ("optimizer", pred["optimizer"], peak["OPT"]),
            ("buffers", 0, peak["BUFFER"]),
            ("activations, logits, copies", pred["activations"] + pred["logits"] + pred["compute_copies"],
             peak["ACT"] + peak["TEMP"]),
            ("total", r.predicted_peak_bytes, peak["Total"]))
    for name, p, m in rows:
        print(f"  {name:32s} {p / MIB:9.1f}   {m / MIB:9.1f}")
    print(f"16-bit weight copies the runtime saves: {r.weight_copies_bytes / MIB:.1f} MiB; priced "
          f"{pred['compute_copies'] / MIB:.1f}, of which the embedding tables' {r.embedding_copy_bytes / MIB:.1f} "
          "(no autocast op reads them)")
    for name, v in r.terms():
        print(f"  {name:58s} {v / MIB:+9.1f}")
    print(f"  {'= reconstructed':58s} {sum(v for _, v in r.terms()) / MIB:9.1f}  (measured {peak['Total'] / MIB:.1f})")


if __name__ == "__main__":
    main()
