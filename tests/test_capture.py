"""autopar.capture on the zoo models, against independent references:
- FLOPs: Narayanan et al. 2021, eq. 3 (GPT), and the same count derived here for SwiGLU + GQA (Llama);
- parameters: sum(p.numel()) of the model;
- saved activations: Korthikanti et al. 2022, Table 2 / eq. 1 (s·b·h·(34 + 5as/h), eager attention);
- boundaries and TP patterns: what the architecture code says they are.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autopar
from autopar import CaptureError, ModelGraph
from autopar.capture import capture


def _gpt_model_flops(*, s: int, layers: int, h: int, V: int) -> float:
    """Narayanan et al. 2021, eq. 3, B = 1: 72·s·l·h²·(1 + s/(6h) + V/(12lh)) (forward + backward)."""
    return 72 * s * layers * h * h * (1 + s / (6 * h) + V / (12 * layers * h))


def _llama_model_flops(*, s: int, layers: int, h: int, a: int, kv: int, f: int, V: int) -> float:
    """The same count for a Llama block, B = 1, derived the way eq. 3 is (2 FLOPs per multiply-add):
    q and o projections 2·2sh², k and v 2·2sh·(kv·h/a), scores and attention-weighted values
    2·2s²h (causal masking not halved, as in eq. 3), SwiGLU MLP three h×f matmuls 3·2shf;
    LM head 2shV; backward is twice forward, so the total is 3× forward."""
    d = h // a
    per_layer = 4 * s * h * h + 4 * s * h * kv * d + 4 * s * s * h + 6 * s * h * f
    return 3 * (layers * per_layer + 2 * s * h * V)


@pytest.mark.parametrize("name,seq", [("gpt2-small", 1024), ("gpt3-175b", 2048)])
def test_gpt_flops_match_narayanan(name: str, seq: int) -> None:
    model, x = autopar.zoo.build(name, seq_len=seq)
    cfg = model.config
    g = capture(model, x)
    expected = _gpt_model_flops(s=seq, layers=cfg.n_layers, h=cfg.hidden_size, V=cfg.vocab_size)
    assert 3 * g.forward_flops == pytest.approx(expected, rel=0.02)
    # what the flop counter measured for backward: 2x forward for the matmuls (eager-free SDPA: flash's
    # backward also recomputes the scores, so slightly more)
    assert 2.0 <= g.backward_flops / g.forward_flops <= 2.2


def test_llama_flops_match_swiglu_gqa_formula() -> None:
    model, x = autopar.zoo.build("llama3-8b", seq_len=4096)
    c = model.config
    g = capture(model, x)
    expected = _llama_model_flops(s=4096, layers=c.n_layers, h=c.hidden_size, a=c.n_heads, kv=c.n_kv_heads,
                                  f=c.ffn_hidden_size, V=c.vocab_size)
    assert 3 * g.forward_flops == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize("name", autopar.zoo.names())
def test_params_equal_model_parameters(name: str) -> None:
    model, x = autopar.zoo.build(name, seq_len=128)
    g = capture(model, x)
    expected = sum(p.numel() for p in model.parameters())
    assert g.num_params == expected
    assert sum(layer.num_params for layer in g.layers) == expected
    assert g.param_bytes == expected * 2  # bf16 on meta


def _gpt_block(attn_impl: str, s: int, b: int) -> tuple[ModelGraph, int, int]:
    model, x = autopar.zoo.build("gpt2-small", seq_len=s, batch_size=b, n_layers=1, attn_impl=attn_impl,
                                 dropout=0.1)
    g = capture(model, x)
    return g, model.config.hidden_size, model.config.n_heads


@pytest.mark.parametrize("batch", [1, 2])
def test_saved_activations_match_korthikanti_eager(batch: int) -> None:
    s = 1024
    g, h, a = _gpt_block("eager", s, batch)
    block = g.layer("blocks.0")
    sbh = s * h  # per sample, b = 1
    assert block.saved_activation_bytes == pytest.approx(sbh * (34 + 5 * a * s / h), rel=0.10)
    # TP divides the 24 + 5as/h part (Korthikanti eq. 2); the attention core is the 5as/h part
    assert block.saved_activation_bytes_tp_sharded == pytest.approx(sbh * (24 + 5 * a * s / h), rel=0.10)
    assert block.saved_activation_bytes_attention_core == pytest.approx(sbh * 5 * a * s / h, rel=0.10)
    assert block.input_bytes == 2 * sbh  # full recompute keeps the layer input, 2sbh (bf16)


def test_saved_activations_flash_path() -> None:
    """SDPA runs as the flash kernel: no s×s tensors; it keeps q, k, v, its output and a fp32
    log-sum-exp [b, a, s], so the block saves 34·s·b·h + 4·a·s·b bytes (34 = Korthikanti's count with the
    5as/h part gone and flash's output doubling as the o_proj input)."""
    s = 1024
    g, h, a = _gpt_block("sdpa", s, 1)
    block = g.layer("blocks.0")
    expected = 34 * s * h + 4 * a * s
    assert block.saved_activation_bytes == pytest.approx(expected, rel=0.02)
    assert block.saved_activation_bytes_tp_sharded == pytest.approx(24 * s * h + 4 * a * s, rel=0.02)
    assert block.saved_activation_bytes_attention_core < 0.01 * block.saved_activation_bytes


def test_gpt_layers_boundaries_and_tp_patterns() -> None:
    s = 256
    model, x = autopar.zoo.build("gpt2-small", seq_len=s, n_layers=3)
    g = capture(model, x)
    h, V = 768, 50304
    assert [la.name for la in g.layers] == ["embed", "blocks.0", "blocks.1", "blocks.2", "ln_f", "lm_head"]
    assert [la.kind for la in g.layers] == ["embedding", "block", "block", "block", "norm", "head"]
    # a cut after any layer but the head sends the hidden state [s, h] in bf16
    assert [la.boundary_bytes for la in g.layers[:-1]] == [2 * s * h] * 5
    assert g.layers[-1].boundary_bytes == 0  # no stage follows the last layer: nothing crosses
    assert len({la.signature for la in g.layers[1:4]}) == 1
    attn, mlp = g.layer("blocks.1").tp_patterns
    qkv = ("blocks.1.attn.q_proj", "blocks.1.attn.k_proj", "blocks.1.attn.v_proj")
    assert (attn.kind, attn.column, attn.row) == ("attention", qkv, ("blocks.1.attn.o_proj",))
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (12, 12, 64)
    assert (mlp.kind, mlp.column, mlp.row) == ("mlp", ("blocks.1.mlp.fc",), ("blocks.1.mlp.proj",))
    assert attn.allreduce_bytes_per_sample == mlp.allreduce_bytes_per_sample == 2 * s * h
    (emb,) = g.layer("embed").tp_patterns
    assert (emb.kind, emb.column, emb.vocab_size) == ("embedding", ("embed.wte",), V)
    (head,) = g.layer("lm_head").tp_patterns
    assert (head.kind, head.column, head.vocab_size) == ("lm_head", ("lm_head",), V)
    block = g.layer("blocks.0")
    assert block.forward_flops_tp_sharded == pytest.approx(block.forward_flops)  # every matmul is in a pattern
    assert g.layer("lm_head").forward_flops_tp_sharded == g.layer("lm_head").forward_flops == 2 * s * h * V
    assert (g.hidden_size, g.num_attention_heads, g.num_kv_heads, g.vocab_size, g.seq_len) == (h, 12, 12, V, s)
    assert g.dtype == "bfloat16" and g.capture_method == "symbolic_trace"


def test_llama_gqa_patterns() -> None:
    model, x = autopar.zoo.build("llama3-70b", seq_len=512, n_layers=2)
    g = capture(model, x)
    attn, mlp = g.layer("layers.0").tp_patterns
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (64, 8, 128)
    assert attn.max_degree_ok(8) and not attn.max_degree_ok(16)
    assert mlp.column == ("layers.0.feed_forward.w1", "layers.0.feed_forward.w3")
    assert mlp.row == ("layers.0.feed_forward.w2",)
    assert (g.num_attention_heads, g.num_kv_heads) == (64, 8)


def test_repeated_blocks_are_measured_once() -> None:
    shallow = capture(*autopar.zoo.build("llama3-70b", seq_len=256, n_layers=2))
    deep = capture(*autopar.zoo.build("llama3-70b", seq_len=256, n_layers=80))
    # embedding, one block, norm, head: the same four measurements whatever the depth
    assert shallow.metadata["distinct_calls_measured"] == deep.metadata["distinct_calls_measured"] == 4
    assert deep.num_layers == 83
    b0, b79 = deep.layer("layers.0"), deep.layer("layers.79")
    assert (b0.forward_flops, b0.saved_activation_bytes, b0.signature) == (
        b79.forward_flops, b79.saved_activation_bytes, b79.signature)
    assert deep.forward_flops == pytest.approx(shallow.forward_flops + 78 * b0.forward_flops)


class _Skip(nn.Module):
    """x → l0 → l1 → l2 (+ l0's output): the l0 output is live across two boundaries."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.layers[0](x)
        h1 = self.layers[1](h0)
        return self.layers[2](h1) + h0


def test_boundary_liveness_counts_skip_connections() -> None:
    g = capture(_Skip(), (torch.zeros(4, 5, 8),))
    act = 5 * 8 * 4  # one [5, 8] fp32 activation per sample
    # l2's stage runs the final add itself; nothing crosses after the last layer
    assert [la.boundary_bytes for la in g.layers] == [act, 2 * act, 0]
    # what full recompute keeps: x, h0 and h1, once each (h0 is read by l1 and by the add after l2: one tensor)
    assert [la.input_bytes for la in g.layers] == [act, act, act]


class _DataDependent(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a tensor value: neither fx nor export can follow it
            return x * 2
        return x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), _DataDependent()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_untraceable_module_is_named() -> None:
    with pytest.raises(CaptureError, match=r"blocks\.1") as info:
        capture(_Net(), (torch.zeros(2, 8),))
    message = str(info.value)
    assert "symbolic_trace" in message and "export" in message and "torch.cond" in message


def test_real_weights_are_neither_used_nor_changed() -> None:
    torch.manual_seed(0)
    real, x = autopar.zoo.build("gpt-tiny", seq_len=64, device="cpu", dtype=torch.bfloat16)
    before = {k: v.clone() for k, v in real.state_dict().items()}
    meta, xm = autopar.zoo.build("gpt-tiny", seq_len=64)
    g_real, g_meta = capture(real, x), capture(meta, xm)
    assert g_real.fingerprint == g_meta.fingerprint
    after = real.state_dict()
    assert all(after[k].device.type == "cpu" and torch.equal(after[k], v) for k, v in before.items())


def test_json_round_trip_and_training_mode_restored() -> None:
    model, x = autopar.zoo.build("llama-tiny", seq_len=32)
    model.eval()
    g = capture(model, x)
    assert not model.training and not any(m.training for m in model.modules())
    again = ModelGraph.from_json(g.to_json())
    assert again == g and again.fingerprint == g.fingerprint


def test_bad_inputs_raise_capture_error() -> None:
    model, _ = autopar.zoo.build("gpt-tiny", seq_len=8)
    with pytest.raises(CaptureError, match="tuple"):
        capture(model, {"input_ids": torch.zeros(1, 8, dtype=torch.long)})
    with pytest.raises(CaptureError, match="nn.Module"):
        capture("gpt-tiny", (torch.zeros(1, 8),))  # type: ignore[arg-type]


def test_llama3_70b_capture_peak_rss_under_2gb() -> None:
    import subprocess
    import sys

    code = ("import resource, autopar; m, x = autopar.zoo.build('llama3-70b', seq_len=4096); "
            "g = autopar.capture(m, x); assert g.num_layers == 83; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) * 1024 < 2 * 2**30  # ru_maxrss is in KiB on Linux


class _ScoringLinear(nn.Linear):
    """A Linear subclass returning several tensors (PhiMoE's and Llama 4's routers do)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = super().forward(x)
        return scores, scores.softmax(-1)


class _Scored(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score, self.out = _ScoringLinear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, weights = self.score(x)
        return self.out(logits * weights)


def test_a_linear_returning_several_tensors_is_captured() -> None:
    g = capture(nn.Sequential(_Scored(), _Scored()), (torch.zeros(2, 4, 8),))
    # two 8×8 matmuls per block over 4 tokens, forward
    assert sum(la.forward_flops for la in g.layers) == pytest.approx(2 * 2 * (2 * 4 * 8 * 8), rel=0.2)
