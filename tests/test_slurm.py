"""Sweeps on the real local SLURM cluster (slurm/local-cluster.sh): arrays, scancel, requeue, DDP, idempotency.

Every job trains a real tiny model. Skipped when ``sinfo`` cannot reach a cluster, unless ``CI`` is set.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import textwrap
import time
from datetime import datetime
from pathlib import Path

import pytest

from harness.errors import DepthmemError, UsageError
from harness.io import read_json
from harness.rundir import read_status
from harness.sweeps.jobstate import sweep_status
from harness.sweeps.planning import check_executor, plan
from harness.sweeps.profiles import Profile
from harness.sweeps.submit import sweep

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm")]

STEPS = 120
TRAIN = (
    f"{{max_steps: {STEPS}, batch_size: 4, warmup_steps: 5, log_every_steps: 10, val_every_steps: 60, "
    f"val_batches: 1, ckpt_every_steps: 10}}"
)


@pytest.fixture(scope="module", autouse=True)
def cluster():
    """The cluster must answer sinfo; CI starts it, so there a missing cluster is a failure."""
    try:
        ok = subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    if not ok:
        reason = "no SLURM cluster reachable (sinfo failed); start one with: bash slurm/local-cluster.sh start"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def grid_file(folder: Path, name: str, seeds: list[int], profile: str = "local") -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(
        textwrap.dedent(f"""
        name: {name}
        profile: {profile}
        parallelism: 2
        base:
          model: {{preset: tiny}}
          train: {TRAIN}
        axes:
          train.seed: {seeds}
        """)
    )
    return path


def wait_until(predicate, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def running_past(run_dir: Path, step: int):
    status = read_status(run_dir)
    return status.get("state") == "running" and (status.get("step") or 0) >= step and status.get("job_id")


def job_state(job_id: str) -> str:
    out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], capture_output=True, text=True).stdout
    return out.strip()


def sacct_times(job_ids: list[str]) -> list[tuple[datetime, datetime]]:
    out = subprocess.run(
        [
            "sacct",
            "-n",
            "-P",
            "-X",
            "-j",
            ",".join(sorted({j.split("_")[0] for j in job_ids})),
            "-o",
            "JobID,Start,End",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    spans = []
    for line in out.splitlines():
        jid, start, end = line.split("|")
        if jid in job_ids and "Unknown" not in (start + end):
            spans.append((datetime.fromisoformat(start), datetime.fromisoformat(end)))
    return spans


@pytest.fixture(scope="module")
def array_sweep(tmp_path_factory):
    """Four seeds as one array, two at a time; the last run is cancelled with scancel once it trains."""
    tmp = tmp_path_factory.mktemp("slurm")
    grid = grid_file(tmp, "four", [0, 1, 2, 3])
    root = tmp / "results"
    sub = sweep(grid, executor="slurm", root=root, wait=False, log=lambda _: None)
    victim = sub.plan.runs[-1].run_id
    job_id = wait_until(lambda: running_past(root / "four" / victim, 10), 300, f"{victim} to start training")
    subprocess.run(["scancel", str(job_id)], check=True)
    wait_until(lambda: not any(r["job_active"] for r in sweep_status("four", root)), 300, "the array to end")
    return tmp, grid, root, sub, victim


def test_four_runs_go_as_one_array_with_parallelism_two(array_sweep):
    tmp, grid, root, sub, victim = array_sweep
    ids = [str(sub.jobs[r.run_id].job_id) for r in sub.plan.runs]
    array = ids[0].split("_")[0]
    assert ids == [f"{array}_{k}" for k in range(4)]
    script = (root / "four" / "jobs" / f"{array}_submission.sh").read_text()
    assert re.search(r"#SBATCH --array=0-3%2", script)
    # never more than two tasks of the array ran at the same time
    spans = sacct_times(ids)
    assert len(spans) == 4
    for start, _ in spans:
        assert sum(1 for s, e in spans if s <= start < e) <= 2
    rows = {r["run_id"]: r for r in sweep_status("four", root)}
    for r in sub.plan.runs:
        if r.run_id == victim:
            continue
        assert rows[r.run_id]["state"] == "done" and rows[r.run_id]["node"] == "localhost"
        assert read_json(root / "four" / r.run_id / "summary.json")["val_loss"] > 0
        assert read_status(root / "four" / r.run_id)["job_id"] == rows[r.run_id]["job_id"]


def test_a_scancelled_run_shows_as_cancelled_with_the_command_that_resumes_it(array_sweep):
    tmp, grid, root, sub, victim = array_sweep
    row = next(r for r in sweep_status("four", root) if r["run_id"] == victim)
    assert row["state"] == "cancelled"
    assert "CANCELLED" in row["reason"] and str(sub.jobs[victim].job_id) in row["reason"]
    assert row["advice"].startswith(f"depthmem sweep {grid}") and "--retry-failed" not in row["advice"]
    assert read_status(root / "four" / victim)["state"] == "cancelled"


def test_resubmitting_a_finished_sweep_resumes_only_the_cancelled_run(array_sweep):
    tmp, grid, root, sub, victim = array_sweep
    p = plan(grid, executor="slurm", root=root)
    assert p.decisions[victim] == "resume"
    assert sorted(d for rid, d in p.decisions.items() if rid != victim) == ["done"] * 3


def test_requeue_resumes_from_the_checkpoint_with_the_same_loss(array_sweep):
    tmp, _, root, _, _ = array_sweep
    grid = grid_file(tmp, "requeue", [0])
    sub = sweep(grid, executor="slurm", root=root, wait=False, log=lambda _: None)
    (rid,) = sub.jobs
    run_dir = root / "requeue" / rid
    job_id = wait_until(lambda: running_past(run_dir, 20), 300, "the run to pass step 20")
    subprocess.run(["scontrol", "requeue", str(job_id)], check=True)  # what a preemption does to the job
    # SLURM holds a requeued job back for two minutes; let it start as soon as it is pending again.
    wait_until(lambda: job_state(job_id) == "PENDING", 120, "the job to be pending again")
    # while SLURM holds it back, status says it was requeued and where it resumes, not that it failed
    row = sweep_status("requeue", root)[0]
    assert row["state"] == "requeued" and row["job_active"], row
    assert row["resume_step"] >= 20 and f"resumes from step {row['resume_step']}" in row["reason"]
    subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
    wait_until(lambda: read_status(run_dir).get("state") == "done", 300, "the requeued run to finish")
    status = read_status(run_dir)
    assert status["attempts"] == 2 and status["step"] == STEPS
    log = (root / "requeue" / "jobs" / f"{job_id}_0_log.out").read_text()  # SLURM appends on requeue
    resumed = int(re.search(r"resuming at step (\d+)", log).group(1))
    assert 20 <= resumed < STEPS
    steps = [int(r.split(",")[0]) for r in (run_dir / "metrics.csv").read_text().splitlines()[1:]]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # resumed: no step logged twice
    uninterrupted = read_json(root / "four" / rid / "summary.json")["val_loss"]  # the same config, seed 0
    assert read_json(run_dir / "summary.json")["val_loss"] == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)


def test_two_tasks_run_ddp_and_match_one_process(array_sweep):
    tmp, _, root, sub, _ = array_sweep
    profile = tmp / "two-tasks.yaml"
    profile.write_text(
        "partition: debug\ntime_min: 20\ntasks_per_node: 2\ncpus_per_task: 1\nmem_gb: 2\n"
        "setup: ['export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK']\n"
    )
    grid = grid_file(tmp, "ddp", [0], profile=str(profile))
    ddp = sweep(grid, executor="slurm", root=root, wait=True, poll_s=1.0, log=lambda _: None)
    (rid,) = ddp.jobs
    cfg = ddp.plan.runs[0].cfg
    assert (cfg.train.devices, cfg.slurm.tasks_per_node) == (2, 2)
    assert ddp.rows[0]["state"] == "done", ddp.rows[0]["reason"]
    log = (root / "ddp" / "jobs" / f"{ddp.jobs[rid].job_id}_0_log.out").read_text()
    assert "on 2 processes (strategy auto: DDP)" in log  # the start line, once, from rank 0
    assert (root / "ddp" / "jobs" / f"{ddp.jobs[rid].job_id}_1_log.out").exists()  # the second task ran
    single = read_json(root / "four" / sub.plan.runs[0].run_id / "summary.json")["val_loss"]  # seed 0, 1 process
    assert math.isfinite(ddp.rows[0]["val_loss"])
    assert ddp.rows[0]["val_loss"] == pytest.approx(single, rel=1e-4)


def test_the_local_executor_gives_the_same_results(array_sweep):
    tmp, _, root, _, _ = array_sweep
    grid = grid_file(tmp, "four", [0, 1])  # the first two runs of the array, by the same name and ids
    local = sweep(grid, executor="local", root=tmp / "local-results", poll_s=0.5, log=lambda _: None)
    for row in local.rows:
        assert row["state"] == "done"
        on_slurm = read_json(root / "four" / row["run_id"] / "summary.json")["val_loss"]
        assert row["val_loss"] == pytest.approx(on_slurm, rel=1e-6, abs=1e-6)


def test_unknown_partition_is_refused_before_submission():
    with pytest.raises(UsageError, match=r"Unknown partition 'nope' .* this cluster has debug"):
        check_executor("slurm", Profile(name="x", partition="nope"))


def test_a_refused_submission_ends_the_runs_as_failed_with_the_reason(tmp_path):
    profile = tmp_path / "bad.yaml"
    profile.write_text("partition: debug\ntime_min: 5\nadditional: {constraint: no-such-feature}\n")
    grid = grid_file(tmp_path, "refused", [0], profile=str(profile))
    with pytest.raises(DepthmemError, match="marked failed"):
        sweep(grid, executor="slurm", root=tmp_path / "results", wait=False, log=lambda _: None)
    (row,) = sweep_status("refused", tmp_path / "results")
    assert row["state"] == "failed" and "refused" in row["reason"] and "--retry-failed" in row["advice"]


def test_dry_run_for_slurm_checks_the_partition(tmp_path, capsys):
    from harness.cli import main

    profile = tmp_path / "nope.yaml"
    profile.write_text("partition: nope\n")
    grid = grid_file(tmp_path, "dry", [0], profile=str(profile))
    assert main(["sweep", str(grid), "--dry-run", "--executor", "slurm", "--results", str(tmp_path / "r")]) == 2
    assert "Unknown partition 'nope'" in capsys.readouterr().err
