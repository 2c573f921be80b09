"""A crash never costs a finished result: SIGKILL at random moments, divergence, and readers during writes.

Training, evaluation and report generation run as real ``depthmem`` processes and are killed with SIGKILL after
delays drawn from a seeded RNG (the seed is printed; set ``DEPTHMEM_KILL_SEED`` to replay one). After every kill,
each file left behind must parse (JSON, CSV, Parquet, Markdown, PNG, PDF, checkpoints), results finished before
the kill must be byte-identical, and running the same command again must complete the work. Divergence must stop
a run with its step and last finite loss, keep the last good checkpoint, and show in status and report.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness import rundir
from harness.cli import main as cli_main

# Every test here trains, evaluates or reports in processes it kills.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("crash")]

ROOT = Path(__file__).resolve().parent.parent
STEPS = 16
TRAIN_ARGS = [
    "--preset",
    "tiny",
    "--max-steps",
    str(STEPS),
    "--set",
    "train.batch_size=4",
    "--set",
    "train.seq_len=32",
    "--set",
    "train.ckpt_every_steps=2",
    "--set",
    "train.log_every_steps=1",
    "--set",
    "train.val_every_steps=4",
    "--set",
    "train.val_batches=1",
    "--set",
    "train.warmup_steps=2",
]
CURVE = ("step", "train_loss", "val_loss", "val_bpb", "lr", "grad_norm")  # tokens_per_s is a clock reading


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp().parent / "depthmem-cache"


@pytest.fixture(autouse=True)
def shared_cache(cache, monkeypatch):
    monkeypatch.setenv("DEPTHMEM_CACHE", str(cache))


@pytest.fixture(scope="module")
def kill_rng(module_seed) -> random.Random:
    """The RNG of every kill delay in this file, from the module's seed (``DEPTHMEM_KILL_SEED`` overrides it)."""
    seed = int(os.environ.get("DEPTHMEM_KILL_SEED") or module_seed)
    print(f"\nkill delays drawn with seed {seed} (replay: DEPTHMEM_KILL_SEED={seed})")
    return random.Random(seed)


class Depthmem:
    """Runs ``depthmem`` as separate processes, each in its own session so a kill takes all of it."""

    def __init__(self, cache: Path, logs: Path):
        self.env = {**os.environ, "DEPTHMEM_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
        self.logs = logs
        logs.mkdir(parents=True, exist_ok=True)
        self.count = 0

    def start(self, argv: list[str]) -> subprocess.Popen:
        self.count += 1
        log = open(self.logs / f"{self.count:03d}-{argv[0]}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "harness.cli", *argv],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.log_path = Path(log.name)  # type: ignore[attr-defined]
        log.close()
        return proc

    def run(self, argv: list[str], *, expect: int = 0) -> float:
        """Run to the end and return the wall time; the exit code must be ``expect``."""
        started = time.monotonic()
        proc = self.start(argv)
        code = proc.wait(timeout=600)
        assert code == expect, f"exit {code}: " + proc.log_path.read_text(errors="replace")[-3000:]
        return time.monotonic() - started

    def kill_after(self, argv: list[str], delay: float) -> str:
        """Start the command and SIGKILL it after ``delay`` seconds unless it ended first."""
        proc = self.start(argv)
        try:
            code = proc.wait(timeout=delay)
            assert code == 0, proc.log_path.read_text(errors="replace")[-3000:]
            return "finished first"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session this test started, and nothing else
            proc.wait()
            return "killed"


def check_parses(folder: Path) -> int:
    """Parse every visible file under ``folder`` by its type; returns how many were checked."""
    checked = 0
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue  # the hidden temporary files of an interrupted atomic write are never read by anyone
        suffix = path.suffix
        if suffix == ".json":
            json.loads(path.read_text())
        elif suffix == ".csv" or path.name.endswith(".csv.gz"):
            with gzip.open(path, "rt", newline="") if suffix == ".gz" else open(path, newline="") as f:
                rows = list(csv.reader(f))
            assert rows and rows[0], f"{path} has no header"
            assert all(len(r) == len(rows[0]) for r in rows), f"{path} has a cut-off row"
        elif suffix == ".parquet":
            pd.read_parquet(path)
        elif suffix == ".ckpt":
            torch.load(path, map_location="cpu", weights_only=True)
        elif suffix == ".png":
            data = path.read_bytes()
            assert data.startswith(b"\x89PNG") and data.endswith(b"IEND\xaeB`\x82"), path
        elif suffix == ".pdf":
            data = path.read_bytes()
            assert data.startswith(b"%PDF") and b"%%EOF" in data[-64:], path
        elif suffix in (".md", ".tex", ".txt", ".log", ".yaml"):
            path.read_text(encoding="utf-8")
        elif suffix == ".sha256":  # at every moment the file beside it is one its checksum file accepts
            target = path.with_name(path.name[: -len(suffix)])
            assert hashlib.sha256(target.read_bytes()).hexdigest() in path.read_text().split(), path
        checked += 1
    return checked


def snapshot(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """SHA-256 of every visible file under ``folder`` (paths relative to it), except those under ``skip``."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not any(p.startswith(".") for p in Path(rel).parts) and not rel.startswith(skip):
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def table_rows(run: Path, task: str) -> list[dict[str, str]]:
    """The rows of one task in ``eval/table.csv``, as the text written."""
    with open(run / "eval" / "table.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["task"] == task]


def item_rows(run: Path, task: str) -> list[dict[str, str]]:
    """The rows of one task in ``eval/items.csv.gz``, as the text written."""
    with gzip.open(run / "eval" / "items.csv.gz", "rt", newline="") as f:
        return [r for r in csv.DictReader(f) if r["task"] == task]


def curve(run: Path) -> dict[str, tuple]:
    with open(run / "metrics.csv", newline="") as f:
        return {r["step"]: tuple(r[c] for c in CURVE) for r in csv.DictReader(f)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """An uninterrupted run (the result every killed run must reproduce) and how long its phases take."""
    base = tmp_path_factory.mktemp("crash")
    runner = Depthmem(cache, base / "logs")
    run = base / "reference"
    started = time.monotonic()
    proc = runner.start(["train", *TRAIN_ARGS, "--out", str(run)])
    while not (run / "status.json").exists() and proc.poll() is None:
        time.sleep(0.05)
    first_write = time.monotonic() - started
    assert proc.wait(timeout=600) == 0, proc.log_path.read_text()[-3000:]
    total = time.monotonic() - started
    print(f"reference run: first file after {first_write:.1f}s, done after {total:.1f}s")
    return {"run": run, "first_write": first_write, "total": total, "runner": runner, "base": base}


# -- SIGKILL during training ----------------------------------------------------------------------------------
def test_training_killed_at_random_moments_loses_nothing(reference, kill_rng, tmp_path):
    runner, ref_curve = reference["runner"], curve(reference["run"])
    run = tmp_path / "killed"
    argv = ["train", *TRAIN_ARGS, "--out", str(run)]
    ckpt_step, kept = -1, {}
    for trial in range(4):
        # From just before its first file to a third of the way through training: each trial advances it a little.
        first = reference["first_write"]
        delay = kill_rng.uniform(0.8 * first, first + 0.35 * (reference["total"] - first))
        outcome = runner.kill_after(argv, delay)
        files = check_parses(run) if run.exists() else 0
        print(f"training trial {trial}: SIGKILL after {delay:.2f}s -> {outcome}, {files} files parse")
        if not (run / "metrics.csv").exists():
            continue
        rows = curve(run)
        # Every row written so far is the uninterrupted run's row: resumed segments recompute nothing differently.
        assert all(rows[s] == ref_curve[s] for s in rows), f"trial {trial}: a metrics row differs"
        assert all(rows.get(s) == row for s, row in kept.items()), f"trial {trial}: a checkpointed row was lost"
        ckpt = run / "ckpt" / "last.ckpt"
        if ckpt.exists():
            step = torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
            assert step >= ckpt_step, "the checkpoint went back in time"
            ckpt_step = step
            kept = {s: r for s, r in rows.items() if int(s) <= step}
        status = rundir.read_status(run)
        assert status["state"] in ("running", "done"), status

    runner.run(argv)  # the same command again completes the work
    assert rundir.read_status(run)["state"] == "done"
    assert curve(run) == ref_curve and len(ref_curve) == STEPS + 1
    assert json.loads((run / "summary.json").read_text())["val_loss"] == pytest.approx(
        json.loads((reference["run"] / "summary.json").read_text())["val_loss"], rel=1e-12
    )

    # A finished run killed while it is asked to train again stays exactly as it was.
    before = snapshot(run)
    delay = kill_rng.uniform(0.5 * reference["first_write"], 1.5 * reference["first_write"])
    print(f"training trial 4 (finished run): SIGKILL after {delay:.2f}s -> {runner.kill_after(argv, delay)}")
    assert snapshot(run) == before


# -- SIGKILL during evaluation --------------------------------------------------------------------------------
def test_evaluation_killed_at_random_moments_loses_nothing(reference, kill_rng, tmp_path):
    runner = reference["runner"]
    run = tmp_path / "evaluated"
    shutil.copytree(reference["run"], run)
    common = ["--limit", "6", "--bootstrap-iters", "0", "--device", "cpu"]
    duration = runner.run(["eval", str(run), "--tasks", "offline_copa", *common])
    finished = snapshot(run)  # the run and its first evaluation: finished results
    copa, copa_items = table_rows(run, "offline_copa"), item_rows(run, "offline_copa")
    assert copa and copa_items, "the first evaluation wrote no rows"

    argv = ["eval", str(run), "--tasks", "offline_piqa", *common]
    piqa_rows = None
    for trial in range(4):
        delay = kill_rng.uniform(0.3 * duration, 1.1 * duration)
        outcome = runner.kill_after(argv, delay)
        files = check_parses(run)
        print(f"evaluation trial {trial}: SIGKILL after {delay:.2f}s -> {outcome}, {files} files parse")
        now = snapshot(run)
        # The evaluation's own records (its table and the list of tasks evaluated) grow with each evaluation.
        grows = ("eval/table.csv", "eval/items.csv.gz", "eval/tasks.json")
        grows += tuple(name + ".sha256" for name in grows)
        assert {k: v for k, v in now.items() if k in finished and k not in grows} == {
            k: v for k, v in finished.items() if k not in grows
        }, "a finished file changed"
        assert table_rows(run, "offline_copa") == copa, "the earlier task's rows changed"
        assert item_rows(run, "offline_copa") == copa_items, "the earlier task's items changed"
        piqa = table_rows(run, "offline_piqa")
        if piqa:
            assert piqa_rows in (None, piqa), "two evaluations of one task disagree"
            piqa_rows = piqa

    runner.run(argv)
    assert table_rows(run, "offline_copa") == copa and item_rows(run, "offline_copa") == copa_items
    assert len(item_rows(run, "offline_piqa")) == 6 * 2  # six items, acc and acc_norm
    piqa = table_rows(run, "offline_piqa")
    assert piqa and piqa_rows in (None, piqa) and all(0.0 <= float(r["value"]) <= 1.0 for r in piqa)
    assert check_parses(run) > 0


# -- SIGKILL during report generation -------------------------------------------------------------------------
def test_report_killed_at_random_moments_loses_nothing(reference, kill_rng, tmp_path):
    runner = reference["runner"]
    sweep = tmp_path / "sweep"
    for name in ("run-a", "run-b"):
        shutil.copytree(reference["run"], sweep / name)
    runs = snapshot(sweep)
    duration = runner.run(["report", str(sweep)])
    report = {k: v for k, v in snapshot(sweep).items() if k not in runs}
    assert "REPORT.md" in report and "runs.parquet" in report and any(k.startswith("figures/") for k in report)

    for trial in range(4):
        delay = kill_rng.uniform(0.3 * duration, 1.1 * duration)
        outcome = runner.kill_after(["report", str(sweep)], delay)
        files = check_parses(sweep)
        print(f"report trial {trial}: SIGKILL after {delay:.2f}s -> {outcome}, {files} files parse")
        # The report is deterministic and written atomically, so every file is the finished one, byte for byte.
        assert snapshot(sweep) == {**runs, **report}, f"trial {trial}: a finished file changed or vanished"

    runner.run(["report", str(sweep)])
    assert snapshot(sweep) == {**runs, **report}


# -- readers during writes ------------------------------------------------------------------------------------
def test_report_while_a_run_is_writing(reference, tmp_path):
    from harness.reporting.report import report

    sweep = tmp_path / "sweep"
    proc = reference["runner"].start(["train", *TRAIN_ARGS, "--out", str(sweep / "live")])
    try:
        while not (sweep / "live" / "status.json").exists() and proc.poll() is None:
            time.sleep(0.05)
        states = []
        while proc.poll() is None or not states:
            path = report(sweep, out_dir=tmp_path / "out", spec={"figures": []})
            assert path.read_text().startswith("# Report")
            frame = pd.read_parquet(tmp_path / "out" / "runs.parquet")
            assert list(frame["run_id"]) == ["live"]
            states.append(frame["state"].iloc[0])
            check_parses(tmp_path / "out")
            time.sleep(0.2)  # leave the two cores mostly to the run being read
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    print(f"{len(states)} reports while training, states seen: {sorted(set(states))}")
    assert proc.returncode == 0 and "running" in states


# -- divergence -----------------------------------------------------------------------------------------------
def test_divergence_stops_with_step_last_loss_and_last_good_checkpoint(tmp_path, capsys):
    run = tmp_path / "sweep" / "diverged"
    # A learning rate no model survives; gradient norms above 100 count as divergence too.
    argv = [
        "train",
        "--preset",
        "tiny",
        "--max-steps",
        "12",
        "--out",
        str(run),
        "--set",
        "train.lr=1e5",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.seq_len=32",
        "--set",
        "train.ckpt_every_steps=1",
        "--set",
        "train.log_every_steps=1",
        "--set",
        "train.val_every_steps=100",
        "--set",
        "train.val_batches=1",
        "--set",
        "train.max_grad_norm_diverge=100",
    ]
    assert cli_main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "depthmem: The run diverged at step" in err

    status = rundir.read_status(run)
    assert status["state"] == "diverged", status
    step = status["step"]
    assert 1 < step < 12, "the run must diverge after a good step, or the test shows nothing"
    rows = curve(run)
    finite = [float(r[1]) for s, r in rows.items() if r[1] and int(s) < step and math.isfinite(float(r[1]))]
    assert status["last_loss"] == pytest.approx(finite[-1], rel=1e-12)
    bad = rows[str(step)]
    assert not math.isfinite(float(bad[1])) or not math.isfinite(float(bad[5])) or float(bad[5]) > 100
    assert f"diverged at step {step}" in status["message"] and "last good checkpoint" in status["message"]

    ckpt = torch.load(run / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == step - 1  # the last good step, never the diverged one
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())
    assert not (run / "summary.json").exists()

    # The report lists it, with its reason, and keeps it out of every average.
    assert cli_main(["report", str(tmp_path / "sweep")]) == 0
    frame = pd.read_parquet(tmp_path / "sweep" / "runs.parquet")
    assert frame.loc[0, "state"] == "diverged" and not frame.loc[0, "counted"]
    assert f"diverged at step {step}" in frame.loc[0, "message"]
    text = (tmp_path / "sweep" / "REPORT.md").read_text()
    assert "diverged" in text and "not counted" in text


GRID = """name: {name}
parallelism: 2
base:
  model: {{preset: tiny}}
  train: {{max_steps: 2, batch_size: 4, seq_len: 32, val_batches: 1, val_every_steps: 2, ckpt_every_steps: 1,
          log_every_steps: 1, warmup_steps: 0}}
axes:
  train.max_grad_norm_diverge: [1.0e-9, 1.0e+4]
"""


def test_sweep_runs_on_past_a_diverged_run_and_shows_it(tmp_path, capsys):
    grid = tmp_path / "diverge.yaml"
    grid.write_text(GRID.format(name="diverge"))
    results = tmp_path / "results"
    assert cli_main(["sweep", str(grid), "--results", str(results)]) == 1  # not every run is done
    capsys.readouterr()

    assert cli_main(["status", "diverge", "--results", str(results), "--json"]) == 0
    rows = {r["state"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"done", "diverged"}, rows
    assert "diverged at step 1" in rows["diverged"]["reason"] and rows["diverged"]["step"] == 1
    assert rows["done"]["val_loss"] is not None and math.isfinite(rows["done"]["val_loss"])

    assert cli_main(["status", "diverge", "--results", str(results)]) == 0
    assert "diverged" in capsys.readouterr().out

    assert cli_main(["report", "diverge", "--results-dir", str(results)]) == 0
    frame = pd.read_parquet(results / "diverge" / "runs.parquet")
    assert sorted(frame["state"]) == ["diverged", "done"]
    assert frame.set_index("state").loc["done", "counted"] and not frame.set_index("state").loc["diverged", "counted"]


def test_second_submission_of_a_sweep_says_locked(tmp_path, capsys):
    import filelock

    grid = tmp_path / "locked.yaml"
    grid.write_text(GRID.format(name="locked"))
    results = tmp_path / "results"
    (results / "locked").mkdir(parents=True)
    # The lock a first submission holds while its runs go on.
    with filelock.FileLock(str(results / "locked" / ".sweep.lock")):
        assert cli_main(["sweep", str(grid), "--results", str(results)]) == 1
    err = capsys.readouterr().err
    assert err.count("depthmem:") == 1 and "locked" in err and "Traceback" not in err
    assert not list((results / "locked").glob("*/status.json")), "a locked sweep must start nothing"
