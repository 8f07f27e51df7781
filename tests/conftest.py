"""Session set-up shared by the suite: the capture cache's folder, and the longest jobs scheduled first."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from capture_cache import ENV

_OWN_FOLDER: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """xdist's chunk size; the controller names one capture-cache folder for the session, which xdist workers
    and the ranks they start inherit through the environment (tests/capture_cache.py)."""
    # no test reaches the network: a Hub name not in a test's cache is refused at once, not fetched
    # (tests/test_hf_config_model.py replaces the fetch where it tests it)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if getattr(config.option, "maxschedchunk", 0) is None:
        # one test at a time from the xdist queue (unless the command line says otherwise): with xdist's
        # default chunks an eighth of the suite goes to each worker at the start, so one would hold every long test
        config.option.maxschedchunk = 1
    if os.environ.get(ENV) or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    folder = tempfile.mkdtemp(prefix="autopar-captures-")
    os.environ[ENV] = folder
    _OWN_FOLDER.append(folder)


def pytest_unconfigure(config: pytest.Config) -> None:
    for folder in _OWN_FOLDER:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(ENV, None)


# Seconds each of the suite's longest self-contained tests took (`python -m pytest -q -n 2 --durations=80` on
# the 2-vCPU dev VM, 2026-11-27, load 5-10 from other sessions: only their order matters). They run first,
# longest first, and xdist hands out one test at a time (--maxschedchunk 1), so a worker never ends the run
# alone in an eight-rank job that started last while the other sat idle. Tests that share a module-scoped
# fixture with others (tests/test_checkpoint.py's uninterrupted run) stay in place so that one worker builds it.
# Keys: file::test, with the parameters where one case differs from the others.
LONGEST_S = {
    # README's blocks (tests/test_readme.py), each alone at load 6-7: the profile → plan → run → report →
    # calibrate chain and the kill-and-resume block; the others (CLI, journey, train_gpt) take 20-70 s there
    "test_readme.py::test_block_runs_as_written[README_block4]": 155.0,
    "test_checkpoint.py::test_token_file_run_killed_at_step_6_resumes_on_the_same_tokens": 117.0,
    "test_readme.py::test_block_runs_as_written[README_block5]": 85.6,
    "test_readme.py::test_block_runs_as_written[README_block2]": 70.0,
    "test_eight_ranks.py::test_three_d_zero3_on_eight_ranks": 89.5,
    "test_conformance_hf.py::test_tp2_dp2_on_four_ranks": 88.3,
    "test_conformance_kinds.py::test_model_kinds_train_as_one_process": 75.4,
    "test_context_parallel.py::test_cp2_with_tp2_pp2_and_zero3_dp2_on_four_ranks": 65.9,
    "test_precision.py::test_memory_bytes_fp16_overflow_and_cp_clipping_on_four_ranks": 55.2,
    "test_golden_plans.py::test_plan_matches_golden[llama3-405b]": 46.5,
    "test_ilp.py::test_planning_prints_nothing_to_stdout": 37.1,
    "test_precision.py::test_policies_clipping_and_schedules_on_two_ranks": 33.0,
    "test_labels_in_batch.py::test_labels_inside_the_batch_train_as_one_process": 30.0,  # dp2 52, tp2 34, pp2 22
    "test_conformance_hf.py::test_moe_families_dp_tp_pp": 27.2,
    "test_failures.py::test_a_peer_blocked_on_a_rank_that_caught_its_failure_stops_within_seconds": 23.7,
    "test_conformance_hf.py::test_families_pipeline_1f1b": 21.4,  # [0] 22.5, [1] 20.3
    "test_dp_costs.py::test_predicted_collective_count_is_what_the_runtime_issues": 21.0,  # zero1 21.4, zero3-m2 20.7
    "test_conformance_own.py::test_own_models_under_tp2_pp2_and_zero3": 20.5,
    "test_error_band.py::test_pessimistic_objective_prefers_the_safer_layout_when_the_advantage_is_inside_the_band":
        19.8,
    "test_golden_plans.py::test_plan_matches_golden[llama3-70b]": 15.7,
    "test_expert_parallel.py::test_ffn_split_found_from_the_data_flow[gpt_oss-want1]": 15.2,
    "test_fp8_offload.py::test_fp8_and_offload_match_one_process_on_two_ranks": 14.8,
    "test_loss_memory.py::test_cross_entropy_peak_over_upcast_logits_is_measured": 14.6,
    "test_parity_recompute.py::test_parity_compiled_blocks_with_op_sac": 14.3,
    "test_failures.py::test_the_watch_thread_ends_before_the_interpreter_finalizes": 14.3,
    "test_report_run.py::test_end_to_end_two_processes": 14.0,
    "test_parity.py::test_parity_dp_zero_tp_on_two_ranks": 12.5,
}


def _longest_s(item: pytest.Item) -> float:
    path, _, name = item.nodeid.partition("::")
    key = f"{path.rsplit('/', 1)[-1]}::{name}"
    return LONGEST_S.get(key, LONGEST_S.get(key.split("[", 1)[0], 0.0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, longest first; the others after them in collection order (a stable sort:
    every xdist worker must collect the same order)."""
    items.sort(key=lambda item: -_longest_s(item))
