"""Token files for training: a flat binary of uint16 or uint32 token ids, memory-mapped (nanoGPT's format:
`np.memmap(path, dtype=np.uint16)`), read in fixed-length sequences at a position a checkpoint can hold.

The stream is cut into consecutive sequences of `seq_len + 1` tokens overlapping by one (inputs are
tokens i … i+seq_len−1, targets i+1 … i+seq_len); sequence k starts at token k·seq_len. A global batch
of B sequences at position p holds sequences p … p+B−1 (modulo the number of sequences: the file is read
again from the start, epoch after epoch), and data-parallel rank r reads only its own b = B/dp of them,
p + r·b … p + r·b + b − 1, the slice `ParallelModel.local_batch` would cut from the global batch. A batch
is a pure function of (file, position), so a run resumed from a checkpoint that kept the position reads
exactly the tokens the interrupted run would have read.

`tokenize_bytes` makes such a file from any local text file with byte-level ids (0–255, the UTF-8 bytes;
no vocabulary to download), for a model with at least 256 token ids.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from autopar.errors import AutoparError

__all__ = ["TOKEN_DTYPES", "TokenFile", "tokenize_bytes"]

TOKEN_DTYPES = ("uint16", "uint32")


class TokenFile:
    """A memory-mapped token file; `batch` reads sequences at a position without loading the file."""

    def __init__(self, path: str | Path, *, dtype: str = "uint16", seq_len: int) -> None:
        if dtype not in TOKEN_DTYPES:
            raise AutoparError(f"token dtype {dtype!r}; a token file holds {' or '.join(TOKEN_DTYPES)} ids")
        self.path = Path(path)
        if not self.path.is_file():
            raise AutoparError(f"token file {self.path} does not exist; make one from a text file with "
                               "autopar.data.tokenize_bytes (examples/train_gpt.py --tokenize TEXT --data PATH)")
        itemsize = np.dtype(dtype).itemsize
        size = self.path.stat().st_size
        if size % itemsize:
            raise AutoparError(f"token file {self.path} has {size} bytes, not a whole number of {dtype} ids; "
                               "is --data-dtype right?")
        self.tokens = np.memmap(self.path, dtype=np.dtype(dtype), mode="r")
        self.seq_len = seq_len
        self.num_sequences = (len(self.tokens) - 1) // seq_len
        if self.num_sequences < 1:
            raise AutoparError(f"token file {self.path} holds {len(self.tokens)} tokens, fewer than one sequence of "
                               f"{seq_len} + 1; use a larger file or a shorter --seq-len")

    def sequences(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [count, seq_len] int64: sequences start … start+count−1 (wrapping)."""
        s = self.seq_len
        rows = [(start + i) % self.num_sequences for i in range(count)]
        chunk = np.stack([np.asarray(self.tokens[k * s:k * s + s + 1], dtype=np.int64) for k in rows])
        t = torch.from_numpy(chunk)
        return t[:, :-1], t[:, 1:]

    def local_batch(self, position: int, global_batch: int, dp_rank: int, dp_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Data-parallel rank `dp_rank`'s share of the global batch at `position` (module docstring)."""
        if global_batch % dp_size:
            raise AutoparError(f"global batch {global_batch} does not split over {dp_size} data-parallel ranks")
        b = global_batch // dp_size
        return self.sequences(position + dp_rank * b, b)

    def check_vocab(self, vocab_size: int, inputs: torch.Tensor) -> None:
        """Ids at or above the model's vocabulary would index past its embedding: refuse them by name."""
        top = int(inputs.max()) if inputs.numel() else 0
        if top >= vocab_size:
            raise AutoparError(f"token file {self.path} holds id {top}, but the model has {vocab_size} token ids; "
                               f"use a model with a vocabulary of at least {top + 1} (e.g. --override "
                               f"vocab_size={max(256, top + 1)})")


def tokenize_bytes(text_path: str | Path, out_path: str | Path) -> int:
    """Write `text_path`'s UTF-8 bytes as uint16 token ids to `out_path`; returns the number of tokens."""
    text = Path(text_path)
    if not text.is_file():
        raise AutoparError(f"text file {text} does not exist; give any local text file to tokenize")
    data = np.frombuffer(text.read_bytes(), dtype=np.uint8).astype(np.uint16)
    if len(data) < 2:
        raise AutoparError(f"text file {text} has {len(data)} bytes; it needs at least one sequence's worth")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    data.tofile(tmp)
    tmp.replace(out)
    return len(data)
