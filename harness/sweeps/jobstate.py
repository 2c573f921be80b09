"""The state of a sweep's jobs: each run's own ``status.json`` reconciled with the scheduler, and cancelling.

A run's row starts from what the run wrote (state, step, the step of its last checkpoint, its message) and is
corrected by what the scheduler knows: submitit's ``SlurmInfoWatcher`` (one ``sacct`` call for the whole sweep)
on SLURM, the job's process on this machine. So a job killed from outside shows as failed or cancelled with the
scheduler's reason, and a requeued job waiting to restart shows as ``requeued`` with the step it resumes from.
A run a local sweep has not started yet has no job: it waits for the sweep's own process (recorded in
``sweep-process.json``), and shows as ``orphaned`` once that process is gone. Every row carries the command that
moves it on (``advice``). Nothing here unpickles a file: the harness keeps what it needs in its own JSON, so
reading a results folder from elsewhere cannot run code.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from harness.errors import UsageError
from harness.io import DamagedFile, DiskFull, atomic_write_json, read_json
from harness.rundir import DAMAGED, axis_label, now_iso, read_status, read_summary, read_sweep_record, write_status
from harness.sweeps.grid import grid_name
from harness.sweeps.tuning import TUNE_DIR

# sacct states after which a job will not run again by itself.
TERMINAL = (
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "REVOKED",
)
# sacct states of a job that ran, was stopped, and waits to start again.
REQUEUE_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED")
STOP_GRACE_S = 30.0
"""Seconds a stopped local run has to write its checkpoint before its process group is killed."""
SWEEP_PROCESS = "sweep-process.json"
"""In a sweep folder while a local sweep starts its runs one window at a time: that process's pid, host and start
time. Runs it has not started yet have no job of their own; when it is gone, nothing will start them."""
HEARTBEAT_STALE_S = 300.0
"""A sweep process on another host, whose pid cannot be checked from here, counts as gone once its record has not
been touched for this long (it touches it at every poll)."""


def default_root() -> Path:
    return Path(os.environ.get("DEPTHMEM_RESULTS", "results"))


def resolve_sweep_dir(sweep: str | Path, root: str | Path | None = None) -> Path:
    """The sweep folder from a sweep name under the results root, a grid file, or the folder itself."""
    root = Path(root or default_root())
    given = Path(sweep)
    if given.suffix in (".yaml", ".yml") and given.is_file():
        candidate = root / grid_name(given)
    elif (given / "sweep.json").exists():
        candidate = given
    else:
        candidate = root / str(sweep)
    if not (candidate / "sweep.json").exists():
        known = sorted(d.name for d in root.glob("*") if (d / "sweep.json").exists()) if root.exists() else []
        raise UsageError(
            f"No sweep {str(sweep)!r} under {root}: submit it first with `depthmem sweep`. "
            f"Known sweeps: {', '.join(known) or 'none'}."
        )
    return candidate


def slurm_info(job_ids: list[str]) -> dict[str, dict[str, str]]:
    """State (first word), its full text (``CANCELLED by 1000``) and node per job id (``123`` or ``123_4``),
    from submitit's view of SLURM accounting: one ``sacct`` call for all of them."""
    if not job_ids:
        return {}
    from submitit.slurm.slurm import SlurmInfoWatcher

    watcher = SlurmInfoWatcher(delay_s=0)
    for job_id in job_ids:
        watcher.register_job(str(job_id))
    try:
        watcher.update()  # submitit logs and bypasses a failing sacct: the states then stay unknown
    except OSError:
        return {}
    info = {}
    for job_id in job_ids:
        entry = watcher.get_info(str(job_id), mode="cache")
        if entry.get("State"):
            state = entry["State"]
            info[str(job_id)] = {"state": state.split()[0], "detail": state, "node": entry.get("NodeList", "")}
    return info


def local_alive(job_id: str) -> bool:
    """Whether the local job (the pid of submitit's controller) still runs."""
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


def _start_ticks(pid: int) -> str | None:
    """When the process started (clock ticks since boot): with the pid, what tells it from a later process that
    was given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _process_file(sweep_dir: Path) -> Path:
    # A tuning stage's runs live in a folder inside the sweep's; the sweep's one process starts both.
    sweep_dir = Path(sweep_dir)
    parent = sweep_dir.parent
    if sweep_dir.name == TUNE_DIR and ((parent / SWEEP_PROCESS).exists() or (parent / "sweep.json").exists()):
        return parent / SWEEP_PROCESS
    return sweep_dir / SWEEP_PROCESS


def record_sweep_process(sweep_dir: Path) -> Path:
    """Record this process as the one that starts the sweep's local runs."""
    return atomic_write_json(
        _process_file(sweep_dir),
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_ticks": _start_ticks(os.getpid()),
            "started": now_iso(),
        },
    )


def touch_sweep_process(sweep_dir: Path) -> None:
    """Show that the recorded sweep process still lives, for a reader on another host."""
    try:
        os.utime(_process_file(sweep_dir))
    except OSError:
        pass  # removed, or a file system that refuses: the pid check on this host does not need it


def forget_sweep_process(sweep_dir: Path) -> None:
    """Remove the record, if it is this process's: its runs have all been started or stopped."""
    path = _process_file(sweep_dir)
    try:
        if (read_json(path) or {}).get("pid") == os.getpid():
            path.unlink()
    except (DamagedFile, OSError, AttributeError):
        pass


def sweep_process(sweep_dir: Path) -> dict[str, Any] | None:
    """The recorded local sweep process of ``sweep_dir`` with ``alive`` set, or None when none is recorded."""
    path = _process_file(sweep_dir)
    try:
        record = read_json(path)
        touched = path.stat().st_mtime
    except (DamagedFile, OSError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return None
    pid = record["pid"]
    if record.get("host") != socket.gethostname():
        alive = time.time() - touched < HEARTBEAT_STALE_S
    else:
        try:
            os.kill(pid, 0)
            alive = record.get("start_ticks") in (None, _start_ticks(pid))
        except ProcessLookupError:
            alive = False
        except PermissionError:
            alive = True
    return {**record, "alive": alive}


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # Members that are all zombies have stopped; only their parent's wait is missing.
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                return True
    return False


def stop_local(job_ids: list[str], grace_s: float = STOP_GRACE_S, reap=None) -> None:
    """Stop local jobs and everything they started: SIGTERM to each job's process group (training saves a
    checkpoint at the end of its step), then SIGKILL to whatever is left after ``grace_s``.

    A sweep starts each local job in its own session, so its group holds the controller, the run and any DDP
    workers. ``reap`` is called while waiting, so a parent can collect its finished children.
    """
    groups = []
    for job_id in job_ids:
        pid = int(job_id)
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGTERM)
                groups.append(pid)
            else:  # started without a group of its own: the controller forwards the signal to its tasks
                os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.time() + grace_s
    while time.time() < deadline and (any(group_alive(g) for g in groups) or any(local_alive(j) for j in job_ids)):
        if reap is not None:
            reap()
        time.sleep(0.1)
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    if reap is not None:
        reap()


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


def advice(state: str, grid: str, resume_step: int | None) -> str:
    """The command that moves a run in ``state`` on, for the sweep of the grid file ``grid``."""
    grid = grid or "GRID"
    if state in ("failed", "diverged"):
        return f"depthmem sweep {grid} --retry-failed"
    if state in ("interrupted", "cancelled", "orphaned"):
        return f"depthmem sweep {grid}" + (f" (resumes from step {resume_step})" if resume_step else "")
    if state == "requeued":
        return "none: SLURM restarts it"
    return ""


def _fill_job_state(row: dict, state: str, job_id: str | None, executor: str | None, info) -> str:
    """Set the row's job state, whether the job is active, and its node; returns the scheduler's word on the job."""
    if job_id and executor == "slurm":
        job = (info if info is not None else slurm_info([job_id])).get(str(job_id))
        if job is None:
            row["job_state"] = "UNKNOWN"
            row["job_active"] = state in ("pending", "running")  # not yet in accounting: just submitted
        else:
            row["job_state"], row["job_active"] = job["state"], job["state"] not in TERMINAL
            if job.get("node") and job["node"] != "None assigned":
                row["node"] = row["node"] or job["node"]
        return job["detail"] if job else "UNKNOWN"
    if job_id:
        row["job_active"] = local_alive(job_id)
        row["job_state"] = "RUNNING" if row["job_active"] else "ENDED"
        return "the local process ended"
    return ""


def reconcile(
    sweep_dir: Path,
    rid: str,
    job_id: str | None,
    executor: str | None,
    info: dict[str, dict[str, str]] | None = None,
    grid: str = "",
) -> dict[str, Any]:
    """A run's row: its status.json, corrected by the scheduler when its job ended without finishing it."""
    run_dir = sweep_dir / rid
    status = read_status(run_dir)
    state = status.get("state", "pending")
    resume_step = status.get("ckpt_step")
    row = {
        "run_id": rid,
        "state": state,
        "step": status.get("step"),
        "loss": status.get("last_loss"),
        "job_id": job_id or status.get("job_id"),
        "node": status.get("node"),
        "reason": (status.get("message") or "")
        if state in ("failed", "diverged", "interrupted", "cancelled", DAMAGED)
        else "",
        "message": status.get("message") or "",
        "attempts": status.get("attempts"),
        "resume_step": resume_step,
        "total_steps": status.get("total_steps"),
        "eta_s": status.get("eta_s"),
        "job_active": False,
        "job_state": None,
    }
    cancelled = status.get("cancelled")
    detail = _fill_job_state(row, state, job_id, executor, info)
    if row["job_active"]:
        started_before = bool(status.get("attempts")) or state not in ("pending",)
        if executor == "slurm" and row["job_state"] in REQUEUE_STATES and started_before and state != "done":
            row["state"] = "requeued"
            row["reason"] = (
                f"job {job_id} was stopped and is {detail.lower()} to restart; it resumes from step {resume_step or 0}"
            )
    elif job_id or cancelled:
        new_state, reason = state, row["reason"]
        if cancelled and state != "done":
            new_state, reason = "cancelled", cancelled
        elif executor == "slurm" and row["job_state"] == "CANCELLED" and state != "done":
            new_state, reason = "cancelled", f"job {job_id} {detail} (scancel)"
        elif executor == "slurm" and row["job_state"] == "PREEMPTED" and state != "done":
            new_state, reason = "interrupted", f"job {job_id} was preempted"
        elif state in ("pending", "running"):
            # The job is over but the run never reached a final state: it was killed from outside.
            reason = f"job {job_id} ended without finishing the run ({detail})"
            tail = _log_tail(sweep_dir / "jobs", str(job_id))
            if tail:
                reason += f": {tail}"
            new_state = "failed"
        elif state in ("failed", "diverged") and row["job_state"] not in (None, "COMPLETED", "FAILED", "ENDED"):
            reason = f"job {job_id} {detail}: {reason}".rstrip(": ")  # the scheduler's word comes first
        if new_state != state or reason != row["reason"]:
            if new_state != state and run_dir.is_dir():  # a folder removed by hand is not made again
                try:
                    write_status(run_dir, new_state, message=reason)
                except DiskFull:
                    pass  # the row still tells the truth; the next status call, with room, records it
            row.update(state=new_state, reason=reason)
    row["advice"] = advice(row["state"], grid, resume_step)
    return row


def run_rows(sweep_dir: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per run of a sweep's record, with one typed field per grid axis and the final numbers."""
    entries = record.get("runs", [])
    slurm_ids = [str(e["job_id"]) for e in entries if e.get("job_id") and e.get("executor") == "slurm"]
    info = slurm_info(slurm_ids) if slurm_ids else {}
    starter = sweep_process(sweep_dir)
    rows = []
    for e in entries:
        row = reconcile(sweep_dir, e["run_id"], e.get("job_id"), e.get("executor"), info, record.get("grid", ""))
        if starter is not None and row["state"] == "pending" and not row["job_active"]:
            _waiting_for(row, starter, record.get("grid", ""))
        row["variant"] = e.get("variant", "")
        row["superseded"] = bool(e.get("superseded"))
        overrides = dict(e.get("overrides") or {})
        # The grid's own order, as the dry run shows it, then keys only this run sets.
        row["axes"] = {k: overrides[k] for k in record.get("axes") or [] if k in overrides}
        row["axes"].update(overrides)
        for key, value in row["axes"].items():
            row.setdefault(key, value)
        summary = read_summary(sweep_dir / e["run_id"])
        for key in ("val_loss", "val_bpb", "params", "tokens_per_s", "train_steps", "train_tokens"):
            row[key] = summary.get(key)
        rows.append(row)
    return rows


def _waiting_for(row: dict[str, Any], starter: dict[str, Any], grid: str) -> None:
    """A pending run without a job waits for the local sweep process to start it: it will start while that
    process lives (``will_start``), and is ``orphaned`` once it is gone."""
    if starter["alive"]:
        row["will_start"] = True
        return
    row["state"] = "orphaned"
    row["reason"] = (
        f"the sweep process that would start it (pid {starter['pid']} on {starter.get('host') or 'an unknown host'}) "
        "is gone"
    )
    row["advice"] = advice("orphaned", grid, row.get("resume_step"))


def axis_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The grid axes that the rows vary, in the order the grid names them."""
    keys: list[str] = []
    for row in rows:
        keys += [k for k in row.get("axes", {}) if k not in keys]
    return keys


def sweep_status(sweep: str | Path, root: str | Path | None = None) -> list[dict[str, Any]]:
    """One row per run: state, step, last loss, job id, node, why a run stopped and what to run next, the grid
    axes, and the final numbers."""
    sweep_dir = resolve_sweep_dir(sweep, root)
    return run_rows(sweep_dir, read_sweep_record(sweep_dir))


def cancel(sweep: str | Path, root: str | Path | None = None) -> list[str]:
    """Cancel every queued or running job of a sweep and mark its runs cancelled; returns their run ids.

    The mark is written before the jobs are signalled and kept through what a stopping job writes, so the run
    says it was cancelled (not merely interrupted) until it is submitted again.
    """
    sweep_dir = resolve_sweep_dir(sweep, root)
    record = read_sweep_record(sweep_dir)
    note = f"cancelled by depthmem cancel ({now_iso()})"
    stopped: list[tuple[str, str, str]] = []
    for row in run_rows(sweep_dir, record):
        if not row["job_active"]:
            continue
        entry = next(e for e in record["runs"] if e["run_id"] == row["run_id"])
        write_status(
            sweep_dir / row["run_id"], read_status(sweep_dir / row["run_id"]).get("state", "pending"), cancelled=note
        )
        stopped.append((row["run_id"], str(row["job_id"]), entry.get("executor") or "local"))
    slurm_ids = [j for _, j, ex in stopped if ex == "slurm"]
    if slurm_ids:
        subprocess.run(["scancel", *slurm_ids], capture_output=True, text=True, timeout=60)
    stop_local([j for _, j, ex in stopped if ex != "slurm"])
    for rid, _, _ in stopped:
        write_status(sweep_dir / rid, "cancelled", message=note, cancelled=note)
    return [rid for rid, _, _ in stopped]


def _cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and value != value):
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def format_rows(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain text table of the given columns (blank for missing values); grid axes go by their short label.

    Numbers are right-aligned and text left-aligned. Plain Python, not pandas: ``depthmem status`` prints this
    and must answer at once.
    """
    if not rows:
        return "(no runs)"
    labels = {c: axis_label(c) if "." in c else c for c in columns}
    if len(set(labels.values())) < len(labels):
        labels = {c: c for c in columns}
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    numeric = [all(_is_number(row.get(c)) or row.get(c) is None for row in rows) for c in columns]
    widths = [max([len(labels[c])] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line([labels[c] for c in columns]), *(line(values) for values in cells)])


__all__ = [
    "TERMINAL",
    "default_root",
    "resolve_sweep_dir",
    "slurm_info",
    "local_alive",
    "stop_local",
    "reconcile",
    "run_rows",
    "axis_columns",
    "sweep_status",
    "cancel",
    "format_rows",
    "advice",
    "record_sweep_process",
    "touch_sweep_process",
    "forget_sweep_process",
    "sweep_process",
]
