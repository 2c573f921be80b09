"""No traceback and no silent acceptance, class by class: every command on a full disk, every run file damaged,
settings that would fail only later, inputs that used to be taken silently, large grids, file permissions and the
temporary files of killed writers.

Full disks are real: a tmpfs of a few hundred kB mounted for the test (root only). Where mounting is not allowed
the test patches ``os.fsync`` to fail with ENOSPC, which is where a network file system reports a full disk, and
says so in its id. Run directories and sweeps are real ones made by ``depthmem train`` and the local executor.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cli_checks
import pytest
from cli_checks import TRAIN_ARGS

from harness import io as hio
from harness.cli import main as cli_main

pytestmark = pytest.mark.usefixtures("shared_cache", "quiet_stale_log_handlers")

ROOT = Path(__file__).resolve().parent.parent
GRID = textwrap.dedent("""\
    name: {name}
    parallelism: 2
    base:
      model: {{preset: tiny}}
      train: {{max_steps: 2, batch_size: 4, seq_len: 32, warmup_steps: 1, log_every_steps: 1, val_every_steps: 2,
              val_batches: 1, ckpt_every_steps: 2}}
    axes:
      train.seed: [0, 1]
    """)


def fails(capsys, argv: list[str], code: int = 2) -> str:
    # Messages about space name the sizes involved, so they may run a little longer.
    return cli_checks.fails(capsys, argv, code, max_len=700)


def succeeds(capsys, argv: list[str]) -> tuple[str, str]:
    rc = cli_main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, f"exit {rc} for {argv}: {err[-2000:]}"
    assert "Traceback" not in err
    return out, err


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


def temp_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and hio.is_temp_name(p.name)]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("trained") / "preln"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEPTHMEM_CACHE", str(tmp_path_factory.getbasetemp().parent / "depthmem-cache"))
        assert cli_main(["train", *TRAIN_ARGS, "--out", str(run)]) == 0
    return run


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory):
    """A two-run grid trained to the end by the local executor: (grid file, results root, run ids)."""
    from harness.sweeps.submit import sweep

    tmp = tmp_path_factory.mktemp("sweep")
    grid = write(tmp / "pair.yaml", GRID.format(name="pair"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEPTHMEM_CACHE", str(tmp_path_factory.getbasetemp().parent / "depthmem-cache"))
        sub = sweep(grid, executor="local", root=tmp / "results", log=lambda *_: None, poll_s=0.3)
    assert [r["state"] for r in sub.rows] == ["done", "done"], sub.rows
    return grid, tmp / "results", sorted(sub.jobs)


# -- full disks ---------------------------------------------------------------------------------------------------
class Disk:
    """A small file system of ``size`` bytes at ``path``: a real tmpfs, or (where mounting is refused) this
    folder with every fsync failing as a full network file system fails it."""

    def __init__(self, path: Path, size: int, monkeypatch):
        self.path, self.size, self.real = path, size, False
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0 and shutil.which("mount"):
            proc = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
                capture_output=True,
                text=True,
            )
            self.real = proc.returncode == 0
        if not self.real:

            def no_space(fd):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            monkeypatch.setattr(hio.os, "fsync", no_space)

    def fill(self, leave: int = 0) -> None:
        """Fill the disk until at most ``leave`` bytes are free."""
        if not self.real:
            return
        with open(self.path / "filler", "ab") as f:
            while hio.free_bytes(self.path) > leave:
                try:
                    f.write(b"\0" * max(4096, min(1 << 16, hio.free_bytes(self.path) - leave)))
                    f.flush()
                except OSError:
                    break

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    made = []

    def make(size: int = 256 * 1024) -> Disk:
        d = Disk(tmp_path / f"disk{len(made)}", size, monkeypatch)
        made.append(d)
        return d

    yield make
    for d in made:
        d.close()


def _no_space(line: str) -> None:
    assert "No space left" in line or "Not enough space" in line, line
    assert "free" in line, line


@pytest.mark.slow
class TestFullDisk:
    """Every command that writes, on a full disk: exit 1, one sentence with the space needed, no temp file left."""

    def test_train_says_how_much_room_its_checkpoints_need(self, capsys, disk):
        d = disk(512 * 1024)  # the tiny model's checkpoint is about 1.7 MB: it cannot fit even once
        line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(d.path / "run")], code=1)
        _no_space(line)
        if d.real:
            assert "twice" in line or "beside the previous one" in line, line
            assert "MB" in line
        assert not temp_files(d.path)

    def test_train_on_a_full_disk(self, capsys, disk):
        d = disk()
        d.fill()
        line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(d.path / "run")], code=1)
        _no_space(line)
        assert not temp_files(d.path)

    def test_a_checkpoint_that_fits_once_but_not_twice(self, tmp_path, disk, rng_seed):
        import torch

        from harness.training.module import AtomicCheckpointIO

        d = disk(3 * 1024 * 1024)
        ckpt = d.path / "ckpt" / "last.ckpt"
        state = {"w": torch.randn(500_000, generator=torch.Generator().manual_seed(rng_seed))}  # 2 MB
        if not d.real:  # every fsync fails: the first save already meets the full disk
            with pytest.raises(hio.DiskFull):
                AtomicCheckpointIO().save_checkpoint(state, ckpt)
            assert not ckpt.exists() and not temp_files(d.path)
            return
        AtomicCheckpointIO().save_checkpoint(state, ckpt)
        before = ckpt.read_bytes()
        state["w"] = state["w"] * 2
        with pytest.raises(hio.DiskFull) as e:
            AtomicCheckpointIO().save_checkpoint(state, ckpt)
        message = str(e.value)
        assert "twice its size" in message and "2.0 MB" in message and "free" in message, message
        assert ckpt.read_bytes() == before  # the previous checkpoint is intact
        assert not temp_files(d.path)

    def test_eval_on_a_full_disk(self, capsys, disk, trained_run):
        d = disk()
        d.fill()
        line = fails(
            capsys,
            ["eval", str(trained_run), "--tasks", "offline_copa", "--limit", "2", "--out", str(d.path / "eval")],
            code=1,
        )
        _no_space(line)
        assert not temp_files(d.path)

    def test_report_on_a_full_disk(self, capsys, disk, trained_run, tmp_path):
        sweep = tmp_path / "sweep"
        shutil.copytree(trained_run, sweep / "preln")
        d = disk()
        d.fill()
        line = fails(capsys, ["report", str(sweep), "--out", str(d.path / "report")], code=1)
        _no_space(line)
        assert not temp_files(d.path)

    def test_prepare_on_a_full_disk(self, capsys, disk, trained_run, tmp_path):
        text = write(tmp_path / "doc.txt", "Words to tokenize, and more words. " * 2000)
        d = disk()
        d.fill(leave=8 * 1024)
        line = fails(
            capsys,
            ["prepare", str(text), "--out", str(d.path / "shards"), "--tokenizer", str(trained_run / "tokenizer.json")],
            code=1,
        )
        _no_space(line)
        assert not temp_files(d.path)

    def test_sweep_on_a_full_disk(self, capsys, disk, tmp_path):
        grid = write(tmp_path / "g.yaml", GRID.format(name="g"))
        d = disk()
        d.fill()
        line = fails(capsys, ["sweep", str(grid), "--results", str(d.path / "results")], code=1)
        _no_space(line)
        assert not temp_files(d.path)

    def test_status_on_a_full_disk_still_reports_a_killed_run(self, capsys, disk, finished_sweep):
        """Status corrects a run whose process died without a word; with no room to record that, it still shows it."""
        _, results, (killed, done) = finished_sweep
        d = disk(32 * 1024 * 1024)
        shutil.copytree(results, d.path / "results")
        status_file = d.path / "results" / "pair" / killed / "status.json"
        status_file.write_text(json.dumps(dict(json.loads(status_file.read_text()), state="running")))
        d.fill()
        out, _ = succeeds(capsys, ["status", "pair", "--results", str(d.path / "results"), "--json"])
        rows = {r["run_id"]: r for r in json.loads(out)}
        assert rows[done]["state"] == "done"
        assert rows[killed]["state"] == "failed" and "ended without finishing" in rows[killed]["reason"]
        assert not temp_files(d.path / "results")

    def test_bench_on_a_full_disk(self, capsys, disk):
        d = disk()
        d.fill()
        line = fails(capsys, ["bench", "--quick", "--variants", "preln", "--out", str(d.path / "bench")], code=1)
        _no_space(line)
        assert not temp_files(d.path)


# -- damaged run files --------------------------------------------------------------------------------------------
DAMAGE = {
    "truncated": lambda data: data[: max(1, len(data) // 2)],
    "binary": lambda data: random.randbytes(max(64, len(data))),  # from the test's seed (conftest)
    "empty": lambda data: b"",
    "not-utf8": lambda data: data[:5] + b"\xff\xfe" + data[5:],
}
RUN_FILES = ("status.json", "config.json", "summary.json", "metrics.csv")


def _damage(path: Path, how: str) -> None:
    path.write_bytes(DAMAGE[how](path.read_bytes()))


def _copy_sweep(finished_sweep, tmp_path: Path) -> tuple[Path, Path, list[str]]:
    grid, results, run_ids = finished_sweep
    shutil.copytree(results, tmp_path / "results")
    return grid, tmp_path / "results", run_ids


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(DAMAGE))
@pytest.mark.parametrize("name", RUN_FILES)
class TestDamagedRunFile:
    """One damaged file of one run: status, dry run and cancel report that run and go on with the other."""

    def test_status_dry_run_and_cancel_go_on(self, capsys, tmp_path, finished_sweep, name, how):
        grid, results, (bad, good) = _copy_sweep(finished_sweep, tmp_path)
        _damage(results / "pair" / bad / name, how)
        out, _ = succeeds(capsys, ["status", "pair", "--results", str(results), "--json"])
        rows = {r["run_id"]: r for r in json.loads(out)}
        assert rows[good]["state"] == "done"
        if name == "status.json":
            assert rows[bad]["state"] == "damaged" and "status.json is damaged" in rows[bad]["reason"]
        else:
            assert rows[bad]["state"] == "done"  # its status still says so; the damage shows where it is read
        out, _ = succeeds(capsys, ["sweep", str(grid), "--dry-run", "--results", str(results)])
        assert bad in out and good in out
        out, _ = succeeds(capsys, ["cancel", "pair", "--results", str(results)])
        assert "nothing to cancel" in out


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated"])  # every kind of damage reads alike; the status test runs them all
@pytest.mark.parametrize("name", RUN_FILES)
def test_train_and_report_read_past_a_damaged_run_file(capsys, tmp_path, finished_sweep, name, how):
    """Report lists the run (or says why not); training the run again reads past the damage and rewrites."""
    grid, results, (bad, good) = _copy_sweep(finished_sweep, tmp_path)
    run = results / "pair" / bad
    config = json.loads((run / "config.json").read_text())
    _damage(run / name, how)
    import pandas as pd

    succeeds(capsys, ["report", str(results / "pair"), "--out", str(tmp_path / "report")])
    listed = set(pd.read_csv(tmp_path / "report" / "runs.csv")["run_id"])
    if name == "config.json":
        assert listed == {good}  # no config, no run: the report says why it skipped it
        assert f"{bad}/config.json" in (tmp_path / "report" / "REPORT.md").read_text()
    else:
        assert listed == {good, bad}
    # Training the same run again: a damaged config.json is named; anything else is read past and rewritten.
    argv = ["train", "--config", str(write(tmp_path / "config.json", json.dumps(config))), "--out", str(run)]
    if name == "config.json":
        line = fails(capsys, argv)
        assert "config.json is damaged" in line and "delete it" in line
    else:
        succeeds(capsys, argv)
        assert json.loads((run / "status.json").read_text())["state"] == "done"


@pytest.mark.slow
@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_damaged_sweep_record_lists_runs_from_their_folders(capsys, tmp_path, finished_sweep, how):
    grid, results, run_ids = _copy_sweep(finished_sweep, tmp_path)
    _damage(results / "pair" / "sweep.json", how)
    out, err = succeeds(capsys, ["status", "pair", "--results", str(results), "--json"])
    assert "sweep.json is damaged" in err
    assert sorted((r["run_id"], r["state"]) for r in json.loads(out)) == [(rid, "done") for rid in run_ids]
    out, _ = succeeds(capsys, ["sweep", str(grid), "--dry-run", "--results", str(results)])
    assert out.count(" done") >= 2
    succeeds(capsys, ["cancel", "pair", "--results", str(results)])
    # The next submission writes the record anew: every run is finished, so it only rewrites sweep.json.
    succeeds(capsys, ["sweep", str(grid), "--results", str(results)])
    assert {e["run_id"] for e in json.loads((results / "pair" / "sweep.json").read_text())["runs"]} == set(run_ids)


@pytest.mark.slow
@pytest.mark.parametrize("keep", [20_000, 60_000, "half"])
def test_truncated_checkpoint_in_eval_and_resume(capsys, tmp_path, trained_run, keep):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    ckpt = run / "ckpt" / "last.ckpt"
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    line = fails(capsys, ["eval", str(run), "--tasks", "offline_copa", "--limit", "2"])
    assert "does not match the checksum" in line
    # A checkpoint saved before checksums were written: the reader itself must find the cut.
    (run / "ckpt" / "last.ckpt.sha256").unlink()
    line = fails(capsys, ["eval", str(run), "--tasks", "offline_copa", "--limit", "2"])
    assert "truncated or corrupt" in line
    (run / "status.json").write_text(json.dumps({"state": "failed"}))
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(run)])
    assert "truncated or corrupt" in line and "--no-resume" in line


# -- files that are not UTF-8, folders given as files ---------------------------------------------------------------
LATIN1 = "name: caf\xe9\nbase:\n  model: {preset: tiny}\naxes:\n  variant: [preln]\n".encode("latin-1")


class TestNotUtf8:
    def test_config_file(self, capsys, tmp_path):
        config = write(tmp_path / "run.yaml", "model:\n  preset: tiny\n# r\xe9glage\n".encode("latin-1"))
        line = fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "r"), "--dry-run"])
        assert "not UTF-8" in line and "line 3" in line and "run.yaml" in line

    @pytest.mark.parametrize("command", ["sweep", "status", "report", "cancel"])
    def test_grid_file(self, capsys, tmp_path, command):
        grid = write(tmp_path / "g.yaml", LATIN1)
        flag = "--results-dir" if command == "report" else "--results"
        argv = [command, str(grid), flag, str(tmp_path / "results")] + (["--dry-run"] if command == "sweep" else [])
        line = fails(capsys, argv)
        assert "not UTF-8" in line and "g.yaml" in line

    def test_profile_file(self, capsys, tmp_path):
        grid = write(tmp_path / "g.yaml", GRID.format(name="g"))
        profile = write(tmp_path / "p.yaml", b"partition: d\xe9bug\n")
        line = fails(
            capsys, ["sweep", str(grid), "--profile", str(profile), "--dry-run", "--results", str(tmp_path / "results")]
        )
        assert "not UTF-8" in line and "p.yaml" in line


class TestMisleadingMessages:
    def test_folder_given_as_a_config_or_grid_file(self, capsys, tmp_path):
        line = fails(capsys, ["train", "--config", str(tmp_path), "--out", str(tmp_path / "r"), "--dry-run"])
        assert "is a folder" in line
        (tmp_path / "grid.yaml").mkdir()
        line = fails(capsys, ["sweep", str(tmp_path / "grid.yaml"), "--dry-run"])
        assert "is a folder" in line

    @pytest.mark.parametrize("item", ["train.lr", "=3", "train.lr:3"])
    def test_override_without_equals(self, capsys, tmp_path, item):
        line = fails(capsys, ["train", "--set", item, "--out", str(tmp_path / "r"), "--dry-run"])
        assert "KEY=VALUE" in line and repr(item) in line

    @pytest.mark.parametrize("command", ["bench", "train", "eval", "report", "prepare", "sweep"])
    def test_output_path_that_is_a_file_exits_2(self, capsys, tmp_path, trained_run, command):
        target = write(tmp_path / "a-file", "not a folder")
        doc = write(tmp_path / "doc.txt", "Some words.")
        grid = write(tmp_path / "g.yaml", GRID.format(name="g"))
        argv = {
            "bench": ["bench", "--quick", "--variants", "preln", "--out", str(target)],
            "train": ["train", *TRAIN_ARGS, "--out", str(target)],
            "eval": ["eval", str(trained_run), "--tasks", "offline_copa", "--limit", "2", "--out", str(target)],
            "report": ["report", str(trained_run.parent), "--out", str(target)],
            "prepare": ["prepare", str(doc), "--out", str(target), "--tokenizer", str(trained_run / "tokenizer.json")],
            "sweep": ["sweep", str(grid), "--results", str(target)],
        }[command]
        line = fails(capsys, argv, code=2)
        assert str(target) in line


# -- settings that pass a glance and fail later -------------------------------------------------------------------
BAD_SETTINGS = [
    ("train.seed=-1", "train.seed must be an integer from 0 to 4294967295"),
    ("train.seed=4294967296", "train.seed must be an integer from 0"),
    ("train.lr=nan", "train.lr must be positive"),
    ("train.lr=inf", "train.lr must be positive"),
    ("train.beta2=1.5", "train.beta2 must be in [0, 1)"),
    ("train.weight_decay=nan", "train.weight_decay"),
    ("train.precision=fp7", "train.precision must be one of"),
    ("train.accelerator=gpuu", "train.accelerator must be one of"),
    ("model.init_std=nan", "model.init_std"),
    ("eval.limit=0", "eval.limit"),
    ("slurm.mem_gb=0", "slurm.mem_gb"),
]


class TestSettingsThatFailLater:
    @pytest.mark.parametrize("override, expected", BAD_SETTINGS)
    def test_train_refuses_before_any_work(self, capsys, tmp_path, override, expected):
        line = fails(capsys, ["train", *TRAIN_ARGS, "--set", override, "--out", str(tmp_path / "run")])
        assert expected in line
        assert not (tmp_path / "run").exists()

    @pytest.mark.parametrize("override, expected", BAD_SETTINGS)
    def test_a_grid_refuses_before_any_work(self, capsys, tmp_path, override, expected):
        key, value = override.split("=")
        axis, seeds = f"  {key}: ['{value}']\n", "  train.seed: [0, 1]\n"
        # A grid names each axis once: a bad seed replaces the grid's own seed axis.
        body = GRID.format(name="g").replace(seeds, axis) if key == "train.seed" else GRID.format(name="g") + axis
        grid = write(tmp_path / "g.yaml", body)
        line = fails(capsys, ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")])
        assert expected in line
        assert not (tmp_path / "results").exists()

    def test_lightning_precisions_are_the_allowed_ones(self):
        import typing

        from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR, _PRECISION_INPUT_STR_ALIAS

        from harness.config import PRECISIONS

        assert set(PRECISIONS) == {
            "auto",
            *typing.get_args(_PRECISION_INPUT_STR),
            *typing.get_args(_PRECISION_INPUT_STR_ALIAS),
        }

    @pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
    def test_gpu_accelerator_on_a_cpu_machine(self, capsys, tmp_path):
        line = fails(capsys, ["train", *TRAIN_ARGS, "--set", "train.accelerator=gpu", "--out", str(tmp_path / "r")])
        assert "no CUDA GPU" in line and "train.accelerator=auto" in line
        grid = write(tmp_path / "g.yaml", GRID.format(name="g") + "  train.accelerator: [gpu]\n")
        out, _ = succeeds(capsys, ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")])
        assert "warning: train.accelerator=gpu but this machine has no CUDA GPU" in out
        line = fails(capsys, ["sweep", str(grid), "--results", str(tmp_path / "results")])
        assert "no CUDA GPU" in line and not (tmp_path / "results" / "g" / "sweep.json").exists()

    def test_grid_partition_that_the_cluster_lacks(self, capsys, tmp_path, monkeypatch):
        # A stand-in sinfo with one partition (the real cluster's may have any); sbatch must never be reached.
        bin_dir = tmp_path / "bin"
        for name, body in (("sinfo", "echo 'debug*'"), ("sbatch", "echo 'sbatch must not run' >&2; exit 3")):
            write(bin_dir / name, f"#!/bin/sh\n{body}\n").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        grid = write(tmp_path / "g.yaml", GRID.format(name="g") + "  slurm.partition: [gpuq]\n")
        out, _ = succeeds(
            capsys, ["sweep", str(grid), "--executor", "slurm", "--dry-run", "--results", str(tmp_path / "results")]
        )
        assert "warning: Unknown partition 'gpuq' (slurm.partition of 2 run(s)); this cluster has debug." in out
        line = fails(capsys, ["sweep", str(grid), "--executor", "slurm", "--results", str(tmp_path / "results")])
        assert "Unknown partition 'gpuq'" in line
        assert not (tmp_path / "results" / "g" / "sweep.json").exists()


# -- what used to be accepted silently -----------------------------------------------------------------------------
class TestSilentAcceptance:
    @pytest.mark.parametrize("argv", [["--variant", ""], ["--variant", "  "], ["--preset", ""], ["--set", "variant="]])
    def test_empty_names(self, capsys, tmp_path, argv):
        line = fails(capsys, ["train", *argv, "--out", str(tmp_path / "r"), "--dry-run"])
        assert "variant" in line or "preset" in line

    def test_empty_variant_in_a_config_file(self, capsys, tmp_path):
        config = write(tmp_path / "c.yaml", "variant: ''\n")
        line = fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "r"), "--dry-run"])
        assert "variant is empty" in line

    @pytest.mark.parametrize(
        "flags, expected",
        [
            (["--bootstrap-iters", "-1"], "bootstrap"),
            (["--batch-size", "0"], "batch size"),
            (["--limit", "0"], "limit"),
        ],
    )
    def test_eval_options(self, capsys, trained_run, flags, expected):
        for extra in ([], ["--dry-run"]):
            line = fails(capsys, ["eval", str(trained_run), "--tasks", "offline_copa", *flags, *extra])
            assert expected in line

    @pytest.mark.parametrize(
        "name, data, expected",
        [
            ("empty.txt", b"", "is empty"),
            ("blank.txt", b"  \n\n ", "only white space"),
            ("binary.txt", None, "binary data"),
            ("latin.txt", "Caf\xe9 cr\xe8me, na\xefve.\n".encode("latin-1"), "not UTF-8 text"),
            ("nulls.jsonl", b'{"text": "fine"}\n{"text": null}\n', "Line 2"),
            ("number.jsonl", b'{"text": 3}\n', "int"),
            ("latin.jsonl", '{"text": "caf\xe9"}\n'.encode("latin-1"), "not UTF-8 text"),
            ("empty.jsonl", b"\n\n", "no JSON records"),
            ("nulls.parquet", ["fine", None], "Row 2"),
        ],
    )
    def test_prepare_refuses(self, capsys, tmp_path, trained_run, name, data, expected):
        if data is None:
            data = bytes(random.Random(7).randrange(256) for _ in range(4096)) + b"\0"
        if name.endswith(".parquet"):
            import io

            import pyarrow as pa
            import pyarrow.parquet as pq

            buffer = io.BytesIO()
            pq.write_table(pa.table({"text": data}), buffer)
            data = buffer.getvalue()
        good = write(tmp_path / "good.txt", "A fine document. " * 20)
        bad = write(tmp_path / name, data)
        line = fails(
            capsys,
            [
                "prepare",
                str(good),
                str(bad),
                "--out",
                str(tmp_path / "shards"),
                "--tokenizer",
                str(trained_run / "tokenizer.json"),
            ],
        )
        assert expected in line and name in line
        assert not (tmp_path / "shards" / "index.json").exists()


# -- large grids -----------------------------------------------------------------------------------------------
def _grid_file(tmp_path: Path, seeds: int, lrs: int, name: str = "big") -> Path:
    return write(
        tmp_path / f"{name}.yaml",
        textwrap.dedent(f"""\
        name: {name}
        base:
          model: {{preset: tiny}}
          train: {{max_steps: 2}}
        axes:
          train.seed: {list(range(seeds))}
          train.lr: {[round(1e-4 * (i + 1), 6) for i in range(lrs)]}
        """),
    )


class TestLargeGrids:
    def test_fast_builder_matches_build_config(self, rng_seed):
        """Random layers of every value type the grid files use: the fast path gives build_config's config."""
        from harness import config as C

        rng = random.Random(rng_seed)
        choices = {
            "model.preset": ["tiny", "cpu", "small"],
            "model.n_blocks": [1, 3, "4"],
            "model.norm_eps": [1e-5, "1e-6", 1],
            "model.tie_embeddings": [True, False, "false"],
            "variant": ["preln", "ldm-rls(groups=4)"],
            "train.lr": [1e-3, "3e-4", 2],
            "train.seed": [0, 7, "3"],
            "train.schedule": ["cosine", "wsd"],
            "train.precision": ["auto", "32-true", 32],
            "eval.tasks": [[], ["offline_copa", "offline_piqa"]],
            "eval.limit": [None, 5, "10"],
            "slurm.setup": [["module load x"], []],
            "data.val_fraction": [0.1, "0.2"],
            "slurm.mem_gb": [8, 2.5],
            "name": ["x", "grid-1"],
        }
        base = {"model": {"preset": "tiny"}, "train": {"max_steps": 2}}
        builder = C.ConfigBuilder({"slurm": {"time_min": 10}}, base)
        for _ in range(60):
            keys = rng.sample(sorted(choices), rng.randrange(1, 6))
            layer = {k: rng.choice(choices[k]) for k in keys}
            from harness.sweeps.grid import nest

            fast = builder.build(nest(layer))
            slow = C.build_config({"slurm": {"time_min": 10}}, base, nest(layer))
            assert fast.to_dict() == slow.to_dict() == dataclasses.asdict(slow), layer

    def test_fast_builder_gives_build_configs_errors(self):
        from harness import config as C
        from harness.errors import UsageError

        builder = C.ConfigBuilder({"model": {"preset": "tiny"}})
        for layer in (
            {"train": {"lrr": 1}},
            {"train": {"lr": "fast"}},
            {"train": {"lr": -1}},
            {"model": {"preset": "smal"}},
            {"train": 3},
            {"model": {"d_model": 65}},
        ):
            with pytest.raises(UsageError) as fast:
                builder.build(layer, source="x")
            with pytest.raises(UsageError) as slow:
                C.build_config({"model": {"preset": "tiny"}}, layer, source="x")
            assert str(fast.value) == str(slow.value)

    def test_ten_thousand_runs_expand_without_a_merge_per_run(self, tmp_path, monkeypatch):
        from harness import config as C
        from harness.sweeps.grid import expand, load_grid

        calls = []
        real = C.build_config
        monkeypatch.setattr(C, "build_config", lambda *a, **k: calls.append(1) or real(*a, **k))
        started = time.process_time()
        runs = expand(load_grid(_grid_file(tmp_path, 100, 100)))
        print(f"10^4 runs expanded and validated in {time.process_time() - started:.1f} s of CPU time")
        assert len(runs) == 10_000 and len({r.run_id for r in runs}) == 10_000
        assert calls == []  # every config came from the typed fast path
        assert {(r.cfg.train.seed, r.cfg.train.lr) for r in runs[:3]} == {(0, 1e-4), (0, 2e-4), (0, 3e-4)}

    def test_a_large_grid_asks_for_yes(self, capsys, tmp_path, monkeypatch):
        monkeypatch.setenv("DEPTHMEM_CONFIRM_RUNS", "5")
        grid = _grid_file(tmp_path, 2, 3, name="six")
        results = tmp_path / "results"
        out, _ = succeeds(capsys, ["sweep", str(grid), "--dry-run", "--results", str(results)])
        assert "6 run(s)" in out
        line = fails(capsys, ["sweep", str(grid), "--no-wait", "--results", str(results)])
        assert "6 runs" in line and "more than the 5" in line and "--yes" in line
        assert not results.exists()
        monkeypatch.setenv("DEPTHMEM_CONFIRM_RUNS", "many")
        line = fails(capsys, ["sweep", str(grid), "--results", str(results)])
        assert "DEPTHMEM_CONFIRM_RUNS" in line

    def test_default_limit_is_a_thousand(self, capsys, tmp_path, monkeypatch):
        monkeypatch.delenv("DEPTHMEM_CONFIRM_RUNS", raising=False)
        line = fails(capsys, ["sweep", str(_grid_file(tmp_path, 11, 100)), "--results", str(tmp_path / "r")])
        assert "1,100 runs" in line and "1,000" in line


# -- permissions and temporary files ---------------------------------------------------------------------------------
class TestPermissions:
    @pytest.mark.parametrize("mask", [0o022, 0o002, 0o077, 0o027])
    def test_files_get_what_open_would_give(self, tmp_path, mask):
        old = os.umask(mask)
        try:
            with open(tmp_path / "plain", "wb") as f:
                f.write(b"x")
            hio.atomic_write_text(tmp_path / "atomic.txt", "x")
            hio.atomic_write_json(tmp_path / "sub" / "atomic.json", {"a": 1})
        finally:
            os.umask(old)
        expected = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
        assert expected == 0o666 & ~mask
        for path in (tmp_path / "atomic.txt", tmp_path / "sub" / "atomic.json"):
            assert stat.S_IMODE(path.stat().st_mode) == expected, oct(path.stat().st_mode)

    def test_a_run_directory_is_group_readable(self, capsys, tmp_path):
        old = os.umask(0o002)
        try:
            succeeds(capsys, ["train", *TRAIN_ARGS, "--out", str(tmp_path / "run")])
        finally:
            os.umask(old)
        files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
        assert len(files) >= 8
        for p in files:
            assert stat.S_IMODE(p.stat().st_mode) == 0o664, (p, oct(p.stat().st_mode))


def _killed_writer(folder: Path, name: str, size: int) -> Path:
    """A real process that starts an atomic write of ``size`` bytes and is SIGKILLed before it renames."""
    code = textwrap.dedent(f"""
        import os, signal, tempfile
        from harness import io
        fd, tmp = tempfile.mkstemp(prefix=io._temp_prefix({name!r}), suffix=".tmp", dir={str(folder)!r})
        os.write(fd, os.urandom({size}))
        print(tmp, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL
    tmp = Path(proc.stdout.strip())
    assert tmp.is_file() and tmp.stat().st_size == size
    return tmp


class TestInterruptedWrites:
    def test_the_next_training_run_removes_a_killed_checkpoint_write(self, capsys, tmp_path, trained_run):
        run = tmp_path / "run"
        shutil.copytree(trained_run, run)
        ckpt_size = (run / "ckpt" / "last.ckpt").stat().st_size
        stale = [_killed_writer(run / "ckpt", "last.ckpt", ckpt_size), _killed_writer(run, "status.json", 100)]
        # A write in progress in a live process, and one from another host that is still being written.
        live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        try:
            host = hio._temp_prefix("x").split(".")[2].rsplit("-", 1)[0]
            kept = [
                write(run / "ckpt" / f".last.ckpt.{host}-{live.pid}.abc.tmp", b"partial"),
                write(run / f".metrics.csv.otherhost-{os.getpid()}.abc.tmp", b"partial"),
            ]
            (run / "status.json").write_text(json.dumps({"state": "failed"}))
            succeeds(capsys, ["train", *TRAIN_ARGS, "--out", str(run)])
            assert not any(p.exists() for p in stale)
            assert all(p.exists() for p in kept)
            # The other host's file is removed once nothing has written to it for a while.
            old = time.time() - hio.FOREIGN_TEMP_AGE_S - 60
            os.utime(kept[1], (old, old))
            assert hio.remove_stale_temps(run) == [kept[1]]
        finally:
            live.kill()
            live.wait()
        assert hio.remove_stale_temps(run / "ckpt") == [kept[0]]

    @pytest.mark.parametrize("command", ["eval", "report", "prepare"])
    def test_other_commands_remove_their_own(self, capsys, tmp_path, trained_run, command):
        sweep = tmp_path / "sweep"
        shutil.copytree(trained_run, sweep / "preln")
        doc = write(tmp_path / "doc.txt", "Some words to tokenize. " * 10)
        out = {"eval": sweep / "preln" / "eval", "report": sweep, "prepare": tmp_path / "shards"}[command]
        out.mkdir(parents=True, exist_ok=True)
        stale = _killed_writer(out, "table.csv", 1000)
        argv = {
            "eval": ["eval", str(sweep / "preln"), "--tasks", "offline_copa", "--limit", "2"],
            "report": ["report", str(sweep)],
            "prepare": ["prepare", str(doc), "--out", str(out), "--tokenizer", str(trained_run / "tokenizer.json")],
        }[command]
        succeeds(capsys, argv)
        assert not stale.exists()
