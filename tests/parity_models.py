"""Tiny models, their graphs, hand-built plans and the single-device reference for the parity tests.

Shapes follow the CI budget: 2 layers, hidden 64, seq 16, global batch 8, fp32, dropout 0.
The reference is the same initial model (deep-copied before sharding) trained on one process on
the whole global batch with the same optimizer; every parallel rank computes it itself.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import capture_cache
import torch
from hf_families import FAMILIES, MOE_FAMILIES, OTHER_FAMILIES, build_custom, build_family
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import autopar
from autopar.capture.graph import LayerSpec, ModelGraph, TPPattern
from autopar.capture.sequence import sequence_parallel_refusal
from autopar.cluster import Cluster
from autopar.codegen import lm_cross_entropy, parallelize
from autopar.codegen.float8 import convert_float8, float8_linear_names, is_float8_linear
from autopar.codegen.state import full_gradients
from autopar.config import ParallelConfig, PlannerOptions
from autopar.plan import BREAKDOWN_KEYS, Estimate, Plan, StagePlan
from autopar.planner.tp_costs import tp_collectives

SEQ, BATCH, VOCAB, HIDDEN, HEADS, LAYERS = 16, 8, 128, 64, 4, 2
LR, STEPS = 1e-3, 5
RTOL, ATOL = 1e-4, 1e-5


def optimizer(params):
    # eps=1e-6 rather than 1e-8: Adam divides by |grad|, so for elements whose gradient is ~1e-9 the
    # fp32 reduction-order noise of a sharded matmul would otherwise become an lr-sized difference.
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01, eps=1e-6)


ODD_VOCAB = 129  # no tp > 1 divides it: the embedding and LM head stay whole (autopar.capture.vocab_split)


def build_model(kind: str, seed: int = 0) -> nn.Module:
    """`kind` ending in "_odd_vocab": that model with a vocabulary of ODD_VOCAB ids (the batches draw below VOCAB)."""
    if kind.endswith("_odd_vocab"):
        base = kind.removesuffix("_odd_vocab")
        if base == "gpt":
            torch.manual_seed(seed)
            model, _ = autopar.zoo.build("gpt-tiny", seq_len=SEQ, device="cpu", dropout=0.0, n_layers=LAYERS,
                                         hidden_size=HIDDEN, n_heads=HEADS, vocab_size=ODD_VOCAB)
            return model
        return build_family(base, seed, vocab_size=ODD_VOCAB)
    if kind in FAMILIES or kind in MOE_FAMILIES or kind in OTHER_FAMILIES:
        return build_family(kind, seed)
    if kind in ("skip_tied", "mixed_attention"):
        return build_custom(kind, seed)
    if kind == "param_list":  # MultiheadAttention, ParameterList: parameters no forward of their holder reads
        from own_models_reuse import ParamListLM

        torch.manual_seed(seed)
        return ParamListLM().float()
    torch.manual_seed(seed)
    if kind == "gpt":
        model, _ = autopar.zoo.build("gpt-tiny", seq_len=SEQ, device="cpu", dropout=0.0, n_layers=LAYERS,
                                     hidden_size=HIDDEN, n_heads=HEADS, vocab_size=VOCAB)
        return model
    if kind == "llama_zoo":
        model, _ = autopar.zoo.build("llama-tiny", seq_len=SEQ, device="cpu", n_layers=LAYERS, hidden_size=HIDDEN,
                                     n_heads=HEADS, n_kv_heads=HEADS // 2, vocab_size=VOCAB)
        return model
    if kind == "hf_llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN + 40,
                          num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS // 2,
                          max_position_embeddings=4 * SEQ, tie_word_embeddings=False, attn_implementation="sdpa")
        return LlamaForCausalLM(cfg).float()
    raise ValueError(kind)


def logits_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out if isinstance(out, torch.Tensor) else out.logits


def _layer(name: str, kind: str, patterns: tuple[TPPattern, ...] = (), modules: tuple[str, ...] = ()) -> LayerSpec:
    zeros = dict(num_params=0, param_bytes=0, forward_flops=0.0, backward_flops=0.0, forward_flops_tp_sharded=0.0,
                 bytes_read=0, bytes_written=0, input_bytes=0, saved_activation_bytes=0,
                 saved_activation_bytes_tp_sharded=0, saved_activation_bytes_attention_core=0, boundary_bytes=0)
    return LayerSpec(name=name, kind=kind, signature=kind, modules=modules or (name,), tp_patterns=patterns, **zeros)


def handmade_graph(kind: str) -> ModelGraph:
    """The layers and TP patterns these models have, written by hand (independent of capture)."""
    if kind == "gpt":
        emb, blocks, norm, head = "embed", "blocks", "ln_f", "lm_head"
        att = ("attn.q_proj", "attn.k_proj", "attn.v_proj"), ("attn.o_proj",)
        mlp = ("mlp.fc",), ("mlp.proj",)
        emb_module, kv = "embed.wte", HEADS
    else:
        emb, blocks, norm, head = "model.embed_tokens", "model.layers", "model.norm", "lm_head"
        att = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",)
        mlp = ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)
        emb_module, kv = "model.embed_tokens", HEADS // 2
    layers = [_layer(emb, "embedding", (TPPattern(kind="embedding", column=(emb_module,), vocab_size=VOCAB),))]
    for i in range(LAYERS):
        p = f"{blocks}.{i}"
        layers.append(_layer(p, "block", (
            TPPattern(kind="attention", column=tuple(f"{p}.{c}" for c in att[0]), row=tuple(f"{p}.{r}" for r in att[1]),
                      num_heads=HEADS, num_kv_heads=kv, head_dim=HIDDEN // HEADS),
            TPPattern(kind="mlp", column=tuple(f"{p}.{c}" for c in mlp[0]), row=tuple(f"{p}.{r}" for r in mlp[1])),
        )))
    layers.append(_layer(norm, "norm"))
    layers.append(_layer(head, "head", (TPPattern(kind="lm_head", column=(head,), vocab_size=VOCAB),)))
    return ModelGraph(model_name=kind, layers=tuple(layers), dtype="float32", seq_len=SEQ, example_batch_size=1,
                      num_params=0, hidden_size=HIDDEN, num_attention_heads=HEADS, num_kv_heads=kv,
                      vocab_size=VOCAB)


def graph_of(kind: str, model: nn.Module, seq: int = SEQ) -> ModelGraph:
    """The captured graph of `model` (what a user's plan is made from), captured once a session (capture_cache)."""
    return capture_cache.capture(model, (torch.zeros(1, seq, dtype=torch.long),))


def make_plan(graph: ModelGraph, layer_recompute: dict[str, str] | None = None,
              stage_sizes: tuple[int, ...] | None = None, **config: Any) -> Plan:
    """A plan with `config`, layers cut into pp·v contiguous chunks as evenly as possible (chunk i on rank i mod pp),
    or of `stage_sizes` layers each (to cut where an even split would not); `layer_recompute` (layer name → mode)
    overrides config.recompute for those layers.
    sequence_parallel="planner": on wherever the planner may choose it under tp (off where it refuses it for the
    model, autopar.capture.sequence.sequence_parallel_refusal), so the case trains whatever the planner picks.
    planner=True: the planner's own plan (`planner_plan`), the other keys its pins."""
    if config.pop("planner", False):
        return planner_plan(graph, **config)
    if config.get("sequence_parallel") == "planner":
        tp = config.get("tp", 1)
        config["sequence_parallel"] = tp > 1 and sequence_parallel_refusal(graph, tp) is None
    config.setdefault("micro_batch_size", BATCH // (config.get("dp", 1) * config.get("num_microbatches", 1)))
    config.setdefault("precision", "fp32")  # parity at rtol 1e-4 is fp32 arithmetic; bf16 has its own tests
    cfg = ParallelConfig(**config)
    n_chunks = cfg.pp * cfg.virtual_stages
    names = [la.name for la in graph.layers]
    bounds = ([sum(stage_sizes[:i]) for i in range(n_chunks + 1)] if stage_sizes
              else [round(i * len(names) / n_chunks) for i in range(n_chunks + 1)])
    modes = [(layer_recompute or {}).get(n, cfg.recompute) for n in names]
    stages = tuple(StagePlan(index=i, layers=tuple(names[bounds[i]:bounds[i + 1]]), pp_rank=i % cfg.pp,
                             recompute=cfg.recompute, time_per_microbatch_s=0.0, peak_memory_bytes=0,
                             layer_recompute=tuple(modes[bounds[i]:bounds[i + 1]]) if layer_recompute else ())
                   for i in range(n_chunks))
    # hand-made: a nominal one-second step, consistent with its breakdown (plans are validated on use)
    est = Estimate(step_time_s=1.0, tokens_per_s=float(cfg.global_batch_size * (graph.seq_len or 1)),
                   tflops_per_device=0.0, mfu=0.0, peak_memory_bytes=0,
                   breakdown={k: float(k == "compute") for k in BREAKDOWN_KEYS})
    return Plan(config=cfg, stages=stages, estimate=est, model_name=graph.model_name,
                graph_fingerprint=graph.fingerprint, cluster_name="local", cluster_fingerprint="-",
                global_batch_size=cfg.global_batch_size, seq_len=graph.seq_len)


def planner_plan(graph: ModelGraph, **pins: Any) -> Plan:
    """What `autopar.plan` picks for `graph` on two local gloo ranks at the suite's global batch, in fp32 and eager
    (parity at rtol 1e-4; no compile in CI), `pins` (PlannerOptions fields) pinned and every other choice its
    own, sequence parallelism included."""
    options = PlannerOptions(top_k=0, precision="fp32", compile=False, **pins)
    return autopar.plan(graph, Cluster.local(nproc=2), global_batch_size=BATCH, options=options)


def pipeline_failing_on_rank1(message: str) -> tuple[Any, Any, torch.Tensor, torch.Tensor]:
    """(parallel model, hook, inputs, targets): the zoo GPT under pp2 whose second stage raises ValueError(message)
    before its last block on rank 1 (hook: the handle, to remove it; None on other ranks). For failure tests."""
    model = build_model("gpt")
    graph = graph_of("gpt", model)
    pm = parallelize(model, make_plan(graph, pp=2, num_microbatches=2), graph=graph, optimizer=optimizer)

    def boom(module: nn.Module, args: tuple) -> None:
        raise ValueError(message)

    rank1 = torch.distributed.get_rank() == 1  # parallelize has joined the process group
    hook = pm.modules[0].get_submodule("blocks.1").register_forward_pre_hook(boom) if rank1 else None
    x, t = batches(1)[0]
    return pm, hook, x, t


def batches(steps: int = STEPS, seed: int = 1, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH, seq), generator=g), torch.randint(0, VOCAB, (BATCH, seq), generator=g))
            for _ in range(steps)]


def _accumulate(model: nn.Module, x: torch.Tensor, t: torch.Tensor, chunks: int) -> torch.Tensor:
    total = torch.zeros(())
    for xc, tc in zip(x.tensor_split(chunks), t.tensor_split(chunks), strict=True):
        loss = lm_cross_entropy(logits_of(model, xc), tc) / chunks
        loss.backward()
        total += loss.detach()
    return total


def train_reference(model: nn.Module, data, chunks: int = 1
                    ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`chunks` > 1: each step accumulates gradients over that many equal slices of the batch, in order (what
    a layout with dp·m micro-batches runs); FP8's dynamic scales are per micro-batch, so its reference must."""
    opt = optimizer(model.parameters())
    losses = []
    for x, t in data:
        opt.zero_grad()
        loss = _accumulate(model, x, t, chunks)
        opt.step()
        losses.append(loss.item())
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, grads


def excess(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max(|got − want| − rtol·|want|) over all entries (≤ atol passes), and the worst name."""
    per = {k: ((got[k] - v).abs() - RTOL * v.abs()).max().item() for k, v in want.items() if k in got}
    worst = max(per, key=per.get)
    return per[worst], worst


class Gathers(TorchDispatchMode):
    """Bytes of every all-gather a step issues (functional collectives' outputs: nccl-tests' convention)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ == "all_gather_into_tensor":
            self.n_bytes += out.numel() * out.element_size()
        return out


def planned_gathers(graph, config) -> int:
    """The all-gather bytes the cost model prices for one step (tp_collectives, as planner/comm_costs.py)."""
    return config.num_microbatches * sum(
        c.n_bytes for la in graph.layers for c in tp_collectives(graph, la, tp=config.tp, sp=config.sequence_parallel,
                                                                 micro_batch=config.micro_batch_size)
        if c.op == "all_gather" and c.phase != "step")


_GRAPHS: dict[tuple[str, int], ModelGraph] = {}
_REFERENCES: dict[tuple, tuple] = {}


def parity_case(kind: str, config: dict[str, Any], steps: int = STEPS, seq: int = SEQ) -> dict[str, Any]:
    """Run in every rank: reference vs parallel losses per step and the largest final-weight error.

    The graph and the single-device reference depend on the model only, so a process running several
    cases of one model computes them once.
    """
    model = build_model(kind)
    if (kind, seq) not in _GRAPHS:
        _GRAPHS[kind, seq] = graph_of(kind, model, seq)
    graph = _GRAPHS[kind, seq]
    plan = make_plan(graph, **config)
    data = batches(steps, seq=seq)
    # under FP8 the reference is the same model converted alike (the linears the plan converts), on one process
    fp8 = plan.config.fp8
    names = float8_linear_names(model, graph, plan.config.tp) if fp8 != "none" else ()
    chunks = plan.config.dp * plan.config.num_microbatches if fp8 != "none" else 1
    if (kind, steps, seq, fp8, names, chunks) not in _REFERENCES:
        reference = copy.deepcopy(model)
        if fp8 != "none":
            convert_float8(reference, names, fp8, device=torch.device("cpu"))
        _REFERENCES[kind, steps, seq, fp8, names, chunks] = train_reference(reference, data, chunks)
    ref_losses, ref_state, ref_grads = _REFERENCES[kind, steps, seq, fp8, names, chunks]
    pm = parallelize(model, plan, graph=graph, optimizer=optimizer, loss_fn=lm_cross_entropy)
    gathers = Gathers()
    # the first step's all-gathers, to compare with what the cost model prices (tp only: dynamo runs nothing
    # compiled under a dispatch mode, and the compiled cases count their graphs)
    with gathers if plan.config.tp > 1 else contextlib.nullcontext():
        losses = [pm.train_step(pm.local_batch(data[0][0]), pm.local_batch(data[0][1]))]
    losses += [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in data[1:]]
    full = pm.full_state_dict()
    grads = full_gradients(pm.modules, pm.mesh["pp"])
    weight_excess, weight_key = excess(full, ref_state)
    grad_excess, grad_key = excess(grads, ref_grads)
    float8 = sorted({n for m in pm.modules for n, sub in m.named_modules() if is_float8_linear(sub)})
    # expert parallelism: each bank's experts on this rank (its DTensor's local rows over "ep")
    experts = {name: (pm.experts.rank, pm.experts.local_experts[name]) for name in pm.experts.banks} \
        if pm.experts is not None else {}
    return {"case": f"{kind} {config}", "losses": losses, "ref_losses": ref_losses, "float8_linears": float8,
            "experts": experts, "config": str(plan.config), "sequence_parallel": plan.config.sequence_parallel,
            "notes": plan.estimate.notes, "gathered_bytes": gathers.n_bytes,
            "planned_gathered_bytes": planned_gathers(graph, plan.config),
            "weight_excess": weight_excess, "weight_key": weight_key,
            "grad_excess": grad_excess, "grad_key": grad_key, "grad_names": sorted(grads),
            "missing": sorted(set(ref_state) - set(full)), "extra": sorted(set(full) - set(ref_state))}


def parity_cases(cases: list[tuple[str, dict[str, Any]]], steps: int = STEPS, seq: int = SEQ) -> list[dict[str, Any]]:
    return [parity_case(kind, cfg, steps, seq) for kind, cfg in cases]


def check_experts_split(results: list[dict], ep: int, etp: int = 1) -> None:
    """Under ep > 1 (or etp > 1) every bank a rank holds has E / ep = 4 / ep experts (hf_families: 4 experts),
    and each bank's EP ranks together hold all of them; a pipeline stage of dense layers only holds none."""
    held = [r.get("experts", {}) for r in results]
    if ep == 1 and etp == 1:
        assert not any(held), held
        return
    assert any(held) and all(local == 4 // ep for h in held for _, local in h.values()), (results[0]["case"], held)
    for bank in {b for h in held for b in h}:
        assert {h[bank][0] for h in held if bank in h} == set(range(ep)), (results[0]["case"], bank, held)
