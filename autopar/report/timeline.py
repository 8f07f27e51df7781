"""`--timeline`: one training step per pipeline rank (forward, backward, recompute, communication, bubble)
and the memory per stage, drawn with matplotlib (an optional extra, imported only here)."""

from __future__ import annotations

from autopar.errors import AutoparError
from autopar.plan import Plan

__all__ = ["rank_segments", "draw_timeline"]

_COLORS = {"forward": "#4c78a8", "backward": "#f58518", "recompute": "#e45756", "comm": "#72b7b2",
           "bubble": "#dddddd", "tail": "#54a24b"}


def rank_segments(plan: Plan) -> list[list[tuple[str, float, float]]]:
    """Per pipeline rank, (kind, start_s, duration_s) of one step: each rank idles for the fill of the ranks
    before it, runs m micro-batches of its chunks (forward ≈ 1/3 and backward ≈ 2/3 of compute, Narayanan et
    al. 2021 §3.1), idles for the drain and ends with the data-parallel/optimizer tail. A schematic of the
    modelled step, not a trace: totals match the estimate's breakdown for the bottleneck rank."""
    c, e = plan.config, plan.estimate
    ranks: list[list[tuple[str, float, float]]] = []
    per_rank = [sum(s.time_per_microbatch_s for s in plan.stages if s.pp_rank == q) for q in range(c.pp)]
    pipe_end = e.step_time_s - e.breakdown.get("dp_comm", 0.0) - e.breakdown.get("optimizer", 0.0)
    for q in range(c.pp):
        t_q = per_rank[q]
        start = sum(per_rank[:q]) / c.virtual_stages
        segs = [("bubble", 0.0, start)] if start > 0 else []
        rec_share = any(k != "none" for s in plan.stages if s.pp_rank == q for k in s.layer_modes)
        t = start
        for _ in range(c.num_microbatches):
            fwd, bwd = t_q / 3, 2 * t_q / 3
            if rec_share:
                fwd, bwd = t_q * 0.3, t_q * 0.6
                segs.append(("recompute", t + fwd + bwd, t_q * 0.1))
            segs += [("forward", t, fwd), ("backward", t + fwd, bwd)]
            t += t_q
        if pipe_end > t:
            segs.append(("bubble", t, pipe_end - t))
        segs.append(("tail", pipe_end, e.step_time_s - pipe_end))
        ranks.append(segs)
    return ranks


def draw_timeline(plan: Plan, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise AutoparError("--timeline needs matplotlib: pip install 'autopar[plot]'") from err
    if not path.lower().endswith((".png", ".svg")):
        raise AutoparError(f"--timeline {path}: use a .png or .svg file name")
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(14, 1 + 0.5 * plan.config.pp), gridspec_kw={"width_ratios": [3, 1]})
    for q, segs in enumerate(rank_segments(plan)):
        for kind, start, dur in segs:
            ax.broken_barh([(start, dur)], (q - 0.4, 0.8), color=_COLORS[kind], linewidth=0)
    ax.set_xlabel("seconds in one step")
    ax.set_ylabel("pipeline rank")
    ax.invert_yaxis()
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=v) for v in _COLORS.values()],
              labels=["forward", "backward", "recompute", "comm", "bubble", "dp comm + optimizer"],
              loc="upper right", fontsize=7, ncol=3)
    cats = ("weights", "grads", "optimizer", "activations", "workspace", "logits", "zero3_buffer")
    firsts = [s for s in plan.stages if s.index < plan.config.pp]
    left = [0.0] * len(firsts)
    for cat in cats:
        vals = [s.memory_breakdown.get(cat, 0) / 2**30 for s in firsts]
        mx.barh(range(len(firsts)), vals, left=left, label=cat)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    mx.invert_yaxis()
    mx.set_xlabel("GiB per device")
    mx.legend(fontsize=6)
    ax.set_title(f"{plan.model_name}: {plan.config}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
