"""Megatron-LM / NeMo: a plan as Megatron-LM's command-line arguments, and such arguments read back as a layout.

Written against Megatron-LM's megatron/training/arguments.py of the core_r0.13/0.14 line (mid/late 2025):
--tensor-model-parallel-size, --pipeline-model-parallel-size, --context-parallel-size,
--expert-model-parallel-size, --expert-tensor-parallel-size, --num-virtual-stages-per-pipeline-rank (or the
older --num-layers-per-virtual-pipeline-stage with --num-layers), --microbatch-group-size-per-virtual-pipeline-stage,
--micro-batch-size, --global-batch-size, --seq-length, --recompute-granularity {full,selective},
--recompute-method {uniform,block}, --recompute-num-layers, --recompute-modules, --sequence-parallel,
--use-distributed-optimizer, --use-megatron-fsdp with --data-parallel-sharding-strategy
{no_shard,optim,optim_grads,optim_grads_params}, --overlap-grad-reduce, --overlap-param-gather,
--optimizer-cpu-offload, --bf16/--fp16, --fp8-format/--fp8-recipe, --moe-token-dispatcher-type /
--moe-enable-deepep, --cross-entropy-loss-fusion. NeMo 2 takes the same names as MegatronStrategy fields
(tensor_model_parallel_size, ...).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from autopar.config import ParallelConfig, PlannerOptions
from autopar.interop import Exported, Imported, format_error, num_blocks, stage_notes, world_split

__all__ = ["export_plan", "import_layout", "VERSION"]

VERSION = "Megatron-LM megatron/training/arguments.py, core_r0.13/r0.14 line"
_SHARDING = {1: "optim", 2: "optim_grads", 3: "optim_grads_params"}
# flags that take a value, with the autopar meaning read from them; switches are listed in _SWITCHES
_VALUED = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
           "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--num-virtual-stages-per-pipeline-rank",
           "--num-layers-per-virtual-pipeline-stage", "--microbatch-group-size-per-virtual-pipeline-stage",
           "--micro-batch-size", "--global-batch-size", "--seq-length", "--num-layers", "--recompute-granularity",
           "--recompute-method", "--recompute-num-layers", "--data-parallel-sharding-strategy", "--fp8-format",
           "--fp8-recipe", "--moe-token-dispatcher-type", "--optimizer-offload-fraction")
_SWITCHES = ("--sequence-parallel", "--use-distributed-optimizer", "--use-megatron-fsdp", "--use-custom-fsdp",
             "--overlap-grad-reduce", "--overlap-param-gather", "--optimizer-cpu-offload", "--bf16", "--fp16",
             "--moe-enable-deepep", "--cross-entropy-loss-fusion", "--tp-comm-overlap")


def export_plan(plan) -> Exported:
    c: ParallelConfig = plan.config
    notes = stage_notes(plan)
    args: list[str] = [f"--tensor-model-parallel-size {c.tp}", f"--pipeline-model-parallel-size {c.pp}",
                       f"--context-parallel-size {c.cp}", f"--micro-batch-size {c.micro_batch_size}",
                       f"--global-batch-size {plan.global_batch_size}"]
    if plan.seq_len:
        args.append(f"--seq-length {plan.seq_len}")
    if c.ep > 1 or c.etp > 1:
        args += [f"--expert-model-parallel-size {c.ep}", f"--expert-tensor-parallel-size {c.etp}"]
        if c.etp == 1 and c.tp > 1 and not c.ep_folded:
            notes.append(f"ep={c.ep} over dp ranks with experts replicated over tp={c.tp}: Megatron-Core at ETP = 1 "
                         f"folds the EP group over the tp ranks when tp divides ep; it lays this ep over the ranks "
                         f"its own way (Parallel Folding), which the plan did not price")
    if c.schedule == "interleaved_1f1b":
        args.append(f"--num-virtual-stages-per-pipeline-rank {c.virtual_stages}")
        if c.microbatch_group is not None:
            args.append(f"--microbatch-group-size-per-virtual-pipeline-stage {c.microbatch_group}")
    elif c.schedule == "gpipe" and c.pp > 1:
        notes.append("schedule=gpipe: Megatron-LM runs 1F1B (no GPipe schedule); written as 1F1B, which holds less "
                     "activation memory for the same bubble")
    if c.recompute == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif c.recompute == "selective":
        args += ["--recompute-granularity selective", "--recompute-modules core_attn"]
    elif c.recompute == "op_sac":
        args += ["--recompute-granularity selective", "--recompute-modules core_attn moe_act layernorm"]
        notes.append("recompute=op_sac (torchtitan's per-op policy: matmul outputs kept, pointwise ops recomputed) "
                     "has no Megatron mode; written as selective recompute of core_attn, moe_act and layernorm, "
                     "the closest")
    if c.sequence_parallel:
        args.append("--sequence-parallel")
    if c.zero_stage == 1:
        args.append("--use-distributed-optimizer")
    elif c.zero_stage in (2, 3):
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {_SHARDING[c.zero_stage]}"]
    if c.dp > 1:
        args.append("--overlap-grad-reduce")
        if c.zero_stage >= 1:
            args.append("--overlap-param-gather")
    if c.offload != "none":
        args += ["--optimizer-cpu-offload", "--optimizer-offload-fraction 1.0"]
        if c.offload == "params":
            notes.append("offload=params (FSDP2 CPU offload of parameters too) has no Megatron-LM option; written as "
                         "--optimizer-cpu-offload (optimizer states and step on the host), the closest")
        if c.zero_stage != 1:
            notes.append("Megatron-LM's --optimizer-cpu-offload runs with the distributed optimizer (ZeRO-1)")
    if c.precision == "bf16":
        args.append("--bf16")
    elif c.precision == "fp16":
        args.append("--fp16")
    if c.fp8 != "none":
        args += ["--fp8-format hybrid", f"--fp8-recipe {'blockwise' if c.fp8 == 'rowwise' else c.fp8}"]
        if c.fp8 == "rowwise":
            notes.append("fp8=rowwise (torchao per-row scales) has no Megatron/Transformer Engine recipe; written as "
                         "--fp8-recipe blockwise (1×128 / 128×128 block scales), the closest")
    if c.compile:
        notes.append("compile=True: Megatron-LM does not torch.compile its blocks (it runs fused Transformer Engine "
                     "kernels); nothing written")
    blocks = num_blocks(plan)
    head = [f"# autopar plan for {plan.model_name} on {plan.cluster_name}: {c}", f"# written for {VERSION}",
            f"# model: {blocks} blocks (--num-layers {blocks})"]
    head += [f"# autopar note: {n}" for n in notes]
    return Exported("megatron", "\n".join(head + [" \\\n".join(args)]) + "\n", tuple(notes))


def _parse(text: str, source: str) -> dict[str, str | bool]:
    lines = [ln.split("#", 1)[0] for ln in text.splitlines()]
    try:
        tokens = shlex.split(" ".join(ln.rstrip().rstrip("\\") for ln in lines))
    except ValueError as e:
        raise format_error(source, f"cannot split the arguments ({e})", "quote them as a shell would") from None
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            i += 1  # the launcher and script (torchrun pretrain_gpt.py) and values of flags we do not read
            continue
        key, eq, val = tok.partition("=")
        if key in _SWITCHES:
            out[key] = True
        elif key == "--recompute-modules":  # nargs='*': the words up to the next flag
            j = i + 1
            while j < len(tokens) and not tokens[j].startswith("--"):
                j += 1
            out[key] = " ".join(([val] if eq else []) + tokens[i + 1:j])
            i = j - 1
        elif key in _VALUED:
            if eq:
                out[key] = val
            elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                out[key] = tokens[i + 1]
                i += 1
            else:
                raise format_error(source, f"{key} has no value", f"give it one, e.g. {key} 2")
        i += 1
    if not any(k in out for k in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                  "--micro-batch-size", "--global-batch-size")):
        raise format_error(source, "names none of --tensor-model-parallel-size, --pipeline-model-parallel-size, "
                           "--micro-batch-size, --global-batch-size, so it is not a Megatron-LM argument list",
                           "pass the arguments given to pretrain_gpt.py, e.g. \"--tensor-model-parallel-size 8 ...\"")
    return out


def _int(args: dict, key: str, default: int, source: str) -> int:
    raw = args.get(key, default)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise format_error(source, f"{key} {raw!r} is not an integer", f"give {key} a positive integer") from None
    if value < 1:
        raise format_error(source, f"{key} {value} is not positive", f"give {key} a positive integer")
    return value


def import_layout(source: str, world_size: int, *, precision: str | None = None,
                  blocks: int | None = None) -> Imported:
    """The layout Megatron-LM arguments `source` (a string, or @file) run on `world_size` devices."""
    text = source
    if source.startswith("@"):
        try:
            text = Path(source[1:]).read_text()
        except OSError as e:
            raise format_error(source, f"cannot read it ({e.strerror})", "pass @path of a file of arguments") from None
    where = "--from-megatron"
    a = _parse(text, where)
    tp, pp = _int(a, "--tensor-model-parallel-size", 1, where), _int(a, "--pipeline-model-parallel-size", 1, where)
    cp = _int(a, "--context-parallel-size", 1, where)
    dp = world_split(where, world_size, tp, pp, cp)
    mbs = _int(a, "--micro-batch-size", 1, where)
    gbs = _int(a, "--global-batch-size", dp * mbs, where)
    if gbs % (dp * mbs):
        raise format_error(where, f"--global-batch-size {gbs} is not a multiple of dp · --micro-batch-size = "
                           f"{dp}·{mbs}", "make it a multiple")
    notes: list[str] = []
    v = 1
    if "--num-virtual-stages-per-pipeline-rank" in a:
        v = _int(a, "--num-virtual-stages-per-pipeline-rank", 1, where)
    elif "--num-layers-per-virtual-pipeline-stage" in a:
        layers = _int(a, "--num-layers", blocks or 0, where) if ("--num-layers" in a or blocks) else None
        if layers is None:
            raise format_error(where, "--num-layers-per-virtual-pipeline-stage without --num-layers",
                               "add --num-layers (the model's layer count) or --num-virtual-stages-per-pipeline-rank")
        v = layers // (pp * _int(a, "--num-layers-per-virtual-pipeline-stage", 1, where))
    group = a.get("--microbatch-group-size-per-virtual-pipeline-stage")
    granularity = a.get("--recompute-granularity")
    if granularity not in (None, "full", "selective"):
        raise format_error(where, f"--recompute-granularity {granularity!r} is not a Megatron value",
                           "use full or selective")
    method = a.get("--recompute-method", "uniform")
    if method not in ("uniform", "block"):
        raise format_error(where, f"--recompute-method {method!r} is not a Megatron value", "use uniform or block")
    modules = set(str(a.get("--recompute-modules", "core_attn")).split())
    pointwise = {"moe_act", "layernorm"} <= modules  # as export writes op_sac: the pointwise ops recomputed too
    recompute = ("none" if granularity is None else "full" if granularity == "full"
                 else "op_sac" if pointwise else "selective")
    if granularity == "full" and method == "block":
        notes.append(f"--recompute-method block recomputes {a.get('--recompute-num-layers', '?')} layers per stage; "
                     "priced as full recompute on every layer (the closest single mode)")
    strategy = a.get("--data-parallel-sharding-strategy", "optim_grads_params")
    fsdp = {v2: k for k, v2 in _SHARDING.items()} | {"no_shard": 0}
    if strategy not in fsdp:
        raise format_error(where, f"--data-parallel-sharding-strategy {strategy!r} is not a Megatron value",
                           f"use one of {', '.join(fsdp)}")
    zero = (fsdp[strategy] if a.get("--use-megatron-fsdp") or a.get("--use-custom-fsdp")
            else 1 if a.get("--use-distributed-optimizer") else 0)
    recipe = a.get("--fp8-recipe", "delayed") if a.get("--fp8-format") else None
    # Transformer Engine's recipes as TE runs them (PlannerOptions.fp8_runtime = "transformer_engine")
    fp8 = {None: "none", "tensorwise": "tensorwise", "delayed": "delayed", "mxfp8": "mxfp8"}.get(recipe)
    if fp8 is None:
        if recipe != "blockwise":
            raise format_error(where, f"--fp8-recipe {recipe!r} is not a Megatron recipe",
                               "use tensorwise, delayed, mxfp8 or blockwise")
        notes.append("--fp8-recipe blockwise (1×128 / 128×128 scales) priced as TE's per-tensor current scaling "
                     "(fp8=tensorwise: its casts and GEMM rate, the closest autopar prices)")
        fp8 = "tensorwise"
    prec = "bf16" if a.get("--bf16") else "fp16" if a.get("--fp16") else "fp32"
    ep = _int(a, "--expert-model-parallel-size", 1, where)
    etp = _int(a, "--expert-tensor-parallel-size", tp if ep > 1 else 1, where)
    if "--expert-tensor-parallel-size" not in a and ep > 1 and tp > 1:
        notes.append(f"--expert-tensor-parallel-size not given: Megatron-Core's default ETP = TP = {tp}")
    config = ParallelConfig(
        tp=tp, pp=pp, dp=dp, cp=cp, zero_stage=zero, micro_batch_size=mbs, num_microbatches=gbs // (dp * mbs),
        schedule="interleaved_1f1b" if v > 1 else "1f1b", virtual_stages=v,
        microbatch_group=int(group) if group and v > 1 else None, recompute=recompute,
        sequence_parallel=bool(a.get("--sequence-parallel")) and tp > 1, fp8=fp8,
        offload="optimizer" if a.get("--optimizer-cpu-offload") else "none", ep=ep, etp=etp,
        precision=precision or prec)
    deepep = a.get("--moe-enable-deepep") or a.get("--moe-token-dispatcher-type") == "flex"
    options = PlannerOptions(pipeline_runtime="megatron", ep_dispatcher="deepep" if deepep else "all_to_all",
                             fp8_runtime="transformer_engine",
                             loss_kernel="fused" if a.get("--cross-entropy-loss-fusion") else "fp32_logits")
    seq = a.get("--seq-length")
    return Imported("megatron", config, options, int(seq) if seq else None, tuple(notes))
