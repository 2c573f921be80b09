"""What a run will need is checked before any run starts, and a dry run checks the same: eval task names, the
results folder, the grid's values, the YAML of grids and profiles, and the shape of overrides; and output to a
reader that has gone ends quietly.

Every case goes through the real command line (``harness.cli.main`` in-process, or as its own process where the
standard output must be a real pipe) and checks that a bad input ends with one sentence naming the problem,
exit 2, and that nothing was created or trained.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_checks import TRAIN_ARGS, fails
from test_status import make_sweep

from harness.cli import PIPE_CLOSED
from harness.cli import main as cli_main
from harness.io import atomic_write_json, read_json
from harness.rundir import short_value, write_config, write_status
from harness.sweeps.planning import plan
from harness.yamltext import read_yaml

pytestmark = pytest.mark.usefixtures("shared_cache", "quiet_stale_log_handlers")

GRID = (
    "name: g\nbase:\n  model: {{preset: tiny}}\n  train: {{max_steps: 2}}\n  eval: {{tasks: {tasks}}}\n"
    "axes:\n  variant: [preln, ldm]\n"
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def blocked(tmp_path) -> Path:
    """A path below a regular file: no process, root included, can make a folder there."""
    (tmp_path / "a-file").write_text("not a folder")
    return tmp_path / "a-file" / "sub"


# -- eval task names ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dry_run", [["--dry-run"], []])
def test_misspelt_offline_task_fails_the_dry_run_and_the_submission(capsys, tmp_path, dry_run):
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[offline_copa, offline_foo]"))
    line = fails(capsys, ["sweep", str(grid), *dry_run, "--results", str(tmp_path / "results")])
    assert "Unknown task 'offline_foo'" in line and str(grid) in line
    assert "offline_copa" in line and "offline_piqa" in line  # the allowed names
    assert not (tmp_path / "results").exists()


def test_known_tasks_pass_the_dry_run(capsys, tmp_path):
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[offline_copa, offline]"))
    assert cli_main(["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")]) == 0
    assert "2 run(s)" in capsys.readouterr().out


def test_unknown_hub_task_fails_the_dry_run_train_and_eval(capsys, tmp_path):
    # A name outside the offline suite is looked up in lm-eval's own task index (built once per process).
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[hellaswg]"))
    line = fails(capsys, ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")])
    assert "Unknown task 'hellaswg'" in line and "Did you mean 'hellaswag'?" in line and "offline_hellaswag" in line
    # A known hub task passes, and the dry run names it with its offline twin.
    write(tmp_path / "g.yaml", GRID.format(tasks="[hellaswag, offline_copa]"))
    assert cli_main(["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")]) == 0
    notes = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "names hellaswag, whose data" in notes[0] and "offline_hellaswag read" in notes[0]
    run = tmp_path / "run"
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(run), "--set", "eval.tasks=[hellaswg]"])
    assert "Unknown task 'hellaswg'" in line and not run.exists()
    assert cli_main(["train", *TRAIN_ARGS, "--out", str(run)]) == 0
    capsys.readouterr()
    line = fails(capsys, ["eval", str(run), "--tasks", "offline_copa,hellaswg", "--limit", "2"])
    assert "Unknown task 'hellaswg'" in line
    assert not (run / "eval").exists()  # nothing was evaluated, not even the known task


def test_train_with_a_misspelt_task_fails_before_training(capsys, tmp_path):
    run = tmp_path / "run"
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(run), "eval.tasks=[offline_foo]"])
    assert "Unknown task 'offline_foo'" in line and "offline_copa" in line
    assert not run.exists()


# -- the results folder and the grid's values ---------------------------------------------------------------------
def test_dry_run_with_an_unwritable_results_folder(capsys, tmp_path, blocked):
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[]"))
    line = fails(capsys, ["sweep", str(grid), "--dry-run", "--results", str(blocked)])
    assert "sweep folder" in line and str(blocked) in line and "is a file" in line


@pytest.mark.parametrize(
    "axis, expected",
    [
        ("train.lr: [1.0e-3, -1]", ["train.lr must be positive"]),
        ("train.logger: [csv, tensorbord]", ["train.logger must be csv, tensorboard or wandb", "'tensorbord'"]),
    ],
)
def test_dry_run_checks_every_value_of_the_grid(capsys, tmp_path, axis, expected):
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[]") + f"  {axis}\n")
    line = fails(capsys, ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")])
    for text in expected:
        assert text in line


# -- duplicate keys in grids, profiles and config files --------------------------------------------------------
@pytest.mark.parametrize(
    "body, key, lines",
    [
        (
            "name: g\nbase:\n  model: {preset: tiny}\n  train: {max_steps: 2, lr: 1.0e-3, lr: 3.0e-3}\n"
            "axes:\n  variant: [preln]\n",
            "'lr'",
            "(line 4)",
        ),
        (
            "name: g\nbase:\n  model: {preset: tiny}\naxes:\n  variant: [preln]\nbase:\n  train: {max_steps: 2}\n",
            "'base'",
            "(lines 2 and 6)",
        ),
        (
            "name: g\nbase:\n  model: {preset: tiny}\naxes:\n  variant: [preln]\n  variant: [ldm]\n",
            "'variant'",
            "(lines 5 and 6)",
        ),
    ],
)
def test_duplicate_key_in_a_grid(capsys, tmp_path, body, key, lines):
    grid = write(tmp_path / "g.yaml", body)
    for argv in (["--dry-run"], []):
        line = fails(capsys, ["sweep", str(grid), *argv, "--results", str(tmp_path / "results")])
        assert f"The key {key} appears twice" in line and str(grid) in line and lines in line
    assert not (tmp_path / "results").exists()


def test_duplicate_key_in_a_profile_and_a_config_file(capsys, tmp_path):
    profile = write(tmp_path / "p.yaml", "executor: local\nmem_gb: 8\ncpus_per_task: 2\nmem_gb: 16\n")
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[]"))
    line = fails(capsys, ["sweep", str(grid), "--profile", str(profile), "--dry-run", "--results", str(tmp_path)])
    assert "The key 'mem_gb' appears twice" in line and str(profile) in line and "(lines 2 and 4)" in line
    config = write(tmp_path / "run.yaml", "model:\n  preset: tiny\ntrain:\n  seed: 1\n  seed: 2\n")
    line = fails(capsys, ["train", "--config", str(config), "--out", str(tmp_path / "run"), "--dry-run"])
    assert "The key 'seed' appears twice" in line and str(config) in line


def test_a_merged_key_may_be_overridden(tmp_path):
    path = write(tmp_path / "m.yaml", "small: &s {lr: 1.0e-3, seed: 0}\nrun:\n  <<: *s\n  lr: 3.0e-3\n")
    assert read_yaml(path)["run"] == {"lr": 3.0e-3, "seed": 0}


# -- one run takes one value --------------------------------------------------------------------------------------
@pytest.mark.parametrize("override", ["train.lr=1e-3,3e-3", "eval.tasks=offline_copa,offline_piqa"])
def test_comma_list_on_train_points_to_sweep(capsys, tmp_path, override):
    for argv in ([override], ["--set", override]):
        line = fails(capsys, ["train", "--preset", "tiny", *argv, "--out", str(tmp_path / "run"), "--dry-run"])
        assert "comma lists are sweep axes: use `depthmem sweep`" in line and repr(override) in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "override, key, expected",
    [
        ("variant=ldm-rls(groups=4,lambda=0.9)", "variant", "ldm-rls(groups=4,lambda=0.9)"),
        ("eval.tasks=[offline_copa,offline_piqa]", "eval", {"tasks": ["offline_copa", "offline_piqa"]}),
    ],
)
def test_commas_inside_brackets_are_one_value(capsys, tmp_path, override, key, expected):
    assert cli_main(["train", "--preset", "tiny", override, "--out", str(tmp_path / "run"), "--dry-run"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    got = cfg[key] if key == "variant" else {"tasks": cfg[key]["tasks"]}
    assert got == expected


# -- a reader that stops reading ----------------------------------------------------------------------------------
def _with_closed_stdout(argv: list[str]) -> tuple[int, str]:
    """Run the CLI as its own process whose standard output's reader has already gone (``... | head -0``)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "harness.cli", *argv],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            cwd=root,
            env=env,
            timeout=300,
        )
    finally:
        os.close(write_end)
    return proc.returncode, proc.stderr


def test_closed_pipe_ends_quietly(tmp_path):
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[]"))
    sweep = make_sweep(tmp_path / "results", runs=20)
    for argv in (
        ["sweep", str(grid), "--dry-run", "--results", str(tmp_path / "results")],
        ["status", sweep.name, "--results", str(sweep.parent)],
    ):
        code, err = _with_closed_stdout(argv)
        assert code == PIPE_CLOSED == 141 and err == "", (argv, code, err[-2000:])


# -- an --out that holds another run ------------------------------------------------------------------------------
def test_another_runs_folder_names_the_keys_that_differ(capsys, tmp_path):
    run = tmp_path / "run"
    assert cli_main(["train", *TRAIN_ARGS, "--out", str(run)]) == 0
    capsys.readouterr()
    before = (run / "config.json").read_bytes()
    saved = json.loads(before)
    # Without the run's settings the defaults differ in several keys: a few are named, the rest counted.
    line = fails(capsys, ["train", "--out", str(run), "train.logger=tensorboard"], max_len=800)
    assert "holds a run with a different config" in line
    assert f"train.batch_size: {saved['train']['batch_size']} → 8" in line
    assert line.count(" → ") == 3 and "more)" in line and f"--config {run / 'config.json'}" in line
    # One key changed: exactly that one is named, with both values.
    config = str(run / "config.json")
    line = fails(capsys, ["train", "--out", str(run), "--config", config, "train.lr=0.0125"], max_len=800)
    assert f"(train.lr: {saved['train']['lr']} → 0.0125)" in line
    assert (run / "config.json").read_bytes() == before
    # The logger is not part of what the run trained: the run's own settings with another logger are accepted.
    assert cli_main(["train", "--out", str(run), "--config", config, "train.logger=tensorboard"]) == 0
    assert "sent" in capsys.readouterr().out


# -- run ids ------------------------------------------------------------------------------------------------------
LR_GRID = (
    "name: g\nbase:\n  model: {preset: tiny}\n  train: {max_steps: 2}\naxes:\n  train.lr: [3.0e-3, 1.0e-2, 3.0e-2]\n"
)


def _finished(run_dir: Path, cfg) -> None:
    """A run as a finished sweep leaves it: its entry in sweep.json, its config, a done status and its summary."""
    record = read_json(run_dir.parent / "sweep.json", default={"runs": []})
    record["runs"].append({"run_id": run_dir.name, "run_dir": run_dir.name, "overrides": {"train.lr": cfg.train.lr}})
    atomic_write_json(run_dir.parent / "sweep.json", record)
    write_config(run_dir, cfg)
    write_status(run_dir, "done", step=2, total_steps=2, message="")
    atomic_write_json(run_dir / "summary.json", {"val_loss": 3.0, "val_bpb": 1.2, "params": 140000})


def test_run_ids_write_every_learning_rate_in_one_form(tmp_path):
    grid = write(tmp_path / "g.yaml", LR_GRID)
    p = plan(grid, root=tmp_path / "results")
    assert [r.run_id.split("-s0-")[0] for r in p.runs] == ["preln-lr3e-3", "preln-lr1e-2", "preln-lr3e-2"]
    assert [short_value(v) for v in (0.0125, 0.05, 0.1, 0.5, 2.0, 1e6, 1.5e-5)] == [
        "1.25e-2",
        "5e-2",
        "0.1",
        "0.5",
        "2",
        "1e6",
        "1.5e-5",
    ]


def test_finished_runs_named_in_another_form_are_found_again(tmp_path):
    grid = write(tmp_path / "g.yaml", LR_GRID)
    sweep_dir = tmp_path / "results" / "g"
    first = plan(grid, root=tmp_path / "results")
    ids = [r.run_id for r in first.runs]
    old = ids[1].replace("-lr1e-2-", "-lr0.01-")
    _finished(sweep_dir / old, first.runs[1].cfg)
    again = plan(grid, root=tmp_path / "results")
    assert [r.run_id for r in again.runs] == [ids[0], old, ids[2]]
    assert again.decisions == {ids[0]: "submit", old: "done", ids[2]: "submit"}
    # Two folders with the same seed and hash: which one is the run cannot be told, so neither is taken.
    _finished(sweep_dir / ids[1].replace("-lr1e-2-", "-lr0.010-"), first.runs[1].cfg)
    third = plan(grid, root=tmp_path / "results")
    assert [r.run_id for r in third.runs] == ids and third.decisions[ids[1]] == "submit"


# -- the logger's package -----------------------------------------------------------------------------------------
def test_a_logger_whose_package_is_missing_fails_before_training(capsys, tmp_path, monkeypatch):
    # Simulated: the package lookup finds nothing, as on a machine where wandb was never installed.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    run = tmp_path / "run"
    line = fails(capsys, ["train", *TRAIN_ARGS, "--out", str(run), "train.logger=wandb"])
    assert "train.logger=wandb needs the package wandb" in line and "train.logger=csv" in line
    assert not run.exists()
    grid = write(tmp_path / "g.yaml", GRID.format(tasks="[]") + "  train.logger: [csv, wandb]\n")
    line = fails(capsys, ["sweep", str(grid), "--executor", "local", "--results", str(tmp_path / "results")])
    assert "train.logger=wandb needs the package wandb" in line
    assert not (tmp_path / "results").exists()
