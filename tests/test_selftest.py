"""``depthmem selftest`` on the CPU, with small sizes: the same code path a GPU check takes, every variant."""

from __future__ import annotations

import json

import pytest

import variants as registry
from harness.cli import main


@pytest.mark.slow
def test_selftest_on_cpu_writes_one_json_and_a_table(tmp_path, capsys):
    out = tmp_path / "selftest"
    code = main(
        [
            "selftest",
            "--device",
            "cpu",
            "--train-steps",
            "6",
            "--bench-preset",
            "tiny",
            "--bench-seq",
            "32",
            "--bench-batch",
            "2",
            "--bench-steps",
            "1",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    report = json.loads((out / "selftest.json").read_text())
    assert code == 0 and report["ok"] and "all checks passed" in printed
    for part in ("numerics", "training", "speed"):
        assert [r["variant"] for r in report[part]] == registry.names()
    for row in report["numerics"]:  # float32 against the float64 reference
        assert row["logits_rel_err"] < 1e-5 and row["grad_rel_err"] < 1e-5
    for row in report["training"]:
        assert row["last_loss"] < row["first_loss"]
    for row in report["speed"]:
        assert row["tokens_per_s"] > 0 and row["peak_fraction"] is None  # a CPU has no known bf16 peak


def test_selftest_refuses_a_missing_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert main(["selftest", "--device", "cuda"]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err
