"""A published mixture-of-experts run's predicted step, component by component, beside the published step.

Prices the row of `benchmarks/data/published_runs.toml` as `published_runs.py` does (its layout, the
planner's best where the source leaves fields open) and splits the step of its bottleneck pipeline rank:
the kernels of its layers by class (expert GEMMs, attention, the other GEMMs, memory-bound kernels),
recompute, the expert-parallel dispatch and combine (all unhidden: autopar's runtime waits for them), the
pipeline bubble, the data-parallel tail, and the expected nodes and GPUs a token's dispatch reaches. Then
the same layout priced again with one thing changed at a time (a counterfactual a reader can check against
the source's claims: dispatch hidden, expert GEMMs at the FP8 rate, memory-bound kernels fused).

    python benchmarks/moe_decompose.py [--only deepseek]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import autopar
from autopar.planner.costs import CostModel
from autopar.planner.fp8_costs import FP8_DTYPE, is_fp8_layer
from autopar.planner.moe_load import moe_token_share
from autopar.planner.problem import MODES
from autopar.planner.space import Candidate
from cost_models.comm import expected_units_hit

sys.path.insert(0, str(Path(__file__).parent))
import published_runs as pr  # noqa: E402

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def _kernel_split(costs: CostModel, ri: int, c: Candidate) -> dict[str, float]:
    """Seconds of one layer of run `ri`, forward + backward of one micro-batch, by kernel class; and
    "expert GEMMs at FP8", the same expert kernels at the device's FP8 rate (a counterfactual)."""
    layer = costs.memory.runs[ri][0]
    comp = costs.compute
    experts = comp._experts(layer, c.ep, c.micro_batch_size, c.tp, c.sequence_parallel, c.etp)
    ep, load, share, etp = experts
    gemm_dtype = FP8_DTYPE if c.fp8 != "none" and is_fp8_layer(layer) else None
    out: dict[str, float] = defaultdict(float)
    for mix, backward in ((layer.kernels_forward, False), (layer.kernels_backward, True)):
        for k in mix.kernels:
            cls = ("expert GEMMs" if k.expert else "attention" if k.kind == "attention"
                   else "other GEMMs" if k.kind == "gemm" else "memory-bound")
            one = dataclasses.replace(mix, kernels=(k,), fused=())
            out[cls] += comp.straggler * comp._pass_s(one, c.tp, c.sequence_parallel, c.tokens_share, False,
                                                      experts, gemm_dtype, backward=backward)
            if k.expert:  # as _pass_s prices an expert kernel, at the FP8 rate
                out["expert GEMMs at FP8"] += comp.straggler * k.count * comp.model.kernel_time_s(
                    k.kind, c.tokens_share * share * load / etp * k.work, dtype=FP8_DTYPE, layout=k.layout,
                    tensor_bytes=c.tokens_share * share * k.tensor_bytes, mnk=k.mnk,
                    groups=max(1, k.groups // ep), backward=backward)
    return out


def decompose(run: dict) -> None:
    graph, cluster = pr._graph(run, {}), pr._cluster(run)
    est, cfg, refused = pr.price(run, graph, cluster)
    opts = pr._options(run)
    pub = pr.published_step_s(run, graph)
    print(f"{run['name']}: {cfg}\n  published {pub:.2f} s, predicted {est.step_time_s:.2f} s "
          f"({est.step_time_s / pub - 1:+.1%}), MFU {est.mfu:.1%}, fits {est.fits and not refused}")
    costs = CostModel.for_cluster(graph, cluster, loss_kernel=opts.loss_kernel, precision=cfg.precision,
                                  pipeline_runtime=opts.pipeline_runtime, ep_dispatcher=opts.ep_dispatcher)
    plan = autopar.plan(graph, cluster, global_batch_size=run["global_batch"],
                        options=pr._options(run, micro_batch_size=cfg.micro_batch_size, schedule=cfg.schedule,
                                            virtual_stages=cfg.virtual_stages))
    stage = max(plan.stages, key=lambda st: st.time_per_microbatch_s)
    modes = stage.layer_recompute or (stage.recompute,) * len(stage.layers)
    c = Candidate.of(plan.config)
    run_of = {la.name: ri for ri, grp in enumerate(costs.memory.runs) for la in grp}
    m = c.num_microbatches
    parts: dict[str, float] = defaultdict(float)
    for name, mode in zip(stage.layers, modes, strict=True):
        ri = run_of[name]
        split = _kernel_split(costs, ri, c)
        for cls, s in split.items():
            parts[cls] += m * s
        t = costs.compute.run(ri, c.tp, c.sequence_parallel, c.tokens_share, c.compile, c.ep, c.fp8, False,
                              c.shard_group, c.etp)
        # the passes beyond their kernels: torchao's FP8 casts, amaxes and transposes (fp8_costs.cast_work)
        parts["FP8 casts"] += m * (t.compute_s - sum(v for k, v in split.items() if k != "expert GEMMs at FP8"))
        i = MODES.index(mode)
        parts["recompute"] += m * t.recompute_s[i]
        ep = costs.comm.ep_times(ri, c.tp, c.sequence_parallel, c.tokens_share, c.ep, c.cp, c.etp)
        # a recompute mode that runs the block's forward again runs its dispatch and combine again too
        parts["dispatch + combine (unhidden)"] += m * (ep["forward"] * (2 if t.recompute_tp[i] else 1)
                                                       + ep["backward"])
    fp8_experts = parts.pop("expert GEMMs at FP8", 0.0)
    b = plan.estimate.breakdown
    busy = sum(parts.values())  # the bottleneck rank's m micro-batches
    parts["pipeline bubble"] = b["pipeline_bubble"]
    parts["pp sends"] = b["pp_comm"]
    parts["DP / ZeRO tail + optimizer"] = b["dp_comm"] + b["optimizer"]
    total = sum(parts.values())
    print(f"  bottleneck pipeline rank: {len(stage.layers)} layers ({stage.layers[0]} … {stage.layers[-1]}), "
          f"{m} micro-batches; its parts sum to {total:.2f} s (the plan's step {plan.estimate.step_time_s:.2f} s):")
    for k, v in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"    {k:<32} {v:7.2f} s  {v / total:6.1%}")

    def without(saved: float) -> float:
        """The step with `saved` seconds less on the bottleneck rank, its bubble shrunk in proportion."""
        return total - saved - parts["pipeline bubble"] * saved / busy

    hidden = parts["dispatch + combine (unhidden)"]
    fp8 = parts["expert GEMMs"] - fp8_experts
    print("  counterfactuals (what autopar does not run; the bubble scales with the rank's time):")
    for label, saved in (("dispatch + combine fully hidden", hidden), ("expert GEMMs at the FP8 rate", fp8),
                         ("both", hidden + fp8)):
        step = without(saved)
        print(f"    {label:<40} {step:6.2f} s ({step / pub - 1:+.1%} against the published {pub:.2f} s)")
    moe = next(la.moe for la in graph.layers if la.moe is not None)
    # the dispatch as priced before: every routed copy by all-to-all, and DeepEP with every expert group open
    opened = dataclasses.replace(graph, layers=tuple(
        dataclasses.replace(la, moe=dataclasses.replace(la.moe, route_groups=1, route_group_top_k=1))
        if la.moe is not None else la for la in graph.layers))
    for label, g, dispatcher in (("every routed copy by all-to-all", graph, "all_to_all"),
                                 ("DeepEP, every expert group open", opened, "deepep")):
        if dispatcher != opts.ep_dispatcher or g is not graph and moe.group_limited:
            other, _, _ = pr.price({**run, "ep_dispatcher": dispatcher}, g, cluster)
            print(f"    {label:<40} {other.step_time_s:6.2f} s ({other.step_time_s / pub - 1:+.1%}; as priced before)")
    fused = autopar.estimate(graph, cluster, dataclasses.replace(plan.config, compile=True), options=opts,
                             stages=plan.stages)
    print(f"    {'memory-bound kernels fused (compile=True)':<40} {fused.step_time_s:6.2f} s "
          f"({fused.step_time_s / pub - 1:+.1%}; autopar runs this one)")
    fb = fused.breakdown
    rank = fused.step_time_s - fb["pipeline_bubble"] - fb["pp_comm"] - fb["dp_comm"] - fb["optimizer"]
    step = fused.step_time_s - (hidden + fp8) * (1 + fb["pipeline_bubble"] / rank)
    print(f"    {'all three':<40} {step:6.2f} s ({step / pub - 1:+.1%}; left: the "
          "schedule's bubble, the run's own recompute)")
    ep, rpn = c.ep, costs.comm.ep_ranks_per_node(c.tp, c.ep, c.cp, c.etp)
    nodes = ep // rpn
    routing = (moe.num_experts, moe.top_k)
    limited = expected_units_hit(*routing, nodes, moe.route_groups, moe.route_group_top_k)
    tokens = c.micro_batch_size * moe.tokens_per_sample * moe_token_share(c.tp, c.sequence_parallel, c.ep, c.etp)
    print(f"  dispatch ({opts.ep_dispatcher}): EP{ep} over {nodes} nodes; router opens {moe.route_group_top_k} of "
          f"{moe.route_groups} expert groups; a token reaches {limited:.2f} nodes "
          f"({expected_units_hit(*routing, nodes):.2f} with every group open), "
          f"{expected_units_hit(*routing, ep, moe.route_groups, moe.route_group_top_k):.2f} GPUs; "
          f"{tokens:.0f} tokens a rank sends per micro-batch")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="deepseek", help="price the MoE runs whose name contains this")
    args = ap.parse_args(argv)
    runs = [r for r in tomllib.loads(pr.DATA.read_text())["run"] if args.only in r["name"] and r.get("ep", 1) > 1]
    if not runs:
        ap.error(f"no expert-parallel run's name contains {args.only!r}")
    for run in runs:
        decompose(run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
