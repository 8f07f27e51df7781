"""What ZeRO-1 under a 16-bit policy (the distributed optimizer, autopar/codegen/dist_optimizer.py) holds, measured.

    PYTHONPATH=$PWD python benchmarks/dist_optimizer_memory.py [--hidden 512] [--layers 4] [--precision bf16]
        [--zero-stage 0]   # ZeRO-0's fp32 parameters under autocast, to compare

A zoo GPT runs two steps on 2 gloo ranks of this CPU (dp2, ZeRO-1, micro-batch 1 × 2). Printed per rank:
the bytes of each state on the live tensors (16-bit parameters, fp32 main gradients, fp32 masters, Adam's
moments) beside the plan's memory breakdown, and the transient each phase of the second step allocates
above what it started with (torch.profiler's allocator record, `Total Allocated`): forward+backward (the
activations, and the 16-bit gradients before the hook adds them into the main gradients), the gradient
reduction (the bucket's flat copy), and the optimizer (AdamW's foreach temporaries, the owners' packed
16-bit broadcast), each also in bytes per parameter this rank holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

import autopar
from autopar.codegen import lm_cross_entropy, parallelize
from autopar.codegen.data_parallel import local
from autopar.codegen.dist_optimizer import DistributedOptimizer

MIB = 2 ** 20
PHASES = ("forward_backward", "optimizer")


def _bytes(t: torch.Tensor) -> int:
    x = local(t)
    return x.numel() * x.element_size()


def _phase_peaks(trace_path: str) -> dict[str, int]:
    """Per phase: the highest `Total Allocated` inside it minus the value when it began; "grad_sync" is the span
    between the two phases."""
    with open(trace_path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") in PHASES and "dur" in e}
    spans["grad_sync"] = (spans["forward_backward"][1], spans["optimizer"][0])
    memory = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]")
    peaks = {}
    for name, (start, end) in spans.items():
        before = [v for ts, v in memory if ts < start]
        base = before[-1] if before else 0
        inside = [v for ts, v in memory if start <= ts <= end]
        peaks[name] = max(inside, default=base) - base
    return peaks


def _rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.manual_seed(0)
    shape = dict(n_layers=args.layers, hidden_size=args.hidden, n_heads=max(1, args.hidden // 64),
                 vocab_size=args.vocab, dropout=0.0)
    meta, example = autopar.zoo.build("gpt-tiny", seq_len=args.seq, batch_size=1, **shape)
    graph = autopar.capture(meta, example)
    node = dataclasses.replace(autopar.Cluster.preset("dgx-h100", nodes=1), devices_per_node=2)
    config = autopar.ParallelConfig(dp=2, zero_stage=args.zero_stage, micro_batch_size=1, num_microbatches=2,
                                    precision=args.precision, recompute="none")
    est = autopar.estimate(graph, node, config)
    plan = autopar.plan(graph, node, global_batch_size=4, options=autopar.PlannerOptions(
        dp=2, tp=1, pp=1, zero_stage=args.zero_stage, micro_batch_size=1, precision=args.precision,
        recompute="none"))
    model, _ = autopar.zoo.build("gpt-tiny", seq_len=args.seq, device="cpu", **shape)
    pm = parallelize(model, plan, graph=graph, optimizer=lambda named: torch.optim.AdamW(named, lr=1e-4),
                     loss_fn=lm_cross_entropy)
    ids = torch.randint(0, args.vocab, (4, args.seq))
    pm.train_step(pm.local_batch(ids), pm.local_batch(ids))  # moments exist from here on
    run, step = pm._run, pm._step

    def timed_run(*a, **k):
        with record_function("forward_backward"):
            return run(*a, **k)

    def timed_step():
        with record_function("optimizer"):
            step()

    pm._run, pm._step = timed_run, timed_step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        pm.train_step(pm.local_batch(ids), pm.local_batch(ids))
    trace = os.path.join(out, f"trace{rank}.json")
    prof.export_chrome_trace(trace)
    params = [p for part in pm.modules for p in {id(q): q for q in part.parameters()}.values()]
    n = sum(local(p).numel() for p in params)
    opt = pm.stepper
    moments = sum(_bytes(v) for st in pm.optimizer.state.values() for k, v in st.items()
                  if isinstance(v, torch.Tensor) and k != "step")
    if isinstance(opt, DistributedOptimizer):
        held = {"16-bit params": sum(_bytes(p) for p in params), "fp32 main grads": sum(_bytes(p.main_grad)
                                                                                      for p in params),
                "fp32 masters": sum(_bytes(m) for m in opt.masters), "moments": moments}
    else:
        held = {"params": sum(_bytes(p) for p in params), "moments": moments}
    result = {"rank": rank, "params": n, "held": held, "planned": est.memory_breakdown,
              "transient": _phase_peaks(trace)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1), help="0: the fp32-parameter path, to compare")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(port, args, out), nprocs=2)
        results: list[dict[str, Any]] = []
        for r in range(2):
            with open(os.path.join(out, f"rank{r}.json")) as f:
                results.append(json.load(f))
    for r in results:
        n = r["params"]
        print(f"rank {r['rank']}: {n:,} parameters, {args.precision}, dp2 ZeRO-{args.zero_stage}")
        for k, v in r["held"].items():
            print(f"  held {k:16s} {v / MIB:9.2f} MiB  {v / n:6.3f} B/param")
        plan = r["planned"]
        for k in ("compute_copies", "grads", "weights", "optimizer", "activations"):
            print(f"  plan {k:16s} {plan.get(k, 0) / MIB:9.2f} MiB  {plan.get(k, 0) / n:6.3f} B/param")
        for k, v in r["transient"].items():
            print(f"  transient {k:16s} {v / MIB:9.2f} MiB  {v / n:6.3f} B/param")


if __name__ == "__main__":
    main()
