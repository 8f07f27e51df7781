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

# What capture's probe tracks per tensor: (source linears, is attention core); sources None = replicated
# (from the residual stream), an empty frozenset = constant.
Tag = tuple[frozenset[str] | None, bool]

__all__ = ["Tag", "merge_sources", "tensor_parallel_pairs"]


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


def merge_sources(in_tags: list[Tag], *, bias_ok: bool) -> frozenset[str] | None:
    """The source linears of an op's output: the union of its inputs', None (replicated) when one input is.

    bias_ok (an op on the attention core, or a fused attention kernel): a replicated input there is a
    bias or mask added to the scores per head (T5's relative position bias, passed from block to block;
    Swin's window bias), not the residual stream: the output keeps the core's sources, and codegen gives
    each rank its heads of the bias (autopar.codegen.head_bias)."""
    src: frozenset[str] | None = frozenset()
    sources = [s for s, _ in in_tags]
    if bias_ok and any(s for s in sources):
        sources = [s for s in sources if s is not None]
    for s in sources:
        src = None if s is None or src is None else src | s
    return src
