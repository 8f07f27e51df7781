"""The golden plans: the whole Plan JSON of three reference problems, as the planner writes them today.

    python tests/golden/regen.py        # rewrite tests/golden/*.json from this tree

tests/test_golden_plans.py plans the same problems and compares the JSON text with these files, so any
change to a plan (a layout, a stage cut, one bit of a predicted figure) fails it. Regenerate only when a
change is meant to move plans (a new ParallelConfig field, a pricing change) and say why in the commit.

The problems are the README's (benchmarks/plan_speed.py): gpt3-175b on 1,024 A100 (128 dgx-a100-80gb
nodes, batch 1536, seq 2048), llama3-70b on 512 H100 (64 dgx-h100 nodes, batch 1024, seq 4096) and
llama3-405b on 16,384 H100 (2,048 nodes, batch 2048, seq 8192), with `autopar.plan`'s default options.
The solver's wall-clock fields (`solver.solve_time_s`, `solver.ilp_time_s`) vary run to run and are
written as 0; every other field is kept as the plan holds it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:  # this tree's autopar, whatever the editable install points at
    sys.path.insert(0, str(HERE.parents[1]))

# name: (zoo model, cluster preset, nodes, global batch, seq len)
CASES = {
    "gpt3-175b": ("gpt3-175b", "dgx-a100-80gb", 128, 1536, 2048),
    "llama3-70b": ("llama3-70b", "dgx-h100", 64, 1024, 4096),
    "llama3-405b": ("llama3-405b", "dgx-h100", 2048, 2048, 8192),
}
TIMING_FIELDS = ("solve_time_s", "ilp_time_s")  # of `solver`: wall time, not part of the plan's answer


def golden_path(name: str) -> Path:
    return HERE / f"{name}.json"


def plan_text(name: str) -> str:
    """The plan of case `name` as JSON text, its timing fields zeroed, as the golden file holds it."""
    import autopar
    from autopar.cluster import Cluster

    model, preset, nodes, batch, seq = CASES[name]
    net, x = autopar.zoo.build(model, seq_len=seq)
    plan = autopar.plan(autopar.capture(net, x), Cluster.preset(preset, nodes=nodes), global_batch_size=batch)
    d = plan.to_dict()
    for f in TIMING_FIELDS:
        d["solver"][f] = 0.0
    return json.dumps(d, indent=1) + "\n"


def main() -> None:
    for name in CASES:
        golden_path(name).write_text(plan_text(name))
        print(f"wrote {golden_path(name)}")


if __name__ == "__main__":
    main()
