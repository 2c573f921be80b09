"""Running a sweep's jobs through submitit: SLURM job arrays, or a window of local runs, and the sweep's record.

Local runs each get a process group of their own, so Ctrl-C stops them with everything they started and marks them
interrupted; the same command resumes them. ``sweep.json`` lists the runs with their latest job ids and one entry
per submission.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import types
from pathlib import Path
from typing import Any

from harness.errors import DepthmemError, UsageError
from harness.io import atomic_write_json
from harness.rundir import now_iso, read_status, read_sweep_record, write_status
from harness.sweeps.announce import progress_line
from harness.sweeps.grid import GridRun
from harness.sweeps.job import RunJob
from harness.sweeps.jobstate import run_rows, stop_local, sweep_status, touch_sweep_process
from harness.sweeps.planning import Plan
from harness.sweeps.profiles import Profile


class SweepInterrupted(DepthmemError):
    """Ctrl-C stopped a local sweep; its runs are marked interrupted and resume on the next submission."""

    exit_code = 130


@contextlib.contextmanager
def _own_process_groups():
    """Start submitit's local controllers in sessions of their own, so that a run and the processes it starts
    (DDP workers) form one group that can be stopped as a whole, and Ctrl-C in the terminal reaches only the
    sweep, which then stops them in order."""
    import submitit.local.local as local

    real = local.subprocess
    local.subprocess = types.SimpleNamespace(Popen=functools.partial(real.Popen, start_new_session=True))
    try:
        yield
    finally:
        local.subprocess = real


def make_executor(kind: str, folder: Path, prof: Profile, parallelism: int, name: str):
    import submitit

    params: dict[str, Any] = dict(
        name=f"depthmem-{name}", timeout_min=prof.time_min, cpus_per_task=prof.cpus_per_task, mem_gb=float(prof.mem_gb)
    )
    if prof.gpus_per_node:  # on a CPU-only cluster a GPU request of 0 is still a gres request: leave it out
        params["gpus_per_node"] = prof.gpus_per_node
    if kind == "slurm":
        setup = list(prof.setup)
        # SLURM 22.05's srun does not pass --cpus-per-task on to the tasks it starts.
        if not any("SRUN_CPUS_PER_TASK" in line for line in setup):
            setup.insert(0, "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK")
        params.update(
            nodes=prof.nodes,
            tasks_per_node=prof.tasks_per_node,
            slurm_setup=setup,
            slurm_array_parallelism=parallelism,
            slurm_signal_delay_s=prof.signal_delay_s,
        )
        for key in ("partition", "account", "qos"):
            if getattr(prof, key):
                params[f"slurm_{key}"] = getattr(prof, key)
        if prof.additional:
            params["slurm_additional_parameters"] = dict(prof.additional)
    else:
        # One local process per run: Lightning itself starts the DDP workers that train.devices asks for. The
        # profile's setup lines are for cluster nodes (modules, SLURM variables), so they are not run here.
        params.update(nodes=1, tasks_per_node=1)
    if kind == "slurm":
        from harness.sbatch import check_values

        try:
            check_values({"folder": str(folder), **params}, "the job setting")
        except ValueError as e:
            raise UsageError(f"{str(e)[0].upper()}{str(e)[1:]}.") from None
    ex = submitit.AutoExecutor(folder=str(folder), cluster=kind, slurm_max_num_timeout=prof.max_requeues)
    ex.update_parameters(**params)
    return ex


def _resource_key(r: GridRun) -> tuple:
    s = r.cfg.slurm
    return (
        s.partition,
        s.account,
        s.qos,
        s.time_min,
        s.nodes,
        s.tasks_per_node,
        s.gpus_per_node,
        s.cpus_per_task,
        s.mem_gb,
        tuple(s.setup),
    )


def _profile_for(base: Profile, r: GridRun) -> Profile:
    """The base profile with the run's own ``slurm`` settings (a grid may override resources per run)."""
    s = r.cfg.slurm
    return dataclasses.replace(
        base,
        partition=s.partition,
        account=s.account,
        qos=s.qos,
        time_min=s.time_min,
        nodes=s.nodes,
        tasks_per_node=s.tasks_per_node,
        gpus_per_node=s.gpus_per_node,
        cpus_per_task=s.cpus_per_task,
        mem_gb=s.mem_gb,
        setup=list(s.setup),
    )


def read_record(p: Plan) -> dict[str, Any]:
    record = read_sweep_record(p.sweep_dir)
    old = {r["run_id"]: r for r in record.get("runs", [])}
    runs, todo = [], {r.run_id for r in p.to_submit()}
    # A run waiting for its tuning has no id yet: it is recorded once its learning rate is chosen.
    known = [r for r in p.runs if p.decisions.get(r.run_id) != "waiting"]
    for r in known:
        entry = dict(old.get(r.run_id, {}))
        if r.run_id in todo:
            # Until its new job exists the run has none: the old job's end must not read as this run failing.
            for key in ("job_id", "executor", "submitted"):
                entry.pop(key, None)
        entry.update(run_id=r.run_id, run_dir=r.run_id, variant=r.cfg.variant, overrides=r.overrides)
        entry.pop("superseded", None)
        runs.append(entry)
    # Runs dropped from the grid since an earlier submission (its base or values changed) stay listed while their
    # directories exist, marked, so that status can tell an earlier generation from the runs the grid holds now.
    current = {r.run_id for r in known}
    runs += [
        {**e, "superseded": True}
        for rid, e in old.items()
        if rid not in current and (p.sweep_dir / e.get("run_dir", rid)).is_dir()
    ]
    record.update(name=p.grid.name, grid=str(p.grid.source), axes=p.axes, runs=runs, updated=now_iso())
    record.setdefault("created", now_iso())
    record.setdefault("submissions", [])
    return record


def save_record(p: Plan, record: dict[str, Any], jobs: dict[str, Any]) -> None:
    """Write sweep.json with the runs' latest job ids and this submission's entry in ``submissions``."""
    if jobs:
        current = record.setdefault(
            "_current",
            {
                "time": now_iso(),
                "executor": p.executor,
                "profile": p.profile.name,
                "parallelism": p.parallelism,
                "job_ids": {},
            },
        )
        for entry in record["runs"]:
            if entry["run_id"] in jobs:
                job_id = str(jobs[entry["run_id"]].job_id)
                if entry.get("job_id") != job_id:
                    entry.update(job_id=job_id, executor=p.executor, submitted=now_iso())
                current["job_ids"][entry["run_id"]] = job_id
    out = {k: v for k, v in record.items() if k != "_current"}
    if "_current" in record:
        out["submissions"] = record["submissions"] + [record["_current"]]
    out["updated"] = now_iso()
    atomic_write_json(p.sweep_dir / "sweep.json", out)


def _refusal(e: BaseException) -> str:
    """The line of a failed sbatch call that says why."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower() and "sbatch" in ln.lower():
            return ln
    return lines[-1] if lines else type(e).__name__


def submit_arrays(p: Plan, todo: list[GridRun], record: dict[str, Any], log) -> dict[str, Any]:
    """One job array per distinct resource request, each with the sweep's parallelism limit."""
    jobs: dict[str, Any] = {}
    groups: dict[tuple, list[GridRun]] = {}
    for r in todo:
        groups.setdefault(_resource_key(r), []).append(r)
    for runs in groups.values():
        ex = make_executor(
            p.executor, p.sweep_dir / "jobs", _profile_for(p.profile, runs[0]), p.parallelism, p.grid.name
        )
        # batch() packs the submissions into one array while each task keeps its own checkpointable callable
        # (map_array would share one function, and requeueing needs the callable's checkpoint method).
        try:
            with _own_process_groups(), ex.batch():
                submitted = [ex.submit(RunJob(p.sweep_dir / r.run_id)) for r in runs]
        except Exception as e:  # sbatch refused the array: no run of it will ever start
            reason = f"the scheduler refused the job: {_refusal(e)}"
            for r in runs:
                write_status(p.sweep_dir / r.run_id, "failed", message=reason)
            save_record(p, record, jobs)
            raise DepthmemError(
                f"Submitting {len(runs)} run(s) of {p.grid.name} failed ({_refusal(e)}); they "
                f"are marked failed: fix the profile and run `depthmem sweep {p.grid.source} "
                "--retry-failed`."
            ) from None
        for r, job in zip(runs, submitted):
            jobs[r.run_id] = job
            _note_job(p.sweep_dir / r.run_id, str(job.job_id))
        if submitted:
            log(
                f"submitted {len(submitted)} run(s) to {p.executor} as job(s) "
                f"{_id_span([str(j.job_id) for j in submitted])}"
            )
    save_record(p, record, jobs)
    return jobs


def _note_job(run_dir: Path, job_id: str) -> None:
    write_status(run_dir, read_status(run_dir).get("state", "pending"), job_id=job_id)


def _id_span(ids: list[str]) -> str:
    return ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]}"


def run_local_window(p: Plan, todo: list[GridRun], record: dict[str, Any], log, poll_s: float) -> dict[str, Any]:
    """Local runs, at most ``parallelism`` at a time: the local executor has no array throttle of its own.

    Ctrl-C stops the running ones (their whole process groups), marks them interrupted and leaves the ones not
    yet started pending; the same command resumes both.
    """
    ex = make_executor("local", p.sweep_dir / "jobs", p.profile, p.parallelism, p.grid.name)
    pending, running, jobs = list(todo), {}, {}
    first_start, finished = time.monotonic(), 0
    try:
        while pending or running:
            while pending and len(running) < p.parallelism:
                r = pending.pop(0)
                with _own_process_groups():
                    job = ex.submit(RunJob(p.sweep_dir / r.run_id))
                jobs[r.run_id] = running[r.run_id] = job
                _note_job(p.sweep_dir / r.run_id, str(job.job_id))
                save_record(p, record, jobs)
                log(f"started {r.run_id} (local job {job.job_id})")
            time.sleep(poll_s if running else 0)
            touch_sweep_process(p.sweep_dir)
            for rid, job in list(running.items()):
                if job.done():
                    del running[rid]
                    finished += 1
                    row = next(
                        x
                        for x in run_rows(
                            p.sweep_dir,
                            {"runs": [e for e in record["runs"] if e["run_id"] == rid], "grid": record.get("grid", "")},
                        )
                    )
                    reason = f" ({row['reason']})" if row.get("reason") else ""
                    elapsed = time.monotonic() - first_start
                    progress = progress_line(finished, len(pending), len(running), p.parallelism, elapsed)
                    log(f"{row['state']}: {rid}{reason} {progress}")
    except KeyboardInterrupt:
        log(f"interrupted: stopping {len(running)} run(s) ...")
        stop_local([str(j.job_id) for j in running.values()], reap=lambda: [j.done() for j in running.values()])
        for rid in running:
            status = read_status(p.sweep_dir / rid)
            if status.get("state") not in ("done", "failed", "diverged"):
                step = status.get("ckpt_step") or 0
                write_status(
                    p.sweep_dir / rid,
                    "interrupted",
                    message=f"interrupted by Ctrl-C at step {status.get('step') or 0}; the last "
                    f"checkpoint is at step {step}",
                )
        for r in pending:
            write_status(p.sweep_dir / r.run_id, "pending", message="not started: the sweep was interrupted")
        raise SweepInterrupted(
            f"Interrupted: {len(running)} run(s) stopped and marked interrupted, {len(pending)} "
            f"not started; `depthmem sweep {p.grid.source}` resumes them."
        ) from None
    return jobs


def wait_for_jobs(p: Plan, jobs: dict[str, Any], poll_s: float) -> None:
    while True:
        rows = {r["run_id"]: r for r in sweep_status(p.sweep_dir)}
        if not any(rows.get(rid, {}).get("job_active") for rid in jobs):
            return
        time.sleep(poll_s)
