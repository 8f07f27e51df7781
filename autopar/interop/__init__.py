"""Hand a plan to the framework a team runs (export), and price the layout it runs today (import).

One module per framework, each with `export_plan(plan) -> Exported` and `import_layout(source, world_size)
-> Imported`: torchtitan (a job-config TOML), Megatron-LM / NeMo (an argument list), DeepSpeed (a ds_config
JSON). What a target cannot express (per-layer recompute, uneven stage cuts, an ep/tp fold, an offload kind)
is written as a note (a comment, or the JSON's "autopar_notes") with the closest setting it takes; import
prices with that framework's runtime (PlannerOptions.pipeline_runtime, loss_kernel, ep_dispatcher).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import AutoparError

__all__ = ["Exported", "Imported", "TARGETS", "export_plan", "import_layout", "stage_notes", "format_error",
           "read_config"]

TARGETS = ("torchtitan", "megatron", "deepspeed")


@dataclass(frozen=True)
class Exported:
    """A target's file text and what of the plan it could not express (also written into the text)."""

    target: str
    text: str
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Imported:
    """A layout read from a framework's config: the ParallelConfig, the options that price it as that framework
    runs it, the sequence length when the config says one, and what was read as its closest layout."""

    source: str
    config: ParallelConfig
    options: PlannerOptions = field(default_factory=PlannerOptions)
    seq_len: int | None = None
    notes: tuple[str, ...] = ()


def format_error(source: str, what: str, fix: str) -> AutoparError:
    return AutoparError(f"{source}: {what}; {fix}")


def read_config(source: str, parse: Callable[[str], Any], kind: str, syntax_errors: tuple[type[Exception], ...],
                fix: str) -> Any:
    """`parse` of the text of file `source`, refused naming the file when it cannot be read or is not `kind`."""
    try:
        return parse(Path(source).read_text())
    except OSError as e:
        raise format_error(source, f"cannot read it ({e.strerror})", fix) from None
    except (*syntax_errors, UnicodeDecodeError) as e:
        raise format_error(source, f"not a {kind} file ({e})", fix) from None


def stage_notes(plan) -> list[str]:
    """Notes every target shares: per-layer recompute inside a stage, and stage cuts that are not even."""
    notes = []
    for st in plan.stages:
        if st.layer_recompute:
            mix = ", ".join(f"{n}×{mode}" for mode, n in Counter(st.layer_recompute).most_common())
            notes.append(f"stage {st.index} recomputes per layer ({mix}); written as recompute={plan.config.recompute} "
                         "on every layer (the closest single mode)")
    sizes = [len(st.layers) for st in plan.stages]
    if len(set(sizes)) > 1:
        notes.append(f"stage cuts are uneven: layers per stage (embedding and head included) {sizes}; written as the "
                     "framework's default split")
    return notes


def _module(target: str):
    if target not in TARGETS:
        raise AutoparError(f"--to {target!r}: unknown target; expected one of {', '.join(TARGETS)}")
    import importlib

    return importlib.import_module(f"autopar.interop.{target}")


def export_plan(plan, target: str) -> Exported:
    return _module(target).export_plan(plan)


def import_layout(target: str, source: str, world_size: int, *, precision: str | None = None,
                  blocks: int | None = None) -> Imported:
    """`source`: a file path (torchtitan, deepspeed) or an argument string (megatron); blocks: the model's
    repeated layers, where a format gives layers per virtual stage rather than their number."""
    return _module(target).import_layout(source, world_size, precision=precision, blocks=blocks)


def num_blocks(plan) -> int:
    """The repeated blocks of a plan's model: its layers named `<stack>.<index>` (model.layers.7, blocks.7)."""
    import re

    return sum(1 for st in plan.stages for name in st.layers if re.search(r"\.\d+$", name))


def world_split(source: str, world_size: int, tp: int, pp: int, cp: int) -> int:
    """The data-parallel degree world / (tp · pp · cp), refused when it does not divide."""
    inner = tp * pp * cp
    if world_size % inner:
        raise format_error(source, f"tp·pp·cp = {tp}·{pp}·{cp} = {inner} does not divide the cluster's "
                           f"{world_size} devices",
                           "give a cluster of a multiple of that size (--cluster/--nodes) or fix the degrees")
    return world_size // inner
