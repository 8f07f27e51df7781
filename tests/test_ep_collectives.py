"""The expert-parallel collectives the runtime issues, counted and sized, against what the planner prices.

autopar.planner.comm_costs (`ep_collective_bytes`) prices a mixture-of-experts layer under expert
parallelism as two all-to-alls of the routed token copies forward (dispatch, combine) and two backward, each
rank sending
`MoESpec.dispatch_bytes_per_sample` × its samples × `moe_token_share` (÷ tp when the tokens are split over
tp), plus, folded over tp without sequence parallelism, an all-gather of the combined outputs over tp in each
direction. Here one training step of transformers' Mixtral runs on two gloo ranks under
`torch.distributed.tensor.debug.CommDebugMode` (torch's own tally of the c10d ops) and a dispatch mode that
records each collective's buffer: the hidden-row all-to-alls and all-gathers must be exactly the priced ones,
in count and in bytes, and the routing metadata beside them (token counts, routing weights, expert ids) small.
With the experts tensor-parallel (etp = tp) the tp collectives around the bank (autopar.codegen.expert_tp)
are recorded as the runtime issues them and set against `etp_collectives`, without and with SP.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.multiproc

CASES = (dict(dp=2, ep=2),  # experts over the data-parallel pair
         dict(tp=2, ep=2, sequence_parallel=True),  # folded over tp, each rank its sequence shard
         dict(tp=2, ep=2))  # folded over tp without SP: the tokens split over tp, the outputs all-gathered


class _SendBuffers(TorchDispatchMode):
    """Records each all-to-all's send buffer (bytes, row width, dtype) and each all-gather's gathered output
    (bytes, row width), by phase."""

    def __init__(self) -> None:
        super().__init__()
        self.all_to_all: list[tuple[str, int, int, torch.dtype]] = []
        self.all_gathers: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
        if func is torch.ops.c10d.alltoall_base_.default:
            send = args[1]
            width = send.shape[1] if send.dim() > 1 else 1
            self.all_to_all.append((phase, send.numel() * send.element_size(), width, send.dtype))
        elif func in (torch.ops.c10d.allgather_.default, torch.ops.c10d._allgather_base_.default):
            listed = func is torch.ops.c10d.allgather_.default  # a list of outputs, else one flat one
            sent = args[1][0] if listed else args[1]
            group_size = len(args[0][0]) if listed else args[0].shape[0] // sent.shape[0]
            width = sent.shape[1] if sent.dim() > 1 else 1
            self.all_gathers.append((phase, sent.numel() * sent.element_size() * group_size, width))
        return func(*args, **(kwargs or {}))


def _one_step(cases: tuple[dict, ...]) -> list[dict]:
    """In every rank: one training step per case, its collectives recorded, beside the planner's bytes."""
    from parity_models import batches, build_model, graph_of, make_plan, optimizer
    from torch.distributed.tensor.debug import CommDebugMode

    from autopar.codegen import lm_cross_entropy, parallelize
    from autopar.planner.comm_costs import ep_collective_bytes

    out, graph = [], None
    for config in cases:
        model = build_model("mixtral")
        graph = graph or graph_of("mixtral", model)  # the same model each time: captured once
        plan = make_plan(graph, **config)
        pm = parallelize(model, plan, graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
        (x, t), = batches(1)
        x, t = pm.local_batch(x), pm.local_batch(t)
        comm, sends = CommDebugMode(), _SendBuffers()
        with comm, sends:
            pm.train_step(x, t)
        counts = {str(op): n for op, n in comm.get_comm_counts().items()}
        cfg = plan.config
        moe = [la.moe for la in graph.layers if la.moe is not None]
        send, gathered = ep_collective_bytes(moe[0], cfg.tp, cfg.sequence_parallel, cfg.ep, cfg.micro_batch_size)
        out.append({"counts": counts, "sends": sends.all_to_all, "all_gathers": sends.all_gathers,
                    "moe_layers": len(moe), "hidden": model.config.hidden_size,
                    "priced_bytes": send, "priced_gather_bytes": gathered})
    return out


def test_expert_parallel_collectives_are_the_priced_ones():
    per_rank = run_distributed(_one_step, 2, CASES)
    for i, config in enumerate(CASES):
        for rank, results in enumerate(per_rank):
            r = results[i]
            layers, hidden = r["moe_layers"], r["hidden"]
            assert layers > 0
            assert r["counts"].get("c10d.alltoall_base_", 0) == len(r["sends"]), (config, r["counts"])
            rows = [s for s in r["sends"] if s[2] == hidden and s[3].is_floating_point]
            meta = [s for s in r["sends"] if not (s[2] == hidden and s[3].is_floating_point)]
            fwd = [b for p, b, _, _ in rows if p == "forward"]
            bwd = [b for p, b, _, _ in rows if p == "backward"]
            # dispatch + combine per MoE layer in each direction, as comm_costs prices them
            assert len(fwd) == len(bwd) == 2 * layers, (config, rank, fwd, bwd)
            # each dispatch sends every routed copy of this rank's tokens, the priced bytes exactly; the combine
            # sends back the copies this rank received; backward runs them reversed, the layers last to first
            assert fwd[0::2] == bwd[0::2] == [r["priced_bytes"]] * layers, (config, rank, fwd, bwd)
            assert fwd[1::2] == bwd[1::2][::-1], (config, rank, fwd, bwd)
            # the routing metadata beside them, per layer: the token counts, routing weights and expert ids forward,
            # the weights' gradient backward; a few bytes per routed copy against hidden · 4 (unpriced: their
            # latency is one all-to-all's α each, their bytes an eighth of the rows' here and less at real widths)
            assert len(meta) == 4 * layers, (config, rank, meta)
            assert sum(b for _, b, _, _ in meta) < sum(b for _, b, _, _ in rows) / 8, (config, meta)
            # folded without SP the tp ranks split the tokens they all hold: the combined outputs all-gathered
            # over tp forward and the tokens' gradients backward, the priced bytes exactly (plus, backward, the
            # routing weights' gradients, top_k wide); otherwise no all-gather at all
            gathers = [(p, b) for p, b, w in r["all_gathers"] if w == hidden]
            priced = r["priced_gather_bytes"]
            assert gathers == ([("forward", priced)] * layers + [("backward", priced)] * layers if priced else []), \
                (config, rank, r["all_gathers"])
            assert len(r["all_gathers"]) == (3 * layers if priced else 0), (config, rank, r["all_gathers"])
        # every copy dispatched is received once: over the ranks, the combines send what the dispatches sent
        rows = [[b for p, b, w, d in res[i]["sends"] if p == "forward" and w == res[i]["hidden"]
                 and d.is_floating_point] for res in per_rank]
        assert sum(sum(f[1::2]) for f in rows) == sum(sum(f[0::2]) for f in rows), (config, rows)


# ---- experts tensor-parallel (etp = tp): the tp collectives around the bank, as autopar.codegen.expert_tp
# issues them, against comm_costs.etp_collectives ----

ETP_CASES = (dict(tp=2, etp=2), dict(tp=2, etp=2, sequence_parallel=True))


class _Recorded:
    """torch.distributed as expert_tp sees it, each collective recorded as (phase, op, bytes): an all-reduce
    its tensor, an all-gather its gathered output, a reduce-scatter its input."""

    def __init__(self, real, calls: list) -> None:
        self._real, self._calls = real, calls

    def __getattr__(self, name: str):
        fn = getattr(self._real, name)
        if name not in ("all_reduce", "all_gather", "reduce_scatter_tensor"):
            return fn

        def recorded(*args, **kwargs):
            phase = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            t = args[1] if name != "all_reduce" else args[0]
            n = t.numel() * t.element_size()
            if name == "all_gather":
                n *= len(args[0])
            if not (name == "all_gather" and t.numel() == 1):  # the row counts exchanged first: metadata
                self._calls.append((phase, name, n))
            return fn(*args, **kwargs)

        return recorded


def _etp_step(cases: tuple[dict, ...]) -> list[dict]:
    """In every rank: one training step per case, expert_tp's collectives recorded, beside the priced ones."""
    from parity_models import batches, build_model, graph_of, make_plan, optimizer

    import autopar.codegen.expert_tp as expert_tp
    from autopar.codegen import lm_cross_entropy, parallelize
    from autopar.planner.comm_costs import etp_collectives

    out, graph = [], None
    for config in cases:
        model = build_model("mixtral")
        graph = graph or graph_of("mixtral", model)
        plan = make_plan(graph, **config)
        pm = parallelize(model, plan, graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
        (x, t), = batches(1)
        calls: list = []
        real, expert_tp.dist = expert_tp.dist, _Recorded(expert_tp.dist, calls)
        try:
            pm.train_step(pm.local_batch(x), pm.local_batch(t))
        finally:
            expert_tp.dist = real
        cfg = plan.config
        moe = [la.moe for la in graph.layers if la.moe is not None]
        priced = etp_collectives(moe[0], cfg.micro_batch_size, cfg.sequence_parallel, model.config.hidden_size)
        out.append({"calls": calls, "layers": len(moe), "priced": list(priced)})
    return out


def test_expert_tensor_parallel_collectives_are_the_priced_ones():
    """Per MoE layer, forward and backward, the runtime's tp collectives are the priced ones in op and bytes
    (gloo has no reduce-scatter: the runtime all-reduces the same input and keeps its rows)."""
    from collections import Counter

    per_rank = run_distributed(_etp_step, 2, ETP_CASES)
    for i, config in enumerate(ETP_CASES):
        for results in per_rank:
            r = results[i]
            want = Counter({(p, "all_reduce" if op == "reduce_scatter" else op, int(n)): k * r["layers"]
                            for (p, op, n), k in Counter(r["priced"]).items()})
            got = Counter((p, {"reduce_scatter_tensor": "all_reduce"}.get(op, op), n) for p, op, n in r["calls"])
            assert got == want, (config, got, want)
