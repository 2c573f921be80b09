"""``make gpu-bench``'s script runs end to end: the same code as on a card, at the tiny preset on CPU."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.benchmarks import gpu

pytestmark = pytest.mark.slow


def test_quick_run_writes_every_table_with_counts_and_ratios(tmp_path):
    out = tmp_path / "gpu-bench"
    # aot_eager: the graphs are traced as on a card, without the C++ compile of every kernel inductor would make.
    args = ["--device", "cpu", "--quick", "--variants", "preln,ldm", "--skip-selftest", "--skip-loop"]
    args += ["--backend", "aot_eager"]
    assert gpu.main([*args, "--out", str(out)]) == 0
    steps = pd.read_csv(out / "steps.csv")
    assert set(steps["mode"]) == {"eager", "compiled", "compiled, kernels off"}
    assert set(steps["variant"]) == {"preln", "ldm"} and steps["error"].isna().all()
    assert (steps["syncs_per_step"] == 0).all()  # no step waits on the device, eager or compiled
    assert (steps.loc[steps.variant == "preln", "time_ratio"] == 1.0).all()
    micro = pd.read_csv(out / "micro_batch.csv")
    assert list(micro["batch"]) == [4, 8] and (micro["tokens_per_s"] > 0).all()
    text = (out / "gpu-bench.md").read_text()
    assert "time_ratio" in text and "micro batch" in text


def test_refuses_cuda_without_a_gpu(tmp_path, capsys):
    if gpu.torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu.main(["--out", str(tmp_path / "g")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
