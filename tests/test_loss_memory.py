"""The loss's peak memory over the logits (cost_models.memory.logits_bytes), measured: the peak resident
memory of a fresh CPU process running torch's cross-entropy forward and backward over bf16 logits."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
