"""What crosses a pipeline cut: codegen's dry run (autopar/codegen/dataflow.py) against capture's boundary
bytes (what the planner prices), and the refusals for forwards that pipelining cannot reproduce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hf_families import build_custom, build_family
from torch import nn

import autopar
from autopar.codegen.batch import MicroBatches
from autopar.codegen.dataflow import trace_dataflow
from autopar.codegen.pipeline import build_stage, layer_modules
from autopar.errors import PlanMismatchError

# one sample per micro-batch, as captured: a tensor without a batch dimension (a position embedding
# of [seq, hidden]) is priced per sample, so only at the captured batch size do the bytes agree exactly
SEQ, MBS = 16, 1


def _flow_and_graph(model: nn.Module):
    graph = autopar.capture(model, (torch.zeros(1, SEQ, dtype=torch.long),))
    units = [u for la in graph.layers for u in layer_modules(graph, la.name)]
    return graph, trace_dataflow(model, units, (torch.zeros(MBS, SEQ, dtype=torch.long),))


def _cut_after(graph, i: int) -> dict[str, int]:
    return {u: int(k > i) for k, la in enumerate(graph.layers) for u in layer_modules(graph, la.name)}


@pytest.mark.parametrize("kind", ["gpt2", "gpt_neox", "gemma", "phi3", "skip_tied", "gpt-tiny"])
def test_codegen_sends_what_the_planner_prices(kind):
    if kind == "gpt-tiny":
        model, _ = autopar.zoo.build(kind, seq_len=SEQ, device="cpu", dropout=0.0)
    elif kind == "skip_tied":
        model = build_custom(kind)
    else:
        model = build_family(kind)
    graph, flow = _flow_and_graph(model)
    for i, layer in enumerate(graph.layers[:-1]):
        io = flow.stages(_cut_after(graph, i), 2)[0]
        assert io.nbytes(flow) == layer.boundary_bytes * MBS, (kind, layer.name, io.sends)
        assert io.nbytes(flow) > 0


def test_skip_connection_and_tied_head_cross_every_cut():
    graph, flow = _flow_and_graph(build_custom("skip_tied"))
    names = [la.name for la in graph.layers]
    io = flow.stages(_cut_after(graph, names.index("blocks.1")), 2)[0]
    # the blocks' output, and both embeddings that the skip connection adds back before the head
    assert [k[0] for k in io.sends] == ["tok", "pos", "blocks.1"]
    tied = next(sp for sp in graph.shared_params if len(sp.names) > 1)
    assert tied.names == ("tok.weight", "head.weight") and tied.layers == ("tok", "head")
    assert any(sp.names == ("out_scale",) and sp.layers == () for sp in graph.shared_params)


class _MaskFromIds(nn.Module):
    """Its top-level code reads the token ids' values (a padding mask): a later stage would need them."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 32)
        self.dropout = dropout

    def forward(self, ids):
        keep = (ids != 0).unsqueeze(-1).float()
        x = F.dropout(self.emb(ids), self.dropout, self.training)
        for block in self.blocks:
            x = block(x) * keep
        return self.head(x)


def test_input_values_read_on_a_later_stage_cross_no_cut():
    """Every stage reads its own micro-batches (codegen/batch.py), so the mask the last block's glue builds
    from the ids is recomputed there: only the first block's output crosses the cut."""
    model = _MaskFromIds()
    graph, flow = _flow_and_graph(model)
    ios = flow.stages(_cut_after(graph, 1), 2)
    assert [k[0] for k in ios[0].sends] == ["blocks.0"] and ios[1].receives == ios[0].sends


def test_random_top_level_code_is_refused_under_pipelining():
    model = _MaskFromIds(dropout=0.1)
    graph, flow = _flow_and_graph(model)
    assert flow.random_glue == ("dropout",)
    stage_of = _cut_after(graph, 1)
    ios = flow.stages(stage_of, 2)
    with pytest.raises(PlanMismatchError, match="draws random numbers"):
        build_stage(model, flow, ios, stage_of, 0, device=torch.device("cpu"), feed=MicroBatches())
    model.eval()  # inactive dropout draws nothing
    assert trace_dataflow(model, list(stage_of), (torch.zeros(MBS, SEQ, dtype=torch.long),)).random_glue == ()


def test_stages_out_of_call_order_are_refused():
    model = build_family("llama")
    graph, flow = _flow_and_graph(model)
    stage_of = _cut_after(graph, 1)
    stage_of["model.layers.0"], stage_of["model.layers.1"] = 1, 0
    with pytest.raises(PlanMismatchError, match="call order"):
        flow.stages(stage_of, 2)


def _refused_on_one_stage() -> str:
    """Rank 1 cannot build its stage (a refusal only that stage meets); rank 0's stage builds fine."""
    import sys

    import torch.distributed as dist
    from parity_models import make_plan, optimizer

    from autopar.codegen import parallelize

    codegen_parallelize = sys.modules["autopar.codegen.parallelize"]  # the module the function shadows

    torch.manual_seed(0)
    model = _MaskFromIds()
    graph = autopar.capture(model, (torch.zeros(1, SEQ, dtype=torch.long),))
    plan = make_plan(graph, pp=2, num_microbatches=2)
    build = codegen_parallelize.build_stage

    def refuse_on_rank_1(*args, **kwargs):
        if dist.get_rank() == 1:
            raise PlanMismatchError("stage 1 holds a module tensor parallelism cannot shard")
        return build(*args, **kwargs)

    codegen_parallelize.build_stage = refuse_on_rank_1
    try:
        parallelize(model, plan, graph=graph, optimizer=optimizer)
    except PlanMismatchError as e:
        return str(e)
    finally:
        codegen_parallelize.build_stage = build
    return "trained"


@pytest.mark.multiproc
def test_a_failure_on_one_rank_stops_every_rank_with_its_name():
    from dist_harness import run_distributed

    messages = run_distributed(_refused_on_one_stage, 2, timeout_s=120)
    assert "cannot shard" in messages[1]
    assert messages[0].startswith("rank 1 could not build its part of the plan") and "cannot shard" in messages[0]


class _ReadsValues(nn.Module):
    """Its forward reads a tensor's value in Python: it cannot be run on fake tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * float(x.sum().item() > 0)


def test_forward_that_reads_values_is_refused_for_pipelining():
    with pytest.raises(PlanMismatchError, match="use pp=1"):
        trace_dataflow(_ReadsValues(), ["blocks.0", "blocks.1"], (torch.zeros(2, 8),))


def _one_rank_raises_in(entry: str) -> str:
    """Rank 1's stage raises inside `entry` (train_step or eval_loss) and its process ends; rank 0 is then
    blocked receiving from it."""
    from parity_models import pipeline_failing_on_rank1

    pm, _, x, t = pipeline_failing_on_rank1(f"boom in {entry}")
    try:
        getattr(pm, entry)(pm.local_batch(x), pm.local_batch(t))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "went on"


@pytest.mark.multiproc
@pytest.mark.parametrize("entry", ["train_step", "eval_loss"])
def test_a_rank_failing_mid_step_is_named_by_its_peers(entry):
    from dist_harness import run_distributed

    messages = run_distributed(_one_rank_raises_in, 2, entry, timeout_s=180)
    assert messages[1] == f"ValueError: boom in {entry}"
    assert messages[0].startswith(f"PeerFailedError: rank 1 failed during {entry} (ValueError: boom in {entry}")
