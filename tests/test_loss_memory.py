"""The loss's peak memory over the logits (cost_models.memory.logits_bytes), measured: the peak resident
memory of a fresh CPU process running torch's cross-entropy forward and backward over bf16 logits ("fp32_logits"),
and the peak bytes autopar's chunked loss allocates (torch's CPU memory profiler, "chunked"); and that loss's
numbers against torch's cross-entropy, on one process and vocab-parallel on two."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from dist_harness import run_distributed
from torch.profiler import ProfilerActivity, profile

from autopar.codegen.loss import IGNORE_INDEX, chunked_cross_entropy, lm_cross_entropy
from autopar.errors import AutoparError
from cost_models import memory

# Runs in a fresh interpreter: resets the kernel's resident-set high-water mark (/proc/self/clear_refs "5")
# once the inputs exist, runs the loss, and prints the high-water mark's growth per logit. Tensors this
# large are mmap'ed by the allocator and returned on free, so the mark follows the live tensors.
_SCRIPT = r"""
import sys, torch, torch.nn.functional as F
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
n, v, keep = 1024, 32768, sys.argv[1] == "keep"
x, t = torch.randn(n, v, dtype=torch.bfloat16), torch.randint(0, v, (n,))
w = torch.nn.Parameter(torch.ones((), dtype=torch.bfloat16))
F.cross_entropy((x[:8] * w).float(), t[:8]).backward()  # kernels and thread pools resident first
open("/proc/self/clear_refs", "w").write("5")
base = rss("VmRSS")
logits = x * w  # the head's bf16 output, in the autograd graph
loss = F.cross_entropy(logits.float(), t)
if not keep:
    del logits  # the caller drops its logits before backward (torchtitan's train step; autopar's pp = 1 loop)
loss.backward()
print((rss("VmHWM") - base) / (n * v))
"""


def _peak_per_logit(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True, check=True,
                         timeout=300)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_cross_entropy_peak_over_upcast_logits_is_measured() -> None:
    dropped, kept = _peak_per_logit("drop"), _peak_per_logit("keep")
    assert dropped == pytest.approx(memory.FP32_LOSS_PEAK_BYTES_PER_LOGIT, abs=0.3)
    assert kept == pytest.approx(memory.FP32_LOSS_PEAK_BYTES_PER_LOGIT + 2, abs=0.3)  # + the bf16 logits
    per_logit = memory.logits_bytes(micro_batch=1, seq_len=1024, vocab=32768, held=True) / (1024 * 32768)
    assert per_logit == pytest.approx(kept, abs=0.3)


def test_logits_bytes_by_kernel() -> None:
    # [1, 2048, 50304] logits: 12 B each under torch's loss (+2 for bf16 logits held), ÷ t over a vocab-parallel
    # head; the fused kernel keeps the 16-bit logits and one fp32 log-sum-exp per row
    n = 2048 * 50304
    assert memory.logits_bytes(micro_batch=1, seq_len=2048, vocab=50304) == 12 * n
    assert memory.logits_bytes(micro_batch=1, seq_len=2048, vocab=50304, tp=8, held=True) == 14 * n / 8
    assert memory.logits_bytes(micro_batch=1, seq_len=2048, vocab=50304, loss_kernel="fused") == 2 * n + 4 * 2048
    # chunked: the bf16 logits and their gradient, a fp32 log-sum-exp per row, one chunk of fp32 rows
    chunk = memory.loss_chunk_tokens(2048, 50304)
    assert chunk == memory.LOSS_CHUNK_FP32_BYTES // (4 * 50304) == 1334
    assert memory.logits_bytes(micro_batch=1, seq_len=2048, vocab=50304, loss_kernel="chunked") == (
        4 * n + 4 * 2048 + chunk * 50304 * 4)
    assert memory.loss_chunk_tokens(100, 50304) == 100 and memory.loss_chunk_tokens(10**6, 10**9) == 1
    # MPT-1B's logits on 40 GB (mbs 10, seq 2048, vocab 50368): 11.5 GiB upcast, 3.9 GiB chunked
    mpt = dict(micro_batch=10, seq_len=2048, vocab=50368)
    assert memory.logits_bytes(**mpt) / 2**30 == pytest.approx(11.53, abs=0.01)
    assert memory.logits_bytes(**mpt, loss_kernel="chunked") / 2**30 == pytest.approx(4.09, abs=0.01)


# ---- autopar's chunked loss (codegen/loss.py): numbers and bytes ----

def _reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's cross-entropy over the upcast logits (the loss lm_cross_entropy computed before): loss, gradient."""
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(x.reshape(-1, x.size(-1)).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.detach(), x.grad


def _targets(shape: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    t = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::5] = IGNORE_INDEX
    return t


def _check_grad(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: within fp32 rounding; 16-bit: the same fp32 value rounded once, so at most one step of its dtype."""
    assert got.dtype == want.dtype
    rtol = 1e-5 if got.dtype == torch.float32 else torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [None, 1, 7, 33, 1000])  # default (one chunk here), uneven remainders, > rows
def test_chunked_loss_matches_torch(dtype: torch.dtype, chunk: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 33, 257, generator=g) * 4).to(dtype).requires_grad_()
    targets = _targets((3, 33), 257, seed=1)
    want_loss, want_grad = _reference(logits, targets)
    loss = chunked_cross_entropy(logits, targets, chunk_tokens=chunk)
    loss.backward(torch.tensor(1.5))  # a scaled loss (fp16 loss scaling, micro-batch means) scales the gradient
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    _check_grad(logits.grad, (want_grad.float() * 1.5).to(dtype))


def test_chunked_loss_counts_no_ignored_rows() -> None:
    logits = torch.randn(4, 9, requires_grad=True)
    targets = torch.full((4,), IGNORE_INDEX)
    loss = lm_cross_entropy(logits, targets)  # 0 with nothing to count (torch's mean gives nan), as under TP
    loss.backward()
    assert loss.item() == 0.0 and not logits.grad.any()


def test_chunked_loss_refuses_a_chunk_of_no_rows() -> None:
    with pytest.raises(AutoparError, match="chunk_tokens=0; pass a positive number"):
        chunked_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), chunk_tokens=0)


def _peak_allocated_bytes(run) -> int:
    """The peak of the bytes `run()` allocates and has not freed, from torch's CPU memory profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _loss_peak(rows: int, vocab: int, dtype: torch.dtype, chunk: int | None, targets: torch.Tensor,
               vocab_start: int = 0, group=None) -> int:
    """Peak bytes of one forward and backward of the loss over `rows` logits that come into being with it
    (as the head's output does) and whose gradient is kept (as the head's backward gets it)."""
    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(2)).to(dtype)

    def run() -> None:
        logits = x.clone().requires_grad_()
        if chunk is None and group is None:
            lm_cross_entropy(logits, targets).backward()
        else:
            chunked_cross_entropy(logits, targets, chunk_tokens=chunk, vocab_start=vocab_start,
                                  group=group).backward()
    return _peak_allocated_bytes(run)


@pytest.mark.parametrize("rows,vocab,dtype,chunk", [
    (1024, 16384, torch.bfloat16, 256),  # four even chunks
    (1000, 16384, torch.bfloat16, 384),  # an uneven remainder (232 rows)
    (600, 8192, torch.float32, 250),  # fp32 logits: the chunk is a copy
    (1000, 16384, torch.bfloat16, None),  # lm_cross_entropy's own chunk (loss_chunk_tokens, 8 MiB budget here)
])
def test_chunked_loss_peak_bytes_equal_the_price(rows: int, vocab: int, dtype: torch.dtype, chunk: int | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "LOSS_CHUNK_FP32_BYTES", 8 * 2**20)  # 128 rows of 16384: several chunks
    got = _loss_peak(rows, vocab, dtype, chunk, _targets((rows,), vocab, seed=3))
    elem = torch.finfo(dtype).bits // 8
    want = memory.logits_bytes(micro_batch=1, seq_len=rows, vocab=vocab, dtype_bytes=elem, loss_kernel="chunked",
                               chunk_tokens=chunk)
    assert got == pytest.approx(want, rel=0.01)
    if dtype == torch.bfloat16:  # torch's loss over the upcast logits holds 12 B per logit (test above), this ~4
        assert got < memory.logits_bytes(micro_batch=1, seq_len=rows, vocab=vocab) / 2


def _vocab_parallel_rank(rows: int, vocab: int, chunk: int) -> dict:
    """On each of two ranks: the loss and gradient of its vocabulary slice, and the loss's peak bytes."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar.codegen.loss import vocab_parallel_cross_entropy

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rank, v_local = dist.get_rank(), vocab // 2
    full = torch.randn(2, rows // 2, vocab, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    targets = _targets((2, rows // 2), vocab, seed=5)
    local = full[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, mesh)
    loss.backward()
    peak = _loss_peak(rows, v_local, torch.bfloat16, chunk, targets.reshape(-1), vocab_start=rank * v_local,
                      group=mesh.get_group())
    return {"loss": loss.detach(), "grad": local.grad, "full": full, "targets": targets, "peak": peak}


def test_vocab_parallel_chunked_loss_on_two_ranks() -> None:
    rows, vocab, chunk = 600, 16384, 256
    ranks = run_distributed(_vocab_parallel_rank, 2, rows, vocab, chunk)
    want_loss, want_grad = _reference(ranks[0]["full"], ranks[0]["targets"])
    for r, got in enumerate(ranks):
        torch.testing.assert_close(got["loss"], want_loss, rtol=1e-5, atol=0)
        _check_grad(got["grad"], want_grad[..., r * vocab // 2:(r + 1) * vocab // 2])
        want = memory.logits_bytes(micro_batch=1, seq_len=rows, vocab=vocab, tp=2, loss_kernel="chunked",
                                   chunk_tokens=chunk)
        assert got["peak"] == pytest.approx(want, rel=0.01)
