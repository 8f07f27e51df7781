"""autopar: plan and apply tensor / pipeline / data parallelism for PyTorch training.

    graph = autopar.capture(model, example_inputs)
    plan = autopar.plan(model, cluster, example_inputs=x, global_batch_size=1536)
    pm = autopar.parallelize(model, plan, example_inputs=x, optimizer=..., loss_fn=...)
"""

from autopar import zoo
from autopar.api import estimate, parallelize, plan  # the functions shadow the submodule name autopar.plan
from autopar.budget import Budget, BudgetPoint, budget  # the function shadows the submodule name autopar.budget
from autopar.capture import capture  # the function shadows the subpackage name (autopar.capture(...))
from autopar.capture.graph import LayerSpec, ModelGraph, TPPattern
from autopar.cluster import Cluster
from autopar.config import ParallelConfig, PlannerOptions
from autopar.errors import (
    AutoparError,
    CaptureError,
    ClusterSpecError,
    ConfigError,
    InfeasiblePlanError,
    PlanMismatchError,
    ProfileMismatchError,
)
from autopar.plan import Estimate, Plan, StagePlan

__all__ = [
    "zoo",
    "capture",
    "plan",
    "estimate",
    "parallelize",
    "budget",
    "Budget",
    "BudgetPoint",
    "LayerSpec",
    "ModelGraph",
    "TPPattern",
    "Cluster",
    "ParallelConfig",
    "PlannerOptions",
    "Plan",
    "Estimate",
    "StagePlan",
    "AutoparError",
    "CaptureError",
    "ClusterSpecError",
    "ConfigError",
    "InfeasiblePlanError",
    "PlanMismatchError",
    "ProfileMismatchError",
]
