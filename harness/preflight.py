"""Checks of the machine a run will use, made before any work: settings that are valid in themselves but cannot
run where they are sent (a GPU accelerator on a node without one, a SLURM partition the cluster does not have).

``here(cfg)`` lists what stops a run on this machine; ``on_slurm(cfgs, partitions)`` what stops runs submitted
to a cluster with the given partitions. Each problem is one sentence; the callers decide whether it is an error
(``train``, a submission) or a warning (a dry run).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from collections.abc import Iterable

from harness.config import RunConfig

GPU_NAMES = ("gpu", "cuda")
_PACKAGES = {
    "tpu": "torch_xla",
    "transformer-engine": "transformer_engine",
    "transformer-engine-float16": "transformer_engine",
}
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""The package each ``train.logger`` other than csv writes through."""


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def here(cfg: RunConfig) -> list[str]:
    """What stops ``cfg`` from training on this machine."""
    import torch

    t, problems = cfg.train, []
    if t.accelerator in GPU_NAMES:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            problems.append(
                f"train.accelerator={t.accelerator} but this machine has no CUDA GPU; use "
                "train.accelerator=auto (or cpu), or run it where there is one."
            )
        elif t.devices > count:
            problems.append(f"train.devices={t.devices} but this machine has {count} CUDA GPU(s).")
    elif t.accelerator == "mps" and not torch.backends.mps.is_available():
        problems.append("train.accelerator=mps but this machine has no Apple GPU; use train.accelerator=auto.")
    for name in (t.accelerator, str(t.precision)):
        if name in _PACKAGES and not _has(_PACKAGES[name]):
            what = "train.accelerator" if name == t.accelerator else "train.precision"
            problems.append(f"{what}={name} needs the package {_PACKAGES[name]}, which is not installed here.")
    package = LOGGER_PACKAGES.get(t.logger)
    if package and not _has(package):
        problems.append(
            f"train.logger={t.logger} needs the package {package}, which is not installed here: install it "
            f"(pip install {package}) or use train.logger=csv."
        )
    return problems


def on_slurm(cfgs: Iterable[RunConfig], partitions: list[str] | None) -> list[str]:
    """What stops runs submitted to SLURM: unknown partitions (``partitions`` None: not checked) and GPU runs
    that ask the scheduler for no GPU."""
    problems: list[str] = []
    unknown: dict[str, int] = {}
    gpu_without_gres = 0
    for cfg in cfgs:
        part = cfg.slurm.partition
        if partitions is not None and part and part not in partitions:
            unknown[part] = unknown.get(part, 0) + 1
        if cfg.train.accelerator in GPU_NAMES and cfg.slurm.gpus_per_node < 1:
            gpu_without_gres += 1
    for part, n in unknown.items():
        problems.append(
            f"Unknown partition {part!r} (slurm.partition of {n} run(s)); this cluster has "
            f"{', '.join(partitions or []) or 'no partitions'}."
        )
    if gpu_without_gres:
        problems.append(
            f"{gpu_without_gres} run(s) set train.accelerator to a GPU but request no GPU "
            "(slurm.gpus_per_node is 0): set gpus_per_node in the profile or the grid."
        )
    return problems


def slurm_partitions() -> list[str] | None:
    """The cluster's partitions from ``sinfo``, or None when there is no reachable SLURM here."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [p.strip().rstrip("*") for p in out.stdout.split() if p.strip()]


def for_executor(cfgs: list[RunConfig], executor: str) -> list[str]:
    """What stops these runs under ``executor``: this machine's checks for local runs, the cluster's for SLURM."""
    if executor == "slurm":
        return on_slurm(cfgs, slurm_partitions())
    # Runs differ in many keys but few in these: check each distinct setting once.
    seen: dict[tuple, RunConfig] = {}
    for cfg in cfgs:
        seen.setdefault((cfg.train.accelerator, str(cfg.train.precision), cfg.train.devices, cfg.train.logger), cfg)
    return list(dict.fromkeys(msg for cfg in seen.values() for msg in here(cfg)))
