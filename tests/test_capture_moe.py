"""Capture of mixture-of-experts layers on meta tensors: the grouped GEMM in any dtype, the MoE found in
each layer (experts, top-k, FFN width, shared experts, router), expert FLOPs against the formula."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import autopar
from autopar.capture.graph import ModelGraph
from autopar.capture.moe import DEFAULT_LOAD_IMBALANCE, grouped_mm_any_dtype

transformers = pytest.importorskip("transformers")

S, B, H, FFN, E, K = 16, 2, 64, 32, 4, 2


def _tiny(name: str) -> nn.Module:
    hf = transformers
    c = dict(vocab_size=128, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
    if name == "mixtral":
        cfg = hf.MixtralConfig(**{**c, "intermediate_size": FFN}, num_local_experts=E, num_experts_per_tok=K)
        cls = hf.MixtralForCausalLM
    elif name == "qwen3_moe":
        cfg = hf.Qwen3MoeConfig(**c, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FFN, head_dim=16)
        cls = hf.Qwen3MoeForCausalLM
    elif name == "qwen2_moe":
        cfg = hf.Qwen2MoeConfig(**c, num_experts=E, num_experts_per_tok=K, moe_intermediate_size=FFN,
                                shared_expert_intermediate_size=48)
        cls = hf.Qwen2MoeForCausalLM
    elif name == "deepseek_v3":  # MLA, one shared expert, the first layer dense
        cfg = hf.DeepseekV3Config(**{**c, "num_key_value_heads": 4}, n_routed_experts=E, num_experts_per_tok=K,
                                  moe_intermediate_size=FFN, n_shared_experts=1, first_k_dense_replace=1,
                                  kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                  v_head_dim=16, n_group=2, topk_group=1)
        cls = hf.DeepseekV3ForCausalLM
    elif name == "phimoe":  # routes by sparsemixer (repeated max, Gumbel sampling): no topk anywhere
        cfg = hf.PhimoeConfig(**{**c, "intermediate_size": FFN}, num_local_experts=E, num_experts_per_tok=K)
        cls = hf.PhimoeForCausalLM
    else:  # gpt_oss: transposed, interleaved gate|up with biases
        cfg = hf.GptOssConfig(**{**c, "intermediate_size": FFN}, num_local_experts=E, num_experts_per_tok=K,
                              head_dim=16, sliding_window=8)
        cls = hf.GptOssForCausalLM
    with torch.device("meta"):
        return cls(cfg)


@pytest.fixture(scope="module")
def graphs() -> dict[str, tuple[nn.Module, ModelGraph]]:
    out = {}
    for name in ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "phimoe"):
        model = _tiny(name)
        out[name] = model, autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),))
    return out


@pytest.mark.parametrize("a_shape,b_shape,offs", [
    ((12, 8), (3, 8, 4), [4, 8, 12]),      # tokens grouped by expert × stacked weights (forward)
    ((8, 12), (12, 4), [4, 8, 12]),        # a weight gradient: one [8, 4] per group
    ((3, 4, 8), (8, 12), [4, 8, 12]),      # columns grouped
    ((3, 4, 8), (3, 8, 4), None),          # batched
])
def test_grouped_mm_meta_matches_cpu_in_any_dtype(a_shape, b_shape, offs) -> None:
    """Meta shapes equal the CPU kernel's output; FLOPs are 2·m·k·n summed over the groups (by hand)."""
    a, b = torch.randn(a_shape), torch.randn(b_shape)
    o = torch.tensor(offs, dtype=torch.int32) if offs is not None else None
    ref = torch._grouped_mm(a, b, offs=o)
    bounds = [0, *offs] if offs is not None else None
    if len(a_shape) == 2 and len(b_shape) == 3:
        flops = sum(2 * (hi - lo) * a_shape[1] * b_shape[2] for lo, hi in zip(bounds, bounds[1:], strict=False))
    elif len(a_shape) == 2:
        flops = sum(2 * a_shape[0] * (hi - lo) * b_shape[1] for lo, hi in zip(bounds, bounds[1:], strict=False))
    elif len(b_shape) == 2:
        flops = sum(2 * a_shape[1] * a_shape[2] * (hi - lo) for lo, hi in zip(bounds, bounds[1:], strict=False))
    else:
        flops = 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        counter = FlopCounterMode(display=False)
        with grouped_mm_any_dtype(), counter:
            out = torch._grouped_mm(a.to("meta", dtype), b.to("meta", dtype),
                                    offs=o.to("meta") if o is not None else None)
        assert out.shape == ref.shape and out.dtype == dtype
        assert counter.get_total_flops() == flops


@pytest.mark.parametrize("name,ffn,shared,router", [
    ("mixtral", FFN, 0, "mlp.gate"),
    ("qwen2_moe", FFN, 3 * 48 * H + H, "mlp.gate"),   # shared expert (gated FFN of 48) and its 1-output gate
    ("deepseek_v3", FFN, 3 * FFN * H, "mlp.gate"),    # one shared expert of the experts' width
    ("gpt_oss", FFN, 0, "mlp.router"),
    ("phimoe", FFN, 0, "mlp.router"),  # found by the bank's call with the chosen experts [T, k]
])
def test_moe_found_from_structure(graphs, name: str, ffn: int, shared: int, router: str) -> None:
    model, g = graphs[name]
    blocks = [la for la in g.layers if la.kind == "block"]
    moe_blocks = [la for la in blocks if la.moe is not None]
    assert len(moe_blocks) == (1 if name == "deepseek_v3" else 2)  # DeepSeek's first layer is dense
    for la in moe_blocks:
        m = la.moe
        bank = model.get_submodule(m.experts)
        assert (m.num_experts, m.top_k, m.ffn_hidden_size, m.shared_params) == (E, K, ffn, shared)
        assert m.router == f"{la.name}.{router}" and m.block == f"{la.name}.mlp"
        assert m.expert_params == sum(p.numel() for p in bank.parameters())
        assert m.expert_param_bytes == 4 * m.expert_params
        assert m.dispatch_bytes_per_sample == S * K * H * 4
        assert m.load_imbalance == DEFAULT_LOAD_IMBALANCE
    assert g.expert_params == sum(la.moe.expert_params for la in moe_blocks)
    assert g.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,matrices", [("mixtral", 3), ("deepseek_v3", 3), ("gpt_oss", 3), ("phimoe", 3)])
def test_expert_flops_at_routed_tokens(graphs, name: str, matrices: int) -> None:
    """Each token goes to k experts: the grouped GEMMs do 2·s·k·(3·ffn·h) FLOPs per sample forward (gate, up,
    down of one expert per routed copy), twice that backward; one launch over the E experts each."""
    _, g = graphs[name]
    la = next(la for la in g.layers if la.moe is not None)
    fwd = [k for k in la.kernels_forward.kernels if k.expert]
    bwd = [k for k in la.kernels_backward.kernels if k.expert]
    expected = 2 * S * K * matrices * FFN * H
    assert sum(k.work * k.count for k in fwd) == pytest.approx(expected)
    assert sum(k.work * k.count for k in bwd) == pytest.approx(2 * expected)
    assert all(k.groups == E and k.kind == "gemm" for k in fwd + bwd)


def test_moe_capture_in_fp16(graphs) -> None:
    """The grouped GEMM's meta kernel is bf16-only on CUDA; capture runs the model in its own dtype
    (fp32 in the fixture, fp16 here: the grouped GEMMs of 16-bit tokens and weights)."""
    model = _tiny("qwen3_moe").to(torch.float16)
    g = autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),))
    la = next(la for la in g.layers if la.moe is not None)
    assert g.dtype == "float16" and la.moe.expert_param_bytes == 2 * la.moe.expert_params
    assert la.moe.dispatch_bytes_per_sample == S * K * H * 2 and la.moe.ffn_hidden_size == FFN


class _UserMoE(nn.Module):
    """A mixture of experts written by hand (not transformers): a linear router, top-2 of 6 experts,
    tokens sorted by expert and multiplied by stacked weights with torch._grouped_mm."""

    def __init__(self, h: int = 32, f: int = 48, e: int = 6, groups: int = 1, open_groups: int = 1) -> None:
        super().__init__()
        self.score = nn.Linear(h, e, bias=False)
        self.w_in = nn.Parameter(torch.randn(e, h, f) * 0.02)
        self.w_out = nn.Parameter(torch.randn(e, f, h) * 0.02)
        self.k, self.e, self.groups, self.open_groups = 2, e, groups, open_groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = self.score(flat).softmax(-1)
        if self.open_groups < self.groups:  # group-limited: the best expert of each group ranks the groups
            best = probs.view(-1, self.groups, self.e // self.groups).amax(-1)
            keep = torch.zeros_like(best).scatter(1, torch.topk(best, self.open_groups, dim=-1).indices, 1.0)
            probs = probs * keep.repeat_interleave(self.e // self.groups, dim=-1)
        weights, idx = torch.topk(probs, self.k, dim=-1)
        order = idx.reshape(-1).argsort()
        rows = flat[order // self.k]
        counts = torch.histc(idx.reshape(-1).float(), bins=self.e, min=0, max=self.e - 1)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        y = torch._grouped_mm(torch.relu(torch._grouped_mm(rows, self.w_in, offs=offs)), self.w_out, offs=offs)
        y = y * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add(0, order // self.k, y).reshape(x.shape)


class _UserModel(nn.Module):
    def __init__(self, **moe: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.LayerNorm(32), _UserMoE(**moe)) for _ in range(2)])
        self.head = nn.Linear(32, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def test_user_moe_found_without_family_names() -> None:
    g = autopar.capture(_UserModel(), (torch.zeros(2, 8, dtype=torch.long),))
    moes = [la.moe for la in g.layers if la.moe is not None]
    assert [m.experts for m in moes] == ["blocks.0.1", "blocks.1.1"] == [m.block for m in moes]
    m = moes[0]
    assert (m.num_experts, m.top_k, m.ffn_hidden_size, m.router) == (6, 2, 48, "blocks.0.1.score")
    assert m.shared_params == 0 and m.dispatch_bytes_per_sample == 8 * 2 * 32 * 4
    assert m.expert_params == 2 * 6 * 32 * 48


def test_group_limited_routing_found_from_the_data_flow(graphs) -> None:
    """A router that opens m of G expert groups to each token is found from its top-m over G groups on the
    tokens it routes: transformers' DeepseekV3 (n_group=2, topk_group=1: a top-2 inside each group, then a
    top-1 of 2 groups) and a hand-written router (best expert per group, top-2 of 3 groups of 4) alike;
    routers open to every expert keep the default, and graphs round-trip through JSON."""
    assert {(la.moe.route_groups, la.moe.route_group_top_k)
            for la in graphs["deepseek_v3"][1].layers if la.moe} == {(2, 1)}
    for name in ("mixtral", "qwen2_moe", "gpt_oss", "phimoe"):
        assert {(la.moe.route_groups, la.moe.route_group_top_k, la.moe.group_limited)
                for la in graphs[name][1].layers if la.moe} == {(1, 1, False)}
    g = autopar.capture(_UserModel(e=12, groups=3, open_groups=2), (torch.zeros(2, 8, dtype=torch.long),))
    assert {(la.moe.route_groups, la.moe.route_group_top_k) for la in g.layers if la.moe} == {(3, 2)}
    assert ModelGraph.from_json(g.to_json()).fingerprint == g.fingerprint
    open_all = autopar.capture(_UserModel(e=12), (torch.zeros(2, 8, dtype=torch.long),))
    assert {la.moe.group_limited for la in open_all.layers if la.moe} == {False}
    spec = next(la.moe for la in g.layers if la.moe)
    with pytest.raises(ValueError, match="route_group_top_k"):
        dataclasses.replace(spec, route_groups=5)  # 5 groups do not split 12 experts
    with pytest.raises(ValueError, match="route_group_top_k"):
        dataclasses.replace(spec, route_groups=12, route_group_top_k=1)  # one open expert for a top-2
    assert not dataclasses.replace(spec, route_groups=6, route_group_top_k=6).group_limited


@pytest.mark.parametrize("family,extra", [
    ("DeepseekV2", dict(topk_method="group_limited_greedy", kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=8)),
    ("Glm4Moe", {}),
    ("Dots1", dict(n_shared_experts=1)),
])
def test_group_limited_routing_in_other_families(family: str, extra: dict) -> None:
    """The routers of DeepSeek-V2 (device-limited), GLM-4-MoE and dots.llm1, each its own code, open 2 of 4
    groups of 2 experts: found by the same data flow as DeepSeek-V3's."""
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=128, hidden_size=H, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=FFN, n_group=4,
        topk_group=2, first_k_dense_replace=0, **extra)
    with torch.device("meta"):
        model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    g = autopar.capture(model, (torch.zeros(1, S, dtype=torch.long, device="meta"),))
    assert {(la.moe.num_experts, la.moe.route_groups, la.moe.route_group_top_k) for la in g.layers if la.moe} == {
        (8, 4, 2)}


def test_mla_attention_runs_the_causal_kernel() -> None:
    """MLA's value heads may be narrower than its query and key heads (8 against 8 + 8 here; 128 against 192 in
    DeepSeek-V3): the attention is captured as the causal fused kernel training runs, with FLOPs of
    2·s²·(d_qk + d_v) per head and sample (it used to fall back to a pass on fake tensors, where transformers
    builds an explicit s×s mask: a kernel over the full score matrix)."""
    cfg = transformers.DeepseekV3Config(vocab_size=128, hidden_size=H, intermediate_size=96, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                                        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
    with torch.device("meta"):
        model = transformers.DeepseekV3ForCausalLM(cfg)
    g = autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),))
    kernels = [k for la in g.layers for k in la.kernels_forward.kernels if k.kind == "attention"]
    assert kernels and all(k.causal for k in kernels)
    assert kernels[0].work == pytest.approx(2 * S * S * 4 * (16 + 8))


def test_load_imbalance_settable_and_checked(graphs) -> None:
    _, g = graphs["mixtral"]
    g2 = g.with_moe_load_imbalance(1.1)
    assert {la.moe.load_imbalance for la in g2.layers if la.moe} == {1.1}
    assert g2.fingerprint != g.fingerprint
    back = ModelGraph.from_json(g2.to_json())
    assert back == g2 and back.fingerprint == g2.fingerprint
    with pytest.raises(ValueError, match="load_imbalance"):
        g.with_moe_load_imbalance(0.5)
    with pytest.raises(ValueError, match="num_experts / top_k"):
        g.with_moe_load_imbalance(E / K + 1)
    dense, _ = autopar.zoo.build("gpt-tiny", seq_len=8)
    with pytest.raises(ValueError, match="no mixture-of-experts"):
        autopar.capture(dense, _).with_moe_load_imbalance(1.2)


def test_active_params_of_full_mixtral() -> None:
    """Mixtral-8x7B (transformers' default config): 46.7B parameters, 12.9B of them used per token (Jiang et
    al. 2024, "Mixtral of Experts", §2), the N of the 6·N·tokens MFU baselines of MoE runs."""
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig()).to(torch.bfloat16)
    g = autopar.capture(model, (torch.zeros(1, 64, dtype=torch.long, device="meta"),))
    assert g.num_params / 1e9 == pytest.approx(46.7, abs=0.05)
    assert g.active_params / 1e9 == pytest.approx(12.9, abs=0.05)


@pytest.mark.parametrize("config_cls,model_cls,extra,block,router", [
    # its forward takes the KV-cache flag only through **kwargs while its config turns the cache on: captured
    # without the cache a training step never builds (capture.targets.training_forward_kwargs)
    ("GraniteMoeConfig", "GraniteMoeForCausalLM", {}, "block_sparse_moe", "router"),
    # lightning (linear) attention on one of its two layers: ops whose inputs repeat a tensor, compared by identity
    ("MiniMaxConfig", "MiniMaxForCausalLM", {"head_dim": 16}, "mlp", "gate"),
])
def test_more_moe_families_capture(config_cls, model_cls, extra, block, router) -> None:
    hf = transformers
    cfg = getattr(hf, config_cls)(vocab_size=128, hidden_size=H, intermediate_size=FFN, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  num_local_experts=E, num_experts_per_tok=K, **extra)
    assert cfg.use_cache
    with torch.device("meta"):
        model = getattr(hf, model_cls)(cfg)
    g = autopar.capture(model, (torch.zeros(B, S, dtype=torch.long, device="meta"),))
    moes = [la for la in g.layers if la.moe is not None]
    assert [la.name for la in moes] == ["model.layers.0", "model.layers.1"]
    for la in moes:
        m = la.moe
        assert (m.num_experts, m.top_k, m.ffn_hidden_size) == (E, K, FFN)
        assert (m.block, m.router) == (f"{la.name}.{block}", f"{la.name}.{block}.{router}")
        assert m.expert_params == sum(p.numel() for p in model.get_submodule(m.experts).parameters())
