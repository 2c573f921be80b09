"""Sharded training (``train.strategy=fsdp``: FSDP2 through Lightning) on two CPU processes over gloo: the same
curve as DDP, and a checkpoint that resumes on two sharded processes bit for bit and on one plain process within
float tolerance (one process sums the whole batch's loss where two average their halves: a different reduction
order, so the last bits move)."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from cli_checks import ranks_stderr, tiny_train_command

SETTINGS = {
    "max_steps": 6,
    "log_every_steps": 1,
    "val_every_steps": 6,
    "val_batches": 1,
    "ckpt_every_steps": 3,
    "seq_len": 32,
    "batch_size": 8,
    "warmup_steps": 2,
}


def _train(out: Path, devices: int, strategy: str, cache: Path) -> subprocess.CompletedProcess:
    command = tiny_train_command("ldm-rls", devices, out, {"strategy": strategy, **SETTINGS})
    env = {**os.environ, "DEPTHMEM_CACHE": str(cache)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, ranks_stderr(result.stderr)
    return result


def _curve(run: Path) -> list[tuple[float, ...]]:
    with open(run / "metrics.csv", newline="") as f:
        return [
            tuple(float(r[k]) if r[k] else float("nan") for k in ("step", "train_loss", "val_loss", "grad_norm"))
            for r in csv.DictReader(f)
        ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sharding")
    cache = tmp_path_factory.getbasetemp().parent / "depthmem-cache"
    sharded = tmp / "fsdp"
    out = _train(sharded, 2, "fsdp", cache)
    ddp = tmp / "ddp"
    _train(ddp, 2, "auto", cache)
    return tmp, cache, sharded, ddp, out


@pytest.mark.parametrize(
    "preset, world, strategy, chosen",
    [
        ("gpt2-large", 8, "auto", "ddp"),  # 774M: a replica's 12 GB of weights, gradients and moments fit
        ("1.3b", 8, "auto", "fsdp"),
        ("1.3b", 1, "auto", "single"),
        ("tiny", 2, "fsdp", "fsdp"),
        ("1.3b", 8, "ddp", "ddp"),
    ],
)
def test_auto_shards_from_a_billion_parameters(preset, world, strategy, chosen):
    from harness.config import model_preset
    from harness.model.costs import preln_params
    from harness.training.sharding import resolved_strategy

    assert resolved_strategy(strategy, world, preln_params(model_preset(preset))) == chosen


@pytest.mark.slow
@pytest.mark.xdist_group("ddp")
def test_a_sharded_run_follows_the_ddp_curve(runs):
    _, _, sharded, ddp, out = runs
    assert "on 2 processes (strategy fsdp)" in out.stdout.splitlines()[0]
    got, want = _curve(sharded), _curve(ddp)
    assert len(got) == len(want) == SETTINGS["max_steps"] + 1
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=1e-6, nan_ok=True)
    # the same summary, written from a whole copy of the sharded model
    summary = json.loads((sharded / "summary.json").read_text())
    assert summary["params"] == json.loads((ddp / "summary.json").read_text())["params"]
    assert (sharded / "mixing.json").is_file()


@pytest.mark.slow
@pytest.mark.xdist_group("ddp")
def test_a_sharded_run_reads_the_same_depth_statistics_without_a_whole_copy(runs):
    """The layers' RMS and what the mixer learned (LDM-RLS: λ, ω and λ's gradient norm) at every validation: from a
    sharded forward and a gathered mixer, the same as DDP's within float tolerance."""
    _, _, sharded, ddp, _ = runs
    with open(sharded / "layers.csv", newline="") as f, open(ddp / "layers.csv", newline="") as g:
        got, want = list(csv.DictReader(f)), list(csv.DictReader(g))
    assert len(got) == len(want) > 0
    for a, b in zip(got, want):
        assert (a["step"], a["layer"], a["kind"]) == (b["step"], b["layer"], b["kind"])
        for key in ("input_rms", "output_rms", "grad_norm"):
            assert float(a[key] or "nan") == pytest.approx(float(b[key] or "nan"), rel=1e-5, nan_ok=True), key
    got, want = (
        [json.loads(line) for line in (run / "depth_stats.jsonl").read_text().splitlines()] for run in (sharded, ddp)
    )
    assert len(got) == len(want) > 0 and all(set(a) == set(b) for a, b in zip(got, want))
    assert "lambda_grad_norm" in got[-1]
    for a, b in zip(got, want):
        flat_a, flat_b = dict(_numbers(a)), dict(_numbers(b))
        assert flat_a.keys() == flat_b.keys()
        for key in flat_a:
            assert flat_a[key] == pytest.approx(flat_b[key], rel=1e-5, abs=1e-7), key


def _numbers(obj, path: str = ""):
    """(path, number) for every number in a JSON value."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _numbers(v, f"{path}/{i}")
    else:
        yield path, float(obj)


def _from_step_3(src: Path, dst: Path) -> Path:
    """The run as it was at its step-3 checkpoint (kept as the previous one beside the last), marked interrupted."""
    shutil.copytree(src, dst)
    ckpt = dst / "ckpt"
    for suffix in ("", ".sha256"):
        os.replace(ckpt / f"last.previous.ckpt{suffix}", ckpt / f"last.ckpt{suffix}")
    status = json.loads((dst / "status.json").read_text())
    status.update(state="interrupted", ckpt_step=3)
    (dst / "status.json").write_text(json.dumps(status))
    for name in ("summary.json", "summary.json.sha256"):
        (dst / name).unlink()
    return dst


@pytest.mark.slow
@pytest.mark.xdist_group("ddp")
@pytest.mark.parametrize("devices, strategy", [(2, "fsdp"), (1, "auto")])
def test_a_sharded_checkpoint_resumes_on_two_processes_and_on_one(runs, devices, strategy):
    tmp, cache, sharded, _, _ = runs
    resumed = _from_step_3(sharded, tmp / f"resumed-{devices}")
    out = _train(resumed, devices, strategy, cache)
    assert "resuming at step 3" in out.stdout
    got, want = _curve(resumed), _curve(sharded)
    assert [g[0] for g in got] == [w[0] for w in want]
    if devices == 2:  # the same processes and reduction order: bit for bit
        assert [repr(g[1:3]) for g in got] == [repr(w[1:3]) for w in want]  # repr: NaN (no value) equals NaN
    else:
        for a, b in zip(got, want):
            assert a[1:3] == pytest.approx(b[1:3], rel=1e-6, nan_ok=True)
