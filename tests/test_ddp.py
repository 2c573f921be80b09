"""Two CPU processes (DDP on gloo), each taking half of every global batch, follow the single-process curve."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.config import build_config
from harness.training.trainer import train


def _column(run: Path, name: str) -> list[float]:
    with open(run / "metrics.csv", newline="") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r[name]]


@pytest.mark.xdist_group("ddp")
# ldm-rls: its reads hand the keys' and values' gradients to autograd through their own buffers (WriteGradient),
# which DDP's gradient hooks must still see.
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
    command = [
        str(Path(sys.executable).parent / "depthmem"),
        "train",
        "--preset",
        "tiny",
        "--variant",
        variant,
        "--devices",
        "2",
        "--out",
        str(tmp_path / "ddp"),
        *[f"--set=train.{k}={v}" for k, v in settings.items()],
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    single = train(
        build_config({"model": {"preset": "tiny"}, "variant": variant, "train": settings}), tmp_path / "single"
    )
    for name in ("train_loss", "val_loss", "val_bpb", "grad_norm"):
        got, want = _column(tmp_path / "ddp", name), _column(single, name)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, rel=1e-5), name
