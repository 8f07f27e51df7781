"""autopar's runtime against hand-written PyTorch-native code: the same model, layout, data and optimizer.

    python benchmarks/native_ratio.py [--hidden 512] [--layers 4] [--seq-len 256] [--batch 8]
                                      [--microbatches 4] [--steps 3] [--rounds 3]

Two gloo ranks on this machine, one thread each, fp32. The zoo Llama (llama-tiny widened to --hidden, ffn
2.6875x, 4 heads / 2 KV heads, vocabulary 1024) trains under three layouts, each twice from the same initial
weights: by `autopar.parallelize` with a hand-made plan (tests/parity_models.make_plan, the planner not asked),
and by the code a user writes with PyTorch's own parts:
- tp2: `parallelize_module` with ColwiseParallel / RowwiseParallel (vocabulary-parallel embedding and head,
  `loss_parallel` cross-entropy), no sequence parallelism on either side;
- tp2-sp: the same with sequence parallelism (SequenceParallel norms, PrepareModuleInput gathering each
  attention's and MLP's input, row outputs reduce-scattered over the sequence; torchtitan's Llama plan), only
  with --layouts tp2-sp: autopar's side fails it today (see main);
- pp2: `torch.distributed.pipelining` PipelineStage + Schedule1F1B, the same cut (embedding and 2 blocks |
  2 blocks, norm and head) and micro-batches;
- dp2 ZeRO-3: `fully_shard` (reshard after forward) on every block and the root, with the
  MixedPrecisionPolicy autopar uses in fp32 (the default one), gradients reduce-scattered by FSDP.
Both sides log the global mean loss each step (one all-reduce). The first steps' losses must agree within
fp32 tolerance (rtol 1e-4); each round times --steps steps of every layout, autopar's and native steps alternating;
the ratios printed are autopar / native of the median step time (wall clock, and CPU time of both ranks
together, which other load on the host moves less), per round and the median over rounds.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYOUTS = ("tp2", "tp2-sp", "pp2", "dp2-zero3")
VOCAB = 1024


def build(args: argparse.Namespace) -> nn.Module:
    import autopar

    torch.manual_seed(0)
    model, _ = autopar.zoo.build("llama-tiny", seq_len=args.seq_len, device="cpu", dtype=torch.float32,
                                 hidden_size=args.hidden, n_layers=args.layers, ffn_hidden_size=args.hidden * 43 // 16,
                                 vocab_size=VOCAB)
    return model


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, eps=1e-6)


def global_mean(loss: torch.Tensor, divisor: int) -> float:
    t = loss.detach().reshape(1).clone()
    dist.all_reduce(t)
    return float(t.item() / divisor)


# ---------------------------------------------------------------------------------------------- autopar
def autopar_stepper(layout: str, model: nn.Module, graph, args: argparse.Namespace):
    from parity_models import make_plan

    from autopar.codegen import lm_cross_entropy, parallelize

    config = {"tp2": dict(tp=2, sequence_parallel=False, micro_batch_size=args.batch),
              "tp2-sp": dict(tp=2, sequence_parallel=True, micro_batch_size=args.batch),
              "pp2": dict(pp=2, num_microbatches=args.microbatches, micro_batch_size=args.batch // args.microbatches,
                          stage_sizes=(1 + args.layers // 2, args.layers - args.layers // 2 + 2)),
              "dp2-zero3": dict(dp=2, zero_stage=3, micro_batch_size=args.batch // 2)}[layout]
    plan = make_plan(graph, precision="fp32", compile=False, **config)
    pm = parallelize(model, plan, graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
    return lambda x, t: pm.train_step(pm.local_batch(x), pm.local_batch(t))


# ----------------------------------------------------------------------------------------------- native
class _Stage(nn.Module):
    """One pipeline stage of the zoo Llama: the embedding (first), a run of blocks, norm and head (last)."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in blocks)
        self.norm = model.norm if last else None
        self.output = model.output if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x)) if self.output is not None else x


def ce(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2).float(), t.flatten())


def native_stepper(layout: str, model: nn.Module, args: argparse.Namespace):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    rank = dist.get_rank()
    if layout in ("tp2", "tp2-sp"):
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            PrepareModuleInput,
            RowwiseParallel,
            SequenceParallel,
            loss_parallel,
            parallelize_module,
        )

        if layout == "tp2":
            plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                    "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
            rows = {"": RowwiseParallel()}
        else:  # the residual stream a DTensor sharded over the sequence, as torchtitan's Llama
            plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "norm": SequenceParallel(),
                    "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                              use_local_output=False)}
            rows = {"": RowwiseParallel(output_layouts=Shard(1))}
        for i in range(len(model.layers)):
            plan.update({f"layers.{i}.attention.{n}": ColwiseParallel() for n in ("wq", "wk", "wv")})
            plan.update({f"layers.{i}.feed_forward.{n}": ColwiseParallel() for n in ("w1", "w3")})
            plan[f"layers.{i}.attention.wo"] = rows[""]
            plan[f"layers.{i}.feed_forward.w2"] = rows[""]
            if layout == "tp2-sp":
                plan[f"layers.{i}.attention_norm"] = SequenceParallel()
                plan[f"layers.{i}.ffn_norm"] = SequenceParallel()
                # (x, rope_cos, rope_sin, position_ids): only the hidden states are a sequence shard
                plan[f"layers.{i}.attention"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                                   desired_input_layouts=(Replicate(), None, None,
                                                                                          None))
                plan[f"layers.{i}.feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),),
                                                                      desired_input_layouts=(Replicate(),))
        parallelize_module(model, mesh, plan)
        opt = optimizer(model.parameters())

        def step(x, t):
            opt.zero_grad(set_to_none=True)
            with loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), t.flatten())
                loss.backward()
            opt.step()
            return global_mean(loss.full_tensor() if hasattr(loss, "full_tensor") else loss, 2)
        return step
    if layout == "pp2":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        half = args.layers // 2
        blocks = range(0, half) if rank == 0 else range(half, args.layers)
        part = _Stage(model, blocks, first=rank == 0, last=rank == 1)
        stage = PipelineStage(part, rank, 2, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=ce)
        opt = optimizer(part.parameters())

        def step(x, t):
            opt.zero_grad(set_to_none=True)
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(x)
                total = torch.zeros(())
            else:
                schedule.step(target=t, losses=losses)
                total = torch.stack(losses).sum() / args.microbatches
            opt.step()
            return global_mean(total, 1)
        return step
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy()  # what autopar.codegen.precision.fsdp_mixed_precision gives fp32
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=mp_policy)
    opt = optimizer(model.parameters())

    def step(x, t):
        opt.zero_grad(set_to_none=True)
        xs, ts = x.chunk(2)[rank], t.chunk(2)[rank]
        loss = ce(model(xs), ts)
        loss.backward()
        opt.step()
        return global_mean(loss, 2)
    return step


# -------------------------------------------------------------------------------------------------- run
def timed(step, x: torch.Tensor, t: torch.Tensor) -> tuple[float, float]:
    """(wall s, CPU s of both ranks together) of one step, started together on both ranks."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    step(x, t)
    wall, cpu = time.perf_counter() - t0, torch.tensor([time.process_time() - c0], dtype=torch.float64)
    dist.all_reduce(cpu)
    return wall, float(cpu)


def worker(rank: int, args: argparse.Namespace, port: int, results) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    import autopar

    g = torch.Generator().manual_seed(1)
    n = args.check_steps + args.rounds * args.steps
    data = [(torch.randint(0, VOCAB, (args.batch, args.seq_len), generator=g),
             torch.randint(0, VOCAB, (args.batch, args.seq_len), generator=g)) for _ in range(n)]
    base = build(args)
    graph = autopar.capture(base, (torch.zeros(1, args.seq_len, dtype=torch.long),))
    steppers, losses = {}, {}
    for layout in args.layouts:
        steppers[layout, "autopar"] = autopar_stepper(layout, copy.deepcopy(base), graph, args)
        steppers[layout, "native"] = native_stepper(layout, copy.deepcopy(base), args)
        for side in ("autopar", "native"):  # the first steps: losses compared, and warm-up
            losses[layout, side] = [steppers[layout, side](x, t) for x, t in data[:args.check_steps]]
    # per round and side: median wall and CPU seconds of its steps; autopar's and native steps alternate, so
    # load from other work on the host falls on both alike
    times: dict[tuple[str, str], list[tuple[float, float]]] = {k: [] for k in steppers}
    for r in range(args.rounds):
        chunk = data[args.check_steps + r * args.steps: args.check_steps + (r + 1) * args.steps]
        for layout in args.layouts:
            got: dict[str, list[tuple[float, float]]] = {"autopar": [], "native": []}
            for x, t in chunk:
                for side in got:
                    got[side].append(timed(steppers[layout, side], x, t))
            for side, runs in got.items():
                times[layout, side].append((statistics.median(w for w, _ in runs),
                                            statistics.median(c for _, c in runs)))
    results.put((rank, losses, times))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--microbatches", type=int, default=4, help="pp2's micro-batches")
    ap.add_argument("--check-steps", type=int, default=3, help="first steps whose losses are compared")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per round and layout")
    ap.add_argument("--rounds", type=int, default=3)
    # tp2-sp is not in the default: autopar's side fails it (PlanMismatchError in layers.0.attention, the zoo
    # block's rope tables sized from the sequence-sharded input), and the other rank then waits for gloo's timeout
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=[x for x in LAYOUTS if x != "tp2-sp"])
    args = ap.parse_args()
    from dist_harness import free_port

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    t0 = time.perf_counter()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, args, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    out = dict((r, (lo, ti)) for r, lo, ti in (results.get() for _ in procs))
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        print("a rank failed", file=sys.stderr)
        return 1
    losses, times = out[0]
    print(f"$ python benchmarks/native_ratio.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"zoo Llama {args.hidden}x{args.layers}, seq {args.seq_len}, global batch {args.batch}, fp32, 2 gloo ranks "
          f"x 1 thread, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f} at the end, "
          f"{time.perf_counter() - t0:.0f} s")
    print(f"{'layout':<10} {'loss rel. diff':>14} {'autopar s':>9} {'native s':>8}  {'wall ratio by round':<20} "
          f"{'median':>6}  {'CPU ratio (both ranks)':<22} {'median':>6}")
    worst = 0.0
    for layout in args.layouts:
        a, n = losses[layout, "autopar"], losses[layout, "native"]
        diff = max(abs(x - y) / abs(y) for x, y in zip(a, n, strict=True))
        worst = max(worst, diff)
        ta, tn = times[layout, "autopar"], times[layout, "native"]
        wall = [x[0] / y[0] for x, y in zip(ta, tn, strict=True)]
        cpu = [x[1] / y[1] for x, y in zip(ta, tn, strict=True)]
        by_round = " ".join(f"{r:.3f}" for r in wall), " ".join(f"{r:.3f}" for r in cpu)
        print(f"{layout:<10} {diff:>14.1e} {statistics.median(w for w, _ in ta):>9.3f} "
              f"{statistics.median(w for w, _ in tn):>8.3f}  {by_round[0]:<20} {statistics.median(wall):>6.3f}  "
              f"{by_round[1]:<22} {statistics.median(cpu):>6.3f}")
    if worst > 1e-4:
        print(f"losses differ by {worst:.1e} (> 1e-4): the two sides do not train the same thing", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
