"""Which config keys a sweep's runs differ in, and the column each becomes: the axes of every table and figure.

A key that differs between runs is an axis (``lr`` for ``train.lr``), except the run's identity (variant, seed),
where it lives (cache folders, loggers, the cluster section) and the keys a tuning stage chose per variant, which
are part of each variant's protocol rather than a setting the runs are compared across.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.reporting.archive import FolderSource, open_source

# Config keys that never change what a run computes, so they never split runs into different settings.
IGNORED_KEYS = ("name", "variant", "train.seed", "data.cache_dir", "eval.batch_size", "train.logger")
IGNORED_PREFIXES = ("slurm.",)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value
    return out


# Column names of the tidy frame that an axis column must not take.
_RESERVED = {
    "run_id",
    "run_dir",
    "setting",
    "variant",
    "base",
    "knobs",
    "preset",
    "seed",
    "state",
    "source",
    "task",
    "step",
    "tokens",
    "metric",
    "value",
    "stderr",
    "train_tokens",
    "train_steps",
    "counted",
    "message",
}


def axis_column_names(keys: list[str]) -> dict[str, str]:
    """Column name per differing config key: its last part (``lr``), or the whole key where that is ambiguous."""
    short = [k.rsplit(".", 1)[-1] for k in keys]
    out = {}
    for key, name in zip(keys, short):
        if short.count(name) > 1 or name in _RESERVED or name.startswith("knob_"):
            name = key.replace(".", "_")
        if name in _RESERVED:  # train.tokens, which the budget columns already name
            name = f"axis_{name}"
        out[name] = key
    return out


def tuned_keys(root: str | Path | FolderSource) -> set[str]:
    """The config keys a tuning stage chose per variant (``tuning.json`` of any sweep under ``root``, a sweep folder,
    archive or its source): part of each variant's protocol, not a setting the runs are compared across."""
    source = root if isinstance(root, FolderSource) else open_source(root)
    keys = set()
    for rel in source.find("tuning.json"):
        try:
            data = json.loads(source.read_bytes(rel))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("axis"), str):
            keys.add(data["axis"])
    return keys
