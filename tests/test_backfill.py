"""A logger switched on after a sweep finished: TensorBoard and W&B (offline) get every run's logged steps from
its metrics.csv and its config, nothing trains again, and W&B writes where ``WANDB_DIR`` says."""

from __future__ import annotations

import csv
import json
import textwrap
from pathlib import Path

import pytest

from harness.cli import main
from harness.rundir import read_config, read_status
from harness.sweeps.planning import plan
from harness.sweeps.submit import sweep

# Each test trains a run first.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A one-run sweep trained to the end with the CSV logger only."""
    tmp = tmp_path_factory.mktemp("late-logger")
    grid = tmp / "late.yaml"
    grid.write_text(
        textwrap.dedent("""
        name: late
        base:
          model: {preset: tiny}
          train: {max_steps: 4, batch_size: 4, warmup_steps: 1, log_every_steps: 1, val_every_steps: 2,
                  val_batches: 1, ckpt_every_steps: 2}
        axes:
          train.seed: [0]
        """)
    )
    sub = sweep(grid, executor="local", root=tmp / "results", log=lambda _: None, poll_s=0.5)
    (rid,) = sub.jobs
    assert sub.rows[0]["state"] == "done"
    return grid, tmp / "results", tmp / "results" / "late" / rid


def logged(run_dir: Path) -> dict[str, dict[int, float]]:
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    out: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, text in row.items():
            if key != "step" and text:
                out.setdefault(key, {})[int(row["step"])] = float(text)
    return out


def test_tensorboard_switched_on_later_gets_every_logged_step(finished, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    grid, results, run_dir = finished
    attempts = read_status(run_dir).get("attempts")
    assert main(["sweep", str(grid), "--results", str(results), "train.logger=tensorboard", "--dry-run"]) == 0
    assert "1 finished run(s) never sent their metrics to tensorboard" in capsys.readouterr().out
    assert not (run_dir / "tensorboard").exists()  # a dry run sends nothing
    lines: list[str] = []
    sub = sweep(grid, root=results, overrides=["train.logger=tensorboard"], log=lines.append)
    assert sub.jobs == {} and read_status(run_dir).get("attempts") == attempts  # nothing trained again
    assert any("sent the metrics of 1 finished run(s) to TensorBoard" in ln for ln in lines), lines
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    expected = logged(run_dir)
    assert {"train_loss", "val_loss"} <= set(expected) and set(events.Tags()["scalars"]) == set(expected)
    for tag, by_step in expected.items():
        seen = {e.step: e.value for e in events.Scalars(tag)}
        assert seen == pytest.approx(by_step, rel=1e-6), tag
    assert "_hparams_/session_start_info" in events.PluginTagToContent("hparams")
    assert read_config(run_dir).train.logger == "tensorboard"
    # sent once: the next submission has nothing to send
    assert plan(grid, root=results, overrides=["train.logger=tensorboard"]).backfill == []


def test_wandb_switched_on_later_writes_where_wandb_dir_says(finished, tmp_path, monkeypatch):
    from test_tracking import _wandb_records

    grid, results, run_dir = finished
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    (tmp_path / "wandb-home").mkdir()
    sub = sweep(grid, root=results, overrides=["train.logger=wandb"], log=lambda _: None)
    assert sub.jobs == {}
    assert not (run_dir / "wandb").exists()
    (run_file,) = (tmp_path / "wandb-home").glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    wid = json.loads((run_dir / "tracking.json").read_text())["wandb_id"]
    assert (run.project, run.run_group, run.display_name, run.run_id) == ("late", "late", run_dir.name, wid)
    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            # The axis live runs use (Lightning's W&B logger): trainer/global_step in every row.
            history[int(items["trainer/global_step"])] = items
    expected = logged(run_dir)
    assert sorted(history) == sorted({step for by_step in expected.values() for step in by_step})
    for tag, by_step in expected.items():
        for step, value in by_step.items():
            assert history[step][tag] == pytest.approx(value, rel=1e-6), (tag, step)
    # wandb.init(config=...) puts the config in the run record; later updates come as config records
    updates = [
        *run.config.update,
        *(u for r in records if r.WhichOneof("record_type") == "config" for u in r.config.update),
    ]
    config = {u.key: json.loads(u.value_json) for u in updates}
    assert config["train"]["seed"] == 0 and config["model"]["preset"] == "tiny"
    assert plan(grid, root=results, overrides=["train.logger=wandb"]).backfill == []


def test_train_on_a_finished_run_with_a_logger_sends_its_curves(tmp_path, capsys):
    from cli_checks import TRAIN_ARGS

    out = tmp_path / "run"
    assert main(["train", *TRAIN_ARGS, "--out", str(out)]) == 0
    assert not (out / "tensorboard").exists()
    capsys.readouterr()
    assert main(["train", *TRAIN_ARGS, "--out", str(out), "train.logger=tensorboard"]) == 0
    printed = capsys.readouterr().out
    steps = len(logged(out)["val_loss"] | logged(out)["train_loss"])
    assert "is already done" in printed and f"sent {steps} logged step(s) of the finished run to tensorboard" in printed
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert main(["train", *TRAIN_ARGS, "--out", str(out), "train.logger=tensorboard"]) == 0
    assert "sent" not in capsys.readouterr().out  # once
