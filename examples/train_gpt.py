"""Train a small autopar.zoo model under torchrun with a plan made by autopar (or read from a file).

    torchrun --nproc_per_node 2 examples/train_gpt.py --model gpt-tiny --seq-len 128 --steps 20 --plan auto
    torchrun --nproc_per_node 4 examples/train_gpt.py --plan plan.json   # from `autopar plan ... --out plan.json`

The data is generated: sequences from a fixed random bigram language (each token has a handful of
likely successors), so the loss visibly falls from ln(vocab) toward the language's entropy.
Rank 0 prints loss, step time and tokens/s; every rank runs the same code.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

import autopar
from autopar.codegen import lm_cross_entropy, parallelize
from autopar.codegen.mesh import resolve_device


def bigram_batches(vocab: int, seq_len: int, batch: int, steps: int, seed: int = 0):
    """`steps` (inputs, targets) global batches from a random sparse bigram table (same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 4), generator=g)
    for _ in range(steps):
        tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        for i in range(seq_len):
            pick = torch.randint(0, 4, (batch,), generator=g)
            tokens[:, i + 1] = successors[tokens[:, i], pick]
        yield tokens[:, :-1], tokens[:, 1:]


def make_plan(args, model, example) -> autopar.Plan:
    """Rank 0 plans (or reads the file) and sends the plan's JSON to every rank: all use the same plan."""
    payload = [None]
    if dist.get_rank() == 0:
        if args.plan == "auto":
            cluster = autopar.Cluster.local(nproc=dist.get_world_size())
            plan = autopar.plan(model, cluster, example_inputs=example, global_batch_size=args.global_batch_size)
        else:
            plan = autopar.Plan.load(args.plan)
        payload = [plan.to_dict()]
    dist.broadcast_object_list(payload, src=0)
    return autopar.Plan.from_dict(payload[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny", help=f"one of {', '.join(autopar.zoo.names())}")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--plan", default="auto", help="'auto' (plan for this job) or a plan JSON file")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    device = resolve_device()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    model, example = autopar.zoo.build(args.model, seq_len=args.seq_len, device="cpu", dropout=0.0)
    plan = make_plan(args, model, example)
    rank0 = dist.get_rank() == 0
    if rank0:
        print(f"plan: {plan.config}  (predicted {plan.estimate.step_time_s * 1e3:.1f} ms/step)", flush=True)
    pm = parallelize(model, plan, example_inputs=example, device=device, loss_fn=lm_cross_entropy,
                     optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01))
    vocab = autopar.zoo.config(args.model).vocab_size
    tokens_per_step = args.global_batch_size * args.seq_len
    times = []
    for step, (x, t) in enumerate(bigram_batches(vocab, args.seq_len, args.global_batch_size, args.steps), 1):
        start = time.perf_counter()
        loss = pm.train_step(pm.local_batch(x), pm.local_batch(t))
        times.append(time.perf_counter() - start)
        if rank0:
            bar = "#" * (20 * step // args.steps)
            lead = "\r" if sys.stdout.isatty() else ""
            end = "\n" if step == args.steps or not lead else ""
            print(f"{lead}[{bar:<20}] step {step}/{args.steps}  loss {loss:.4f}  {times[-1] * 1e3:.0f} ms  "
                  f"{tokens_per_step / times[-1]:.0f} tok/s", end=end, flush=True)
    if rank0:
        steady = times[1:] or times
        mean_s = sum(steady) / len(steady)
        print(f"mean step {mean_s * 1e3:.1f} ms (after the first), {tokens_per_step / mean_s:.0f} tokens/s")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
