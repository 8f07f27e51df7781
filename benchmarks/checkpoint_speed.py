"""Checkpoint speed on this machine: save (sync and async) and load time against model size, and the
time from a killed rank to the first training step after torchrun restarted the job.

    python benchmarks/checkpoint_speed.py [--nproc 2] [--hidden 128 256 512 1024] [--repeats 3] [--dir /tmp/ckbench]

Sizes: the zoo's gpt-tiny (4 layers) at each --hidden, planned by autopar for --nproc gloo processes
(launched here with torchrun), AdamW state included. For each size, the median of --repeats of:
- sync save: `Checkpointer.save` (DCP write of every rank's shards, CRC-32 of each file, manifest,
  atomic rename) until it returns;
- async save, blocking: until `save` returns (the state copied to CPU memory, the write started);
- async save, total: until `wait()` returns (written and committed);
- load: `Checkpointer.resume` (verification of every file's CRC-32, then the DCP read).
Recovery: examples/train_gpt.py under `torchrun --max-restarts 1` with `--fail-at-step`; the time from
rank 1's SIGKILL to the first step line of the restarted attempt, read from the live output.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(args) -> None:
    """One rank of the size sweep (run under torchrun); rank 0 prints one row per size."""
    import torch
    import torch.distributed as dist

    import autopar
    from autopar.codegen import parallelize
    from autopar.codegen.checkpoint import Checkpointer
    from autopar.codegen.elastic import init_process_group

    init_process_group("gloo")
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"{'params':>10} {'on disk':>9} {'sync save':>10} {'async block':>12} {'async total':>12} "
              f"{'load':>8} {'save MB/s':>10}", flush=True)
    for hidden in args.hidden:
        torch.manual_seed(0)
        model, example = autopar.zoo.build("gpt-tiny", seq_len=64, device="cpu", dtype=torch.float32,
                                           hidden_size=hidden, dropout=0)
        n_params = sum(p.numel() for p in model.parameters())
        plan = autopar.plan(model, autopar.Cluster.local(nproc=dist.get_world_size()), example_inputs=example,
                            global_batch_size=2 * dist.get_world_size())
        pm = parallelize(model, plan, example_inputs=example,
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3))
        x = torch.randint(0, 1024, (plan.config.global_batch_size, 64))
        pm.train_step(pm.local_batch(x), pm.local_batch(x))  # optimizer state exists
        root = Path(args.dir) / f"h{hidden}"
        times: dict[str, list[float]] = {k: [] for k in ("sync", "block", "total", "load")}
        sync_ck = Checkpointer(pm, root / "sync", model_name="gpt-tiny", keep_last=1)
        async_ck = Checkpointer(pm, root / "async", model_name="gpt-tiny", keep_last=1, async_save=True)
        for step in range(1, args.repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            sync_ck.save(step)
            times["sync"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            async_ck.save(step)
            times["block"].append(time.perf_counter() - t0)
            async_ck.wait()
            times["total"].append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            sync_ck.resume()
            times["load"].append(time.perf_counter() - t0)
        if rank0:
            folder = root / "sync" / f"step_{args.repeats:08d}"
            size_b = sum(f.stat().st_size for f in folder.iterdir())
            med = {k: statistics.median(v) for k, v in times.items()}
            print(f"{n_params:>10,} {size_b / 2**20:>7.1f} M {med['sync']:>9.3f}s {med['block']:>11.3f}s "
                  f"{med['total']:>11.3f}s {med['load']:>7.3f}s {size_b / med['sync'] / 1e6:>10.1f}", flush=True)
            shutil.rmtree(root, ignore_errors=True)
        dist.barrier()
    dist.destroy_process_group()


def _sizes(args) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master-port",
           str(_free_port()), __file__, "--worker", "--dir", args.dir, "--repeats", str(args.repeats),
           "--hidden", *map(str, args.hidden)]
    print(f"save/load, gpt-tiny (4 layers) at hidden {args.hidden}, {args.nproc} gloo processes, "
          f"median of {args.repeats}:", flush=True)
    subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _recovery(args) -> None:
    """Seconds from rank 1's SIGKILL to the restarted job's first step line."""
    folder = Path(args.dir) / "recovery"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    plan = folder / "plan.json"
    subprocess.run([sys.executable, "-m", "autopar.cli.main", "plan", "gpt-tiny", "--override", "dropout=0",
                    "--cluster", "local", "--nproc", str(args.nproc), "--global-batch-size", "8", "--seq-len", "64",
                    "--out", str(plan)], check=True, capture_output=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--max-restarts", "1",
           "--master-port", str(_free_port()), str(ROOT / "examples" / "train_gpt.py"), "--model", "gpt-tiny",
           "--seq-len", "64", "--override", "dropout=0", "--plan", str(plan), "--steps", "8",
           "--checkpoint-dir", str(folder / "ck"), "--checkpoint-every", "2", "--fail-at-step", "6"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    killed = resumed = first_step = None
    for line in proc.stdout:
        now = time.perf_counter()
        if "SIGKILL" in line and killed is None:
            killed = now
        elif killed is not None and "resumed from" in line:
            resumed = now
        elif resumed is not None and " step " in line and first_step is None:
            first_step = now
    proc.wait()
    if proc.returncode or None in (killed, resumed, first_step):
        raise RuntimeError(f"the recovery run failed (exit {proc.returncode}); run `{' '.join(cmd)}` to see why")
    print(f"recovery on {args.nproc} processes (gpt-tiny, checkpoint every 2 steps, rank 1 killed at step 6): "
          f"{first_step - killed:.1f} s from the kill to the first step after it "
          f"({resumed - killed:.1f} s to the checkpoint loaded: restart, imports, process group, plan check, "
          f"sharding, resume)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        args.dir = args.dir or tmp
        _sizes(args)
        _recovery(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
