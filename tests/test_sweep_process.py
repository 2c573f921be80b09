"""A local sweep records its own process in the sweep folder; ``depthmem status`` shows the runs it has not started
as ``orphaned`` once that process is gone, with the command that starts them, and ``--watch`` ends only when
nothing will start again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main as cli_main
from harness.io import atomic_write_json
from harness.rundir import write_status
from harness.sweeps.jobstate import SWEEP_PROCESS, sweep_process
from harness.sweeps.submit import sweep

ROOT = Path(__file__).resolve().parent.parent
GRID = "experiments/s.yaml"


def make_sweep(root: Path) -> Path:
    """A sweep as a killed local sweep leaves it: one run done, two marked pending that no job was started for."""
    sweep_dir = root / "s"
    entries = []
    for seed, state in enumerate(["done", "pending", "pending"]):
        rid = f"preln-s{seed}-0000000{seed}"
        done = state == "done"
        write_status(
            sweep_dir / rid, state, step=10 if done else 0, total_steps=10, message="" if done else "submitted"
        )
        if done:
            atomic_write_json(sweep_dir / rid / "summary.json", {"val_loss": 3.1, "val_bpb": 1.2, "params": 1000})
        entries.append({"run_id": rid, "run_dir": rid, "variant": "preln", "overrides": {"train.seed": seed}})
    atomic_write_json(sweep_dir / "sweep.json", {"name": "s", "grid": GRID, "axes": ["train.seed"], "runs": entries})
    return sweep_dir


def start_ticks(pid: int) -> str:
    # Field 22 of /proc/PID/stat (proc(5)); the command name before it may hold spaces, so count from its ')'.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def record(sweep_dir: Path, pid: int, ticks: str) -> None:
    atomic_write_json(
        sweep_dir / SWEEP_PROCESS,
        {"pid": pid, "host": socket.gethostname(), "start_ticks": ticks, "started": "2026-01-01T00:00:00+00:00"},
    )


def rows(capsys, root: Path) -> dict[str, dict]:
    assert cli_main(["status", "s", "--results", str(root), "--json"]) == 0
    return {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}


def test_unstarted_runs_of_a_gone_sweep_process_are_orphaned(tmp_path, capsys):
    sweep_dir = make_sweep(tmp_path)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    ticks = start_ticks(gone.pid)
    gone.wait()
    record(sweep_dir, gone.pid, ticks)
    by_id = rows(capsys, tmp_path)
    assert by_id["preln-s0-00000000"]["state"] == "done"
    for rid in ("preln-s1-00000001", "preln-s2-00000002"):
        row = by_id[rid]
        assert row["state"] == "orphaned" and f"pid {gone.pid}" in row["reason"] and "is gone" in row["reason"]
        assert row["advice"] == f"depthmem sweep {GRID}"
    assert cli_main(["status", "s", "--results", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "1 done, 2 orphaned"
    # Nothing is written: the run's own status still says what its last writer said.
    assert json.loads((sweep_dir / "preln-s1-00000001" / "status.json").read_text())["state"] == "pending"


def test_a_reused_pid_is_not_the_sweep_process(tmp_path, capsys):
    sweep_dir = make_sweep(tmp_path)
    # This test's own process is alive, but it started at another moment than the recorded one.
    record(sweep_dir, os.getpid(), str(int(start_ticks(os.getpid())) + 1))
    assert {r["state"] for r in rows(capsys, tmp_path).values()} == {"done", "orphaned"}
    record(sweep_dir, os.getpid(), start_ticks(os.getpid()))
    by_id = rows(capsys, tmp_path)
    assert [by_id[r]["state"] for r in sorted(by_id)] == ["done", "pending", "pending"]
    assert by_id["preln-s1-00000001"]["will_start"] is True


def test_watch_ends_only_when_nothing_will_start(tmp_path):
    sweep_dir = make_sweep(tmp_path)
    starter = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        record(sweep_dir, starter.pid, start_ticks(starter.pid))
        watch = subprocess.Popen(
            [sys.executable, "-m", "harness.cli", "status", "s", "--results", str(tmp_path), "--watch", "0.2"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert watch.stdout.readline().split()[:2] == ["run_id", "seed"]
            # Several refreshes later it still watches: the live sweep process will start the pending runs.
            seen = [watch.stdout.readline() for _ in range(12)]
            assert watch.poll() is None and any("pending" in line for line in seen), seen
        finally:
            starter.kill()
            starter.wait()
        out, err = watch.communicate(timeout=120)
        assert watch.returncode == 0, err
        assert out.splitlines()[-1] == "1 done, 2 orphaned"
    finally:
        if watch.poll() is None:
            watch.kill()


@pytest.mark.slow
def test_a_local_sweep_records_itself_while_it_starts_runs(tmp_path):
    grid = tmp_path / "g.yaml"
    grid.write_text(
        "name: g\nbase:\n  model: {preset: tiny}\n  train: {max_steps: 2, batch_size: 4, seq_len: 32, val_batches: 1,"
        " val_every_steps: 2, ckpt_every_steps: 2}\naxes:\n  train.seed: [0, 1]\n"
    )
    sweep_dir = tmp_path / "results" / "g"
    seen: list[dict | None] = []

    def log(line: str) -> None:
        if line.startswith("started "):
            seen.append(sweep_process(sweep_dir))

    sub = sweep(grid, executor="local", root=tmp_path / "results", parallelism=1, log=log, poll_s=0.2)
    assert [r["state"] for r in sub.rows] == ["done", "done"]
    assert len(seen) == 2 and all(s and s["alive"] and s["pid"] == os.getpid() for s in seen), seen
    assert not (sweep_dir / SWEEP_PROCESS).exists()  # every run started and ended: nothing is left to start


def test_no_record_no_change(tmp_path, capsys):
    # SLURM sweeps and sweeps submitted without waiting record no process: their pending runs stay pending.
    make_sweep(tmp_path)
    assert sweep_process(tmp_path / "s") is None
    by_id = rows(capsys, tmp_path)
    assert by_id["preln-s1-00000001"]["state"] == "pending" and "will_start" not in by_id["preln-s1-00000001"]
