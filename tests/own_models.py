"""Self-written language models in the styles people write outside transformers (for the conformance and
spelling-invariance tests). Written for these tests, each in its own idiom:

- `NanoGPT`: a single-file GPT with its modules in an `nn.ModuleDict`, a fused q|k|v projection, the head
  tied to the token embedding, and `forward(idx, targets=None) -> (logits, loss)` that returns only the last
  position's logits without targets;
- `MetaLlama`: a Llama with complex rotary tables (`torch.polar`, `view_as_complex`), grouped-query attention
  by `expand` + `reshape`, RMSNorm, blocks unpacking `x.shape`; only `torch.export` captures it;
- `EagerGPT`: hand-written softmax attention with a cached causal-mask buffer, blocks in `nn.Sequential`, a
  root-level position parameter;
- `FunctionalLM`: lambdas and `functools.partial` helpers held in modules, blocks in a `ModuleDict` under an
  attribute, a tied embedding two levels down, and `forward(input_ids, labels=None)` that shifts the labels
  inside and returns an object with `.loss`;
- `TargetArgLM`: rotary Llama whose `forward(x, y=None)` returns only the scalar loss, an `nll_loss` over
  `log_softmax` with ignore_index, its target named by `target_arg="y"`;
- six more in tests/own_models_reuse.py: one block applied at every depth between blocks of its own, a
  forward returning a dict, an encoder–decoder of torch's own layers, blocks under the model's own activation
  checkpointing, weights in `nn.ParameterList`s beside `nn.MultiheadAttention`, and a `cumsum` recurrence whose
  projections are as wide as the vocabulary.

All take `(dim, n_layers, n_heads, vocab, seq)` so that the same code is built tiny (parity, CI) or large (on
the meta device, for pricing).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from own_models_reuse import CheckpointedLM, DictLM, GatedScanLM, LoopedLM, ParamListLM, TorchSeq2SeqLM
from torch import nn

SEQ, VOCAB, DIM, HEADS, LAYERS = 16, 128, 64, 4, 2

# ---- NanoGPT -----------------------------------------------------------------------------------------


class NanoAttention(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.n_head, self.n_embd = n_head, dim

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806 - the idiom
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = NanoAttention(dim, n_head)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = NanoMLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ, tie: bool = True) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, dim), wpe=nn.Embedding(seq, dim), drop=nn.Dropout(0.0),
            h=nn.ModuleList([NanoBlock(dim, n_heads) for _ in range(n_layers)]), ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])  # inference: only the last position
            loss = None
        return logits, loss


# ---- MetaLlama ---------------------------------------------------------------------------------------


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    return torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x, n_rep: int):
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim).reshape(
        bs, slen, n_kv_heads * n_rep, head_dim)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class MetaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_local_heads, self.n_local_kv_heads = n_heads, n_kv_heads
        self.n_rep, self.head_dim = n_heads // n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        keys, values = repeat_kv(xk, self.n_rep), repeat_kv(xv, self.n_rep)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class MetaFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MetaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = MetaAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = MetaFeedForward(dim, hidden)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ, n_kv_heads: int | None = None, ffn_hidden: int | None = None) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        kv = n_kv_heads or n_heads // 2
        self.layers = nn.ModuleList(MetaBlock(dim, n_heads, kv, ffn_hidden or 3 * dim) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, 2 * seq), persistent=False)

    def forward(self, tokens):
        _bsz, seqlen = tokens.shape
        if seqlen > self.freqs_cis.shape[0]:  # Python control flow on a shape: fx cannot trace this model
            raise ValueError(f"sequence of {seqlen} tokens is longer than the rotary table")
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


# ---- EagerGPT ----------------------------------------------------------------------------------------


class EagerAttention(nn.Module):
    def __init__(self, dim: int, n_head: int, seq: int) -> None:
        super().__init__()
        self.key, self.query, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))
        self.n_head = n_head

    def forward(self, x):
        B, T, C = x.size()  # noqa: N806
        k = self.key(x).view(B, T, self.n_head, -1).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, -1).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, -1).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, -1)
        return self.proj(y)


class EagerBlock(nn.Module):
    def __init__(self, dim: int, n_head: int, seq: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = EagerAttention(dim, n_head, seq)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class EagerGPT(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.blocks = nn.Sequential(*[EagerBlock(dim, n_heads, seq) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        t = idx.size(1)
        x = self.tok_emb(idx) + self.pos_emb[:, :t, :]
        return self.head(self.ln_f(self.blocks(x)))


# ---- FunctionalLM ------------------------------------------------------------------------------------


@dataclass
class LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class FunctionalBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.ModuleDict({"q": nn.Linear(dim, dim), "k": nn.Linear(dim, dim), "v": nn.Linear(dim, dim)})
        self.out = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.act = lambda x: F.gelu(x, approximate="tanh")
        self.attend = functools.partial(F.scaled_dot_product_attention, is_causal=True)
        self.num_heads = n_heads

    def _heads(self, x):
        return x.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

    def forward(self, x):
        h = self.norm_1(x)
        q, k, v = (self._heads(self.qkv[n](h)) for n in ("q", "k", "v"))
        x = x + self.out(self.attend(q, k, v).transpose(1, 2).flatten(2))
        return x + self.down(self.act(self.up(self.norm_2(x))))


class FunctionalBody(nn.Module):
    def __init__(self, dim: int, n_layers: int, n_heads: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleDict({f"block_{i}": FunctionalBlock(dim, n_heads) for i in range(n_layers)})
        self.final_norm = nn.LayerNorm(dim)


class FunctionalLM(nn.Module):
    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ) -> None:
        super().__init__()
        self.body = FunctionalBody(dim, n_layers, n_heads, vocab)
        self.unembed = nn.Linear(dim, vocab, bias=False)
        self.unembed.weight = self.body.embed.weight
        self.scale = dim ** 0.5

    def forward(self, input_ids, labels=None):
        x = self.body.embed(input_ids) * self.scale
        for block in self.body.blocks.values():
            x = block(x)
        logits = self.unembed(self.body.final_norm(x))
        loss = None
        if labels is not None:  # next-token loss: the labels are the inputs, shifted here
            shift_logits = logits[:, :-1, :].contiguous()
            shift_labels = labels[:, 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))
        return LMOutput(loss=loss, logits=logits)


# ---- TargetArgLM -------------------------------------------------------------------------------------


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.num_heads, self.num_kv_heads = n_heads, n_kv_heads
        self.q_proj = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.input_norm, self.post_norm = RMSNorm(dim), RMSNorm(dim)
        self.attn = RotaryAttention(dim, n_heads, n_kv_heads)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class Trunk(nn.Module):
    def __init__(self, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(RotaryBlock(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers))


class TargetArgLM(nn.Module):
    ignore_index = -1

    def __init__(self, dim: int = DIM, n_layers: int = LAYERS, n_heads: int = HEADS, vocab: int = VOCAB,
                 seq: int = SEQ, n_kv_heads: int | None = None, ffn_hidden: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.trunk = Trunk(dim, n_layers, n_heads, n_kv_heads or n_heads // 2, ffn_hidden or 3 * dim)
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // n_heads
        inv = 1.0 / 10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)
        ang = torch.outer(torch.arange(2 * seq).float(), inv)
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, x, y=None):
        s = x.size(1)
        cos, sin = self.cos[:s], self.sin[:s]
        h = self.embed(x)
        for layer in self.trunk.layers:
            h = layer(h, cos, sin)
        logits = self.lm_head(self.norm(h))
        if y is None:
            return logits
        logp = F.log_softmax(logits.float(), dim=-1)
        return F.nll_loss(logp.flatten(0, 1), y.flatten(), ignore_index=self.ignore_index)


MODELS = {"nanogpt": NanoGPT, "meta_llama": MetaLlama, "eager_gpt": EagerGPT, "functional_lm": FunctionalLM,
          "target_arg_lm": TargetArgLM, "looped_lm": LoopedLM, "dict_lm": DictLM,
          "torch_seq2seq": TorchSeq2SeqLM, "checkpointed_lm": CheckpointedLM,
          "param_list_lm": ParamListLM, "gated_scan_lm": GatedScanLM}
TARGET_ARG = {"nanogpt": "targets", "functional_lm": "labels", "target_arg_lm": "y"}  # models with their own loss


def build_own(name: str, seed: int = 0, **dims) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name](**dims).float()


# ---- conformance cases (run in every rank of a gloo job; see tests/test_conformance_own.py) -------------

IGNORE = {"nanogpt": -1, "functional_lm": -100, "target_arg_lm": -1}  # the ignore_index each model's loss uses


def own_batches(name: str, steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Token batches; a model with its own loss gets targets with ignored positions, unevenly spread over the
    samples (so each rank and micro-batch averages over a different number of tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        t = torch.randint(0, VOCAB, (batch, SEQ), generator=g) if name not in TARGET_ARG else x.clone()
        if name in IGNORE:
            t[torch.rand(batch, SEQ, generator=g) < torch.linspace(0.0, 0.8, batch).unsqueeze(1)] = IGNORE[name]
        out.append((x, t))
    return out


def own_loss(model: nn.Module, name: str, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The single-process loss: the model's own when it has one, else next-token cross-entropy of its logits."""
    if name in TARGET_ARG:
        out = model(x, **{TARGET_ARG[name]: t})
        return out if isinstance(out, torch.Tensor) else out.loss if hasattr(out, "loss") else out[1]
    from autopar.codegen import lm_cross_entropy

    out = model(x)
    return lm_cross_entropy(out["logits"] if isinstance(out, dict) else out, t)


_DONE: dict[tuple[str, int], tuple] = {}


def own_case(name: str, config: dict, steps: int = 3) -> dict:
    """Reference (one process, whole batch) vs parallel run of model `name` under `config`."""
    import copy

    from capture_cache import capture
    from parity_models import BATCH, excess, make_plan, optimizer

    from autopar.codegen import lm_cross_entropy, parallelize
    from autopar.codegen.state import full_gradients

    model = build_own(name)
    x0 = torch.zeros(1, SEQ, dtype=torch.long)
    data = own_batches(name, steps, BATCH)
    if (name, steps) not in _DONE:  # the graph and the one-process reference, once per model in a process
        kw = {TARGET_ARG[name]: x0} if name in TARGET_ARG else {}
        graph = capture(model, (x0,), kw)
        ref = copy.deepcopy(model)
        opt = optimizer(ref.parameters())
        ref_losses = []
        for x, t in data:
            opt.zero_grad()
            loss = own_loss(ref, name, x, t)
            loss.backward()
            opt.step()
            ref_losses.append(loss.item())
        ref_grads = {k: p.grad.detach().clone() for k, p in ref.named_parameters() if p.grad is not None}
        _DONE[name, steps] = graph, ref_losses, ref_grads, {k: v.detach().clone() for k, v in ref.state_dict().items()}
    graph, ref_losses, ref_grads, ref_state = _DONE[name, steps]
    own = {"target_arg": TARGET_ARG[name]} if name in TARGET_ARG else {"loss_fn": lm_cross_entropy}
    pm = parallelize(model, make_plan(graph, **config), graph=graph, example_inputs=(x0,), optimizer=optimizer, **own)
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data]
    full = pm.full_state_dict()
    grads = full_gradients(pm.modules, pm.mesh["pp"])
    weight_excess, weight_key = excess(full, ref_state)
    grad_excess, grad_key = excess(grads, ref_grads)
    return {"case": f"{name} {config}", "losses": losses, "ref_losses": ref_losses,
            "weight_excess": weight_excess, "weight_key": weight_key, "grad_excess": grad_excess, "grad_key": grad_key,
            "missing": sorted(set(ref_state) - set(full)), "extra": sorted(set(full) - set(ref_state))}


def own_cases(cases: list[tuple[str, dict]], steps: int = 3) -> list[dict]:
    return [own_case(name, cfg, steps) for name, cfg in cases]
