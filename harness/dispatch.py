"""The sweep API under its earlier module name: profiles, the submitted job, submission and job state now live in
``harness.profiles``, ``harness.job``, ``harness.submit`` and ``harness.jobstate``."""

from __future__ import annotations

from harness.job import RunJob
from harness.jobstate import cancel, default_root, format_rows, resolve_sweep_dir, sweep_status
from harness.profiles import Profile, load_profile
from harness.submit import Plan, Submission, SweepLocked, check_executor, describe_plan, plan, sweep

__all__ = ["Profile", "RunJob", "Plan", "Submission", "SweepLocked", "load_profile", "plan", "sweep",
           "sweep_status", "cancel", "resolve_sweep_dir", "describe_plan", "format_rows", "check_executor",
           "default_root"]
