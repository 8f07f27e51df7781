"""Where folding expert parallelism over tp wins: Qwen3-235B-A22B on 256 H100 at its published layout.

NVIDIA's MoE model zoo row `qwen3-235b-mcore-h100-256-fsdp` (benchmarks/data/published_runs.toml) runs
TP2 · EP8 · ETP1 · EDP32 · DP128: Megatron-Core folds EP8 over the TP2 × DP4 ranks of one node (Parallel
Folding, Liu et al. 2025, arXiv:2504.14960). This prices the row's layout at every expert-parallel degree
autopar allows under tp2 (folded: tp2 × ep/tp data-parallel ranks; autopar.config.ep_folds) and lets the
planner choose ep with the rest of the published layout pinned: ep16 and up span two nodes or more, so their
all-to-alls cross InfiniBand, and ep4 and down hold more experts a rank, gathered over more ranks under FSDP.

    python benchmarks/moe_fold.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import tomllib

import autopar
from autopar import PlannerOptions

sys.path.insert(0, str(Path(__file__).parent))
import published_runs  # noqa: E402

ROW = "qwen3-235b-mcore-h100-256-fsdp"


def main() -> int:
    runs = tomllib.loads((Path(__file__).parent / "data" / "published_runs.toml").read_text())["run"]
    run = next(r for r in runs if r["name"] == ROW)
    graph, cluster = published_runs._graph(run, {}), published_runs._cluster(run)
    _, layout, _ = published_runs.price(run, graph, cluster)
    print(f"{ROW}: published {run['step_s']} s a step at {layout}")
    for ep in (2, 4, 8, 16, 32):
        cfg = dataclasses.replace(layout, ep=ep)
        est = autopar.estimate(graph, cluster, cfg)
        print(f"  {cfg.ep_text():<34} step {est.step_time_s:6.2f} s  all-to-all and TP "
              f"{est.breakdown['tp_comm']:5.2f} s  data-parallel tail {est.breakdown['dp_comm']:5.2f} s  "
              f"peak {est.peak_memory_bytes / 2**30:.1f} GiB")
    pins = dict(tp=layout.tp, pp=layout.pp, dp=layout.dp, zero_stage=layout.zero_stage,
                micro_batch_size=layout.micro_batch_size, recompute=layout.recompute,
                sequence_parallel=layout.sequence_parallel, compile=layout.compile, top_k=0)
    plan = autopar.plan(graph, cluster, global_batch_size=run["global_batch"], options=PlannerOptions(**pins))
    print(f"  planner, ep free: {plan.config.ep_text()}, {plan.estimate.step_time_s:.2f} s, {plan.solver.status}, "
          f"gap {plan.solver.gap:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
