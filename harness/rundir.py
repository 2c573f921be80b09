"""The run directory: what a run writes, where, and the small helpers that read and write it.

Layout::

    <run_dir>/
      config.json     the resolved RunConfig, written before step 0
      env.json        package versions, git revision, host, devices
      status.json     state (pending, running, done, failed, diverged, interrupted, cancelled), step, last loss,
                      message, job id, node, the step of the last checkpoint
      metrics.csv     one row per logged step: step, tokens, train_loss, val_loss, val_bpb, lr, grad_norm, tokens_per_s
      layers.csv      per-layer diagnostics: step, layer, kind, input_rms, output_rms, grad_norm
      summary.json    final numbers of a finished run: val_loss, val_bpb, params, costs, throughput, peak memory
      mixing.json     the depth-mixing matrix of the final model on validation tokens
      ckpt/last.ckpt  the latest checkpoint (exact resume)
      eval/           lm-eval's results_<iso-time>.json and table.csv (task, metric, value, stderr)

Every file goes through ``harness.io``'s atomic writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from harness.config import RunConfig, build_config, flat_keys
from harness.errors import UsageError
from harness.io import DamagedFile, atomic_write_json, read_json

STATES = ("pending", "running", "done", "failed", "diverged", "interrupted", "cancelled")
"""``interrupted``: stopped by a signal (preemption, requeue, Ctrl-C) after saving a checkpoint, resumed by running
the same command again; ``cancelled``: stopped by ``depthmem cancel`` or ``scancel``, resumed the same way."""
DAMAGED = "damaged"
"""The state read from a status.json that no longer parses; never written, the next write replaces the file."""
PACKAGES = (
    "torch",
    "lightning",
    "lm_eval",
    "submitit",
    "transformers",
    "tokenizers",
    "tiktoken",
    "numpy",
    "pandas",
    "depthmem",
)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# Settings that change how a run is watched, where it runs or what is done with it afterwards, but not the model
# it trains: evaluation, loggers, log/validation/checkpoint intervals, the process layout and the cache folder.
# Batches are keyed by (seed, step) and the global batch is split over processes, so neither the intervals nor
# the layout changes a step's update.
NOT_IDENTITY = {
    "name": None,
    "slurm": None,
    "eval": None,
    "train": (
        "logger",
        "wandb_project",
        "log_every_steps",
        "val_every_steps",
        "ckpt_every_steps",
        "devices",
        "num_nodes",
        "strategy",
        "activation_checkpointing",
    ),
    "data": ("cache_dir",),
}


def identity(cfg: RunConfig, *, with_seed: bool = True) -> dict[str, Any]:
    """The part of a config that decides the trained model: model, variant (canonical), data, tokenizer,
    optimisation, precision, budget and (optionally) seed."""
    # The variant is the parsed, canonical name: ``ldm-rls`` and ``ldm-rls(groups=16)`` are one model, so they
    # share a hash (and collide in a grid).
    d = cfg.to_dict()
    d["variant"] = str(cfg.variant)
    for section, keys in NOT_IDENTITY.items():
        if keys is None:
            d.pop(section, None)
        else:
            d[section] = {k: v for k, v in d[section].items() if k not in keys}
    if not with_seed:
        d["train"].pop("seed", None)
    _drop_default_split(d)
    return d


def _drop_default_split(d: dict[str, Any]) -> None:
    # Runs validated on ``val`` hashed the same before ``data.eval_split`` existed; leaving the default out keeps
    # their ids (and their folders) unchanged.
    if d.get("data", {}).get("eval_split") == "val":
        del d["data"]["eval_split"]


def config_hash(cfg: RunConfig, *, with_seed: bool = False) -> str:
    """A short hash of the run's identity (the seed optional): equal for configs that train the same model."""
    blob = json.dumps(identity(cfg, with_seed=with_seed), sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:8]


SHOWN_DIFFERENCES = 3
"""Most differing keys named when a run directory holds another run; the rest are counted."""


def check_same_run(run_dir: Path, cfg: RunConfig) -> None:
    """Refuse a run directory that holds a run of another model (its identity, the seed included, differs), naming
    the keys that differ."""
    if not (Path(run_dir) / "config.json").is_file():
        return
    old = flat_keys(identity(read_config(run_dir)))
    new = flat_keys(identity(cfg))
    keys = [k for k in dict.fromkeys([*new, *old]) if old.get(k, "(unset)") != new.get(k, "(unset)")]
    if not keys:
        return
    shown = "; ".join(f"{k}: {old.get(k, '(unset)')} → {new.get(k, '(unset)')}" for k in keys[:SHOWN_DIFFERENCES])
    more = f"; and {len(keys) - SHOWN_DIFFERENCES} more" if len(keys) > SHOWN_DIFFERENCES else ""
    raise UsageError(
        f"{run_dir} holds a run with a different config ({shown}{more}); give this run another --out directory, or "
        f"start from the run's own settings (--config {Path(run_dir) / 'config.json'}) to change only its logger, "
        "evaluation or intervals."
    )


# Short labels of common axes in run ids; any other key is labelled by its last part.
AXIS_LABELS = {
    "train.lr": "lr",
    "train.weight_decay": "wd",
    "train.batch_size": "bs",
    "train.warmup_steps": "warmup",
    "train.max_steps": "steps",
    "train.tokens_per_param": "tpp",
    "train.schedule": "",
    "model.preset": "",
    "model.n_blocks": "blocks",
    "model.d_model": "d",
    "train.precision": "",
    "train.seq_len": "seq",
    "data.corpus": "",
    "data.eval_split": "",
    "data.tokenizer": "tok",
    "model.vocab_size": "vocab",
}
_SLUG = re.compile(r"[^A-Za-z0-9.]+")


def axis_label(key: str) -> str:
    """The column name and id prefix of an axis: ``train.lr`` -> ``lr``; keys without a short form keep their name."""
    if key in AXIS_LABELS:
        return AXIS_LABELS[key] or key.rsplit(".", 1)[-1]
    return key.rsplit(".", 1)[-1]


SCIENTIFIC_BELOW = 0.1
"""Floats smaller than this in magnitude read as ``3e-3`` in ids, so a learning-rate axis is written in one form
(``1e-3``, ``3e-3``, ``1e-2``, ``3e-2``); larger ones as ``%g`` writes them (``0.5``, ``2``, ``1e6``)."""


def short_value(value: Any) -> str:
    """An axis value as it reads in an id: ``0.003`` -> ``3e-3``, ``0.01`` -> ``1e-2``, ``/data/fineweb`` ->
    ``fineweb``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        if 0 < abs(value) < SCIENTIFIC_BELOW:
            mant, exp = f"{value:e}".split("e")
            return f"{float(mant):g}e{int(exp)}"
        text = f"{value:g}"
        if "e" in text:
            mant, exp = text.split("e")
            return f"{mant}e{int(exp)}"
        return text
    text = str(value)
    if "/" in text:
        text = text.rstrip("/").rsplit("/", 1)[-1]
    return _SLUG.sub("-", text).strip("-")


def run_id(cfg: RunConfig, axes: dict[str, Any] | None = None) -> str:
    """A stable, readable id: the variant, the values of the grid's other axes, the seed and a short hash of the
    run's identity, e.g. ``ldm-rls-lr3e-3-s0-3f2a9c1e``. The hash alone tells runs apart; the rest is for reading."""
    parts = [_SLUG.sub("-", str(cfg.variant)).strip("-")]
    for key, value in (axes or {}).items():
        if key in ("variant", "train.seed", "name"):
            continue
        label = AXIS_LABELS.get(key, key.rsplit(".", 1)[-1].replace("_", ""))
        parts.append(f"{label}{short_value(value)}")
    readable = "-".join(p for p in parts if p)[:80].strip("-.")
    return f"{readable}-s{cfg.train.seed}-{config_hash(cfg)}"


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    atomic_write_json(Path(run_dir) / "config.json", cfg.to_dict())


def read_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / "config.json"
    try:
        data = read_json(path)
    except DamagedFile as e:
        raise UsageError(
            f"The run's {path} is damaged ({e.reason}); delete it and run the same command again "
            "(training writes it anew, and the checkpoint's own copy of the config still guards the "
            "resume)."
        ) from None
    if data is None:
        raise UsageError(f"{run_dir} holds no config.json: it is not a run directory.")
    if not isinstance(data, dict):
        raise UsageError(
            f"The run's {path} is damaged (it holds a {type(data).__name__}, not a mapping); delete it "
            "and run the same command again."
        )
    return build_config(data, source=str(path))


def read_status(run_dir: Path) -> dict[str, Any]:
    """The run's status.json; one that no longer parses reads as state ``damaged`` with the reason."""
    path = Path(run_dir) / "status.json"
    try:
        status = read_json(path, default={"state": "pending"})
    except DamagedFile as e:
        return {"state": DAMAGED, "message": f"status.json is damaged ({e.reason})"}
    if not isinstance(status, dict) or not isinstance(status.get("state", "pending"), str):
        return {"state": DAMAGED, "message": "status.json is damaged (it holds no state)"}
    return status


def read_summary(run_dir: Path) -> dict[str, Any]:
    """The final numbers of a finished run; empty when there are none or summary.json no longer parses."""
    try:
        summary = read_json(Path(run_dir) / "summary.json", default={})
    except DamagedFile:
        return {}
    return summary if isinstance(summary, dict) else {}


def read_metric_rows(path: Path, up_to_step: int) -> list[dict[str, str]]:
    """Rows of a run's metrics.csv or layers.csv up to ``up_to_step``; lines that do not parse are dropped.

    A resumed run rewrites the file from these rows, so a damaged line costs that line, never the run.
    """
    import csv
    import io

    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # a line whose append never finished is not a row
    rows = []
    try:
        for row in csv.DictReader(io.StringIO(text.replace("\0", ""))):
            try:
                step = int(row.get("step") or "")
            except (TypeError, ValueError):
                continue
            if step <= up_to_step and None not in row and None not in row.values():
                rows.append(row)
    except csv.Error:
        pass  # a line the csv module cannot split ends the readable part of the file
    return rows


def read_sweep_record(sweep_dir: Path) -> dict[str, Any]:
    """A sweep's sweep.json; when it no longer parses, its runs are listed from their run directories instead.

    Job ids come from each run's status.json then; an array task id (``123_4``) means SLURM, any other a local
    process, which is how submitit names them.
    """
    import sys

    sweep_dir = Path(sweep_dir)
    try:
        record = read_json(sweep_dir / "sweep.json", default={})
        if (
            isinstance(record, dict)
            and isinstance(record.get("runs", []), list)
            and all(isinstance(e, dict) and "run_id" in e for e in record.get("runs", []))
        ):
            return record
        reason = "it holds no list of runs"
    except DamagedFile as e:
        reason = e.reason
    runs = []
    for d in sorted(p for p in sweep_dir.iterdir() if p.is_dir()):
        if not ((d / "config.json").exists() or (d / "status.json").exists()):
            continue
        status = read_status(d)
        job_id = status.get("job_id")
        entry: dict[str, Any] = {"run_id": d.name, "run_dir": d.name}
        if job_id:
            entry.update(job_id=str(job_id), executor="slurm" if "_" in str(job_id) else "local")
        try:
            entry["variant"] = read_config(d).variant
        except UsageError:
            pass
        runs.append(entry)
    sys.stderr.write(
        f"depthmem: warning: {sweep_dir / 'sweep.json'} is damaged ({reason}); the {len(runs)} "
        f"run(s) are listed from their folders, and the next submission writes it anew.\n"
    )
    return {"name": sweep_dir.name, "runs": runs, "submissions": []}


def write_status(run_dir: Path, state: str, **fields: Any) -> dict[str, Any]:
    """Update status.json, keeping earlier fields (job id, node) that this call does not change."""
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    status = read_status(run_dir)
    if status.get("state") == DAMAGED:
        status = {}  # nothing in it can be trusted: the new status replaces it whole
    status.update(fields, state=state, updated=now_iso())
    atomic_write_json(Path(run_dir) / "status.json", status)
    return status


def git_revision() -> str | None:
    """The checkout's commit, with ``-dirty`` when tracked files differ from it; None outside a git checkout."""
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode != 0:
            return None
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, Any]:
    """Package versions, git revision, host and devices: what a reader needs to reproduce a run."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    devices: dict[str, Any] = {"cpu_count": os.cpu_count()}
    try:
        import torch

        devices["cuda"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        devices["torch_threads"] = torch.get_num_threads()
    except Exception:  # torch missing or no driver: the record is still useful without it
        pass
    return {
        "packages": versions,
        "python": platform.python_version(),
        "git_revision": git_revision(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "devices": devices,
        "time": now_iso(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def write_env(run_dir: Path) -> dict[str, Any]:
    env = environment()
    atomic_write_json(Path(run_dir) / "env.json", env)
    return env
