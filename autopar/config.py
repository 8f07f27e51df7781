"""`ParallelConfig` (one layout) and `PlannerOptions` (which layouts the planner may consider).

Vocabulary: tp / cp / pp / dp are the *degrees* of tensor, context (sequence split across ranks),
pipeline and data parallelism (mesh axis sizes, mesh order ("pp", "dp", "cp", "tp"), tp innermost); ep is
the expert-parallel degree of mixture-of-experts layers (docs/design.md §8: experts see the mesh
("pp", "edp", "ep", "etp"), etp · ep · edp = tp · dp). etp is the experts' tensor-parallel degree, 1 or tp.
At etp = 1 the EP group takes the innermost ranks, as Megatron-Core's Parallel Folding lays it out (Liu et
al. 2025, arXiv:2504.14960): where tp divides ep it is folded over the tp ranks and ep / tp consecutive
data-parallel ranks (ep · edp = tp · dp, `ep_folded`), else it spans ep data-parallel ranks, the bank
replicated over tp (ep · edp = dp). At etp = tp (Megatron-Core's ETP = TP) the EP group spans ep
data-parallel ranks (ep divides dp, never folded) and every tp rank holds 1/tp of each of its experts' FFN
(gate/up column-parallel, down row-parallel), the expert outputs summed over tp;
`virtual_stages` is the number of model
chunks per pipeline rank (v in Narayanan et al. 2021, §2.2); a *micro-batch* is what one pipeline
slot processes on one data-parallel rank.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autopar.checks import MAX_DEVICES, MAX_TOP_K, check_number, check_positive_int, is_int, is_real
from autopar.errors import AutoparError, ConfigError
from cost_models.comm import EP_DISPATCHERS
from cost_models.memory import ALLOCATOR_RESERVE_FRACTION, LOSS_KERNELS, RECOMPUTE_MODES
from cost_models.pipeline import PIPELINE_RUNTIMES
from cost_models.precision import PRECISIONS

__all__ = ["ParallelConfig", "ep_folds", "ep_fits", "ep_invalid", "expert_dp", "etp_invalid",
           "PlannerOptions", "SCHEDULES", "RECOMPUTE_MODES", "ZERO_STAGES",
           "FP8_RECIPES", "FP8_RUNTIMES", "FP8_RUNTIME_RECIPES",
           "OFFLOAD_MODES", "OBJECTIVES", "LOSS_KERNELS", "PRECISIONS", "check_options"]

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# "fastest": the layout of least modelled step time; "pessimistic": of least step time at the slow end of its
# error band (cost_models.error_band), so a layout wins only by more than the model's own uncertainty
OBJECTIVES = ("fastest", "pessimistic")
ZERO_STAGES = (0, 1, 2, 3)
# FP8 training recipes, by the framework that runs them (PlannerOptions.fp8_runtime): torchao's float8 training,
# what autopar.codegen.float8 runs (scales per tensor, or per row of each GEMM operand), and Transformer
# Engine's, which autopar prices for runs made with Megatron-LM or NeMo (per-tensor delayed scaling from an amax
# history, per-tensor current scaling, MXFP8's 1×32 block scales): autopar.planner.fp8_costs
FP8_RUNTIME_RECIPES = {"torchao": ("tensorwise", "rowwise"), "transformer_engine": ("delayed", "tensorwise", "mxfp8")}
FP8_RUNTIMES = tuple(FP8_RUNTIME_RECIPES)
FP8_RECIPES = ("none", "tensorwise", "rowwise", "delayed", "mxfp8")
# "optimizer": fp32 masters and moments in host memory, the step on the CPU (ZeRO-Offload, Ren et al. 2021);
# "params": FSDP2's CPUOffloadPolicy (sharded parameters, gradients and optimizer states on the host)
OFFLOAD_MODES = ("none", "optimizer", "params")


def ep_folds(tp: int, ep: int, etp: int = 1) -> bool:
    """Whether expert parallelism ep folds over tensor-parallel degree tp: Megatron-Core's Parallel Folding at
    ETP = 1, the EP group taking the innermost ranks (the tp ranks, then data-parallel ones) when tp divides ep.
    Experts tensor-parallel (etp > 1) keep the tp ranks for their FFN split: never folded."""
    return etp == 1 and tp > 1 and ep > 1 and ep % tp == 0


def expert_dp(tp: int, dp: int, ep: int, etp: int = 1) -> int:
    """Ranks holding the same experts (per cp rank): dp · tp / ep when ep folds over tp, else dp / ep (with
    etp = tp each of them holds the same 1/tp slice of those experts)."""
    return dp * tp // ep if ep_folds(tp, ep, etp) else dp // ep


def etp_invalid(tp: int, dp: int, ep: int, etp: int) -> str | None:
    """Why the experts' tensor-parallel degree etp cannot lay out (None when it can): it is 1 or tp, and
    etp = tp > 1 needs the EP group over data-parallel ranks only (ep divides dp)."""
    if etp == 1:
        return None
    if etp != tp:
        return (f"etp={etp} must be 1 (experts replicated over tp) or tp={tp} (each expert's FFN split over the "
                f"tp ranks, Megatron-Core's ETP = TP); set etp=1" + (f" or etp={tp}" if tp > 1 else ""))
    if dp % ep:
        ok = [e for e in range(1, dp + 1) if dp % e == 0]
        return (f"etp={etp} splits each expert over the tp ranks, so the EP group spans data-parallel ranks only: "
                f"ep={ep} must divide dp={dp} (possible ep: {ok}); or set etp=1 to fold ep over tp")
    return None


def ep_invalid(tp: int, dp: int, ep: int, etp: int = 1) -> str | None:
    """Why expert-parallel degree ep cannot lay out over tp × dp with expert tensor parallelism etp (None when
    it can): it must divide dp (experts over data-parallel ranks, replicated over tp, or split over tp when
    etp = tp) or, folded at etp = 1, be a multiple of tp whose ep / tp divides dp."""
    if etp != 1:
        return etp_invalid(tp, dp, ep, etp)
    if ep_fits(tp, dp, ep):
        return None
    ok = [e for e in range(1, dp * tp + 1) if ep_fits(tp, dp, e)]
    if tp == 1:
        return (f"ep={ep} must divide dp={dp}: experts are split over ep of each stage's data-parallel ranks "
                f"(ep · edp = dp); possible ep: {ok}")
    return (f"ep={ep} must divide dp={dp} (experts over data-parallel ranks, replicated over tp={tp}) or be a "
            f"multiple of tp={tp} dividing dp · tp = {dp * tp} (folded over tp × ep/tp data-parallel ranks, "
            f"Parallel Folding); possible ep: {ok}")


def ep_fits(tp: int, dp: int, ep: int, etp: int = 1) -> bool:
    """Whether expert-parallel degree ep lays out over tp × dp at expert tensor parallelism etp (`ep_invalid`
    says why not)."""
    if etp != 1:
        return etp_invalid(tp, dp, ep, etp) is None
    return dp % (ep // tp) == 0 if ep_folds(tp, ep) else dp % ep == 0


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """One training layout. `recompute` applies to every stage unless a plan's stages refine it."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    # context parallelism: each sequence split over cp ranks, two mirrored chunks each (codegen/context_parallel.py)
    cp: int = 1
    zero_stage: int = 0
    micro_batch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # interleaved 1F1B: micro-batches a rank runs through one chunk before its next (N of Dubey et al. 2024
    # §3.3.2, cost_models.pipeline_order); None: torch's and Megatron-LM's N = pp, run by torch's own schedule
    microbatch_group: int | None = None
    recompute: str = "none"
    sequence_parallel: bool = False
    # each block compiled with torch.compile (autopar.codegen.compile), its pointwise chains fused
    compile: bool = False
    # FP8 GEMMs on top of the 16-bit compute: one of FP8_RECIPES, run by PlannerOptions.fp8_runtime (torchao
    # by default: "tensorwise" or "rowwise"; "delayed" and "mxfp8" are Transformer Engine recipes autopar prices)
    fp8: str = "none"
    # where the optimizer states (and with "params" the parameters) live: one of OFFLOAD_MODES
    offload: str = "none"
    # expert parallelism: each MoE layer's experts split over ep ranks (E / ep each), tokens moved by all-to-all:
    # folded over tp × ep/tp dp ranks where tp divides ep, else over ep dp ranks (module docstring); ZeRO shards
    # expert states over the edp ranks holding the same experts
    ep: int = 1
    # expert tensor parallelism: 1 (each expert whole on its rank, replicated over tp) or tp (each expert's FFN
    # split over the tp ranks, its output summed over them; the EP group then spans dp ranks only: module docstring)
    etp: int = 1
    # training precision policy (cost_models.precision): "bf16"/"fp16" compute in 16 bits over fp32 master
    # weights, optimizer states and gradient reductions; "fp32" computes on the masters
    precision: str = "bf16"

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "cp", "micro_batch_size", "num_microbatches", "virtual_stages", "ep", "etp"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"ParallelConfig.{f}={v!r}; it must be a positive integer")
        if self.zero_stage not in ZERO_STAGES:
            raise ConfigError(f"ParallelConfig.zero_stage={self.zero_stage!r}; expected one of {ZERO_STAGES}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"ParallelConfig.schedule={self.schedule!r}; expected one of {SCHEDULES}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"ParallelConfig.recompute={self.recompute!r}; expected one of {RECOMPUTE_MODES}")
        if self.fp8 not in FP8_RECIPES:
            raise ConfigError(f"ParallelConfig.fp8={self.fp8!r}; expected one of {FP8_RECIPES}")
        if self.offload not in OFFLOAD_MODES:
            raise ConfigError(f"ParallelConfig.offload={self.offload!r}; expected one of {OFFLOAD_MODES}")
        if self.offload == "params" and self.zero_stage != 3:
            raise ConfigError(f"offload='params' is FSDP2's CPU offload of sharded parameters and needs zero_stage=3 "
                              f"(got {self.zero_stage}); set zero_stage=3 or offload='optimizer'")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"ParallelConfig.precision={self.precision!r}; expected one of {PRECISIONS}")
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("ParallelConfig.sequence_parallel=True needs tp > 1; set sequence_parallel=False")
        if self.schedule == "interleaved_1f1b":
            if self.pp == 1:
                raise ConfigError("schedule 'interleaved_1f1b' needs pp > 1; use '1f1b' or set pp")
            if self.num_microbatches % self.pp:
                raise ConfigError(
                    f"interleaved_1f1b needs num_microbatches ({self.num_microbatches}) divisible by pp ({self.pp})"
                )
            if self.microbatch_group is not None and (not is_int(self.microbatch_group)
                                                      or not 1 <= self.microbatch_group <= self.num_microbatches):
                raise ConfigError(f"ParallelConfig.microbatch_group={self.microbatch_group!r}; it must be an integer "
                                  f"from 1 to num_microbatches ({self.num_microbatches}), or None for pp")
        elif self.virtual_stages != 1:
            raise ConfigError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved_1f1b'")
        elif self.microbatch_group is not None:
            raise ConfigError(f"microbatch_group={self.microbatch_group} needs schedule='interleaved_1f1b' (the "
                              "micro-batches a rank runs through one of its chunks before the next)")
        if why := ep_invalid(self.tp, self.dp, self.ep, self.etp):
            raise ConfigError(f"ParallelConfig.{why}")

    @property
    def ep_folded(self) -> bool:
        """Whether the EP group folds over the tp ranks (tp divides ep): the module docstring."""
        return ep_folds(self.tp, self.ep, self.etp)

    @property
    def ep_dp(self) -> int:
        """The data-parallel ranks one EP group spans: ep / tp when folded, else ep."""
        return self.ep // self.tp if self.ep_folded else self.ep

    @property
    def edp(self) -> int:
        """Expert data parallelism: the ranks of a stage (per cp rank) holding the same experts, dp · tp / ep when
        folded, else dp / ep (the bank then also replicated over tp, or split over it at etp = tp); ZeRO shards
        expert states over them."""
        return expert_dp(self.tp, self.dp, self.ep, self.etp)

    def ep_text(self) -> str:
        """"ep=8 (over tp2 x dp4, edp=4)": the EP degree, the ranks its group spans and how the tp ranks hold the
        experts ("" for ep = 1 and etp = 1)."""
        if self.ep == 1 and self.etp == 1:
            return ""
        over = f"tp{self.tp} x dp{self.ep_dp}" if self.ep_folded else f"dp{self.ep}"
        tp = (f" x tp{self.tp} replicas" if self.tp > 1 and not self.ep_folded and self.etp == 1
              else f" x etp{self.etp} FFN shards" if self.etp > 1 else "")
        return f"ep={self.ep} (over {over}{tp}, edp={self.edp})"

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.micro_batch_size * self.num_microbatches

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON values; microbatch_group and etp only where set (plans written before them stay
        alike)."""
        d = dataclasses.asdict(self)
        if d["microbatch_group"] is None:
            del d["microbatch_group"]
        if d["etp"] == 1:
            del d["etp"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParallelConfig:
        return cls(**d)

    def __str__(self) -> str:
        cp = f",cp={self.cp}" if self.cp > 1 else ""
        s = f"tp={self.tp}{cp},pp={self.pp},dp={self.dp},zero={self.zero_stage},mbs={self.micro_batch_size}," \
            f"m={self.num_microbatches},schedule={self.schedule}"
        if self.virtual_stages > 1:
            s += f",v={self.virtual_stages}"
        if self.microbatch_group is not None:
            s += f",microbatch_group={self.microbatch_group}"
        s += f",recompute={self.recompute}"
        if self.sequence_parallel:
            s += ",sp=1"
        if self.compile:
            s += ",compile=1"
        if self.fp8 != "none":
            s += f",fp8={self.fp8}"
        if self.offload != "none":
            s += f",offload={self.offload}"
        if self.ep > 1:
            s += f",ep={self.ep}"
        if self.etp > 1:
            s += f",etp={self.etp}"
        return s + f",precision={self.precision}"

    _ALIASES = {"zero": "zero_stage", "mbs": "micro_batch_size", "m": "num_microbatches",
                "v": "virtual_stages", "sp": "sequence_parallel"}

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> ParallelConfig:
        """Parse `str(config)` or a partial spec such as "tp=4,pp=8" (missing fields from `defaults`)."""
        return cls(**{**defaults, **cls.parse_fields(text)})

    @classmethod
    def parse_fields(cls, text: str) -> dict[str, Any]:
        """The fields a spec such as "tp=4,pp=8,zero=1" sets, by their full names, not yet validated together."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ConfigError(f"config part {part!r} is not key=value; example: 'tp=4,pp=8,zero=1'")
            key, raw = (s.strip() for s in part.split("=", 1))
            given, key = key, cls._ALIASES.get(key, key)
            if key not in fields:
                raise ConfigError(f"unknown config key {key!r}; keys: {', '.join(list(fields) + list(cls._ALIASES))}")
            if key in values:
                alias = f" (as {key})" if given != key else ""
                raise ConfigError(f"config key {given!r} is given twice in {text!r}{alias}; give each key once")
            if key in ("schedule", "recompute", "fp8", "offload", "precision"):
                values[key] = raw
            elif key in ("sequence_parallel", "compile"):
                values[key] = raw.lower() in ("1", "true", "yes", "on")
            else:
                try:
                    values[key] = int(raw)
                except ValueError:
                    raise ConfigError(f"config value {key}={raw!r} is not an integer") from None
        return values


@dataclass(frozen=True, kw_only=True)
class PlannerOptions:
    """Restricts the planner's search. A field set to a value pins it; None searches it."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None
    cp: int | None = None
    zero_stage: int | None = None
    micro_batch_size: int | None = None
    num_microbatches: int | None = None
    schedule: str | None = None
    virtual_stages: int | None = None
    # interleaved 1F1B's N (ParallelConfig.microbatch_group): a value pins it; None prices torch's N = pp, and
    # where pp, virtual_stages and num_microbatches are pinned and that does not fit, also N from pp/2 to pp − 1
    # (less warm-up memory for more bubble)
    microbatch_group: int | None = None
    recompute: str | None = None
    sequence_parallel: bool | None = None
    # False: eager blocks (what codegen runs unless asked); True: compiled; None: the planner prices both
    compile: bool | None = False
    ep: int | None = None  # expert parallelism (MoE models; dense models have ep = 1 only)
    # expert tensor parallelism, 1 or tp (ParallelConfig.etp); None: the planner prices both where ep divides dp
    etp: int | None = None
    # "none" (the default: FP8 changes numerics, so it is opt-in), a recipe to pin, or None: the planner picks
    fp8: str | None = "none"
    # None: the planner prices every offload mode and takes one where nothing else fits or it is faster
    offload: str | None = None
    # None: the device's practitioner default (cost_models.precision.default_precision: bf16 on GPUs with
    # bf16 tensor throughput, fp32 on CPU); a value pins it
    precision: str | None = None
    exclude_schedules: tuple[str, ...] = ()
    exclude_zero_stages: tuple[int, ...] = ()
    exclude_recompute: tuple[str, ...] = ()  # recompute modes no layer may use (e.g. to compare spaces)
    recompute_per_layer: bool = True  # False: one recompute mode for all layers of a pipeline rank
    max_virtual_stages: int = 4
    memory_reserve_fraction: float = ALLOCATOR_RESERVE_FRACTION  # CUDA context, NCCL, cuBLAS (cost_models.memory)
    time_limit_s: float = 60.0
    top_k: int = 5  # runner-up configurations kept in the plan
    objective: str = "fastest"  # OBJECTIVES
    # how the training code computes the loss (cost_models.memory.LOSS_KERNELS). None: as autopar's runtime
    # does, "chunked" for a loss_fn of the logits (lm_cross_entropy) and "fp32_logits" for a model's own loss
    # (autopar.capture.loss_mode.runtime_loss_kernel); "fp32_logits" for a loss_fn that upcasts all the
    # logits (F.cross_entropy(logits.float(), ...)), or to price another framework's run; "fused" for a fused kernel
    loss_kernel: str | None = None
    # the router's load imbalance the MoE layers are priced at (busiest expert-parallel rank's routed tokens ÷
    # the mean, autopar.planner.moe_load); None: the captured graph's (MoESpec.load_imbalance, by default
    # autopar.capture.moe.DEFAULT_LOAD_IMBALANCE). A plan records it (Plan.router_skew)
    router_skew: float | None = None
    # the runtime pp > 1 is priced on (cost_models.pipeline.PIPELINE_RUNTIMES: its boundary transfers, what it
    # holds in memory and how its framework launches expert GEMMs): "torch", the one autopar runs
    # (torch.distributed.pipelining); "megatron" or "deepspeed" to price a run made with another framework
    pipeline_runtime: str = "autopar"
    # how expert-parallel groups move routed tokens (cost_models.comm.EP_DISPATCHERS): "all_to_all", as autopar
    # runs it; "deepep" to price a run made with DeepEP's node-deduplicating kernels
    ep_dispatcher: str = "all_to_all"
    # the framework that runs FP8 GEMMs (FP8_RUNTIMES: its recipes, which casts it fuses, the FP8 weight copies
    # it holds; autopar.planner.fp8_costs): "torchao", the one autopar's codegen runs; "transformer_engine" to
    # price a run made with Megatron-LM or NeMo
    fp8_runtime: str = "torchao"

    def __post_init__(self) -> None:
        for f in ("tp", "pp", "dp", "micro_batch_size", "num_microbatches", "virtual_stages", "ep",
                  "microbatch_group", "etp"):
            if getattr(self, f) is not None:
                check_positive_int(f"PlannerOptions.{f}", getattr(self, f), error=ConfigError,
                                   bound=MAX_DEVICES if f in ("tp", "pp", "dp", "ep", "etp") else None)
        if self.etp is not None and self.tp is not None and self.etp not in (1, self.tp):
            raise ConfigError(f"PlannerOptions.etp={self.etp} with tp={self.tp}: the experts' tensor-parallel degree "
                              f"is 1 or tp; set etp=1, etp={self.tp} or leave it unset")
        check_positive_int("PlannerOptions.max_virtual_stages", self.max_virtual_stages, error=ConfigError)
        if not is_int(self.top_k) or not 0 <= self.top_k <= MAX_TOP_K:
            raise ConfigError(f"PlannerOptions.top_k={self.top_k!r}; it must be an integer from 0 to {MAX_TOP_K} "
                              "(runner-up layouts kept)")
        check_number("PlannerOptions.time_limit_s", self.time_limit_s, positive=True, error=ConfigError)
        if not is_real(self.memory_reserve_fraction) or not 0.0 <= self.memory_reserve_fraction < 1.0:
            raise ConfigError(f"PlannerOptions.memory_reserve_fraction={self.memory_reserve_fraction!r}; it must "
                              "be in [0, 1)")
        for f in ("sequence_parallel", "compile"):
            if getattr(self, f) is not None and not isinstance(getattr(self, f), bool):
                raise ConfigError(f"PlannerOptions.{f}={getattr(self, f)!r}; it must be True, False or None")
        if not isinstance(self.recompute_per_layer, bool):
            raise ConfigError(f"PlannerOptions.recompute_per_layer={self.recompute_per_layer!r}; it must be True "
                              "or False")
        if self.zero_stage is not None and (not is_int(self.zero_stage) or self.zero_stage not in ZERO_STAGES):
            raise ConfigError(f"PlannerOptions.zero_stage={self.zero_stage!r}; expected one of {ZERO_STAGES}")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ConfigError(f"PlannerOptions.schedule={self.schedule!r}; expected one of {SCHEDULES}")
        if self.recompute is not None and self.recompute not in RECOMPUTE_MODES:
            raise ConfigError(f"PlannerOptions.recompute={self.recompute!r}; expected one of {RECOMPUTE_MODES}")
        if set(self.exclude_recompute) - set(RECOMPUTE_MODES) or set(RECOMPUTE_MODES) <= set(self.exclude_recompute):
            raise ConfigError(f"PlannerOptions.exclude_recompute={self.exclude_recompute!r}; exclude some of "
                             f"{RECOMPUTE_MODES}, not all")
        if self.fp8_runtime not in FP8_RUNTIMES:
            raise ConfigError(f"PlannerOptions.fp8_runtime={self.fp8_runtime!r}; expected one of {FP8_RUNTIMES} "
                              "('torchao': what autopar runs; 'transformer_engine': Megatron-LM / NeMo runs)")
        if self.fp8 is not None and self.fp8 not in FP8_RECIPES:
            raise ConfigError(f"PlannerOptions.fp8={self.fp8!r}; expected one of {FP8_RECIPES} or None (auto)")
        recipes = FP8_RUNTIME_RECIPES[self.fp8_runtime]
        if self.fp8 not in (None, "none", *recipes):
            other = next(r for r, rs in FP8_RUNTIME_RECIPES.items() if self.fp8 in rs)
            raise ConfigError(f"PlannerOptions.fp8={self.fp8!r} is a {other} recipe, but fp8_runtime="
                              f"{self.fp8_runtime!r} runs {recipes}; set fp8_runtime={other!r} or pick one of those")
        if self.offload is not None and self.offload not in OFFLOAD_MODES:
            raise ConfigError(f"PlannerOptions.offload={self.offload!r}; expected one of {OFFLOAD_MODES} "
                              "or None (auto)")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ConfigError(f"PlannerOptions.precision={self.precision!r}; expected one of {PRECISIONS}")
        bad = [s for s in self.exclude_schedules if s not in SCHEDULES]
        if bad:
            raise ConfigError(f"PlannerOptions.exclude_schedules has unknown {bad}; expected from {SCHEDULES}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"PlannerOptions.objective={self.objective!r}; expected one of {OBJECTIVES}")
        if self.loss_kernel is not None and self.loss_kernel not in LOSS_KERNELS:
            raise ConfigError(f"PlannerOptions.loss_kernel={self.loss_kernel!r}; expected one of {LOSS_KERNELS} "
                              "or None (as autopar's runtime computes the loss)")
        if self.router_skew is not None and (not is_real(self.router_skew) or not 1.0 <= self.router_skew < 1e6):
            raise ConfigError(f"PlannerOptions.router_skew={self.router_skew!r}; it must be a number ≥ 1 (the "
                              "busiest expert-parallel rank's routed tokens ÷ the mean; 1 = balanced)")
        if self.pipeline_runtime not in PIPELINE_RUNTIMES:
            raise ConfigError(f"PlannerOptions.pipeline_runtime={self.pipeline_runtime!r}; expected one of "
                              f"{tuple(PIPELINE_RUNTIMES)}")
        if self.ep_dispatcher not in EP_DISPATCHERS:
            raise ConfigError(f"PlannerOptions.ep_dispatcher={self.ep_dispatcher!r}; expected one of "
                              f"{EP_DISPATCHERS}")


def check_options(options: Any) -> PlannerOptions:
    """`options` (PlannerOptions checks its own fields on construction), or the defaults for None."""
    if options is None:
        return PlannerOptions()
    if not isinstance(options, PlannerOptions):
        raise AutoparError(f"options={options!r} ({type(options).__name__}); pass autopar.PlannerOptions(...) "
                           "or None")
    return options
