"""``depthmem selftest`` on the CPU, with small sizes: the same code path a GPU check takes, every variant."""

from __future__ import annotations

import json

import pytest
import torch

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


@pytest.mark.slow
def test_selftest_reports_compiled_speed_beside_eager():
    from harness.benchmarks.selftest import format_report, measure_speed

    dev = torch.device("cpu")
    kw = dict(preset="tiny", seq_len=16, batch=2, dtype="float32", steps=1, warmup=1, peak_tflops=None)
    eager, compiled = measure_speed("preln", dev, **kw), measure_speed("preln", dev, compiled=True, **kw)
    torch._dynamo.reset()
    assert eager["tokens_per_s"] > 0 and compiled["tokens_per_s"] > 0
    ok = {"variant": "preln", "ok": True}
    report = {
        "device": "cpu",
        "device_name": "cpu",
        "torch": torch.__version__,
        "peak_bf16_tflops": None,
        "numerics": [{**ok, "logits_rel_err": 1e-7, "grad_rel_err": 1e-7}],
        "training": [{**ok, "first_loss": 6.0, "last_loss": 5.0}],
        "speed": [eager],
        "speed_compiled": [compiled],
        "compile": [],
        "ok": True,
    }
    header = format_report(report).splitlines()[1]
    assert "tokens_per_s" in header and "compiled_tokens_per_s" in header
