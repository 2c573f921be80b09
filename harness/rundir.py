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
from harness.io import atomic_write_json, read_json

STATES = ("pending", "running", "done", "failed", "diverged")
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
    data = read_json(path)
    if data is None:
        raise UsageError(f"{run_dir} holds no config.json: it is not a run directory.")
    return build_config(data, source=str(path))


def read_status(run_dir: Path) -> dict[str, Any]:
    return read_json(Path(run_dir) / "status.json", default={"state": "pending"})


def write_status(run_dir: Path, state: str, **fields: Any) -> dict[str, Any]:
    """Update status.json, keeping earlier fields (job id, node) that this call does not change."""
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    status = read_status(run_dir)
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

