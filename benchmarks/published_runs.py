"""How well autopar prices real GPU training: every published run in `benchmarks/data/published_runs.toml`
priced with `autopar.estimate` on its own layout and model shape, against the published step time and,
where published, peak memory.

Prints per run the predicted and published step time and memory, whether autopar says the layout fits,
the mean absolute percentage error (MAPE) of step time, and the baseline "6·N·tokens at one constant MFU",
with that constant fitted to these same runs (the MAPE-minimising one), for comparison. Where a source does
not publish the micro-batch size and schedule, the run is priced at the planner's best with every published
field pinned (that is what the people who ran it tuned too); if nothing fits, at micro-batch 1 and 1F1B,
and it counts as refused.

    python benchmarks/published_runs.py [--only NAME_SUBSTRING] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import autopar
from autopar import Cluster, ParallelConfig, PlannerOptions
from autopar.errors import InfeasiblePlanError
from cost_models import catalog

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).parent))
import fused_llama  # noqa: E402  (beside this script)

DATA = Path(__file__).parent / "data" / "published_runs.toml"
GiB = float(1 << 30)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Priced:
    name: str
    published_s: float
    predicted_s: float
    fits: bool
    config: str
    published_GiB: float | None
    predicted_GiB: float
    params: float  # N
    tokens: float  # per step
    peak_flops: float  # per GPU, the run's dtype
    gpus: int

    @property
    def error(self) -> float:
        return self.predicted_s / self.published_s - 1.0

    @property
    def memory_error(self) -> float | None:
        return None if self.published_GiB is None else self.predicted_GiB / self.published_GiB - 1.0


def _graph(run: dict, cache: dict):
    impl = run.get("model_impl", "zoo")
    key = (run["model"], impl, run["seq_len"], tuple(sorted(run.get("overrides", {}).items())))
    if key not in cache:
        build = fused_llama.build if impl == "fused" else autopar.zoo.build
        model, x = build(run["model"], seq_len=run["seq_len"], **run.get("overrides", {}))
        cache[key] = autopar.capture(model, x)
    return cache[key]


def _cluster(run: dict) -> Cluster:
    base = Cluster.preset(run["cluster"], nodes=max(1, run["gpus"] // 8))
    if base.world_size != run["gpus"]:
        raise ValueError(f"{run['name']}: {run['gpus']} GPUs is not a whole number of 8-GPU nodes")
    if "device" in run:
        base = dataclasses.replace(base, device=catalog.device(run["device"]))
    return base


def published_step_s(run: dict, graph) -> float:
    """The source's throughput as seconds per optimizer step."""
    tokens = run["global_batch"] * run["seq_len"]
    if "step_s" in run:
        return float(run["step_s"])
    if "tokens_per_s_per_gpu" in run:
        return tokens / (run["gpus"] * run["tokens_per_s_per_gpu"])
    b, s, gpus = run["global_batch"], run["seq_len"], run["gpus"]
    L, h, V = sum(la.kind == "block" for la in graph.layers), graph.hidden_size, graph.vocab_size
    if run["flops_formula"] == "narayanan":  # eq. 3 of Narayanan et al. 2021, recompute forward included
        flops = 96.0 * b * s * L * h * h * (1 + s / (6.0 * h) + V / (16.0 * L * h))
    elif run["flops_formula"] == "6n_attn":  # PaLM (Chowdhery et al. 2022) Appendix B
        flops = tokens * (6.0 * graph.num_params + 12.0 * L * h * s)
    else:
        raise ValueError(f"{run['name']}: unknown flops_formula {run['flops_formula']!r}")
    return flops / (gpus * run["tflops_per_gpu"] * 1e12)


def _run_options(run: dict) -> dict:
    """The run's precision and memory options as ParallelConfig fields: FP8 recipe, offload, compiled blocks."""
    return dict(fp8=run.get("fp8", "none"), offload=run.get("offload", "none"), compile=run.get("compile", False))


def price(run: dict, graph, cluster: Cluster) -> tuple[autopar.Estimate, str, bool]:
    """(estimate, layout, refused): the published layout, or the planner's best with its published fields."""
    dp, gb = run["dp"], run["global_batch"]
    if "mbs" in run:
        cfg = ParallelConfig(tp=run["tp"], pp=run["pp"], dp=dp, zero_stage=run["zero"], micro_batch_size=run["mbs"],
                             num_microbatches=gb // (dp * run["mbs"]), schedule=run.get("schedule", "1f1b"),
                             virtual_stages=run.get("v", 1), recompute=run["recompute"],
                             sequence_parallel=run["sp"], **_run_options(run))
        est = autopar.estimate(graph, cluster, cfg)
        return est, str(cfg), not est.fits
    opts = PlannerOptions(tp=run["tp"], pp=run["pp"], dp=dp, zero_stage=run["zero"], recompute=run["recompute"],
                          sequence_parallel=run["sp"], top_k=0, max_virtual_stages=8,
                          **_run_options(run))
    try:
        plan = autopar.plan(graph, cluster, global_batch_size=gb, options=opts)
        return plan.estimate, str(plan.config), False
    except InfeasiblePlanError:
        cfg = ParallelConfig(tp=run["tp"], pp=run["pp"], dp=dp, zero_stage=run["zero"], micro_batch_size=1,
                             num_microbatches=gb // dp, schedule="1f1b", recompute=run["recompute"],
                             sequence_parallel=run["sp"], **_run_options(run))
        return autopar.estimate(graph, cluster, cfg), str(cfg), True


def _memory_as_published(run: dict, est) -> float:
    """The estimate's bytes in the source's terms: torch.cuda.max_memory_reserved (torchtitan logs it) is the
    tensor peak plus the caching allocator's fragmentation (Estimate.reserved_bytes); else the tensor peak."""
    return est.reserved_bytes if run.get("memory_kind", "reserved") == "reserved" else est.peak_memory_bytes


def fitted_constant_mfu(rows: list[Priced]) -> tuple[float, float]:
    """(c, MAPE) of the baseline step = 6·N·tokens / (gpus · peak · c), c minimising the MAPE over `rows`.
    The MAPE is piecewise convex in 1/c with its minimum at a weighted median of the per-run ratios, so
    scanning every run's own ratio finds it exactly."""
    ideal = [6.0 * r.params * r.tokens / (r.gpus * r.peak_flops) for r in rows]  # step time at MFU 1

    def mape(c: float) -> float:
        return statistics.fmean(abs(i / c / r.published_s - 1.0) for i, r in zip(ideal, rows, strict=True))

    candidates = [i / r.published_s for i, r in zip(ideal, rows, strict=True)]
    best = min(candidates, key=mape)
    return best, mape(best)


def print_speedups(runs: list[dict], rows: list[Priced]) -> None:
    """FP8 over 16-bit (or offload over none): each run that names its `baseline` run, published ratio beside
    the predicted one (the same two layouts priced by autopar)."""
    by_name = {r.name: r for r in rows}
    pairs = [(by_name[run["name"]], by_name.get(run["baseline"])) for run in runs if "baseline" in run]
    pairs = [(row, base) for row, base in pairs if base is not None]
    if not pairs:
        return
    print(f"\n{'speedup over its baseline':<62} {'published':>9} {'predicted':>9} {'error':>7}")
    for row, base in pairs:
        pub, pred = base.published_s / row.published_s, base.predicted_s / row.predicted_s
        print(f"{row.name + ' / ' + base.name:<62} {pub:>8.3f}x {pred:>8.3f}x {pred / pub - 1:>+7.1%}")


def _planner_against_meta(runs: list[dict], cache: dict) -> None:
    """Llama-3-405B on 16,384 H100: Meta's layout against what autopar.plan chooses for the same job."""
    run = next((r for r in runs if r["name"] == "llama3-405b-16k-gpus"), None)
    if run is None:
        return
    graph, cluster = _graph(run, cache), _cluster(run)
    meta, layout, _ = price(run, graph, cluster)
    plan = autopar.plan(graph, cluster, global_batch_size=run["global_batch"], options=PlannerOptions(top_k=0))
    print(f"llama3-405b on {run['gpus']:,} H100: Meta's layout priced at MFU {meta.mfu:.1%} (published 38–41%), "
          f"{meta.step_time_s:.2f} s; autopar plan {plan.config}: MFU {plan.estimate.mfu:.1%}, "
          f"{plan.estimate.step_time_s:.2f} s ({plan.solver.status}, gap {plan.solver.gap:g})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="price only runs whose name contains this")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    runs = tomllib.loads(DATA.read_text())["run"]
    if args.only:
        runs = [r for r in runs if args.only in r["name"]]
    cache: dict = {}
    rows: list[Priced] = []
    t0 = time.perf_counter()
    print(f"{'run':<32} {'published':>10} {'predicted':>10} {'error':>7}  {'mem pub':>8} {'mem pred':>9} "
          f"{'error':>7}  fits  layout priced")
    for run in runs:
        graph, cluster = _graph(run, cache), _cluster(run)
        est, layout, refused = price(run, graph, cluster)
        pub = published_step_s(run, graph)
        row = Priced(name=run["name"], published_s=pub, predicted_s=est.step_time_s, fits=not refused, config=layout,
                     published_GiB=run.get("memory_GiB"), predicted_GiB=_memory_as_published(run, est) / GiB,
                     params=graph.num_params, tokens=run["global_batch"] * run["seq_len"],
                     peak_flops=cluster.device.peak_flops_for(graph.dtype), gpus=run["gpus"])
        rows.append(row)
        mem_pub = f"{row.published_GiB:.1f}" if row.published_GiB else "-"
        mem_err = f"{row.memory_error:+.1%}" if row.memory_error is not None else "-"
        print(f"{row.name:<32} {pub:>9.3f}s {est.step_time_s:>9.3f}s {row.error:>+7.1%}  {mem_pub:>8} "
              f"{row.predicted_GiB:>9.1f} {mem_err:>7}  {'yes' if row.fits else 'NO ':<4}  {layout}")
        sys.stdout.flush()
    errors = [abs(r.error) for r in rows]
    mem = [abs(r.memory_error) for r in rows if r.memory_error is not None]
    c, base = fitted_constant_mfu(rows)
    print(f"\n{len(rows)} runs in {time.perf_counter() - t0:.0f} s")
    print(f"step time   MAPE {statistics.fmean(errors):.1%}, median {statistics.median(errors):.1%}, "
          f"worst {max(errors):.1%}; {sum(e <= 0.10 for e in errors)} of {len(rows)} within 10%")
    if mem:
        print(f"memory      MAPE {statistics.fmean(mem):.1%} over {len(mem)} runs that publish it; "
              f"{sum(e <= 0.10 for e in mem)} within 10%")
    print(f"refused     {sum(not r.fits for r in rows)} of {len(rows)} published layouts priced as not fitting")
    print(f"baseline    6·N·tokens at one MFU fitted to these runs ({c:.1%}): MAPE {base:.1%}")
    print_speedups(runs, rows)
    _planner_against_meta(runs, cache)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    return 0 if all(math.isfinite(r.predicted_s) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
