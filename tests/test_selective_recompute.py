"""Selective recompute's price against what torch's selective checkpointing really caches on a real block.

A transformers LlamaDecoderLayer (hidden 64, 4 query and 2 key/value heads, SwiGLU ffn 176, fp32) runs forward on
the CPU under autopar's selective policy (codegen.recompute); torch's MemTracker follows every storage the
forward leaves alive (independent of capture's probe). The policy caches every op's output outside the
attention core, read by backward or not, and a cached view keeps its base alive. With fused attention (SDPA)
that is, per token, in elements (h = 64, kv = 32 the key/value width, f = 176):
  input norm  pow, x·rsqrt, output (3 h) and mean, +eps, rsqrt (3)
  projections q, k, v (h + 2 kv); rotary on q: q·cos, −half, cat, ·sin, sum (4.5 h); on k alike (4.5 kv)
  attention   its output's reshape keeps the recomputed SDPA output (h); o_proj (h); residual add (h)
  post norm   3 h + 3; SwiGLU gate, silu, up, product (4 f); down_proj (h)
= 15.5 h + 6.5 kv + 6 + 4 f, beside the block's inputs (hidden states, rotary cos and sin, positions); its
output is charged to the layer that reads it. "none" keeps less than that (11.3 MB against 15.6 MB at 2,048
tokens): the policy saves what backward never reads.
"""

from __future__ import annotations

import pytest
import torch

from autopar.capture.probe import measure_call
from autopar.capture.tensors import ModelState, tensor_bytes
from autopar.codegen.recompute import apply_recompute

pytest.importorskip("transformers")

H, KV, F = 64, 32, 176


def _block(impl: str, seq: int, device: str):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=H, intermediate_size=F, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=512, attn_implementation=impl)
    with torch.device(device):
        torch.manual_seed(0)
        layer, rotary = LlamaDecoderLayer(cfg, 0), LlamaRotaryEmbedding(cfg)
        x = torch.randn(1, seq, H, requires_grad=True)
        positions = torch.arange(seq)[None]
    with torch.no_grad():
        cos_sin = rotary(x, positions)
    mask = None
    if impl == "eager":  # eager attention takes the causal mask as an additive bias
        mask = torch.full((seq, seq), float("-inf"), device=device).triu(1)[None, None]
    return layer, (x,), dict(position_embeddings=cos_sin, attention_mask=mask, position_ids=positions)


def _measured_selective_bytes(impl: str, seq: int) -> int:
    """Bytes the forward leaves alive under selective recompute, beyond its output, plus its inputs."""
    from torch.distributed._tools.mem_tracker import MemTracker

    layer, args, kwargs = _block(impl, seq, "cpu")
    apply_recompute(layer, "selective")
    tracker = MemTracker()
    tracker.track_external(layer)
    inputs = tensor_bytes([t for t in (*args, *kwargs.values()) if t is not None])
    with tracker:
        before = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        out = layer(*args, **kwargs)
        after = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
        out = out[0] if isinstance(out, tuple) else out
    # the inputs were allocated outside the tracker: the first op reading one registers its storage
    alive = sum(v - before.get(k, 0) for k, v in after.items() if str(k).endswith("ACT"))
    first_seen = tensor_bytes([args[0], *kwargs["position_embeddings"]])
    return alive - first_seen - out.numel() * out.element_size() + inputs


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_capture_prices_what_selective_caches(impl: str) -> None:
    seq = 128
    layer, args, kwargs = _block(impl, seq, "meta")
    priced = measure_call(layer, args, kwargs, ModelState(layer)).saved_bytes_selective
    assert priced == _measured_selective_bytes(impl, seq)


def test_selective_cache_hand_count() -> None:
    seq = 128
    layer, args, kwargs = _block("sdpa", seq, "meta")
    stats = measure_call(layer, args, kwargs, ModelState(layer))
    inputs = 4 * seq * (H + 2 * 16) + 8 * seq  # hidden states, cos and sin (head_dim 16), int64 positions
    assert stats.saved_bytes_selective == inputs + 4 * seq * (15.5 * H + 6.5 * KV + 6 + 4 * F)
    assert stats.saved_bytes_selective > stats.saved_bytes  # fused attention: more than none keeps


def test_megatron_runtime_prices_selective_as_none_less_the_core() -> None:
    # autopar's runtime keeps torch's selective-checkpoint cache (the captured figure); Megatron-LM's selective
    # recompute checkpoints the attention core alone: none's bytes less the core (Korthikanti et al. 2022 §5)
    import autopar
    from autopar.planner.costs import CostModel
    from autopar.planner.problem import MODES

    graph = autopar.capture(*autopar.zoo.build("gpt-tiny", seq_len=64, attn_impl="eager"))
    cluster = autopar.Cluster.preset("dgx-a100-80gb", nodes=1)
    ours = CostModel.for_cluster(graph, cluster).memory
    megatron = CostModel.for_cluster(graph, cluster, pipeline_runtime="megatron").memory
    ri = next(i for i, run in enumerate(ours.runs) if run[0].kind == "block")
    layer = ours.runs[ri][0]
    assert layer.saved_activation_bytes_selective is not None
    sel, none = MODES.index("selective"), MODES.index("none")
    theirs = megatron.activation_bytes(ri, 1, False, 1)
    assert theirs[sel] == pytest.approx(theirs[none] - megatron.act_scale * layer.saved_activation_bytes_attention_core)
    kept = ours.act_scale * layer.saved_activation_bytes_selective
    assert ours.activation_bytes(ri, 1, False, 1)[sel] == pytest.approx(kept)


def test_eager_selective_keeps_no_score_sized_tensor() -> None:
    # the eager core's scaled, masked and viewed scores are the core too (AttentionCore follows the data): what
    # selective keeps grows linearly in the sequence (the s² causal mask is the call's input, not kept by it)
    # and is less than none keeps, at runtime as priced; keyed by op type, the cache kept the scores' views and
    # the masked sum (s² each), more than none
    kept = {}
    for seq in (256, 512):
        layer, args, kwargs = _block("eager", seq, "meta")
        stats = measure_call(layer, args, kwargs, ModelState(layer))
        kept[seq] = stats.saved_bytes_selective - 4 * seq * seq
    assert kept[512] == 2 * kept[256]
    assert _measured_selective_bytes("eager", 512) == stats.saved_bytes_selective < stats.saved_bytes


def test_eager_selective_recompute_gives_the_same_gradients() -> None:
    # the recomputed core (scale, mask, softmax, dropout with its RNG replayed) reproduces the forward's:
    # gradients of a zoo GPT with eager attention and dropout 0.1 equal those without recompute
    import autopar

    grads = {}
    for mode in ("none", "selective"):
        model, _ = autopar.zoo.build("gpt-tiny", seq_len=32, attn_impl="eager", dtype=torch.float32)
        model = model.to_empty(device="cpu")
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.05)
        for m in model.modules():
            if type(m).__name__ == "GPTBlock":
                apply_recompute(m, mode)
        torch.manual_seed(1)
        tokens = torch.randint(0, 64, (2, 32))
        model(tokens).float().square().mean().backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, g in grads["none"].items():
        torch.testing.assert_close(grads["selective"][name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_selective_replays_every_random_draw_in_order() -> None:
    # a random op kept while dropout runs again would shift the RNG: backward's mask would not be the forward's.
    # Ops that draw (rand_like here) run again too, so the gradients equal those without recompute
    class Noisy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x) * torch.rand_like(x)
            return torch.nn.functional.dropout(h, 0.3, training=True).sum(-1)

    grads = {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        block = Noisy()
        apply_recompute(block, mode)
        block(torch.randn(4, 16)).square().sum().backward()
        grads[mode] = block.proj.weight.grad
    torch.testing.assert_close(grads["selective"], grads["none"], rtol=1e-6, atol=1e-7)
