"""`autopar budget --plot`: days and cost against GPUs, one line per cluster kind, the error band shaded and
the deadline drawn (matplotlib, an optional extra, imported only here)."""

from __future__ import annotations

from autopar.budget import Budget
from autopar.errors import AutoparError

__all__ = ["draw_budget"]


def draw_budget(b: Budget, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise AutoparError(f"--plot needs matplotlib ({e}); pip install 'autopar[plot]'") from None
    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(11, 4.2))
    priced = b.front_axis == "cost"
    for kind in dict.fromkeys(p.cluster for p in b.points):
        pts = sorted((p for p in b.points if p.cluster == kind and p.fits), key=lambda p: p.gpus)
        if not pts:
            continue
        x = [p.gpus for p in pts]
        (line,) = ax_t.plot(x, [p.days for p in pts], marker="o", label=kind)
        ax_t.fill_between(x, [p.days_lo for p in pts], [p.days_hi for p in pts], color=line.get_color(), alpha=0.2)
        lo = [p.cost * (1 + p.plan.estimate.band_lo) if priced else p.gpu_hours * (1 + p.plan.estimate.band_lo)
              for p in pts]
        hi = [p.cost_hi if priced else p.gpu_hours * (1 + p.plan.estimate.band_hi) for p in pts]
        ax_c.plot(x, [p.cost if priced else p.gpu_hours for p in pts], marker="o", color=line.get_color(), label=kind)
        ax_c.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2)
    if b.deadline_days is not None:
        ax_t.axhline(b.deadline_days, color="black", linestyle="--", label=f"deadline {b.deadline_days:g} d")
    if b.max_cost is not None:
        ax_c.axhline(b.max_cost, color="black", linestyle="--", label="cost cap")
    for ax, ylabel in ((ax_t, f"days to train (goodput {b.goodput:.2f})"),
                       (ax_c, "cost" if priced else "GPU-hours (no prices given)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{b.model_name}: {b.tokens:.3g} tokens (band: published runs like each layout)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
