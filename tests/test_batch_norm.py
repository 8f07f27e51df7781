"""Batch norm under data parallelism (autopar/codegen/batch_norm.py): what capture records, what the planner
charges, and that the synchronised forward is batch norm itself (one rank: equal to torch's own, outputs,
gradients and running statistics) issuing exactly the all-reduces priced. Parity of conv nets with batch
norm under dp2 and ZeRO-3 against one process on the same micro-batches: tests/test_conformance_kinds.py."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from hf_kinds import build_kind, example
from torch import nn

import autopar
from autopar import Cluster, ParallelConfig
from autopar.codegen.batch_norm import apply_sync_batch_norm, batch_norms


@pytest.fixture(scope="module")
def resnet_graph():
    model = build_kind("resnet")
    return model, autopar.capture(model, (), example("resnet"))


def test_capture_records_each_batch_norm_and_no_sequence_for_a_conv_net(resnet_graph):
    model, graph = resnet_graph
    recorded = sorted(c for la in graph.layers for c in la.batch_norm_channels)
    assert recorded == sorted(m.num_features for _, m in batch_norms(model)) and len(recorded) == 6
    assert graph.seq_len is None  # per-sample figures: images are no token sequence


def test_the_planner_charges_four_all_reduces_per_batch_norm_and_micro_batch(resnet_graph):
    _, graph = resnet_graph
    bare = dataclasses.replace(graph, layers=tuple(dataclasses.replace(la, batch_norm_channels=())
                                                   for la in graph.layers))
    cluster = Cluster.preset("dgx-h100", nodes=1)
    cfg = ParallelConfig(dp=8, micro_batch_size=32, num_microbatches=2)
    with_bn, without = (autopar.estimate(g, cluster, cfg) for g in (graph, bare))
    from autopar.planner.costs import CostModel

    comm = CostModel.for_cluster(graph, cluster).comm
    per_micro_batch = sum(2 * (comm.collective_s("all_reduce", 4 * (c + 1), 8, 8)
                               + comm.collective_s("all_reduce", 4 * c, 8, 8))
                          for la in graph.layers for c in la.batch_norm_channels)
    extra = with_bn.breakdown["tp_comm"] - without.breakdown["tp_comm"]
    assert extra == pytest.approx(cfg.num_microbatches * per_micro_batch, rel=1e-9) and extra > 0
    assert any("synchronise their statistics over the 8 data-parallel ranks" in n and "256 samples" in n
               for n in with_bn.notes)


@pytest.fixture
def one_rank_group():
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(__import__("dist_harness").free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_synchronised_batch_norm_is_batch_norm_and_issues_what_is_priced(one_rank_group, monkeypatch):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.BatchNorm2d(5, momentum=None))
    ref = copy.deepcopy(net)
    assert apply_sync_batch_norm(net, one_rank_group, dp_size=2) == 2  # dp_size > 1: the synchronised path
    issued: list[int] = []
    all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, **kw: (issued.append(t.numel()), all_reduce(t, **kw))[1])
    for _ in range(2):  # two steps: the running statistics' update rule (momentum, and cumulative for None)
        x = torch.randn(4, 3, 8, 8)
        out, want = net(x), ref(x)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        out.square().mean().backward()
        want.square().mean().backward()
    for (name, a), b in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)
    for a, b in zip(net.buffers(), ref.buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # per batch norm and step: forward (C + 1) sums with the count and C squared deviations, backward the same
    assert sorted(issued) == sorted([6, 5] * 2 * 2 * 2)
    net.eval(), ref.eval()
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(net(x), ref(x))
