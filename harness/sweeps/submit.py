"""Planning and submitting a sweep through submitit, locally or as SLURM job arrays.

``sweep(grid_file, executor="local"|"slurm", profile=...)`` expands and validates the grid, takes the sweep's
lock (a second submission of the same sweep fails at once), writes each run's ``config.json``, skips runs that
are finished or still queued, resumes interrupted and cancelled ones from their last checkpoint, evaluates a
finished run only on the tasks it has no result of, reruns failed ones only when asked, and submits the rest as
job arrays with a parallelism limit. Without ``executor`` the profile decides (``executor: slurm`` in a cluster
profile). Local runs each get a process group of their own, so Ctrl-C stops them with everything they started and
marks them interrupted; the same command resumes them.

Layout: ``<root>/<sweep>/sweep.json`` (runs, their grid values and job ids), ``<root>/<sweep>/<run_id>/`` (run
directories) and ``<root>/<sweep>/jobs/`` (submitit's files and logs, one ``<job_id>_<task>_log.{out,err}`` pair
per task).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import DepthmemError, UsageError
from harness.io import remove_stale_temps, writable_dir
from harness.rundir import now_iso, read_status, write_config, write_status
from harness.sweeps.announce import announce_plan, backfill_trackers, write_tuning
from harness.sweeps.execute import read_record, run_local_window, save_record, submit_arrays, wait_for_jobs
from harness.sweeps.jobstate import forget_sweep_process, record_sweep_process, sweep_status
from harness.sweeps.planning import Plan, check_executor, plan

LOCAL_RUNS_WITHOUT_ASKING = 4
"""Most runs of a cluster grid (a profile with ``executor: slurm``) that run on this machine without ``--yes``."""


class SweepLocked(DepthmemError):
    """Another submission of the same sweep holds its lock."""


@dataclass
class Submission:
    """The outcome of ``sweep``: the plan, the submitit jobs by run id, and the final rows when it waited."""

    plan: Plan
    jobs: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


def _take_lock(p: Plan):
    """The sweep's lock, held; another submission of the same sweep holding it is refused at once."""
    import filelock

    lock = filelock.FileLock(str(p.sweep_dir / ".sweep.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise SweepLocked(
            f"The sweep {p.grid.name!r} is locked by another submission "
            f"({p.sweep_dir / '.sweep.lock'}); wait for it to finish or check "
            f"`depthmem status {p.grid.name}`."
        ) from None
    return lock


def sweep(
    grid_file: str | Path,
    *,
    executor: str | None = None,
    profile: str | None = None,
    root: str | Path | None = None,
    retry_failed: bool = False,
    wait: bool | None = None,
    parallelism: int | None = None,
    poll_s: float = 2.0,
    log=print,
    yes: bool = False,
    overrides: list[str] | None = None,
) -> Submission:
    """Submit a grid's unfinished runs as job arrays; with ``wait`` (default: local only) block until they end.

    A cluster grid (its profile says ``executor: slurm``) run here with more than a handful of runs needs
    ``yes=True``: the machine would train them all.
    """
    p = plan(
        grid_file,
        executor=executor,
        profile=profile,
        root=root,
        retry_failed=retry_failed,
        parallelism=parallelism,
        overrides=overrides,
    )
    if p.warnings:
        raise UsageError(f"Cannot submit {p.grid.source}: {p.warnings[0]}")
    check_executor(p.executor, p.profile)
    todo_count = len(p.to_submit()) + (len(p.tuning.to_submit()) if p.tuning else 0)
    if p.executor == "local" and p.profile.executor == "slurm" and todo_count > LOCAL_RUNS_WITHOUT_ASKING and not yes:
        raise UsageError(
            f"{p.grid.source} is a cluster grid (profile {p.profile.name!r}) and {todo_count} runs "
            f"would train on this machine; add --yes to run them here, or drop --executor local."
        )
    wait = (p.executor == "local") if wait is None else wait
    writable_dir(p.sweep_dir, "sweep folder")
    remove_stale_temps(p.sweep_dir)
    lock = _take_lock(p)
    try:
        # The lock is held, so the decisions are made again now that no other submission can change them.
        replan = functools.partial(
            plan,
            grid_file,
            executor=p.executor,
            profile=profile,
            root=root,
            retry_failed=retry_failed,
            parallelism=parallelism,
            overrides=overrides,
        )
        p = replan()
        if p.executor == "local" and wait:
            # Runs not started yet have no job of their own: status tells by this record whether they will start.
            record_sweep_process(p.sweep_dir)
        jobs: dict[str, Any] = {}
        if p.tuning is not None:
            tuned = _run_stage(p.tuning, lambda m: log(f"tuning stage: {m}"), wait, poll_s)
            jobs.update(tuned)
            if tuned and wait:
                p = replan()  # the tuning runs have ended: their cells' values can be chosen now
            write_tuning(p, log)
        sub = Submission(p)
        jobs.update(_run_stage(p, log, wait, poll_s))
        sub.jobs = jobs
        sub.rows = sweep_status(p.sweep_dir)
        return sub
    finally:
        forget_sweep_process(p.sweep_dir)
        lock.release()


def _run_stage(p: Plan, log, wait: bool, poll_s: float) -> dict[str, Any]:
    """Submit one stage's unfinished runs (and with ``wait``, wait for them); returns their jobs by run id."""
    writable_dir(p.sweep_dir, "sweep folder")
    announce_plan(p, log)
    backfill_trackers(p, log)
    todo = p.to_submit()
    for r in todo:
        run_dir = p.sweep_dir / r.run_id
        write_config(run_dir, r.cfg)  # evaluation settings may have changed since it trained
        decision = p.decisions[r.run_id]
        if decision in ("submit", "retry"):
            write_status(run_dir, "pending", message="submitted", submitted=now_iso(), cancelled=None)
        elif decision == "resume":
            step = read_status(run_dir).get("ckpt_step") or 0
            write_status(
                run_dir,
                "pending",
                message=f"submitted; resumes from step {step}",
                submitted=now_iso(),
                cancelled=None,
            )
    record = read_record(p)
    save_record(p, record, {})
    if p.executor == "local" and wait:
        return run_local_window(p, todo, record, log, poll_s)
    jobs = submit_arrays(p, todo, record, log)
    if wait:
        wait_for_jobs(p, jobs, poll_s)
    return jobs


__all__ = ["Submission", "SweepLocked", "sweep"]
