"""``depthmem status`` on a 100-run sweep: it reads the runs' small state files and answers at once, without
torch, Lightning or pandas; ``--watch`` draws its first table straight away; its columns follow the dry run's."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.io import atomic_write_json
from harness.rundir import write_status

ROOT = Path(__file__).resolve().parent.parent
AXES = ["variant", "train.lr", "train.seed"]
HEAVY = ("torch", "lightning", "pandas", "lm_eval", "transformers")


def make_sweep(root: Path, runs: int = 100, active_job: str | None = None) -> Path:
    """A sweep folder as a submission leaves it: sweep.json, and per run its status.json (and summary.json)."""
    sweep = root / "big"
    entries = []
    states = ["done", "failed", "interrupted", "cancelled", "done"]
    for i in range(runs):
        variant, lr, seed = ["preln", "ldm-rls", "mhc", "hc", "ldm"][i % 5], [1e-3, 3e-3][i // 5 % 2], i // 10
        rid = f"{variant}-lr{lr:g}-s{seed}-{i:08x}"
        (sweep / rid).mkdir(parents=True)
        state = "running" if active_job and i == 0 else states[i % 5]
        write_status(sweep / rid, state, step=40, total_steps=100, last_loss=3.2, eta_s=90.0, ckpt_step=40, message="")
        if state == "done":
            atomic_write_json(sweep / rid / "summary.json", {"val_loss": 3.1, "val_bpb": 1.2, "params": 210880})
        # Keys only a run's include entry sets come last in its overrides; the grid's order is in "axes".
        overrides = {"train.seed": seed, "train.lr": lr, "variant": variant}
        entry = {"run_id": rid, "run_dir": rid, "variant": variant, "overrides": overrides}
        if active_job and i == 0:
            entry.update(job_id=active_job, executor="local")
        entries.append(entry)
    atomic_write_json(
        sweep / "sweep.json", {"name": "big", "grid": "experiments/big.yaml", "axes": AXES, "runs": entries}
    )
    return sweep


def status(root: Path, *args: str, sweep: str = "big", **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "harness.cli", "status", sweep, "--results", str(root), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


@pytest.mark.parametrize("by", ["name", "grid file"])
def test_status_of_a_hundred_runs_imports_no_heavy_library(tmp_path, by):
    make_sweep(tmp_path)
    # A grid file with a report baseline, which checking the whole grid would load the variants for.
    grid = tmp_path / "big.yaml"
    grid.write_text(
        "name: big\nbase: {model: {preset: tiny}}\naxes: {variant: [preln, hc]}\nreport: {baseline: preln}\n"
    )
    started = time.perf_counter()
    done = status(tmp_path, sweep="big" if by == "name" else str(grid))
    elapsed = time.perf_counter() - started
    assert done.returncode == 0, done.stderr
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    assert imported and not [m for m in imported if m.split(".")[0] in HEAVY], sorted(imported)
    lines = done.stdout.splitlines()
    assert len(lines) == 1 + 100 + 1 and lines[-1] == "20 cancelled, 40 done, 20 failed, 20 interrupted"
    # A generous bound for a loaded shared machine; docs/notes/history.md has the measured time.
    assert elapsed < 10, elapsed


def test_status_columns_follow_the_dry_run(tmp_path, capsys):
    from harness.cli import main

    make_sweep(tmp_path, runs=5)
    assert main(["status", "big", "--results", str(tmp_path)]) == 0
    status_header = capsys.readouterr().out.splitlines()[0].split()
    grid = tmp_path / "big.yaml"
    grid.write_text(
        "name: big\nbase: {model: {preset: tiny}, train: {max_steps: 2}}\n"
        "axes: {variant: [preln, hc], train.lr: [1.0e-3], train.seed: [0]}\n"
    )
    assert main(["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "other")]) == 0
    dry_header = capsys.readouterr().out.splitlines()[1].split()
    assert status_header[:5] == ["run_id", "variant", "lr", "seed", "state"]
    assert dry_header[:5] == ["run_id", "variant", "lr", "seed", "action"]
    assert status_header[5] == "progress" and dry_header[5:7] == ["steps", "tokens"]


def test_watch_draws_its_first_table_at_once(tmp_path):
    # A live local job: the status command knows one by its process and "submitit" in its command line.
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "submitit"])
    try:
        make_sweep(tmp_path, runs=100, active_job=str(job.pid))
        watch = subprocess.Popen(
            [sys.executable, "-m", "harness.cli", "status", "big", "--results", str(tmp_path), "--watch", "60"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            started = time.perf_counter()
            header = watch.stdout.readline()
            first = watch.stdout.readline()
            elapsed = time.perf_counter() - started
            assert header.split()[:2] == ["run_id", "variant"], header
            assert "running" in first and "40/100, eta 1:30" in first, first
            assert elapsed < 10, elapsed
            assert watch.poll() is None  # still watching the running job
        finally:
            watch.kill()
            watch.wait()
    finally:
        job.kill()
        job.wait()


@pytest.mark.parametrize("seconds", ["0", "-1"])
def test_watch_needs_a_positive_interval(tmp_path, seconds):
    make_sweep(tmp_path, runs=2)
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "status", "big", "--results", str(tmp_path), "--watch", seconds],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert done.returncode == 2 and done.stderr.strip().startswith("depthmem: --watch takes a positive number")


def test_a_waited_sweep_ends_with_downstream_scores_and_counts(tmp_path):
    from harness.sweeps.announce import closing_table
    from harness.sweeps.jobstate import sweep_status

    sweep = make_sweep(tmp_path, runs=10)
    done = [p for p in sorted(sweep.iterdir()) if (p / "summary.json").exists()]
    # acc_norm where a task reports it (piqa), else acc (copa), as the report chooses
    for i, run_dir in enumerate(done):
        (run_dir / "eval").mkdir()
        (run_dir / "eval" / "table.csv").write_text(
            "task,metric,value,stderr\n"
            f"offline_copa,acc,{0.5 + i / 100},0.05\n"
            f"offline_piqa,acc,0.4,0.05\noffline_piqa,acc_norm,{0.6 + i / 100},0.05\n"
        )
    text = closing_table(sweep_status("big", tmp_path), sweep)
    header, *body = text.splitlines()
    assert header.split()[-3:] == ["offline_copa", "offline_piqa", "reason"]
    first = next(line for line in body if line.startswith(done[0].name))
    assert first.split()[-2:] == ["50.0", "60.0"]
    assert body[-1] == (
        "10 run(s): 2 cancelled, 4 done, 2 failed, 2 interrupted; downstream in percent: offline_copa acc, "
        "offline_piqa acc_norm"
    )


def test_the_local_progress_line_estimates_from_the_pace_so_far():
    from harness.sweeps.announce import progress_line

    assert progress_line(0, pending=3, running=2, parallelism=2, elapsed_s=5.0) == "[0/5 finished]"
    # 4 runs in 80 s: 20 s a run, 4 left
    assert progress_line(4, pending=2, running=2, parallelism=2, elapsed_s=80.0) == "[4/8 finished, about 1:20 left]"
    # the first of 2 parallel runs ends at 30 s: the pace counts both, 15 s a run
    assert progress_line(1, pending=4, running=1, parallelism=2, elapsed_s=30.0) == "[1/6 finished, about 1:15 left]"
    assert progress_line(2, pending=0, running=0, parallelism=2, elapsed_s=9.0) == "[2/2 finished]"
