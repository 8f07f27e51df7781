"""`autopar capture MODEL`: the layer table of a model (per sample of the example batch) and its totals."""

from __future__ import annotations

import argparse
import json

from autopar.capture.graph import LayerSpec, ModelGraph, TPPattern
from autopar.cli.cmd_plan import _graph, add_loss_args

__all__ = ["register", "run", "format_table"]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "capture", help="capture a model as a layer table",
        description="Trace MODEL on the meta device and print its layers: parameters, FLOPs, saved "
                    "activations, pipeline boundary bytes and tensor-parallel patterns (per sample).")
    p.add_argument("model", metavar="MODEL",
                   help="zoo name (e.g. llama3-8b), path/file.py:factory, package.module:factory, or a transformers "
                        "config: a folder with config.json, a .json file, or a Hub name in the local HF cache")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (zoo default: min(context, 2048))")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="zoo config field, e.g. dropout=0 (repeatable; as examples/train_gpt.py takes it)")
    add_loss_args(p)
    p.add_argument("--all-layers", action="store_true", help="one row per layer; default folds identical runs")
    p.add_argument("--json", action="store_true", help="print the ModelGraph as JSON")
    p.set_defaults(func=run)


def _moe(la: LayerSpec) -> str:
    m = la.moe
    if m is None:
        return ""
    shared = f",shared={_si(m.shared_params)}" if m.shared_params else ""
    groups = f",groups={m.route_group_top_k}/{m.route_groups}" if m.group_limited else ""
    return f" moe(E={m.num_experts},k={m.top_k}{groups},ffn={m.ffn_hidden_size}{shared})"


def _pattern(p: TPPattern) -> str:
    if p.kind == "attention":
        kv = f",kv={p.num_kv_heads}" if p.num_kv_heads and p.num_kv_heads != p.num_heads else ""
        return f"attn(h={p.num_heads}{kv})"
    if p.kind in ("embedding", "lm_head"):
        return f"{p.kind}(V={p.vocab_size})"
    return "mlp"


def _si(x: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= factor:
            return f"{x / factor:.2f}{prefix}{unit}"
    return f"{x:.0f}{unit}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _runs(layers: tuple[LayerSpec, ...], fold: bool) -> list[tuple[str, LayerSpec, int]]:
    rows: list[tuple[str, LayerSpec, int]] = []
    i = 0
    while i < len(layers):
        j = i + 1
        while fold and j < len(layers) and layers[j].signature == layers[i].signature:
            j += 1
        name = layers[i].name if j - i == 1 else f"{layers[i].name} … {layers[j - 1].name}"
        rows.append((name, layers[i], j - i))
        i = j
    return rows


def format_table(graph: ModelGraph, fold: bool = True) -> str:
    """The human-readable table: one row per layer (or per run of identical layers, counts × each)."""
    head = (f"{'layer':<28}{'kind':<10}{'×':>4}{'params':>10}{'fwd FLOP':>11}{'bwd FLOP':>11}"
            f"{'saved MiB':>11}{'boundary MiB':>13}  TP pattern")
    lines = [f"{graph.model_name}: {graph.num_layers} layers, seq_len={graph.seq_len}, dtype={graph.dtype}, "
             f"captured by {graph.capture_method} in {graph.capture_time_s:.2f} s "
             "(FLOPs and bytes per sample, per layer)", head, "-" * len(head)]
    for name, la, count in _runs(graph.layers, fold):
        pats = (" ".join(_pattern(p) for p in la.tp_patterns) + _moe(la)).strip() or "-"
        lines.append(f"{name[:27]:<28}{la.kind:<10}{count:>4}{_si(la.num_params):>10}{_si(la.forward_flops):>11}"
                     f"{_si(la.backward_flops):>11}{_mib(la.saved_activation_bytes):>11}"
                     f"{_mib(la.boundary_bytes):>13}  {pats}")
    lines.append("-" * len(head))
    lines.append(f"total: {graph.num_params:,} parameters ({graph.param_bytes / 2**30:.2f} GiB), "
                 f"{_si(graph.forward_flops)}FLOP forward + {_si(graph.backward_flops)}FLOP backward per sample, "
                 f"{graph.saved_activation_bytes / 2**30:.2f} GiB saved activations per sample")
    moe = [la.moe for la in graph.layers if la.moe is not None]
    if moe:
        lines.append(f"mixture of experts: {len(moe)} MoE layers, {_si(graph.expert_params)} expert parameters "
                     f"(dense {_si(graph.num_params - graph.expert_params)}), load imbalance {moe[0].load_imbalance:g} "
                     "(busiest expert's tokens ÷ mean)")
    dims = [f"{k}={v}" for k, v in (("hidden", graph.hidden_size), ("heads", graph.num_attention_heads),
                                    ("kv_heads", graph.num_kv_heads), ("vocab", graph.vocab_size)) if v]
    lines.append(f"{', '.join(dims)}; fingerprint {graph.fingerprint}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    graph = _graph(args.model, args.seq_len, overrides=args.override, args=args)
    if args.json:
        print(json.dumps({**graph.to_dict(), "fingerprint": graph.fingerprint}, indent=1))
    else:
        print(format_table(graph, fold=not args.all_layers))
    return 0
