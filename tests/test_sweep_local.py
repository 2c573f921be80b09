"""The local executor end to end: a 2-run tiny grid trained for real, resubmission, the lock, --retry-failed."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import filelock
import pytest

from harness.cli import main
from harness.io import read_json
from harness.rundir import read_status
from harness.dispatch import SweepLocked, sweep, sweep_status

TINY_TRAIN = ("{max_steps: 6, batch_size: 4, warmup_steps: 1, log_every_steps: 3, val_every_steps: 3, "
              "val_batches: 1, ckpt_every_steps: 3}")


def grid_file(tmp_path: Path, name: str, axes: str, extra_train: str = "") -> Path:
    train = TINY_TRAIN[:-1] + (f", {extra_train}" if extra_train else "") + "}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(textwrap.dedent(f"""
        name: {name}
        parallelism: 2
        base:
          model: {{preset: tiny}}
          train: {train}
        axes:
          {axes}
        """))
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 2-run grid (two seeds) trained to the end by the local executor."""
    tmp = tmp_path_factory.mktemp("local")
    grid = grid_file(tmp, "pair", "train.seed: [0, 1]")
    lines: list[str] = []
    sub = sweep(grid, executor="local", root=tmp / "results", log=lines.append, poll_s=0.5)
    return tmp, grid, sub, lines


def test_local_sweep_trains_every_run(finished):
    tmp, grid, sub, lines = finished
    sweep_dir = tmp / "results" / "pair"
    assert len(sub.jobs) == 2 and [r["state"] for r in sub.rows] == ["done", "done"]
    record = read_json(sweep_dir / "sweep.json")
    assert {r["run_id"] for r in record["runs"]} == set(sub.jobs)
    for rid, job in sub.jobs.items():
        run_dir = sweep_dir / rid
        status = read_status(run_dir)
        assert status["state"] == "done" and status["step"] == 6
        assert status["job_id"] == str(job.job_id) and status["node"]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["val_loss"] > 0 and summary["params"] > 0
        assert (run_dir / "config.json").exists() and (run_dir / "ckpt" / "last.ckpt").exists()
        assert next(r for r in record["runs"] if r["run_id"] == rid)["job_id"] == str(job.job_id)
    # two seeds are two different trainings
    losses = {r["run_id"]: r["val_loss"] for r in sub.rows}
    assert len(set(losses.values())) == 2


def test_resubmitting_a_finished_sweep_submits_nothing(finished, capsys):
    tmp, grid, sub, _ = finished
    lines: list[str] = []
    again = sweep(grid, executor="local", root=tmp / "results", log=lines.append)
    assert again.jobs == {} and set(again.plan.decisions.values()) == {"done"}
    assert any("skipping 2 finished" in ln for ln in lines) and "nothing to submit." in lines
    # the command prints the table of final losses read from summary.json
    assert main(["sweep", str(grid), "--results", str(tmp / "results")]) == 0
    out = capsys.readouterr().out
    for row in sub.rows:
        assert row["run_id"] in out and f"{row['val_loss']:.4g}" in out


def test_status_command_shows_every_run(finished, capsys):
    tmp, grid, sub, _ = finished
    assert main(["status", str(grid), "--results", str(tmp / "results"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["state"], r["step"]) for r in rows] == [(r["run_id"], "done", 6) for r in sub.rows]
    assert all(r["job_id"] and r["node"] and r["loss"] > 0 for r in rows)


def test_a_second_submission_of_a_locked_sweep_fails_at_once(finished, capsys):
    tmp, grid, _, _ = finished
    lock = filelock.FileLock(str(tmp / "results" / "pair" / ".sweep.lock"))
    with lock.acquire(timeout=0):
        with pytest.raises(SweepLocked, match="locked by another submission"):
            sweep(grid, executor="local", root=tmp / "results", log=lambda _: None)
        assert main(["sweep", str(grid), "--results", str(tmp / "results")]) == 1
        assert "is locked" in capsys.readouterr().err
    # once released, the sweep can be submitted again (and has nothing to do)
    assert sweep(grid, executor="local", root=tmp / "results", log=lambda _: None).jobs == {}


def test_failed_runs_are_rerun_only_with_retry_failed(tmp_path):
    # A divergence limit no real gradient stays under: the run fails for real, at its first step.
    grid = grid_file(tmp_path, "diverge", "train.seed: [3]", "max_grad_norm_diverge: 1.0e-9")
    root = tmp_path / "results"
    first = sweep(grid, executor="local", root=root, log=lambda _: None, poll_s=0.5)
    (rid,) = first.jobs
    row = first.rows[0]
    assert row["state"] == "diverged" and "diverged at step" in row["reason"]
    lines: list[str] = []
    skipped = sweep(grid, executor="local", root=root, log=lines.append)
    assert skipped.jobs == {} and skipped.plan.decisions == {rid: "failed"}
    assert any("skipping 1 failed run(s) (rerun them with --retry-failed)" in ln and rid in ln for ln in lines)
    retried = sweep(grid, executor="local", root=root, retry_failed=True, log=lambda _: None, poll_s=0.5)
    assert list(retried.jobs) == [rid] and retried.plan.decisions == {rid: "retry"}
    assert str(retried.jobs[rid].job_id) != str(first.jobs[rid].job_id)
    status = read_status(root / "diverge" / rid)
    assert status["attempts"] == 2 and status["state"] == "diverged"
    assert sweep_status("diverge", root)[0]["job_id"] == str(retried.jobs[rid].job_id)


def test_cancel_stops_a_running_sweep_and_marks_its_runs_failed(tmp_path, capsys):
    grid = grid_file(tmp_path, "long", "train.seed: [4]", "max_steps: 100000")
    root = tmp_path / "results"
    sub = sweep(grid, executor="local", root=root, wait=False, log=lambda _: None)
    (rid,) = sub.jobs
    job = sub.jobs[rid]
    deadline = time.time() + 300
    while (read_status(root / "long" / rid).get("step") or 0) < 3:  # cancel it mid-training
        assert time.time() < deadline and not job.done(), "the run never started training"
        time.sleep(0.2)
    assert main(["cancel", "long", "--results", str(root)]) == 0
    assert f"cancelled 1 run(s): {rid}" in capsys.readouterr().out
    job.wait()  # the local job ends once its process is interrupted
    row = sweep_status("long", root)[0]
    assert row["state"] == "failed" and "cancelled by depthmem cancel" in row["reason"]
    assert not row["job_active"]
    assert main(["cancel", "long", "--results", str(root)]) == 0
    assert "nothing to cancel" in capsys.readouterr().out
