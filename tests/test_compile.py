"""``train.compile=true`` (torch.compile with fullgraph=True, inductor on CPU) trains to the same losses as eager.

Every registered variant, on a one-block model: compile time grows with the number of operations in the graph, not
with the sizes of the tensors, so one block (two depth-mixing layers, plus the head's read) keeps each variant's
compile to well under a minute while still running every kind of node the mixer has (its first layer, a later
layer reading earlier writes, the head). Validation is off so only the training graph is compiled.
``depthmem selftest --device cpu --compile`` runs the same comparison at the tiny preset.

mHC runs 3 Sinkhorn iterations instead of 20: inductor unrolls the loop (forward and backward) into kernels of
thousands of lines whose C++ compile alone took 100 s; three iterations run the same code.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import variants
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


SPECS = {"mhc": "mhc(sinkhorn_iters=3)"}


@pytest.mark.parametrize("variant", variants.names())
def test_compiled_training_matches_eager(variant, tmp_path):
    spec = SPECS.get(variant, variant)
    runs = {}
    for compiled in (False, True):
        cfg = build_config(
            {"model": {"preset": "tiny", "n_blocks": 1}, "variant": spec, "train": {**SETTINGS, "compile": compiled}}
        )
        torch._dynamo.reset()
        counters.clear()
        runs[compiled] = train(cfg, tmp_path / str(compiled))
    # One graph for the whole training (the trainer compiles with fullgraph=True): nothing the first step caches,
    # and no diagnostic pass, is compiled again.
    assert counters["stats"]["unique_graphs"] == 1
    for name in ("train_loss", "grad_norm"):
        got, want = _column(runs[True], name), _column(runs[False], name)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, rel=1e-4, abs=1e-4), name
