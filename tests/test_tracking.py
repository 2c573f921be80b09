"""What a run shows while and after it trains: TensorBoard and W&B (offline) get the full config and the W&B
identity of the run; progress lines outside a terminal, a step bar in one, and no third-party advertising."""

from __future__ import annotations

import fcntl
import os
import pty
import random
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

from harness.config import build_config
from harness.training.runfiles import progress_line
from harness.training.trainer import tracking_id, train

# Most tests here train a run.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def tiny(logger: str, name: str = "tracked", **train_extra):
    return build_config(
        {
            "name": name,
            "model": {"preset": "tiny"},
            "train": {
                "max_steps": 4,
                "batch_size": 4,
                "warmup_steps": 1,
                "log_every_steps": 2,
                "val_every_steps": 2,
                "val_batches": 1,
                "ckpt_every_steps": 2,
                "logger": logger,
                **train_extra,
            },
        }
    )


def test_tensorboard_event_files_hold_the_full_config(tmp_path, rng_seed):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    lr = random.Random(rng_seed).choice([1e-3, 2e-3, 4e-3])
    cfg = tiny("tensorboard", lr=lr)
    train(cfg, tmp_path / "run")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert "val_loss" in events.Tags()["scalars"]
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info
    hp = {k: v for k, v in start.hparams.items()}
    assert hp["train/lr"].number_value == pytest.approx(lr) and hp["variant"].string_value == "preln"
    assert hp["model/d_model"].number_value == 64 and hp["name"].string_value == "tracked"
    import yaml

    saved = yaml.safe_load((tmp_path / "run" / "tensorboard" / "hparams.yaml").read_text())
    assert saved["train"]["lr"] == pytest.approx(lr) and saved["model"]["preset"] == "tiny"


def _wandb_records(run_file: Path):
    """The records of a W&B offline log (LevelDB log format: 32 KiB blocks of CRC, length, type, data)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, out, buf, block = run_file.read_bytes(), 7, [], b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0 and length == 0:
            break
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def test_wandb_offline_run_has_the_config_and_the_run_identity(tmp_path, monkeypatch):
    import json

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = tiny("wandb", name="lr-sweep", wandb_project="depth-study")
    run_dir = tmp_path / "lr-sweep" / "ldm-lr3e-3-s0-abcdef12"
    cfg = build_config(cfg.to_dict(), {"variant": "ldm"})
    train(cfg, run_dir)
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    wid = json.loads((run_dir / "tracking.json").read_text())["wandb_id"]
    assert (run.project, run.run_group, run.job_type, run.display_name, run.run_id) == (
        "depth-study",
        "lr-sweep",
        "ldm",
        run_dir.name,
        wid,
    )
    config = {
        u.key: json.loads(u.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for u in r.config.update
    }
    assert config["variant"] == "ldm" and config["train"]["lr"] == cfg.train.lr
    assert config["model"]["d_model"] == 64 and config["train"]["max_steps"] == 4


def test_wandb_id_is_kept_across_requeues_and_unique_per_run_folder(tmp_path):
    a, b = tmp_path / "sweep-a" / "preln-s0-1234abcd", tmp_path / "sweep-b" / "preln-s0-1234abcd"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    first = tracking_id(a)
    assert tracking_id(a) == first  # a requeued job resumes the same W&B run
    assert tracking_id(b) != first and first.startswith(a.name)  # same folder name elsewhere: another run


def test_progress_line_reads_step_elapsed_eta_rate_and_val_loss():
    line = progress_line(30, 120, 62.0, 190.4, 12345.6, 4.56789, 4.1234)
    assert line == ("step 30/120 (25%)  elapsed 1:02  eta 3:10  12,346 tok/s  loss 4.5679  val_loss 4.1234")
    assert "eta ?" in progress_line(1, 10, 0.5, None, None, None, None)


def _cli_train_in_a_terminal(tmp_path: Path) -> str:
    argv = [
        sys.executable,
        "-m",
        "harness.cli",
        "train",
        "--preset",
        "tiny",
        "--out",
        str(tmp_path / "cli"),
        "train.max_steps=4",
        "train.batch_size=4",
        "train.log_every_steps=2",
        "train.val_every_steps=2",
        "train.val_batches=1",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    main, child = pty.openpty()
    # A real terminal has a size; tqdm draws nothing in one of zero columns.
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(argv, env=env, stdout=child, stderr=child)
    os.close(child)
    out = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=300)
    os.close(main)
    return out.decode(errors="replace")


def test_plain_logs_have_progress_lines_and_no_advertising(tmp_path, capsys, caplog):
    from harness.cli import main

    assert (
        main(
            [
                "train",
                "--preset",
                "tiny",
                "--out",
                str(tmp_path / "cli"),
                "train.max_steps=4",
                "train.batch_size=4",
                "train.log_every_steps=2",
                "train.val_every_steps=2",
                "train.val_batches=1",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    out = captured.out + captured.err + caplog.text
    lines = [ln for ln in out.splitlines() if ln.startswith("depthmem: step")]
    assert [ln.split()[2] for ln in lines] == ["0/4", "1/4", "2/4", "4/4"]
    assert all("elapsed" in ln and "eta" in ln for ln in lines) and "tok/s" in lines[-1]
    assert "val_loss" in lines[-1]
    assert "litlogger" not in out and "Tip" not in out
    # Lightning's word on devices the run did not use and on max_steps is not about this run.
    assert "GPU available" not in out and "TPU available" not in out and "Trainer.fit" not in out


def test_terminal_shows_a_step_bar_with_val_loss(tmp_path):
    out = _cli_train_in_a_terminal(tmp_path)
    assert "train" in out and "4/4" in out and "val_loss" in out
    assert "Epoch 0/-2" not in out and "litlogger" not in out and "depthmem: step" not in out
    # The start line says what trains and where, in a terminal as in a log.
    assert "parameters, 4 steps" in out and "writing" in out


def test_a_finished_run_is_the_same_run_under_another_logger_or_eval_tasks(tmp_path, capsys):
    """What only watches or evaluates a run is not part of its identity: the run directory is reused as it is."""
    cfg = tiny("csv")
    run = train(cfg, tmp_path / "run")
    ckpt = (run / "ckpt" / "last.ckpt").stat().st_mtime_ns
    other = build_config(
        cfg.to_dict(), {"train": {"logger": "tensorboard", "log_every_steps": 1}, "eval": {"tasks": ["offline_copa"]}}
    )
    assert train(other, run) == run
    assert "already done" in capsys.readouterr().out
    assert (run / "ckpt" / "last.ckpt").stat().st_mtime_ns == ckpt
    changed = build_config(cfg.to_dict(), {"train": {"lr": cfg.train.lr * 2}})
    from harness.errors import UsageError

    with pytest.raises(UsageError, match="different config"):
        train(changed, run)


def test_wandb_training_follows_wandb_dir_and_wandb_project(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_PROJECT", "from-the-environment")
    cfg = tiny("wandb")
    run_dir = tmp_path / "runs" / "preln-s0"
    train(cfg, run_dir)
    assert not (run_dir / "wandb").exists()
    (run_file,) = (tmp_path / "wandb-home").glob("wandb/offline-run-*/run-*.wandb")
    run = next(r.run for r in _wandb_records(run_file) if r.WhichOneof("record_type") == "run")
    assert run.project == "from-the-environment"


def test_a_job_log_carries_no_allocator_warning_from_the_memory_meter(tmp_path):
    """The CPU memory meter profiles every step; the allocator's one-time warning about blocks from before
    profiling must not reach the job's stderr."""
    args = ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "train.max_steps=3", "train.batch_size=2"]
    args += ["train.val_every_steps=3", "train.val_batches=1"]
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "CPUAllocator" not in done.stderr and "profiler results will not include" not in done.stderr


def test_tensorboard_gets_each_metric_once_per_step_on_one_axis_before_and_after_a_resume(tmp_path):
    import csv
    import json
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(tiny("tensorboard", log_every_steps=1), tmp_path / "run")

    def logged() -> dict[str, list[tuple[int, float]]]:
        events = EventAccumulator(str(run / "tensorboard"))
        events.Reload()
        return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}

    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    first = logged()
    assert "epoch" not in first
    for tag in ("train_loss", "val_loss", "lr"):
        want = [(int(r["step"]), float(r[tag])) for r in rows if r[tag]]
        assert [s for s, _ in first[tag]] == [s for s, _ in want]  # once per step, on the optimizer's steps
        assert [v for _, v in first[tag]] == pytest.approx([v for _, v in want], rel=1e-6)
    # Back to the step-2 checkpoint, as after a kill there: steps 3 and 4 train and are logged again.
    ckpt = run / "ckpt"
    for suffix in ("", ".sha256"):
        shutil.copy(ckpt / f"last.previous.ckpt{suffix}", ckpt / f"last.ckpt{suffix}")
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "failed"}))
    train(tiny("tensorboard", log_every_steps=1), run)
    again = logged()
    assert set(again) == set(first)
    for tag, points in again.items():
        by_step: dict[int, set[float]] = {}
        for step, value in points:
            by_step.setdefault(step, set()).add(value)
        assert sorted(by_step) == [s for s, _ in first[tag]]
        if tag != "tokens_per_s":  # a clock's reading; every other metric replays exactly
            # The resumed steps carry the values they had: one value per step, the same as before the resume.
            assert all(len(values) == 1 for values in by_step.values()), tag
