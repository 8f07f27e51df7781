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


# Seconds each of the suite's longest self-contained tests took (`python -m pytest -q -n 2 --durations=60` on
# the 2-vCPU dev VM, 2026-11-27, under load from other sessions: only their order matters). They run first,
# longest first, and xdist hands out one test at a time (--maxschedchunk 1), so a worker never ends the run
# alone in an eight-rank job that started last while the other sat idle. Tests that share a module-scoped
# fixture with others (tests/test_checkpoint.py's uninterrupted run) stay in place so that one worker builds it.
LONGEST_S = {
    "test_eight_ranks.py::test_three_d_zero3_on_eight_ranks": 203.1,
    "test_conformance_kinds.py::test_model_kinds_train_as_one_process": 196.8,
    "test_checkpoint.py::test_token_file_run_killed_at_step_6_resumes_on_the_same_tokens": 184.3,
    "test_context_parallel.py::test_cp2_with_tp2_pp2_and_zero3_dp2_on_four_ranks": 142.5,
    "test_conformance_hf.py::test_tp2_dp2_on_four_ranks": 133.7,
    "test_precision.py::test_memory_bytes_fp16_overflow_and_cp_clipping_on_four_ranks": 122.9,
    "test_precision.py::test_policies_clipping_and_schedules_on_two_ranks": 121.3,
    "test_conformance_hf.py::test_moe_families_dp_tp_pp": 114.7,
    "test_conformance_hf.py::test_families_pipeline_1f1b": 89.1,  # per half: [0] 100.2, [1] 78.0
    "test_conformance_hf.py::test_families_tensor_parallel": 83.3,  # [0] 68.7, [1] 98.0
    "test_context_parallel.py::test_cp2_alone_and_with_each_recompute_mode_on_two_ranks": 87.2,
    "test_parity.py::test_parity_dp_zero_tp_on_two_ranks": 77.9,
    "test_checkpoint.py::test_kill_during_save_leaves_previous_checkpoint_usable": 75.6,
    "test_conformance_own.py::test_own_models_under_tp2_pp2_and_zero3": 73.1,
    "test_parity.py::test_parity_pipeline_schedules_and_recompute_on_two_ranks": 67.2,
    "test_fp8_offload.py::test_fp8_and_offload_match_one_process_on_two_ranks": 67.0,
    "test_codegen.py::test_checkpoint_resume_gives_identical_next_step_loss": 61.9,
    "test_conformance_hf.py::test_families_data_parallel": 48.4,  # [0] 43.2, [1] 53.7
    "test_pipeline_order.py::test_planner_takes_the_fastest_group_that_fits_where_torchs_does_not": 52.9,
    "test_parity_recompute.py::test_parity_op_sac_and_per_layer_recompute_on_two_ranks": 52.4,
    "test_ep_collectives.py::test_expert_parallel_collectives_are_the_priced_ones": 51.4,
    "test_expert_parallel.py::test_expert_tensor_parallel_checkpoint_loads_into_another_layout": 50.9,
    "test_expert_parallel.py::test_expert_parallel_checkpoint_loads_into_another_layout": 49.6,
    "test_conformance_hf.py::test_own_model_with_skip_connection_tied_head_and_root_parameter": 46.8,
    "test_codegen.py::test_tp_collectives_observed_are_the_ones_the_cost_model_prices": 43.1,
    "test_report_run.py::test_end_to_end_two_processes": 39.8,
}


def _longest_s(item: pytest.Item) -> float:
    path, _, name = item.nodeid.partition("::")
    return LONGEST_S.get(f"{path.rsplit('/', 1)[-1]}::{name.split('[', 1)[0]}", 0.0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, longest first; the others after them in collection order (a stable sort:
    every xdist worker must collect the same order)."""
    items.sort(key=lambda item: -_longest_s(item))
