"""What per-layer recompute, op-level selective checkpointing and compiled blocks gain in predicted step
time (issue 14).

    python benchmarks/recompute_compile_gain.py [--only NAME]

For each of the zoo's large models on its reference cluster, plans four times with autopar.plan's
defaults otherwise: (1) the space before issue 14: one of none / selective / full per pipeline rank, eager
blocks; (2) a mode per layer (k of a rank's n layers may recompute); (3) with op_sac too (the default
space); (4) with op_sac and every block compiled (PlannerOptions(compile=True)). Prints each row's
predicted step time, its gain over row (1), its layout and how many layers use each recompute mode, and
the planning time.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import autopar  # run from the repository root after `pip install -e .`, or with PYTHONPATH=.
from autopar.cluster import Cluster
from autopar.config import PlannerOptions

CASES = {  # model, preset, nodes, global batch, sequence
    "llama3-8b": ("llama3-8b", "dgx-h100", 1, 16, 8192),
    "llama3-70b": ("llama3-70b", "dgx-h100", 64, 1024, 4096),
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048),
    "llama3-405b": ("llama3-405b", "dgx-h100", 2048, 2048, 8192),
}
ROWS = {
    "one of 3 modes per rank": PlannerOptions(exclude_recompute=("op_sac",), recompute_per_layer=False),
    "+ per layer": PlannerOptions(exclude_recompute=("op_sac",)),
    "+ op_sac": PlannerOptions(),
    "+ op_sac + compiled blocks": PlannerOptions(compile=True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=list(CASES))
    args = ap.parse_args()
    print(f"{'model':<12} {'space':<28} {'step':>9} {'gain':>7}  {'plan':>6}  layout / layers per recompute mode")
    for key, (model, preset, nodes, batch, seq) in CASES.items():
        if args.only and key != args.only:
            continue
        net, x = autopar.zoo.build(model, seq_len=seq)
        graph = autopar.capture(net, x)
        cluster = Cluster.preset(preset, nodes=nodes)
        base = None
        for name, options in ROWS.items():
            t0 = time.perf_counter()
            plan = autopar.plan(graph, cluster, global_batch_size=batch, options=options)
            seconds = time.perf_counter() - t0
            step = plan.estimate.step_time_s
            base = base or step
            modes = Counter(k for s in plan.stages for k in s.layer_modes)
            print(f"{key:<12} {name:<28} {step:>7.3f} s {base / step - 1:>+6.1%}  {seconds:>4.1f} s  {plan.config}  "
                  + ", ".join(f"{n} {k}" for k, n in modes.most_common()), flush=True)


if __name__ == "__main__":
    main()
