"""`autopar explain plan.json --from...`: why the plan differs from the layout a framework config runs, and by how
much; the same layout is priced under autopar's runtime too, so the framework's runtime rules and the layout are
told apart (issue 39)."""

from __future__ import annotations

import json

import pytest

from autopar.cli.main import main

MEGATRON = "--tensor-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 8 --seq-length 64"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("explain") / "plan.json"
    assert main(["plan", "gpt-tiny", "--cluster", "local", "--nproc", "2", "--global-batch-size", "8",
                 "--seq-len", "64", "--out", str(path)]) == 0
    return path


def test_explain_from_megatron_prices_it_as_megatron_runs_it_beside_the_plan(plan_file, capsys):
    import autopar
    from autopar import Cluster, ParallelConfig, PlannerOptions

    capsys.readouterr()
    assert main(["explain", str(plan_file), "--from-megatron", MEGATRON, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    got = ParallelConfig.from_dict(out["alternative"]["config"])
    assert (got.tp, got.pp, got.dp, got.micro_batch_size, got.num_microbatches) == (2, 1, 1, 2, 4)
    graph = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=64, dtype=__import__("torch").float32))
    cluster = Cluster.local(nproc=2)
    megatron = autopar.estimate(graph, cluster, got, options=PlannerOptions(pipeline_runtime="megatron"))
    ours = autopar.estimate(graph, cluster, got)
    assert out["alternative"]["estimate"]["step_time_s"] == pytest.approx(megatron.step_time_s, rel=1e-9)
    assert out["alternative_on_autopar"]["step_time_s"] == pytest.approx(ours.step_time_s, rel=1e-9)
    assert main(["explain", str(plan_file), "--from-megatron", MEGATRON]) == 0
    text = capsys.readouterr().out
    assert "read from megatron" in text and "the same layout under autopar's runtime" in text


def test_explain_from_a_config_of_another_batch_says_which(plan_file, capsys):
    other = MEGATRON.replace("--global-batch-size 8", "--global-batch-size 16")
    assert main(["explain", str(plan_file), "--from-megatron", other]) == 1
    assert "global batch of 16 sequences, the plan 8" in capsys.readouterr().err
