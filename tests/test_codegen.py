"""Codegen beyond parity: collectives per step against the TP patterns, plan checks, DCP resume."""

from __future__ import annotations

import os
import tempfile

import pytest
from dist_harness import run_distributed
from parity_models import HEADS, batches, build_model, graph_of, handmade_graph, make_plan, optimizer

from autopar.codegen import lm_cross_entropy, parallelize
from autopar.errors import PlanMismatchError


def _comm_counts(kind: str, config: dict) -> dict[str, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    model = build_model(kind)
    graph = graph_of(kind, model)
    pm = parallelize(model, make_plan(graph, **config), graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
    x, t = batches(1)[0]
    with CommDebugMode() as mode:
        pm.train_step(pm.local_batch(x), pm.local_batch(t))
    counts = {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}
    patterns = [p.kind for la in graph.layers for p in la.tp_patterns]
    return {"counts": counts, "patterns": patterns}


def _world_size_error() -> str:
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    try:
        parallelize(model, make_plan(graph, tp=2, dp=2), graph=graph, optimizer=optimizer)
    except PlanMismatchError as e:
        return str(e)
    return "no error"


def _collective_jobs() -> list:
    return [_comm_counts("hf_llama", dict(tp=2)), _comm_counts("hf_llama", dict(tp=2, sequence_parallel=True)),
            _world_size_error()]


@pytest.mark.multiproc
def test_tp_collectives_match_the_patterns_and_world_size_is_checked():
    plain, sp, world_error = run_distributed(_collective_jobs, 2)[0]
    blocks = sum(k in ("attention", "mlp") for k in plain["patterns"])
    assert blocks == 4 and "embedding" in plain["patterns"] and "lm_head" in plain["patterns"]
    # Megatron TP: each attention/MLP pattern one all-reduce forward + one backward; the vocab-parallel
    # embedding one forward; the LM head one backward (its input gradient).
    assert plain["counts"].get("all_reduce") == 2 * blocks + 1 + 1
    assert "all_gather_into_tensor" not in plain["counts"] and "reduce_scatter_tensor" not in plain["counts"]
    # c10d all-reduces: the parallel cross-entropy (max; sum-exp with target logit) and the reported loss.
    assert plain["counts"].get("allreduce_") == 2 + 1
    # With sequence parallelism each pattern all-gathers its input and reduce-scatters its output in
    # forward, mirrored in backward; the LM head all-gathers its input (backward: reduce-scatter); the
    # sequence split after the embedding is free forward and an all-gather backward.
    assert sp["counts"].get("all_gather_into_tensor") == 2 * blocks + 1 + 1
    assert sp["counts"].get("reduce_scatter_tensor") == 2 * blocks + 1
    assert "world size is 2" in world_error and "needs 4 processes" in world_error
    assert "--nproc_per_node 4" in world_error


def test_plan_for_another_model_is_refused():
    model = build_model("gpt")
    other = make_plan(handmade_graph("hf_llama"), dp=1)
    with pytest.raises(PlanMismatchError, match="made for model"):
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

