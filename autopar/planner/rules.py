"""What the search space leaves out, split into the rules a layout cannot break and the rules of thumb.

Hard rules (a layout breaking one cannot run, or cannot be priced): tensor parallelism splits every head
count evenly (a vocabulary it does not divide stays replicated: capture.vocab_split) and stays inside a
node (tp divides the node's device count: the cost model prices tp collectives over one node's links, not
across nodes); context parallelism needs attention over a
sequence of at least 2·cp tokens (every chunk holds one); and the rest `ParallelConfig` checks.
Rules of thumb (a layout breaking one runs; the search just does not look there unasked):
  cp chunks      cp is searched only where each of a sequence's 2·cp chunks holds ≥ MIN_CP_CHUNK tokens;
  v ≤ max        virtual stages are searched up to PlannerOptions.max_virtual_stages;
  tp splits      tp is searched only where it splits some pattern (a model whose only patterns are over a
                 vocabulary tp does not divide, such as Hugging Face GPT-2's, would repeat its work on each rank).
A pin is the user's decision: a pinned value that only a rule of thumb excludes is searched and priced as it
runs, and the plan says which rule it breaks (`layout_notes`, kept in Estimate.notes). A pinned value that
breaks a hard rule is refused naming the pin, the rule and the values that pass.
"""

from __future__ import annotations

import math

from autopar.capture.graph import ModelGraph
from autopar.capture.vocab_split import splits_anything, whole_vocabulary_note

__all__ = ["MIN_CP_CHUNK", "divisors", "tp_invalid", "cp_invalid", "cp_chunk_tokens", "layout_notes"]

# The shortest chunk (tokens) a context-parallel rank holds (it holds two) in the searched space. Llama 3 ran
# its 131,072-token stage in chunks of 4,096 (cp 16, Dubey et al. 2024 Table 4), the one published CP layout
# the cost model is checked against (benchmarks/published_runs.py); shorter chunks (small attention blocks,
# K/V exchanges dominated by latency) are not searched unless cp is pinned. It also keeps the search within
# the planner's time limit: with chunks of 128, cp entered every plan of 8K tokens and the llama3-405b problem
# grew to 46,544 layouts.
MIN_CP_CHUNK = 4096


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_invalid(graph: ModelGraph, tp: int, *, devices_per_node: int, world_size: int) -> str | None:
    """Why tensor-parallel degree `tp` cannot be planned for `graph` (None when it can): it must split every
    head count and vocabulary evenly and divide the devices of a node (module docstring)."""
    if tp == 1:
        return None
    if nothing := graph.no_tensor_parallelism():
        return f"tp={tp} is not possible: {nothing}; leave tp unset or 1"
    fits = [t for t in divisors(math.gcd(devices_per_node, world_size)) if _splits(graph, t)]
    if not _splits(graph, tp):
        return (f"tp={tp} does not split every head count of {graph.model_name} evenly "
                f"({_split_sizes(graph)}); possible tp: {fits}")
    if devices_per_node % tp or world_size % tp:
        return (f"tp={tp} is not possible on {world_size} devices of {devices_per_node} per node: a tensor-parallel "
                f"group must divide the devices of a node (its collectives run every layer; the cost model prices "
                f"them over one node's links, not across nodes); possible tp: {fits}")
    return None


def _splits(graph: ModelGraph, tp: int) -> bool:
    """Whether tp runs every pattern (a vocabulary it does not divide kept whole)."""
    return all(pat.max_degree_ok(tp) for layer in graph.layers for pat in layer.tp_patterns)


def _split_sizes(graph: ModelGraph) -> str:
    """"heads 4, kv heads 2, vocabulary 128": what tensor parallelism splits."""
    heads = sorted({p.num_heads for la in graph.layers for p in la.tp_patterns if p.kind == "attention"})
    kv = sorted({p.num_kv_heads or p.num_heads for la in graph.layers for p in la.tp_patterns
                 if p.kind == "attention"})
    vocab = sorted({p.vocab_size for la in graph.layers for p in la.tp_patterns
                    if p.kind in ("embedding", "lm_head") and p.vocab_size})
    parts = [f"heads {heads}" if heads else "", f"kv heads {kv}" if kv and kv != heads else "",
             f"vocabulary {vocab}" if vocab else ""]
    return ", ".join(p for p in parts if p) or "no split sizes"


def cp_invalid(graph: ModelGraph, cp: int) -> str | None:
    """Why context-parallel degree `cp` cannot run for `graph` (None when it can): cp > 1 splits each sequence
    into 2·cp chunks attended across ranks, so it needs attention over a sequence of at least 2·cp tokens."""
    if cp == 1:
        return None
    has_attention = any(p.kind == "attention" for la in graph.layers for p in la.tp_patterns)
    if not (has_attention and graph.seq_len):
        what = "no attention layer" if graph.seq_len else "no sequence dimension in its inputs"
        return (f"cp={cp} splits each sequence over {cp} ranks, which needs attention over a sequence; "
                f"{graph.model_name} has {what}: leave cp unset or 1")
    if graph.seq_len < 2 * cp:
        return (f"cp={cp} splits each sequence into 2·cp = {2 * cp} chunks, but {graph.model_name}'s sequences "
                f"hold {graph.seq_len} tokens (every chunk needs one); pin cp ≤ {graph.seq_len // 2} or plan "
                "longer sequences")
    return None


def cp_chunk_tokens(seq_len: int, cp: int) -> int:
    """Tokens in each of the 2·cp chunks of a sequence (codegen pads it to a multiple of 2·cp)."""
    return -(-seq_len // (2 * cp))


def layout_notes(graph: ModelGraph, *, cp: int, virtual_stages: int, max_virtual_stages: int,
                 tp: int = 1) -> tuple[str, ...]:
    """One note per rule of thumb the layout breaks (it is in the plan because pinned): what the search would
    have left out and why it runs all the same; and a vocabulary that tp leaves whole (capture.vocab_split)."""
    notes = [note] if (note := whole_vocabulary_note(graph, tp)) else []
    if tp > 1 and graph.layers and not splits_anything(graph, tp) and not graph.no_tensor_parallelism():
        vocab = max(p.vocab_size or 0 for la in graph.layers for p in la.tp_patterns)
        padded = -(-vocab // (128 * tp)) * 128 * tp  # Megatron-LM's padding: a multiple of 128·tp
        notes.append(f"tp={tp} as pinned splits nothing of {graph.model_name}: its only tensor-parallel patterns "
                     "are its embedding and LM head, kept whole at this degree (capture found no column→row linear "
                     "pair in its blocks), so its tp ranks repeat each other's work, priced so; a vocabulary padded "
                     f"to a multiple of tp (vocab_size={padded}) would split them")
    if cp > 1 and graph.seq_len and cp_chunk_tokens(graph.seq_len, cp) < MIN_CP_CHUNK:
        notes.append(f"cp={cp} as pinned: each rank holds 2 chunks of {cp_chunk_tokens(graph.seq_len, cp):,} "
                     f"tokens of the {graph.seq_len:,}-token sequence, below the {MIN_CP_CHUNK:,}-token chunks the "
                     "search considers (its K/V all-gathers are latency-bound at this size); priced as it runs")
    if virtual_stages > max_virtual_stages:
        notes.append(f"virtual_stages={virtual_stages} as pinned, above max_virtual_stages={max_virtual_stages} "
                     "(the most the search considers)")
    return tuple(notes)
