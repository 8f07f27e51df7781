"""The expert banks' saved activations on each rank of a real 2-rank run, beside what the planner prices.

Transformers' Mixtral at test size (tests/hf_families.py: hidden 64, 4 experts of FFN width 32, top-2, fp32)
trains one step of autopar's runtime under each layout of one shared gloo job; on every rank
`torch.autograd.graph.saved_tensors_hooks` counts the unique storages autograd keeps while each expert bank's
call runs (the rank's bank wrapped in its dispatch and combine; parameters excluded), as
tests/test_saved_activations_real.py counts them in one process. The price is what `activation_bytes` adds
for the banks at the layout (`_priced`: the layer with and without LayerSpec.saved_activation_bytes_expert).

What each rank must keep, with b = capture's bank bytes per routed (token, slot) pair and T the micro-batch's
tokens, k = 2 slots each:

- tp2, the bank replicated over the tp pair: each rank runs all T·k pairs, b·T·k, whatever the routing;
- ep2 over dp2, ep2 folded over tp2 (each tp rank dispatches half the tokens both hold), ep2 folded under
  sequence parallelism (each tp rank's own sequence half): a rank's bank runs the pairs routed to its 2
  experts, whose number depends on the routing; the EP group's ranks together run every pair once (dropless),
  so the ranks' sum is what the planner prices at the mean share (T·k/2 pairs each). The busier rank keeps
  more by the routing's spread, which the memory price leaves out (the time price adds it:
  autopar.planner.moe_load): 7-15% here, 128 pairs a rank at random initialisation; the sampling term of a
  balanced router, 1.5% at Mixtral-8x7B's 4096 tokens a rank under ep8. The dispatch and combine add three
  int64 indices per pair the rank sends (the rows gathered, the routing weights gathered, the returned rows
  put back in slot order: `_DISPATCH_BYTES_PER_PAIR`), which the planner does not price (0.02% of b at
  Mixtral-8x7B's width in bf16);
- etp2 over tp2, with and without sequence parallelism (every tp rank runs all T·k pairs of its tp group
  through its half of each expert's FFN): routing-independent, each rank keeps the FFN-wide intermediates
  halved and the h-wide rows whole (the tokens entering the first GEMM and the expert outputs the routing
  weights multiply, 2 rows per pair), as the planner prices them; the per-pair routing weight and indices
  (20 of b = 1052 bytes here) stay whole but are priced halved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from dist_harness import run_distributed

from autopar.config import ep_folds

pytestmark = pytest.mark.multiproc

FAMILY, SEQ = "mixtral", 16
LAYOUTS = (dict(tp=2), dict(dp=2, ep=2), dict(tp=2, ep=2), dict(tp=2, ep=2, sequence_parallel=True), dict(tp=2, etp=2),
           dict(tp=2, etp=2, sequence_parallel=True))
_DISPATCH_BYTES_PER_PAIR = 3 * 8  # autopar.codegen.experts._dispatched: token, order and slot, int64 each


def _bank_saves(family: str, graph, layouts: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """On every rank, per layout: the bytes autograd keeps inside each expert bank's call during one training
    step, and the bank call's routing (its [T, k] expert choices) to count the pairs each rank runs. `graph`:
    the family's capture, made once by the caller."""
    from hf_families import build_family

    return [_one_step(build_family(family), graph, config) for config in layouts]


def _one_step(model, graph, config: dict[str, Any]) -> dict[str, Any]:
    from parity_models import batches, make_plan, optimizer
    from torch.autograd.graph import saved_tensors_hooks
    from torch.distributed.tensor import DTensor

    from autopar.codegen import lm_cross_entropy, parallelize

    def storage(t: torch.Tensor) -> torch.UntypedStorage:
        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()

    pm = parallelize(model, make_plan(graph, **config), graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
    params = {storage(p).data_ptr() for p in model.parameters()}
    inside: list[str | None] = [None]  # the bank whose call is running
    saved: dict[int, tuple[str, int]] = {}
    routing: dict[str, list] = {}

    def pre(name: str):
        def hook(_m: Any, args: tuple) -> None:
            inside[0] = name
            routing[name] = next(a for a in args if not a.is_floating_point()).tolist()
        return hook

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] is not None and (s := storage(t)).data_ptr() not in params:
            saved.setdefault(s.data_ptr(), (inside[0], s.nbytes()))
        return t

    hooks = []
    for bank in (la.moe.experts for la in graph.layers if la.moe is not None):
        module = model.get_submodule(bank)
        hooks += [module.register_forward_pre_hook(pre(bank)),
                  module.register_forward_hook(lambda *_: inside.__setitem__(0, None))]
    x, t = batches(1, seq=SEQ)[0]
    try:
        with saved_tensors_hooks(pack, lambda t: t):
            pm.train_step(pm.local_batch(x), pm.local_batch(t))
    finally:
        for h in hooks:
            h.remove()
    banks = {name: sum(n for b, n in saved.values() if b == name) for name in routing}
    return dict(saved=banks, routing=routing, mbs=pm.config.micro_batch_size)


def _priced(graph, config: dict[str, Any], mbs: int) -> dict[str, float]:
    """What the planner charges one rank for each MoE layer's banks at `config` (fp32, no recompute): the layer's
    activation bytes less those of the same layer without its bank saves."""
    from test_planner import fake_cluster

    from autopar.planner.costs import CostModel
    from autopar.planner.problem import MODES

    def strip(la):
        return dataclasses.replace(la, saved_activation_bytes=la.saved_activation_bytes
                                   - la.saved_activation_bytes_expert, saved_activation_bytes_expert=0)

    bare = dataclasses.replace(graph, layers=tuple(strip(la) if la.moe else la for la in graph.layers))
    tp, ep, etp = config.get("tp", 1), config.get("ep", 1), config.get("etp", 1)
    sp, none = config.get("sequence_parallel", False), MODES.index("none")
    out = {}
    for g in (graph, bare):
        mem = CostModel.for_cluster(g, fake_cluster(), precision="fp32").memory
        for ri, run in enumerate(mem.runs):
            for la in run:
                if la.moe is not None:
                    acts = mem.activation_bytes(ri, tp, sp, mbs, ep=ep, etp=etp)[none]
                    out[la.moe.experts] = out.get(la.moe.experts, 0.0) + (acts if g is graph else -acts)
    return out


@pytest.fixture(scope="module")
def graph():
    from hf_families import build_family
    from parity_models import graph_of

    return graph_of(FAMILY, build_family(FAMILY), SEQ)


@pytest.fixture(scope="module")
def measured(graph) -> list[list[dict[str, Any]]]:
    return run_distributed(_bank_saves, 2, FAMILY, graph, LAYOUTS, timeout_s=300)


@pytest.mark.parametrize("i", range(len(LAYOUTS)), ids=[",".join(f"{k}{v}" for k, v in c.items()).replace(
    "sequence_parallelTrue", "sp") for c in LAYOUTS])
def test_bank_saves_per_rank_are_priced(measured, graph, i: int) -> None:
    config, ranks = LAYOUTS[i], [r[i] for r in measured]
    priced = _priced(graph, config, ranks[0]["mbs"])
    moe = {la.moe.experts: la for la in graph.layers if la.moe}
    assert set(priced) == set(moe) == set(ranks[0]["saved"])
    ep = config.get("ep", 1)
    for bank, layer in moe.items():
        got = [r["saved"][bank] for r in ranks]
        if ep == 1:  # tp2, etp2: every rank runs every pair of its tp group, whatever the routing (etp2: the
            # per-pair routing weight and indices, 2% of b here, kept whole and priced halved)
            assert got == pytest.approx([priced[bank]] * 2, rel=0.02), (bank, got, priced[bank])
            continue
        # pairs each rank sends (its own tokens: half the call's rows where folded over tp without SP) and runs
        tp, sp = config.get("tp", 1), config.get("sequence_parallel", False)
        split = tp if ep_folds(tp, ep) and not sp else 1
        calls = [torch.tensor(r["routing"][bank]) for r in ranks]
        sent = [c.numel() // split for c in calls]
        pairs = torch.cat(calls[:1] if split > 1 else calls).reshape(-1)
        local = layer.moe.num_experts // ep
        run = [int((pairs // local == r).sum()) for r in range(ep)]
        per_pair = layer.saved_activation_bytes_expert / (layer.moe.tokens_per_sample * layer.moe.top_k)
        for r in range(2):  # each rank: the pairs routed to its experts, and the indices of those it sent
            assert got[r] == pytest.approx(per_pair * run[r] + _DISPATCH_BYTES_PER_PAIR * sent[r], rel=0.01)
        # dropless: the ranks together keep every pair once, what the planner prices at the mean share
        assert sum(got) - _DISPATCH_BYTES_PER_PAIR * sum(sent) == pytest.approx(2 * priced[bank], rel=1e-3)
