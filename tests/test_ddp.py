"""Two CPU processes (DDP on gloo), each taking half of every global batch, follow the single-process curve."""

from __future__ import annotations

import csv
import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from cli_checks import ranks_stderr, tiny_train_command

from harness.config import build_config
from harness.training.trainer import train

# Two training processes per test.
pytestmark = pytest.mark.slow


def _column(run: Path, name: str) -> list[float]:
    with open(run / "metrics.csv", newline="") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r[name]]


@pytest.mark.xdist_group("ddp")
# ldm-rls: the mixer with the most parameters of its own (per-layer query and key MLPs, learned λ), each of which
# DDP must average.
@pytest.mark.parametrize("variant", ["preln", "ldm-rls"])
def test_two_processes_match_one_process(variant, tmp_path, tmp_path_factory):
    env = {**os.environ, "DEPTHMEM_CACHE": str(tmp_path_factory.getbasetemp().parent / "depthmem-cache")}
    os.environ["DEPTHMEM_CACHE"] = env["DEPTHMEM_CACHE"]
    settings = {
        "max_steps": 4,
        "log_every_steps": 1,
        "val_every_steps": 4,
        "val_batches": 1,
        "ckpt_every_steps": 4,
        "seq_len": 32,
        "batch_size": 8,
        "warmup_steps": 2,
    }
    command = tiny_train_command(variant, 2, tmp_path / "ddp", settings)
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, ranks_stderr(result.stderr)
    # one start line naming the processes, one closing line, and none of Lightning's per-process greetings
    assert "on 2 processes (strategy auto: DDP)" in result.stdout.splitlines()[0]
    assert result.stdout.count("depthmem: run directory") == 1, result.stdout
    assert "Initializing distributed" not in result.stderr and "distributed_backend" not in result.stderr
    single = train(
        build_config({"model": {"preset": "tiny"}, "variant": variant, "train": settings}), tmp_path / "single"
    )
    for name in ("train_loss", "val_loss", "val_bpb", "grad_norm"):
        got, want = _column(tmp_path / "ddp", name), _column(single, name)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, rel=1e-5), name


def _rank_one(parent: int) -> int | None:
    """The PID of the child process running rank 1 of a local multi-process run, once it exists."""
    try:
        children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            if b"LOCAL_RANK=1" in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
        except OSError:
            continue
    return None


@pytest.mark.xdist_group("ddp")
def test_sigterm_to_one_rank_stops_both_after_the_same_step_and_the_run_resumes(tmp_path, tmp_path_factory):
    """SLURM signals a job's tasks one by one. Signalled alone, rank 1 must not start a collective of its own (the
    run would hang); both ranks stop after one step, save it, and the same command finishes the run."""
    env = {**os.environ, "DEPTHMEM_CACHE": str(tmp_path_factory.getbasetemp().parent / "depthmem-cache")}
    run = tmp_path / "ddp"
    settings = {"max_steps": 120, "log_every_steps": 5, "val_every_steps": 60, "val_batches": 1}
    settings |= {"ckpt_every_steps": 60, "seq_len": 32, "batch_size": 8, "warmup_steps": 2}
    command = tiny_train_command("preln", 2, run, settings)
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        metrics = run / "metrics.csv"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 4:  # training, past the first log lines
            break
        time.sleep(0.1)
    child = _rank_one(proc.pid)
    assert child is not None and proc.poll() is None, "rank 1 was not found while the run trained"
    os.kill(child, signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # both ranks: this test's own session
        pytest.fail("the run hung after rank 1 alone received SIGTERM")
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "interrupted" and status["ckpt_step"] == status["step"] < 120, (status, ranks_stderr(err))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, ranks_stderr(result.stderr)
    assert json.loads((run / "status.json").read_text())["state"] == "done"
    steps = [int(s) for s in _column(run, "step")]
    assert steps == sorted(set(steps)) and steps[-1] == 120


# Loaded at start-up by every Python process of the runs below (Lightning's rank 1 included): on one rank, at one
# step, the margin LDM-RLS's guard reads is set below its floor, as a batch that lost its digits on that rank alone
# would leave it. The rest is the harness as it runs.
_TRIP_ONE_RANK = """
import os

from harness.training import module

_RANK, _STEP, _MARGIN = int(os.environ["TRIP_RANK"]), int(os.environ["TRIP_STEP"]), float(os.environ["TRIP_MARGIN"])
_checked = module.LitDecoder.on_before_optimizer_step


def on_before_optimizer_step(self, optimizer):
    if self.global_rank == _RANK and self.global_step + 1 == _STEP:
        self.model.mixer.margin.fill_(_MARGIN)
    return _checked(self, optimizer)


module.LitDecoder.on_before_optimizer_step = on_before_optimizer_step
"""


@pytest.mark.xdist_group("ddp")
def test_the_ldm_rls_guard_tripping_on_one_rank_skips_the_step_on_both(tmp_path, tmp_path_factory, rng_seed):
    """Training decides LDM-RLS's guard from every rank's margins (``least_over_ranks``): a trip on rank 1 alone
    withholds the step's update on both ranks and switches both to float64, so the two processes still follow one
    process that tripped at the same step. Decided per rank, rank 0 would neither record the trip nor withhold the
    update, the replicas would part, and the curves with them."""
    rng = random.Random(rng_seed)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_TRIP_ONE_RANK)
    step, margin = rng.randint(2, 3), rng.uniform(0.01, 0.99)  # in units of the floor
    env = {
        **os.environ,
        "DEPTHMEM_CACHE": str(tmp_path_factory.getbasetemp().parent / "depthmem-cache"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")])),
        "TRIP_STEP": str(step),
        "TRIP_MARGIN": str(margin),
    }
    settings = {"max_steps": 5, "log_every_steps": 1, "val_every_steps": 5, "val_batches": 1}
    settings |= {"ckpt_every_steps": 5, "seq_len": 32, "batch_size": 8, "warmup_steps": 2}
    runs = {}
    for devices, rank in ((2, 1), (1, 0)):
        runs[devices] = tmp_path / f"devices{devices}"
        command = tiny_train_command("ldm-rls", devices, runs[devices], settings)
        result = subprocess.run(
            command, env=env | {"TRIP_RANK": str(rank)}, capture_output=True, text=True, timeout=600
        )
        assert result.returncode == 0, ranks_stderr(result.stderr)
        # rank 0 prints and records the step whether the trip was its own or rank 1's
        assert result.stdout.count("this step's update is skipped") == 1, result.stdout
        (skipped,) = json.loads((runs[devices] / "summary.json").read_text())["skipped_updates"]
        assert skipped["step"] == step and skipped["reason"].startswith("a whitening margin of LDM-RLS fell to")
    for name in ("train_loss", "grad_norm", "val_loss"):
        got, want = _column(runs[2], name), _column(runs[1], name)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, rel=1e-5), name
