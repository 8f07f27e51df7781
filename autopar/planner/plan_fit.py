"""Does a plan fit a model graph? Checked where the two meet: codegen's entry, `autopar.estimate(stages=…)`
and the CLI commands that read a plan file beside a model.

A plan checks itself (`Plan.check`); here it is held against the graph it claims to be for: the same
fingerprint, stages that hold every layer exactly once and in the model's order, a tensor-parallel degree
that splits every head count and vocabulary, and figures that agree with the model's FLOPs.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.capture.graph import ModelGraph, sequence_parallel_expert_conflict, sequence_parallel_refusal
from autopar.checks import close
from autopar.errors import PlanMismatchError
from autopar.plan import Plan, StagePlan, plan_error

__all__ = ["check_plan_for_graph", "check_stages_for_graph"]


def check_plan_for_graph(plan: Plan, graph: ModelGraph, *, where: str = "plan") -> None:
    """The plan was made for this graph: same fingerprint, its stages hold every layer of the graph
    exactly once and in order, and its tp splits every tensor-parallel pattern."""
    plan.check(where=where)
    if plan.graph_fingerprint != graph.fingerprint:
        raise PlanMismatchError(
            f"{where} was made for model {plan.model_name!r} (graph fingerprint {plan.graph_fingerprint}) but "
            f"this model is {graph.model_name!r} (fingerprint {graph.fingerprint}); make a plan for this model "
            "with `autopar plan` or autopar.plan(model, cluster, ...)")
    check_stages_for_graph(plan.stages, graph, where=where)
    if plan.config.tp > 1 and (nothing := graph.no_tensor_parallelism()):
        raise plan_error(where, f"tp={plan.config.tp} but {nothing}; re-plan with tp=1")
    for layer in graph.layers:
        for pattern in layer.tp_patterns:
            if not pattern.max_degree_ok(plan.config.tp):
                raise plan_error(where, f"layer {layer.name}: tp={plan.config.tp} does not divide its {pattern.kind} "
                                 f"pattern (heads={pattern.num_heads}, kv heads={pattern.num_kv_heads}, "
                                 f"vocab={pattern.vocab_size})")
    cfg = plan.config
    if cfg.sequence_parallel and (why := sequence_parallel_refusal(graph, cfg.tp)
                                  or sequence_parallel_expert_conflict(graph, cfg.ep, cfg.etp)):
        raise plan_error(where, f"sequence_parallel is on but {why}; re-plan with sequence_parallel=False")
    if plan.seq_len != graph.seq_len:
        raise plan_error(where, f"seq_len = {plan.seq_len} but the model's example input has {graph.seq_len} tokens")
    flops = plan.global_batch_size * (graph.forward_flops + graph.backward_flops)
    for name, est in [("estimate", plan.estimate), *((f"alternatives[{i}]", e) for i, (_, e) in
                                                     enumerate(plan.alternatives))]:
        want = flops / est.step_time_s / plan.config.world_size / 1e12
        if est.tflops_per_device and not close(est.tflops_per_device, want):  # 0: not priced (a hand-made plan)
            raise plan_error(where, f"{name}.tflops_per_device = {est.tflops_per_device:.9g} but the model's "
                             f"FLOPs per step over step_time_s and {plan.config.world_size} devices give {want:.9g}")


def check_stages_for_graph(stages: Sequence[StagePlan], graph: ModelGraph, *, where: str = "plan") -> None:
    """`stages` (StagePlans, in index order) hold the graph's layers exactly once and in order."""
    expected = [la.name for la in graph.layers]
    known = set(expected)
    got = [name for st in stages for name in st.layers]
    unknown = [n for n in got if n not in known]
    if unknown:
        raise plan_error(where, f"layer(s) {unknown[:5]} are not layers of {graph.model_name!r} (its layers: "
                         f"{_names(expected)})")
    missing = [n for n in expected if n not in set(got)]
    if missing:
        raise plan_error(where, f"layer(s) {missing[:5]} of {graph.model_name!r} are in no stage; every layer must be "
                         "in exactly one stage")
    dup = sorted({n for n in got if got.count(n) > 1})
    if dup:
        raise plan_error(where, f"layer(s) {dup[:5]} are in more than one stage")
    if got != expected:
        first = next(i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b)
        raise plan_error(where, f"stages hold the layers out of order: position {first} is {got[first]!r} but the "
                         f"model runs {expected[first]!r} there; stages must follow the model's layer order")


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])}, …, {', '.join(names[-2:])}"
