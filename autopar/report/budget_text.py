"""`autopar budget` as text: the sweep's table, its Pareto front, the chosen plans and the assumptions."""

from __future__ import annotations

import os

from autopar.budget import Budget, BudgetPoint

__all__ = ["render_budget"]


def _money(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _row(i: int, p: BudgetPoint, b: Budget) -> str:
    mark = ("*" if i in b.front else " ") + ("F" if i == b.fastest else " ") + ("C" if i == b.cheapest else " ")
    head = f"{mark} {p.cluster:<15} {p.nodes:>5} {p.gpus:>6}"
    if not p.fits:
        return f"{head}  does not fit"
    e = p.plan.estimate
    band = f"{_d(p.days_lo):>7}–{_d(p.days_hi):<7}"
    tail = f"  ! {p.slower_note}" if p.slower_note else ""
    return (f"{head} {p.global_batch_size:>6} {e.step_time_s:8.3g} {_d(p.days):>7} {band} {p.gpu_hours:>12,.0f} "
            f"{_money(p.cost):>13} {_money(p.cost_hi):>13}  {p.plan.config}{tail}")


def _d(days: float) -> str:
    return f"{days:.3g}"


def _name(p: BudgetPoint) -> str:
    return f"{p.nodes} × {p.cluster} ({p.gpus} GPUs)"


def _chosen(label: str, p: BudgetPoint) -> str:
    e = p.plan.estimate
    cost = f", cost {_money(p.cost)} ({_money(p.cost_hi)} at the slow end)" if p.cost is not None else ""
    return (f"{label:<9}{_name(p)}: {_d(p.days)} days ({_d(p.days_lo)}–{_d(p.days_hi)}), {p.gpu_hours:,.0f} "
            f"GPU-hours{cost}\n{'':<9}layout {p.plan.config}\n{'':<9}step {e.step_time_s:.3f} s "
            f"(band {e.band_lo:+.1%}/{e.band_hi:+.1%} over {e.band_runs} runs"
            f"{', ' + e.band_basis if e.band_basis else ''}), MFU {e.mfu:.1%}, "
            f"{e.peak_memory_bytes / 2**30:.1f} GiB/GPU, solver {p.plan.solver.status} gap {p.plan.solver.gap:g}")


def render_budget(b: Budget) -> str:
    seq = b.points[0].seq_len
    lines = [f"model           {b.model_name}, {b.tokens:.4g} tokens, sequences of {seq}",
             f"goodput         {b.goodput:.2f} (fraction of wall time spent training: restarts, evaluation and "
             "checkpoints take the rest; set with --goodput)",
             f"deadline        {'none' if b.deadline_days is None else f'{b.deadline_days:g} days'} (met at the slow "
             f"end of the band){'' if b.max_cost is None else f'; cost cap {b.max_cost:,.0f}'}",
             "",
             "  cluster          nodes   GPUs  batch   step s    days   days (band)   GPU-hours "
             "        cost   cost (slow)  layout"]
    lines += [_row(i, p, b) for i, p in enumerate(b.points)]
    lines.append("(* on the Pareto front of days and " + ("cost" if b.front_axis == "cost" else
                 "GPU-hours (no price for every cluster: give --price KIND=PER_GPU_HOUR for cost)")
                 + "; F fastest, C cheapest meeting the deadline at the slow end; batch in sequences)")
    lines.append("")
    lines.append("front           " + "; ".join(
        f"{b.points[i].nodes}×{b.points[i].cluster} {_d(b.points[i].days)} d "
        + (_money(b.points[i].cost) if b.front_axis == "cost" else f"{b.points[i].gpu_hours:,.0f} GPU-h")
        for i in b.front))
    if b.fastest is not None:
        lines.append(_chosen("fastest", b.points[b.fastest]))
        if b.cheapest != b.fastest:
            lines.append(_chosen("cheapest", b.points[b.cheapest]))
        else:
            lines.append("cheapest the same cluster")
    else:
        lines.append(f"unmet           {b.unmet}")
    kinds = dict.fromkeys(p.cluster for p in b.points)
    for k in kinds:
        if k in b.smallest:
            p = b.points[b.smallest[k]]
            first = min(q.nodes for q in b.points if q.cluster == k)
            lines.append(f"smallest fit    {k}: {p.nodes} node(s), {p.gpus} GPUs"
                         + (" (the smallest swept)" if p.nodes == first else ""))
        else:
            lines.append(f"smallest fit    {k}: none of the swept sizes fits")
    n = len(b.points)
    lines.append(f"sweep           {n} plans in {b.sweep_s:.1f} s ({b.sweep_cpu_s:.1f} s CPU), capture "
                 f"{b.capture_s:.1f} s; load average {b.load_avg:.1f} on {os.cpu_count()} CPUs")
    return "\n".join(lines)
