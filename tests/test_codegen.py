"""Codegen beyond parity: collectives per step against the TP patterns, plan checks, DCP resume."""

from __future__ import annotations

import dataclasses
import os
import tempfile

import pytest
from dist_harness import run_distributed
from parity_models import BATCH, HEADS, batches, build_model, graph_of, handmade_graph, make_plan, optimizer

from autopar.capture.graph import ModelGraph
from autopar.codegen import lm_cross_entropy, parallelize
from autopar.errors import PlanMismatchError
from autopar.planner.dp_costs import DPTail
from autopar.planner.tp_costs import tp_collectives

# CommDebugMode's names (functional collectives from DTensor, c10d ops from dist.*) → the planner's
_OBSERVED_KIND = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
                  "reduce_scatter_tensor": "reduce_scatter"}


def _comm_counts(kind: str, config: dict) -> dict:
    from torch.distributed.tensor.debug import CommDebugMode

    model = build_model(kind)
    graph = graph_of(kind, model)
    pm = parallelize(model, make_plan(graph, **config), graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
    x, t = batches(1)[0]
    with CommDebugMode() as mode:
        pm.train_step(pm.local_batch(x), pm.local_batch(t))
    counts: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = _OBSERVED_KIND.get(str(op).split(".")[-1], str(op))
        counts[name] = counts.get(name, 0) + n
    return {"counts": counts, "graph": graph.to_json(), "config": config}


def _planned_counts(graph: ModelGraph, config: dict) -> dict[str, int]:
    """What the cost model charges for one step of `config` (one micro-batch): every layer's TP
    collectives (tp_collectives, the function planner/comm_costs.py prices) and the data-parallel tail's (the loss)."""
    tp, sp = config.get("tp", 1), config.get("sequence_parallel", False)
    counts: dict[str, int] = {}
    for layer in graph.layers:
        for c in tp_collectives(graph, layer, tp=tp, sp=sp, micro_batch=BATCH):
            counts[c.op] = counts.get(c.op, 0) + 1
    tail = DPTail(zero_stage=0, dp=1, world=tp, microbatches=1, rank_grad_bytes=1.0,
                  collective_s=lambda *_: 0.0, memory_s=lambda _n: 0.0)
    counts["all_reduce"] = counts.get("all_reduce", 0) + tail.collectives_per_step(len(graph.layers))
    return counts


_TP_CONFIGS = [dict(tp=2), dict(tp=2, sequence_parallel=True)]


def _collective_jobs() -> list:
    return [[_comm_counts(kind, c) for kind in ("gpt", "hf_llama") for c in _TP_CONFIGS], _world_size_error()]


def _world_size_error() -> str:
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    try:
        parallelize(model, make_plan(graph, tp=2, dp=2), graph=graph, optimizer=optimizer)
    except PlanMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.multiproc
def test_tp_collectives_observed_are_the_ones_the_cost_model_prices():
    runs, world_error = run_distributed(_collective_jobs, 2)[0]
    for run in runs:
        graph = ModelGraph.from_json(run["graph"])
        assert run["counts"] == _planned_counts(graph, run["config"]), (graph.model_name, run["config"])
    # The same function, read by hand for the hf_llama plan (2 blocks, vocab-parallel embedding and head):
    # 4 patterns × (forward + backward) + embedding forward + head backward + 2 cross-entropy + the loss + the
    # gradient norm.
    plain = _planned_counts(ModelGraph.from_json(runs[2]["graph"]), runs[2]["config"])
    assert plain == {"all_reduce": 4 * 2 + 1 + 1 + 2 + 1 + 1}
    assert "world size is 2" in world_error and "needs 4 processes" in world_error
    assert "--nproc_per_node 4" in world_error


def test_planned_collectives_change_when_codegen_would():
    """The comparison above can fail: one more collective in a layer changes the planned counts."""
    graph = graph_of("hf_llama", build_model("hf_llama"))
    base = _planned_counts(graph, dict(tp=2, sequence_parallel=True))
    # SP: per pattern an all-gather and a reduce-scatter each way; the head gathers its input forward and
    # reduce-scatters backward; the sequence split after the embedding gathers its gradient backward;
    # 5 RMSNorm weights (2 per block, the final norm) reduced once each (to their parameter's placement), plus
    # the embedding's forward all-reduce, the cross-entropy's 2, the loss and the gradient norm.
    assert base == {"all_gather": 4 * 2 + 1 + 1, "reduce_scatter": 4 * 2 + 1, "all_reduce": 1 + 5 + 2 + 1 + 1}
    extra = dataclasses.replace(graph.layers[1], tp_patterns=graph.layers[1].tp_patterns * 2)
    more = dataclasses.replace(graph, layers=(graph.layers[0], extra, *graph.layers[2:]))
    assert _planned_counts(more, dict(tp=2, sequence_parallel=True))["all_gather"] == base["all_gather"] + 4


def test_plan_for_another_model_is_refused():
    model = build_model("gpt")
    other = make_plan(handmade_graph("hf_llama"), dp=1)
    with pytest.raises(PlanMismatchError, match="made for another model .*: it is for "):
        parallelize(model, other, graph=graph_of("gpt", model), optimizer=optimizer)


def test_tp_that_does_not_divide_heads_is_refused():
    graph = handmade_graph("hf_llama")  # 4 query heads, 2 kv heads
    plan = make_plan(graph, tp=4)
    with pytest.raises(PlanMismatchError, match="tp=4 does not divide"):
        parallelize(build_model("hf_llama"), plan, graph=graph, optimizer=optimizer)
    assert HEADS % 4 == 0  # the query heads alone would split: it is the kv heads that refuse


def test_world_size_without_torchrun_names_the_flag(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    with pytest.raises(PlanMismatchError, match="torchrun --nproc_per_node 2"):
        parallelize(model, make_plan(graph, dp=2), graph=graph, optimizer=optimizer)


def _resume(kind: str, config: dict, path: str) -> tuple[float, float]:
    data = batches(3)
    graph = graph_of(kind, build_model(kind))
    plan = make_plan(graph, **config)
    pm = parallelize(build_model(kind), plan, graph=graph, optimizer=optimizer)
    for x, t in data[:2]:
        pm.train_step(pm.local_batch(x), pm.local_batch(t))
    pm.save(path)
    expected = pm.train_step(pm.local_batch(data[2][0]), pm.local_batch(data[2][1]))
    fresh = parallelize(build_model(kind, seed=123), plan, graph=graph, optimizer=optimizer)
    fresh.load(path)
    return expected, fresh.train_step(fresh.local_batch(data[2][0]), fresh.local_batch(data[2][1]))


def _resume_jobs(root: str) -> list:
    return [_resume("gpt", dict(dp=2, zero_stage=3, num_microbatches=2), os.path.join(root, "zero3")),
            _resume("hf_llama", dict(tp=2), os.path.join(root, "tp")),
            _resume("gpt", dict(pp=2, num_microbatches=2, schedule="1f1b"), os.path.join(root, "pp"))]


@pytest.mark.multiproc
def test_checkpoint_resume_gives_identical_next_step_loss():
    with tempfile.TemporaryDirectory() as root:
        results = run_distributed(_resume_jobs, 2, root)[0]
    for expected, resumed in results:
        assert resumed == pytest.approx(expected, rel=1e-6, abs=0)


def _single_process() -> float:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        os.environ.pop(var, None)
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    pm = parallelize(model, make_plan(graph), graph=graph, optimizer=optimizer)
    x, t = batches(1)[0]
    return pm.train_step(x, t)


def test_parallelize_initialises_the_process_group_itself():
    loss = run_distributed(_single_process, 1)[0]
    reference = build_model("gpt")
    x, t = batches(1)[0]
    assert loss == pytest.approx(lm_cross_entropy(reference(x), t).item(), rel=1e-6)

