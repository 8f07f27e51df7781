"""Wall time of `autopar.plan` end to end (capture included) on the README's reference problems.

    python benchmarks/plan_speed.py [--only NAME] [--time-limit S]

Prints, per case: wall time end to end (model build + capture + plan), of which capture and search,
layouts considered, ILPs solved and the time inside the ILP solver, solver status and gap, and the chosen
layout. Targets (issue 4): gpt3-175b on 1024 GPUs < 5 s, llama3-405b on 16,384 < 30 s, both gap 0.
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
    ap.add_argument("--time-limit", type=float, default=120.0)
    args = ap.parse_args()
    for key, (model, preset, nodes, batch, seq) in CASES.items():
        if args.only and key != args.only:
            continue
        t0 = time.perf_counter()
        net, x = autopar.zoo.build(model, seq_len=seq)
        graph = autopar.capture(net, x)
        t_cap = time.perf_counter() - t0
        plan = autopar.plan(graph, Cluster.preset(preset, nodes=nodes), global_batch_size=batch,
                            options=PlannerOptions(time_limit_s=args.time_limit, top_k=3))
        total = time.perf_counter() - t0
        s = plan.solver
        print(f"{model:<12} {preset}×{nodes} ({nodes * 8} devices), batch {batch}, seq {seq}: wall {total:.2f} s "
              f"(capture {t_cap:.2f} s, search {s.solve_time_s:.2f} s), {s.configs_considered} layouts considered, "
              f"{s.ilps_solved} ILPs solved in {s.ilp_time_s:.2f} s, {s.solver} {s.status} gap {s.gap:.2g}\n"
              f"    chosen {plan.config}  {plan.estimate.tokens_per_s:,.0f} tokens/s, MFU {plan.estimate.mfu:.1%}",
              flush=True)


if __name__ == "__main__":
    main()
