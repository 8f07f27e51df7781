"""The memory-bound kernels of a pass as TorchInductor fuses them: what a compiled block runs.

TorchInductor fuses each chain of pointwise and reduction ops that no matmul interrupts into one
kernel (Ansel et al. 2024, "PyTorch 2: Faster Machine Learning Through Dynamic Python Bytecode
Transformation and Graph Compilation", ASPLOS, §5: "vertical fusion" of pointwise/reduction loops;
matmuls and attention stay library calls). A fused kernel reads each tensor the chain takes from
outside once and writes only what leaves the chain: tensors read after it, saved for backward, or
never read again inside the pass (its outputs); intermediates stay in registers. So a chain of n
eager kernels that each read and write a [b, s, h] tensor (≈ 2n passes over it) becomes about two.

`fused_kernels` takes a pass's ops in execution order, each with the storages it reads and writes,
and returns one `Kernel` per chain priced by that traffic; GEMM and attention kernels are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capture.graph import Kernel, merge_kernels

__all__ = ["Step", "StepLog", "fused_kernels"]


@dataclass(frozen=True)
class Step:
    """One op of a pass: kind "gemm" | "attention" | "memory" | "view"; reads/writes as (storage, bytes)."""

    kind: str
    reads: tuple[tuple[int, int], ...]
    writes: tuple[tuple[int, int], ...]
    kernel: Kernel | None  # its eager kernel (None for views)


class StepLog:
    """Records steps as a dispatch mode sees them. A storage is named by its key and how many times it has
    been written, so a key reused after its tensor was freed names a new tensor."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self._writes: dict[int, int] = {}

    def ident(self, key: int) -> int:
        return hash((key, self._writes.get(key, 0)))

    def record(self, kind: str, reads: list[tuple[int, int]], writes: list[tuple[int, int]],
               kernel: Kernel | None = None) -> None:
        named_reads = tuple((self.ident(k), n) for k, n in reads)
        for k, _ in writes:
            self._writes[k] = self._writes.get(k, 0) + 1
        self.steps.append(Step(kind=kind, reads=named_reads, writes=tuple((self.ident(k), n) for k, n in writes),
                               kernel=kernel))


def unread_save_bytes(steps: list[Step], saved: set[int], policy_bytes: list[int]) -> int:
    """Bytes a checkpoint policy saves (`policy_bytes`: each step's saved output bytes, 0 for steps it
    recomputes) that no backward reads: nothing autograd saves (`saved`) is among those outputs, nor among
    the inputs of the steps recomputed to produce what it saves. Eager selective checkpointing keeps every
    policy-saved output until backward; a compiled block's partitioner (AOTAutograd) saves only what the
    backward graph reads, so these bytes go."""
    needed = set(saved)
    for st, kept in zip(reversed(steps), reversed(policy_bytes), strict=True):
        if not kept and any(key in needed for key, _ in st.writes):  # recomputed: its inputs are needed
            needed.update(key for key, _ in st.reads)
    return sum(n for st, n in zip(steps, policy_bytes, strict=True)
               if n and not any(key in needed for key, _ in st.writes))


def fused_kernels(steps: list[Step], keep: frozenset[int] = frozenset()) -> tuple[Kernel, ...]:
    """One kernel per maximal chain of memory-bound steps: work = bytes read from outside the chain plus
    bytes written that outlive it (read by a later step, in `keep` (saved for backward) or never read
    again). Its class, layout flags and largest tensor are those of the chain's heaviest eager kernel."""
    last_read: dict[int, int] = {}
    for i, st in enumerate(steps):
        for key, _ in st.reads:
            last_read[key] = i
    out: list[Kernel] = []
    chain: list[int] = []

    def close() -> None:
        if not chain:
            return
        end = chain[-1]
        produced: set[int] = set()
        reads: dict[int, int] = {}
        writes: dict[int, int] = {}
        for i in chain:
            for key, n in steps[i].reads:
                if key not in produced:
                    reads[key] = max(reads.get(key, 0), n)
            for key, n in steps[i].writes:
                produced.add(key)
                if key in keep or last_read.get(key, -1) > end or last_read.get(key, -1) < i:
                    writes[key] = max(writes.get(key, 0), n)
        kernels = [steps[i].kernel for i in chain if steps[i].kernel is not None]
        if kernels:
            top = max(kernels, key=lambda k: k.work)
            out.append(Kernel(kind=top.kind, count=1, work=float(sum(reads.values()) + sum(writes.values())),
                              tensor_bytes=max(k.tensor_bytes for k in kernels), tp_sharded=top.tp_sharded,
                              attention_core=top.attention_core))
        chain.clear()

    for i, st in enumerate(steps):
        if st.kind == "memory":
            chain.append(i)
        elif st.kind != "view":
            close()
    close()
    return merge_kernels(out)
