"""depthmem: a benchmarking and ablation harness for depth mixing in transformers.

The Python API comes first and the ``depthmem`` command is a thin layer over it; a notebook can call the same
functions. Heavy modules load on first use, so ``import harness`` stays fast.
"""

from __future__ import annotations

from harness.config import ModelConfig, RunConfig, build_config, load_config, model_preset
from harness.errors import DepthmemError, RunFailed, UsageError
from harness.factory import build_model

__version__ = "0.1.0"

__all__ = [
    "ModelConfig", "RunConfig", "build_config", "load_config", "model_preset", "build_model",
    "DepthmemError", "UsageError", "RunFailed",
]
