"""Which linears of a unit tensor parallelism may shard: (row, columns) pairs in the Megatron pattern.

A column linear's output feeding (through per-head or per-feature ops only) a row linear's input makes a
pair (probe.measure_call records the candidates as the unit runs). Pairs are kept in execution order
while no linear is both a column and a row, and dropped where splitting would mix what must stay whole:
a fused projection (q|k|v, gate|up) wider than the row's input, and a norm over a column's whole output
(it is fed by the columns: a norm of the residual after the row, BERT's, is no obstacle).
"""

from __future__ import annotations

from torch import nn

from autopar.capture.units import common_parent, is_norm

__all__ = ["tensor_parallel_pairs"]


def tensor_parallel_pairs(module: nn.Module, linears: dict[str, nn.Module],
                          candidates: list[tuple[str, frozenset[str]]],
                          norm_sources: dict[str, frozenset[str] | None]) -> list[tuple[str, frozenset[str]]]:
    """The (row, columns) pairs of `module` (names relative to it) that tensor parallelism shards.

    norm_sources: each norm module called, with the linears its input is computed from (None: the
    residual stream)."""
    return [(row, cols) for row, cols in _resolve_pairs(candidates)
            if not _fused(linears, row, cols) and not _full_width_norm(module, linears, row, cols, norm_sources)]


def _fused(linears: dict[str, nn.Module], row: str, cols: frozenset[str]) -> bool:
    """A column linear wider than the row linear's input is several projections in one (q|k|v, gate|up):
    splitting its output features into tp contiguous blocks would give a rank parts of different
    projections, so such a pair is not sharded (it stays replicated, and is priced so)."""
    return any(linears[c].out_features > linears[row].in_features for c in cols)


def _full_width_norm(module: nn.Module, linears: dict[str, nn.Module], row: str, cols: frozenset[str],
                     norm_sources: dict[str, frozenset[str] | None]) -> bool:
    """A norm fed by the columns, as wide as a column's output (OLMo2 normalises q over all heads at
    once): it would need every rank's heads, so the pair is not sharded. Per-head norms (Qwen3) are
    narrower and run on a rank's heads (codegen sums their gradients over the TP group)."""
    owner = common_parent([*cols, row])
    widths = {linears[c].out_features for c in cols}
    root = module.get_submodule(owner) if owner else module
    for name, sub in root.named_modules(prefix=owner):
        src = norm_sources.get(name)
        if is_norm(sub) and src and src <= cols:
            weights = [p for p in sub.parameters(recurse=False) if p.dim() == 1]
            if weights and weights[0].numel() in widths:
                return True
    return False


def _resolve_pairs(candidates: list[tuple[str, frozenset[str]]]) -> list[tuple[str, frozenset[str]]]:
    """Keep candidates in execution order while no linear is both a column and a row."""
    used_rows: set[str] = set()
    used_cols: set[str] = set()
    pairs = []
    for row, cols in candidates:
        if row in used_cols or row in used_rows or cols & used_rows or cols & used_cols:
            continue
        pairs.append((row, cols))
        used_rows.add(row)
        used_cols |= cols
    return pairs
