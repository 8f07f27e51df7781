"""A compiled block against an eager one on this CPU: does the planner's pricing of compiled blocks
(each chain of memory-bound kernels between matmuls fused into one pass, KernelMix.fused) predict what
`torch.compile` gains here?

    python benchmarks/compile_gain_cpu.py [--profile profile.json] [--dtype float32]

Profiles the machine (quick sweep, one thread) unless --profile is given, captures a one-block GPT
(h=768, 12 heads, s=512, b=2, SDPA, dropout 0) and prices its forward + backward as the planner does,
eager and compiled (CostModel.layer_compute_s); then times the same block eager and under
`torch.compile` (after the compiling warm-up call), single-threaded by the thread's CPU time. Prints
both times, predicted and measured, and the two speed-ups.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import autopar  # run from the repository root after `pip install -e .`, or with PYTHONPATH=.
from autopar.planner.costs import CostModel
from autopar.zoo.gpt import GPTBlock, GPTConfig
from cost_models import catalog
from cost_models.profile import Profile
from cost_models.profiler import profile_machine
from cost_models.profiler.timing import time_callable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", help="use this profile (measured with --clock thread) instead of measuring one")
    ap.add_argument("--dtype", choices=list(DTYPES), default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    device, dtype = torch.device("cpu"), DTYPES[args.dtype]
    t0 = time.perf_counter()
    prof = Profile.load(args.profile) if args.profile else profile_machine(nproc=2, quick=True, clock="thread")
    print(f"profile {prof.device_name} ({prof.clock} clock) in {time.perf_counter() - t0:.0f} s; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    cfg = GPTConfig(n_layers=1, hidden_size=768, n_heads=12, vocab_size=1024, max_seq_len=512, dropout=0.0)
    model, inputs = autopar.zoo.build("gpt2-small", seq_len=512, batch_size=2, dtype=dtype, n_layers=1,
                                      vocab_size=1024, dropout=0.0)
    graph = autopar.capture(model, inputs)
    link = catalog.link("cpu-loopback")
    planner = CostModel(graph, device=catalog.device("cpu"), devices_per_node=1, nodes=1, intra_node=link,
                        inter_node=link, profile=prof, backend="gloo")
    predicted = {c: planner.compute.layer_compute_s("blocks.0", micro_batch=2, compiled=c) for c in (False, True)}
    torch.manual_seed(0)
    block = GPTBlock(cfg).to(device=device, dtype=dtype)
    x = torch.randn(2, 512, 768, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    measured = {}
    for compiled in (False, True):
        run = torch.compile(block) if compiled else block

        def step(run: torch.nn.Module = run) -> None:
            block.zero_grad(set_to_none=True)
            x.grad = None
            run(x).backward(grad)

        t1 = time.perf_counter()
        step()  # compiles on the first call
        warm = time.perf_counter() - t1
        measured[compiled] = time_callable(step, device, trial_s=0.2, trials=7, clock="thread")
        print(f"{'compiled' if compiled else 'eager':<9} predicted {predicted[compiled] * 1e3:7.1f} ms   measured "
              f"{measured[compiled] * 1e3:7.1f} ms   (first call {warm:.1f} s)", flush=True)
    print(f"speed-up of compiling: predicted {predicted[False] / predicted[True]:.2f}x, measured "
          f"{measured[False] / measured[True]:.2f}x; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
