"""Bad command lines end in one `autopar: error:` line and exit 1, before any long work; a bug in autopar
ends in one line saying so (the traceback under --debug); the API raises AutoparError subclasses."""

from __future__ import annotations

import json
import time

import pytest
import torch

import autopar
from autopar.cli.main import main
from autopar.errors import AutoparError, ClusterSpecError, ConfigError

FACTORIES = '''
import torch
from torch import nn
def raises():
    raise RuntimeError("weights file missing")
def needs(hidden):
    return nn.Linear(hidden, hidden), (torch.zeros(1, hidden),)
def fixed():
    return nn.Linear(8, 8), (torch.zeros(2, 8),)
'''

CASES = [  # (command line, a phrase the one error line must hold)
    ("plan gpt-tiny --cluster local --dtype float16 --global-batch-size 8", "no float16 throughput"),
    ("plan gpt-tiny --cluster {nan} --global-batch-size 8", "bandwidth_GBps = nan"),
    ("plan gpt-tiny --cluster {huge} --global-batch-size 8", "at most 1,048,576"),
    ("plan gpt-tiny --cluster {null} --global-batch-size 8", "holds null"),
    ("plan gpt-tiny --cluster local --global-batch-size 8 --out {tmp}/f.txt/plan.json", "cannot create its folder"),
    ("plan gpt-tiny --cluster local --global-batch-size 8 --top -1", "--top -1"),
    ("plan gpt-tiny --cluster local --global-batch-size 8 --time-limit nan", "--time-limit nan"),
    ("plan gpt-tiny --cluster local --global-batch-size 100000000", "bound of 16,777,216"),
    ("plan gpt-tiny --cluster local --nodes 4 --global-batch-size 8", "does not apply to --cluster local"),
    ("plan gpt-tiny --cluster {ok} --nodes 4 --global-batch-size 8", "does not apply to the cluster file"),
    ("plan {factories}:raises --cluster local --global-batch-size 8", "raised RuntimeError: weights file missing"),
    ("plan {factories}:needs --cluster local --global-batch-size 8", "needs argument(s) ['hidden']"),
    ("plan {factories}:fixed --cluster local --global-batch-size 8 --seq-len 64", "takes no seq_len"),
    ("plan {factories}:fixed --cluster local --global-batch-size 8 --dtype float32", "--dtype applies to zoo"),
    ("plan gpt-tiny --cluster local --global-batch-size 8 --profile {null}", "not the object"),
    ("show {list}", "holds a JSON list"),
    ("report {list} {list}", "holds a JSON list"),
]

CLUSTER = {"nodes": 2, "devices_per_node": 8, "device": "h100-sxm-80gb", "intra_node": "nvlink4-nvswitch",
           "inter_node": {"bandwidth_GBps": 50.0, "latency_us": 5.0}}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad")
    paths = {"tmp": str(d)}
    for name, doc in (("ok", CLUSTER), ("huge", dict(CLUSTER, nodes=10**9)), ("null", None), ("list", [1])):
        (d / f"{name}.json").write_text(json.dumps(doc))
        paths[name] = str(d / f"{name}.json")
    (d / "nan.json").write_text(json.dumps(dict(CLUSTER, inter_node={"bandwidth_GBps": float("nan"),
                                                                     "latency_us": 5.0})))
    paths["nan"] = str(d / "nan.json")
    (d / "factories.py").write_text(FACTORIES)
    paths["factories"] = str(d / "factories.py")
    (d / "f.txt").write_text("a file where a folder is expected")
    return paths


@pytest.mark.parametrize(("line", "phrase"), CASES)
def test_a_bad_command_line_prints_one_error_line_and_exits_1(files, capsys, line, phrase) -> None:
    t0 = time.perf_counter()
    assert main(line.format(**files).split()) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopar: error:"), err
    assert phrase in err[0], err[0]
    assert time.perf_counter() - t0 < 60  # refused up front: nothing here plans or measures


def test_an_internal_error_says_it_is_a_bug_and_debug_shows_the_traceback(monkeypatch, capsys) -> None:
    import autopar.cli.cmd_clusters as clusters

    def broken(args):
        raise KeyError("device")

    monkeypatch.setattr(clusters, "run", broken)
    assert main(["clusters"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "internal error: KeyError" in err[0] and "bug in autopar" in err[0], err
    assert main(["clusters", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "bug in autopar" in err


def test_the_api_raises_autopar_errors_for_wrong_arguments() -> None:
    graph = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=32, dtype=torch.float32, n_layers=1))
    local = autopar.Cluster.local(nproc=2)
    with pytest.raises(AutoparError, match="pass a Cluster"):
        autopar.plan(graph, "dgx-h100", global_batch_size=4)
    with pytest.raises(AutoparError, match="positive integer"):
        autopar.plan(graph, local, global_batch_size="4")
    with pytest.raises(AutoparError, match="top_k"):
        autopar.plan(graph, local, global_batch_size=4, options=autopar.PlannerOptions(top_k=-1))
    with pytest.raises(AutoparError, match="pass a ParallelConfig"):
        autopar.estimate(graph, local, {"dp": 2})
    with pytest.raises(ConfigError, match="ParallelConfig.tp=0"):
        autopar.ParallelConfig(tp=0)
    with pytest.raises(ValueError):  # ConfigError stays a ValueError for callers that caught that
        autopar.ParallelConfig(schedule="zigzag")
    with pytest.raises(ClusterSpecError, match="at most"):
        autopar.Cluster.preset("dgx-h100", nodes=10**7)
