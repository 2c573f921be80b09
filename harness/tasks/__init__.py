"""The offline benchmark suite: lm-eval task YAMLs in this folder that read real validation data from disk.

Each task mirrors the semantics of lm-eval's stock task of the same benchmark (prompt, choices, metrics) but
loads its documents through a ``custom_dataset`` loader in ``harness.tasks.offline`` instead of the Hugging Face
hub, so it runs on a cluster node without network access. Task names carry the ``offline_`` prefix so they never
clash with lm-eval's own names, and the group ``offline`` runs the default suite.
"""

from __future__ import annotations

import logging
from pathlib import Path

TASKS_DIR = Path(__file__).resolve().parent
"""The folder to hand to ``lm_eval.tasks.TaskManager(include_path=...)`` or ``lm-eval --include_path``."""

SUITE = "offline"
"""The group that runs every task of the default suite."""

SUITE_TASKS: tuple[str, ...] = (
    "offline_arc_easy", "offline_arc_challenge", "offline_hellaswag", "offline_piqa", "offline_winogrande",
    "offline_openbookqa", "offline_boolq", "offline_copa", "offline_lambada_openai", "offline_shakespeare",
)

# Not in the default suite: SciQ's license (CC BY-NC 3.0) forbids commercial use, so it runs only when named.
OPT_IN_TASKS: tuple[str, ...] = ("offline_sciq",)

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
