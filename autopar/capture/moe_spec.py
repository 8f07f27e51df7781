"""`MoESpec`: a mixture-of-experts block as capture finds it and the planner and codegen read it (a field of
`autopar.capture.graph.LayerSpec`). Frozen, validated, round-trips through JSON with the graph."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MoESpec"]


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """A mixture-of-experts block in a layer (found by autopar.capture.moe.find_moe). Module names are
    fully qualified. Per-sample figures are at the example's sequence length.

    experts: the expert bank (E weight matrices stacked per projection, or a list of E modules).
    router: the module scoring each token against the E experts (None when top-level code scores them).
    block: the module holding both, whose other parameters (shared experts) every token passes through.
    expert_params / expert_param_bytes: all E experts' parameters (kept apart from the dense ones: under
      expert parallelism a rank holds E / ep of them).
    shared_params: the block's dense parameters besides the router and the bank (shared experts, gates).
    ffn_hidden_size: one expert's FFN width.
    dispatch_bytes_per_sample: the routed token copies (tokens · top_k · hidden, model dtype) that the
      all-to-all dispatch sends and the combine returns, per sample.
    tokens_per_sample: the tokens (sequence positions) of one sample the router scores.
    load_imbalance: the router's systematic skew, busiest expert-parallel rank's tokens ÷ the mean in
      expectation (autopar.capture.moe.DEFAULT_LOAD_IMBALANCE); the sampling spread of a finite micro-batch
      comes on top (autopar.planner.moe_load).
    route_groups / route_group_top_k: group-limited routing (DeepSeek-V2 §2.2.2 "device-limited routing",
      DeepSeek-V3 §2.1.2 "node-limited routing", arXiv 2405.04434 / 2412.19437): the router splits the E
      experts into route_groups contiguous groups of E / route_groups, picks route_group_top_k of them per
      token and its top_k experts only inside those (found from the router's data flow:
      autopar.capture.moe.find_moe). 1 of 1: every expert open to every token.
    """

    experts: str
    router: str | None
    block: str
    num_experts: int
    top_k: int
    expert_params: int
    expert_param_bytes: int
    shared_params: int = 0
    ffn_hidden_size: int = 0
    dispatch_bytes_per_sample: int = 0
    tokens_per_sample: int = 0
    load_imbalance: float = 1.0
    route_groups: int = 1
    route_group_top_k: int = 1

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"MoESpec {self.experts}: top_k={self.top_k} of num_experts={self.num_experts}; "
                             "expected 1 ≤ top_k ≤ num_experts")
        if min(self.expert_params, self.expert_param_bytes, self.shared_params, self.dispatch_bytes_per_sample,
               self.tokens_per_sample) < 0:
            raise ValueError(f"MoESpec {self.experts}: negative size")
        if not 1.0 <= self.load_imbalance <= self.num_experts / self.top_k + 1e-9:
            raise ValueError(f"MoESpec {self.experts}: load_imbalance={self.load_imbalance} must lie in "
                             f"[1, num_experts / top_k = {self.num_experts / self.top_k:g}] (1 = perfectly even)")
        g, m = self.route_groups, self.route_group_top_k
        if g < 1 or self.num_experts % g or not 1 <= m <= g or m * (self.num_experts // g) < self.top_k:
            raise ValueError(f"MoESpec {self.experts}: route_group_top_k={m} of route_groups={g} over "
                             f"num_experts={self.num_experts}, top_k={self.top_k}; expected groups dividing the "
                             "experts and 1 ≤ route_group_top_k ≤ route_groups with top_k experts in the open groups")

    @property
    def group_limited(self) -> bool:
        """Whether the router opens only some expert groups to each token (route_group_top_k < route_groups)."""
        return self.route_group_top_k < self.route_groups

    def max_degree_ok(self, ep: int) -> bool:
        """Whether expert-parallel degree `ep` splits the experts evenly."""
        return self.num_experts % ep == 0

    def ffn_split_ok(self, etp: int) -> bool:
        """Whether expert tensor-parallel degree `etp` splits each expert's FFN width evenly (unknown width: 1)."""
        return etp == 1 or (self.ffn_hidden_size > 0 and self.ffn_hidden_size % etp == 0)
