"""``depthmem status``: every run of a sweep with its state, step, last loss, job, node and failure reason."""

from __future__ import annotations

import json

COLUMNS = ["run_id", "variant", "state", "step", "loss", "job_id", "node", "val_loss", "reason"]


def add_parser(sub):
    p = sub.add_parser("status", help="show the runs of a sweep: state, step, loss, job, node, why it failed",
                       description="Show every run of SWEEP (a sweep name under the results root, or its grid "
                                   "file) with its state, step, last loss, job id, node and, for a failed run, "
                                   "the reason (from status.json, SLURM accounting and submitit's logs).")
    p.add_argument("sweep", metavar="SWEEP", help="sweep name (results/<name>) or grid file")
    p.add_argument("--results", metavar="DIR", help="results root (default: $DEPTHMEM_RESULTS or ./results)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return p


def run(args) -> int:
    from harness.dispatch import format_rows, sweep_status

    rows = sweep_status(args.sweep, args.results)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    print(format_rows(rows, COLUMNS))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    print(", ".join(f"{n} {state}" for state, n in sorted(counts.items())))
    return 0
