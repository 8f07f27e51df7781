"""The exceptions autopar raises for bad input or impossible requests.

Every message says what is wrong, shows the values involved and says how to fix it.
The CLI prints the one-line message and exits 1.
"""

from __future__ import annotations

__all__ = [
    "AutoparError",
    "CaptureError",
    "CheckpointError",
    "ClusterSpecError",
    "ConfigError",
    "InfeasiblePlanError",
    "PeerFailedError",
    "PlanMismatchError",
    "ProfileMismatchError",
]


class AutoparError(Exception):
    """Base of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be traced or analysed."""


class ConfigError(AutoparError, ValueError):
    """A ParallelConfig or PlannerOptions field has an invalid value (also a ValueError, as it always was)."""


class ClusterSpecError(AutoparError):
    """A cluster preset name or cluster file is malformed."""


class InfeasiblePlanError(AutoparError):
    """No layout in the search space fits the model on the cluster."""


class PlanMismatchError(AutoparError):
    """A plan was made for another model, cluster or world size."""


class ProfileMismatchError(AutoparError):
    """A profile or run record comes from another machine, model, plan or torch version."""


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete, corrupted, or of another model."""


class PeerFailedError(AutoparError):
    """Another rank of the job failed; this rank stopped because of it (the message names that rank)."""
