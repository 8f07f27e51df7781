"""The busiest expert-parallel rank's load: what the expert GEMMs and the all-to-alls of an MoE layer wait for.

Under expert parallelism (ep > 1) every rank of an EP group holds E / ep experts and receives the tokens its
peers route to them; the dispatch and combine all-to-alls are collective, so the layer advances at the pace
of the rank receiving the most. Relative to the mean (each rank's own tokens · k) the busiest rank carries

    factor = skew × (1 + z(ep) · sqrt((E − k) / ((E − 1) · T · k)))

- skew (`MoESpec.load_imbalance`): the router's systematic preference, busiest rank ÷ mean in expectation.
  Default 1.0 (autopar.capture.moe.DEFAULT_LOAD_IMBALANCE): a router trained to balance, which is the
  condition under which the published MoE throughputs were measured (NVIDIA's Megatron-Bridge benchmarks
  force-balance the routing, docs/performance-summary-archive.md); a run that measures its router sets its own
  (`ModelGraph.with_moe_load_imbalance`).
- the sampling term: even a balanced router sends a random number of copies to each rank. The N = ep · T · k
  routed copies of a micro-batch (T tokens per rank) land on a rank with probability 1/ep, a token's k
  copies on k distinct experts (hypergeometric: variance × (E − k)/(E − 1)): the ranks' loads have mean
  T·k, variance c·T·k·(1 − 1/ep) with c = (E − k)/(E − 1), and correlation −1/(ep − 1) (they sum to N).
  Such loads are, in the normal limit, T·k + sqrt(c·T·k) · (Z_i − Z̄) for independent standard normals Z_i,
  so the busiest one exceeds the mean by sqrt(c·T·k) · E[max Z] = sqrt(c·T·k) · z(ep), with
  z(n) = Φ⁻¹((n − 0.375) / (n + 0.25)) (Blom 1958, the expected maximum of n normal samples; exact for n = 2,
  1/√π). Mixtral (E = 8, k = 2) at micro-batch 1 × 4096 tokens, ep = 8: 1 + 1.43 · sqrt(6/7) / 90.5 = 1.015.

At ep = 1 the rank runs every expert on its own tokens: the total routed work is the same whatever the
routing, so the factor is 1.

A rank's own tokens are the micro-batch's ÷ tp where its MoE block runs on a share of them
(`moe_token_share`): under sequence parallelism (each tp rank's sequence shard) and under expert parallelism
folded over tp (autopar.config.ep_folds: the tp ranks split the replicated tokens between them before the
dispatch, autopar.codegen.experts); otherwise every tp rank runs the whole micro-batch's experts, as it does
with the experts tensor-parallel (etp > 1: each tp rank holds a slice of every expert's FFN, so it runs all
the tokens of its tp group, gathered over tp under sequence parallelism).
"""

from __future__ import annotations

import math
from statistics import NormalDist

from autopar.capture.moe_spec import MoESpec
from autopar.config import ep_folds

__all__ = ["busiest_rank_factor", "expected_max_z", "moe_token_share"]


def moe_token_share(tp: int, sp: bool, ep: int, etp: int = 1) -> float:
    """The share of a micro-batch's tokens one rank's expert bank runs on (module docstring): 1 / tp under
    sequence parallelism or expert parallelism folded over tp, else 1 (always 1 with the experts split over tp,
    etp > 1)."""
    return 1.0 / tp if tp > 1 and etp == 1 and (sp or ep_folds(tp, ep)) else 1.0


def expected_max_z(n: int) -> float:
    """Expected maximum of n standard normal samples, Blom's approximation Φ⁻¹((n − 0.375) / (n + 0.25))."""
    if n < 1:
        raise ValueError(f"expected_max_z needs n ≥ 1 samples, got {n}")
    return 0.0 if n == 1 else NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


def busiest_rank_factor(moe: MoESpec, ep: int, tokens_per_rank: float) -> float:
    """Busiest EP rank's routed tokens ÷ the mean, for `tokens_per_rank` tokens per rank and micro-batch
    (module docstring); 1.0 at ep = 1."""
    if ep <= 1:
        return 1.0
    copies = tokens_per_rank * moe.top_k
    if copies <= 0:
        return moe.load_imbalance
    spread = (moe.num_experts - moe.top_k) / max(1, moe.num_experts - 1)
    return moe.load_imbalance * (1.0 + expected_max_z(ep) * math.sqrt(spread / copies))
