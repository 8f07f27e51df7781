"""Two more self-written language models, for what the five of tests/own_models.py do not spell:

- `LoopedLM`: one block applied several times, interleaved with blocks of its own at each depth (the weight
  sharing of ALBERT or of looped transformers): a module called again after other modules with parameters ran,
  so no pipeline cut may fall between its first and its last call (autopar.capture.layers);
- `DictLM`: blocks in an `nn.ModuleDict` of `nn.Sequential`s, and a forward that returns a dict holding the
  logits beside another tensor;
- `TorchSeq2SeqLM`: an encoder–decoder of torch's own `nn.TransformerEncoderLayer`s and
  `nn.TransformerDecoderLayer`s (packed q|k|v parameters, cross-attention on the encoder's output, a causal
  mask); their attention permutes its input, so the gradient a pipeline stage sends back is not contiguous;
- `CheckpointedLM`: blocks of several modules, each block called under the model's own
  `torch.utils.checkpoint` (non-reentrant), whose backward replays the whole block: no cut may split one;
- `ParamListLM`: torch's `nn.MultiheadAttention` called directly, and an MLP by `torch.einsum` over weights kept
  in `nn.ParameterList`s that the model's forward indexes (never called themselves);
- `GatedScanLM`: a gated linear recurrence by `cumsum` whose per-depth gate|value projections, in a
  `ModuleList`, are exactly as wide as the vocabulary (2·DIM = VOCAB), which no head is.

All take the same `(dim, n_layers, n_heads, vocab, seq)` as the others, with the same tiny defaults.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

SEQ, VOCAB, DIM, HEADS, LAYERS = 16, 128, 64, 4, 2


def _mlp(dim: int, hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class LoopedLM(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.shared = _mlp(dim, 4 * dim)  # applied at every depth
        self.own = nn.ModuleList(_mlp(dim, 2 * dim) for _ in range(n_layers + 1))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[: x.shape[1]]
        for own in self.own:
            h = h + self.shared(h)
            h = h + own(h)
        return self.head(self.norm(h))


class DictLM(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({f"b{i}": _mlp(dim, 3 * dim) for i in range(n_layers + 1)})
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.embed(input_ids)
        for block in self.blocks.values():
            h = h + block(h)
        return {"hidden": h, "logits": self.head(h)}


class TorchSeq2SeqLM(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.ModuleList(nn.TransformerEncoderLayer(dim, n_heads, 2 * dim, 0.0, batch_first=True)
                                     for _ in range(n_layers))
        self.decoder = nn.ModuleList(nn.TransformerDecoderLayer(dim, n_heads, 2 * dim, 0.0, batch_first=True)
                                     for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.embed(x)
        for layer in self.encoder:
            memory = layer(memory)
        y = self.embed(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        for layer in self.decoder:
            y = layer(y, memory, tgt_mask=mask, tgt_is_causal=True)
        return self.head(y)


class CheckpointedLM(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_mlp(dim, 2 * dim) for _ in range(n_layers + 1))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False)
        return self.head(h)


class ParamListLM(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.ModuleList(nn.MultiheadAttention(dim, n_heads, batch_first=True) for _ in range(n_layers))
        self.w_in = nn.ParameterList(nn.Parameter(torch.randn(dim, 2 * dim) * 0.05) for _ in range(n_layers))
        self.w_out = nn.ParameterList(nn.Parameter(torch.randn(2 * dim, dim) * 0.05) for _ in range(n_layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        for i, attn in enumerate(self.attn):
            h = h + attn(h, h, h, attn_mask=mask)[0]
            h = h + torch.einsum("bsf,fd->bsd", F.gelu(torch.einsum("bsd,df->bsf", h, self.w_in[i])), self.w_out[i])
        return self.head(self.norm(h))


class GatedScanLM(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.gates = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(n_layers + 1))
        self.outs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(n_layers + 1))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for gate, out in zip(self.gates, self.outs, strict=True):
            a, b = gate(h).chunk(2, dim=-1)
            state = torch.cumsum(F.logsigmoid(a), dim=1)  # log of the running product of the decays
            h = h + out(torch.exp(state) * torch.cumsum(torch.exp(-state) * b, dim=1) * 1e-3)
        return self.head(h)
