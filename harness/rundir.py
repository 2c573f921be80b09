"""The run directory: what a run writes, where, and the small helpers that read and write it.

Layout::

    <run_dir>/
      config.json     the resolved RunConfig, written before step 0
      env.json        package versions, git revision, host, devices
      status.json     state (pending, running, done, failed, diverged), step, last loss, message, job id, node
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

from harness.config import RunConfig, build_config
from harness.errors import UsageError
from harness.io import DamagedFile, atomic_write_json, read_json

STATES = ("pending", "running", "done", "failed", "diverged")
DAMAGED = "damaged"
"""The state read from a status.json that no longer parses; never written, the next write replaces the file."""
PACKAGES = ("torch", "lightning", "lm_eval", "submitit", "transformers", "tokenizers", "tiktoken", "numpy",
            "pandas", "depthmem")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _canonical_variant(spec: str) -> str:
    # ``ldm-rls`` and ``ldm-rls(groups=16)`` are one model, so they must share a hash (and collide in a grid).
    import variants

    try:
        return variants.canonical(spec)
    except UsageError:
        return spec


def config_hash(cfg: RunConfig, *, with_seed: bool = False) -> str:
    """A short hash of everything that determines a run (the seed optional, the name never)."""
    d = cfg.to_dict()
    d["variant"] = _canonical_variant(cfg.variant)
    d.pop("name", None)
    d.pop("slurm", None)  # where a run executes does not change what it computes
    if not with_seed:
        d["train"] = {k: v for k, v in d["train"].items() if k != "seed"}
    blob = json.dumps(d, sort_keys=True, default=str).encode()
    return hashlib.sha1(blob).hexdigest()[:8]


def run_id(cfg: RunConfig) -> str:
    """A stable, readable id: the variant, a short config hash and the seed, e.g. ``ldm-rls_groups-4-3f2a9c1e-s0``."""
    import variants

    slug = re.sub(r"[^A-Za-z0-9.]+", "-", variants.canonical(cfg.variant)).strip("-")
    return f"{slug}-{config_hash(cfg)}-s{cfg.train.seed}"


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    atomic_write_json(Path(run_dir) / "config.json", cfg.to_dict())


def read_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / "config.json"
    try:
        data = read_json(path)
    except DamagedFile as e:
        raise UsageError(f"The run's {path} is damaged ({e.reason}); delete it and run the same command again "
                         "(training writes it anew, and the checkpoint's own copy of the config still guards the "
                         "resume).") from None
    if data is None:
        raise UsageError(f"{run_dir} holds no config.json: it is not a run directory.")
    if not isinstance(data, dict):
        raise UsageError(f"The run's {path} is damaged (it holds a {type(data).__name__}, not a mapping); delete it "
                         "and run the same command again.")
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
        if isinstance(record, dict) and isinstance(record.get("runs", []), list) \
                and all(isinstance(e, dict) and "run_id" in e for e in record.get("runs", [])):
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
    sys.stderr.write(f"depthmem: warning: {sweep_dir / 'sweep.json'} is damaged ({reason}); the {len(runs)} "
                     f"run(s) are listed from their folders, and the next submission writes it anew.\n")
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


def _git_revision() -> str | None:
    try:
        root = Path(__file__).resolve().parent.parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5)
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
    return {"packages": versions, "python": platform.python_version(), "git_revision": _git_revision(),
            "host": socket.gethostname(), "platform": platform.platform(), "devices": devices,
            "time": now_iso(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}


def write_env(run_dir: Path) -> dict[str, Any]:
    env = environment()
    atomic_write_json(Path(run_dir) / "env.json", env)
    return env

