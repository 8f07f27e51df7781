"""`ModelGraph`: what a model computes, layer by layer, as the planner and codegen see it.

Vocabulary (used across autopar):
- *layer*: a contiguous group of modules in execution order (embedding, one transformer block,
  final norm, LM head, ...). Pipeline stage cuts are only placed between layers.
- *per sample*: one element of the batch dimension (dim 0) of the example inputs, at the
  example's sequence length. Batch-level numbers are per-sample numbers times the micro-batch size.
- *signature*: a hash of a layer's structure (module classes, parameter shapes, input shapes).
  Layers with equal signatures are identical and analysed once.

All byte counts are in the dtype the model was captured in (`ModelGraph.dtype`).
Every class here is frozen, validates itself and round-trips through JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from autopar.capture.moe_spec import MoESpec

__all__ = ["TPPattern", "Kernel", "KernelMix", "LayerSpec", "SharedParam", "ModelGraph"]

TP_KINDS = ("mlp", "attention", "embedding", "lm_head")
VOCAB_KINDS = ("embedding", "lm_head")  # split over the vocabulary, or kept whole where tp does not divide it
LAYER_KINDS = ("embedding", "block", "norm", "head", "other")
# what bounds a kernel: matmul FLOPs, or the bytes of one of the memory-bound classes that
# cost_models.compute.MEMORY_KINDS prices from their own measured tables
KERNEL_KINDS = ("gemm", "attention", "elementwise", "reduction", "transcendental", "copy")


@dataclass(frozen=True, kw_only=True)
class TPPattern:
    """A tensor-parallel opportunity found in a layer.

    kind:
      - "mlp": `column` linears (up/gate projections) feed `row` linears (down projection).
      - "attention": `column` are the q/k/v (or fused qkv) projections, `row` the output projection;
        `num_heads` and `num_kv_heads` bound the TP degree (both must be divisible by it).
      - "embedding": `column` holds the embedding module (vocab-parallel); `vocab_size` set.
      - "lm_head": `column` holds the output projection (vocab-parallel); `vocab_size` set.
    Module names are fully qualified (as in `model.named_modules()`).

    allreduce_bytes_per_sample: the payload of the one all-reduce this pattern needs in forward
      (the row-parallel output, or the embedding output); backward needs one more of equal size.
    head_table_bytes, head_table_bytes_per_sample: an attention's per-head tensors computed from
      parameters (T5's relative position bias, Swin's window-bias table), kept whole and cut to each
      rank's heads: backward all-gathers their gradients once per micro-batch, head_table_bytes whatever
      its size plus head_table_bytes_per_sample per sample (capture.head_tables).
    """

    kind: str
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    allreduce_bytes_per_sample: int = 0
    head_table_bytes: int = 0
    head_table_bytes_per_sample: int = 0

    def __post_init__(self) -> None:
        if self.kind not in TP_KINDS:
            raise ValueError(f"TPPattern.kind={self.kind!r}; expected one of {TP_KINDS}")
        if self.kind == "attention" and not self.num_heads:
            raise ValueError("an attention TPPattern needs num_heads")

    def max_degree_ok(self, tp: int) -> bool:
        """Whether tensor-parallel degree `tp` can run this pattern: attention needs its head counts split
        evenly; a vocabulary pattern runs at any degree, split where tp divides its vocabulary, else kept
        whole on every tp rank (`splits`)."""
        if self.kind == "attention":
            kv = self.num_kv_heads or self.num_heads
            return self.num_heads % tp == 0 and kv % tp == 0
        return True

    def splits(self, tp: int) -> bool:
        """Whether degree `tp` > 1 splits this pattern over its tp ranks. A vocabulary-parallel embedding or
        LM head whose vocabulary tp does not divide (GPT-2's 50,257 at tp=2) stays replicated: autopar does
        not pad the user's vocabulary as Megatron does, and the rest of the model is split all the same."""
        if tp <= 1 or not self.max_degree_ok(tp):
            return False
        return self.kind not in VOCAB_KINDS or self.vocab_size is None or self.vocab_size % tp == 0


@dataclass(frozen=True, kw_only=True)
class Kernel:
    """`count` identical kernels of one pass of a layer, per sample (work and sizes scale with the batch).

    work: FLOPs (gemm, attention) or bytes read + written (the memory-bound kinds), per kernel.
    tensor_bytes: the kernel's largest tensor; a memory-bound kernel's measured rate depends on it
      (cache, reused heap block or fresh mapping), which a layer total cannot tell.
    layout: which GEMM operands are stored transposed ("nn", "nt", "tn"), as the profile's tables.
    mnk: per-matrix (m, n, k) of a batched matmul (eager attention's bmm); the matrices per sample
      are work / (2·m·n·k). None for GEMMs against weights and fused attention kernels.
    tp_sharded: inside a tensor-parallel pattern, so tp ranks each run 1/tp of it.
    attention_core: part of the attention core (the attention matmuls or fused kernel, and the scores'
      mask, softmax and dropout between them): what selective recompute runs again (Korthikanti et al.
      2022, §4.2). Forward kernels only.
    op_sac_saved: recompute under "op_sac" does not run it again: the policy keeps its output
      (autopar.capture.kernels.op_sac_saves), or it follows the last op whose output backward needs, where
      checkpointing stops recomputing. Forward kernels only.
    groups: a grouped GEMM (torch._grouped_mm): one launch multiplying `groups` weight matrices, each on
      its own rows, so each group runs at the efficiency of work / groups (an expert's few tokens).
    expert: computed by a mixture-of-experts bank on routed tokens (`MoESpec`): under expert parallelism a
      rank runs groups / ep experts on the tokens routed to them, at the load-imbalance factor.
    causal: a fused attention kernel run with is_causal=True: it skips the score tiles above the diagonal,
      which `work` (FlopCounterMode's count of the full score matrix) still includes; the cost model prices
      the tiles it computes (cost_models.compute.CAUSAL_TIME_FRACTION).
    """

    kind: str
    count: int
    work: float
    tensor_bytes: float = 0.0
    layout: str = "nn"
    mnk: tuple[int, int, int] | None = None
    tp_sharded: bool = False
    attention_core: bool = False
    op_sac_saved: bool = False
    groups: int = 1
    expert: bool = False
    causal: bool = False

    def __post_init__(self) -> None:
        if self.groups < 1:
            raise ValueError(f"Kernel {self.kind}: groups={self.groups} must be ≥ 1")
        if self.kind not in KERNEL_KINDS:
            raise ValueError(f"Kernel.kind={self.kind!r}; expected one of {KERNEL_KINDS}")
        if self.count < 1 or self.work < 0 or self.tensor_bytes < 0:
            raise ValueError(f"Kernel {self.kind}: count={self.count} must be ≥ 1, work={self.work} and "
                             f"tensor_bytes={self.tensor_bytes} non-negative")
        if self.mnk is not None:
            object.__setattr__(self, "mnk", tuple(int(d) for d in self.mnk))

    @property
    def key(self) -> tuple:
        """Kernels with equal keys are identical and are merged into one entry (counts added)."""
        return (self.kind, self.work, self.tensor_bytes, self.layout, self.mnk, self.tp_sharded,
                self.attention_core, self.op_sac_saved, self.groups, self.expert, self.causal)


def merge_kernels(kernels: list[Kernel] | tuple[Kernel, ...]) -> tuple[Kernel, ...]:
    """Identical kernels merged (first-seen order), so a pass stores each distinct kernel once."""
    counts: dict[tuple, Kernel] = {}
    for k in kernels:
        seen = counts.get(k.key)
        counts[k.key] = k if seen is None else dataclasses.replace(seen, count=seen.count + k.count)
    return tuple(counts.values())


@dataclass(frozen=True, kw_only=True)
class KernelMix:
    """The kernels of one pass (forward or backward) of a layer, per sample, grouped by what bounds them.

    A layer's time is the sum of its kernels' times, not one roofline over its totals: a block's
    GEMMs are compute-bound while its norms, activations and dropouts are memory-bound, and they
    run one after another. Counts are kernels per pass (they do not scale with the batch).
    The `*_tp_sharded` parts are inside tensor-parallel patterns and are divided by tp.
    `kernels` lists the same kernels one by one (merged when identical), with the sizes and layouts
    that set each one's measured rate; the totals above stay for readers that only need sums.
    Graphs written before it existed have none, and are priced from the totals.
    `fused` lists the memory-bound kernels as TorchInductor fuses them in a compiled block, one per chain
    of pointwise/reduction ops between matmuls (autopar.capture.fusion); () in older graphs, whose
    compiled blocks are priced as eager.
    """

    gemm_flops: float = 0.0  # matmuls against weights (linear layers)
    gemm_count: int = 0
    attention_flops: float = 0.0  # matmuls between activations and fused attention kernels
    attention_count: int = 0
    memory_bytes: float = 0.0  # bytes read + written by the other (memory-bound) kernels
    memory_count: int = 0
    gemm_flops_tp_sharded: float = 0.0
    attention_flops_tp_sharded: float = 0.0
    memory_bytes_tp_sharded: float = 0.0
    kernels: tuple[Kernel, ...] = ()
    fused: tuple[Kernel, ...] = ()

    def __post_init__(self) -> None:
        for name in ("kernels", "fused"):  # from JSON: dicts
            ks = tuple(k if isinstance(k, Kernel) else Kernel(**k) for k in getattr(self, name))
            object.__setattr__(self, name, ks)
        if min(self.gemm_flops, self.attention_flops, self.memory_bytes, self.gemm_count, self.attention_count,
               self.memory_count) < 0:
            raise ValueError(f"KernelMix has a negative entry: {self}")

    def __add__(self, other: KernelMix) -> KernelMix:
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)
                if f.name not in ("kernels", "fused")}
        return KernelMix(**sums, kernels=merge_kernels(self.kernels + other.kernels),
                         fused=merge_kernels(self.fused + other.fused))

    def scaled(self, factor: float) -> KernelMix:
        """Work scaled by `factor` (e.g. 1/batch for per-sample numbers); kernel counts unchanged."""
        sums = {f.name: getattr(self, f.name) * (1 if f.name.endswith("count") else factor)
                for f in dataclasses.fields(self) if f.name not in ("kernels", "fused")}

        def scale(ks: tuple[Kernel, ...]) -> tuple[Kernel, ...]:
            return merge_kernels([dataclasses.replace(k, work=k.work * factor, tensor_bytes=k.tensor_bytes * factor)
                                  for k in ks])

        return KernelMix(**sums, kernels=scale(self.kernels), fused=scale(self.fused))


@dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """One layer, measured on meta/fake tensors; all FLOPs and activation bytes are per sample."""

    name: str  # module path prefix, e.g. "blocks.3" or "transformer.h.3"
    kind: str  # one of LAYER_KINDS
    signature: str  # equal signature ⇒ identical layer
    modules: tuple[str, ...]  # fully qualified top-level modules in this layer, execution order
    num_params: int
    param_bytes: int
    forward_flops: float
    backward_flops: float
    # The part of forward_flops inside TP patterns (divided by tp under tensor parallelism).
    forward_flops_tp_sharded: float
    bytes_read: int  # forward memory traffic: parameters + activations read
    bytes_written: int  # forward memory traffic: activations written
    input_bytes: int  # tensors entering the layer (what full recompute keeps)
    saved_activation_bytes: int  # saved for backward, no parallelism, no recompute
    # Of saved_activation_bytes, the part that tensor parallelism divides by tp (inside TP patterns);
    # the rest is replicated across the TP group unless sequence parallelism shards it.
    saved_activation_bytes_tp_sharded: int
    # Of saved_activation_bytes, the attention core (scores, softmax, its dropout mask):
    # what selective recompute drops (Korthikanti et al. 2022, §4.2).
    saved_activation_bytes_attention_core: int
    boundary_bytes: int  # live tensors crossing a cut placed right after this layer
    tp_patterns: tuple[TPPattern, ...] = ()
    kernels_forward: KernelMix = field(default_factory=KernelMix)
    kernels_backward: KernelMix = field(default_factory=KernelMix)
    # Elements of each parameter tensor of the layer's norm modules (LayerNorm weight and bias, RMSNorm
    # weight): replicated under tensor parallelism, and reduced across the TP group under sequence parallelism.
    norm_param_numels: tuple[int, ...] = ()
    # What op-level selective checkpointing keeps (the layer's inputs and the outputs of the ops its policy
    # saves: autopar.capture.kernels.op_sac_saves) and, of that, the part inside TP patterns. None in
    # graphs captured before op_sac existed: the planner then never prefers op_sac (planner/compute_costs.py).
    saved_activation_bytes_op_sac: int | None = None
    saved_activation_bytes_op_sac_tp_sharded: int | None = None
    # Of saved_activation_bytes_op_sac, the outputs the policy saves that no backward reads (not even to
    # recompute what it does read): a compiled block does not keep them (capture.fusion.unread_save_bytes).
    saved_activation_bytes_op_sac_unread: int = 0
    # The same for selective recompute, whose policy caches every op's output outside the attention core, read by
    # backward or not (autopar.capture.kernels.AttentionCore). None in graphs captured before it: the planner
    # then prices selective as saved_activation_bytes less the attention core.
    saved_activation_bytes_selective: int | None = None
    saved_activation_bytes_selective_tp_sharded: int | None = None
    saved_activation_bytes_selective_unread: int = 0
    # The layer's mixture-of-experts block, if any (its experts' parameters are part of num_params).
    moe: MoESpec | None = None
    # Of saved_activation_bytes (outside its TP-sharded part), what the expert banks keep: their token rows
    # and FFN intermediates, which expert parallelism's token share and etp divide (planner/memory_costs).
    saved_activation_bytes_expert: int = 0
    # Channels of each batch norm the layer holds: under data parallelism codegen synchronises their
    # statistics over the dp group every micro-batch (autopar.codegen.batch_norm; priced in comm_costs).
    batch_norm_channels: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # from JSON
            object.__setattr__(self, "moe", MoESpec(**self.moe))
        object.__setattr__(self, "norm_param_numels", tuple(int(n) for n in self.norm_param_numels))
        object.__setattr__(self, "batch_norm_channels", tuple(int(n) for n in self.batch_norm_channels))
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"LayerSpec.kind={self.kind!r}; expected one of {LAYER_KINDS}")
        for f in ("num_params", "param_bytes", "saved_activation_bytes", "boundary_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"LayerSpec {self.name}: {f} is negative")
        if self.saved_activation_bytes_tp_sharded > self.saved_activation_bytes:
            raise ValueError(f"LayerSpec {self.name}: tp-sharded activations exceed the total")
        if self.saved_activation_bytes_expert + self.saved_activation_bytes_tp_sharded > self.saved_activation_bytes:
            raise ValueError(f"LayerSpec {self.name}: expert and tp-sharded activations exceed the total")

    @property
    def flops_per_sample(self) -> float:
        return self.forward_flops + self.backward_flops


@dataclass(frozen=True, kw_only=True)
class SharedParam:
    """A parameter that several layers hold (a head tied to the token embedding), or that the model's own
    code reads outside every layer (held by every pipeline stage). Each holding layer counts its bytes:
    a pipeline stage keeps a replica, and the replicas' gradients are summed over the holding stages."""

    names: tuple[str, ...]  # every name it has in the model's state dict
    layers: tuple[str, ...]  # the layers holding it; () when only top-level code reads it
    num_params: int
    param_bytes: int


@dataclass(frozen=True, kw_only=True)
class ModelGraph:
    """Ordered layers of a model plus totals; the input of the planner and of codegen."""

    model_name: str  # class name, or the zoo name
    layers: tuple[LayerSpec, ...]
    dtype: str  # e.g. "bfloat16"
    seq_len: int | None  # tokens per sample, when the input is a token sequence
    example_batch_size: int  # batch size of the example inputs that were traced
    num_params: int  # unique parameters (tied weights counted once)
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    num_kv_heads: int | None = None
    vocab_size: int | None = None
    shared_params: tuple[SharedParam, ...] = ()
    capture_method: str = "symbolic_trace"  # or "export"
    capture_time_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    # how the captured program trains (autopar.capture.targets: "loss_fn", or "own:labels" for a forward given its
    # targets); beside the fingerprint, not in it: a plan made under one loss runs under the other (plan_fit.py)
    loss_mode: str = "loss_fn"

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("ModelGraph has no layers")
        names = [layer.name for layer in self.layers]
        if len(set(names)) != len(names):
            raise ValueError(f"ModelGraph has duplicate layer names: {names}")

    # ---- totals (per sample of the example batch) ----
    @property
    def forward_flops(self) -> float:
        return sum(layer.forward_flops for layer in self.layers)

    @property
    def backward_flops(self) -> float:
        return sum(layer.backward_flops for layer in self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def saved_activation_bytes(self) -> int:
        return sum(layer.saved_activation_bytes for layer in self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def expert_params(self) -> int:
        """Parameters of all mixture-of-experts banks (of num_params; the rest is dense)."""
        return sum(la.moe.expert_params for la in self.layers if la.moe is not None)

    @property
    def active_params(self) -> float:
        """Parameters a token passes: the dense ones and top_k / num_experts of each bank (MoE MFU's N)."""
        return self.num_params - sum(la.moe.expert_params * (1 - la.moe.top_k / la.moe.num_experts)
                                     for la in self.layers if la.moe is not None)

    def with_moe_load_imbalance(self, factor: float) -> ModelGraph:
        """This graph with every MoE layer's load-imbalance factor set to `factor` (busiest expert's tokens
        ÷ the mean; 1 = perfectly balanced routing). Plans made from it carry its fingerprint."""
        if not any(la.moe is not None for la in self.layers):
            raise ValueError(f"{self.model_name} has no mixture-of-experts layer to set a load imbalance on")
        layers = tuple(dataclasses.replace(la, moe=dataclasses.replace(la.moe, load_imbalance=float(factor)))
                       if la.moe is not None else la for la in self.layers)
        return dataclasses.replace(self, layers=layers)

    def no_tensor_parallelism(self) -> str | None:
        """Why tensor parallelism would do nothing for this model (no TP pattern in any layer), else None."""
        if any(la.tp_patterns for la in self.layers):
            return None
        return (f"no layer of {self.model_name} has anything tensor parallelism can split: capture found no "
                "column→row linear pair (attention heads, an MLP), no vocabulary-parallel embedding and no LM head "
                "(convolutions, norms and linears over constants are not split), so tp ranks would only repeat "
                "each other's work")

    def layer(self, name: str) -> LayerSpec:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named {name!r}; layers are {[la.name for la in self.layers]}")

    @cached_property  # the graph is frozen; hashing its JSON costs a second on a model of 100+ layers
    def fingerprint(self) -> str:
        """A hash of everything a plan depends on (not timings); plans carry it to detect mismatch."""
        payload = self.to_dict()
        payload.pop("capture_time_s", None)
        payload.pop("capture_method", None)
        payload.pop("metadata", None)
        payload.pop("loss_mode", None)  # recorded beside it: the program's own targets already change its figures
        if not payload.get("shared_params"):
            payload.pop("shared_params", None)  # graphs without shared weights keep their fingerprints
        _drop_moe_defaults(payload)  # and dense graphs keep theirs from before MoE fields existed
        for layer in payload["layers"]:
            if not layer.get("batch_norm_channels"):
                layer.pop("batch_norm_channels", None)  # nor do graphs without batch norm
            for p in layer.get("tp_patterns", ()):  # nor those without per-head tables
                for key in ("head_table_bytes", "head_table_bytes_per_sample"):
                    if not p.get(key):
                        p.pop(key, None)
        blob = json.dumps(payload, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---- serialization ----
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelGraph:
        d = dict(d)
        d["shared_params"] = tuple(SharedParam(**{**sp, "names": tuple(sp["names"]), "layers": tuple(sp["layers"])})
                                   for sp in d.get("shared_params", ()))
        layers = []
        for ld in d.pop("layers"):
            ld = dict(ld)
            pats = tuple(
                TPPattern(**{**p, "column": tuple(p["column"]), "row": tuple(p["row"])})
                for p in ld.pop("tp_patterns", ())
            )
            ld["modules"] = tuple(ld["modules"])
            kernels = {k: KernelMix(**ld.pop(k)) for k in ("kernels_forward", "kernels_backward") if k in ld}
            layers.append(LayerSpec(**ld, tp_patterns=pats, **kernels))
        return cls(**d, layers=tuple(layers))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelGraph:
        return cls.from_dict(json.loads(text))

    def __repr__(self) -> str:
        return (
            f"ModelGraph({self.model_name}, {len(self.layers)} layers, {self.num_params / 1e6:.1f}M params, "
            f"{self.forward_flops / 1e9:.2f} GFLOP fwd/sample, dtype={self.dtype})"
        )


def _drop_moe_defaults(payload: dict[str, Any]) -> None:
    """Remove the MoE fields at their defaults (no MoE block, plain kernels) from a graph's dict."""
    for layer in payload["layers"]:
        if layer.get("moe", 0) is None:
            del layer["moe"]
        elif layer.get("moe") and layer["moe"].get("route_groups") == 1 and layer["moe"].get("route_group_top_k") == 1:
            del layer["moe"]["route_groups"], layer["moe"]["route_group_top_k"]  # routers open to every expert
        if layer.get("saved_activation_bytes_expert", 1) == 0:
            del layer["saved_activation_bytes_expert"]
        for mix in ("kernels_forward", "kernels_backward"):
            for k in (*layer[mix]["kernels"], *layer[mix]["fused"]):
                if k.get("groups") == 1 and k.get("expert") is False:
                    del k["groups"], k["expert"]
