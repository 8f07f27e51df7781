"""CPU time PyTorch's distributed wrappers add to a training step on this machine: FSDP2's per-layer
hooks and DTensor optimizer (the source of autopar.planner.dp_costs.FSDP_HOOKS_FLOORS and
DTENSOR_OPTIMIZER_FLOORS), and DTensor tensor parallelism's dispatch
(autopar.planner.compute_costs.TP_HOST_FLOORS_PER_GEMM and TP_OPTIMIZER_FLOORS_PER_GEMM).

    python benchmarks/host_overhead.py [--model gpt-tiny] [--seq-len 128] [--batch 4]

One process, a 1-rank gloo mesh (no communication), one thread, timed by the thread's CPU time (immune
to other work on a shared machine): forward + backward and an AdamW step of the zoo model, plain, with
`fully_shard` on every layer as autopar's codegen applies it (ZeRO-2 and ZeRO-3), and with autopar's
tensor parallelism (apply_tensor_parallel on a 1-rank "tp" mesh). Prints the difference per FSDP unit
(a layer with parameters) and per forward GEMM of the TP-sharded layers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import autopar  # noqa: E402


def thread_s(fn, reps: int = 10) -> float:
    fn()
    fn()
    t0 = time.thread_time()
    for _ in range(reps):
        fn()
    return (time.thread_time() - t0) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29881")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from autopar.codegen.data_parallel import split_mixed_groups
    from autopar.codegen.tensor_parallel import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    base = None
    for kind in ("plain", "zero2", "zero3", "tp"):
        torch.manual_seed(0)
        model, example = autopar.zoo.build(args.model, seq_len=args.seq_len, device="cpu", dtype=torch.float32)
        graph = autopar.capture(model, example)
        units = [m for m in (model.embed, *model.blocks, model.ln_f, model.lm_head)
                 if any(True for _ in m.parameters())]
        if kind.startswith("zero"):
            for m in units:
                fully_shard(m, mesh=mesh, reshard_after_forward=kind == "zero3")
            fully_shard(model, mesh=mesh, reshard_after_forward=kind == "zero3")
        if kind == "tp":
            apply_tensor_parallel(model, graph.layers, mesh["tp"], sequence_parallel=None)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        split_mixed_groups(opt)
        x = torch.randint(0, 1024, (args.batch, args.seq_len))

        def fb(model=model, x=x) -> None:
            out = model(x)
            (out.full_tensor() if hasattr(out, "full_tensor") else out).float().sum().backward()

        fb = thread_s(fb)
        step = thread_s(opt.step)
        line = f"{kind:<6} forward+backward {fb * 1e3:7.2f} ms, AdamW step {step * 1e3:6.2f} ms"
        if base is None:
            base = (fb, step)
        elif kind == "tp":
            n = sum(la.kernels_forward.gemm_count for la in graph.layers if la.tp_patterns)
            line += (f"; over plain, per forward GEMM of the TP layers ({n}): {(fb - base[0]) / n * 1e3:.3f} ms "
                     f"per micro-batch, {(step - base[1]) / n * 1e3:.3f} ms per optimizer step")
        else:
            n = len(units)
            line += (f"; over plain, per unit ({n}): {(fb - base[0]) / n * 1e3:.2f} ms per micro-batch, "
                     f"{(step - base[1]) / n * 1e3:.2f} ms per optimizer step")
        print(line, flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
