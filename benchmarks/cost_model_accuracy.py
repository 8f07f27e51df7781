"""Prediction against measurement on this machine: does the cost model, fed a fresh profile, predict
what it has not measured?

    python benchmarks/cost_model_accuracy.py [--profile profile.json] [--nproc 4]

1. Profile this machine (`profile_machine(quick=True)`), unless --profile is given.
2. GEMMs of shapes the sweep did not time: ComputeModel.gemm_time_s vs torch.mm, median of repeats.
3. A GPT transformer block (h=768, 12 heads, s=512, b=2, eager attention) forward + backward: what the
   planner charges for that layer (autopar.capture of a one-block GPT, CostModel.layer_compute_s: the
   sum of the captured kernels, each priced from the GEMM, batched-matmul and elementwise tables at its
   own size, layout and class) — not from a layer entry; beside it (not counted) the op-by-op prediction
   of the same block traced on this machine (cost_models.optrace).
4. gloo all-reduce over 2 and 4 processes (4 on a 2-core machine is oversubscribed) at sizes midway (in
   log-size) between the profile's table points: CommModel on tables the profiler measures at its own
   sizes, each round paired in time with the measurement of the midpoints (`allreduce_cases`).
Prints each case with its relative error and whether it is within 15%, and the load average at each
stage. Other processes on the same cores change both sides of the comparison: `--clock thread` times
kernels, GEMMs and the block single-threaded by CPU time on both sides (the collectives stay on the wall
clock, which is what they cost). Memory contention still reaches the thread clock, so the rule is:
profile and measure at the same load (bf16 GEMMs on AMX are the most sensitive).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch

from cost_models import catalog
from cost_models.comm import CommModel, Topology
from cost_models.compute import ComputeModel
from cost_models.optrace import predict_ops_time_s, trace_ops
from cost_models.profile import CollectiveSample, Profile
from cost_models.profiler import profile_machine
from cost_models.profiler.collectives import measure_collectives
from cost_models.profiler.timing import time_callable

TOLERANCE = 0.15
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GEMM_CASES = [(1536, 1536, 1536), (3000, 700, 1300), (2048, 4096, 1024)]
# 45 KiB, 724 KiB, 11.3 MiB: midway in log-size between the profile table's points (×2 apart)
ALLREDUCE_BYTES = [round(2**e / 64) * 64 for e in (15.5, 19.5, 23.5)]
ROUNDS = 5  # paired rounds of (profiler table, measurement) for the collectives


def row(name: str, predicted_s: float, measured_s: float, note: str = "") -> bool:
    err = predicted_s / measured_s - 1.0
    ok = abs(err) <= TOLERANCE
    print(f"{name:<56}{predicted_s * 1e3:>12.3f}{measured_s * 1e3:>12.3f}{err * 100:>+9.1f}%  {'ok' if ok else 'MISS'}"
          + (f"  {note}" if note else ""))
    return ok


def gemm_cases(cm: ComputeModel, device: torch.device, clock: str) -> list[bool]:
    results = []
    for dtype in ("float32", "bfloat16"):
        for m, n, k in GEMM_CASES:
            a = torch.randn(m, k, dtype=DTYPES[dtype], device=device)
            b = torch.randn(k, n, dtype=DTYPES[dtype], device=device)
            measured = time_callable(lambda a=a, b=b: torch.mm(a, b), device, trial_s=0.05, trials=7, clock=clock)
            results.append(row(f"gemm {m}x{n}x{k} {dtype}", cm.gemm_time_s(m, n, k, dtype), measured))
    return results


def block_cases(prof: Profile, device: torch.device, clock: str) -> list[bool]:
    """The block row is what `autopar.plan` charges for that layer: capture of a one-block GPT at the
    measured batch, priced by the planner's CostModel (the sum of the captured kernels)."""
    # imported here: spawned collective workers re-import this script and need only cost_models
    import autopar
    from autopar.planner.costs import CostModel
    from autopar.zoo.gpt import GPTBlock, GPTConfig

    results = []
    cfg = GPTConfig(n_layers=1, hidden_size=768, n_heads=12, vocab_size=1024, max_seq_len=512, dropout=0.0,
                    attn_impl="eager")
    cm = ComputeModel(catalog.device("cpu"), prof)
    link = catalog.link("cpu-loopback")
    for dtype in ("float32", "bfloat16"):
        model, inputs = autopar.zoo.build("gpt2-small", seq_len=512, batch_size=2, dtype=DTYPES[dtype],
                                          **{f: getattr(cfg, f) for f in ("n_layers", "vocab_size", "dropout",
                                                                          "attn_impl")})
        graph = autopar.capture(model, inputs)
        planner = CostModel(graph, device=catalog.device("cpu"), devices_per_node=1, nodes=1, intra_node=link,
                            inter_node=link, profile=prof, backend="gloo")
        predicted = planner.compute.layer_compute_s("blocks.0", tp=1, sp=False, micro_batch=2)
        block = GPTBlock(cfg).to(device=device, dtype=DTYPES[dtype])
        x = torch.randn(2, 512, 768, dtype=DTYPES[dtype], device=device, requires_grad=True)
        grad = torch.randn_like(x)

        def step(block: torch.nn.Module = block, x: torch.Tensor = x, grad: torch.Tensor = grad) -> None:
            block.zero_grad(set_to_none=True)  # as a training step: gradients are written, not accumulated
            x.grad = None
            block(x).backward(grad)

        ops = trace_ops(step)
        measured = time_callable(step, device, trial_s=0.3, trials=7, max_reps=20, clock=clock)
        results.append(row(f"GPT block h768 s512 b2 fwd+bwd {dtype} (planner)", predicted, measured))
        row(f"  (op by op, not counted) {dtype}", predict_ops_time_s(ops, cm, dtype), measured)
    return results


def allreduce_cases(prof: Profile, nproc: int) -> list[bool]:
    """Each round runs the profiler's own all-reduce sweep (its table sizes, as `profile_machine` runs it)
    and then the measurement at the midpoint sizes, seconds apart; the prediction prices the midpoints
    from the median of the rounds' tables, the measurement is the median of the rounds. Pairing them in
    time keeps the machine's drift out of the comparison: small gloo messages on these 2 shared vCPUs
    drift ±20% over minutes, which a table measured once at the start would read as model error. The
    error against the profile's own tables (measured minutes earlier) is printed beside, not counted."""
    groups = [g for g in (2, 4) if g <= nproc]
    plan = [("all_reduce", g) for g in groups]
    tables, rounds = [], []
    for _ in range(ROUNDS):
        tables.append(measure_collectives(nproc, backend="gloo", quick=True, progress=lambda _m: None, plan=plan))
        rounds.append(measure_collectives(nproc, backend="gloo", quick=False, progress=lambda _m: None,
                                          sizes=ALLREDUCE_BYTES, plan=plan))

    def median_of(runs: list[list[CollectiveSample]]) -> list[CollectiveSample]:
        return [dataclasses.replace(first, time_s=statistics.median(r[i].time_s for r in runs))
                for i, first in enumerate(runs[0])]

    paired = dataclasses.replace(prof, collectives=tuple(median_of(tables)))
    topo = Topology(devices_per_node=nproc, intra=catalog.link("cpu-loopback"), inter=catalog.link("cpu-loopback"))
    comm, earlier = CommModel(topo, profile=paired), CommModel(topo, profile=prof)
    results = []
    for s in median_of(rounds):
        own = earlier.all_reduce_time_s(s.n_bytes, s.group_size, s.group_size) if \
            prof.collective_table("all_reduce", s.group_size) else float("nan")
        results.append(row(f"gloo all_reduce x{s.group_size} {s.n_bytes / 2**10:.0f} KiB",
                           comm.all_reduce_time_s(s.n_bytes, s.group_size, s.group_size), s.time_s,
                           note=f"(profile's own table {(own / s.time_s - 1) * 100:+.1f}%)"))
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="use this profile instead of measuring one now")
    ap.add_argument("--save-profile", help="write the profile measured now here (to rerun with --profile)")
    ap.add_argument("--nproc", type=int, default=4, help="processes for the collective sweep (default 4)")
    ap.add_argument("--clock", choices=("wall", "thread"), default="wall",
                    help="wall: elapsed time; thread: single-threaded CPU time, for shared machines")
    args = ap.parse_args()
    device = torch.device("cpu")
    if args.clock == "thread":
        torch.set_num_threads(1)
    t0 = time.perf_counter()
    if args.profile:
        prof = Profile.load(args.profile)
    else:
        print(f"profiling this machine (quick sweep, {args.nproc} processes) ...", flush=True)
        prof = profile_machine(nproc=args.nproc, quick=True, clock=args.clock)
        if args.save_profile:
            prof.save(args.save_profile)
    print(f"profile: {prof.device_name}, torch {prof.torch_version}, {prof.created}, clock {prof.clock}, "
          f"{torch.get_num_threads()} threads; took {time.perf_counter() - t0:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    if prof.clock != args.clock:
        print(f"warning: the profile was timed with the {prof.clock} clock, this run with {args.clock}: "
              "not like with like")
    cm = ComputeModel(catalog.device("cpu"), prof)
    print(f"{'case':<56}{'pred ms':>12}{'meas ms':>12}{'error':>10}")
    print(f"clock: {args.clock}")
    results = gemm_cases(cm, device, args.clock)
    print(f"(load average {os.getloadavg()[0]:.1f})")
    results += block_cases(prof, device, args.clock)
    print(f"(load average {os.getloadavg()[0]:.1f})")
    results += allreduce_cases(prof, args.nproc)
    hits = sum(results)
    errs = f"{hits}/{len(results)} within {TOLERANCE:.0%}"
    print(f"\n{errs}; total {time.perf_counter() - t0:.0f} s; load average now {os.getloadavg()[0]:.1f}")
    return 0 if hits == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
