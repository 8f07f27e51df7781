"""Reference architectures with shapes from their papers, built on the meta device by default.

`build(name, seq_len=..., device="meta")` returns `(model, example_inputs)`; on any other device the
model gets real, initialised weights (seeded by the caller's `torch.manual_seed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.zoo.gpt import GPT, GPTConfig
from autopar.zoo.llama import Llama, LlamaConfig

__all__ = ["build", "names", "config", "parse_overrides", "GPT", "GPTConfig", "Llama", "LlamaConfig"]


def _gpt(n_layers: int, hidden: int, heads: int, vocab: int = 50304, ctx: int = 2048) -> GPTConfig:
    # Vocabulary 50257 padded to a multiple of 128 (50304), as Megatron-LM and nanoGPT do,
    # so that vocab-parallel sharding divides evenly.
    return GPTConfig(n_layers=n_layers, hidden_size=hidden, n_heads=heads, vocab_size=vocab, max_seq_len=ctx)


def _llama(n_layers: int, hidden: int, heads: int, kv: int, ffn: int, vocab: int = 128256,
           ctx: int = 8192) -> LlamaConfig:
    return LlamaConfig(n_layers=n_layers, hidden_size=hidden, n_heads=heads, n_kv_heads=kv,
                       ffn_hidden_size=ffn, vocab_size=vocab, max_seq_len=ctx)


_CONFIGS: dict[str, GPTConfig | LlamaConfig] = {
    # GPT-2 (Radford et al. 2019, Table 2); context 1024.
    "gpt2-small": _gpt(12, 768, 12, ctx=1024),
    "gpt2-medium": _gpt(24, 1024, 16, ctx=1024),
    "gpt2-large": _gpt(36, 1280, 20, ctx=1024),
    "gpt2-xl": _gpt(48, 1600, 25, ctx=1024),
    # GPT-3 (Brown et al. 2020, Table 2.1); 13B uses Megatron's 5120 rather than the table's 5140.
    "gpt3-1.3b": _gpt(24, 2048, 16),
    "gpt3-2.7b": _gpt(32, 2560, 32),
    "gpt3-6.7b": _gpt(32, 4096, 32),
    "gpt3-13b": _gpt(40, 5120, 40),
    "gpt3-175b": _gpt(96, 12288, 96),
    # Llama 3 (Dubey et al. 2024, Table 3).
    "llama3-8b": _llama(32, 4096, 32, 8, 14336),
    "llama3-70b": _llama(80, 8192, 64, 8, 28672),
    "llama3-405b": _llama(126, 16384, 128, 8, 53248),
    # Tiny models for tests and runs on a laptop CPU.
    "gpt-tiny": GPTConfig(n_layers=4, hidden_size=128, n_heads=4, vocab_size=1024, max_seq_len=256),
    "llama-tiny": _llama(4, 128, 4, 2, 344, vocab=1024, ctx=256),
}


def names() -> list[str]:
    """Names accepted by `build`."""
    return list(_CONFIGS)


def config(name: str, **overrides: Any) -> GPTConfig | LlamaConfig:
    """The architecture config of `name`, with fields replaced by `overrides` (e.g. n_layers=2, dropout=0.0)."""
    if name not in _CONFIGS:
        raise AutoparError(f"unknown model {name!r}; autopar.zoo.names() lists {', '.join(_CONFIGS)}")
    cfg = _CONFIGS[name]
    valid = {f.name for f in dataclasses.fields(cfg)}
    bad = sorted(set(overrides) - valid)
    if bad:
        raise AutoparError(f"{name}: unknown config field(s) {bad}; valid fields are {sorted(valid)}")
    return dataclasses.replace(cfg, **overrides)


def parse_overrides(items: Sequence[str]) -> dict[str, int | float]:
    """`--override` flags as config fields: ["n_layers=2", "dropout=0.1"] → {"n_layers": 2, "dropout": 0.1}.

    One parser for the CLI and the training script, so a plan and a run name the same model.
    """
    out: dict[str, int | float] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            value = float(raw) if any(c in raw for c in ".eE") else int(raw)
        except ValueError:
            raise AutoparError(f"--override {item!r}: expected KEY=NUMBER, e.g. n_layers=2 or dropout=0") from None
        out[key.strip()] = value
    return out


def build(name: str, seq_len: int | None = None, *, batch_size: int = 1, device: str | torch.device = "meta",
          dtype: torch.dtype | None = None, **overrides: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model `name` and example inputs `(input_ids [batch_size, seq_len],)`.

    dtype defaults to bfloat16 on meta (what the planner assumes for mixed-precision training)
    and float32 elsewhere (what parity tests compare).
    """
    cfg = config(name, **overrides)
    seq_len = seq_len or min(cfg.max_seq_len, 2048)
    if seq_len > cfg.max_seq_len:
        if isinstance(cfg, GPTConfig):  # learned positions: a longer context is a different, larger model
            raise AutoparError(
                f"{name} has {cfg.max_seq_len} learned positions; seq_len={seq_len} needs a larger position table. "
                f"Pass seq_len ≤ {cfg.max_seq_len}, or max_seq_len={seq_len} to build that larger model on purpose")
        cfg = dataclasses.replace(cfg, max_seq_len=seq_len)  # rotary positions extend without new parameters
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "meta" else torch.float32)
    factory: Callable[[Any], nn.Module] = GPT if isinstance(cfg, GPTConfig) else Llama
    with device:
        model = factory(cfg)
    if device.type != "meta":
        model.init_weights()
    model = model.to(dtype=dtype)
    model.zoo_name = name  # type: ignore[attr-defined]  # lets capture() name the graph
    input_ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    if device.type != "meta":
        input_ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=device)
    return model, (input_ids,)
