"""The least-squares non-decreasing fit of a measured curve (isotonic regression).

Measured times against size must not decrease (a larger message or GEMM is never faster), but a noisy
table does dip. Taking the running maximum repairs a dip by copying one slow row forward, so one
outlier raises every larger entry up to where the curve catches it — the denser the table, the more
outliers it holds. The least-squares monotone fit (pool adjacent violators: Ayer et al. 1955; Barlow et
al. 1972, "Statistical Inference under Order Restrictions") instead averages each violating run, so
noise cancels. It is done on log-times: errors of a timing are relative.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["nondecreasing_fit"]


def nondecreasing_fit(times: Sequence[float]) -> list[float]:
    """Times (ordered by size) replaced by the non-decreasing sequence nearest in log-space (pool
    adjacent violators: merge any block whose mean exceeds the next block's, until none does)."""
    if any(not t > 0 for t in times):
        raise ValueError(f"times must be positive to fit a monotone curve; got {list(times)}")
    blocks: list[list[float]] = []  # [sum of log-times, count]
    for t in times:
        blocks.append([math.log(t), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [math.exp(total / count) for total, count in blocks for _ in range(int(count))]
