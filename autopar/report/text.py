"""Human-readable renderings of plans: `show`, `diff`, `explain`. Pure functions from data to text."""

from __future__ import annotations

import dataclasses

from autopar.config import ParallelConfig
from autopar.plan import BREAKDOWN_KEYS, Estimate, Plan, StagePlan
from cost_models.memory import RECOMPUTE_MODES

__all__ = ["render_plan", "render_diff", "render_explain", "render_estimate", "memory_lines", "gib", "fmt_s",
           "band_text"]



def _count(n: int, one: str, many: str | None = None) -> str:
    """"1 device", "8 devices"."""
    return f"{n:,} {one if n == 1 else (many or one + 's')}"

def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def fmt_s(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def band_text(e: Estimate) -> str:
    """", runs of this kind −12%/+31% (fsdp on a100, 37 published runs)": how far published runs like the
    layout were from their predictions; "" when no band applies."""
    if not e.band_runs:
        return ""

    def pct(x: float) -> str:
        return f"{x:+.0%}".replace("-", "−")

    return (f", runs of this kind {pct(e.band_lo)}/{pct(e.band_hi)} ({e.band_basis}, "
            f"{_count(e.band_runs, 'published run')})")


def _estimate_line(e: Estimate) -> str:
    return (f"step {fmt_s(e.step_time_s)}{band_text(e)}  |  {e.tokens_per_s:,.0f} tokens/s  |  "
            f"{e.tflops_per_device:.0f} TFLOP/s "
            f"per device  |  MFU {e.mfu:.1%}  |  peak {gib(e.peak_memory_bytes)}")


def _breakdown(e: Estimate) -> list[str]:
    rows = []
    for k in BREAKDOWN_KEYS:
        v = e.breakdown.get(k, 0.0)
        rows.append(f"  {k:<16} {fmt_s(v):>12}  {v / e.step_time_s:6.1%}  {'█' * round(40 * v / e.step_time_s)}")
    return rows


def recompute_cell(stage: StagePlan) -> str:
    """A stage's recompute: its mode, or how many of its layers use each mode (heaviest first) when they
    differ, e.g. "2×full+6×none"."""
    modes = stage.layer_modes
    if len(set(modes)) <= 1:
        return stage.recompute
    return "+".join(f"{modes.count(k)}×{k}" for k in reversed(RECOMPUTE_MODES) if k in modes)


def _stage_table(plan: Plan) -> list[str]:
    width = max([9] + [len(recompute_cell(s)) for s in plan.stages])
    rows = [f"  {'stage':>5} {'rank':>4}  {'layers':<34} {'n':>3}  {'recompute':<{width}} {'t/µbatch':>10}  "
            f"{'weights':>9} {'grads':>9} {'optim':>9} {'activ':>9} {'peak':>9}"]
    for s in plan.stages:
        mb = s.memory_breakdown
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} … {s.layers[-1]}"
        rows.append(f"  {s.index:>5} {s.pp_rank:>4}  {span[:34]:<34} {len(s.layers):>3}  {recompute_cell(s):<{width}} "
                    f"{fmt_s(s.time_per_microbatch_s):>10}  {gib(mb.get('weights', 0)):>9} "
                    f"{gib(mb.get('grads', 0)):>9} {gib(mb.get('optimizer', 0)):>9} "
                    f"{gib(mb.get('activations', 0)):>9} {gib(s.peak_memory_bytes):>9}")
    return rows


def render_plan(plan: Plan, *, top: int | None = None) -> str:
    c, e = plan.config, plan.estimate
    lines = [f"autopar plan: {plan.model_name} on {plan.cluster_name} ({_count(c.world_size, 'device')}), "
             f"global batch {plan.global_batch_size}" + (f" × {plan.seq_len} tokens" if plan.seq_len else ""),
             "", f"chosen layout   {c}",
             f"                tp={c.tp} (inside a node) × "
             + (f"cp={c.cp} (each sequence split over {c.cp} ranks) × " if c.cp > 1 else "")
             + f"pp={c.pp} × dp={c.dp}, ZeRO-{c.zero_stage}, "
             f"{_count(c.num_microbatches, 'micro-batch', 'micro-batches')} of {c.micro_batch_size}, {c.schedule}"
             + (f" with v={c.virtual_stages}" if c.virtual_stages > 1 else "")
             + (f", groups of {c.microbatch_group} micro-batches per chunk" if c.microbatch_group else ""),
             *([f"                experts {c.ep_text()}"] if c.ep > 1 or c.etp > 1 else []),
             f"predicted       {_estimate_line(e)}", "", "time per step"]
    lines += _breakdown(e)
    lines += ["", "stages (memory per device)"] + _stage_table(plan)
    lines += [f"note            {n}" for n in e.notes]
    if plan.router_skew is not None:
        lines.append(f"note            MoE layers priced at router skew {plan.router_skew:g} (busiest expert-parallel "
                     "rank's routed tokens ÷ the mean)")
    alts = plan.alternatives[:top] if top is not None else plan.alternatives
    if alts:
        lines += ["", "runner-ups"]
        for i, (ac, ae) in enumerate(alts, 1):
            lines.append(f"  {i}. {fmt_s(ae.step_time_s):>10} ({ae.step_time_s / e.step_time_s - 1:+7.2%})  {ac}")
    if plan.solver:
        s = plan.solver
        ilps = f", {s.ilps_solved} ILPs solved ({s.ilp_time_s:.2f} s)" if s.ilps_solved else ""
        lines += ["", f"solver          {s.solver}: {s.status}, gap {s.gap:.2g}, {s.configs_considered} layouts "
                      f"considered{ilps}, {s.solve_time_s:.2f} s"]
    lines.append(f"fingerprints    model {plan.graph_fingerprint}, cluster {plan.cluster_fingerprint}")
    return "\n".join(lines)


def render_diff(a: Plan, b: Plan) -> str:
    ca, cb = dataclasses.asdict(a.config), dataclasses.asdict(b.config)
    lines = [f"{'':<20} {'A':>24} {'B':>24}"]
    for k in ca:
        mark = " " if ca[k] == cb[k] else "*"
        lines.append(f"{mark} {k:<18} {ca[k]!s:>24} {cb[k]!s:>24}")
    if max(a.config.ep, b.config.ep, a.config.etp, b.config.etp) > 1:  # the ranks each EP group spans
        fold_a, fold_b = (_ep_span(c) for c in (a.config, b.config))
        lines.append(f"{' ' if fold_a == fold_b else '*'} {'ep_over':<18} {fold_a:>24} {fold_b:>24}")
    ea, eb = a.estimate, b.estimate
    for name, va, vb in (("step_time_s", ea.step_time_s, eb.step_time_s), ("tokens_per_s", ea.tokens_per_s,
                         eb.tokens_per_s), ("mfu", ea.mfu, eb.mfu), ("peak_memory_GiB", ea.peak_memory_bytes / 2**30,
                         eb.peak_memory_bytes / 2**30)):
        lines.append(f"  {name:<18} {va:>24.4g} {vb:>24.4g}   ({vb / va - 1:+.1%})" if va else f"  {name}")
    for k in BREAKDOWN_KEYS:
        va, vb = ea.breakdown.get(k, 0.0), eb.breakdown.get(k, 0.0)
        lines.append(f"  {k:<18} {fmt_s(va):>24} {fmt_s(vb):>24}")
    if a.graph_fingerprint != b.graph_fingerprint or a.cluster_fingerprint != b.cluster_fingerprint:
        lines.append("  note: the plans were made for different models or clusters")
    cuts_a = [len(s.layers) for s in a.stages]
    cuts_b = [len(s.layers) for s in b.stages]
    if cuts_a != cuts_b:
        lines.append(f"  layers per stage  A {cuts_a}\n                    B {cuts_b}")
    return "\n".join(lines)


def memory_lines(e: Estimate) -> list[str]:
    """Whether the layout fits, then its peak rank's bytes by category against what is usable."""
    cap = e.memory_capacity_bytes
    held = f" (the caching allocator would hold ~{gib(e.reserved_bytes)})" if e.reserved_bytes else ""
    head = (f"  memory         fits: peak {gib(e.peak_memory_bytes)} of {gib(cap)} usable{held}" if e.fits else
            f"  memory         DOES NOT FIT: constraint {e.violated} is violated; peak {gib(e.peak_memory_bytes)} "
            f"per device, {gib(cap)} usable ({e.peak_memory_bytes / cap:.0%}); the planner never chooses it")
    rows = [head] if cap else []
    for k, v in sorted(e.memory_breakdown.items(), key=lambda kv: -kv[1]):
        if v:
            rows.append(f"    {k:<14} {gib(v):>12}")
    return rows


def render_estimate(config: ParallelConfig, e: Estimate) -> str:
    """`autopar estimate`: the layout, its step time and breakdown, and its memory against the device's."""
    return "\n".join([f"layout         {config}", f"               {_estimate_line(e)}", *_breakdown(e),
                      *memory_lines(e), *(f"  note           {n}" for n in e.notes)])


def _ep_span(c: ParallelConfig) -> str:
    """"tp2 x dp4, edp=32": what `ParallelConfig.ep_text` puts in brackets ("-" without expert parallelism)."""
    return c.ep_text().partition("(over ")[2].rstrip(")") or "-"


def render_explain(plan: Plan, config: ParallelConfig, estimate: Estimate | None, reason: str | None) -> str:
    def experts(c: ParallelConfig) -> list[str]:
        shown = max(plan.config.ep, config.ep, plan.config.etp, config.etp) > 1
        return [f"             experts {c.ep_text() or 'ep=1'}"] if shown else []

    lines = [f"chosen       {plan.config}", *experts(plan.config), f"             {_estimate_line(plan.estimate)}",
             f"alternative  {config}", *experts(config)]
    if estimate is None:
        lines.append(f"             not possible: {reason}")
        return "\n".join(lines)
    lines.append(f"             {_estimate_line(estimate)}")
    if not estimate.fits:
        lines += memory_lines(estimate)
    slower = estimate.step_time_s / plan.estimate.step_time_s - 1
    lines.append(f"             {'slower' if slower >= 0 else 'FASTER'} by {abs(slower):.2%}; where the time goes:")
    lines.append(f"  {'':<16} {'chosen':>12} {'alternative':>12}")
    for k in BREAKDOWN_KEYS:
        lines.append(f"  {k:<16} {fmt_s(plan.estimate.breakdown.get(k, 0)):>12} "
                     f"{fmt_s(estimate.breakdown.get(k, 0)):>12}")
    return "\n".join(lines)
