"""Fuzzed user files: a valid plan, cluster file, profile and run record mutated field by field.

Every mutation (field deleted, wrong type, null, NaN, ±inf, negative, huge; layers renamed, removed,
duplicated, stages reordered) must end in an AutoparError (or, for profiles read by cost_models alone,
ProfileMismatch) with a one-line message, or in a valid object that round-trips through its file.
A tampered plan must be refused by `parallelize` on every rank of a gloo job before anything trains.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import autopar
from autopar.cluster import Cluster
from autopar.config import PlannerOptions
from autopar.errors import AutoparError, PlanMismatchError
from autopar.plan import BREAKDOWN_KEYS, Plan
from autopar.planner.plan_fit import check_plan_for_graph
from autopar.record import RankTiming, RunRecord, build_record
from cost_models.profile import (
    CollectiveSample,
    ElementwiseSample,
    GemmSample,
    MachineInfo,
    Profile,
    ProfileMismatch,
)
from tests.dist_harness import run_distributed

SEQ = 32
VALUES = ("x", None, math.nan, math.inf, -math.inf, -1, 0, 10**30, 1e300, [], {})


@pytest.fixture(scope="module")
def graph():
    import torch

    model, x = autopar.zoo.build("gpt-tiny", seq_len=SEQ, dtype=torch.float32, n_layers=2, dropout=0.0)
    return autopar.capture(model, x)


@pytest.fixture(scope="module")
def plan(graph) -> Plan:
    return autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=4,
                        options=PlannerOptions(pp=2, schedule="1f1b", num_microbatches=2, top_k=2))


def _paths(d: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every key path to a leaf or container of a JSON document."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _json(d: dict) -> dict:
    """`d` as its file holds it (tuples become lists)."""
    return json.loads(json.dumps(d))


def _mutations(doc: dict) -> Iterator[tuple[str, dict]]:
    """(description, mutated copy): each path deleted, then set to each of VALUES."""
    doc = _json(doc)
    for path in _paths(doc):
        for value in ("<deleted>", *VALUES):
            d = copy.deepcopy(doc)
            parent = d
            for key in path[:-1]:
                parent = parent[key]
            if value == "<deleted>":
                del parent[path[-1]]
            else:
                parent[path[-1]] = value
            yield f"{'.'.join(map(str, path))} = {value!r}", d


def _outcome(load: Callable[[str], Any], path, doc: Any, errors: tuple[type, ...]) -> Any:
    """Write `doc`, load it: the object, or the error, which must be one of `errors` with a one-line message."""
    path.write_text(json.dumps(doc))
    try:
        return load(str(path))
    except errors as e:
        msg = str(e)
        assert msg and "\n" not in msg, msg
        return e


def test_every_mutation_of_a_plan_is_refused_or_round_trips(plan, graph, tmp_path) -> None:
    def load(p: str) -> Plan:
        got = Plan.load(p)
        check_plan_for_graph(got, graph)
        return got

    doc = plan.to_dict()
    f = tmp_path / "plan.json"
    refused, accepted = 0, []
    for what, d in _mutations(doc):
        got = _outcome(load, f, d, (AutoparError,))
        if isinstance(got, Plan):
            accepted.append(what)
            assert Plan.from_dict(got.to_dict()) == got, what
            got.save(f)
            assert Plan.load(f) == got, what
            assert "NaN" not in f.read_text() and "Infinity" not in f.read_text(), what  # json's NaN is one object
        else:
            refused += 1
    # What passes is a label (names, solver statistics), a field deleted or set to its default, or an
    # optional figure (runner-ups, 0 for "not priced"); never a change to the layout, its cuts or its step.
    core = ("stages.0.layers", "stages.1.layers", "graph_fingerprint", "global_batch_size", "seq_len",
            "estimate.step_time_s", "estimate.tokens_per_s", "config.pp", "config.num_microbatches",
            "config.micro_batch_size")
    assert not [w for w in accepted if w.startswith(core)], accepted
    assert refused > 3 * len(accepted), (refused, len(accepted))


@pytest.mark.parametrize("edit", ["removed", "renamed", "duplicated", "reordered", "moved", "tp3", "nan_peak"])
def test_hand_edits_of_a_plan_are_refused_with_what_is_wrong(plan, graph, tmp_path, edit) -> None:
    d = _json(plan.to_dict())
    s0, s1 = d["stages"]
    if edit == "removed":
        s1["layers"].remove(s1["layers"][0])
        want = "in no stage"
    elif edit == "renamed":
        s0["layers"][-1] = "blocks.7"
        want = "not layers of"
    elif edit == "duplicated":
        s1["layers"].insert(0, s0["layers"][-1])
        want = "again in stage"
    elif edit == "reordered":
        s0["layers"], s1["layers"] = s1["layers"], s0["layers"]
        want = "out of order"
    elif edit == "moved":  # one layer moved to the other stage: still complete, but not the planned cut
        s1["layers"].insert(0, s0["layers"].pop())
        want = None
    elif edit == "tp3":
        d["config"]["tp"] = 3
        d["alternatives"] = []
        want = "tp=3 does not divide"
    else:
        d["estimate"]["peak_memory_bytes"] = math.nan
        want = "peak_memory_bytes"
    f = tmp_path / "plan.json"
    got = _outcome(lambda p: (check_plan_for_graph(Plan.load(p), graph), Plan.load(p))[1], f, d, (AutoparError,))
    if want is None:  # a different cut is a legitimate plan: accepted (its estimate is then not the planner's)
        assert isinstance(got, Plan)
        return
    assert isinstance(got, PlanMismatchError), got
    assert want in str(got) and "autopar plan" in str(got)


def test_cli_show_of_a_tampered_plan_prints_one_error_line(tmp_path, capsys) -> None:
    """`show` rebuilds a zoo model as `autopar plan` captured it and checks the stages against its layers."""
    import torch

    from autopar.cli.main import main

    graph = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=SEQ, dtype=torch.float32))
    plan = autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=2, options=PlannerOptions(top_k=0))
    d = _json(plan.to_dict())
    d["stages"][0]["layers"].remove("blocks.1")
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(d))
    assert main(["show", str(f)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error:") and "['blocks.1']" in err[0], err


CLUSTER = {"name": "fuzz", "nodes": 2, "devices_per_node": 8, "device": "h100-sxm-80gb",
           "intra_node": "nvlink4-nvswitch", "inter_node": {"bandwidth_GBps": 50.0, "latency_us": 5.0},
           "backend": "nccl"}


def test_every_mutation_of_a_cluster_file_is_refused_or_round_trips(tmp_path) -> None:
    f = tmp_path / "cluster.json"
    docs = list(_mutations(CLUSTER))
    inline = dict(CLUSTER, device={"memory_GiB": 80.0, "memory_bandwidth_GBps": 3350.0,
                                   "peak_TFLOPs": {"bfloat16": 989.0}, "source": "H100 SXM datasheet"})
    docs += list(_mutations(inline))
    docs += [("null", None), ("list", [CLUSTER]), ("string", "dgx-h100"), ("number", 3)]
    refused = 0
    for what, d in docs:
        got = _outcome(Cluster.from_file, f, d, (AutoparError,))
        if isinstance(got, Cluster):
            assert Cluster.from_dict(got.to_dict()) == got, what
            for key in ("memory_bandwidth_Bps",):
                assert math.isfinite(getattr(got.device, key)), what
            assert all(math.isfinite(v) and v > 0 for v in got.device.peak_flops.values()), what
            assert math.isfinite(got.inter_node.bandwidth_Bps) and got.inter_node.bandwidth_Bps > 0, what
        else:
            refused += 1
    assert refused > len(docs) // 2


def test_a_cluster_of_a_billion_nodes_is_refused_naming_the_bound(tmp_path) -> None:
    f = tmp_path / "huge.json"
    f.write_text(json.dumps(dict(CLUSTER, nodes=10**9)))
    with pytest.raises(AutoparError, match="at most 1,048,576"):
        Cluster.from_file(f)
    with pytest.raises(AutoparError, match="at most 1,048,576"):
        Cluster.preset("dgx-h100", nodes=10**9)


def _profile() -> Profile:
    return Profile(machine=MachineInfo(hostname="h", platform="Linux", processor="x86_64", cpu_count=2,
                                       ram_bytes=2**34),
                   device_name="cpu", device_kind="cpu", device_count=2, torch_version="2.13.0",
                   created="2026-01-01T00:00:00", backend="gloo", threads_per_process=1, launch_overhead_s=1e-6,
                   gemm=(GemmSample(m=64, n=64, k=64, dtype="float32", time_s=1e-5),),
                   elementwise=(ElementwiseSample(op="add", dtype="float32", n_bytes=3 * 2**20, time_s=1e-4,
                                                  tensor_bytes=2**20),),
                   collectives=(CollectiveSample(op="all_reduce", group_size=2, n_bytes=2**20, time_s=1e-3),),
                   layer_times={"abc:fwd:b1:t1": 1e-3})


def test_every_mutation_of_a_profile_is_refused_or_round_trips(tmp_path) -> None:
    from autopar.cluster import _load_profile

    f = tmp_path / "profile.json"
    prof = _profile()
    refused = 0
    for what, d in _mutations(prof.to_dict()):
        got = _outcome(Profile.load, f, d, (ProfileMismatch,))
        if isinstance(got, Profile):
            assert Profile.from_dict(json.loads(got.to_json())) == got, what
            assert "NaN" not in got.to_json() and "Infinity" not in got.to_json(), what
        else:
            refused += 1
            with pytest.raises(AutoparError):  # what autopar (Cluster.local/preset) raises for the same file
                _load_profile(f)
    assert refused > 100


def test_every_mutation_of_a_run_record_is_refused_or_round_trips(plan, tmp_path) -> None:
    steps = (0.2, 0.21)
    comps = {k: (0.1, 0.1) if k == "compute" else (0.0, 0.0) for k in BREAKDOWN_KEYS}
    ranks = [RankTiming(rank=r, pp_rank=r, dp_rank=0, tp_rank=0, step_s=steps, components_s=comps) for r in (0, 1)]
    rec = build_record(plan, ranks, hostname="h", device_name="cpu", torch_version="2.13.0", backend="gloo",
                       threads_per_process=1, created="2026-01-01T00:00:00", warmup_steps=1)
    f = tmp_path / "run.json"
    refused = 0
    for what, d in _mutations(rec.to_dict()):
        got = _outcome(RunRecord.load, f, d, (AutoparError,))
        if isinstance(got, RunRecord):
            text = json.dumps(got.to_dict())
            assert RunRecord.from_dict(json.loads(text)) == got, what
            assert "NaN" not in text and "Infinity" not in text, what
        else:
            refused += 1
    assert refused > 100


def _parallelize_tampered(plan_dict: dict) -> str:
    """On one rank: the model the plan was made for, and the plan with a layer taken out of its stage."""
    import torch

    model, x = autopar.zoo.build("gpt-tiny", seq_len=SEQ, device="cpu", dtype=torch.float32, n_layers=2,
                                 dropout=0.0)
    plan = Plan.from_dict(plan_dict)
    try:
        autopar.parallelize(model, plan, example_inputs=x,
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    except PlanMismatchError as e:
        return str(e)
    return "trained"


@pytest.mark.multiproc
def test_parallelize_refuses_a_tampered_plan_on_every_rank(plan) -> None:
    d = _json(plan.to_dict())
    d["stages"][1]["layers"].pop(0)  # a block in no stage: the rest would still train, a different network
    results = run_distributed(_parallelize_tampered, 2, d, timeout_s=120)
    assert all("in no stage" in r for r in results), results
