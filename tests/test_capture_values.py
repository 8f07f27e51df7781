"""Capture follows values computed from shapes alone, so a model takes the branch real data takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture import capture
from autopar.capture.values import ShapeValues


class _Attention(nn.Module):
    def __init__(self, check_positions: bool, mask: bool) -> None:
        super().__init__()
        self.qkv, self.out, self.check_positions = nn.Linear(32, 96), nn.Linear(32, 32), check_positions
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        causal = not self.mask
        if self.check_positions:  # the packed-document check, as Hugging Face decoders spell it
            positions = torch.arange(s, device=x.device).expand(b, s)
            tracing = torch.compiler.is_compiling() or isinstance(positions, torch.fx.Proxy)
            causal = not tracing and bool((torch.diff(positions, dim=-1) == 1).all())
        if causal:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, 32))


class _Model(nn.Module):
    def __init__(self, check_positions: bool, mask: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Attention(check_positions, mask) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_a_value_read_from_shapes_takes_the_branch_real_data_takes() -> None:
    x = torch.zeros(2, 64, 32)
    checked, plain = capture(_Model(check_positions=True), (x,)), capture(_Model(check_positions=False), (x,))
    a, b = checked.layer("layers.0"), plain.layer("layers.0")
    assert (a.saved_activation_bytes, a.kernels_forward.attention_flops, a.kernels_backward.attention_flops) == (
        b.saved_activation_bytes, b.kernels_forward.attention_flops, b.kernels_backward.attention_flops)
    # the check itself (a few elementwise passes over the b·s int64 positions) is all that differs in traffic
    assert 0 <= a.kernels_forward.memory_bytes - b.kernels_forward.memory_bytes <= 4 * x.shape[0] * x.shape[1] * 8
    masked = capture(_Model(check_positions=False, mask=True), (x,)).layer("layers.0")
    assert masked.saved_activation_bytes > a.saved_activation_bytes  # the other branch would have been priced


def test_values_are_followed_only_where_they_are_determined() -> None:
    with ShapeValues():
        positions = torch.arange(6, device="meta").view(2, 3)
        assert int(positions.sum()) == 15
        assert bool((positions.sum(-1) == torch.arange(2, device="meta") * 9 + 3).all())
        grown = positions.clone()
        grown.add_(torch.empty(2, 3, device="meta", dtype=torch.long))  # uninitialised: unknown from here on
        with pytest.raises(RuntimeError, match="meta"):
            bool(grown.sum() > 0)
        with pytest.raises(RuntimeError, match="meta"):
            bool(torch.randint(0, 4, (3,), device="meta").sum() > 0)  # random ops have no fixed value


def test_hugging_face_decoder_is_priced_with_the_causal_kernel_it_runs() -> None:
    """On real positions transformers skips the mask and runs SDPA's causal kernel, whose saved tensors and
    traffic grow linearly with the sequence; an s×s mask (built when its packed-sequence check cannot read
    the positions) would add a quadratic term."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    short, long = (capture(model, (torch.zeros(1, s, dtype=torch.long),)) for s in (128, 256))
    for name in ("model.layers.0", "model.layers.1"):
        a, b = short.layer(name), long.layer(name)
        assert b.saved_activation_bytes == pytest.approx(2 * a.saved_activation_bytes, rel=1e-4)
        assert b.kernels_forward.memory_bytes == pytest.approx(2 * a.kernels_forward.memory_bytes, rel=1e-3)
        assert b.kernels_backward.memory_bytes == pytest.approx(2 * a.kernels_backward.memory_bytes, rel=1e-3)
    # what full recompute keeps of a later block: its input hidden states (the tables are the first block's)
    assert long.layer("model.layers.1").input_bytes == 2 * short.layer("model.layers.1").input_bytes
