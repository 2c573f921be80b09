"""``make gpu-bench``'s script: the same code as on a card, at the tiny preset on CPU (``--quick``), each step in a
process of its own; every row filled, and a step that fails or runs out of time gives a non-zero exit."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

import variants
from harness.benchmarks import gpu


@pytest.mark.slow
def test_quick_run_fills_every_row_and_exits_zero(tmp_path):
    out = tmp_path / "gpu-bench"
    # The time limit is raised so that a busy machine cannot fail the test: it checks what comes back, not speed.
    assert gpu.main(["--quick", "--out", str(out), "--card", "H100 SXM", "--minutes", "60"]) == 0
    steps = pd.read_csv(out / "steps.csv")
    assert steps["error"].isna().all() and steps["ms"].notna().all()
    assert set(steps["variant"]) == set(variants.names())
    assert set(zip(steps.depth, steps["mode"])) == {
        (2, "compiled"),
        (2, "eager"),
        (4, "compiled"),
        (4, "eager"),
        (2, "compiled, kernels off"),
    }
    assert (steps.loc[steps.variant == "preln", ["time_ratio", "floor_x_preln"]] == 1.0).all().all()
    assert (steps.floor_x_preln.drop(steps.index[steps.variant == "preln"]) > 1.0).all()
    assert (steps.time_x_floor > 0).all() and (steps.model_tflops > 0).all()
    assert (steps.loc[steps["mode"] != "eager", "syncs_per_step"] == 0).all()  # compiled steps never wait
    micro = pd.read_csv(out / "micro_batch.csv")
    assert list(micro["batch"]) == [2, 4] and (micro["tokens_per_s"] > 0).all()
    assert (out / "loop" / "loop_bench.csv").exists()
    assert json.loads((out / "selftest" / "selftest.json").read_text())
    assert (pd.read_csv(out / "status.csv").status == "ok").all()
    assert "time_x_floor" in (out / "gpu-bench.md").read_text()


@pytest.mark.slow
def test_a_step_past_the_time_limit_is_killed_and_fails_the_run(tmp_path, monkeypatch):
    """The first step's process and the one it started are still running at the time limit: both are killed, the
    rows the step had not written say so, the steps after it are skipped, and the run fails. The step sleeps past
    any limit, so the outcome does not hang on how fast this machine compiles: a real compiled step, started with
    the compile cache warm from earlier tests, once measured its row within the 3 s given here."""
    child = tmp_path / "child.pid"
    sleeper = (
        "import os, subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(child)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    plan = gpu._plan

    def first_step_sleeps(args, out, variants):
        steps = plan(args, out, variants)
        steps[0] = dataclasses.replace(steps[0], argv=[sys.executable, "-c", sleeper])
        return steps

    monkeypatch.setattr(gpu, "_plan", first_step_sleeps)
    out = tmp_path / "gpu-bench"
    assert gpu.main(["--quick", "--out", str(out), "--variants", "preln", "--minutes", "0.05"]) == 1
    steps = pd.read_csv(out / "steps.csv")
    first = steps[(steps.depth == 2) & (steps["mode"] == "compiled")]
    assert len(first) == 1 and first["error"].str.startswith("not measured: step timed out").all()
    assert (steps.drop(first.index)["error"] == "skipped: time budget").all()
    status = pd.read_csv(out / "status.csv").set_index("step").status
    assert status["steps L=2 compiled"].startswith("timed out after")
    assert child.exists(), "the step had not started its child by the time limit"
    pid = int(child.read_text())
    deadline = time.monotonic() + 10  # killed already; reaped by init a moment later
    while _running(pid):
        assert time.monotonic() < deadline, "the step's own child outlived the kill"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_failing_step_fails_the_run(tmp_path):
    out = tmp_path / "gpu-bench"
    args = ["--quick", "--out", str(out), "--variants", "preln", "--minutes", "0.5", "--backend", "no-such-backend"]
    assert gpu.main(args) == 1
    status = pd.read_csv(out / "status.csv").set_index("step").status
    assert status["steps L=2 compiled"].startswith("failed: exit 1")


def test_refuses_cuda_without_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert gpu.main(["--out", str(tmp_path / "g")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--card", "B200"), ("--minutes", "0"), ("--variants", "nope")])
def test_bad_settings_are_refused_with_one_sentence(tmp_path, capsys, flag, value):
    assert gpu.main(["--quick", "--out", str(tmp_path / "g"), flag, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("depthmem: ") and value in err and "Traceback" not in err
