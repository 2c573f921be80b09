"""Dispatch a grid through submitit, locally or on SLURM, and report or cancel what it started.

``sweep(grid_file, executor="local"|"slurm", profile=...)`` expands and validates the grid, takes the sweep's
lock (a second submission of the same sweep fails at once), writes each run's ``config.json``, skips runs that
are finished or still queued, resumes unfinished ones from their last checkpoint, reruns failed ones only when
asked, and submits the rest as job arrays with a parallelism limit. The submitted callable, ``RunJob``, trains
and then evaluates one run; it is checkpointable, so a preempted or timed-out job is requeued and resumes.
``sweep_status`` merges each run's ``status.json`` with the scheduler's view (``sacct``, or the local process)
and submitit's result files, so a job killed from outside (``scancel``, out of memory) shows as failed with
the reason; ``cancel`` stops a sweep's queued and running jobs.

Layout: ``<root>/<sweep>/sweep.json`` (runs and job ids), ``<root>/<sweep>/<run_id>/`` (run directories) and
``<root>/<sweep>/jobs/`` (submitit's pickles and logs, one ``<job_id>_<task>_log.{out,err}`` pair per task).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import preflight
from harness.config import SlurmConfig, read_yaml
from harness.errors import DepthmemError, UsageError, did_you_mean
from harness.grid import Grid, GridRun, expand, load_grid
from harness.io import atomic_write_json, read_json, remove_stale_temps, writable_dir
from harness.rundir import (DAMAGED, now_iso, read_config, read_status, read_summary, read_sweep_record, write_config,
                            write_status)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
PROFILE_DIR = PROJECT_ROOT / "slurm" / "profiles"
EXECUTORS = ("local", "slurm")
# sacct states after which a job will not run again by itself.
TERMINAL = ("COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED", "REVOKED")


class SweepLocked(DepthmemError):
    """Another submission of the same sweep holds its lock."""


# -- resource profiles ------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class Profile(SlurmConfig):
    """Resources for every job of a sweep (``slurm/profiles/*.yaml``): a run's ``slurm`` section plus how the
    sweep is scheduled. ``tasks_per_node`` processes per node run DDP (train.devices follows it); ``setup``
    lines run in the job script before Python starts (modules, environment variables)."""

    name: str = "default"
    array_parallelism: int = 4
    """Most array tasks running at once."""
    signal_delay_s: int = 90
    """Seconds before the time limit at which the job is signalled to requeue itself."""
    max_requeues: int = 3
    """Most requeues after time limits (preemptions do not count)."""
    additional: dict[str, Any] = field(default_factory=dict)
    """Further sbatch options, e.g. ``{constraint: a100}``."""

    def __post_init__(self):
        for name in ("time_min", "nodes", "tasks_per_node", "cpus_per_task", "array_parallelism"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UsageError(f"The profile {self.name!r} needs {name} as a positive integer, "
                                 f"got {getattr(self, name)!r}.")
        if self.gpus_per_node < 0 or self.mem_gb <= 0 or self.signal_delay_s < 0 or self.max_requeues < 0:
            raise UsageError(f"The profile {self.name!r} needs gpus_per_node, signal_delay_s and max_requeues "
                             f"of zero or more, and a positive mem_gb.")

    def config_layer(self) -> dict[str, Any]:
        """The run-config settings this profile implies: its ``slurm`` section and the DDP layout."""
        slurm = {f.name: getattr(self, f.name) for f in dataclasses.fields(SlurmConfig)}
        slurm["setup"] = list(self.setup)
        return {"slurm": slurm, "train": {"devices": self.tasks_per_node, "num_nodes": self.nodes}}


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | None) -> Profile:
    """A profile by name (``slurm/profiles/NAME.yaml``) or by path; ``None`` gives the defaults."""
    if not name_or_path:
        return Profile()
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PROFILE_DIR / f"{path.stem if path.suffix in ('.yaml', '.yml') else name_or_path}.yaml"
    if not path.exists():
        known = profile_names()
        hint = did_you_mean(Path(str(name_or_path)).stem, known)
        raise UsageError(f"Unknown profile {name_or_path!r}.{hint} Known profiles: {', '.join(known) or 'none'} "
                         f"(in {PROFILE_DIR}), or give the path of a profile file.")
    data = read_yaml(path, "profile") or {}
    if not isinstance(data, dict):
        raise UsageError(f"The profile {path} must hold a mapping of resource settings.")
    known = [f.name for f in dataclasses.fields(Profile) if f.name != "name"]
    for key in data:
        if key not in known:
            raise UsageError(f"Unknown key {key!r} in the profile {path}.{did_you_mean(key, known)} Allowed keys: {', '.join(known)}.")
    data.setdefault("setup", [])
    if not isinstance(data["setup"], list):
        raise UsageError(f"setup in the profile {path} must be a list of shell lines.")
    return Profile(name=path.stem, **data)


# -- the submitted callable ---------------------------------------------------------------------------------
class RunJob:
    """Train one run, then evaluate it when it asks for tasks; requeued with the same run on preemption.

    It holds only the run directory: everything else is read from ``config.json`` in the job, and training
    resumes from ``ckpt/last.ckpt``, so the resubmitted callable needs no state of its own.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict[str, Any]:
        import submitit

        from harness.errors import RunFailed

        run_dir = Path(self.run_dir)
        cfg = read_config(run_dir)
        try:
            env = submitit.JobEnvironment()
            job_id, rank = env.job_id, env.global_rank
        except RuntimeError:  # called outside submitit (a plain function call): still a valid way to run
            job_id, rank = None, 0
        if rank == 0:
            before = read_status(run_dir)
            write_status(run_dir, "done" if before.get("state") == "done" else "running", message="",
                         job_id=job_id, node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                         attempts=int(before.get("attempts", 0)) + 1)
        import torch

        # The same thread count in every executor keeps CPU results identical between local and SLURM runs.
        torch.set_num_threads(max(1, cfg.slurm.cpus_per_task))
        from harness.training import train

        try:
            train(cfg, run_dir, resume=True)
            table = run_dir / "eval" / "table.csv"
            if rank == 0 and cfg.eval.tasks and not table.exists():
                from harness.evaluation import evaluate

                evaluate(run_dir, list(cfg.eval.tasks), limit=cfg.eval.limit, batch_size=cfg.eval.batch_size)
        except RunFailed:
            raise  # training already marked the run diverged or failed, with its reason
        except Exception as e:
            if rank == 0 and read_status(run_dir).get("state") not in ("failed", "diverged"):
                write_status(run_dir, "failed", message=f"{type(e).__name__}: {e}")
            raise
        return read_json(run_dir / "summary.json", default={}) or {}

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Requeue the same run: training picks up its last checkpoint when the job starts again."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(RunJob(self.run_dir))


# -- the sweep ----------------------------------------------------------------------------------------------
@dataclass
class Plan:
    """What a submission would do: the grid, its runs, resources, and a decision per run."""

    grid: Grid
    runs: list[GridRun]
    profile: Profile
    executor: str
    sweep_dir: Path
    parallelism: int
    decisions: dict[str, str] = field(default_factory=dict)
    """run_id -> ``submit``, ``resume``, ``done``, ``queued``, ``failed`` (skipped) or ``retry``."""
    warnings: list[str] = field(default_factory=list)

    def to_submit(self) -> list[GridRun]:
        return [r for r in self.runs if self.decisions.get(r.run_id) in ("submit", "resume", "retry", "evaluate")]


def default_root() -> Path:
    return Path(os.environ.get("DEPTHMEM_RESULTS", "results"))


def _check_corpus(runs: list[GridRun]) -> list[str]:
    missing = sorted({r.cfg.data.corpus for r in runs
                      if r.cfg.data.corpus != "shakespeare" and not Path(r.cfg.data.corpus).exists()})
    return [f"the corpus {c} does not exist yet: build it with `depthmem prepare` before submitting."
            for c in missing]


def _slurm_partitions() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DepthmemError(f"sinfo could not list the partitions: {e}.") from None
    if out.returncode != 0:
        raise DepthmemError(f"sinfo could not reach SLURM: {out.stderr.strip() or out.stdout.strip()}.")
    return [p.strip().rstrip("*") for p in out.stdout.split() if p.strip()]


def check_executor(executor: str, profile: Profile) -> None:
    """Fail before submitting when the executor cannot run here or the profile names an unknown partition."""
    if executor not in EXECUTORS:
        raise UsageError(f"Unknown executor {executor!r}; allowed: {', '.join(EXECUTORS)}.")
    if executor != "slurm":
        return
    if shutil.which("sbatch") is None:
        raise UsageError("--executor slurm needs sbatch on PATH and there is none here; "
                         "use --executor local to run on this machine.")
    if profile.partition:
        partitions = _slurm_partitions()
        if profile.partition not in partitions:
            raise UsageError(f"Unknown partition {profile.partition!r} in the profile {profile.name!r}; "
                             f"this cluster has {', '.join(partitions) or 'no partitions'}.")


def plan(grid_file: str | Path, *, executor: str = "local", profile: str | None = None,
         root: str | Path | None = None, retry_failed: bool = False, parallelism: int | None = None) -> Plan:
    """Expand and validate a grid and decide, run by run, what a submission would do (submits nothing).

    Reading the runs' states records, as failed, runs whose jobs were killed from outside.
    """
    if executor not in EXECUTORS:
        raise UsageError(f"Unknown executor {executor!r}; allowed: {', '.join(EXECUTORS)}.")
    grid = load_grid(grid_file)
    prof = load_profile(profile or grid.profile)
    runs = expand(grid, defaults=prof.config_layer())
    sweep_dir = Path(root or default_root()) / grid.name
    p = Plan(grid, runs, prof, executor, sweep_dir,
             parallelism=parallelism or grid.parallelism or prof.array_parallelism)
    p.warnings = _check_corpus(runs) + preflight.for_executor([r.cfg for r in runs], executor)
    states = {row["run_id"]: row for row in _run_rows(sweep_dir, read_sweep_record(sweep_dir))}
    for r in runs:
        row = states.get(r.run_id, {})
        state = row.get("state", "pending")
        run_dir = sweep_dir / r.run_id
        needs_eval = bool(r.cfg.eval.tasks) and not (run_dir / "eval" / "table.csv").exists()
        if row.get("job_active"):
            p.decisions[r.run_id] = "queued"
        elif state == "done":
            p.decisions[r.run_id] = "evaluate" if needs_eval else "done"
        elif state in ("failed", "diverged"):
            p.decisions[r.run_id] = "retry" if retry_failed else "failed"
        elif (run_dir / "ckpt" / "last.ckpt").exists():
            p.decisions[r.run_id] = "resume"
        else:
            p.decisions[r.run_id] = "submit"
    return p


def _executor(kind: str, folder: Path, prof: Profile, parallelism: int, name: str):
    import submitit

    ex = submitit.AutoExecutor(folder=str(folder), cluster=kind, slurm_max_num_timeout=prof.max_requeues)
    params: dict[str, Any] = dict(name=f"depthmem-{name}", timeout_min=prof.time_min, cpus_per_task=prof.cpus_per_task,
                                  mem_gb=float(prof.mem_gb))
    if prof.gpus_per_node:  # on a CPU-only cluster a GPU request of 0 is still a gres request: leave it out
        params["gpus_per_node"] = prof.gpus_per_node
    if kind == "slurm":
        setup = list(prof.setup)
        # SLURM 22.05's srun does not pass --cpus-per-task on to the tasks it starts.
        if not any("SRUN_CPUS_PER_TASK" in line for line in setup):
            setup.insert(0, "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK")
        params.update(nodes=prof.nodes, tasks_per_node=prof.tasks_per_node, slurm_setup=setup,
                      slurm_array_parallelism=parallelism, slurm_signal_delay_s=prof.signal_delay_s)
        for key in ("partition", "account", "qos"):
            if getattr(prof, key):
                params[f"slurm_{key}"] = getattr(prof, key)
        if prof.additional:
            params["slurm_additional_parameters"] = dict(prof.additional)
    else:
        # One local process per run: Lightning itself starts the DDP workers that train.devices asks for. The
        # profile's setup lines are for cluster nodes (modules, SLURM variables), so they are not run here.
        params.update(nodes=1, tasks_per_node=1)
    ex.update_parameters(**params)
    return ex


def _resource_key(r: GridRun) -> tuple:
    s = r.cfg.slurm
    return (s.partition, s.account, s.qos, s.time_min, s.nodes, s.tasks_per_node, s.gpus_per_node,
            s.cpus_per_task, s.mem_gb, tuple(s.setup))


def _profile_for(base: Profile, r: GridRun) -> Profile:
    """The base profile with the run's own ``slurm`` settings (a grid may override resources per run)."""
    s = r.cfg.slurm
    return dataclasses.replace(base, partition=s.partition, account=s.account, qos=s.qos, time_min=s.time_min,
                               nodes=s.nodes, tasks_per_node=s.tasks_per_node, gpus_per_node=s.gpus_per_node,
                               cpus_per_task=s.cpus_per_task, mem_gb=s.mem_gb, setup=list(s.setup))


@dataclass
class Submission:
    """The outcome of ``sweep``: the plan, the submitit jobs by run id, and the final rows when it waited."""

    plan: Plan
    jobs: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


def sweep(grid_file: str | Path, *, executor: str = "local", profile: str | None = None,
          root: str | Path | None = None, retry_failed: bool = False, wait: bool | None = None,
          parallelism: int | None = None, poll_s: float = 2.0, log=print) -> Submission:
    """Submit a grid's unfinished runs as job arrays; with ``wait`` (default: local only) block until they end."""
    import filelock

    p = plan(grid_file, executor=executor, profile=profile, root=root, retry_failed=retry_failed,
             parallelism=parallelism)
    if p.warnings:
        raise UsageError(f"Cannot submit {p.grid.source}: {p.warnings[0]}")
    check_executor(executor, p.profile)
    wait = (executor == "local") if wait is None else wait
    writable_dir(p.sweep_dir, "sweep folder")
    remove_stale_temps(p.sweep_dir)
    lock = filelock.FileLock(str(p.sweep_dir / ".sweep.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise SweepLocked(f"The sweep {p.grid.name!r} is locked by another submission "
                          f"({p.sweep_dir / '.sweep.lock'}); wait for it to finish or check "
                          f"`depthmem status {p.grid.name}`.") from None
    try:
        # The lock is held, so the decisions are made again now that no other submission can change them.
        p = plan(grid_file, executor=executor, profile=profile, root=root, retry_failed=retry_failed,
                 parallelism=parallelism)
        sub = Submission(p)
        _announce(p, log)
        todo = p.to_submit()
        for r in todo:
            run_dir = p.sweep_dir / r.run_id
            if p.decisions[r.run_id] != "evaluate":
                write_config(run_dir, r.cfg)
            if p.decisions[r.run_id] in ("submit", "retry"):
                write_status(run_dir, "pending", message="submitted", submitted=now_iso())
        record = _read_record(p)
        _save_record(p, record, {})
        if executor == "local" and wait:
            sub.jobs = _run_local_window(p, todo, record, log, poll_s)
        else:
            sub.jobs = _submit_arrays(p, todo, record, log)
            if wait:
                _wait(p, sub.jobs, poll_s)
        sub.rows = sweep_status(p.sweep_dir)
        return sub
    finally:
        lock.release()


def _announce(p: Plan, log) -> None:
    groups: dict[str, list[str]] = {}
    for rid, decision in p.decisions.items():
        groups.setdefault(decision, []).append(rid)
    if groups.get("done"):
        log(f"skipping {len(groups['done'])} finished run(s): {', '.join(groups['done'])}")
    if groups.get("queued"):
        log(f"skipping {len(groups['queued'])} run(s) still queued or running: {', '.join(groups['queued'])}")
    if groups.get("failed"):
        log(f"skipping {len(groups['failed'])} failed run(s) (rerun them with --retry-failed): "
            f"{', '.join(groups['failed'])}")
    for what, label in (("resume", "resuming from their last checkpoint"), ("retry", "retrying"),
                        ("evaluate", "evaluating"), ("submit", "starting")):
        if groups.get(what):
            log(f"{label}: {len(groups[what])} run(s)")
    if not p.to_submit():
        log("nothing to submit.")


def _read_record(p: Plan) -> dict[str, Any]:
    record = read_sweep_record(p.sweep_dir)
    old = {r["run_id"]: r for r in record.get("runs", [])}
    runs, todo = [], {r.run_id for r in p.to_submit()}
    for r in p.runs:
        entry = dict(old.get(r.run_id, {}))
        if r.run_id in todo:
            # Until its new job exists the run has none: the old job's end must not read as this run failing.
            for key in ("job_id", "executor", "submitted"):
                entry.pop(key, None)
        entry.update(run_id=r.run_id, run_dir=r.run_id, variant=r.cfg.variant, overrides=r.overrides)
        runs.append(entry)
    # Runs dropped from the grid since an earlier submission stay listed: their directories still exist.
    runs += [e for rid, e in old.items() if rid not in {r.run_id for r in p.runs}]
    record.update(name=p.grid.name, grid=str(p.grid.source), runs=runs, updated=now_iso())
    record.setdefault("created", now_iso())
    record.setdefault("submissions", [])
    return record


def _save_record(p: Plan, record: dict[str, Any], jobs: dict[str, Any]) -> None:
    """Write sweep.json with the runs' latest job ids and this submission's entry in ``submissions``."""
    if jobs:
        current = record.setdefault("_current", {"time": now_iso(), "executor": p.executor,
                                                 "profile": p.profile.name, "parallelism": p.parallelism,
                                                 "job_ids": {}})
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


def _submit_arrays(p: Plan, todo: list[GridRun], record: dict[str, Any], log) -> dict[str, Any]:
    """One job array per distinct resource request, each with the sweep's parallelism limit."""
    jobs: dict[str, Any] = {}
    groups: dict[tuple, list[GridRun]] = {}
    for r in todo:
        groups.setdefault(_resource_key(r), []).append(r)
    for runs in groups.values():
        ex = _executor(p.executor, p.sweep_dir / "jobs", _profile_for(p.profile, runs[0]), p.parallelism,
                       p.grid.name)
        # batch() packs the submissions into one array while each task keeps its own checkpointable callable
        # (map_array would share one function, and requeueing needs the callable's checkpoint method).
        with ex.batch():
            submitted = [ex.submit(RunJob(p.sweep_dir / r.run_id)) for r in runs]
        for r, job in zip(runs, submitted):
            jobs[r.run_id] = job
            _note_job(p.sweep_dir / r.run_id, str(job.job_id))
        if submitted:
            log(f"submitted {len(submitted)} run(s) to {p.executor} as job(s) "
                f"{_id_span([str(j.job_id) for j in submitted])}")
    _save_record(p, record, jobs)
    return jobs


def _note_job(run_dir: Path, job_id: str) -> None:
    write_status(run_dir, read_status(run_dir).get("state", "pending"), job_id=job_id)


def _id_span(ids: list[str]) -> str:
    return ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]}"


def _run_local_window(p: Plan, todo: list[GridRun], record: dict[str, Any], log, poll_s: float) -> dict[str, Any]:
    """Local runs, at most ``parallelism`` at a time: the local executor has no array throttle of its own."""
    ex = _executor("local", p.sweep_dir / "jobs", p.profile, p.parallelism, p.grid.name)
    pending, running, jobs = list(todo), {}, {}
    while pending or running:
        while pending and len(running) < p.parallelism:
            r = pending.pop(0)
            job = ex.submit(RunJob(p.sweep_dir / r.run_id))
            jobs[r.run_id] = running[r.run_id] = job
            _note_job(p.sweep_dir / r.run_id, str(job.job_id))
            _save_record(p, record, jobs)
            log(f"started {r.run_id} (local job {job.job_id})")
        time.sleep(poll_s if running else 0)
        for rid, job in list(running.items()):
            if job.done():
                del running[rid]
                row = _reconcile(p.sweep_dir, rid, str(job.job_id), "local")
                log(f"{row['state']}: {rid}" + (f" ({row['reason']})" if row.get("reason") else ""))
    return jobs


def _wait(p: Plan, jobs: dict[str, Any], poll_s: float) -> None:
    while True:
        rows = {r["run_id"]: r for r in sweep_status(p.sweep_dir)}
        if not any(rows.get(rid, {}).get("job_active") for rid in jobs):
            return
        time.sleep(poll_s)


# -- status and cancel --------------------------------------------------------------------------------------
def resolve_sweep_dir(sweep: str | Path, root: str | Path | None = None) -> Path:
    """The sweep folder from a sweep name under the results root, a grid file, or the folder itself."""
    root = Path(root or default_root())
    given = Path(sweep)
    if given.suffix in (".yaml", ".yml") and given.is_file():
        candidate = root / load_grid(given).name
    elif (given / "sweep.json").exists():
        candidate = given
    else:
        candidate = root / str(sweep)
    if not (candidate / "sweep.json").exists():
        known = sorted(d.name for d in root.glob("*") if (d / "sweep.json").exists()) if root.exists() else []
        raise UsageError(f"No sweep {str(sweep)!r} under {root}: submit it first with `depthmem sweep`. "
                         f"Known sweeps: {', '.join(known) or 'none'}.")
    return candidate


def _sacct(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """State, node and exit code per job id (``123`` or ``123_4``) from SLURM accounting."""
    if not job_ids or shutil.which("sacct") is None:
        return {}
    ids = sorted({j.split("_")[0] for j in job_ids})
    try:
        out = subprocess.run(["sacct", "-n", "-P", "-X", "-j", ",".join(ids), "-o", "JobID,State,NodeList,ExitCode"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    info: dict[str, dict[str, str]] = {}
    for line in out.stdout.splitlines():
        parts = line.split("|")
        if len(parts) < 4:
            continue
        jid, state, node, code = parts[:4]
        entry = {"state": state.split()[0] if state else "UNKNOWN", "detail": state, "node": node, "exit": code}
        if "[" in jid:  # a pending array range such as 12_[3-5%2]: every task in it is pending
            base, rng = jid.split("_[", 1)
            for part in rng.split("%")[0].rstrip("]").split(","):
                lo, _, hi = part.partition("-")
                for k in range(int(lo), int(hi or lo) + 1):
                    info[f"{base}_{k}"] = entry
        else:
            info[jid] = entry
    return info


def _local_alive(job_id: str) -> bool:
    try:
        os.kill(int(job_id), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    # A finished child that nobody waited for is a zombie, and a pid reused by another program is not our job.
    try:
        with open(f"/proc/{int(job_id)}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
        with open(f"/proc/{int(job_id)}/cmdline", "rb") as f:
            return b"submitit" in f.read()
    except OSError:
        return True


def _result_error(jobs_dir: Path, job_id: str) -> str | None:
    """The last line of the exception a job raised, from submitit's result pickle, if it raised one."""
    from submitit.core.utils import pickle_load

    path = jobs_dir / f"{job_id}_0_result.pkl"
    if not path.exists():
        return None
    try:
        outcome, value = pickle_load(path)
    except Exception:  # a pickle from another submitit version: fall back on the logs
        return None
    if outcome != "error":
        return None
    lines = [ln for ln in str(value).strip().splitlines() if ln.strip()]
    return lines[-1].strip() if lines else "the job raised an error"


def _log_tail(jobs_dir: Path, job_id: str) -> str | None:
    """The most telling line of a job's stderr: an error, a SLURM kill notice, or its last line."""
    path = jobs_dir / f"{job_id}_0_log.err"
    if not path.exists():
        return None
    lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "CANCELLED" in ln or "DUE TO TIME LIMIT" in ln or "oom" in ln.lower() or "Error" in ln:
            return ln
    return lines[-1] if lines else None


def _reconcile(sweep_dir: Path, rid: str, job_id: str | None, executor: str | None,
               sacct: dict[str, dict[str, str]] | None = None) -> dict[str, Any]:
    """A run's row: its status.json, corrected by the scheduler when its job ended without finishing it."""
    run_dir = sweep_dir / rid
    status = read_status(run_dir)
    state = status.get("state", "pending")
    failed = state in ("failed", "diverged", DAMAGED)
    row = {"run_id": rid, "state": state, "step": status.get("step"), "loss": status.get("last_loss"),
           "job_id": job_id or status.get("job_id"), "node": status.get("node"),
           "reason": (status.get("message") or "") if failed else "", "message": status.get("message") or "",
           "attempts": status.get("attempts"), "job_active": False, "job_state": None}
    if not job_id:
        return row
    if executor == "slurm":
        info = (sacct if sacct is not None else _sacct([job_id])).get(job_id)
        if info is None:
            row["job_state"] = "UNKNOWN"
            row["job_active"] = state in ("pending", "running")  # not yet in accounting: just submitted
            return row
        row["job_state"], row["job_active"] = info["state"], info["state"] not in TERMINAL
        if info.get("node") and info["node"] != "None assigned":
            row["node"] = row["node"] or info["node"]
        ended_because = info["detail"]
    else:
        row["job_active"] = _local_alive(job_id)
        row["job_state"] = "RUNNING" if row["job_active"] else "ENDED"
        ended_because = "the local process ended"
    if row["job_active"] or state in ("done", "failed", "diverged", DAMAGED):
        if state in ("failed", "diverged") and not row["job_active"]:
            row["reason"] = row["reason"] or _result_error(sweep_dir / "jobs", job_id) \
                or _log_tail(sweep_dir / "jobs", job_id) or ""
            if row["job_state"] not in (None, "COMPLETED", "FAILED", "ENDED"):
                # Killed from outside (scancel, time limit, memory): the scheduler's word comes first.
                row["reason"] = f"job {job_id} {ended_because}: {row['reason']}".rstrip(": ")
        return row
    # The job is over but the run never reached a final state: it was killed from outside.
    reason = _result_error(sweep_dir / "jobs", job_id)
    if reason is None:
        reason = f"job {job_id} ended without finishing the run ({ended_because})"
        tail = _log_tail(sweep_dir / "jobs", job_id)
        if tail and "CANCELLED" not in ended_because:
            reason += f": {tail}"
    write_status(run_dir, "failed", message=reason)
    row.update(state="failed", reason=reason)
    return row


def _run_rows(sweep_dir: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    entries = record.get("runs", [])
    slurm_ids = [e["job_id"] for e in entries if e.get("job_id") and e.get("executor") == "slurm"]
    sacct = _sacct(slurm_ids) if slurm_ids else {}
    rows = []
    for e in entries:
        row = _reconcile(sweep_dir, e["run_id"], e.get("job_id"), e.get("executor"), sacct)
        row["variant"] = e.get("variant", "")
        summary = read_summary(sweep_dir / e["run_id"])
        for key in ("val_loss", "val_bpb", "params", "tokens_per_s"):
            row[key] = summary.get(key)
        rows.append(row)
    return rows


def sweep_status(sweep: str | Path, root: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per run: state, step, last loss, job id, node, the reason a failed run failed, final numbers."""
    sweep_dir = resolve_sweep_dir(sweep, root)
    return _run_rows(sweep_dir, read_sweep_record(sweep_dir))


def cancel(sweep: str | Path, root: str | Path | None = None) -> list[str]:
    """Cancel every queued or running job of a sweep and mark its runs failed; returns the cancelled run ids."""
    sweep_dir = resolve_sweep_dir(sweep, root)
    record = read_sweep_record(sweep_dir)
    stopped: list[tuple[str, str, str]] = []
    for row in _run_rows(sweep_dir, record):
        if not row["job_active"]:
            continue
        entry = next(e for e in record["runs"] if e["run_id"] == row["run_id"])
        if entry.get("executor") == "slurm":
            subprocess.run(["scancel", str(row["job_id"])], capture_output=True, text=True, timeout=30)
        else:
            # The local job id is the pid of the controller submitit started for this run; it forwards the
            # interrupt to the run's process.
            try:
                os.kill(int(row["job_id"]), signal.SIGINT)
            except ProcessLookupError:
                pass
        stopped.append((row["run_id"], str(row["job_id"]), entry.get("executor") or "local"))
    # A stopping run writes its own last status; wait for local ones so the cancellation is the final word.
    deadline = time.time() + 15
    while time.time() < deadline and any(ex == "local" and _local_alive(j) for _, j, ex in stopped):
        time.sleep(0.2)
    for rid, _, _ in stopped:
        write_status(sweep_dir / rid, "failed", message=f"cancelled by depthmem cancel ({now_iso()})")
    return [rid for rid, _, _ in stopped]


def format_rows(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain text table of the given columns (blank for missing values)."""
    import pandas as pd

    if not rows:
        return "(no runs)"
    frame = pd.DataFrame([{c: row.get(c) for c in columns} for row in rows], columns=columns)
    return frame.to_string(index=False, na_rep="", float_format=lambda v: f"{v:.4g}")


def describe_plan(p: Plan) -> str:
    """The dry-run text: every run with its decision, then the resources each job asks for."""
    keys = []
    for r in p.runs:
        keys += [k for k in r.overrides if k not in keys]
    from harness.budget import train_steps, tokens_per_step

    rows = [{"run_id": r.run_id, **{k: r.overrides.get(k, "") for k in keys}, "steps": train_steps(r.cfg),
             "tokens": train_steps(r.cfg) * tokens_per_step(r.cfg), "action": p.decisions.get(r.run_id)}
            for r in p.runs]
    lines = [f"sweep {p.grid.name}: {len(p.runs)} run(s) in {p.sweep_dir}",
             format_rows(rows, ["run_id", *keys, "steps", "tokens", "action"])]
    budgets = sorted({(row["steps"], row["tokens"]) for row in rows})
    if len(budgets) == 1:
        lines.append(f"budget: every run trains {budgets[0][0]:,} steps on {budgets[0][1]:,} tokens")
    else:
        lines.append(f"budget: the runs train on {len(budgets)} different budgets, from {budgets[0][1]:,} to "
                     f"{budgets[-1][1]:,} tokens (the grid varies the budget or the model size)")
    pr = p.profile
    res = (f"resources ({p.executor}, profile {pr.name}): partition={pr.partition or '(default)'} "
           f"account={pr.account or '-'} qos={pr.qos or '-'} time={pr.time_min}min nodes={pr.nodes} "
           f"tasks_per_node={pr.tasks_per_node} gpus_per_node={pr.gpus_per_node} cpus_per_task={pr.cpus_per_task} "
           f"mem={pr.mem_gb:g}GB; {len(p.to_submit())} job(s) as an array, at most {p.parallelism} at a time")
    lines.append(res)
    if pr.setup:
        lines.append("setup: " + "; ".join(pr.setup))
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


__all__ = ["Profile", "RunJob", "Plan", "Submission", "SweepLocked", "load_profile", "plan", "sweep",
           "sweep_status", "cancel", "resolve_sweep_dir", "describe_plan", "format_rows", "check_executor"]
