"""Gradient accumulation: a global batch taken in micro batches follows the curve of the whole batch at once."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from harness.config import build_config
from harness.errors import UsageError
from harness.training.optim import accumulation
from harness.training.trainer import train

SETTINGS = {
    "max_steps": 6,
    "log_every_steps": 1,
    "val_every_steps": 3,
    "val_batches": 1,
    "ckpt_every_steps": 3,
    "seq_len": 32,
    "batch_size": 8,
    "warmup_steps": 2,
}


def _column(run: Path, name: str) -> list[float]:
    with open(run / "metrics.csv", newline="") as f:
        return [float(r[name]) for r in csv.DictReader(f) if r[name]]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["preln", "ldm-rls"])
def test_micro_batches_follow_the_whole_batch(variant, tmp_path):
    whole = train(build_config({"model": {"preset": "tiny"}, "variant": variant, "train": SETTINGS}), tmp_path / "a")
    cfg = build_config({"model": {"preset": "tiny"}, "variant": variant, "train": {**SETTINGS, "micro_batch_size": 2}})
    assert accumulation(cfg) == 4
    micro = train(cfg, tmp_path / "b")
    for name in ("train_loss", "val_loss", "val_bpb", "grad_norm"):
        got, want = _column(micro, name), _column(whole, name)
        assert len(got) == len(want) > 0
        assert got == pytest.approx(want, rel=1e-5), name
    steps = [int(v) for v in _column(micro, "step")]
    assert steps == list(range(SETTINGS["max_steps"] + 1))  # one row per optimizer step, not per pass


def test_accumulation_is_derived_from_processes_and_micro_batch():
    cfg = build_config({"train": {"batch_size": 256, "devices": 4, "num_nodes": 2, "micro_batch_size": 16}})
    assert accumulation(cfg) == 2
    assert accumulation(build_config({"train": {"batch_size": 256, "devices": 4}})) == 1


def test_a_batch_that_does_not_divide_is_one_sentence():
    cfg = build_config({"train": {"batch_size": 256, "devices": 4, "micro_batch_size": 24}})
    with pytest.raises(
        UsageError,
        match=r"train.batch_size \(256\) must be a multiple of devices x nodes x "
        r"train.micro_batch_size \(4 x 1 x 24 = 96\)\.",
    ):
        accumulation(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("profile, passes", [("gpu-40gb", 8), ("gpu-80gb", 4)])
def test_paper_grid_is_sized_for_40_and_80_gb_cards(profile, passes, tmp_path):
    from harness.sweeps.planning import plan

    cfg = plan("experiments/paper.yaml", profile=profile, root=tmp_path).runs[0].cfg
    assert (cfg.train.batch_size, cfg.train.devices, cfg.train.num_nodes) == (256, 4, 1)
    assert cfg.train.micro_batch_size == 64 // passes and accumulation(cfg) == passes
