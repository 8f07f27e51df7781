"""The one place that knows what device a rank trains on: its type, its process-group backend, the
autocast device type, its memory statistics and its random-number state.

Everything device-dependent in codegen, checkpoints and the examples asks this module, so the CUDA/NCCL
path and the CPU/gloo path run the same code: a GPU rank differs from a CPU rank only in the answers
given here.
"""

from __future__ import annotations

import os

import torch

__all__ = ["resolve_device", "backend_for", "autocast_device_type", "device_name", "memory_stats",
           "reset_memory_stats", "rng_states", "set_rng_states", "synchronize"]


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device of this rank: the one given, else cuda:LOCAL_RANK when CUDA is present, else CPU."""
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The process-group backend for `device`: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def autocast_device_type(device: torch.device) -> str:
    """The `device_type` torch.autocast takes for tensors on `device` ("cuda" or "cpu")."""
    return "cuda" if device.type == "cuda" else "cpu"


def device_name(device: torch.device) -> str:
    """What profiles and run records call this device: the CUDA name, else "cpu"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so host clocks time what ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_stats(device: torch.device) -> dict[str, int]:
    """Peak bytes the caching allocator handed out and held since the last reset (CUDA), as
    torch.cuda.max_memory_allocated / max_memory_reserved report them; empty on CPU, which has no
    device allocator to ask."""
    if device.type != "cuda":
        return {}
    return {"max_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved(device))}


def reset_memory_stats(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's generator states: the CPU one, and the device's when it is a GPU in use."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda" and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(device: torch.device, states: dict[str, torch.Tensor]) -> None:
    """Restore what `rng_states` returned (keys this device does not have are ignored)."""
    if "cpu" in states:
        torch.set_rng_state(states["cpu"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
