"""Training checkpoints that survive a crash and load under any layout.

A checkpoint is one folder `DIR/step_00000042/` holding a DCP (torch.distributed.checkpoint) save of
the model and optimizer state by parameter name (`state.py`), every rank's RNG states, and
`manifest.json`: the step, the model's name, the caller's `extra` (e.g. the data position), and the
size and CRC-32 of every file.

- Atomic: ranks write into `step_N.partial/` (DCP's writer fsyncs each file); only when every rank
  has written its files does rank 0 add the manifest and rename the folder to `step_N` (a rename is
  atomic on POSIX). A crash mid-save
  leaves a `.partial` folder, which resume ignores and the next save removes.
- Verified: resume checks every file's size and CRC-32 against the manifest before loading, and on a
  mismatch (or a load that fails) falls back to the previous complete checkpoint, saying why.
- Any layout: DCP stores each tensor's global shape and the slices each rank wrote, and each loading
  rank reads the slices its own shards cover, so tp, pp, dp, ZeRO stage and world size may all differ
  between save and load. RNG states are restored only when the world size is unchanged (a rank of
  another layout has no counterpart); training without dropout does not depend on them.
- Asynchronous (optional): `dcp.async_save` copies the state to CPU memory and writes it from a
  background thread over a process group of its own, while training goes on; the checkpoint is
  committed at the next save or at `wait()`.
- The last `keep_last` complete checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zlib
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from autopar.codegen import state as state_io
from autopar.codegen.device import rng_states, set_rng_states
from autopar.codegen.failures import named_failures
from autopar.errors import CheckpointError

if TYPE_CHECKING:
    from autopar.codegen.runtime import ParallelModel

__all__ = ["CheckpointInfo", "Checkpointer", "complete_checkpoints"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d{8})$")
_CRC_CHUNK_BYTES = 8 * 2**20


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """A complete checkpoint on disk: its folder, the step it was taken after, and its manifest."""

    path: Path
    step: int
    manifest: dict[str, Any] = field(repr=False)

    @property
    def extra(self) -> dict[str, Any]:
        return self.manifest.get("extra", {})


def _folder(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_checkpoints(root: str | Path) -> list[CheckpointInfo]:
    """Complete checkpoints in `root` (a folder `step_N` with a readable manifest), oldest first."""
    root = Path(root)
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        m = _NAME.match(path.name)
        if not m or not (path / MANIFEST).is_file():
            continue
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, json.JSONDecodeError):
            continue
        found.append(CheckpointInfo(path=path, step=int(m.group(1)), manifest=manifest))
    return found


def _crc32(path: Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CRC_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    rank = dist.get_rank()
    return {f"rng.{kind}.rank{rank}": state for kind, state in rng_states(device).items()}


def _global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.shape)  # a DTensor's shape is the global one


class Checkpointer:
    """Saves and resumes the training state of one `ParallelModel` in `root` (construct on every rank).

    model_name: what the checkpoint says it holds (e.g. the plan's `model_name`); a resume into a model
    whose parameter names or shapes differ names both models.
    """

    def __init__(self, pm: ParallelModel, root: str | Path, *, model_name: str, keep_last: int = 2,
                 async_save: bool = False) -> None:
        if keep_last < 1:
            raise CheckpointError(f"keep_last={keep_last}; keep at least the latest checkpoint (keep_last >= 1)")
        self.pm = pm
        self.root = Path(root)
        self.model_name = model_name
        self.keep_last = keep_last
        self.async_save = async_save
        self._pending: tuple[Future, int, Path, dict] | None = None
        # Async writes run DCP's collectives from a background thread: on a group of their own, so they
        # never interleave with the training step's collectives on the default group.
        self._group = dist.new_group(backend="gloo") if async_save else None

    @property
    def _parts(self) -> Sequence[nn.Module]:
        return self.pm.modules

    # ---- save ----
    def save(self, step: int, extra: dict[str, Any] | None = None) -> None:
        """Checkpoint the state after `step` (collective). `extra`: JSON values kept in the manifest."""
        with named_failures("checkpoint save"):
            self._save(step, extra)

    def _save(self, step: int, extra: dict[str, Any] | None) -> None:
        self.wait()
        self.pm.wait_pending("checkpoint save")  # ZeRO-1's parameter broadcasts still in flight
        partial = self.root / f"step_{step:08d}.partial"
        if dist.get_rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        state = {"model": state_io.model_state(self._parts, self.pm.stepper, writing=True),
                 "optim": state_io.optimizer_state(self.pm.stepper, self._parts), **_rng_states(self.pm.device)}
        info = {"step": step, "extra": dict(extra or {})}
        if self.pm.loss_scaler is not None:  # fp16: every rank holds the same scale (its updates are agreed)
            info["loss_scale"] = self.pm.loss_scaler.state_dict()
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self._group)
            self._pending = (future, step, partial, info)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._commit(step, partial, info)

    def wait(self) -> None:
        """Finish and commit the asynchronous save in flight, if any (collective)."""
        if self._pending is None:
            return
        future, step, partial, info = self._pending
        self._pending = None
        future.result()
        self._commit(step, partial, info)

    def _commit(self, step: int, partial: Path, info: dict) -> None:
        """Every rank checksums the files it wrote; rank 0 writes the manifest and renames the folder."""
        rank = dist.get_rank()
        mine = {p.name: {"bytes": p.stat().st_size, "crc32": _crc32(p)}
                for p in partial.glob(f"__{rank}_*.distcp")}
        files: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(files, mine)
        if rank == 0:
            meta = partial / ".metadata"
            listing = {k: v for d in files for k, v in d.items()}
            listing[meta.name] = {"bytes": meta.stat().st_size, "crc32": _crc32(meta)}
            manifest = {"format": FORMAT_VERSION, "model_name": self.model_name, "world_size": dist.get_world_size(),
                        "config": str(self.pm.config), **info, "files": listing}
            tmp = partial / (MANIFEST + ".tmp")
            with tmp.open("w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(partial / MANIFEST)
            final = _folder(self.root, step)
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            _fsync_dir(self.root)
            self._prune(step)
        dist.barrier()

    def _prune(self, step: int) -> None:
        """Keep the newest `keep_last` complete checkpoints; drop abandoned partial folders."""
        for old in complete_checkpoints(self.root)[:-self.keep_last]:
            shutil.rmtree(old.path, ignore_errors=True)
        for stale in self.root.glob("step_*.partial"):
            if stale.name != f"step_{step:08d}.partial":
                shutil.rmtree(stale, ignore_errors=True)

    # ---- resume ----
    def resume(self) -> CheckpointInfo:
        """Load the latest complete checkpoint that verifies into this layout (collective).

        A corrupted or unreadable one is reported and the previous one tried; none left → CheckpointError.
        """
        self.wait()
        self.pm.wait_pending("checkpoint resume")  # nothing in flight may land on the loaded weights
        found = complete_checkpoints(self.root) if dist.get_rank() == 0 else None
        payload = [found]
        dist.broadcast_object_list(payload, src=0)
        found = payload[0]
        if not found:
            partial = sorted(p.name for p in self.root.glob("step_*.partial")) if self.root.is_dir() else []
            raise CheckpointError(
                f"--resume: no complete checkpoint in {self.root}"
                + (f" (only incomplete saves: {', '.join(partial)})" if partial else "")
                + "; start without --resume, or point --checkpoint-dir at the folder the run saved to")
        reasons = []
        for info in reversed(found):
            problem = self._verify(info)
            if problem is None:
                self._check_model(info)
                try:
                    self._load(info)
                    if reasons and dist.get_rank() == 0:
                        print(f"autopar: resumed from {info.path.name} instead: " + "; ".join(reasons), flush=True)
                    return info
                except CheckpointException as e:
                    problem = f"loading failed: {str(e).splitlines()[0][:300]}"
            reasons.append(f"{info.path} is unusable ({problem})")
            if dist.get_rank() == 0:
                print(f"autopar: checkpoint {info.path} is unusable ({problem}); trying the previous one", flush=True)
        raise CheckpointError("--resume: no usable checkpoint in " + str(self.root) + ": " + "; ".join(reasons)
                              + ". Start without --resume, or restore the files from a copy")

    def _verify(self, info: CheckpointInfo) -> str | None:
        """The first file whose size or CRC-32 differs from the manifest (checked by all ranks in turn)."""
        files = sorted(info.manifest.get("files", {}).items())
        if not files:
            return f"{MANIFEST} lists no files"
        rank, world = dist.get_rank(), dist.get_world_size()
        problem = None
        for name, want in files[rank::world]:
            path = info.path / name
            if not path.is_file():
                problem = f"shard {name} is missing"
            elif path.stat().st_size != want["bytes"]:
                problem = f"shard {name} has {path.stat().st_size} bytes, the manifest says {want['bytes']}"
            elif _crc32(path) != want["crc32"]:
                problem = f"shard {name} is corrupted (CRC-32 differs from the manifest)"
            if problem:
                break
        problems: list[Any] = [None] * world
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p), None)

    def _check_model(self, info: CheckpointInfo) -> None:
        """Every parameter this rank holds is in the checkpoint with the same global shape, else name both models."""
        saved = FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
        wrong = []
        for name, t in state_io.model_state(self._parts, self.pm.stepper).items():
            meta = saved.get(f"model.{name}")
            if not isinstance(meta, TensorStorageMetadata):
                wrong.append(f"{name} missing")
            elif tuple(meta.size) != _global_shape(t):
                wrong.append(f"{name} {tuple(meta.size)} vs {_global_shape(t)} here")
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, wrong[:3])
        wrong = [w for ws in gathered for w in ws]
        if wrong:
            raise CheckpointError(
                f"checkpoint {info.path} holds model {info.manifest.get('model_name')!r}, but this job trains "
                f"{self.model_name!r} with other parameters ({'; '.join(wrong[:3])}); resume with the model and "
                "--override flags it was saved with, or use another --checkpoint-dir")

    def _load(self, info: CheckpointInfo) -> None:
        parts, optimizer = self._parts, self.pm.stepper
        state_io.init_optimizer_state(optimizer, self.pm.updates)
        state: dict[str, Any] = {"model": state_io.model_state(parts, optimizer),
                                 "optim": state_io.optimizer_state(optimizer, parts)}
        same_world = info.manifest.get("world_size") == dist.get_world_size()
        rng = _rng_states(self.pm.device) if same_world else {}
        dcp.load({**state, **rng}, checkpoint_id=str(info.path))
        state_io.restore_scalars(state["optim"], optimizer, parts)
        set_rng_states(self.pm.device, {key.split(".")[1]: value for key, value in rng.items()})
        if self.pm.loss_scaler is not None and "loss_scale" in info.manifest:  # saved under fp16 too
            self.pm.loss_scaler.load_state_dict(info.manifest["loss_scale"])

