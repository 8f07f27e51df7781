"""op_sac and compiled blocks without processes: which matmuls op_sac runs again, what capture says it
keeps, how fused kernels are priced, and how the planner offers both (hand-counted references)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.capture.fusion import Step, fused_kernels, unread_save_bytes
from autopar.capture.graph import Kernel
from autopar.cluster import Cluster
from autopar.codegen.recompute import apply_recompute
from autopar.config import ParallelConfig, PlannerOptions
from autopar.planner.costs import CostModel
from autopar.planner.problem import MODES
from autopar.planner.space import Candidate

H, S = 64, 16  # gpt-tiny block: hidden 64, 4 heads, MLP 4·64, fp32


def _block():
    torch.manual_seed(0)
    model, _ = autopar.zoo.build("gpt-tiny", seq_len=S, device="cpu", dropout=0.0, n_layers=1, hidden_size=H,
                                 n_heads=4, vocab_size=128)
    return model.blocks[0]


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


def _backward_matmuls(mode: str) -> int:
    block = _block()
    apply_recompute(block, mode)
    x = torch.randn(2, S, H, requires_grad=True)
    out = block(x)
    with _CountMatmuls() as count:
        out.sum().backward()
    return count.n


def test_op_sac_runs_every_second_matmul_again() -> None:
    """A GPT block has 6 linears (q, k, v, o, fc, proj): backward runs 2 matmuls per linear (input and weight
    gradients, 12). op_sac saves the 1st, 3rd and 5th and reruns the 2nd and 4th (k, o); the 6th (proj)
    it would rerun too, but non-reentrant checkpointing stops recomputing once every tensor backward needs
    is back, and backward needs proj's input, not its output. Full recompute reruns 5 for the same reason;
    selective reruns none (the fused attention kernel is its only recomputed op here)."""
    assert _backward_matmuls("none") == 12
    assert _backward_matmuls("selective") == 12
    assert _backward_matmuls("op_sac") == 12 + 2
    assert _backward_matmuls("full") == 12 + 5
    # capture prices exactly the matmuls op_sac runs again
    g = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=S, device="meta", n_layers=1, hidden_size=H,
                                           n_heads=4, vocab_size=128, dropout=0.0))
    block = next(la for la in g.layers if la.kind == "block")
    assert sum(k.count for k in block.kernels_forward.kernels if k.kind == "gemm" and not k.op_sac_saved) == 2


def test_capture_counts_what_op_sac_keeps() -> None:
    """Per sample, bf16 (the zoo's meta dtype): the block input, q, v (the 1st and 3rd linears), the
    attention output, fc's output (4·H), S·(4·H + 4·H)·2 bytes, and the flash kernel's fp32 log-sum-exp
    (4 heads × S) and RNG seed/offset (a few bytes). Of it, all but the block input lies inside the TP
    patterns."""
    g = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=S, device="meta", n_layers=1, hidden_size=H,
                                           n_heads=4, vocab_size=128))
    block = next(la for la in g.layers if la.kind == "block")
    expect = S * (4 * H + 4 * H) * 2 + 4 * S * 4
    assert expect <= block.saved_activation_bytes_op_sac <= expect + 32
    assert block.saved_activation_bytes_op_sac < block.saved_activation_bytes
    assert block.saved_activation_bytes_op_sac - block.saved_activation_bytes_op_sac_tp_sharded == S * H * 2


def test_saves_no_backward_reads_are_found_through_recomputed_ops() -> None:
    # x → mm → a (policy-saved, read only by the residual add) → add → out; x → mm → b (policy-saved) →
    # gelu → g (recomputed; autograd saves g for the next matmul) → mm: b is read to recompute g, a by nothing
    steps = [Step(kind="gemm", reads=((1, 8),), writes=((2, 8),), kernel=None),       # a = x @ w
             Step(kind="memory", reads=((2, 8), (1, 8)), writes=((3, 8),), kernel=None),  # out = a + x
             Step(kind="gemm", reads=((1, 8),), writes=((4, 32),), kernel=None),      # b = x @ w1
             Step(kind="memory", reads=((4, 32),), writes=((5, 32),), kernel=None),   # g = gelu(b)
             Step(kind="gemm", reads=((5, 32),), writes=((6, 8),), kernel=None)]      # y = g @ w2
    policy = [8, 0, 32, 0, 0]
    assert unread_save_bytes(steps, {5, 1}, policy) == 8  # a: nothing backward reads needs it
    assert unread_save_bytes(steps, {5, 1, 2}, policy) == 0  # once autograd saves a, it stays


def test_a_compiled_op_sac_block_drops_the_down_projection_output() -> None:
    """Llama's block under op_sac saves the 7th matmul (the MLP's down projection): its output feeds only the
    residual add, whose backward reads nothing, so a compiled block (AOTAutograd saves what the backward
    graph reads) does not keep it: s·h bf16 values per sample. GPT's 4 matmuls save the 1st and 3rd, both read."""
    llama = autopar.capture(*autopar.zoo.build("llama-tiny", seq_len=16))
    block = next(la for la in llama.layers if la.kind == "block")
    assert block.saved_activation_bytes_op_sac_unread == 16 * llama.hidden_size * 2
    gpt = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=16))
    assert all(la.saved_activation_bytes_op_sac_unread == 0 for la in gpt.layers if la.kind == "block")
    costs = CostModel.for_cluster(llama, Cluster.preset("dgx-h100", nodes=1))
    ri = next(i for i, g in enumerate(costs.memory.runs) if g[0].kind == "block")
    sac = MODES.index("op_sac")
    eager, compiled = (costs.memory.activation_bytes(ri, 1, False, 2, c)[sac] for c in (False, True))
    none = MODES.index("none")
    assert compiled < eager and costs.memory.activation_bytes(ri, 1, False, 2, True)[none] == \
        costs.memory.activation_bytes(ri, 1, False, 2)[none]


def test_a_fused_chain_reads_its_inputs_and_writes_its_outputs_once() -> None:
    """x → a = gelu(x) → b = a·2 → c = b + y, then a matmul reads c: eager streams 2+2+3 tensors of n bytes
    (read x, write a; read a, write b; read b and y, write c); fused it reads x and y and writes c: 3·n."""
    n = 1000
    k = Kernel(kind="elementwise", count=1, work=2.0 * n, tensor_bytes=n)
    steps = [Step("memory", ((1, n),), ((2, n),), k), Step("memory", ((2, n),), ((3, n),), k),
             Step("memory", ((3, n), (4, n)), ((5, n),), k), Step("gemm", ((5, n), (6, n)), ((7, n),), None)]
    (fused,) = fused_kernels(steps)
    assert fused.work == 3 * n
    # a tensor saved for backward (kept) is written out even if only the chain reads it
    (kept,) = fused_kernels(steps, keep=frozenset({2}))
    assert kept.work == 4 * n


def test_compiled_blocks_are_priced_faster_and_offered_by_the_planner() -> None:
    net, x = autopar.zoo.build("llama3-8b", seq_len=2048)
    graph = autopar.capture(net, x)
    cluster = Cluster.preset("dgx-h100", nodes=1)
    costs = CostModel.for_cluster(graph, cluster)
    cand = Candidate.of(ParallelConfig(dp=8, zero_stage=3, micro_batch_size=1, num_microbatches=2))
    block = next(i for i, g in enumerate(costs.memory.runs) if g[0].kind == "block")
    eager = costs.problem(cand).runs[block]
    compiled = costs.problem(Candidate.of(ParallelConfig(dp=8, zero_stage=3, micro_batch_size=1,
                                                         num_microbatches=2, compile=True))).runs[block]
    assert compiled.compute_s[0] < eager.compute_s[0]
    # the same activations, but under op_sac the down projection's output, which no backward reads (and under
    # selective every cached output no backward reads)
    for k, c, e in zip(MODES, compiled.act_bytes, eager.act_bytes, strict=True):
        assert c < e if k in ("op_sac", "selective") else c == e
    plan = autopar.plan(graph, cluster, global_batch_size=16, options=PlannerOptions(compile=None, top_k=0))
    assert plan.config.compile  # never slower, so chosen when the planner may


def test_per_layer_recompute_round_trips_and_old_plans_load(tmp_path) -> None:
    """A stage's layer modes travel through the Plan JSON and `show`; plans written with one mode per stage
    (no layer_recompute) still load, every layer taking the stage's mode."""
    from parity_models import graph_of, make_plan

    graph = graph_of("gpt", autopar.zoo.build("gpt-tiny", seq_len=16, device="meta", n_layers=2, hidden_size=64,
                                              n_heads=4, vocab_size=128)[0])
    plan = make_plan(graph, dp=1, layer_recompute={"blocks.0": "op_sac"})
    path = tmp_path / "plan.json"
    plan.save(path)
    back = autopar.Plan.load(path)
    assert back.stages[0].layer_modes == ("none", "op_sac", "none", "none", "none")
    assert back.stages[0].recompute_of("blocks.0") == "op_sac"
    from autopar.report.text import recompute_cell
    assert recompute_cell(back.stages[0]) == "1×op_sac+4×none"
    old = back.to_dict()
    for st in old["stages"]:
        del st["layer_recompute"]
    assert autopar.Plan.from_dict(old).stages[0].layer_modes == ("none",) * 5


def test_cli_pins_op_sac_and_compiled_blocks_or_lets_the_planner_choose(tmp_path) -> None:
    from autopar.cli.main import main

    base = ["plan", "gpt-tiny", "--cluster", "dgx-h100", "--global-batch-size", "16", "--seq-len", "128"]
    assert main([*base, "--recompute", "op_sac", "--compile", "--out", str(tmp_path / "a.json")]) == 0
    a = autopar.Plan.load(tmp_path / "a.json")
    assert a.config.compile and {k for s in a.stages for k in s.layer_modes} == {"op_sac"}
    assert main([*base, "--compile", "auto", "--out", str(tmp_path / "b.json")]) == 0
    assert autopar.Plan.load(tmp_path / "b.json").config.compile  # compiled blocks are never priced slower
    assert main([*base, "--out", str(tmp_path / "c.json")]) == 0
    assert not autopar.Plan.load(tmp_path / "c.json").config.compile  # eager unless asked


def test_graphs_captured_before_op_sac_still_plan() -> None:
    """A graph JSON without the op_sac and fusion fields loads; op_sac is priced as none's memory with full's
    time there (never better than either, so never chosen) and compiled blocks as eager."""
    from autopar.capture.graph import ModelGraph

    g = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=S, device="meta", n_layers=2, hidden_size=H,
                                           n_heads=4, vocab_size=128))
    d = g.to_dict()
    for la in d["layers"]:
        del la["saved_activation_bytes_op_sac"], la["saved_activation_bytes_op_sac_tp_sharded"]
        for mix in ("kernels_forward", "kernels_backward"):
            del la[mix]["fused"]
            for k in la[mix]["kernels"]:
                del k["op_sac_saved"]
    old = ModelGraph.from_dict(d)
    costs = CostModel.for_cluster(old, Cluster.preset("dgx-h100", nodes=1))
    runs = costs.problem(Candidate.of(ParallelConfig(dp=8))).runs
    run = next(r for r, grp in zip(runs, costs.memory.runs, strict=True) if grp[0].kind == "block")
    op_sac, full, none = (MODES.index(k) for k in ("op_sac", "full", "none"))
    assert run.time_s[op_sac] == run.time_s[full] and run.act_bytes[op_sac] == run.act_bytes[none]
    eager = costs.problem(Candidate.of(ParallelConfig(dp=8))).runs
    compiled = costs.problem(Candidate.of(ParallelConfig(dp=8, compile=True))).runs
    assert [r.time_s for r in eager] == [r.time_s for r in compiled]
