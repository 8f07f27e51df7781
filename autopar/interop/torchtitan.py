"""torchtitan: a plan as a job-config TOML, and a job-config TOML read back as a layout.

Written against torchtitan's `JobConfig` (torchtitan/config/job_config.py, main of late 2025, the v0.2 line:
[parallelism] data_parallel_replicate_degree / data_parallel_shard_degree / fsdp_reshard_after_forward /
tensor_parallel_degree / pipeline_parallel_degree / pipeline_parallel_schedule /
pipeline_parallel_microbatch_size / pipeline_parallel_layers_per_stage / context_parallel_degree /
expert_parallel_degree / expert_tensor_parallel_degree / expert_parallel_comm_backend; [training]
local_batch_size / global_batch_size / seq_len / mixed_precision_param / mixed_precision_reduce /
enable_cpu_offload; [activation_checkpoint] mode / selective_ac_option; [compile] enable / components;
[quantize.linear.float8] recipe_name, enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp;
confirmed against torchtitan's docs/float8.md TOML example).

Batch: torchtitan's local_batch_size is what one data-parallel rank runs per step with pp > 1 (split into
pipeline_parallel_microbatch_size micro-batches) and per forward with pp = 1 (gradient accumulation makes up
global_batch_size), so mbs = pipeline_parallel_microbatch_size (pp > 1) or local_batch_size, m = global / (dp · mbs).
"""

from __future__ import annotations

from typing import Any

import tomllib

from autopar.config import ParallelConfig, PlannerOptions
from autopar.interop import Exported, Imported, format_error, num_blocks, read_config, stage_notes, world_split

__all__ = ["export_plan", "import_layout", "VERSION"]

VERSION = "torchtitan JobConfig (torchtitan/config/job_config.py, main late 2025, v0.2 line)"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B"}
PRECISION = {"bf16": "bfloat16", "fp32": "float32"}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(v)


def export_plan(plan) -> Exported:
    c: ParallelConfig = plan.config
    notes = stage_notes(plan)
    replicate, shard, reshard = c.dp, 1, "default"
    if c.zero_stage == 3:
        replicate, shard = 1, c.dp
    elif c.zero_stage in (1, 2):
        replicate, shard, reshard = 1, c.dp, "never"
        if c.zero_stage == 1:
            notes.append("ZeRO-1 (optimizer states sharded, gradients whole): torchtitan's FSDP2 shards gradients too; "
                         "written as ZeRO-2's fsdp_reshard_after_forward = \"never\" (the closest)")
    etp = c.etp
    if c.ep > 1 and c.tp > 1 and c.etp == 1 and not c.ep_folded:
        etp = c.tp
        notes.append(f"ep={c.ep} over data-parallel ranks with experts replicated over tp={c.tp} is not a torchtitan "
                     f"layout (at etp = 1 it takes ep as a multiple of tp); written as expert_tensor_parallel_degree = "
                     f"{c.tp} (each expert split over tp, the closest)")
    if c.ep > 1 and c.zero_stage == 0:
        notes.append("torchtitan lays expert parallelism over FSDP's shard dimension; with ZeRO-0 (DDP) set "
                     "data_parallel_shard_degree instead if it refuses the layout")
    recompute = {"none": ("none", None), "full": ("full", None), "op_sac": ("selective", "op"),
                 "selective": ("selective", "op")}[c.recompute]
    if c.recompute == "selective":
        notes.append("recompute=selective (the attention core only, Korthikanti et al.) has no torchtitan mode; "
                     "written as per-op selective checkpointing (selective_ac_option = \"op\"), the closest")
    precision = PRECISION.get(c.precision)
    if precision is None:
        notes.append(f"precision={c.precision}: torchtitan's mixed_precision_param is bfloat16 or float32; written as "
                     "bfloat16, the closest 16-bit policy")
        precision = "bfloat16"
    offload = c.offload != "none"
    if c.offload == "optimizer":
        notes.append("offload=optimizer (optimizer states and step on the host) has no torchtitan option; written as "
                     "enable_cpu_offload = true (FSDP2 offloads parameters, gradients and optimizer states: more)")
    if c.microbatch_group is not None:
        notes.append(f"microbatch_group={c.microbatch_group} (interleaved 1F1B's N) has no torchtitan option; torch's "
                     "Interleaved1F1B runs N = pp")
    local = c.micro_batch_size * c.num_microbatches if c.pp > 1 else c.micro_batch_size
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": reshard, "tensor_parallel_degree": c.tp,
        "pipeline_parallel_degree": c.pp, "pipeline_parallel_schedule": SCHEDULES[c.schedule],
        "pipeline_parallel_microbatch_size": c.micro_batch_size, "context_parallel_degree": c.cp,
        "expert_parallel_degree": c.ep, "expert_tensor_parallel_degree": etp}
    if c.virtual_stages > 1:
        blocks = num_blocks(plan)
        per = blocks // (c.pp * c.virtual_stages)
        par["pipeline_parallel_layers_per_stage"] = max(1, per)
        if per * c.pp * c.virtual_stages != blocks:
            notes.append(f"{blocks} blocks do not split evenly into pp·v = {c.pp * c.virtual_stages} stages; "
                         f"pipeline_parallel_layers_per_stage = {max(1, per)} is the closest")
    if c.tp > 1 and not c.sequence_parallel:
        notes.append("tp without sequence parallelism: torchtitan's tensor parallelism always shards the norms' "
                     "sequence (sequence parallel); it runs with sp")
    sections: dict[str, dict[str, Any]] = {
        "training": {"local_batch_size": local, "global_batch_size": plan.global_batch_size,
                     "seq_len": plan.seq_len or 2048, "mixed_precision_param": precision,
                     "mixed_precision_reduce": "float32", "enable_cpu_offload": offload},
        "parallelism": par,
        "activation_checkpoint": {"mode": recompute[0], **({"selective_ac_option": recompute[1]}
                                                           if recompute[1] else {})},
        "compile": {"enable": c.compile, "components": ["model", "loss"] if c.compile else []},
    }
    if c.fp8 != "none":
        sections["model"] = {"converters": ["quantize.linear.float8"]}
        fp8: dict[str, Any] = {"recipe_name": c.fp8}
        if c.fp8 == "tensorwise" and c.zero_stage >= 2:  # FSDP: the weights all-gathered in float8, as priced
            fp8 |= {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True}
        sections["quantize.linear.float8"] = fp8
    head = [f"# autopar plan for {plan.model_name} on {plan.cluster_name}: {c}",
            f"# written for {VERSION}",
            f"# predicted step {plan.estimate.step_time_s:.3f} s, "
            f"peak {plan.estimate.peak_memory_bytes / 2**30:.1f} GiB"]
    head += [f"# autopar note: {n}" for n in notes]
    body = []
    for name, values in sections.items():
        body.append(f"\n[{name}]")
        body += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return Exported("torchtitan", "\n".join(head + body) + "\n", tuple(notes))


def _get(table: dict, key: str, kind: type, default: Any, source: str) -> Any:
    value = table.get(key, default)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)) or kind is not int and \
            not isinstance(value, kind):
        raise format_error(source, f"{key} = {value!r} is not a {kind.__name__}", f"give {key} a {kind.__name__}")
    return value


def import_layout(source: str, world_size: int, *, precision: str | None = None,
                  blocks: int | None = None) -> Imported:
    """The layout a torchtitan job config runs on `world_size` devices (blocks: the model's repeated layers, to
    read pipeline_parallel_layers_per_stage as virtual stages)."""
    doc = read_config(source, tomllib.loads, "TOML", (tomllib.TOMLDecodeError,), "pass a torchtitan job-config .toml")
    if not isinstance(doc.get("parallelism"), dict) and not isinstance(doc.get("training"), dict):
        raise format_error(source, "has no [parallelism] or [training] table, so it is not a torchtitan job config",
                           "pass the .toml given to torchtitan's train.py --job.config_file")
    par, train = doc.get("parallelism", {}), doc.get("training", {})
    ac, comp = doc.get("activation_checkpoint", {}), doc.get("compile", {})
    g = {k: _get(par, k, int, d, source) for k, d in (
        ("data_parallel_replicate_degree", 1), ("data_parallel_shard_degree", -1), ("tensor_parallel_degree", 1),
        ("pipeline_parallel_degree", 1), ("pipeline_parallel_microbatch_size", 1), ("context_parallel_degree", 1),
        ("expert_parallel_degree", 1), ("expert_tensor_parallel_degree", 1))}
    tp, pp, cp = g["tensor_parallel_degree"], g["pipeline_parallel_degree"], g["context_parallel_degree"]
    replicate, shard = g["data_parallel_replicate_degree"], g["data_parallel_shard_degree"]
    dp = world_split(source, world_size, tp, pp, cp)
    if shard == -1:
        shard = dp // replicate
    if replicate * shard != dp:
        raise format_error(source, f"data_parallel_replicate_degree · data_parallel_shard_degree = {replicate}·{shard} "
                           f"but the cluster leaves dp = {dp} (world {world_size} / tp·pp·cp)",
                           "set data_parallel_shard_degree = -1 or degrees that multiply to the world size")
    notes = []
    reshard = _get(par, "fsdp_reshard_after_forward", str, "default", source)
    if reshard not in ("default", "always", "never"):
        raise format_error(source, f"fsdp_reshard_after_forward = {reshard!r} is not a torchtitan policy",
                           "use default, always or never")
    zero = 0 if shard == 1 else 2 if reshard == "never" else 3
    if replicate > 1 and shard > 1:
        notes.append(f"HSDP (replicate {replicate} × shard {shard}) is priced as ZeRO-{zero} over all dp = {dp} ranks "
                     "(autopar does not model the hybrid split)")
    names = {v.lower(): k for k, v in SCHEDULES.items()}
    schedule_name = _get(par, "pipeline_parallel_schedule", str, "1F1B", source)
    if schedule_name.lower() not in names:
        raise format_error(source, f"pipeline_parallel_schedule = {schedule_name!r} is not one autopar prices",
                           f"use one of {', '.join(SCHEDULES.values())}")
    schedule = names[schedule_name.lower()] if pp > 1 else "1f1b"
    v = 1
    if schedule == "interleaved_1f1b":
        lps = par.get("pipeline_parallel_layers_per_stage")
        v = 2 if lps is None else max(1, round((blocks or 0) / (pp * lps))) if blocks else 2
        if lps is not None and not blocks:
            notes.append("pipeline_parallel_layers_per_stage read without the model's layer count: v = 2")
    local = _get(train, "local_batch_size", int, 8, source)
    mbs = g["pipeline_parallel_microbatch_size"] if pp > 1 else local
    global_batch = _get(train, "global_batch_size", int, -1, source)
    global_batch = dp * local if global_batch == -1 else global_batch
    if mbs < 1 or global_batch % (dp * mbs):
        raise format_error(source, f"global_batch_size {global_batch} is not a multiple of dp · micro-batch = "
                           f"{dp}·{mbs}", "make global_batch_size a multiple of it")
    mode = _get(ac, "mode", str, "selective", source)
    option = str(ac.get("selective_ac_option", "2"))
    if mode == "selective" and option != "op":
        notes.append(f"selective_ac_option = {option!r} (full recompute of every {option}th layer) is priced as "
                     "per-op selective recompute on every layer, the closest single mode")
    recompute = {"none": "none", "full": "full", "selective": "op_sac"}.get(mode)
    if recompute is None:
        raise format_error(source, f"activation_checkpoint.mode = {mode!r} is not one autopar prices",
                           "use none, selective or full")
    mp = _get(train, "mixed_precision_param", str, "bfloat16", source)
    prec = {"bfloat16": "bf16", "float32": "fp32"}.get(mp)
    if prec is None:
        raise format_error(source, f"mixed_precision_param = {mp!r} is not a torchtitan dtype",
                           "use bfloat16 or float32")
    fp8 = doc.get("quantize", {}).get("linear", {}).get("float8", {}).get("recipe_name") or "none"
    if fp8 not in ("none", "tensorwise", "rowwise"):
        raise format_error(source, f"quantize.linear.float8.recipe_name = {fp8!r} is not one autopar prices",
                           "use tensorwise or rowwise")
    compile_on = bool(comp.get("enable", False))
    offload = bool(train.get("enable_cpu_offload", False))
    if offload and zero != 3:
        notes.append(f"enable_cpu_offload puts FSDP2's sharded parameters on the host: priced as ZeRO-3 with "
                     f"offload=params (the layout read as ZeRO-{zero})")
        zero = 3
    config = ParallelConfig(
        tp=tp, pp=pp, dp=dp, cp=cp, zero_stage=zero, micro_batch_size=mbs,
        num_microbatches=global_batch // (dp * mbs), schedule=schedule, virtual_stages=v, recompute=recompute,
        sequence_parallel=tp > 1, compile=compile_on, fp8=fp8,
        offload="params" if offload else "none", ep=g["expert_parallel_degree"],
        etp=g["expert_tensor_parallel_degree"], precision=precision or prec)
    dispatcher = "deepep" if par.get("expert_parallel_comm_backend") == "deepep" else "all_to_all"
    fused = compile_on and "loss" in comp.get("components", [])  # a compiled loss never holds fp32 logits
    options = PlannerOptions(pipeline_runtime="torch", ep_dispatcher=dispatcher,
                             loss_kernel="fused" if fused else "fp32_logits")
    return Imported("torchtitan", config, options, train.get("seq_len"), tuple(notes))
