"""Expert parallelism (autopar.codegen.experts): banks the runtime cannot split are refused by name, before
anything is sharded.

Its parity runs in the shared gloo jobs of tests/test_conformance_hf.py and tests/test_eight_ranks.py
(transformers' Mixtral, Qwen3-MoE,
DeepSeek-V3 with multi-head latent attention and a shared expert, GPT-OSS with biased, transposed experts):
ep2 on 2 ranks, and folded over tp2 (Parallel Folding); ep2 × edp2 (dp4), ep2 folded over tp2 (edp2), ep4
folded over tp2 × dp2 and ep2 under pp2 on 4 ranks; ep2 × pp2 × edp2 with ZeRO-3 on 8 ranks; 3 AdamW steps
against one process, losses, weights and gradients within rtol 1e-4, each bank's experts
split E / ep per rank; and experts tensor-parallel (etp2: ep2 over dp2, each expert's FFN split over the tp
pair) on all four families on 4 ranks, GPT-OSS at etp2 without EP on 2. Here, in one process: the refusals,
and the FFN split each bank's data flow shows (autopar.codegen.expert_tp).
"""

from __future__ import annotations

import pytest
import torch
from hf_families import build_family
from torch import nn

from autopar.capture.moe_spec import MoESpec
from autopar.codegen.expert_tp import FFNSplit, ffn_splits, tp_slice
from autopar.codegen.experts import check_bank
from autopar.errors import PlanMismatchError

# ---- refusals, before anything is sharded (one process) ----

def _spec(bank: str, experts: int = 4, top_k: int = 2) -> MoESpec:
    return MoESpec(experts=bank, router=None, block="", num_experts=experts, top_k=top_k, expert_params=0,
                   expert_param_bytes=0)


def test_bank_refused_when_ep_does_not_divide_the_experts():
    model = build_family("mixtral")
    bank = model.model.layers[0].mlp.experts
    with pytest.raises(PlanMismatchError, match=r"'model.layers.0.mlp.experts' holds 4 experts, which ep=3"):
        check_bank(bank, _spec("model.layers.0.mlp.experts"), 3)
    check_bank(bank, _spec("model.layers.0.mlp.experts"), 2)  # the real bank passes, in fp32 and in bf16
    check_bank(bank.to(torch.bfloat16), _spec("model.layers.0.mlp.experts"), 2)


class _LoopedExperts(nn.Module):
    """Experts as a list of modules the block loops over itself (no bank call with the routing)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))


class _NormalisingBank(nn.Module):
    """A bank that renormalises the routing weights over the slots it is given: one slot's output is then not
    that slot's share of the whole call (the tokens cannot be split by expert)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        weights = weights / weights.sum(-1, keepdim=True)
        return sum(torch.einsum("th,tho->to", x, self.w[index[:, j]]) * weights[:, j:j + 1]
                   for j in range(index.shape[1]))


class _OtherSignature(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w[0]


@pytest.mark.parametrize(("bank", "message"), [
    (_LoopedExperts().experts, r"'blk.experts' \(ModuleList\) holds a list of expert modules.*ep=1"),
    (_NormalisingBank(), r"'blk.experts'.*not the sum of the one-expert outputs.*ep=1"),
    (_OtherSignature(), r"'blk.experts' \(_OtherSignature\) cannot be called as bank\(tokens.*ep=1"),
])
def test_bank_refused_by_name(bank, message):
    with pytest.raises(PlanMismatchError, match=message):
        check_bank(bank, _spec("blk.experts"), 2)


# ---- checkpoints: expert-parallel state resharded by DCP into another layout ----

def _save_under_ep_load_without(path: str, saved_layout: dict | None = None) -> dict:
    """Train Mixtral one step under ep2 (ZeRO-1; or `saved_layout`), save; load into ep1 with ZeRO-3 (experts
    whole, every state sharded over dp instead): the full weights and the next two steps' losses (the second
    after an AdamW step on the loaded moments) must be those of the saved run."""
    from parity_models import batches, build_model, graph_of, make_plan, optimizer

    from autopar.codegen import lm_cross_entropy, parallelize

    data, out = batches(3), {}
    for name, layout in [("ep2", saved_layout or dict(dp=2, ep=2, zero_stage=1)), ("ep1", dict(dp=2, zero_stage=3))]:
        model = build_model("mixtral")
        graph = graph_of("mixtral", model)
        pm = parallelize(model, make_plan(graph, **layout), graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
        if name == "ep2":
            pm.train_step(pm.local_batch(data[0][0]), pm.local_batch(data[0][1]))
            pm.save(path)
            saved = pm.full_state_dict()
            out["split"] = sorted(pm.experts.banks)
        else:
            pm.load(path)
            full = pm.full_state_dict()
            out["max_weight_diff"] = max((full[k] - v).abs().max().item() for k, v in saved.items())
        out[f"losses_{name}"] = [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data[1:]]
    return out


@pytest.mark.multiproc
def test_expert_parallel_checkpoint_loads_into_another_layout(tmp_path):
    from dist_harness import run_distributed

    out = run_distributed(_save_under_ep_load_without, 2, str(tmp_path / "ck"))[0]
    assert out["split"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert out["max_weight_diff"] == 0.0
    assert out["losses_ep1"] == pytest.approx(out["losses_ep2"], rel=1e-5)  # weights, then moments, restored


@pytest.mark.multiproc
def test_expert_tensor_parallel_checkpoint_loads_into_another_layout(tmp_path):
    """Saved with each expert's [gate; up] halves split over tp2 (etp2: a strided shard, which DCP writes
    replicated over tp), loaded into dp2 with ZeRO-3: the same weights and next losses."""
    from dist_harness import run_distributed

    out = run_distributed(_save_under_ep_load_without, 2, str(tmp_path / "ck"), dict(tp=2, etp=2, zero_stage=1))[0]
    assert out["split"] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert out["max_weight_diff"] == 0.0
    assert out["losses_ep1"] == pytest.approx(out["losses_ep2"], rel=1e-5)


# ---- the folded layout's token split over tp (uneven shares) ----

def _split_and_gather() -> dict:
    """5 rows both ranks hold alike: rank r takes its share (3 rows, then 2), scales it by its own factor,
    and the shares are gathered back; the loss is computed alike on both ranks from the gathered rows."""
    import torch.distributed as dist

    from autopar.codegen.experts import gather_shares, take_share

    dist.init_process_group("gloo")  # from the harness's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE)
    group, rank = dist.group.WORLD, dist.get_rank()
    x = torch.arange(15.0).reshape(5, 3).requires_grad_()
    share = take_share(x, rank, group)
    y = gather_shares(share * (rank + 2.0), 5, rank, group)
    (y * torch.arange(5.0).unsqueeze(1)).sum().backward()
    return {"rows": share.shape[0], "y": y.detach(), "grad": x.grad}


@pytest.mark.multiproc
def test_token_share_split_and_gather_are_each_others_backward():
    from dist_harness import run_distributed

    out = run_distributed(_split_and_gather, 2)
    scale = torch.tensor([2.0, 2.0, 2.0, 3.0, 3.0]).unsqueeze(1)  # rank 0's rows ×2, rank 1's ×3
    x = torch.arange(15.0).reshape(5, 3)
    for r in out:  # both ranks hold the whole output and the whole input gradient, as one process would
        assert torch.equal(r["y"], x * scale)
        assert torch.equal(r["grad"], (scale * torch.arange(5.0).unsqueeze(1)).expand(5, 3))
    assert [r["rows"] for r in out] == [3, 2]


# ---- experts tensor-parallel (etp = tp): the FFN split found from the data flow, or refused by name ----

def _bank_spec(model, bank: str) -> MoESpec:
    import autopar

    graph = autopar.capture(model, (torch.zeros(1, 8, dtype=torch.long),))
    return next(la.moe for la in graph.layers if la.moe is not None and la.moe.experts == bank)


@pytest.mark.parametrize(("family", "want"), [
    # [gate; up] chunked in two along dim 1 (each half split apart), down row-parallel over its last dim
    ("mixtral", {"gate_up_proj": FFNSplit(1, halves=True), "down_proj": FFNSplit(2)}),
    # transposed, gate and up interleaved along the last dim (a block of pairs per rank), biases: the FFN one
    # split with its columns, the output one held whole (added once)
    ("gpt_oss", {"gate_up_proj": FFNSplit(2), "gate_up_proj_bias": FFNSplit(1), "down_proj": FFNSplit(1),
                 "down_proj_bias": FFNSplit(None)}),
])
def test_ffn_split_found_from_the_data_flow(family, want):
    """Which dimension of each stacked parameter is the FFN's, and how gate|up lies in it, from the bank's
    outputs alone; the tp slices' outputs sum to the whole bank's on the real weights too."""
    model = build_family(family)
    name = "model.layers.0.mlp.experts"
    bank, spec = model.get_submodule(name), _bank_spec(model, name)
    splits = ffn_splits(bank, spec, list(want), 2, 64)
    assert splits == want
    x, index, w = torch.randn(5, 64), torch.tensor([[0, 1], [2, 3], [1, 3], [0, 2], [3, 1]]), torch.rand(5, 2)
    whole = bank(x, index, w)
    held = dict(bank._parameters)
    total = torch.zeros_like(whole)
    for r in range(2):
        for n, s in splits.items():
            part = tp_slice(held[n], s, r, 2)
            bank._parameters[n] = nn.Parameter(part / 2 if s.dim is None else part)
        total += bank(x, index, w)
    bank._parameters.update(held)
    torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-6)


class _NormedFFNBank(nn.Module):
    """Experts that normalise the FFN activation over its whole width: no tp slice computes its share."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(4, 16, 8))
        self.down = nn.Parameter(torch.randn(4, 8, 16))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for j in range(index.shape[1]):
            h = torch.einsum("th,tfh->tf", x, self.up[index[:, j]])
            h = torch.nn.functional.layer_norm(h, h.shape[-1:])
            out = out + torch.einsum("tf,thf->th", h, self.down[index[:, j]]) * weights[:, j:j + 1]
        return out


def test_ffn_split_refused_by_name():
    spec = MoESpec(experts="blk.experts", router=None, block="blk", num_experts=4, top_k=2, expert_params=0,
                   expert_param_bytes=0, ffn_hidden_size=16)
    with pytest.raises(PlanMismatchError, match=r"'blk.experts' \(_NormedFFNBank\): none of .* ways of splitting "
                                                r"its FFN width 16 over tp=2.*etp=1"):
        ffn_splits(_NormedFFNBank(), spec, ["up", "down"], 2, 8)
    with pytest.raises(PlanMismatchError, match=r"'blk.experts'.*FFN width 16 cannot be split over tp=3.*etp=1"):
        ffn_splits(_NormedFFNBank(), spec, ["up", "down"], 3, 8)
