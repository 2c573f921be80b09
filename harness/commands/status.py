"""``depthmem status``: every run of a sweep with its grid values, state, progress, job, node and what to run next."""

from __future__ import annotations

import json
import sys
import time

from harness.commands import add_results_option
from harness.errors import UsageError
from harness.sweeps.jobstate import axis_columns, format_rows, sweep_status
from harness.units import duration

SUPERSEDED = "superseded: not in the grid as it is now (an earlier version of it ran this)"
COLUMNS = ["state", "step", "loss", "val_loss", "job_id", "node", "reason"]


def add_parser(sub):
    p = sub.add_parser(
        "status",
        help="show the runs of a sweep: grid values, state, step, loss, job, node, why",
        description="Show every run of SWEEP (a sweep name under the results root, or its grid "
        "file) with one column per grid axis, its state, step, last loss, job id, node "
        "and, for a run that stopped, the reason and the command that moves it on "
        "(from status.json and the scheduler).",
    )
    p.add_argument("sweep", metavar="SWEEP", help="sweep name (results/<name>) or grid file")
    add_results_option(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON (grid values typed)")
    p.add_argument(
        "--watch",
        nargs="?",
        const=5.0,
        type=float,
        metavar="SECONDS",
        help="refresh in place every SECONDS (default 5) with steps done/total and ETA per run; "
        "exits when no run is queued or running and no local sweep process will start one",
    )
    return p


def _progress(row) -> str:
    total = row.get("total_steps")
    step = row.get("step") or 0
    if not total:
        return ""
    eta = f", eta {duration(row['eta_s'])}" if row.get("state") == "running" and row.get("eta_s") is not None else ""
    return f"{step}/{total}{eta}"


def table(rows) -> str:

    axes = axis_columns(rows)
    # The runs the grid holds now first, then those an earlier version of it left behind.
    rows = sorted(rows, key=lambda r: r.get("superseded", False))
    for row in rows:
        row["progress"] = _progress(row)
        old = SUPERSEDED if row.get("superseded") else ""
        row["why / next"] = "; ".join(x for x in (old, row.get("reason"), row.get("advice")) if x)
    columns = ["run_id", *axes, "state", "progress", "loss", "val_loss", "job_id", "node", "why / next"]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    line = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    superseded = sum(bool(r.get("superseded")) for r in rows)
    if superseded:
        line += f"; {superseded} of them superseded (from an earlier version of the grid, not in it now)"
    return format_rows(rows, columns) + "\n" + line


def run(args) -> int:

    if args.watch is not None and not args.watch > 0:
        raise UsageError(f"--watch takes a positive number of seconds, got {args.watch}.")
    rows = sweep_status(args.sweep, args.results)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if args.watch is None:
        print(table(rows))
        return 0
    tty = sys.stdout.isatty()
    while True:
        text = table(rows)
        if tty:
            sys.stdout.write("\x1b[H\x1b[J")  # redraw in place
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        # Done when nothing runs and nothing will start: a pending run waits for its live sweep process.
        if not any(r["job_active"] or r.get("will_start") for r in rows):
            return 0
        time.sleep(args.watch)
        rows = sweep_status(args.sweep, args.results)
