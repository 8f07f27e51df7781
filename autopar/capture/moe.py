"""Mixture-of-experts layers on meta tensors: the grouped GEMM in any dtype, and the MoE found in a layer.

transformers' MoE layers (Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS, OLMoE, ...) run their experts as
`torch._grouped_mm`: the tokens sorted by expert, one GEMM launch over all experts' weight matrices
[E, n, k] with the row offsets of each expert's tokens. Its meta kernel checks the CUDA kernel's bf16
requirement, so a model captured in fp32 (or fp16) fails on meta; `grouped_mm_any_dtype()` computes the
same output shapes for any dtype, and `register_grouped_mm_flops` teaches FlopCounterMode its FLOPs
(2·M·K·N summed over the groups: the rows of all groups together are the routed token copies).

An MoE is found from the call's data flow and the module structure, never a family's class names
(`find_moe`): a `topk` over the last dimension of a tensor of width E selects the experts (the router), or
the bank is called with the choice itself, an integer tensor [T, k] of expert indices (`record_bank_calls`:
routers that pick by sampling or repeated max instead of `topk`, PhiMoE's sparsemixer); the expert bank
is the module of the layer whose own parameters stack E matrices (leading dimension E) or a list of E
identical modules; the router is the module whose weight has E rows. What else the MoE block holds
(shared experts that every token passes through, a shared expert's gate) is dense.

Group-limited routing (DeepSeek's device- and node-limited routing; `MoESpec.route_groups`) is found from
the same data flow: before choosing its k of E experts for T tokens, the router takes a top-m of G < E
(G dividing E, m < G) for the same T tokens — the groups of E / G consecutive experts it opens to each
token. A top-k inside each group (a [T, G, E / G] score tensor, T · G rows) is the groups' scoring, not the
choice. No class or attribute name is read: a router that limits groups some other way (by sampling, or by
masking without a top-k) is priced as open to every expert, which overstates its dispatch.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, register_flop_formula

from autopar.capture.moe_spec import MoESpec

__all__ = ["GROUPED_MM_OPS", "grouped_mm_any_dtype", "grouped_mm_groups", "find_moe", "bank_width",
           "record_bank_calls", "DEFAULT_LOAD_IMBALANCE"]

aten = torch.ops.aten
GROUPED_MM_OPS = frozenset({aten._grouped_mm}) if hasattr(aten, "_grouped_mm") else frozenset()

# The router's systematic skew: the busiest expert-parallel rank's routed tokens ÷ the mean, in expectation
# (the sampling spread of a finite micro-batch is derived on top of it: autopar.planner.moe_load). Default 1:
# a router trained to balance its experts, the condition the published MoE throughputs were measured under —
# NVIDIA's Megatron-Bridge MoE benchmarks "force-balance the token distribution among experts" and are
# token-dropless (NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary-archive.md, 25.11 notes), and
# DeepSeek-V3 trains with auxiliary-loss-free balancing to keep expert load even (arXiv 2412.19437 §2.1.2).
# It is not a measurement of any one router: Megatron-Core's MoE README warns that dropless routing is badly
# skewed in the first 100-300 steps from scratch, and NVIDIA's MoE model zoo measured Qwen3-235B-A22B on 32
# H100 nodes (mock data) dropless at 237, 277, 320 and 357 TFLOP/s per GPU against 295, 335, 368 and 389
# force-balanced at 16k to 128k tokens (yanring/Megatron-MoE-ModelZoo, best_practice/qwen3/readme.md): whole
# steps 9-25% slower, a skew well above 1 on the expert part. A run that measures its own sets it with
# `ModelGraph.with_moe_load_imbalance` (`benchmarks/moe_plans.py --load-imbalance`). Switch Transformer's
# capacity factor 1.25 (Fedus et al. 2022, Table 1), used before, provisions expert buffers with a margin
# against dropping tokens; it is not the load a dropless layer waits for.
DEFAULT_LOAD_IMBALANCE = 1.0


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """Output shape of torch._grouped_mm (2-D × 3-D: rows grouped by offsets; 3-D × 2-D: columns grouped;
    2-D × 2-D: the shared dimension grouped, one [m, n] result per group; 3-D × 3-D: a batched matmul)."""
    if a.dim() == 2 and b.dim() == 2:
        if offs is None:
            raise ValueError("torch._grouped_mm of two 2-D tensors needs offs")
        return [offs.shape[0], a.shape[0], b.shape[1]]
    if a.dim() == 2:
        return [a.shape[0], b.shape[-1]]
    if b.dim() == 2:
        return [a.shape[1], b.shape[1]]
    return [a.shape[0], a.shape[1], b.shape[-1]]


def grouped_mm_groups(args: tuple, kwargs: dict) -> int:
    """How many weight matrices one grouped GEMM multiplies (the experts it runs in one launch)."""
    a = args[0]
    offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
    if offs is not None:
        return int(offs.shape[0])
    return int(a.shape[0]) if a.dim() == 3 else 1


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, **kwargs: Any) -> int:
    """2·M·K·N summed over the groups (every row of a, or every column of b, is in one group)."""
    if len(a_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
    if len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[-1]
    return 2 * a_shape[1] * a_shape[2] * b_shape[-1]


def register_grouped_mm_flops() -> None:
    """Count torch._grouped_mm in FlopCounterMode (torch has no formula for it); idempotent."""
    for op in GROUPED_MM_OPS:
        if op not in flop_registry:
            register_flop_formula(op, get_raw=False)(
                lambda a_shape, b_shape, *rest, out_shape=None, **kw: _grouped_mm_flops(a_shape, b_shape))


register_grouped_mm_flops()  # at import: a FlopCounterMode copies the registry when it is constructed


class _GroupedMMAnyDtype(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket in GROUPED_MM_OPS and (args[0].device.type == "meta"
                                                      or isinstance(args[0], FakeTensor)):
            a, b = args[0], args[1]
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            dtype = kwargs.get("out_dtype") or a.dtype
            return a.new_empty(_grouped_mm_shape(a, b, offs), dtype=dtype)
        return func(*args, **kwargs)


@contextmanager
def grouped_mm_any_dtype() -> Iterator[None]:
    """Within the block, torch._grouped_mm on meta and fake tensors of any dtype returns its output
    shape, as the bf16 CUDA kernel would; FLOPs are counted by FlopCounterMode."""
    with _GroupedMMAnyDtype():
        yield


def _bank(module: nn.Module) -> tuple[int, list[nn.Parameter]] | None:
    """(E, the experts' parameters) when `module` holds an expert bank: its own parameters stacking E
    matrices (leading dim E, at least one ≥ 3-D; per-expert biases [E, n] included), or it is a list of
    E ≥ 2 modules of one class with parameters of equal shapes."""
    if isinstance(module, nn.ModuleList) and len(module) >= 2:
        shapes = {tuple((n, tuple(p.shape)) for n, p in child.named_parameters()) for child in module}
        if len(shapes) == 1 and len({type(c) for c in module}) == 1 and next(iter(shapes)):
            return len(module), list(module.parameters())
        return None
    stacked = [p for p in module.parameters(recurse=False) if p.dim() >= 3]
    if not stacked or len({p.shape[0] for p in stacked}) != 1:
        return None
    experts = int(stacked[0].shape[0])
    return experts, [p for p in module.parameters(recurse=False) if p.dim() >= 2 and p.shape[0] == experts]


def record_bank_calls(module: nn.Module, topks: list[tuple[int, int, int]]) -> list[Any]:
    """Forward pre-hooks on every expert bank under `module` that append (k, E, T) to `topks` when the bank is
    called with an integer [T, k] tensor (k < E): the experts each token chose, however the router chose
    them. Returns the hook handles (remove them after the call)."""

    def hook(experts: int) -> Any:
        def pre(mod: nn.Module, inputs: tuple) -> None:
            for t in inputs:
                if (isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point()
                        and t.dtype != torch.bool and 0 < t.shape[-1] < experts):
                    topks.append((int(t.shape[-1]), experts, int(t.shape[0])))
                    return
        return pre

    return [m.register_forward_pre_hook(hook(b[0])) for _, m in module.named_modules() if (b := _bank(m))]


def record_bank_saves(module: nn.Module, saved: dict[Any, int], keys: list[Any]) -> list[Any]:
    """Forward hooks on every expert bank under `module` (on each expert of a list of experts) that append
    to `keys` the keys `saved` gained while the bank ran: the tensors autograd keeps for the experts'
    backward (their token rows and FFN intermediates), which expert parallelism and expert tensor
    parallelism split (planner/memory_costs). `saved` must keep insertion order (a dict). Returns the
    handles (remove them after the call)."""
    marks: list[int] = []

    def pre(mod: nn.Module, inputs: tuple) -> None:
        marks.append(len(saved))

    def post(mod: nn.Module, inputs: tuple, output: Any) -> None:
        keys.extend(list(saved)[marks.pop():])

    handles = []
    for _, m in module.named_modules():
        if _bank(m):
            for unit in (m if isinstance(m, nn.ModuleList) else (m,)):
                handles += [unit.register_forward_pre_hook(pre), unit.register_forward_hook(post)]
    return handles


def _router(module: nn.Module, experts: int, bank: set[int]) -> str | None:
    """The module whose 2-D weight (not the bank's) maps the hidden state to one score per expert."""
    for name, m in module.named_modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and id(w) not in bank and w.dim() == 2 and w.shape[0] == experts:
            return name
    return None


def find_moe(module: nn.Module, prefix: str, topks: tuple[tuple[int, int, int], ...], dtype_bytes: int, *,
             tokens_per_sample: int, load_imbalance: float) -> MoESpec | None:
    """The MoE of a layer's module: `topks` are the (k, width, rows) of each topk the call ran. None without
    one.

    Raises ValueError for a layer with several expert banks the same topk could route (ambiguous).
    """
    banks = {name: b for name, m in module.named_modules() if (b := _bank(m))}
    for i, (k, width, rows) in enumerate(topks):
        matches = [n for n, (e, _) in banks.items() if e == width]
        if not matches:
            continue
        if len(matches) > 1:
            raise ValueError(f"{prefix}: expert banks {matches} all hold {width} experts; which one the "
                             f"router's top-{k} selects cannot be told from the structure")
        bank = matches[0]
        params = banks[bank][1]
        ids = {id(p) for p in params}
        router = _router(module, width, ids)
        owner = _enclosing(bank, router) if router is not None else bank.rpartition(".")[0]
        block = module.get_submodule(owner) if owner else module
        router_module = module.get_submodule(router) if router is not None else None
        exclude = ids | ({id(p) for p in router_module.parameters()} if router_module is not None else set())
        hidden = int(router_module.weight.shape[1]) if router_module is not None else bank_width(params, width)
        return MoESpec(
            experts=_join(prefix, bank), router=_join(prefix, router) if router is not None else None,
            block=_join(prefix, owner), num_experts=width, top_k=k,
            expert_params=sum(p.numel() for p in params),
            expert_param_bytes=sum(p.numel() * p.element_size() for p in params),
            shared_params=sum(p.numel() for p in block.parameters() if id(p) not in exclude),
            ffn_hidden_size=_ffn_hidden(params, width, hidden),
            dispatch_bytes_per_sample=tokens_per_sample * k * hidden * dtype_bytes,
            tokens_per_sample=tokens_per_sample, load_imbalance=load_imbalance,
            **_route_groups(topks[:i], experts=width, top_k=k, rows=rows))
    return None


def _route_groups(before: tuple[tuple[int, int, int], ...], *, experts: int, top_k: int,
                  rows: int) -> dict[str, int]:
    """MoESpec's route_groups / route_group_top_k from the top-k selections a call ran before choosing its
    experts (module docstring): the last top-m of G groups over the same rows (tokens) with G dividing E,
    1 < G < E, m < G and room for top_k experts in m groups; none: {} (every expert open)."""
    for m, groups, r in reversed(before):
        if (r == rows and 1 < groups < experts and experts % groups == 0 and 1 <= m < groups
                and m * (experts // groups) >= top_k):
            return {"route_groups": groups, "route_group_top_k": m}
    return {}


def _expert_matrices(params: list[nn.Parameter], experts: int) -> list[tuple[int, ...]]:
    """One expert's weight matrices: the trailing dims of stacked weights, or each list member's 2-D weights."""
    stacked = [tuple(p.shape[-2:]) for p in params if p.dim() == 3]
    return stacked or [tuple(p.shape) for p in params[: len(params) // experts] if p.dim() == 2]


def bank_width(params: list[nn.Parameter], experts: int) -> int:
    """The model width when no router weight shows it: the dimension every expert matrix shares."""
    mats = _expert_matrices(params, experts)
    common = set(mats[0]).intersection(*map(set, mats[1:])) if mats else set()
    return min(common) if common else 0


def _ffn_hidden(params: list[nn.Parameter], experts: int, hidden: int) -> int:
    """One expert's FFN width: the smallest other side of its weight matrices (gate|up fused is 2·ffn wide)."""
    others = [a if b == hidden else b for a, b in _expert_matrices(params, experts) if hidden in (a, b)]
    return min(others, default=0)


def _enclosing(a: str, b: str) -> str:
    """The innermost module path containing both module paths (one of them when it holds the other)."""
    common = []
    for x, y in zip(a.split(".") if a else [], b.split(".") if b else [], strict=False):
        if x != y:
            break
        common.append(x)
    return ".".join(common)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name
