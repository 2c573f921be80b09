"""GPU-hours from measurement (``harness.benchmarks.measured``): a run of a variant that ``make gpu-bench`` timed on a
card of the profile's peak is priced at the measured rate, every other run at the assumed share of the peak."""

from __future__ import annotations

import pandas as pd
import pytest
from cli_checks import dry_run_text

from harness.benchmarks import measured
from harness.config import build_config
from harness.sweeps.estimate import run_cost, sweep_cost


@pytest.fixture
def bench_csv(tmp_path, rng_seed):
    import random

    rates = random.Random(rng_seed)
    card, tiny = "NVIDIA H100 80GB HBM3", {"d_model": 64, "seq_len": 64}  # the runs' width and context below
    rows = [
        {"card": card, "depth": depth, "mode": mode, "variant": name, "model_tflops": tflops, **tiny}
        for depth in (4, 8)
        for name in ("preln", "ldm")
        for mode, tflops in (("compiled", rates.uniform(50, 400)), ("eager", rates.uniform(10, 50)))
    ]
    rows.append({"card": card, "depth": 4, "mode": "compiled", "variant": "hc", "model_tflops": None, **tiny})
    # attnres was timed at another width only: its rate does not hold for these runs.
    wide = {"d_model": 768, "seq_len": 1024}
    rows.append({"card": card, "depth": 4, "mode": "compiled", "variant": "attnres", "model_tflops": 300.0, **wide})
    # Where `make gpu-bench --out r/gpu-bench` leaves it, in the results folder the dry run below plans in.
    path = tmp_path / "r" / "gpu-bench" / "steps.csv"
    path.parent.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(path, index=False)
    return pd.DataFrame(rows), path


def _config(variant: str, n_blocks: int):
    return build_config(
        {"model": {"preset": "tiny", "n_blocks": n_blocks}, "variant": variant, "train": {"max_steps": 20}}
    )


def test_measured_variants_use_the_rate_of_the_nearest_depth(bench_csv):
    configs = [_config("preln", 2), _config("ldm", 5), _config("hc", 2), _config("attnres", 2)]
    frame, path = bench_csv
    costs = sweep_cost(configs, peak_tflops=989, utilisation=0.4, steps_csv=path)
    compiled = frame[frame["mode"] == "compiled"].set_index(["variant", "depth"]).model_tflops
    # preln at 4 sublayers was measured at 4; ldm at 10 sublayers is nearest to the run at 8.
    for cost, (name, depth) in zip(costs[:2], [("preln", 4), ("ldm", 8)]):
        assert cost["gpu_hours"] == pytest.approx(cost["train_flops"] / (compiled[name, depth] * 1e12) / 3600)
        assert cost["gpu_hours_basis"] == "measured on NVIDIA H100 80GB HBM3"
    for cfg, cost in zip(configs[2:], costs[2:]):  # hc's row holds no measurement, attnres none at this width
        assumed = run_cost(cfg, peak_tflops=989, utilisation=0.4)
        assert cost["gpu_hours_basis"] == "assumed" and cost["gpu_hours"] == assumed["gpu_hours"]
    note = measured.basis_note(costs, 0.4, 989)
    assert "2 run(s) at the model FLOP/s" in note and "of 2 at 40% of a 989 TFLOP/s bf16 peak, assumed" in note


def test_a_card_of_another_peak_is_not_used(bench_csv):
    costs = sweep_cost([_config("preln", 2)], peak_tflops=312, utilisation=0.4, steps_csv=bench_csv[1])
    assert costs[0]["gpu_hours_basis"] == "assumed"
    assert measured.basis_note(costs, 0.4, 312).startswith("GPU time at 40% of a 312 TFLOP/s bf16 peak, assumed")


def test_dry_run_says_which_runs_are_measured(bench_csv, tmp_path, capsys):
    profile = "gpu_peak_tflops: 989\nutilisation: 0.5\n"
    out = dry_run_text(capsys, tmp_path, profile, ["preln", "attnres"], tmp_path / "r")
    assert "GPU time of 1 run(s) at the model FLOP/s their variant reached on NVIDIA H100 80GB HBM3" in out
    assert "of 1 at 50% of a 989 TFLOP/s bf16 peak, assumed" in out
    # The benchmark belongs to its results folder: a sweep planned in another one does not see it.
    out = dry_run_text(capsys, tmp_path, profile, ["preln", "attnres"], tmp_path / "elsewhere")
    assert "GPU time at 50% of a 989 TFLOP/s bf16 peak, assumed" in out and "GPU time of" not in out
