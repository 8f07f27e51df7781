"""Train a small autopar.zoo model under torchrun with a plan made by autopar (or read from a file).

    torchrun --nproc_per_node 2 examples/train_gpt.py --model gpt-tiny --seq-len 128 --steps 20 --plan auto
    torchrun --nproc_per_node 4 examples/train_gpt.py --plan plan.json   # from `autopar plan ... --out plan.json`
    torchrun --nproc_per_node 4 examples/train_gpt.py --plan plan.json --record run.json   # then `autopar report`
    torchrun --nproc_per_node 4 --max-restarts 3 examples/train_gpt.py --plan auto --steps 100 \
        --checkpoint-dir ck --checkpoint-every 10 --resume   # survives killed ranks; resumes on any layout

A plan file must be made for the model this script trains: the zoo model with its own dropout, in the
training dtype `autopar.models.training_dtype` gives (float32 on a CPU-only machine, bfloat16 with
GPUs; --dtype overrides it), which is also what `autopar plan gpt-tiny --cluster local` builds, so
`autopar plan MODEL --cluster local ...` then `--plan plan.json` here agree. A plan of another graph
(dtype, dropout, --override, --seq-len) is refused with the flags to fix it.

Training as practitioners run it: `--precision bf16` (16-bit compute over fp32 master weights and
optimizer states; the default is the plan's: bf16 on GPUs, fp32 on a CPU), `--max-grad-norm 1.0`
(global gradient-norm clipping over every rank), `--lr-schedule cosine` (linear warm-up over
`--lr-warmup-steps`, then cosine decay to 10% of --lr, a torch.optim.lr_scheduler.LambdaLR on
`pm.optimizer`; AdamW with no weight decay on biases and norms, parameter groups by name).

The data: `--data tokens.bin`, a flat binary of uint16 (or `--data-dtype uint32`) token ids read
memory-mapped (autopar.data; each data-parallel rank reads only its share; `--tokenize TEXT` first writes
TEXT's UTF-8 bytes there as ids 0–255, for a model with ≥ 256 token ids); the data position is kept in
each checkpoint, so a resumed run reads exactly the tokens the interrupted one would have read. Without
--data the batches are generated: sequences from a fixed random bigram language (each token has a handful
of likely successors), so the loss visibly falls from ln(vocab) toward the language's entropy, each step's
batch a pure function of the global step.

Fault tolerance (autopar.codegen.checkpoint): `--checkpoint-every N` saves model, optimizer, step
and RNG states atomically into `--checkpoint-dir`; `--resume` loads the latest complete checkpoint
there, resharded into this job's plan (any tp/pp/dp/ZeRO stage/world size), and continues from the
step after it. Under `torchrun --max-restarts` a lost rank restarts the job, which resumes the same
way; with `--plan auto` a job relaunched on a different number of processes re-plans for them.
Rank 0 prints loss, step time and tokens/s; every rank runs the same code.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import signal
import socket
import sys
import time
import warnings
import zlib

import torch
import torch.distributed as dist

import autopar
from autopar.codegen import lm_cross_entropy, parallelize
from autopar.codegen.checkpoint import Checkpointer, complete_checkpoints
from autopar.codegen.device import backend_for, device_name, resolve_device
from autopar.codegen.elastic import init_process_group, job_restart_count
from autopar.codegen.timing import rank_timing
from autopar.config import PRECISIONS, PlannerOptions
from autopar.data import TOKEN_DTYPES, TokenFile, tokenize_bytes
from autopar.errors import AutoparError, PlanMismatchError
from autopar.models import DTYPES, training_dtype
from autopar.record import build_record
from cost_models.profiler.cpu import cpu_kind


def build_model(name: str = "gpt-tiny", seq_len: int = 128, device: str = "meta", dtype: str | None = None,
                **overrides):
    """The model this script trains: the zoo model in this machine's training dtype (module docstring)."""
    return autopar.zoo.build(name, seq_len=seq_len, device=device, dtype=training_dtype("local", dtype), **overrides)


def gpt_tiny(seq_len: int = 128):
    """MODEL factory for the CLI (`autopar profile|plan examples/train_gpt.py:gpt_tiny`): the default run."""
    return build_model("gpt-tiny", seq_len)


def bigram_batch(vocab: int, seq_len: int, batch: int, step: int, seed: int = 0):
    """The (inputs, targets) global batch of global step `step` (from 1): a pure function of its arguments,
    drawn from a random sparse bigram table (the same on every rank and every run)."""
    successors = torch.randint(0, vocab, (vocab, 4), generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for i in range(seq_len):
        pick = torch.randint(0, 4, (batch,), generator=g)
        tokens[:, i + 1] = successors[tokens[:, i], pick]
    return tokens[:, :-1], tokens[:, 1:]


def make_plan(args, model, example) -> autopar.Plan:
    """Rank 0 plans (or reads the file) and sends the plan's JSON to every rank: all use the same plan."""
    payload = [None]
    if dist.get_rank() == 0:
        if args.plan == "auto":
            cluster = autopar.Cluster.local(nproc=dist.get_world_size())
            plan = autopar.plan(model, cluster, example_inputs=example, global_batch_size=args.global_batch_size,
                                options=PlannerOptions(precision=args.precision))
        else:
            plan = autopar.Plan.load(args.plan)
        payload = [plan.to_dict()]
    dist.broadcast_object_list(payload, src=0)
    plan = autopar.Plan.from_dict(payload[0])
    world = dist.get_world_size()
    if plan.config.world_size != world:
        raise PlanMismatchError(
            f"--plan {args.plan} is for {plan.config.world_size} processes ({plan.config}) but this job has {world}; "
            f"make a plan for {world} (`autopar plan {args.model} --cluster local --nproc {world} ...`), or pass "
            "--plan auto to plan for the processes this job has")
    if args.precision is not None and plan.config.precision != args.precision:
        raise PlanMismatchError(f"--plan {args.plan} trains in precision {plan.config.precision}, not --precision "
                                f"{args.precision}; make the plan with `autopar plan ... --precision {args.precision}`")
    return plan


def make_optimizer(args):
    """AdamW over the named parameters: weight decay on matrices, none on biases and norms (1-D parameters)."""
    def factory(named):
        decay = [(n, p) for n, p in named if p.dim() >= 2]
        rest = [(n, p) for n, p in named if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
                                 lr=args.lr)
    return factory


def lr_factor(args, step: int) -> float:
    """--lr-schedule's multiplier of --lr after `step` optimizer steps (0-based: the factor of step step+1)."""
    if args.lr_schedule == "constant":
        return 1.0
    warm = args.lr_warmup_steps
    if step < warm:
        return (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, args.steps - warm))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def write_record(args, plan: autopar.Plan, pm, timer, overrides: dict, losses: list[tuple[int, float]]) -> None:
    """Gather every rank's timings on rank 0 and save the RunRecord (collective: all ranks call it)."""
    mine = rank_timing(timer, rank=dist.get_rank(), pp_rank=pm.pp_rank, dp_rank=pm.dp_rank, tp_rank=pm.tp_rank,
                       warmup_steps=args.warmup)
    gathered: list = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(mine, gathered if dist.get_rank() == 0 else None, dst=0)
    if dist.get_rank() != 0:
        return
    spec = " ".join([args.model, f"seq_len={args.seq_len}", f"dtype={training_dtype('local', args.dtype)}",
                     *(f"{k}={v}" for k, v in overrides.items())])
    record = build_record(plan, gathered, hostname=socket.gethostname(), device_name=device_name(pm.device),
                          torch_version=torch.__version__, backend=dist.get_backend(),
                          threads_per_process=torch.get_num_threads(),
                          created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                          warmup_steps=args.warmup, model_spec=spec, cpu=cpu_kind().describe())
    record = dataclasses.replace(record, losses=tuple(losses))
    record.save(args.record)
    b = record.breakdown()
    print(f"recorded {record.steps} steps to {args.record}: median {record.measured_step_time_s * 1e3:.1f} ms "
          f"(predicted {record.predicted_step_time_s * 1e3:.1f} ms); "
          + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in b.items() if v > 0), flush=True)
    peak = max(r.peak_memory_bytes for r in record.ranks)
    if peak:
        print(f"peak memory {peak / 2**30:.2f} GiB (largest rank's torch.cuda.max_memory_allocated; predicted "
              f"{plan.estimate.peak_memory_bytes / 2**30:.2f} GiB)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt-tiny", help=f"one of {', '.join(autopar.zoo.names())}")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--plan", default="auto", help="'auto' (plan for this job) or a plan JSON file")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                        help="model config field, e.g. n_layers=2 (repeatable; the plan must be made for it too)")
    parser.add_argument("--record", default=None, help="write measured step times and breakdown here (JSON)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the record")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="training dtype (default: float32 without a GPU, else bfloat16); the plan's too")
    tr = parser.add_argument_group("training recipe and data")
    tr.add_argument("--precision", choices=PRECISIONS, default=None,
                    help="training precision (default: the plan's; --plan auto: bf16 on GPUs, fp32 on CPU)")
    tr.add_argument("--max-grad-norm", type=float, default=None, help="clip the global gradient norm to this")
    tr.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                    help="cosine: linear warm-up over --lr-warmup-steps, then cosine decay to 10%% of --lr")
    tr.add_argument("--lr-warmup-steps", type=int, default=None, help="default: a tenth of --steps, at least 1")
    tr.add_argument("--data", default=None, help="a token file (flat uint16/uint32 ids); default: generated data")
    tr.add_argument("--data-dtype", choices=TOKEN_DTYPES, default="uint16", help="the ids' type in --data")
    tr.add_argument("--tokenize", default=None, metavar="TEXT",
                    help="first write TEXT's UTF-8 bytes to --data as token ids 0-255 (byte level)")
    ck = parser.add_argument_group("fault tolerance")
    ck.add_argument("--checkpoint-dir", default=None, help="folder of checkpoints (one sub-folder per saved step)")
    ck.add_argument("--checkpoint-every", type=int, default=0, metavar="N", help="save after every N-th step")
    ck.add_argument("--keep-checkpoints", type=int, default=2, metavar="K", help="complete checkpoints kept")
    ck.add_argument("--async-checkpoint", action="store_true", help="write checkpoints while training goes on")
    ck.add_argument("--resume", action="store_true",
                    help="continue from the latest complete checkpoint in --checkpoint-dir, under this job's plan "
                         "(a restarted attempt under torchrun --max-restarts does so without it)")
    ck.add_argument("--fail-at-step", type=int, default=None, metavar="N",
                    help="fault injection: rank 1 kills itself (SIGKILL) at step N, on the job's first attempt only")
    ck.add_argument("--save-final", default=None, metavar="PATH",
                    help="rank 0 writes the full single-device state dict here (torch.save)")
    args = parser.parse_args(argv)
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        parser.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.checkpoint_every < 0 or args.keep_checkpoints < 1:
        parser.error("--checkpoint-every must be >= 0 and --keep-checkpoints >= 1")
    if args.tokenize and not args.data:
        parser.error("--tokenize TEXT writes the token file named by --data; give --data too")
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        parser.error("--max-grad-norm must be a positive number")
    if args.lr_warmup_steps is None:
        args.lr_warmup_steps = max(1, args.steps // 10)
    if args.lr_warmup_steps < 1:
        parser.error("--lr-warmup-steps must be >= 1")
    try:
        return train(args)
    except AutoparError as e:
        raise SystemExit(f"train_gpt.py: {e}") from e


def train(args) -> int:
    """Plan, parallelize, resume if asked, train to --steps; see the module docstring."""

    device = resolve_device()
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
        init_process_group(backend_for(device))  # restart-safe under torchrun
    if args.tokenize and dist.get_rank() == 0:
        print(f"tokenized {args.tokenize}: {tokenize_bytes(args.tokenize, args.data):,} byte-level tokens in "
              f"{args.data}", flush=True)
    dist.barrier()
    torch.manual_seed(0)
    overrides = autopar.zoo.parse_overrides(args.override)
    model, example = build_model(args.model, args.seq_len, "cpu", args.dtype, **overrides)
    plan = make_plan(args, model, example)
    rank0 = dist.get_rank() == 0
    if args.fail_at_step is not None and dist.get_world_size() < 2:
        raise AutoparError("--fail-at-step kills rank 1; run at least 2 processes")
    if rank0:
        print(f"plan: {plan.config}  (predicted {plan.estimate.step_time_s * 1e3:.1f} ms/step)", flush=True)
    try:
        pm = parallelize(model, plan, example_inputs=example, device=device, loss_fn=lm_cross_entropy,
                         optimizer=make_optimizer(args), max_grad_norm=args.max_grad_norm)
    except PlanMismatchError as e:
        dtype = str(training_dtype("local", args.dtype)).removeprefix("torch.")
        flags = " ".join(f"--override {k}={v}" for k, v in overrides.items())
        raise SystemExit(
            f"train_gpt.py: {e}\nThis script trains {args.model} (seq_len {args.seq_len}, {dtype}, zoo dropout"
            f"{', ' + flags if flags else ''}); make the plan for exactly that: `autopar plan {args.model} --cluster "
            f"local --seq-len {args.seq_len} --dtype {dtype} ...`, or pass this script the --dtype / --seq-len / "
            "--override the plan was made with.") from e
    schedule = torch.optim.lr_scheduler.LambdaLR(pm.optimizer, lambda step: lr_factor(args, step))
    checkpointer = (Checkpointer(pm, args.checkpoint_dir, model_name=plan.model_name,
                                 keep_last=args.keep_checkpoints, async_save=args.async_checkpoint)
                    if args.checkpoint_dir else None)
    done = 0
    data = TokenFile(args.data, dtype=args.data_dtype, seq_len=args.seq_len) if args.data else None
    position = 0  # sequences of --data consumed so far
    # A restarted attempt (torchrun --max-restarts) continues from the latest checkpoint, if one was made.
    first_attempt = job_restart_count() == 0  # collective: every rank must agree
    restarted = checkpointer is not None and not first_attempt and bool(complete_checkpoints(args.checkpoint_dir))
    if args.resume or restarted:
        info = checkpointer.resume()
        done = info.step
        position = info.extra.get("data_position", done * args.global_batch_size)
        with warnings.catch_warnings():  # the schedule is a function of the step: bring it to `done`
            warnings.simplefilter("ignore")
            for _ in range(done):
                schedule.step()
        if rank0:
            print(f"resumed from {info.path} (step {done}, saved by {info.manifest['world_size']} processes as "
                  f"{info.manifest['config']})", flush=True)
    if args.record and args.steps - done <= args.warmup:
        raise AutoparError(f"--record: this run trains steps {done + 1}..{args.steps}, not more than --warmup "
                           f"({args.warmup}); lower --warmup or raise --steps")
    vocab = autopar.zoo.config(args.model).vocab_size
    tokens_per_step = args.global_batch_size * args.seq_len
    times, losses = [], []
    timing = pm.timing() if args.record else None
    timer = timing.__enter__() if timing else None
    for step in range(done + 1, args.steps + 1):
        if data is not None:
            x, t = data.local_batch(position, args.global_batch_size, pm.dp_rank, pm.dp_size)
            data.check_vocab(vocab, x)
            position += args.global_batch_size
        else:
            x, t = (pm.local_batch(b) for b in bigram_batch(vocab, args.seq_len, args.global_batch_size, step))
        if step == args.fail_at_step and first_attempt and dist.get_rank() == 1:
            print(f"rank 1: --fail-at-step {step}: SIGKILL", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if timer:
            dist.barrier()  # every rank starts the step together, so per-rank times are comparable
        start = time.perf_counter()
        loss = pm.train_step(x, t)
        schedule.step()
        times.append(time.perf_counter() - start)
        losses.append((step, loss))
        if checkpointer and args.checkpoint_every and step % args.checkpoint_every == 0:
            checkpointer.save(step, extra={"next_step": step + 1, "data": args.data or "bigram_batch(step), seed 0",
                                           "data_position": position})
        if rank0:
            bar = "#" * (20 * step // args.steps)
            lead = "\r" if sys.stdout.isatty() else ""
            end = "\n" if step == args.steps or not lead else ""
            extra = f"  grad norm {pm.grad_norm:.3f}" if pm.grad_norm is not None else ""
            if data is not None:  # which tokens this rank read, so runs can be compared token for token
                extra += f"  tokens crc32 {zlib.crc32(x.numpy().tobytes()):08x}"
            print(f"{lead}[{bar:<20}] step {step}/{args.steps}  loss {loss:.4f}  {times[-1] * 1e3:.0f} ms  "
                  f"{tokens_per_step / times[-1]:.0f} tok/s{extra}", end=end, flush=True)
    if checkpointer:
        checkpointer.wait()
    if rank0 and times:
        steady = times[1:] or times
        mean_s = sum(steady) / len(steady)
        print(f"mean step {mean_s * 1e3:.1f} ms (after the first), {tokens_per_step / mean_s:.0f} tokens/s")
    if timing is not None:
        timing.__exit__(None, None, None)
        write_record(args, plan, pm, timer, overrides, losses)
    if args.save_final:
        full = pm.full_state_dict()  # collective
        if rank0:
            torch.save(full, args.save_final)
    # Every rank finishes its last collective before any tears gloo down: a rank that leaves early can
    # abort a peer still inside FSDP's final reduce ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
