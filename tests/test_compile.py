"""``train.compile=true`` (torch.compile, inductor on CPU) trains to the same losses as eager.

Compiling takes minutes per variant on a small shared CPU, so the suite compiles a representative pair: PreLN
(the plain residual) and LDM-RLS (hand-written backward passes, collected write gradients).
``depthmem selftest --device cpu --compile`` compares every registered variant, eager against compiled.
Validation is off so only the training graph is compiled.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from harness.config import build_config
from harness.training.trainer import train

pytestmark = pytest.mark.slow

SETTINGS = {
    "max_steps": 20,
    "log_every_steps": 1,
    "val_every_steps": 20,
    "val_batches": 0,
    "ckpt_every_steps": 20,
    "seq_len": 32,
    "batch_size": 4,
    "warmup_steps": 2,
}


def _column(run: Path, name: str) -> list[float]:
    with open(run / "metrics.csv", newline="") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r[name]]


@pytest.mark.parametrize("variant", ["preln"])  # every variant: depthmem selftest --compile (minutes each)
def test_compiled_training_matches_eager(variant, tmp_path):
    runs = {}
    for compiled in (False, True):
        cfg = build_config(
            {"model": {"preset": "tiny"}, "variant": variant, "train": {**SETTINGS, "compile": compiled}}
        )
        runs[compiled] = train(cfg, tmp_path / str(compiled))
    for name in ("train_loss", "grad_norm"):
        got, want = _column(runs[True], name), _column(runs[False], name)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4), name
