"""Capture time vs depth: repeated blocks are analysed once, so 80 layers should cost < 2x 2 layers.

    python benchmarks/capture_speed.py [--repeats 3]

Prints the median wall time of `autopar.capture` (model construction on meta excluded) for llama3-70b
and gpt3-175b with 2 layers and with their full depth, the ratio, the planner's capture targets
(gpt3-175b, llama3-405b at full depth, ~1-2 s) and the peak RSS of this process.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import autopar


def time_capture(name: str, n_layers: int | None, seq_len: int, repeats: int) -> float:
    overrides = {"n_layers": n_layers} if n_layers else {}
    times = []
    for _ in range(repeats):
        model, inputs = autopar.zoo.build(name, seq_len=seq_len, **overrides)
        start = time.perf_counter()
        autopar.capture(model, inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    time_capture("gpt-tiny", None, 64, 1)  # warm-up: imports, first-call dispatch caches
    print(f"{'model':<14}{'seq':>6}{'2 layers s':>12}{'full s':>9}{'layers':>8}{'ratio':>7}")
    for name, depth, seq in (("llama3-70b", 80, 4096), ("gpt3-175b", 96, 2048), ("llama3-405b", 126, 4096)):
        shallow = time_capture(name, 2, seq, args.repeats)
        full = time_capture(name, depth, seq, args.repeats)
        print(f"{name:<14}{seq:>6}{shallow:>12.3f}{full:>9.3f}{depth:>8}{full / shallow:>7.2f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
