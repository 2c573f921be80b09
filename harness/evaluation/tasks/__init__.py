"""The offline benchmark suite: lm-eval task YAMLs in this folder that read real validation data from disk.

Each task mirrors the semantics of lm-eval's stock task of the same benchmark (prompt, choices, metrics) but
loads its documents through a ``custom_dataset`` loader in ``harness.evaluation.tasks.offline`` instead of the
Hugging Face hub, so it runs on a cluster node without network access. Task names carry the ``offline_`` prefix
so they never clash with lm-eval's own names, and the group ``offline`` runs the default suite.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml

TASKS_DIR = Path(__file__).resolve().parent
"""The folder to hand to ``lm_eval.tasks.TaskManager(include_path=...)`` or ``lm-eval --include_path``."""

SUITE = "offline"
"""The group that runs every task of the default suite."""


def _read_task_yaml(path: Path) -> dict:
    # lm-eval's YAMLs carry ``!function`` tags; only names and metadata are read here, so tags stay strings.
    loader = type("_TaskYamlLoader", (yaml.SafeLoader,), {})
    loader.add_constructor("!function", lambda ld, node: ld.construct_scalar(node))
    return yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}


def _discover() -> tuple[dict[str, dict], tuple[str, ...]]:
    # The task YAMLs are the one place a task is declared: its name, its loader and (in ``metadata``) its data
    # and expected document count; the group file says which tasks the default suite runs.
    tasks = {}
    for path in sorted(TASKS_DIR.glob("offline_*.yaml")):
        cfg = _read_task_yaml(path)
        tasks[cfg["task"]] = dict(cfg.get("metadata") or {}, file=path.name)
    suite = tuple(_read_task_yaml(TASKS_DIR / f"{SUITE}.yaml")["task"])
    return tasks, suite


TASKS, SUITE_TASKS = _discover()
"""Every offline task (name -> its metadata) and those the default suite runs, from the YAMLs in this folder."""

# Tasks outside the group run only when named: SciQ's license (CC BY-NC 3.0) forbids commercial use.
OPT_IN_TASKS: tuple[str, ...] = tuple(name for name in TASKS if name not in SUITE_TASKS)

KNOWN_NAMES: tuple[str, ...] = (SUITE, *SUITE_TASKS, *OPT_IN_TASKS)


def is_offline_name(name: str) -> bool:
    """Whether ``name`` is the suite or one of its tasks (as opposed to a stock lm-eval task)."""
    return name in KNOWN_NAMES


class _DropCustomDatasetHint(logging.Filter):
    # lm-eval warns, for every task with a custom loader, that loader settings can come from --metadata; the
    # offline tasks need none, so the warning would only be noise in every evaluation log.
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("offline_") and "Custom kwargs can be passed" in message)


logging.getLogger("lm_eval.api.task").addFilter(_DropCustomDatasetHint())
