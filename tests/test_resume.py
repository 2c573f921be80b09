"""Exact resume: a ``depthmem train`` killed with SIGKILL after a checkpoint and run again ends with the same loss
curve, step for step, as a run that was never interrupted."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cli_checks import ranks_stderr

from harness import rundir
from harness.config import build_config
from harness.training.trainer import train

ARGS = [
    "--preset",
    "tiny",
    "--max-steps",
    "16",
    "--set",
    "train.ckpt_every_steps=4",
    "--set",
    "train.log_every_steps=1",
    "--set",
    "train.val_every_steps=8",
    "--set",
    "train.val_batches=1",
    "--set",
    "train.seq_len=32",
    "--set",
    "train.warmup_steps=2",
]


def _curve(run: Path) -> list[tuple[str, str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [(r["step"], r["train_loss"], r["val_loss"]) for r in csv.DictReader(f)]


@pytest.mark.slow
@pytest.mark.xdist_group("ddp")
def test_sigkill_then_rerun_matches_an_uninterrupted_run(tmp_path, tmp_path_factory):
    env = {**os.environ, "DEPTHMEM_CACHE": str(tmp_path_factory.getbasetemp().parent / "depthmem-cache")}
    os.environ["DEPTHMEM_CACHE"] = env["DEPTHMEM_CACHE"]
    command = [str(Path(sys.executable).parent / "depthmem"), "train", *ARGS, "--out", str(tmp_path / "killed")]
    ckpt = tmp_path / "killed" / "ckpt" / "last.ckpt"
    proc = subprocess.Popen(
        command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 300
        while not ckpt.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert ckpt.exists(), "the run ended before writing its first checkpoint"
    killed_at = torch.load(ckpt, weights_only=True)["global_step"]
    assert killed_at < 16 and rundir.read_status(tmp_path / "killed")["state"] == "running"

    rerun = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, ranks_stderr(rerun.stderr)
    assert f"resuming at step {killed_at}" in rerun.stdout

    cfg = build_config(
        {
            "model": {"preset": "tiny"},
            "train": {
                "max_steps": 16,
                "ckpt_every_steps": 4,
                "log_every_steps": 1,
                "val_every_steps": 8,
                "val_batches": 1,
                "seq_len": 32,
                "warmup_steps": 2,
            },
        }
    )
    reference = train(cfg, tmp_path / "uninterrupted")
    assert _curve(tmp_path / "killed") == _curve(reference)
    assert [s for s, _, _ in _curve(reference)] == [str(i) for i in range(17)]


def test_metrics_log_appends_and_resumes_to_exactly_the_uninterrupted_rows(tmp_path):
    """Rows are appended, not rewritten; a resumed segment keeps exactly the rows up to its checkpoint step, even
    after a killed segment left later rows and a line cut short behind."""
    from harness.rundir import read_metric_rows
    from harness.training.runfiles import METRICS_COLUMNS, CsvLog, csv_text

    gen = torch.Generator().manual_seed(7)
    rows = [
        {
            "step": s,
            "tokens": 64 * s,
            "train_loss": float(torch.rand((), generator=gen)),
            "val_loss": float(torch.rand((), generator=gen)) if s % 4 == 0 else None,
        }
        for s in range(13)
    ]
    path = tmp_path / "metrics.csv"
    log = CsvLog(path, METRICS_COLUMNS, [])
    log.add(rows[:1])
    inode = path.stat().st_ino
    for row in rows[1:9]:
        log.add([row])
    assert path.stat().st_ino == inode, "a later row rewrote the file instead of appending"
    log.sync()
    uninterrupted = csv_text(METRICS_COLUMNS, rows)
    assert path.read_text() == csv_text(METRICS_COLUMNS, rows[:9])

    with open(path, "a") as f:  # what a kill mid-append could leave: a line without its end
        f.write("9,576,0.5")
    resumed_at = 5  # the checkpoint of the killed segment
    kept = read_metric_rows(path, resumed_at)
    assert [int(r["step"]) for r in kept] == list(range(resumed_at + 1))
    log = CsvLog(path, METRICS_COLUMNS, kept)
    for row in rows[resumed_at + 1 :]:
        log.add([row])
    assert path.read_text() == uninterrupted

    with open(path, "a") as f:
        f.write("1")  # a cut-off line that would read as an early step must not count either
    assert [int(r["step"]) for r in read_metric_rows(path, 12)] == list(range(13))


@pytest.mark.slow
def test_an_error_mid_run_is_a_failure_with_its_cause_not_a_ctrl_c(tmp_path, monkeypatch, rng_seed):
    """Lightning marks the trainer interrupted for every exception that leaves ``fit``; only a signal may be
    reported as one, or a crashed job reads as if someone had pressed Ctrl-C."""
    from harness.training.module import LitDecoder

    at = 3 + rng_seed % 4
    step = LitDecoder.training_step

    def breaks(self, batch, batch_idx):
        if self.global_step == at:
            raise RuntimeError(f"connection reset by peer at {at}")
        return step(self, batch, batch_idx)

    monkeypatch.setattr(LitDecoder, "training_step", breaks)
    cfg = build_config(
        {"model": {"preset": "tiny"}, "train": {"max_steps": 12, "seq_len": 32, "seed": rng_seed, "val_every_steps": 8}}
    )
    with pytest.raises(RuntimeError, match="connection reset"):
        train(cfg, tmp_path / "run")
    status = rundir.read_status(tmp_path / "run")
    assert status["state"] == "failed" and status["step"] == at, status
    assert "RuntimeError: connection reset by peer" in status["message"] and "Ctrl-C" not in status["message"]
