"""depthmem: a benchmarking and ablation harness for depth mixing in transformers.

The Python API comes first and the ``depthmem`` command is a thin layer over it; a notebook can call the same
functions. Heavy modules (Lightning, lm-eval, seaborn, submitit) load on first use, so ``import harness`` stays fast::

    import harness
    cfg = harness.build_config({"variant": "ldm-rls", "model": {"preset": "tiny"}}, ["train.max_steps=100"])
    run_dir = harness.train(cfg, "results/demo/ldm-rls")
    harness.evaluate(run_dir, ["offline_arc_easy"], limit=100)
    frame = harness.aggregate("results/demo")
"""

from __future__ import annotations

import importlib

from harness.config import ModelConfig, RunConfig, build_config, load_config, model_preset
from harness.errors import DepthmemError, RunFailed, UsageError

__version__ = "0.2.0"

# name -> module that defines it; resolved on first attribute access (PEP 562).
_LAZY = {
    "build_model": "harness.model.factory",
    "train": "harness.training.trainer",
    "load_model": "harness.model.checkpoint",
    "get_tokenizer": "harness.data.corpus",
    "prepare": "harness.data.shards",
    "evaluate": "harness.evaluation.evaluator",
    "sweep": "harness.sweeps.submit",
    "expand_grid": "harness.sweeps.grid",
    "aggregate": "harness.reporting.results",
    "report": "harness.reporting.report",
    "compare_sweeps": "harness.reporting.compare",
    "pack": "harness.reporting.archive",
    "bench": "harness.benchmarks.benchmark",
    "cost_table": "harness.model.costs",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'harness' has no attribute {name!r}")


__all__ = [
    "ModelConfig",
    "RunConfig",
    "build_config",
    "load_config",
    "model_preset",
    "DepthmemError",
    "UsageError",
    "RunFailed",
    *_LAZY,
]
