"""DeepSpeed: a plan as a ds_config JSON, and a ds_config read back as a layout.

Written against DeepSpeed's configuration JSON as documented for v0.16/v0.17 (deepspeed.ai/docs/config-json):
train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, bf16.enabled / fp16.enabled,
zero_optimization.stage / offload_optimizer.device / offload_param.device / overlap_comm, compile.enabled,
tensor_parallel.autotp_size (AutoTP training, v0.16.4+) and pipeline.stages /
pipeline.activation_checkpoint_interval (the pipeline engine's section; PipelineModule(num_stages=) must agree).
A ds_config has no context- or expert-parallel degree (Ulysses' sequence-parallel group and
deepspeed.moe.layer.MoE(ep_size=) are set in code): they, and whatever else the format cannot say, go into
the top-level "autopar" object, which DeepSpeed ignores, as "layout" (read back on import) and "notes".
"""

from __future__ import annotations

import json
from typing import Any

from autopar.config import ParallelConfig, PlannerOptions
from autopar.interop import Exported, Imported, format_error, read_config, stage_notes, world_split

__all__ = ["export_plan", "import_layout", "VERSION"]

VERSION = "DeepSpeed ds_config JSON, v0.16/v0.17 documentation"
_KNOWN = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "zero_optimization")


def export_plan(plan) -> Exported:
    c: ParallelConfig = plan.config
    notes = stage_notes(plan)
    zero: dict[str, Any] = {"stage": c.zero_stage, "overlap_comm": c.dp > 1}
    if c.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if c.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {"train_batch_size": plan.global_batch_size,
                           "train_micro_batch_size_per_gpu": c.micro_batch_size,
                           "gradient_accumulation_steps": c.num_microbatches,
                           "bf16": {"enabled": c.precision == "bf16"}, "fp16": {"enabled": c.precision == "fp16"},
                           "zero_optimization": zero}
    if c.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": c.tp}
        if c.sequence_parallel:
            notes.append("sequence parallelism over tp has no ds_config option (AutoTP keeps activations whole); the "
                         "plan priced it with sp")
    if c.pp > 1:
        cfg["pipeline"] = {"stages": c.pp, "activation_checkpoint_interval": 1 if c.recompute == "full" else 0}
        if c.schedule != "1f1b":
            notes.append(f"schedule={c.schedule}: DeepSpeed's pipeline engine runs its own 1F1B (TrainSchedule); "
                         "written as that, the closest")
    if c.recompute != "none":
        notes.append(f"recompute={c.recompute}: a ds_config does not choose what a layer recomputes (the model calls "
                     "deepspeed.checkpointing.checkpoint); checkpoint each block" +
                     (" in full" if c.recompute == "full" else f" with the {c.recompute} policy"))
    if c.compile:
        cfg["compile"] = {"enabled": True, "backend": "inductor"}
    if c.fp8 != "none":
        notes.append(f"fp8={c.fp8}: a ds_config has no FP8 training option (Transformer Engine or torchao in the "
                     "model); nothing written")
    if c.ep > 1:
        notes.append(f"ep={c.ep}: set deepspeed.moe.layer.MoE(ep_size={c.ep}) in the model (not a ds_config key)")
    if c.cp > 1:
        notes.append(f"cp={c.cp}: DeepSpeed's sequence parallelism (Ulysses) is set in code; autopar priced ring "
                     "context parallelism over mirrored chunks")
    layout = {"tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep, "etp": c.etp, "recompute": c.recompute,
              "sequence_parallel": c.sequence_parallel}
    cfg["autopar"] = {"plan": f"{plan.model_name} on {plan.cluster_name}: {c}", "written_for": VERSION,
                      "layout": layout, "notes": notes}
    return Exported("deepspeed", json.dumps(cfg, indent=2) + "\n", tuple(notes))


def _int(d: dict, key: str, default: int, source: str) -> int:
    value = d.get(key, default)
    if value == "auto":
        raise format_error(source, f"{key} is \"auto\" (filled in by the HF Trainer at launch)",
                           f"write the number the run uses for {key}")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise format_error(source, f"{key} = {value!r} is not a positive integer", f"give {key} a positive integer")
    return value


def import_layout(source: str, world_size: int, *, precision: str | None = None,
                  blocks: int | None = None) -> Imported:
    """The layout ds_config `source` runs on `world_size` devices."""
    del blocks  # a ds_config never counts layers
    cfg = read_config(source, json.loads, "JSON", (json.JSONDecodeError,), "pass a DeepSpeed ds_config .json")
    if not isinstance(cfg, dict) or not any(k in cfg for k in _KNOWN):
        raise format_error(source, f"has none of {', '.join(_KNOWN)}, so it is not a DeepSpeed ds_config",
                           "pass the JSON given to deepspeed.initialize(config=...)")
    layout = cfg.get("autopar", {}).get("layout", {}) if isinstance(cfg.get("autopar"), dict) else {}
    tp = _int(cfg.get("tensor_parallel", {}), "autotp_size", 1, source)
    pipe = cfg.get("pipeline", {})
    pp = 1 if pipe.get("stages", "auto") == "auto" else _int(pipe, "stages", 1, source)
    cp, ep, etp = (_int(layout, k, 1, source) for k in ("cp", "ep", "etp"))
    dp = world_split(source, world_size, tp, pp, cp)
    mbs = _int(cfg, "train_micro_batch_size_per_gpu", 1, source)
    gas = _int(cfg, "gradient_accumulation_steps", 1, source)
    total = _int(cfg, "train_batch_size", mbs * gas * dp, source)
    if total != mbs * gas * dp:
        raise format_error(source, f"train_batch_size {total} ≠ train_micro_batch_size_per_gpu · "
                           f"gradient_accumulation_steps · dp = {mbs}·{gas}·{dp} (dp = world {world_size} / tp·pp·cp)",
                           "make them agree (DeepSpeed refuses the same config)")
    zero_cfg = cfg.get("zero_optimization", {})
    stage = zero_cfg.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise format_error(source, f"zero_optimization.stage = {stage!r} is not a ZeRO stage", "use 0, 1, 2 or 3")
    notes = []
    devices = {k: (zero_cfg.get(k) or {}).get("device", "none") for k in ("offload_optimizer", "offload_param")}
    for key, device in devices.items():
        if device not in ("none", "cpu"):
            raise format_error(source, f"zero_optimization.{key}.device = {device!r} is not priced (autopar models "
                               "host-memory offload only)", f"set {key}.device to \"cpu\" or \"none\"")
    offload = ("params" if devices["offload_param"] == "cpu" else
               "optimizer" if devices["offload_optimizer"] == "cpu" else "none")
    if offload == "params" and stage != 3:
        raise format_error(source, f"offload_param needs ZeRO-3 (stage is {stage})", "set zero_optimization.stage 3")
    fp16, bf16 = (bool((cfg.get(k) or {}).get("enabled")) for k in ("fp16", "bf16"))
    if fp16 and bf16:
        raise format_error(source, "both fp16.enabled and bf16.enabled", "enable one")
    recompute = layout.get("recompute")
    if recompute is None:
        recompute = "full" if pipe.get("activation_checkpoint_interval", 0) else "none"
        if cfg.get("activation_checkpointing"):
            notes.append("activation_checkpointing configures deepspeed.checkpointing, not which layers recompute; "
                         f"priced as recompute={recompute}")
    config = ParallelConfig(
        tp=tp, pp=pp, dp=dp, cp=cp, zero_stage=stage, micro_batch_size=mbs, num_microbatches=gas,
        recompute=recompute, sequence_parallel=bool(layout.get("sequence_parallel", False)) and tp > 1,
        compile=bool((cfg.get("compile") or {}).get("enabled")), offload=offload, ep=ep, etp=etp,
        precision=precision or ("bf16" if bf16 else "fp16" if fp16 else "fp32"))
    return Imported("deepspeed", config, PlannerOptions(pipeline_runtime="deepspeed"), None, tuple(notes))
