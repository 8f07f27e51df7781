"""cost_models: how long training work takes and how much memory it needs, independent of autopar."""

from cost_models.hardware import DeviceSpec, LinkSpec

__all__ = ["DeviceSpec", "LinkSpec"]
