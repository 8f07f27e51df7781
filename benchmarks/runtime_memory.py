"""What a training step of autopar's own runtime holds in memory, measured on CPU, beside what autopar prices.

    PYTHONPATH=$PWD python benchmarks/runtime_memory.py            # a llama3-8b block scaled to h = 512
    PYTHONPATH=$PWD python benchmarks/runtime_memory.py --hidden 1024 --heads 8 --ffn 3584 --seq 1024

A zoo Llama with llama3-8b's proportions (head_dim 128, 4 query heads per KV head, ffn = 3.5 h) is run
for real on the CPU, one gloo rank, under the plan autopar makes for one H200 with tp = pp = dp = 1 and the
bf16 policy pinned (16-bit compute under autocast over fp32 master weights, AdamW), as
`benchmarks/gpu_truth.sh` runs llama3-8b on a GPU. Printed:

1. the bytes autograd saves per block per token (unique storages, parameters, buffers and the autocast
   copies of weights left out; `torch.autograd.graph.saved_tensors_hooks`): as capture measures them (the
   model run in bf16 on meta), the same model run for real in bf16, and under the runtime's autocast;
2. the step's peak live bytes by kind (`torch.distributed._tools.mem_tracker.MemTracker`, which follows
   every storage's allocation and release) beside the plan's `memory_breakdown`.

CPU and CUDA autocast agree on this model's ops (matmuls and attention in 16 bits, the rest in the dtype
of their inputs), so the composition holds on a GPU; the GPU's own allocator figures are in
`benchmarks/data/gpu_truth/`.
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

import autopar
from autopar.codegen import parallelize

__all__ = ["StepMemory", "measure", "saved_bytes_per_block", "main"]

MIB = 2 ** 20


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
    copies = set()
    seen: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in state and key not in seen:
            seen[key] = (current[0], t.untyped_storage().nbytes())
        return t

    # a weight's autocast copy is the one saved 2-D tensor shaped like a parameter (or its transpose)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    shapes |= {s[::-1] for s in shapes}

    def pack_weights(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 2 and tuple(t.shape) in shapes and t.dtype != next(model.parameters()).dtype:
            copies.add(t.untyped_storage().data_ptr())
        return pack(t)

    try:
        with saved_tensors_hooks(pack_weights, lambda t: t):
            run()
    finally:
        for h in hooks:
            h.remove()
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
                ("rotary tables (buffers)", self.peak["BUFFER"]))


def measure(*, hidden: int = 512, heads: int = 4, kv_heads: int = 1, ffn: int = 1792, vocab: int = 16000,
            layers: int = 2, seq: int = 512, batch: int = 4) -> StepMemory:
    """Plan, then run three steps of autopar's runtime on this process's CPU (one rank): the second counts the
    saved tensors, the third the peak (module docstring)."""
    shape = dict(n_layers=layers, hidden_size=hidden, n_heads=heads, n_kv_heads=kv_heads, ffn_hidden_size=ffn,
                 vocab_size=vocab)
    meta, example = autopar.zoo.build("llama3-8b", seq_len=seq, batch_size=batch, **shape)
    graph = autopar.capture(meta, example)
    cluster = dataclasses.replace(autopar.Cluster.preset("dgx-h200"), devices_per_node=1)
    opts = autopar.PlannerOptions(tp=1, pp=1, dp=1, micro_batch_size=batch, recompute="none", zero_stage=0,
                                  precision="bf16")
    plan = autopar.plan(graph, cluster, global_batch_size=batch, options=opts)
    tokens = batch * seq

    bf16, _ = autopar.zoo.build("llama3-8b", seq_len=seq, device="cpu", dtype=torch.bfloat16, **shape)
    x = torch.randn(batch, seq, hidden, dtype=torch.bfloat16, requires_grad=True)
    plain = saved_bytes_per_block(bf16.layers[0], lambda: bf16.layers[0](x))

    model, _ = autopar.zoo.build("llama3-8b", seq_len=seq, device="cpu", dtype=torch.bfloat16, **shape)
    pm = parallelize(model, plan, graph=graph, optimizer=lambda named: torch.optim.AdamW([p for _, p in named]))
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
        hidden=hidden, captured_block_per_token=graph.layer("layers.0").saved_activation_bytes / seq,
        bf16_block_per_token=sum(plain.values()) / tokens, runtime_block_per_token=runtime["layers.0"] / tokens,
        runtime_norm_per_token=runtime.get("norm", 0) / tokens,
        captured_norm_per_token=graph.layer("norm").saved_activation_bytes / seq,
        weight_copies_bytes=runtime.get("weight copies", 0), predicted=dict(plan.estimate.memory_breakdown),
        predicted_peak_bytes=plan.estimate.peak_memory_bytes, peak=peak,
        embedding_copy_bytes=graph.layer("tok_embeddings").num_params * 2,
        autocast_extra_bytes=sum(runtime.get(la.name, 0) - la.saved_activation_bytes * batch
                                 for la in graph.layers if la.kind in ("block", "norm")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("hidden", 512), ("heads", 4), ("kv-heads", 1), ("ffn", 1792), ("vocab", 16000),
                          ("layers", 2), ("seq", 512), ("batch", 4)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    args = ap.parse_args()
    r = measure(**{k: v for k, v in vars(args).items()})
    h = r.hidden
    print(f"Llama h={args.hidden} heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab={args.vocab} "
          f"layers={args.layers}, batch {args.batch} x {args.seq}; bytes per token per block, in units of h:")
    print(f"  capture (bf16 model on meta)            {r.captured_block_per_token / h:7.2f}")
    print(f"  the bf16 model run for real             {r.bf16_block_per_token / h:7.2f}")
    print(f"  autopar's runtime, bf16 policy          {r.runtime_block_per_token / h:7.2f}   (final norm "
          f"{r.runtime_norm_per_token / h:.2f}, captured {r.captured_norm_per_token / h:.2f})")
    pred, peak = r.predicted, r.peak
    print("peak of a step, MiB:             predicted   measured at the peak")
    rows = (("weights (fp32 masters)", pred["weights"], peak["PARAM"]),
            ("gradients", pred["grads"], peak["GRAD"]),
            ("optimizer", pred["optimizer"], peak["OPT"]),
            ("buffers (rotary tables)", 0, peak["BUFFER"]),
            ("activations, logits, copies", pred["activations"] + pred["logits"] + pred["compute_copies"],
             peak["ACT"] + peak["TEMP"]),
            ("total", r.predicted_peak_bytes, peak["Total"]))
    for name, p, m in rows:
        print(f"  {name:32s} {p / MIB:9.1f}   {m / MIB:9.1f}")
    print(f"16-bit weight copies the runtime saves: {r.weight_copies_bytes / MIB:.1f} MiB; priced "
          f"{pred['compute_copies'] / MIB:.1f}, of which the embedding table's {r.embedding_copy_bytes / MIB:.1f} "
          "(no autocast op reads it)")
    for name, v in r.terms():
        print(f"  {name:58s} {v / MIB:+9.1f}")
    print(f"  {'= reconstructed':58s} {sum(v for _, v in r.terms()) / MIB:9.1f}  (measured {peak['Total'] / MIB:.1f})")


if __name__ == "__main__":
    main()
