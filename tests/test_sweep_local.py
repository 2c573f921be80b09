"""The local executor end to end: a 2-run tiny grid trained for real, resubmission, the lock, --retry-failed,
run identity (eval tasks, loggers and profiles retrain nothing), axis columns, Ctrl-C, cancel, and truthful status."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import filelock
import pytest

from harness.cli import main
from harness.commands.status import table as status_table
from harness.io import file_digest, read_json, recorded_digests
from harness.rundir import read_status
from harness.sweeps.jobstate import sweep_status
from harness.sweeps.planning import plan
from harness.sweeps.submit import SweepLocked, sweep

# Every test here trains a sweep of runs or starts its processes.
pytestmark = pytest.mark.slow

TINY_TRAIN = (
    "{max_steps: 6, batch_size: 4, warmup_steps: 1, log_every_steps: 3, val_every_steps: 3, "
    "val_batches: 1, ckpt_every_steps: 3}"
)


def grid_file(tmp_path: Path, name: str, axes: str, extra_train: str = "") -> Path:
    # A key of extra_train replaces TINY_TRAIN's own: a YAML mapping names each key once.
    items = dict(part.split(": ", 1) for part in TINY_TRAIN.strip("{}").split(", "))
    items.update(part.split(": ", 1) for part in extra_train.split(", ") if part)
    train = "{" + ", ".join(f"{key}: {value}" for key, value in items.items()) + "}"
    path = tmp_path / f"{name}.yaml"
    path.write_text(
        textwrap.dedent(f"""
        name: {name}
        parallelism: 2
        base:
          model: {{preset: tiny}}
          train: {train}
        axes:
          {axes}
        """)
    )
    return path


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 2-run grid (two seeds) trained to the end by the local executor."""
    tmp = tmp_path_factory.mktemp("local")
    grid = grid_file(tmp, "pair", "train.lr: [3.0e-3, 1.0e-2]")
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
        for name in ("summary.json", "mixing.json"):  # results carry the checksum written at save time
            assert (run_dir / name).is_file(), name
            assert recorded_digests(run_dir / name) == [file_digest(run_dir / name)]
        assert (run_dir / "config.json").exists() and (run_dir / "ckpt" / "last.ckpt").exists()
        assert next(r for r in record["runs"] if r["run_id"] == rid)["job_id"] == str(job.job_id)
    # two learning rates are two different trainings, and the ids say which is which
    assert [r.run_id.split("-s0-")[0] for r in sub.plan.runs] == ["preln-lr3e-3", "preln-lr1e-2"]
    losses = {r["run_id"]: r["val_loss"] for r in sub.rows}
    assert len(set(losses.values())) == 2
    # each run that ends says how far the sweep is, and the first one gives an estimate for the rest
    ended = [line for line in lines if line.startswith("done: ")]
    assert ended[-1].endswith("[2/2 finished]"), ended
    assert ended[0].endswith("[1/2 finished, about " + ended[0].split("about ")[-1]) and "left]" in ended[0]


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


def test_status_command_shows_every_run_with_a_column_per_axis(finished, capsys):
    tmp, grid, sub, _ = finished
    assert main(["status", str(grid), "--results", str(tmp / "results"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["run_id"], r["state"], r["step"]) for r in rows] == [(r["run_id"], "done", 6) for r in sub.rows]
    assert all(r["job_id"] and r["node"] and r["loss"] > 0 for r in rows)
    assert [r["train.lr"] for r in rows] == [0.003, 0.01] and [r["axes"] for r in rows] == [
        {"train.lr": 0.003},
        {"train.lr": 0.01},
    ]  # typed: numbers, not text
    assert main(["status", "pair", "--results", str(tmp / "results")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["run_id", "lr", "state"]
    assert lines[1].split()[1:4] == ["0.003", "done", "6/6"] and lines[2].split()[1:4] == ["0.01", "done", "6/6"]
    # --watch on a finished sweep prints once and exits
    assert main(["status", "pair", "--results", str(tmp / "results"), "--watch", "0.1"]) == 0
    assert "2 done" in capsys.readouterr().out


def test_logger_profile_and_intervals_retrain_nothing(finished, tmp_path):
    tmp, grid, sub, _ = finished
    text = grid.read_text()
    other = tmp_path / "pair.yaml"  # the same sweep name, so the same results folder
    other.write_text(
        text.replace("log_every_steps: 3", "log_every_steps: 2, logger: tensorboard").replace(
            "ckpt_every_steps: 3", "ckpt_every_steps: 2"
        )
    )
    p = plan(other, profile="local", root=tmp / "results")
    assert p.executor == "local" and set(p.decisions.values()) == {"done"}
    assert [r.run_id for r in p.runs] == [r.run_id for r in sub.plan.runs]


def test_an_eval_task_added_later_evaluates_only_that_task(finished, tmp_path):
    tmp, grid, sub, _ = finished
    root = tmp / "results"
    first = sweep(
        grid, root=root, log=lambda _: None, poll_s=0.5, overrides=["eval.tasks=[offline_shakespeare]", "eval.limit=2"]
    )
    assert set(first.plan.decisions.values()) == {"evaluate"} and all(r["state"] == "done" for r in first.rows)
    run_dir = root / "pair" / sub.plan.runs[0].run_id
    assert set(read_json(run_dir / "eval" / "tasks.json")) == {"offline_shakespeare"}
    results_before = sorted((run_dir / "eval").glob("results_*.json"))
    ckpt_time = (run_dir / "ckpt" / "last.ckpt").stat().st_mtime_ns
    # the same tasks again: nothing to do; a new task: only it is evaluated
    again = plan(grid, root=root, overrides=["eval.tasks=[offline_shakespeare]", "eval.limit=2"])
    assert set(again.decisions.values()) == {"done"}
    from harness.sweeps.job import pending_tasks

    assert pending_tasks(run_dir, ["offline_shakespeare", "offline_copa"], 2) == ["offline_copa"]
    assert (run_dir / "ckpt" / "last.ckpt").stat().st_mtime_ns == ckpt_time  # nothing retrained
    assert sorted((run_dir / "eval").glob("results_*.json")) == results_before


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


def test_cancel_stops_a_running_sweep_and_marks_its_runs_cancelled(tmp_path, capsys):
    grid = grid_file(tmp_path, "long", "train.seed: [4]", "max_steps: 100000")
    root = tmp_path / "results"
    sub = sweep(grid, executor="local", root=root, wait=False, log=lambda _: None)
    (rid,) = sub.jobs
    job = sub.jobs[rid]
    deadline = time.time() + 300
    while (read_status(root / "long" / rid).get("ckpt_step") or 0) < 3:  # cancel it mid-training
        assert time.time() < deadline and not job.done(), "the run never started training"
        time.sleep(0.2)
    # while it trains, status shows steps done of the total and an ETA
    from harness.commands.status import table

    live = sweep_status("long", root)[0]
    assert live["state"] == "running" and live["total_steps"] == 100000 and live["eta_s"] > 0
    assert "/100000, eta " in table([live])
    assert main(["cancel", "long", "--results", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"cancelled 1 run(s): {rid}" in out and f"depthmem sweep {grid}" in out
    job.wait()  # the local job ends once its process group is stopped
    assert not _group_alive(int(job.job_id))  # no process of the run is left
    row = sweep_status("long", root)[0]
    # the job's own last words (stopped by SIGTERM) do not replace the cancellation
    assert row["state"] == "cancelled" and "cancelled by depthmem cancel" in row["reason"]
    assert row["advice"].startswith(f"depthmem sweep {grid}") and not row["job_active"]
    assert row["resume_step"] >= 3
    assert main(["cancel", "long", "--results", str(root)]) == 0
    assert "nothing to cancel" in capsys.readouterr().out
    # the same command resumes it (no --retry-failed): it is interrupted work, not a failure
    p = plan(grid, root=root)
    assert p.decisions == {rid: "resume"}


def _group_alive(pgid: int) -> bool:
    from harness.sweeps.jobstate import group_alive as alive

    return alive(pgid)


def test_ctrl_c_stops_the_runs_marks_them_interrupted_and_the_same_command_resumes(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    grid = grid_file(tmp_path, "stop", "train.seed: [5, 6]", "max_steps: 100000")
    root = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "sweep", str(grid), "--results", str(root)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        # As from a terminal: a Python started with SIGINT ignored (so are the tests when run in the background, and
        # under some runners) never turns it into KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 300
    dirs = lambda: [d for d in (root / "stop").glob("preln-*") if d.is_dir()]  # noqa: E731
    while not (len(dirs()) == 2 and all((read_status(d).get("ckpt_step") or 0) >= 3 for d in dirs())):
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.2)
    groups = [int(read_status(d)["job_id"]) for d in dirs()]
    proc.send_signal(signal.SIGINT)  # what Ctrl-C in the terminal sends to the sweep
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "marked interrupted" in err and f"depthmem sweep {grid}" in err
    assert not any(_group_alive(g) for g in groups)  # every process of every run is gone
    for d in dirs():
        status = read_status(d)
        assert status["state"] == "interrupted" and status["ckpt_step"] >= 3
    p = plan(grid, root=root)
    assert set(p.decisions.values()) == {"resume"}
    # a stop the sweep asked for is no error: the jobs' logs hold no traceback
    for log in (root / "stop" / "jobs").glob("*.err"):
        assert "Traceback" not in log.read_text() and "triggered an exception" not in log.read_text(), log.read_text()


def test_a_run_whose_start_fails_ends_failed_with_its_reason(tmp_path):
    empty = tmp_path / "empty-corpus"
    empty.mkdir()
    grid = grid_file(tmp_path, "nostart", "train.seed: [7]", "")
    grid.write_text(
        grid.read_text().replace("model: {preset: tiny}", f"model: {{preset: tiny}}\n  data: {{corpus: {empty}}}")
    )
    sub = sweep(grid, executor="local", root=tmp_path / "results", log=lambda _: None, poll_s=0.5)
    (row,) = sub.rows
    assert row["state"] == "failed" and row["reason"] and "empty-corpus" in row["reason"]
    assert row["advice"] == f"depthmem sweep {grid} --retry-failed"


def test_status_never_unpickles_files_in_the_results_folder(finished, tmp_path):
    """A crafted submitit result pickle in jobs/ must not run when status or a dry run reads the sweep."""
    import pickle

    tmp, grid, sub, _ = finished
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    jobs = tmp / "results" / "pair" / "jobs"
    for job in sub.jobs.values():
        (jobs / f"{job.job_id}_0_result.pkl").write_bytes(pickle.dumps(("error", Payload())))
        (jobs / f"{job.job_id}_result.pkl").write_bytes(pickle.dumps(("error", Payload())))
    # make a run look killed from outside, the case in which the reason used to be read from the pickle
    rid = sub.plan.runs[0].run_id
    status_path = tmp / "results" / "pair" / rid / "status.json"
    saved = status_path.read_text()
    try:
        data = json.loads(saved)
        data["state"] = "running"
        status_path.write_text(json.dumps(data))
        rows = sweep_status("pair", tmp / "results")
        assert main(["sweep", str(grid), "--results", str(tmp / "results"), "--dry-run"]) == 0
        assert not marker.exists()
        assert rows[0]["state"] == "failed" and "ended without finishing" in rows[0]["reason"]
    finally:
        status_path.write_text(saved)


def test_a_run_dropped_from_the_grid_stays_listed_only_while_its_folder_exists(finished, tmp_path):
    import shutil

    tmp, _, sub, _ = finished
    root = tmp_path / "results"
    shutil.copytree(tmp / "results", root)
    kept, removed = sorted(sub.jobs)
    narrower = grid_file(tmp_path, "pair", "train.lr: [2.0e-2]")  # both runs leave the grid; one new run trains
    shutil.rmtree(root / "pair" / removed)
    sweep(narrower, executor="local", root=root, log=lambda _: None, poll_s=0.5)
    listed = {r["run_id"] for r in read_json(root / "pair" / "sweep.json")["runs"]}
    assert not (root / "pair" / removed).exists()  # status never makes a removed run folder again
    assert removed not in listed and kept in listed
    # status tells the earlier generation from the grid's runs, and lists it last
    rows = sweep_status("pair", root)
    assert {r["run_id"]: r["superseded"] for r in rows}[kept] is True
    assert sum(not r["superseded"] for r in rows) == 1
    text = status_table(rows)
    assert text.splitlines()[-2].startswith(kept) and "superseded: not in the grid" in text.splitlines()[-2]
    assert text.splitlines()[-1].endswith("1 of them superseded (from an earlier version of the grid, not in it now)")
