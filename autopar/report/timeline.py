"""`--timeline`: one training step per pipeline rank (forward, backward, recompute, communication, bubble)
and the memory per stage, drawn with matplotlib (an optional extra, imported only here)."""

from __future__ import annotations

from autopar.errors import AutoparError
from autopar.plan import Plan

__all__ = ["rank_segments", "timeline_figure", "draw_timeline"]

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
    """Write `timeline_figure(plan)` to a .png or .svg file."""
    if not path.lower().endswith((".png", ".svg")):
        raise AutoparError(f"--timeline {path}: use a .png or .svg file name")
    fig = timeline_figure(plan)
    import matplotlib.pyplot as plt

    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def timeline_figure(plan: Plan):  # -> matplotlib.figure.Figure (matplotlib is optional)
    """Two panels: the step of each pipeline rank over time, and each rank's memory by category; pipeline
    ranks ticked as integers (every rank up to 16 ranks, fewer beyond), legends below the data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator
        from matplotlib.transforms import offset_copy
    except ImportError as err:
        raise AutoparError("--timeline needs matplotlib: pip install 'autopar[plot]'") from err
    pp = plan.config.pp
    fig, (ax, mx) = plt.subplots(1, 2, figsize=(14, 2.6 + 0.22 * pp), gridspec_kw={"width_ratios": [3, 1]})
    segments = rank_segments(plan)
    for q, segs in enumerate(segments):
        for kind in _COLORS:  # one collection per rank and kind: a 32-rank plan draws in a second, not half a minute
            spans = [(start, dur) for k, start, dur in segs if k == kind]
            if spans:
                ax.broken_barh(spans, (q - 0.4, 0.8), color=_COLORS[kind], linewidth=0)
    names = {"forward": "forward", "backward": "backward", "recompute": "recompute", "comm": "comm",
             "bubble": "bubble (idle)", "tail": "dp comm + optimizer"}
    drawn = [k for k in _COLORS if any(kind == k for segs in segments for kind, _, _ in segs)]
    step = -(-pp // 16)  # every rank up to 16 ranks, every second up to 32, ...
    for axis in (ax, mx):
        axis.set_ylim(pp - 0.5, -0.5)  # rank 0 on top, each rank one row
        axis.yaxis.set_major_locator(FixedLocator(list(range(0, pp, step))))
        axis.set_ylabel("pipeline rank")
    # legends below each panel's tick labels and axis label, whatever the panel's height
    below = {"loc": "upper center", "bbox_to_anchor": (0.5, 0.0), "fontsize": 7, "frameon": False}
    ax.set_xlabel("seconds in one step")
    ax.set_title("one training step per pipeline rank (schematic of the modelled step)", fontsize=9)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=_COLORS[k]) for k in drawn],
              labels=[names[k] for k in drawn], ncol=len(drawn),
              bbox_transform=offset_copy(ax.transAxes, fig=fig, y=-30, units="points"), **below)
    cats = ("weights", "grads", "optimizer", "compute_copies", "activations", "workspace", "logits", "zero3_buffer",
            "pipeline_buffers")
    firsts = [s for s in plan.stages if s.index < pp]
    left = [0.0] * len(firsts)
    for cat in cats:
        vals = [s.memory_breakdown.get(cat, 0) / 2**30 for s in firsts]
        mx.barh(range(len(firsts)), vals, left=left, label=cat, height=0.8)
        left = [a + b for a, b in zip(left, vals, strict=True)]
    mx.set_xlabel("GiB per device")
    mx.set_title("peak memory per device, by category", fontsize=9)
    mx.legend(ncol=3, bbox_transform=offset_copy(mx.transAxes, fig=fig, y=-30, units="points"), **below)
    fig.suptitle(f"{plan.model_name}: {plan.config}", fontsize=10)
    fig.tight_layout()
    return fig
