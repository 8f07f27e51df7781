"""Does a plan fit a model graph? Checked where the two meet: codegen's entry, `autopar.estimate(stages=…)`
and the CLI commands that read a plan file beside a model.

A plan checks itself (`Plan.check`); here it is held against the graph it claims to be for: the same
fingerprint, stages that hold every layer exactly once and in the model's order, a tensor-parallel degree
that splits every head count (a vocabulary it does not divide stays whole: capture.vocab_split), and
figures that agree with the model's FLOPs.

The loss is how a model trains, not which model it is. A plan made for the model training on its own loss
(`labels=` given to its forward) runs a `loss_fn` of its logits, and the converse: the layout and its stage
cuts do not depend on the loss. Only the price does (the program's last layer computes the loss or not), so the
fingerprints differ; the model captured under the plan's loss mode (`recapture`) must then match the plan's,
and the run says once what the other loss changes (`loss_switch_note`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from autopar.capture.graph import ModelGraph
from autopar.capture.loss_mode import LOSS_FN, describe_loss_mode, loss_mode, own_loss_target
from autopar.capture.sequence import sequence_parallel_expert_conflict, sequence_parallel_refusal
from autopar.checks import close
from autopar.errors import PlanMismatchError
from autopar.plan import Plan, StagePlan, plan_error

__all__ = ["check_plan_for_graph", "check_stages_for_graph", "loss_switch_note"]

# the model captured under a loss mode ("loss_fn", "own:labels"; "own:" finds the target argument itself), or
# None when it cannot be captured again (no example inputs)
Recapture = Callable[[str], "ModelGraph | None"]


def check_plan_for_graph(plan: Plan, graph: ModelGraph, *, where: str = "plan",
                         recapture: Recapture | None = None) -> ModelGraph:
    """The plan was made for this graph: same fingerprint (or the same model under another loss mode, captured
    by `recapture`), its stages hold every layer of the graph exactly once and in order, and its tp splits
    every tensor-parallel pattern. Returns the graph the plan was priced on: `graph`, or the recaptured one."""
    plan.check(where=where)
    priced = graph
    if plan.graph_fingerprint != graph.fingerprint:
        priced = _under_plan_loss(plan, graph, recapture) or _refuse_other_model(plan, graph, where)
    check_stages_for_graph(plan.stages, graph, where=where)
    if plan.config.tp > 1 and (nothing := graph.no_tensor_parallelism()):
        raise plan_error(where, f"tp={plan.config.tp} but {nothing}; re-plan with tp=1")
    for layer in graph.layers:
        for pattern in layer.tp_patterns:
            if not pattern.max_degree_ok(plan.config.tp):  # a vocabulary tp does not divide stays whole
                raise plan_error(where, f"layer {layer.name}: tp={plan.config.tp} does not divide its {pattern.kind} "
                                 f"pattern (heads={pattern.num_heads}, kv heads={pattern.num_kv_heads}); "
                                 "re-plan with a tp that divides them")
    cfg = plan.config
    if cfg.sequence_parallel and (why := sequence_parallel_refusal(graph, cfg.tp)
                                  or sequence_parallel_expert_conflict(graph, cfg.ep, cfg.etp)):
        raise plan_error(where, f"sequence_parallel is on but {why}; re-plan with sequence_parallel=False")
    if plan.seq_len != graph.seq_len:
        raise plan_error(where, f"seq_len = {plan.seq_len} but the model's example input has {graph.seq_len} tokens")
    flops = plan.global_batch_size * (priced.forward_flops + priced.backward_flops)
    for name, est in [("estimate", plan.estimate), *((f"alternatives[{i}]", e) for i, (_, e) in
                                                     enumerate(plan.alternatives))]:
        want = flops / est.step_time_s / plan.config.world_size / 1e12
        if est.tflops_per_device and not close(est.tflops_per_device, want):  # 0: not priced (a hand-made plan)
            raise plan_error(where, f"{name}.tflops_per_device = {est.tflops_per_device:.9g} but the model's "
                             f"FLOPs per step over step_time_s and {plan.config.world_size} devices give {want:.9g}")
    return priced


def _under_plan_loss(plan: Plan, graph: ModelGraph, recapture: Recapture | None) -> ModelGraph | None:
    """The model captured under the loss mode the plan was priced with, when that matches the plan."""
    if recapture is None:
        return None
    if plan.loss_mode:
        modes = [plan.loss_mode] if plan.loss_mode != graph.loss_mode else []
    else:  # a plan from before loss modes were recorded: the other mode
        modes = [loss_mode("") if graph.loss_mode == LOSS_FN else LOSS_FN]
    for mode in modes:
        other = recapture(mode)
        if other is not None and other.fingerprint == plan.graph_fingerprint:
            return other
    return None


def _refuse_other_model(plan: Plan, graph: ModelGraph, where: str) -> ModelGraph:
    """Raise the error for a plan made for another model, saying what differs."""
    differs = []
    if plan.model_name != graph.model_name:
        differs.append(f"it is for {plan.model_name!r}, this model is {graph.model_name!r}")
    planned = [name for st in plan.stages for name in st.layers]
    layers = [la.name for la in graph.layers]
    if planned != layers:
        differs.append(f"its {len(planned)} layers ({_names(planned)}) are not this model's {len(layers)} "
                       f"({_names(layers)})")
    if plan.seq_len != graph.seq_len:
        differs.append(f"it is for {plan.seq_len} tokens per sample, the example inputs have {graph.seq_len}")
    if plan.loss_mode and plan.loss_mode != graph.loss_mode:
        differs.append(f"it trains on {describe_loss_mode(plan.loss_mode)}, this run on "
                       f"{describe_loss_mode(graph.loss_mode)}")
    if not differs:
        differs.append(f"both are {graph.model_name!r} with the same layers and {graph.seq_len} tokens per sample, so "
                       "the configuration (widths, heads, vocabulary, dtype) or the example inputs' other tensors "
                       "(masks, keyword inputs) differ")
    raise PlanMismatchError(
        f"{where} was made for another model (graph fingerprint {plan.graph_fingerprint}; this model's is "
        f"{graph.fingerprint}): {'; '.join(differs)}. Make the plan from this model and the inputs you train it "
        "with: autopar.plan(model, cluster, example_inputs=..., example_kwargs=...), or `autopar plan "
        "path/file.py:factory` with the factory that builds it")


def loss_switch_note(plan: Plan, priced: ModelGraph, graph: ModelGraph, micro_batch_size: int) -> str | None:
    """What training under `graph`'s loss changes against the plan, priced on `priced` (None: nothing)."""
    if priced is graph:
        return None
    plan_flops = priced.forward_flops + priced.backward_flops
    run_flops = graph.forward_flops + graph.backward_flops
    saved = (graph.saved_activation_bytes - priced.saved_activation_bytes) * micro_batch_size
    moved = sum(la.bytes_read + la.bytes_written for la in graph.layers) - \
        sum(la.bytes_read + la.bytes_written for la in priced.layers)
    changed = [a.name for a, b in zip(graph.layers, priced.layers, strict=True) if a != b]
    if own_loss_target(graph.loss_mode) is None:
        fix = "pass the same loss_fn= to autopar.plan (CLI: autopar plan --external-loss)"
    else:
        fix = "plan without loss_fn (CLI: autopar plan without --external-loss)"
    return (f"autopar: the plan priced {graph.model_name} training on {describe_loss_mode(priced.loss_mode)}; this "
            f"run trains on {describe_loss_mode(graph.loss_mode)}. The layout and its stage cuts stand (they do not "
            f"depend on the loss); this run's program differs in {_names(changed) or 'no layer'}: "
            f"{(run_flops - plan_flops) / plan_flops:+.3%} FLOPs, {moved * micro_batch_size / 2**20:+.3f} MiB moved "
            f"by its kernels and {saved / 2**20:+.3f} MiB of saved activations per micro-batch of "
            f"{micro_batch_size}. To price exactly what trains, {fix}")


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
