"""Fault tolerance: a killed rank, a relaunch on another layout and a kill mid-save all continue the
uninterrupted trajectory; bad checkpoints and plans are refused with a clear error.

References: the uninterrupted run of the same command (the resumed run must match it bit for bit on
the same layout, within rtol 1e-4 on another), and a plain single-process AdamW run of the same model
on the same batches (examples/train_gpt.py's `bigram_batch`, a pure function of the step), whose losses
every run must match within rtol 1e-4. (Final weights are compared with the parallel uninterrupted run
only: AdamW turns the last-bit differences of rarely seen embedding rows' tiny gradients into
lr-sized steps, so any two reduction orders differ there by ~1e-3 after 8 steps.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist_harness import free_port, run_distributed

import autopar
from autopar.codegen import lm_cross_entropy
from autopar.config import PlannerOptions

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
MODEL, SEQ, BATCH, STEPS, LR = "gpt-tiny", 64, 8, 8, 3e-3
COMMON = ["--model", MODEL, "--seq-len", str(SEQ), "--override", "dropout=0", "--global-batch-size", str(BATCH),
          "--lr", str(LR)]
RTOL = 1e-4


def _example():
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def single_device_losses() -> dict[int, float]:
    """Losses by step of a plain single-process AdamW run of the script's model on the script's batches."""
    ex = _example()
    torch.manual_seed(0)  # as the script does before building the model
    model, _ = ex.build_model(MODEL, SEQ, "cpu", None, dropout=0)
    opt = ex.make_optimizer(SimpleNamespace(lr=LR))(list(model.named_parameters()))  # the script's AdamW groups
    vocab = autopar.zoo.config(MODEL).vocab_size
    losses = {}
    for step in range(1, STEPS + 1):
        x, t = ex.bigram_batch(vocab, SEQ, BATCH, step)
        opt.zero_grad()
        loss = lm_cross_entropy(model(x), t)
        loss.backward()
        opt.step()
        losses[step] = loss.item()
    return losses


def _plan(path: Path, nproc: int, **pins) -> Path:
    model, example = _example().build_model(MODEL, SEQ, "cpu", None, dropout=0)
    plan = autopar.plan(model, autopar.Cluster.local(nproc=nproc), example_inputs=example, global_batch_size=BATCH,
                        options=PlannerOptions(**pins))
    plan.save(path)
    return path


def _torchrun(nproc: int, *args: str, max_restarts: int = 0, timeout_s: float = 240) -> str:
    """The job's stdout and stderr; fails the test if the job fails."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master-port",
           str(free_port()), "--max-restarts", str(max_restarts), str(SCRIPT), *COMMON, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")
    return out.stdout + out.stderr


@dataclass(frozen=True)
class Run:
    losses: dict[int, float]
    weights: dict[str, torch.Tensor]
    checkpoints: Path
    log: str


def _run(folder: Path, nproc: int, plan: Path, *args: str, max_restarts: int = 0) -> Run:
    folder.mkdir()
    log = _torchrun(nproc, "--plan", str(plan), "--steps", str(STEPS), "--checkpoint-dir", str(folder / "ck"),
                    "--record", str(folder / "r.json"), "--save-final", str(folder / "f.pt"), *args,
                    max_restarts=max_restarts)
    losses = {step: loss for step, loss in json.loads((folder / "r.json").read_text())["losses"]}
    return Run(losses, torch.load(folder / "f.pt"), folder / "ck", log)


@pytest.fixture(scope="module")
def plan_a(tmp_path_factory) -> Path:
    return _plan(tmp_path_factory.mktemp("plans") / "A.json", 4, tp=2, dp=2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, plan_a) -> Run:
    """8 steps of tp2·dp2 on 4 processes, a checkpoint every 2 steps (all kept), written asynchronously."""
    return _run(tmp_path_factory.mktemp("run") / "a", 4, plan_a, "--checkpoint-every", "2", "--keep-checkpoints", "4",
                "--async-checkpoint")


@pytest.mark.multiproc
def test_killed_rank_restarts_from_latest_checkpoint_on_four_processes(tmp_path, plan_a, uninterrupted,
                                                                      single_device_losses):
    run = _run(tmp_path / "fault", 4, plan_a, "--checkpoint-every", "2", "--fail-at-step", "6", max_restarts=1)
    assert "--fail-at-step 6: SIGKILL" in run.log  # the fault happened, and the restart resumed:
    assert "resumed from" in run.log and "step_00000004" in run.log
    assert sorted(run.losses) == [5, 6, 7, 8]  # the second attempt ran steps 5-8 only
    assert run.losses == {s: uninterrupted.losses[s] for s in run.losses}  # bit for bit, same layout
    assert run.weights.keys() == uninterrupted.weights.keys()
    assert all(torch.equal(run.weights[k], uninterrupted.weights[k]) for k in run.weights)
    for step, loss in run.losses.items():  # and the trajectory is the single-device one
        assert loss == pytest.approx(single_device_losses[step], rel=RTOL), step


@pytest.mark.multiproc
def test_tp2_dp2_checkpoint_resumes_as_pp2_on_two_processes(tmp_path, uninterrupted, single_device_losses):
    ck = tmp_path / "ck"
    shutil.copytree(uninterrupted.checkpoints / "step_00000004", ck / "step_00000004")  # as if it ran 4 steps
    log = _torchrun(2, "--plan", str(_plan(tmp_path / "B.json", 2, pp=2)), "--steps", str(STEPS),
                    "--checkpoint-dir", str(ck), "--resume", "--record", str(tmp_path / "r.json"),
                    "--save-final", str(tmp_path / "f.pt"))
    assert "saved by 4 processes as tp=2,pp=1,dp=2" in log
    losses = dict(json.loads((tmp_path / "r.json").read_text())["losses"])
    assert sorted(losses) == [5, 6, 7, 8]
    for step, loss in losses.items():
        assert loss == pytest.approx(uninterrupted.losses[step], rel=RTOL), step
        assert loss == pytest.approx(single_device_losses[step], rel=RTOL), step
    weights = torch.load(tmp_path / "f.pt")
    assert weights.keys() == uninterrupted.weights.keys()
    # atol 2e-5: train_gpt's AdamW (eps 1e-8) turns the fp32 rounding by which tp2's vocab-parallel loss and pp2's
    # plain one differ into lr-sized moves of elements whose gradient is ~1e-9 (one embedding element of 65k moved
    # 1.4e-5 with the chunked loss); the losses above match at rtol 1e-4 every step
    for name, want in uninterrupted.weights.items():
        torch.testing.assert_close(weights[name], want, rtol=RTOL, atol=2e-5, msg=name)


# ---- kill during a save; bad checkpoints (small parity models, in-process ranks) ----

def _parallel(kind: str, **config):
    from parity_models import build_model, graph_of, make_plan, optimizer

    from autopar.codegen import parallelize

    model = build_model(kind)
    graph = graph_of(kind, model)
    return parallelize(model, make_plan(graph, **config), graph=graph, optimizer=optimizer)


def _train(pm, first: int, last: int) -> list[float]:
    """Global steps first..last (from 1) of parity_models' batches."""
    from parity_models import batches

    return [pm.train_step(pm.local_batch(x), pm.local_batch(t)) for x, t in batches(last)[first - 1:last]]


def _killed_mid_save(root: str) -> None:
    """ZeRO-1 on 2 ranks (each holds half the optimizer state): save after step 2, train steps 3-4, then
    rank 1 dies inside the save of step 4, after its shard is written (every byte is on disk; only the
    commit is missing)."""
    import torch.distributed as dist

    from autopar.codegen import checkpoint

    pm = _parallel("gpt", dp=2, zero_stage=1)
    ck = checkpoint.Checkpointer(pm, root, model_name="gpt")
    _train(pm, 1, 2)
    ck.save(2)
    _train(pm, 3, 4)
    real_save = checkpoint.dcp.save

    def save_then_die(*args, **kwargs):
        real_save(*args, **kwargs)
        if dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    checkpoint.dcp.save = save_then_die
    ck.save(4)


def _resume_after_kill(root: str) -> tuple[int, float]:
    from autopar.codegen.checkpoint import Checkpointer

    pm = _parallel("gpt", num_microbatches=2)  # another layout and world size, on purpose
    info = Checkpointer(pm, root, model_name="gpt").resume()
    return info.step, _train(pm, 3, 3)[0]


def _single_device_losses(steps: int) -> list[float]:
    from parity_models import batches, build_model, logits_of, optimizer

    model = build_model("gpt")
    opt = optimizer(model.parameters())
    losses = []
    for x, t in batches(steps):
        opt.zero_grad()
        loss = lm_cross_entropy(logits_of(model, x), t)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.multiproc
def test_kill_during_save_leaves_previous_checkpoint_usable(tmp_path):
    root = str(tmp_path / "ck")
    with pytest.raises(AssertionError, match="failed"):
        run_distributed(_killed_mid_save, 2, root, timeout_s=120)
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000004.partial"]  # step 4 never committed
    assert (tmp_path / "ck" / "step_00000004.partial" / ".metadata").exists()  # though all its data was written
    step, loss = run_distributed(_resume_after_kill, 1, root)[0]
    assert step == 2
    assert loss == pytest.approx(_single_device_losses(3)[2], rel=RTOL)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _bad_inputs(root: str, plan_for_four: str) -> dict:
    from autopar.codegen.checkpoint import Checkpointer, complete_checkpoints
    from autopar.errors import CheckpointError

    out: dict = {}
    pm = _parallel("gpt")
    try:
        Checkpointer(pm, Path(root) / "empty", model_name="gpt").resume()
    except CheckpointError as e:
        out["empty"] = str(e)
    ck = Checkpointer(pm, Path(root) / "ck", model_name="gpt", keep_last=3)
    rng_at_step1 = None
    for step in (1, 2):
        _train(pm, step, step)
        rng_at_step1 = torch.get_rng_state() if step == 1 else rng_at_step1
        ck.save(step)
        torch.rand(3)  # the generator moves on after the save
    _flip_byte(Path(root) / "ck" / "step_00000002" / "__0_0.distcp")
    out["fallback_step"] = ck.resume().step
    out["rng_restored"] = torch.equal(torch.get_rng_state(), rng_at_step1)
    out["next_loss"] = _train(pm, 2, 2)[0]  # step 2 again, from the step-1 checkpoint
    _flip_byte(Path(root) / "ck" / "step_00000001" / "__0_0.distcp")
    try:
        ck.resume()
    except CheckpointError as e:
        out["all_corrupt"] = str(e)
    kept = Checkpointer(pm, Path(root) / "gpt", model_name="gpt", keep_last=2)
    for step in (3, 4, 5):
        kept.save(step)
    out["kept"] = [c.step for c in complete_checkpoints(Path(root) / "gpt")]
    try:
        Checkpointer(_parallel("hf_llama"), Path(root) / "gpt", model_name="hf_llama").resume()
    except CheckpointError as e:
        out["other_model"] = str(e)
    try:
        _example().main([*COMMON, "--plan", plan_for_four, "--steps", "1"])
    except SystemExit as e:
        out["world_size"] = str(e)
    return out


@pytest.mark.multiproc
def test_bad_checkpoints_and_plans_are_refused_clearly(tmp_path, plan_a):
    out = run_distributed(_bad_inputs, 1, str(tmp_path), str(plan_a))[0]
    assert "no complete checkpoint in" in out["empty"] and "without --resume" in out["empty"]
    assert out["fallback_step"] == 1  # the corrupted step-2 shard was detected; step 1 loaded instead
    assert out["rng_restored"]  # same world size: the generator is where it was at the step-1 save
    assert out["kept"] == [4, 5]  # keep_last=2
    assert out["next_loss"] == pytest.approx(_single_device_losses(2)[1], rel=RTOL)
    assert "no usable checkpoint" in out["all_corrupt"] and "corrupted" in out["all_corrupt"]
    assert "step_00000002" in out["all_corrupt"] and "step_00000001" in out["all_corrupt"]
    assert "holds model 'gpt'" in out["other_model"] and "'hf_llama'" in out["other_model"]
    assert "is for 4 processes" in out["world_size"] and "this job has 1" in out["world_size"]
    assert "--plan auto" in out["world_size"]


def test_restart_attempts_are_numbered_alike_by_every_worker():
    """Workers of one attempt join one block, whatever order they arrive in; a block of another world size
    (the job came back with fewer processes) starts afresh."""
    import threading

    import torch.distributed as dist

    from autopar.codegen.elastic import _join_block

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    got: list[tuple[int, int]] = []

    def join(world: int) -> None:
        got.append((world, _join_block(dist.TCPStore("127.0.0.1", port, 1, is_master=False), world)))

    for world in (4, 4, 2):
        threads = [threading.Thread(target=join, args=(world,)) for _ in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(got) == [(2, 3), (2, 3), (4, 1), (4, 1), (4, 1), (4, 1), (4, 2), (4, 2), (4, 2), (4, 2)]
    del server


@pytest.mark.multiproc
def test_token_file_run_killed_at_step_6_resumes_on_the_same_tokens(tmp_path):
    """--data (README.md's bytes as token ids), the fp32 CPU recipe with --max-grad-norm and a cosine LR
    schedule: rank 1 killed at step 6 and restarted from the step-4 checkpoint reads the same tokens (the
    data position is in the checkpoint) and reproduces the uninterrupted run's losses bit for bit."""
    plan = _plan(tmp_path / "dp2.json", 2, dp=2)
    tokens = tmp_path / "readme.bin"
    recipe = ["--data", str(tokens), "--max-grad-norm", "1.0", "--lr-schedule", "cosine", "--lr-warmup-steps", "2"]

    def run(name: str, *extra: str, max_restarts: int = 0) -> tuple[dict[int, float], dict[int, str], str]:
        folder = tmp_path / name
        log = _torchrun(2, "--plan", str(plan), "--steps", str(STEPS), "--checkpoint-dir", str(folder / "ck"),
                        "--checkpoint-every", "2", "--record", str(folder / "r.json"), *recipe, *extra,
                        max_restarts=max_restarts)
        crc = {}
        for line in log.splitlines():  # the last time each step ran (a restart runs some again)
            if "tokens crc32" in line:
                step = int(line.split(" step ")[1].split("/")[0])
                crc[step] = line.split("tokens crc32 ")[1].split()[0]
        return dict(json.loads((folder / "r.json").read_text())["losses"]), crc, log

    first, first_crc, log = run("a", "--tokenize", str(ROOT / "README.md"))
    assert "byte-level tokens" in log and tokens.stat().st_size == 2 * (ROOT / "README.md").stat().st_size
    resumed, resumed_crc, log = run("b", "--fail-at-step", "6", max_restarts=1)
    assert "--fail-at-step 6: SIGKILL" in log and "step_00000004" in log
    assert sorted(resumed) == [5, 6, 7, 8]
    assert resumed == {s: first[s] for s in resumed}
    assert {s: resumed_crc[s] for s in resumed} == {s: first_crc[s] for s in resumed}
    assert len(set(first_crc.values())) == STEPS  # each step read other tokens
