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
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed._tools.mem_tracker import MemTracker

import autopar
from autopar.codegen import parallelize

__all__ = ["saved_bytes_per_block", "main"]

MIB = 2 ** 20


def _model(args: argparse.Namespace, device: str, dtype: torch.dtype | None = None) -> tuple[nn.Module, Any]:
    return autopar.zoo.build("llama3-8b", seq_len=args.seq, batch_size=args.batch, device=device, dtype=dtype,
                             n_layers=args.layers, hidden_size=args.hidden, n_heads=args.heads,
                             n_kv_heads=args.kv_heads, ffn_hidden_size=args.ffn, vocab_size=args.vocab)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("hidden", 512), ("heads", 4), ("kv-heads", 1), ("ffn", 1792), ("vocab", 16000),
                          ("layers", 2), ("seq", 512), ("batch", 4)):
        ap.add_argument(f"--{flag}", type=int, default=default)
    args = ap.parse_args()
    tokens = args.batch * args.seq

    meta, example = _model(args, "meta")
    graph = autopar.capture(meta, example)
    cluster = dataclasses.replace(autopar.Cluster.preset("dgx-h200"), devices_per_node=1)
    opts = autopar.PlannerOptions(tp=1, pp=1, dp=1, micro_batch_size=args.batch, recompute="none", zero_stage=0,
                                  precision="bf16")
    plan = autopar.plan(graph, cluster, global_batch_size=args.batch, options=opts)

    print(f"Llama h={args.hidden} heads={args.heads}/{args.kv_heads} ffn={args.ffn} vocab={args.vocab} "
          f"layers={args.layers}, batch {args.batch} x {args.seq}; bytes per token per block, in units of h:")
    bf16, _ = _model(args, "cpu", torch.bfloat16)
    x = torch.randn(args.batch, args.seq, args.hidden, dtype=torch.bfloat16, requires_grad=True)
    plain = saved_bytes_per_block(bf16.layers[0], lambda: bf16.layers[0](x))
    captured = graph.layer("layers.0").saved_activation_bytes / args.seq

    model, _ = _model(args, "cpu", torch.bfloat16)
    pm = parallelize(model, plan, graph=graph, optimizer=lambda named: torch.optim.AdamW([p for _, p in named]))
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    targets = torch.randint(0, args.vocab, (args.batch, args.seq))
    pm.train_step(ids, targets)  # the optimizer's states exist from here on
    runtime = saved_bytes_per_block(model, lambda: pm.train_step(ids, targets))
    per_h = args.hidden
    print(f"  capture (bf16 model on meta)            {captured / per_h:7.2f}")
    print(f"  the bf16 model run for real             {sum(plain.values()) / tokens / per_h:7.2f}")
    print(f"  autopar's runtime, bf16 policy          {runtime['layers.0'] / tokens / per_h:7.2f}   "
          f"(final norm {runtime.get('norm', 0) / tokens / per_h:.2f}, captured "
          f"{graph.layer('norm').saved_activation_bytes / args.seq / per_h:.2f})")

    _print_peak(model, pm, plan, graph, runtime, args, ids, targets)


def _print_peak(model: nn.Module, pm: Any, plan: autopar.Plan, graph: autopar.ModelGraph, runtime: dict[str, int],
                args: argparse.Namespace, ids: torch.Tensor, targets: torch.Tensor) -> None:
    """The step's peak by kind beside the plan's breakdown, and the difference term by term."""
    tracker = MemTracker()
    tracker.track_external(model, pm.optimizer)
    with tracker:
        pm.train_step(ids, targets)
    peak = {str(k).split(".")[-1]: v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    pred = plan.estimate.memory_breakdown
    print("peak of a step, MiB:             predicted   measured at the peak")
    rows = (("weights (fp32 masters)", pred["weights"], peak["PARAM"]),
            ("gradients", pred["grads"], peak["GRAD"]),
            ("optimizer", pred["optimizer"], peak["OPT"]),
            ("buffers (rotary tables)", 0, peak["BUFFER"]),
            ("activations, logits, copies", pred["activations"] + pred["logits"] + pred["compute_copies"],
             peak["ACT"] + peak["TEMP"]),
            ("total", plan.estimate.peak_memory_bytes, peak["Total"]))
    for name, p, m in rows:
        print(f"  {name:32s} {p / MIB:9.1f}   {m / MIB:9.1f}")
    embedding = graph.layer("tok_embeddings").num_params * 2
    print(f"16-bit weight copies the runtime saves: {runtime.get('weight copies', 0) / MIB:.1f} MiB; priced "
          f"{pred['compute_copies'] / MIB:.1f}, of which the embedding table's {embedding / MIB:.1f} (no autocast "
          "op reads it)")
    autocast = sum(runtime.get(la.name, 0) - la.saved_activation_bytes * args.batch
                   for la in graph.layers if la.kind in ("block", "norm"))
    terms = (("predicted", plan.estimate.peak_memory_bytes),
             ("gradients, not allocated yet at the peak", peak["GRAD"] - pred["grads"]),
             ("embedding copy, never made", -embedding),
             ("activations under autocast (fp32 residual stream, norms)", autocast),
             ("rotary tables (buffers)", peak["BUFFER"]))
    for name, v in terms:
        print(f"  {name:58s} {v / MIB:+9.1f}")
    print(f"  {'= reconstructed':58s} {sum(v for _, v in terms) / MIB:9.1f}  (measured {peak['Total'] / MIB:.1f})")


if __name__ == "__main__":
    main()
