"""Codegen: a `Plan` applied to a model under torchrun — mesh, pipeline stages, tensor parallelism,
recompute, ZeRO/data parallelism — returning a `ParallelModel` that trains it."""

from autopar.codegen.loss import lm_cross_entropy, vocab_parallel_cross_entropy
from autopar.codegen.parallelize import parallelize
from autopar.codegen.runtime import ParallelModel

__all__ = ["parallelize", "ParallelModel", "lm_cross_entropy", "vocab_parallel_cross_entropy"]
