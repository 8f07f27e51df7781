"""How well autopar prices real GPU training: every published run in `benchmarks/data/published_runs.toml`
priced with `autopar.estimate` on its own layout and model shape, against the published step time and,
where published, peak memory.

Prints per run the predicted and published step time and memory, whether autopar says the layout fits,
the mean absolute percentage error (MAPE) of step time, and leave-one-source-out (LOSO) validation
(benchmarks/loso.py): per source, the model's error on it, the baseline "6·N·tokens at one constant MFU"
with that MFU fitted to the *other* sources, and how many of its runs fell inside the error band derived
without it. Where a source does not publish the micro-batch size and schedule (or ZeRO stage, or
recompute), the run is priced at the planner's best with every published field pinned (that is what the
people who ran it tuned too); if nothing fits, at micro-batch 1 and 1F1B, and it counts as refused.
Every run is first priced at each sustained fraction of loso.SUSTAINED_GRID (the cost model's one fitted
quantity, cost_models.compute.sustained_fraction): the table prices them at the fraction fitted to all of
them, LOSO at the fraction fitted without the source under test. --only prices at the fitted fraction of
cost_models/catalog/fitted.toml.

    python benchmarks/published_runs.py [--only NAME_SUBSTRING] [--json out.json] [--write-bands]

--write-bands writes cost_models/catalog/error_bands.toml (the bands every Estimate carries) and
cost_models/catalog/fitted.toml (the sustained fraction) from all runs.
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
from autopar.config import FP8_RUNTIME_RECIPES
from autopar.errors import InfeasiblePlanError
from cost_models import catalog

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

sys.path.insert(0, str(Path(__file__).parent))
import fused_attention  # noqa: E402, F401  (registers the fused attention rows select by name)
import fused_llama  # noqa: E402  (beside this script)
import loso  # noqa: E402

from cost_models import compute, error_band  # noqa: E402

DATA = Path(__file__).parent / "data" / "published_runs.toml"
GiB = float(1 << 30)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Priced:
    name: str
    source_id: str
    kind: str  # cost_models.error_band.layout_kind of the layout priced
    hardware: str  # device family
    published_s: float
    predicted_s: float
    fits: bool
    config: str
    published_GiB: float | None
    predicted_GiB: float
    params: float  # N of 6·N per token: active parameters (an MoE token passes top_k of its experts)
    tokens: float  # per step
    peak_flops: float  # per GPU, the run's dtype
    gpus: int
    curve: tuple[tuple[float, float], ...] = ()  # (sustained fraction, predicted step time) on loso's grid
    moe: bool = False  # a mixture-of-experts model (its MAPE is printed apart too)
    fp8: bool = False  # FP8 GEMMs (any recipe, any framework): printed apart (print_apart)
    cp: bool = False  # context parallelism (cp > 1): printed apart
    # the same layout (published fields pinned) priced as autopar's own runtime runs it (RUNTIMES)
    own_predicted_s: float = math.nan
    own_fits: bool = True
    own_GiB: float = math.nan
    own_config: str = ""

    @property
    def error(self) -> float:
        return self.predicted_s / self.published_s - 1.0

    @property
    def memory_error(self) -> float | None:
        return None if self.published_GiB is None else self.predicted_GiB / self.published_GiB - 1.0


def _transformers_model(name: str, *, seq_len: int, **overrides):
    """transformers' `<name>ForCausalLM` of `<name>Config(**overrides)` on the meta device in bf16 (the
    models whose shapes transformers' default configs give: Mixtral-8x7B, GPT-OSS-120B, DeepSeek-V3)."""
    import torch
    import transformers

    cfg = getattr(transformers, f"{name}Config")(**overrides)
    with torch.device("meta"):
        model = getattr(transformers, f"{name}ForCausalLM")(cfg).to(torch.bfloat16)
    return model, (torch.zeros(1, seq_len, dtype=torch.long, device="meta"),)


def _graph(run: dict, cache: dict):
    impl = run.get("model_impl", "zoo")
    key = (run["model"], impl, run["seq_len"], tuple(sorted(run.get("overrides", {}).items())))
    if key not in cache:
        build = {"fused": fused_llama.build, "transformers": _transformers_model}.get(impl, autopar.zoo.build)
        model, x = build(run["model"], seq_len=run["seq_len"], **run.get("overrides", {}))
        cache[key] = autopar.capture(model, x)
    return cache[key]


def megatron_flops_per_sample(f: dict, seq_len: int) -> float:
    """Megatron-LM's model FLOPs of one sample, forward and backward (megatron/training/training.py,
    num_floating_point_operations, MCore v0.9, 2024-11): 12·s·L·h²·[(1 + g/a + s/h)·(a·d/h)
    + (ffn/h)·k·(3/2 with SwiGLU) + (shared ffn/h)·(3/2) + V/(2·L·h)], from the run's `megatron_flops` table
    (h, layers, heads, groups, head_dim, ffn, topk, shared_ffn, vocab, swiglu, causal). `causal`: the
    score and value matmuls counted over the causal half (s / 2h for s / h), as Megatron-LM counts them since
    2025 (Megatron-MoE-ModelZoo's Qwen3-235B rows: 245, 200 and 167 TF/GPU at 19.7, 24.2 and 29.0 s are
    this count of 2,048 samples of 4,096 tokens over 256 GPUs, to 0.5%; the full s / h would give 278, 226
    and 189)."""
    s, h, L, a = seq_len, f["h"], f["layers"], f["heads"]
    glu = 1.5 if f.get("swiglu", True) else 1.0
    scores = s / (2.0 * h) if f.get("causal", False) else s / h
    attention = (1 + f["groups"] / a + scores) * (a * f["head_dim"] / h)
    mlp = f["ffn"] / h * f.get("topk", 1) * glu + f.get("shared_ffn", 0) / h * glu
    return 12.0 * s * L * h * h * (attention + mlp + f["vocab"] / (2.0 * L * h))


def _cluster(run: dict, sustained: float | None = None) -> Cluster:
    """The run's cluster; `sustained`: its GPUs' sustained fraction (None: the fitted one, FITTED_FILE)."""
    base = Cluster.preset(run["cluster"], nodes=max(1, run["gpus"] // 8))
    if base.world_size != run["gpus"]:
        raise ValueError(f"{run['name']}: {run['gpus']} GPUs is not a whole number of 8-GPU nodes")
    device = catalog.device(run["device"]) if "device" in run else base.device
    if sustained is not None:
        device = dataclasses.replace(device, sustained_fraction=sustained)
    if "attention_kernel" in run:
        device = dataclasses.replace(device, attention_kernel=run["attention_kernel"])
    return dataclasses.replace(base, device=device)


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
    elif run["flops_formula"] == "megatron":
        flops = b * megatron_flops_per_sample(run["megatron_flops"], s)
    else:
        raise ValueError(f"{run['name']}: unknown flops_formula {run['flops_formula']!r}")
    return flops / (gpus * run["tflops_per_gpu"] * 1e12)


def _run_options(run: dict, runtime: str = "published") -> dict:
    """The run's precision and memory options as ParallelConfig fields: FP8 recipe, offload, compiled blocks.
    Under autopar's runtime a Transformer Engine recipe becomes torchao's per-tensor one, what autopar runs."""
    fp8 = run.get("fp8", "none")
    if runtime == "autopar" and fp8 not in FP8_RUNTIME_RECIPES["torchao"]:
        fp8 = "none" if fp8 == "none" else "tensorwise"
    return dict(fp8=fp8, offload=run.get("offload", "none"), compile=run.get("compile", False))


def source_id(run: dict) -> str:
    """The independent source a row comes from: its `source_id`, else its citation up to the first colon."""
    return run.get("source_id") or run["source"].split(":", 1)[0].strip()


# The two ways a row is priced: "published" with the memory rules of the framework that ran it (its loss
# kernel, its pipeline runtime's buffers), "autopar" as autopar's own runtime would run the same layout
# (PlannerOptions' defaults): what a user who hands autopar that layout gets.
RUNTIMES = ("published", "autopar")


def _options(run: dict, runtime: str = "published", **pins) -> PlannerOptions:
    """Planner options with every published field of `run` pinned (zero and recompute when published)."""
    framework = (dict(loss_kernel=run.get("loss_impl", "fp32_logits"), fp8_runtime=run.get("fp8_runtime", "torchao"),
                      pipeline_runtime=run.get("pipeline_runtime", "torch")) if runtime == "published" else {})
    return PlannerOptions(tp=run["tp"], cp=run.get("cp", 1), pp=run["pp"], dp=run["dp"], ep=run.get("ep", 1),
                          etp=run.get("etp", 1), zero_stage=run.get("zero"),
                          recompute=run.get("recompute"), sequence_parallel=run["sp"], **framework,
                          ep_dispatcher=run.get("ep_dispatcher", "all_to_all"),
                          top_k=0, max_virtual_stages=8, router_skew=run.get("load_imbalance"),
                          **_run_options(run, runtime), **pins)


def price(run: dict, graph, cluster: Cluster, runtime: str = "published"
          ) -> tuple[autopar.Estimate, ParallelConfig, bool]:
    """(estimate, layout, refused): the published layout, or the planner's best with its published fields,
    priced under `runtime` (RUNTIMES)."""
    dp, gb = run["dp"], run["global_batch"]
    # An unpublished interleaving group N (Meta's Llama 3) is priced at N = pp, as torch and Megatron-LM run it:
    # a group below pp fits in less memory but stalls (cost_models/pipeline_order.py), which Meta's published
    # throughput rules out, and Megatron-Core accepts N only from pp to m.
    if "mbs" in run and "zero" in run and "recompute" in run:
        cfg = ParallelConfig(tp=run["tp"], pp=run["pp"], dp=dp, cp=run.get("cp", 1), ep=run.get("ep", 1),
                             etp=run.get("etp", 1),
                             zero_stage=run["zero"], micro_batch_size=run["mbs"],
                             num_microbatches=gb // (dp * run["mbs"]), schedule=run.get("schedule", "1f1b"),
                             virtual_stages=run.get("v", 1), recompute=run["recompute"],
                             sequence_parallel=run["sp"], **_run_options(run, runtime))
        est = autopar.estimate(graph, cluster, cfg, options=_options(run, runtime))
        if est.fits or runtime != "autopar" or cfg.schedule != "interleaved_1f1b":
            return est, cfg, not est.fits
        # The interleaving group N is not a published field: autopar's planner chooses it (from pp/2 to pp,
        # PlannerOptions.microbatch_group) with every published field pinned, paying the bubble a group
        # below pp costs (cost_models/pipeline_order.py) where N = pp does not fit.
        try:
            plan = autopar.plan(graph, cluster, global_batch_size=gb, options=_options(
                run, runtime, micro_batch_size=cfg.micro_batch_size, num_microbatches=cfg.num_microbatches,
                schedule=cfg.schedule, virtual_stages=cfg.virtual_stages))
        except InfeasiblePlanError:
            return est, cfg, True
        return plan.estimate, plan.config, False
    # a published micro-batch fixes the count too (global batch ÷ dp ÷ micro-batch), which lets the planner
    # choose an unpublished interleaving group (PlannerOptions.microbatch_group)
    if "mbs" in run and gb % (dp * run["mbs"]):
        raise ValueError(f"{run['name']}: global batch {gb} is not a multiple of dp {dp} x micro-batch {run['mbs']}")
    pins = {"micro_batch_size": run["mbs"], "num_microbatches": gb // (dp * run["mbs"])} if "mbs" in run else {}
    if "schedule" in run:
        pins["schedule"] = run["schedule"]
    if "v" in run:
        pins["virtual_stages"] = run["v"]
    try:
        plan = autopar.plan(graph, cluster, global_batch_size=gb, options=_options(run, runtime, **pins))
        return plan.estimate, plan.config, False
    except InfeasiblePlanError:
        cfg = ParallelConfig(tp=run["tp"], pp=run["pp"], dp=dp, cp=run.get("cp", 1), ep=run.get("ep", 1),
                             etp=run.get("etp", 1),
                             zero_stage=run.get("zero", 0), micro_batch_size=1,
                             num_microbatches=gb // dp, schedule="1f1b", recompute=run.get("recompute", "full"),
                             sequence_parallel=run["sp"], **_run_options(run, runtime))
        return autopar.estimate(graph, cluster, cfg, options=_options(run, runtime)), cfg, True


def _memory_as_published(run: dict, est) -> float:
    """The estimate's bytes in the source's terms: torch.cuda.max_memory_reserved (torchtitan logs it) is the
    tensor peak plus the caching allocator's fragmentation (Estimate.reserved_bytes); else the tensor peak."""
    return est.reserved_bytes if run.get("memory_kind", "reserved") == "reserved" else est.peak_memory_bytes


def loso_rows(rows: list[Priced]) -> list[loso.Row]:
    return [loso.Row(name=r.name, source_id=r.source_id, kind=r.kind, hardware=r.hardware, published_s=r.published_s,
                     predicted_s=r.predicted_s, ideal_s=6.0 * r.params * r.tokens / (r.gpus * r.peak_flops),
                     curve=r.curve)
            for r in rows]


def own_loso_rows(rows: list[Priced], runs: list[dict], cache: dict) -> list[loso.Row]:
    """`loso_rows` of the rows as autopar's own runtime prices them: a row priced alike under both runtimes
    (same layout, same step time) keeps its curve; the others are priced on loso's grid again."""
    by_name = {r["name"]: r for r in runs}
    out = []
    for r in rows:
        curve = r.curve
        if r.curve and (r.own_config != r.config or not math.isclose(r.own_predicted_s, r.predicted_s, rel_tol=1e-9)):
            run = by_name[r.name]
            curve = tuple((g, price(run, _graph(run, cache), _cluster(run, g), runtime="autopar")[0].step_time_s)
                          for g, _ in r.curve)
        out.append(dataclasses.replace(r, predicted_s=r.own_predicted_s, curve=curve))
    return loso_rows(out)


def write_fitted(sustained: float, rows: int, sources: int, path: Path = compute.FITTED_FILE) -> None:
    """The cost model's fitted quantity (cost_models.compute.sustained_fraction) as TOML."""
    path.write_text("\n".join([
        "# The cost model's one quantity fitted to published runs (cost_models/compute.py, sustained_fraction):",
        "# the fraction of burst tensor-core throughput (MAMF, FlashAttention benchmarks) a GPU sustains in a",
        "# training step. Generated from benchmarks/data/published_runs.toml by",
        "#     python benchmarks/published_runs.py --write-bands",
        f"# from {rows} runs of {sources} sources (the MAPE-minimising fraction); do not edit by hand.",
        f"sustained_fraction = {sustained:.3f}", ""]))


def price_curves(runs: list[dict], cache: dict) -> list[tuple[tuple[float, float], ...]]:
    """Every run's predicted step time at each sustained fraction of loso.SUSTAINED_GRID."""
    curves: list[list[tuple[float, float]]] = [[] for _ in runs]
    for g in loso.SUSTAINED_GRID:
        for curve, run in zip(curves, runs, strict=True):
            est, _, _ = price(run, _graph(run, cache), _cluster(run, g))
            curve.append((g, est.step_time_s))
    return [tuple(c) for c in curves]


def write_bands(rows: list[loso.Row], path: Path = error_band.BANDS_FILE) -> None:
    """The bands of every (kind, device family), every kind on any hardware, and all runs, as TOML."""
    keys = sorted({(r.kind, r.hardware) for r in rows}) + sorted({(r.kind, error_band.ANY) for r in rows})
    lines = ["# Error bands of autopar's step time on published runs (cost_models/error_band.py): published step",
             "# time ∈ predicted · [1 + lo, 1 + hi]. Generated from benchmarks/data/published_runs.toml by",
             "#     python benchmarks/published_runs.py --write-bands",
             f"# from {len(rows)} runs of {len({r.source_id for r in rows})} sources; do not edit by hand.", ""]
    for kind, hw in keys + [(error_band.ANY, error_band.ANY)]:
        if kind == error_band.ANY:
            lo, hi = loso._spread(rows)
            band = loso.Band(lo=lo, hi=hi, runs=len(rows), basis="all")
        elif hw == error_band.ANY:  # the kind on any hardware: derive_band's fallback without the hardware step
            same = [r for r in rows if r.kind == kind]
            pool = same if loso.enough_sources(same) else list(rows)
            lo, hi = loso._spread(pool)
            band = loso.Band(lo=lo, hi=hi, runs=len(pool), basis="kind" if pool is same else "all")
        else:
            band = loso.derive_band(rows, kind=kind, hardware=hw)
        basis = {"kind+hardware": f"{kind} on {hw}", "kind": f"{kind}, any hardware", "all": "every kind"}[band.basis]
        lines += ["[[band]]", f'kind = "{kind}"', f'hardware = "{hw}"', f"lo = {band.lo:.4f}", f"hi = {band.hi:.4f}",
                  f"runs = {band.runs}", f'basis = "{basis}"', ""]
    path.write_text("\n".join(lines))


def print_memory_notes(runs: list[dict], rows: list[Priced]) -> None:
    """Each run priced as not fitting or with memory outside 10% of the published figure, and the reason its
    row gives (`memory_note`), or that none is given."""
    notes = {run["name"]: run.get("memory_note") for run in runs}
    out = [r for r in rows if not r.fits or (r.memory_error is not None and abs(r.memory_error) > 0.10)]
    for r in out:
        what = "not fitting" if not r.fits else f"memory {r.memory_error:+.1%}"
        print(f"  {r.name} ({what}): {notes.get(r.name) or 'no reason given'}")


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


def loso_errors(rows: list[loso.Row]) -> dict[str, float]:
    """Each run's error priced at the sustained fraction fitted without its source (what LOSO holds out)."""
    out = {}
    for source in {r.source_id for r in rows}:
        g = loso.fit_sustained([r for r in rows if r.source_id != source])
        out.update({r.name: (r.at(g) if g is not None else r).error for r in rows if r.source_id == source})
    return out


def print_apart(rows: list[Priced], held_out: dict[str, float]) -> None:
    """FP8 rows and context-parallel rows on their own: MAPE, LOSO MAPE, and how many are priced as not fitting
    as their framework runs them and as autopar's runtime would."""
    for what, subset in (("FP8 rows", [r for r in rows if r.fp8]), ("CP rows", [r for r in rows if r.cp])):
        if not subset:
            continue
        errs = [abs(r.error) for r in subset]
        lo = [abs(held_out[r.name]) for r in subset if r.name in held_out]
        own = [abs(r.own_predicted_s / r.published_s - 1.0) for r in subset]
        print(f"{what:<11} {len(subset)} runs of {len({r.source_id for r in subset})} sources: MAPE "
              f"{statistics.fmean(errs):.1%}" + (f", LOSO {statistics.fmean(lo):.1%}" if lo else "")
              + f", median signed {statistics.median(r.error for r in subset):+.1%}; not fitting "
              f"{sum(not r.fits for r in subset)} as published, {sum(not r.own_fits for r in subset)} under "
              f"autopar's runtime (MAPE there {statistics.fmean(own):.1%})")


def _planner_against_meta(runs: list[dict], cache: dict, sustained: float | None) -> None:
    """Llama-3-405B on 16,384 H100: Meta's layout against what autopar.plan chooses for the same job."""
    run = next((r for r in runs if r["name"] == "llama3-405b-16k-gpus"), None)
    if run is None:
        return
    graph, cluster = _graph(run, cache), _cluster(run, sustained)
    meta, layout, _ = price(run, graph, cluster)
    plan = autopar.plan(graph, cluster, global_batch_size=run["global_batch"], options=PlannerOptions(top_k=0))
    print(f"llama3-405b on {run['gpus']:,} H100: Meta's layout priced at MFU {meta.mfu:.1%} (published 38–41%), "
          f"{meta.step_time_s:.2f} s; autopar plan {plan.config}: MFU {plan.estimate.mfu:.1%}, "
          f"{plan.estimate.step_time_s:.2f} s ({plan.solver.status}, gap {plan.solver.gap:g})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="price only runs whose name contains this")
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    ap.add_argument("--write-bands", action="store_true", help="write cost_models/catalog/error_bands.toml")
    args = ap.parse_args(argv)
    runs = tomllib.loads(DATA.read_text())["run"]
    if args.only and args.write_bands:
        ap.error("--write-bands derives the bands from every run; drop --only")
    if args.only:
        runs = [r for r in runs if args.only in r["name"]]
    cache: dict = {}
    rows: list[Priced] = []
    apart: list[Priced] = []  # rows whose source ran code autopar does not price (`not_comparable`)
    reasons: dict[str, str] = {}
    t0 = time.perf_counter()
    # the sustained fraction: fitted to every run (each priced on loso's grid); with --only, the fitted one
    comparable = [r for r in runs if "not_comparable" not in r]  # the others are not fitted to either
    curves = price_curves(comparable, cache) if not args.only else [() for _ in comparable]
    sustained = loso.fit_sustained([loso.Row(name=r["name"], source_id=source_id(r), kind="", hardware="",
                                             published_s=published_step_s(r, _graph(r, cache)), predicted_s=0.0,
                                             ideal_s=0.0, curve=c) for r, c in zip(comparable, curves, strict=True)])
    curve_of = {r["name"]: c for r, c in zip(comparable, curves, strict=True)}
    fitted = compute.sustained_fraction(catalog.device("h100-sxm-80gb"))
    print("sustained fraction of burst tensor-core throughput: "
          + (f"{sustained:.3f}, fitted to these runs" if sustained is not None
             else f"{fitted:.3f} (cost_models/catalog/fitted.toml)"))
    print(f"{'run':<32} {'published':>10} {'predicted':>10} {'error':>7}  {'mem pub':>8} {'mem pred':>9} "
          f"{'error':>7}  fits  {'autopar runtime':>17}  layout priced")
    for run in runs:
        curve = curve_of.get(run["name"], ())
        graph, cluster = _graph(run, cache), _cluster(run, sustained)
        est, cfg, refused = price(run, graph, cluster)
        own, own_cfg, own_refused = price(run, graph, cluster, runtime="autopar")
        layout = str(cfg)
        pub = published_step_s(run, graph)
        row = Priced(name=run["name"], source_id=source_id(run),
                     kind=error_band.layout_kind(tp=cfg.tp, pp=cfg.pp, zero_stage=cfg.zero_stage),
                     hardware=error_band.device_family(cluster.device.name), published_s=pub,
                     predicted_s=est.step_time_s, fits=not refused, config=layout,
                     published_GiB=run.get("memory_GiB"), predicted_GiB=_memory_as_published(run, est) / GiB,
                     params=graph.active_params, tokens=run["global_batch"] * run["seq_len"],
                     peak_flops=cluster.device.peak_flops_for(graph.dtype), gpus=run["gpus"], curve=curve,
                     moe=graph.expert_params > 0, fp8=run.get("fp8", "none") != "none", cp=run.get("cp", 1) > 1,
                     own_predicted_s=own.step_time_s, own_fits=not own_refused,
                     own_GiB=_memory_as_published(run, own) / GiB, own_config=str(own_cfg))
        (apart if "not_comparable" in run else rows).append(row)
        if "not_comparable" in run:
            reasons[row.name] = run["not_comparable"]
        mem_pub = f"{row.published_GiB:.1f}" if row.published_GiB else "-"
        mem_err = f"{row.memory_error:+.1%}" if row.memory_error is not None else "-"
        print(f"{row.name:<32} {pub:>9.3f}s {est.step_time_s:>9.3f}s {row.error:>+7.1%}  {mem_pub:>8} "
              f"{row.predicted_GiB:>9.1f} {mem_err:>7}  {'yes' if row.fits else 'NO ':<4}  "
              f"{row.own_GiB:>7.1f} GiB {'fits' if row.own_fits else 'NO  '}  {layout}"
              + (f"  (autopar runtime: {row.own_config})" if row.own_config != layout else ""))
        sys.stdout.flush()
    for row in apart:
        print(f"  {row.name}: priced apart, not in the MAPE, LOSO or bands: {reasons[row.name]}")
    if not rows:
        if apart:
            return 0
        ap.error(f"no run's name contains {args.only!r}")
    errors = [abs(r.error) for r in rows]
    mem = [abs(r.memory_error) for r in rows if r.memory_error is not None]
    print(f"\n{len(rows)} runs of {len({r.source_id for r in rows})} sources in {time.perf_counter() - t0:.0f} s")
    print(f"step time   MAPE {statistics.fmean(errors):.1%}, median {statistics.median(errors):.1%}, "
          f"worst {max(errors):.1%}; {sum(e <= 0.10 for e in errors)} of {len(rows)} within 10%; median signed "
          f"error {statistics.median(r.error for r in rows):+.1%}")
    moe = [abs(r.error) for r in rows if r.moe]
    if moe:
        print(f"MoE rows    MAPE {statistics.fmean(moe):.1%} over {len(moe)} runs, worst {max(moe):.1%}")
    if mem:
        print(f"memory      MAPE {statistics.fmean(mem):.1%} over {len(mem)} runs that publish it; "
              f"{sum(e <= 0.10 for e in mem)} within 10%")
    print(f"refused     {sum(not r.fits for r in rows)} of {len(rows)} published layouts priced as not fitting")
    own_errors = [abs(r.own_predicted_s / r.published_s - 1.0) for r in rows]
    print(f"as autopar's own runtime runs them (published fields pinned, default options): "
          f"{sum(not r.own_fits for r in rows)} of {len(rows)} priced as not fitting; step time MAPE "
          f"{statistics.fmean(own_errors):.1%}")
    for r in rows:
        if not r.own_fits:
            print(f"  {r.name}: {r.own_GiB:.1f} GiB under autopar's runtime ({r.own_config})")
    lrows = loso_rows(rows)
    own_lrows = own_loso_rows(rows, runs, cache)
    print_apart(rows, loso_errors(lrows) if len({r.source_id for r in lrows}) >= 2 else {})
    print_memory_notes(runs, rows)
    print_speedups(runs, rows)
    if len({r.source_id for r in lrows}) >= 2:
        results = loso.leave_one_source_out(lrows)
        print("\nleave-one-source-out (sustained fraction, baseline MFU and bands derived without the source):")
        print(f"  {'source':<20} {'runs':>4} {'autopar':>8} {'1-MFU':>8} {'(MFU)':>6}  {'in band':>7}  sustained")
        for s in results:
            fitted = f"{s.sustained:.3f}" if s.sustained is not None else "-"
            print(f"  {s.source_id:<20} {s.runs:>4} {s.model_mape:>8.1%} {s.baseline_mape:>8.1%} "
                  f"{s.baseline_mfu:>6.1%}  {s.inside_band:>3}/{s.runs:<3}  {fitted}")
        model_all, base_all = loso.overall(results)
        print(f"  {'all':<20} {len(lrows):>4} {model_all:>8.1%} {base_all:>8.1%}         "
              f"{sum(s.inside_band for s in results):>3}/{len(lrows):<3}")
        own = loso.leave_one_source_out(own_lrows)
        own_model, own_base = loso.overall(own)
        print(f"  as autopar's own runtime runs them (published fields pinned): LOSO MAPE {own_model:.1%} against "
              f"{own_base:.1%} for one MFU; {sum(s.model_mape < s.baseline_mape for s in own)} of {len(own)} sources "
              f"below their baseline; {sum(s.inside_band for s in own)} of {len(own_lrows)} runs inside the band")
        by_kind = {}
        for r in lrows:
            by_kind.setdefault((r.kind, r.hardware), []).append(r.error)
        print("  by kind    " + "; ".join(f"{k} on {h}: {loso.mape(e):.1%} ({len(e)})"
                                          for (k, h), e in sorted(by_kind.items())))
    if args.write_bands:
        write_bands(lrows)
        write_fitted(sustained, len(rows), len({r.source_id for r in rows}))
        print(f"wrote {error_band.BANDS_FILE} and {compute.FITTED_FILE}")
    _planner_against_meta(runs, cache, sustained)
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    return 0 if all(math.isfinite(r.predicted_s) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
