"""`autopar budget`: which GPUs, how many, how long and at what cost. A thin mirror of `autopar.budget`;
this module parses the amounts (2e12, 2T, 4Mi), durations (30d), ranges (8..512) and prices."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import time

from autopar.checks import MAX_DEVICES
from autopar.cli.checks import check_output_path
from autopar.errors import AutoparError

__all__ = ["register", "parse_amount", "parse_days", "parse_nodes", "parse_prices", "batch_tokens"]

_SUFFIX = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
_DAYS = {"": 1.0, "d": 1.0, "h": 1 / 24, "w": 7.0}
DEFAULT_NODES = "1..64"


def parse_amount(text: str, flag: str) -> float:
    """'2e12', '2T' (10^12), '300B', '4M' (10^6), '4Mi' (4·2^20) → a positive number."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|[kKMBGT]?)\s*", text)
    value = float(m.group(1)) * _SUFFIX[m.group(2)] if m and _is_float(m.group(1)) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise AutoparError(f"{flag} {text!r}: give a positive amount, e.g. 2e12, 2T (10^12), 300B, 4M (10^6) or "
                           "4Mi (4·2^20)")
    return value


def _is_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def parse_days(text: str, flag: str = "--deadline") -> float:
    """'30d', '720h', '4w' or '30' (days) → days."""
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([dhw]?)\s*", text)
    value = float(m.group(1)) * _DAYS[m.group(2)] if m and _is_float(m.group(1)) else math.nan
    if not (math.isfinite(value) and value > 0):
        raise AutoparError(f"{flag} {text!r}: give a positive duration, e.g. 30d, 720h or 4w")
    return value


def parse_nodes(text: str) -> list[int]:
    """'8..512' (8, 12, 16, 24, …, 512: powers of two and 1.5× between) and/or '8,16,100' → sorted sizes."""
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("..")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            a = b = 0
        if a < 1 or b < a or b > MAX_DEVICES:
            raise AutoparError(f"--nodes {text!r}: give node counts or ranges LOW..HIGH with 1 ≤ LOW ≤ HIGH, e.g. "
                               "8..512 or 8,16,32")
        if not sep:
            out.add(a)
            continue
        p = 1
        while p <= b:
            out.update(n for n in (p, p * 3 // 2) if a <= n <= b and (p > 1 or n == 1))
            p *= 2
        out.update((a, b))
    return sorted(out)


def parse_prices(items: list[str]) -> dict[str, float]:
    """['dgx-h100=2.5', …] → {cluster: price per GPU-hour}."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        try:
            value = float(raw) if sep and name.strip() else math.nan
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise AutoparError(f"--price {item!r}: give CLUSTER=PRICE_PER_GPU_HOUR with a positive price, e.g. "
                               "dgx-h100=2.5")
        out[name.strip()] = value
    return out


def batch_tokens(text: str, seq_len: int) -> list[int]:
    """'4Mi' → [4·2^20] (a whole number of sequences); '4M..16M' → every power-of-two number of sequences
    whose tokens lie in the range (the largest useful batch bounds data parallelism: a range lets each
    cluster take the batch that trains it fastest)."""
    lo, sep, hi = text.partition("..")
    a = parse_amount(lo, "--global-batch-tokens")
    if not sep:
        return [int(a)] if a == int(a) else [math.ceil(a)]
    b = parse_amount(hi, "--global-batch-tokens")
    sizes = [2**k for k in range(25) if a <= 2**k * seq_len <= b]
    if b < a or not sizes:
        raise AutoparError(f"--global-batch-tokens {text!r}: no power-of-two number of {seq_len}-token sequences "
                           f"lies in it; give LOW ≤ HIGH spanning a power of two times {seq_len}, e.g. 4M..16M")
    return [s * seq_len for s in sizes]


def register(subparsers: argparse._SubParsersAction) -> None:
    from autopar.cli.cmd_plan import add_loss_args

    p = subparsers.add_parser("budget", help="which GPUs, how many, how long and at what cost to train a model",
                              description="Plan MODEL on every cluster kind × size (the exact best plan each) and "
                                          "say how long training the tokens takes, with its error band, what it "
                                          "costs at your prices, the Pareto front and the plans that meet the "
                                          "deadline at the slow end of the band.")
    p.add_argument("model", metavar="MODEL", help="zoo name (e.g. llama3-70b), path/file.py:factory or pkg.mod:factory")
    p.add_argument("--tokens", required=True, help="tokens to train on, e.g. 2e12 or 2T")
    p.add_argument("--clusters", required=True, help="comma-separated presets (autopar clusters) or cluster files")
    p.add_argument("--nodes", default=DEFAULT_NODES, help=f"sizes to sweep: LOW..HIGH (powers of two and 1.5× "
                                                          f"between) and/or a list (default {DEFAULT_NODES})")
    p.add_argument("--global-batch-tokens", default="4Mi",
                   help="tokens per step, a whole number of sequences (default 4Mi = 4·2^20, Llama 2's '4M'), or "
                        "a range LOW..HIGH: each cluster takes the power-of-two batch in it that trains fastest")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="zoo config field")
    p.add_argument("--deadline", default=None, help="train within this long at the slow end of the band: 30d, 720h")
    p.add_argument("--max-cost", default=None, help="cost cap at the slow end of the band, in the prices' currency")
    p.add_argument("--price", action="append", default=[], metavar="CLUSTER=PRICE",
                   help="price per GPU-hour of a cluster kind (repeatable; or price_per_gpu_hour in a cluster "
                        "file); autopar holds no prices")
    p.add_argument("--goodput", type=float, default=1.0,
                   help="fraction of wall time spent training (restarts, evaluation, checkpoints take the rest); "
                        "default 1.0; Meta reports >0.9 for Llama 3")
    p.add_argument("--workers", type=int, default=None,
                   help="processes planning points at once (forked; default 1)")
    p.add_argument("--time-limit", type=float, default=60.0, help="solver time limit per plan, seconds")
    p.add_argument("--plot", default=None, help="draw days and cost against GPUs (png/svg)")
    p.add_argument("--json", action="store_true", help="print the budget as JSON")
    add_loss_args(p)
    p.set_defaults(func=_budget)


def _budget(args: argparse.Namespace) -> int:
    import autopar
    from autopar.budget import cluster_kinds
    from autopar.cli.cmd_plan import _graph
    from autopar.config import PlannerOptions
    from autopar.models import training_dtype

    tokens = parse_amount(args.tokens, "--tokens")
    deadline = parse_days(args.deadline) if args.deadline is not None else None
    max_cost = parse_amount(args.max_cost, "--max-cost") if args.max_cost is not None else None
    nodes = parse_nodes(args.nodes)
    prices = parse_prices(args.price)
    clusters = [c.strip() for c in args.clusters.split(",") if c.strip()]
    if not (math.isfinite(args.goodput) and 0 < args.goodput <= 1):
        raise AutoparError(f"--goodput {args.goodput}: give the fraction of wall time spent training, in (0, 1], "
                           "e.g. 0.9")
    if not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise AutoparError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    if args.seq_len is not None and args.seq_len < 1:
        raise AutoparError(f"--seq-len {args.seq_len}: give a positive number of tokens per sequence")
    if args.plot is not None:
        if not args.plot.lower().endswith((".png", ".svg")):
            raise AutoparError(f"--plot {args.plot}: use a .png or .svg file name")
        check_output_path(args.plot, "--plot")
    cluster_kinds(clusters, dict(prices))  # unknown names and bad files refused before the capture
    t0 = time.perf_counter()
    graph = _graph(args.model, args.seq_len, training_dtype("cluster"), args.override, args=args)
    capture_s = time.perf_counter() - t0
    result = autopar.budget(graph, tokens=tokens, clusters=clusters, nodes=nodes,
                            global_batch_tokens=batch_tokens(args.global_batch_tokens, graph.seq_len or 1),
                            prices=prices, deadline_days=deadline, max_cost=max_cost, goodput=args.goodput,
                            options=PlannerOptions(time_limit_s=args.time_limit),
                            workers=args.workers if args.workers is not None else 1)
    result = dataclasses.replace(result, capture_s=capture_s)
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        from autopar.report.budget_text import render_budget

        print(render_budget(result))
    if args.plot:
        from autopar.report.budget_plot import draw_budget

        draw_budget(result, args.plot)
        if not args.json:
            print(f"plot            {args.plot}")
    if result.unmet:
        raise AutoparError(result.unmet)
    return 0
