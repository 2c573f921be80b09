"""Sweep archives: ``depthmem pack`` writes the same bytes for the same runs, and a report read from the archive is
the report read from the folder."""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path, PurePosixPath

import numpy as np
import pandas as pd
import pytest
from cli_checks import fails
from test_report import _write_run

from harness.cli import main as cli_main
from harness.errors import UsageError
from harness.reporting import archive
from harness.reporting.report import report, resolve_target
from harness.reporting.results import aggregate, load_sweep
from harness.reporting.tuning import read_tuning

pytestmark = pytest.mark.xdist_group("report")

# (variant, seed, state, message): finished runs of two variants, one failed, one still running.
RUNS = [
    ("preln", 0, "done", ""),
    ("preln", 1, "done", ""),
    ("ldm-rls", 0, "done", ""),
    ("ldm-rls", 1, "done", ""),
    ("hc", 0, "failed", "CUDA out of memory at step 12"),
    ("preln", 2, "running", ""),
]
KEPT_RUN_FILES = ("config.json", "status.json", "metrics.csv", "layers.csv")


@pytest.fixture
def sweep_dir(tmp_path, rng_seed):
    """A sweep of known files (fresh random values), with a tuning.json, a manifest and what pack leaves out."""
    rng = np.random.default_rng(rng_seed)
    root = tmp_path / "synthetic"
    for variant, seed, state, message in RUNS:
        run = root / variant / f"run-s{seed}"
        _write_run(run, variant, seed, state, message, rng)
        (run / "ckpt").mkdir()
        (run / "ckpt" / "last.ckpt").write_bytes(rng.bytes(64))
    # A summary cut off mid-write: a note, whichever form the sweep is read from.
    (root / "ldm-rls" / "run-s1" / "summary.json").write_text('{"val_loss": 3.2, "step"')
    (root / "preln" / "run-s0" / ".metrics.csv.host-1.abc.tmp").write_text("half a line")
    (root / "preln" / "run-s0" / "weights.safetensors").write_bytes(rng.bytes(32))
    (root / "preln" / "run-s0" / "big.jsonl").write_bytes(rng.bytes(4096))
    lr = float(rng.uniform(1e-3, 5e-3))
    cells = [{"cell": "variant=preln", "variant": "preln", "tuned": True, "state": "chosen", "chosen": lr}]
    (root / "tuning.json").write_text(json.dumps({"axis": "train.lr", "values": [lr, 2 * lr], "cells": cells}))
    (root / "sweep.json").write_text(json.dumps({"name": "synthetic", "runs": []}))
    (root / "notes.txt").write_text("not part of any run")
    return root


@pytest.fixture(autouse=True)
def small_members(monkeypatch):
    monkeypatch.setattr(archive, "MAX_MEMBER_BYTES", 2048)  # big.jsonl above stands for a file over the limit


def test_pack_keeps_the_results_and_is_byte_identical_for_the_same_files(sweep_dir, tmp_path):
    first = archive.pack(sweep_dir, tmp_path / "a.tar.xz")
    for path in sweep_dir.rglob("*"):  # new times and permissions, the same contents
        os.utime(path, (1e9, 1e9))
        if path.is_file():
            path.chmod(0o600)
    second = archive.pack(sweep_dir, tmp_path / "b.tar.xz")
    assert first.read_bytes() == second.read_bytes()
    gz = [archive.pack(sweep_dir, tmp_path / name).read_bytes() for name in ("a.tgz", "b.tar.gz")]
    assert gz[0] == gz[1]
    with tarfile.open(first) as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names == sorted(names)
    assert all((m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644) for m in members)
    assert {"tuning.json", "sweep.json", "preln/run-s0/eval/table.csv"} <= set(names)
    assert all(f"{v}/run-s{s}/{f}" in names for v, s, _, _ in RUNS for f in KEPT_RUN_FILES)
    skipped = ("ckpt", ".tmp", ".safetensors", "big.jsonl", "notes.txt")
    assert not [n for n in names if any(part in n for part in skipped)]


def test_an_archive_reads_as_the_folder_does(sweep_dir, tmp_path):
    packed = archive.pack(sweep_dir, tmp_path / "synthetic.tar.xz")
    folder, archived = load_sweep(sweep_dir), load_sweep(packed)
    assert folder.notes == archived.notes and any("summary.json" in n for n in folder.notes)
    assert (folder.knob_names, folder.axis_keys) == (archived.knob_names, archived.axis_keys)
    assert [r.rel for r in archived.runs] == [f"{v}/run-s{s}" for v, s in sorted((v, s) for v, s, _, _ in RUNS)]
    assert [r.run_id for r in folder.runs] == [r.run_id for r in archived.runs]
    for a, b in zip(folder.runs, archived.runs):
        assert b.path == PurePosixPath(a.rel) and a.path == sweep_dir / a.rel
        for name in (
            "run_id",
            "rel",
            "variant",
            "knobs",
            "config",
            "status",
            "summary",
            "mixing",
            "state",
            "final_loss",
        ):
            assert getattr(a, name) == getattr(b, name), (a.rel, name)
        for name in ("metrics", "layers", "eval"):
            if getattr(a, name) is None:
                assert getattr(b, name) is None
            else:
                pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name))
    pd.testing.assert_frame_equal(aggregate(folder), aggregate(archived))
    assert read_tuning(packed) == read_tuning(sweep_dir) and read_tuning(packed)["cells"][0]["variant"] == "preln"


def test_a_report_from_the_archive_is_the_report_from_the_folder(sweep_dir, tmp_path):
    packed = archive.pack(sweep_dir, tmp_path / "synthetic.tar.xz")
    spec = {"figures": ["final_loss"]}
    from_folder = report(sweep_dir, out_dir=tmp_path / "from-folder", spec=spec)
    from_archive = report(packed, out_dir=tmp_path / "from-archive", spec=spec)
    assert from_archive.read_text() == from_folder.read_text()
    tables = sorted(p.name for p in (tmp_path / "from-folder" / "tables").glob("*.csv"))
    assert {"main.csv", "tuning.csv"} <= set(tables)
    assert tables == sorted(p.name for p in (tmp_path / "from-archive" / "tables").glob("*.csv"))
    for rel in [f"tables/{name}" for name in tables] + ["aggregate.csv", "runs.csv"]:
        assert (tmp_path / "from-archive" / rel).read_text() == (tmp_path / "from-folder" / rel).read_text(), rel
    assert (tmp_path / "from-archive" / "figures" / "final_loss.png").is_file()


def test_the_command_packs_beside_the_folder_and_reports_need_a_folder_to_write(sweep_dir, tmp_path, capsys):
    assert cli_main(["pack", str(sweep_dir)]) == 0
    packed = tmp_path / "synthetic.tar.xz"
    assert capsys.readouterr().out.startswith(f"{packed} (") and packed.is_file()
    line = fails(capsys, ["report", str(packed)])
    assert str(packed) in line and "--out FOLDER" in line
    with pytest.raises(UsageError, match="--out FOLDER"):
        report(packed)
    assert cli_main(["report", str(packed), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    assert json.loads(capsys.readouterr().out)["out_dir"] == str(tmp_path / "out")


def test_damaged_and_foreign_files_end_in_one_sentence(sweep_dir, tmp_path, capsys, rng_seed):
    rng = np.random.default_rng(rng_seed)
    corrupt = tmp_path / "corrupt.tar.xz"
    corrupt.write_bytes(rng.bytes(512))
    line = fails(capsys, ["report", str(corrupt), "--out", str(tmp_path / "out")])
    assert "cannot be read" in line and "depthmem pack" in line
    text = tmp_path / "notes.txt"
    text.write_text("not a sweep")
    line = fails(capsys, ["report", str(text), "--out", str(tmp_path / "out")])
    assert "neither a sweep archive" in line
    line = fails(capsys, ["pack", str(tmp_path / "missing")])
    assert "does not exist" in line
    line = fails(capsys, ["pack", str(sweep_dir), "--out", str(tmp_path / "sweep.zip")])
    assert ".tar.xz" in line
    (tmp_path / "empty").mkdir()
    assert "nothing to pack" in fails(capsys, ["pack", str(tmp_path / "empty")])
    assert not (tmp_path / "out").exists()


def test_a_cut_archive_keeps_the_runs_before_the_cut_and_says_so(sweep_dir, tmp_path):
    packed = archive.pack(sweep_dir, tmp_path / "whole.tar.xz")
    cut = tmp_path / "cut.tar.xz"
    cut.write_bytes(packed.read_bytes()[: packed.stat().st_size * 2 // 3])
    sweep = load_sweep(cut)
    assert 0 < len(sweep.runs) < len(RUNS) and any("is damaged after its first" in n for n in sweep.notes)


@pytest.mark.slow
@pytest.mark.parametrize(
    "grid, folder",
    [
        ("experiments/reference.yaml", "results/reference/study"),
        ("experiments/reference-protocol.yaml", "results/reference/protocol"),
        ("experiments/residual-write.yaml", "results/reference/residual-write"),
    ],
)
def test_committed_reference_tables_come_from_their_committed_archive(tmp_path, monkeypatch, grid, folder):
    """Each committed reference report's tables are what the report code makes of its committed run archive."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)  # the grid names its archive relative to the repository
    source, spec = resolve_target(grid)
    assert source.suffix == ".xz" and source.is_file()
    spec.figures = []  # the tables carry the numbers; drawing the figures would only add time
    report(source, out_dir=tmp_path, spec=spec)
    committed = sorted((root / folder / "tables").glob("*.csv"))
    assert committed
    for path in committed:
        assert (tmp_path / "tables" / path.name).read_text() == path.read_text(), path.name
