"""Wall time of `autopar.plan` end to end (capture included) on the README's reference problems.

    python benchmarks/plan_speed.py [--only NAME] [--time-limit S]

Plans with `autopar.plan`'s default options (what users get: top_k runner-ups, every recompute mode per
layer). Prints, per case: wall time of capture + plan (and of building the meta model before it, which
imports torch's compiler stack on first use), the same in CPU seconds of this process (steadier than wall
time on a shared machine), layouts considered, ILPs solved and the time inside the ILP solver, solver
status and gap, and the chosen layout. Targets (issues 4 and 14): capture + plan of gpt3-175b on 1024
GPUs < 5 s and of llama3-405b on 16,384 H100 (batch 2048 × 8192) < 10 s on a 2-core machine, gap 0.
"""

from __future__ import annotations

import argparse
import time

import autopar  # run from the repository root after `pip install -e .`, or with PYTHONPATH=.
from autopar.cluster import Cluster
from autopar.config import PlannerOptions

CASES = {
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048),
    "llama3-70b": ("llama3-70b", "dgx-h100", 64, 1024, 4096),
    "llama3-405b": ("llama3-405b", "dgx-h100", 2048, 2048, 8192),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=list(CASES))
    ap.add_argument("--time-limit", type=float, default=None, help="PlannerOptions.time_limit_s (default: its default)")
    args = ap.parse_args()
    options = PlannerOptions() if args.time_limit is None else PlannerOptions(time_limit_s=args.time_limit)
    for key, (model, preset, nodes, batch, seq) in CASES.items():
        if args.only and key != args.only:
            continue
        t0, c0 = time.perf_counter(), time.process_time()
        net, x = autopar.zoo.build(model, seq_len=seq)
        t1, c1 = time.perf_counter(), time.process_time()
        graph = autopar.capture(net, x)
        t_cap = time.perf_counter() - t1
        plan = autopar.plan(graph, Cluster.preset(preset, nodes=nodes), global_batch_size=batch, options=options)
        total, cpu = time.perf_counter() - t1, time.process_time() - c1
        s = plan.solver
        print(f"{model:<12} {preset}×{nodes} ({nodes * 8} devices), batch {batch}, seq {seq}: capture + plan "
              f"{total:.2f} s wall, {cpu:.2f} s CPU (capture {t_cap:.2f} s, search {s.solve_time_s:.2f} s; model "
              f"build before it {t1 - t0:.2f} s wall, {c1 - c0:.2f} s CPU), {s.configs_considered} layouts considered, "
              f"{s.ilps_solved} ILPs solved in {s.ilp_time_s:.2f} s, {s.solver} {s.status} gap {s.gap:.2g}\n"
              f"    chosen {plan.config}  {plan.estimate.tokens_per_s:,.0f} tokens/s, MFU {plan.estimate.mfu:.1%}",
              flush=True)


if __name__ == "__main__":
    main()
