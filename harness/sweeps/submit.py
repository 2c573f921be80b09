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

import contextlib
import dataclasses
import functools
import shutil
import subprocess
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import preflight, tracking, units
from harness.errors import DepthmemError, UsageError
from harness.io import atomic_write_json, remove_stale_temps, writable_dir
from harness.rundir import now_iso, read_status, read_sweep_record, write_config, write_status
from harness.sweeps.grid import Grid, GridRun, axis_keys, check_tune, expand, load_grid
from harness.sweeps.job import RunJob, pending_tasks
from harness.sweeps.jobstate import default_root, format_rows, run_rows, stop_local, sweep_status
from harness.sweeps.profiles import EXECUTORS, Profile, load_profile
from harness.training.budget import tokens_per_step, train_steps

LOCAL_RUNS_WITHOUT_ASKING = 4
"""Most runs of a cluster grid (a profile with ``executor: slurm``) that run on this machine without ``--yes``."""


class SweepLocked(DepthmemError):
    """Another submission of the same sweep holds its lock."""


class SweepInterrupted(DepthmemError):
    """Ctrl-C stopped a local sweep; its runs are marked interrupted and resume on the next submission."""

    exit_code = 130


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
    """run_id -> ``submit``, ``resume``, ``evaluate``, ``done``, ``queued``, ``failed`` (skipped), ``retry`` or
    ``waiting`` (for its cell's tuning runs)."""
    warnings: list[str] = field(default_factory=list)
    axes: list[str] = field(default_factory=list)
    backfill: list[str] = field(default_factory=list)
    """Finished runs whose ``train.logger`` has not seen their metrics; the submission sends them from metrics.csv."""
    tuning: Plan | None = None
    """The tuning stage of a grid with ``tune``: its runs live in ``<sweep>/tune/``."""
    selection: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The tuning stage's entry per cell, as ``tuning.json`` holds it."""

    @property
    def waiting(self) -> list[GridRun]:
        """Runs that wait for their cell's tuning to end: their learning rate, and so their id, is not known yet."""
        return [r for r in self.runs if self.decisions.get(r.run_id) == "waiting"]

    def to_submit(self) -> list[GridRun]:
        return [r for r in self.runs if self.decisions.get(r.run_id) in ("submit", "resume", "retry", "evaluate")]


def _check_corpus(runs: list[GridRun]) -> list[str]:
    missing = sorted(
        {r.cfg.data.corpus for r in runs if r.cfg.data.corpus != "shakespeare" and not Path(r.cfg.data.corpus).exists()}
    )
    return [f"the corpus {c} does not exist yet: build it with `depthmem prepare` before submitting." for c in missing]


def _slurm_partitions() -> list[str]:
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise DepthmemError(f"No SLURM controller answers: sinfo failed ({e}).") from None
    if out.returncode != 0:
        first = (out.stderr.strip() or out.stdout.strip() or "no output").splitlines()[0]
        raise DepthmemError(
            f"No SLURM controller answers (sinfo: {first}); start it, or run here with --executor local."
        )
    return [p.strip().rstrip("*") for p in out.stdout.split() if p.strip()]


def check_executor(executor: str, profile: Profile) -> None:
    """Fail before submitting when the executor cannot run here or the profile names an unknown partition."""
    if executor not in EXECUTORS:
        raise UsageError(f"Unknown executor {executor!r}; allowed: {', '.join(EXECUTORS)}.")
    if executor != "slurm":
        return
    if shutil.which("sbatch") is None:
        raise UsageError(
            "--executor slurm needs sbatch on PATH and there is none here; use --executor local to run on this machine."
        )
    if profile.partition:
        partitions = _slurm_partitions()
        if profile.partition not in partitions:
            raise UsageError(
                f"Unknown partition {profile.partition!r} in the profile {profile.name!r}; "
                f"this cluster has {', '.join(partitions) or 'no partitions'}."
            )


def plan(
    grid_file: str | Path,
    *,
    executor: str | None = None,
    profile: str | None = None,
    root: str | Path | None = None,
    retry_failed: bool = False,
    parallelism: int | None = None,
    overrides: list[str] | None = None,
) -> Plan:
    """Expand and validate a grid and decide, run by run, what a submission would do (submits nothing).

    ``overrides`` (``["train.max_steps=200"]``) change the grid's base. Reading the runs' states records, as
    failed or cancelled, runs whose jobs were stopped from outside.
    """
    if executor is not None and executor not in EXECUTORS:
        raise UsageError(f"Unknown executor {executor!r}; allowed: {', '.join(EXECUTORS)}.")
    grid = load_grid(grid_file)
    if overrides:
        apply_overrides(grid, overrides)
        check_tune(grid)
    prof = load_profile(profile or grid.profile)
    runs = expand(grid, defaults=prof.config_layer())
    sweep_dir = Path(root or default_root()) / grid.name
    executor = executor or prof.executor
    parallelism = parallelism or grid.parallelism or prof.array_parallelism
    tuning_plan, waiting, entries = None, [], {}
    ready = runs
    if grid.tune is not None:
        from harness.sweeps import tuning

        cell_list = tuning.cells(grid, runs)
        by_cell = tuning.expand_tuning(grid, cell_list, defaults=prof.config_layer())
        tune_runs = [r for rs in by_cell.values() for r in rs]
        tuning_plan = Plan(
            grid,
            tune_runs,
            prof,
            executor,
            sweep_dir / tuning.TUNE_DIR,
            parallelism=parallelism,
            axes=[*axis_keys(grid), grid.tune.axis, "data.eval_split"],
        )
        _decide(tuning_plan, retry_failed)
        entries = tuning.selection(grid, cell_list, by_cell, tuning_plan.sweep_dir)
        ready, waiting = tuning.apply(grid, runs, cell_list, entries)
    p = Plan(grid, ready, prof, executor, sweep_dir, parallelism=parallelism, axes=axis_keys(grid))
    p.tuning, p.selection = tuning_plan, entries
    p.warnings = _check_corpus(p.runs) + preflight.for_executor([r.cfg for r in p.runs], p.executor)
    _decide(p, retry_failed, [r for r in ready if not any(r is w for w in waiting)])
    p.decisions.update({r.run_id: "waiting" for r in waiting})
    return p


def _decide(p: Plan, retry_failed: bool, runs: list[GridRun] | None = None) -> None:
    """Each run's decision (of ``runs``, default all of the plan's) from its state on disk and its job's."""
    sweep_dir, runs = p.sweep_dir, p.runs if runs is None else runs
    states = {row["run_id"]: row for row in run_rows(sweep_dir, read_sweep_record(sweep_dir))}
    for r in runs:
        run_dir = sweep_dir / r.run_id
        row = states.get(r.run_id, {})
        state = row.get("state", "pending")
        if row.get("job_active"):
            p.decisions[r.run_id] = "queued"
        elif state == "done":
            todo = pending_tasks(run_dir, list(r.cfg.eval.tasks), r.cfg.eval.limit) if r.cfg.eval.tasks else []
            p.decisions[r.run_id] = "evaluate" if todo else "done"
            if tracking.needs_backfill(run_dir, r.cfg):
                p.backfill.append(r.run_id)
        elif state in ("failed", "diverged"):
            p.decisions[r.run_id] = "retry" if retry_failed else "failed"
        elif (run_dir / "ckpt" / "last.ckpt").exists():
            p.decisions[r.run_id] = "resume"
        else:
            p.decisions[r.run_id] = "submit"


def split_choices(text: str) -> list[str]:
    """The parts of ``text`` between commas outside brackets and quotes: ``1e-3,3e-3`` has two, ``[a,b]`` one."""
    parts, depth, quote, current = [], 0, "", ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        current += c
    return parts + [current]


def apply_overrides(grid: Grid, overrides: list[str]) -> None:
    """Apply command-line ``KEY=VALUE`` overrides to a grid, Hydra multirun style.

    ``KEY=VALUE`` sets KEY in the base, except on a key the grid varies, whose axis it narrows to that one value;
    ``KEY=V1,V2`` makes KEY an axis over the values (a new axis goes last; a grid's own keeps its place). A value
    holding a list is written in brackets, ``eval.tasks=[a,b]``, and one comma-separated string in quotes.
    """
    import yaml

    from harness.yamltext import load

    zipped = {k for g in grid.zips for k in g}
    for item in overrides:
        key, _, text = item.partition("=")
        key = key.strip()
        choices = split_choices(text)
        try:
            values = [load(part) if part.strip() else "" for part in choices]
        except yaml.YAMLError:
            raise UsageError(
                f"The value of {item!r} is not valid YAML: put brackets around a list and quotes around text "
                "with commas or colons."
            ) from None
        if key in zipped:
            raise UsageError(
                f"{key} varies in a zip group of {grid.source}; change its values there, or drop it from the group "
                f"to sweep it with {item!r}."
            )
        if len(values) > 1 or key in grid.axes:
            if len(values) != len({repr(v) for v in values}):
                raise UsageError(f"{item!r} names a value twice; each value of an axis gives one run.")
            grid.axes[key] = values
        else:
            grid.base = {**grid.base, key: values[0]}


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


def _executor(kind: str, folder: Path, prof: Profile, parallelism: int, name: str):
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


@dataclass
class Submission:
    """The outcome of ``sweep``: the plan, the submitit jobs by run id, and the final rows when it waited."""

    plan: Plan
    jobs: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)


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
    import filelock

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
    lock = filelock.FileLock(str(p.sweep_dir / ".sweep.lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        raise SweepLocked(
            f"The sweep {p.grid.name!r} is locked by another submission "
            f"({p.sweep_dir / '.sweep.lock'}); wait for it to finish or check "
            f"`depthmem status {p.grid.name}`."
        ) from None
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
        jobs: dict[str, Any] = {}
        if p.tuning is not None:
            tuned = _run_stage(p.tuning, lambda m: log(f"tuning stage: {m}"), wait, poll_s)
            jobs.update(tuned)
            if tuned and wait:
                p = replan()  # the tuning runs have ended: their cells' values can be chosen now
            _write_tuning(p, log)
        sub = Submission(p)
        jobs.update(_run_stage(p, log, wait, poll_s))
        sub.jobs = jobs
        sub.rows = sweep_status(p.sweep_dir)
        return sub
    finally:
        lock.release()


def _run_stage(p: Plan, log, wait: bool, poll_s: float) -> dict[str, Any]:
    """Submit one stage's unfinished runs (and with ``wait``, wait for them); returns their jobs by run id."""
    writable_dir(p.sweep_dir, "sweep folder")
    _announce(p, log)
    _backfill(p, log)
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
    record = _read_record(p)
    _save_record(p, record, {})
    if p.executor == "local" and wait:
        return _run_local_window(p, todo, record, log, poll_s)
    jobs = _submit_arrays(p, todo, record, log)
    if wait:
        _wait(p, jobs, poll_s)
    return jobs


def _write_tuning(p: Plan, log) -> None:
    """Write tuning.json and say which cells still wait for their tuning runs, and why."""
    from harness.sweeps import tuning

    tuning.write(p.sweep_dir, p.grid, p.selection)
    for entry in p.selection.values():
        if entry["tuned"] and entry["state"] == "chosen":
            edge = f" (at the {entry['edge']} value tried)" if entry["at_edge"] else ""
            log(f"tuning stage: {entry['cell']}: {p.grid.tune.axis}={entry['chosen']:g}{edge}")
    blocked = [e for e in p.selection.values() if e["tuned"] and e["state"] != "chosen"]
    for entry in blocked:
        log(f"tuning stage: {entry['cell']} has no {p.grid.tune.axis} yet: {entry['reason']}")
    if p.waiting:
        log(
            f"{len(p.waiting)} run(s) wait for their tuning runs to end; `depthmem sweep {p.grid.source}` "
            "submits them then, redoing nothing that has finished"
        )


def _backfill(p: Plan, log) -> None:
    """Send finished runs' metrics to a logger switched on after they trained, from their metrics.csv."""
    if not p.backfill:
        return
    logger = {r.run_id: r.cfg.train.logger for r in p.runs}
    for r in p.runs:
        if r.run_id in p.backfill:
            run_dir = p.sweep_dir / r.run_id
            tracking.backfill(run_dir, r.cfg)
            write_config(run_dir, r.cfg)  # the run's config now names the logger that holds its curves
    names = sorted({logger[rid] for rid in p.backfill})
    where = {"tensorboard": "TensorBoard (each run's tensorboard/ folder)", "wandb": "W&B"}
    log(
        f"sent the metrics of {len(p.backfill)} finished run(s) to {' and '.join(where[n] for n in names)} "
        "from their metrics.csv; nothing was trained again"
    )


def _announce(p: Plan, log) -> None:
    groups: dict[str, list[str]] = {}
    for rid, decision in p.decisions.items():
        groups.setdefault(decision, []).append(rid)
    if groups.get("done"):
        log(f"skipping {len(groups['done'])} finished run(s): {', '.join(groups['done'])}")
    if groups.get("queued"):
        log(f"skipping {len(groups['queued'])} run(s) still queued or running: {', '.join(groups['queued'])}")
    if groups.get("failed"):
        log(
            f"skipping {len(groups['failed'])} failed run(s) (rerun them with --retry-failed): "
            f"{', '.join(groups['failed'])}"
        )
    for what, label in (
        ("resume", "resuming from their last checkpoint"),
        ("retry", "retrying"),
        ("evaluate", "evaluating on the tasks they have no result of"),
        ("submit", "starting"),
    ):
        if groups.get(what):
            log(f"{label}: {len(groups[what])} run(s)")
    if not p.to_submit():
        log("nothing to submit.")


def _read_record(p: Plan) -> dict[str, Any]:
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
        runs.append(entry)
    # Runs dropped from the grid since an earlier submission stay listed while their directories exist.
    current = {r.run_id for r in known}
    runs += [e for rid, e in old.items() if rid not in current and (p.sweep_dir / e.get("run_dir", rid)).is_dir()]
    record.update(name=p.grid.name, grid=str(p.grid.source), axes=p.axes, runs=runs, updated=now_iso())
    record.setdefault("created", now_iso())
    record.setdefault("submissions", [])
    return record


def _save_record(p: Plan, record: dict[str, Any], jobs: dict[str, Any]) -> None:
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


def _submit_arrays(p: Plan, todo: list[GridRun], record: dict[str, Any], log) -> dict[str, Any]:
    """One job array per distinct resource request, each with the sweep's parallelism limit."""
    jobs: dict[str, Any] = {}
    groups: dict[tuple, list[GridRun]] = {}
    for r in todo:
        groups.setdefault(_resource_key(r), []).append(r)
    for runs in groups.values():
        ex = _executor(p.executor, p.sweep_dir / "jobs", _profile_for(p.profile, runs[0]), p.parallelism, p.grid.name)
        # batch() packs the submissions into one array while each task keeps its own checkpointable callable
        # (map_array would share one function, and requeueing needs the callable's checkpoint method).
        try:
            with _own_process_groups(), ex.batch():
                submitted = [ex.submit(RunJob(p.sweep_dir / r.run_id)) for r in runs]
        except Exception as e:  # sbatch refused the array: no run of it will ever start
            reason = f"the scheduler refused the job: {_refusal(e)}"
            for r in runs:
                write_status(p.sweep_dir / r.run_id, "failed", message=reason)
            _save_record(p, record, jobs)
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
    _save_record(p, record, jobs)
    return jobs


def _note_job(run_dir: Path, job_id: str) -> None:
    write_status(run_dir, read_status(run_dir).get("state", "pending"), job_id=job_id)


def _id_span(ids: list[str]) -> str:
    return ids[0] if len(ids) == 1 else f"{ids[0]} .. {ids[-1]}"


def _run_local_window(p: Plan, todo: list[GridRun], record: dict[str, Any], log, poll_s: float) -> dict[str, Any]:
    """Local runs, at most ``parallelism`` at a time: the local executor has no array throttle of its own.

    Ctrl-C stops the running ones (their whole process groups), marks them interrupted and leaves the ones not
    yet started pending; the same command resumes both.
    """
    ex = _executor("local", p.sweep_dir / "jobs", p.profile, p.parallelism, p.grid.name)
    pending, running, jobs = list(todo), {}, {}
    try:
        while pending or running:
            while pending and len(running) < p.parallelism:
                r = pending.pop(0)
                with _own_process_groups():
                    job = ex.submit(RunJob(p.sweep_dir / r.run_id))
                jobs[r.run_id] = running[r.run_id] = job
                _note_job(p.sweep_dir / r.run_id, str(job.job_id))
                _save_record(p, record, jobs)
                log(f"started {r.run_id} (local job {job.job_id})")
            time.sleep(poll_s if running else 0)
            for rid, job in list(running.items()):
                if job.done():
                    del running[rid]
                    row = next(
                        x
                        for x in run_rows(
                            p.sweep_dir,
                            {"runs": [e for e in record["runs"] if e["run_id"] == rid], "grid": record.get("grid", "")},
                        )
                    )
                    log(f"{row['state']}: {rid}" + (f" ({row['reason']})" if row.get("reason") else ""))
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


def _wait(p: Plan, jobs: dict[str, Any], poll_s: float) -> None:
    while True:
        rows = {r["run_id"]: r for r in sweep_status(p.sweep_dir)}
        if not any(rows.get(rid, {}).get("job_active") for rid in jobs):
            return
        time.sleep(poll_s)


def describe_plan(p: Plan) -> str:
    """The dry-run text: every run with its grid values and decision, then the resources each job asks for."""

    lines = _describe_tuning(p) if p.tuning is not None else []
    tuned = p.grid.tune is not None
    lr_column = [p.grid.tune.axis] if tuned else []
    rows = [
        {
            "run_id": r.run_id,
            **{k: r.overrides.get(k, "") for k in p.axes},
            **({lr_column[0]: f"{r.cfg.train.lr:g}"} if tuned else {}),
            "action": p.decisions.get(r.run_id),
            "steps": train_steps(r.cfg),
            "tokens": train_steps(r.cfg) * tokens_per_step(r.cfg),
        }
        for r in p.runs
    ]
    for row in rows:
        if row["action"] == "waiting":
            row.update(action="after tuning", **({lr_column[0]: "(tuned)"} if tuned else {}))
    # The columns in the order ``depthmem status`` shows them: id, grid values, what happens, then the budget.
    shown = [{**row, "tokens": units.tokens(row["tokens"])} for row in rows]
    stage = "main stage: " if tuned else ""
    lines += [
        f"{stage}sweep {p.grid.name}: {len(p.runs)} run(s) in {p.sweep_dir}",
        format_rows(shown, ["run_id", *p.axes, *lr_column, "action", "steps", "tokens"]),
    ]
    budgets = sorted({(row["steps"], row["tokens"]) for row in rows})
    if len(budgets) == 1:
        lines.append(f"budget: every run trains {budgets[0][0]:,} steps on {budgets[0][1]:,} tokens")
    else:
        lines.append(
            f"budget: the runs train on {len(budgets)} different budgets, from {budgets[0][1]:,} to "
            f"{budgets[-1][1]:,} tokens (the grid varies the budget or the model size)"
        )
    pr = p.profile
    res = (
        f"resources ({p.executor}, profile {pr.name}): partition={pr.partition or '(default)'} "
        f"account={pr.account or '-'} qos={pr.qos or '-'} time={pr.time_min}min nodes={pr.nodes} "
        f"tasks_per_node={pr.tasks_per_node} gpus_per_node={pr.gpus_per_node} cpus_per_task={pr.cpus_per_task} "
        f"mem={pr.mem_gb:g}GB; {len(p.to_submit())} job(s) as an array, at most {p.parallelism} at a time"
    )
    lines.append(res)
    if pr.setup:
        lines.append("setup: " + "; ".join(pr.setup))
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.sweeps.estimate import describe_costs

    lines.append(describe_costs(p.runs, pr))
    if p.tuning is not None:
        lines.append(_both_stages(p))
    if p.backfill:
        loggers = sorted({r.cfg.train.logger for r in p.runs if r.run_id in p.backfill})
        lines.append(
            f"{len(p.backfill)} finished run(s) never sent their metrics to {' or '.join(loggers)}: "
            "a submission sends them from each run's metrics.csv and config, training nothing again"
        )
    lines += [f"warning: {w}" for w in p.warnings]
    return "\n".join(lines)


def _describe_tuning(p: Plan) -> list[str]:
    """The dry run's tuning block: the protocol, each tuning run with its decision, their cost and the choices."""
    from harness.sweeps.estimate import describe_costs

    t, tp = p.grid.tune, p.tuning
    assert t is not None and tp is not None
    tuned = [e for e in p.selection.values() if e["tuned"]]
    seeds = f"seeds {', '.join(map(str, t.seeds))}" if t.seeds else "1 seed (each cell's first)"
    rows = [
        {
            "run_id": r.run_id,
            **{k: r.overrides.get(k, "") for k in tp.axes},
            "action": tp.decisions.get(r.run_id),
            "steps": train_steps(r.cfg),
            "tokens": units.tokens(train_steps(r.cfg) * tokens_per_step(r.cfg)),
        }
        for r in tp.runs
    ]
    lines = [
        f"tuning stage: {len(tp.runs)} run(s) in {tp.sweep_dir}: {len(tuned)} cell(s) x {len(t.values)} value(s) "
        f"of {t.axis} ({', '.join(f'{v:g}' for v in t.values)}) x {seeds}, each validated on the tuning split "
        f"(data.eval_split=tune) and judged on its final {t.metric}; a cell's runs start once its tuning has ended",
        format_rows(rows, ["run_id", *tp.axes, "action", "steps", "tokens"]),
        describe_costs(tp.runs, p.profile),
    ]
    inherit = [e for e in p.selection.values() if not e["tuned"]]
    for entry in tuned:
        chosen = "not chosen yet" if entry["chosen"] is None else f"{entry['chosen']:g}"
        edge = f" (at the {entry['edge']} value tried)" if entry["at_edge"] else ""
        lines.append(f"tuning: {entry['cell']}: {t.axis} {chosen}{edge}")
    for entry in inherit:
        where = f"the choice of {entry['from']}" if entry.get("from") else "the base value (not tuned)"
        lines.append(f"tuning: {entry['cell']}: {t.axis} from {where}")
    return lines


def _both_stages(p: Plan) -> str:
    """One line that adds the tuning stage's cost to the main runs'."""
    from harness.sweeps.estimate import sweep_cost

    assert p.tuning is not None
    pr = p.profile
    tune = sweep_cost([r.cfg for r in p.tuning.runs], peak_tflops=pr.gpu_peak_tflops, utilisation=pr.utilisation)
    main = sweep_cost([r.cfg for r in p.runs], peak_tflops=pr.gpu_peak_tflops, utilisation=pr.utilisation)

    def total(costs, key):
        return sum(c[key] for c in costs)

    return (
        f"with tuning: {len(tune)} tuning run(s) ({units.tokens(total(tune, 'tokens'))} tokens, "
        f"{units.gpu_time(total(tune, 'gpu_hours'))}) + {len(main)} main run(s) "
        f"({units.tokens(total(main, 'tokens'))} tokens, {units.gpu_time(total(main, 'gpu_hours'))}) = "
        f"{units.tokens(total(tune, 'tokens') + total(main, 'tokens'))} tokens, "
        f"{units.gpu_time(total(tune, 'gpu_hours') + total(main, 'gpu_hours'))}"
    )


__all__ = [
    "Plan",
    "Submission",
    "SweepLocked",
    "SweepInterrupted",
    "plan",
    "sweep",
    "check_executor",
    "describe_plan",
    "default_root",
]
