"""``depthmem cancel``: cancel the queued and running jobs of a sweep."""

from __future__ import annotations

from harness.commands import add_results_option
from harness.io import read_json
from harness.sweeps.jobstate import cancel, resolve_sweep_dir


def add_parser(sub):
    p = sub.add_parser(
        "cancel",
        help="cancel the queued and running jobs of a sweep",
        description="Cancel every queued or running job of SWEEP (scancel on SLURM; on this machine "
        "each run's process group is stopped) and mark its runs cancelled; the same "
        "`depthmem sweep FILE` later resumes them from their checkpoints.",
    )
    p.add_argument("sweep", metavar="SWEEP", help="sweep name (results/<name>) or grid file")
    add_results_option(p)
    return p


def run(args) -> int:

    cancelled = cancel(args.sweep, args.results)
    if cancelled:
        grid = (read_json(resolve_sweep_dir(args.sweep, args.results) / "sweep.json") or {}).get("grid") or "FILE"
        print(f"cancelled {len(cancelled)} run(s): {', '.join(cancelled)}; `depthmem sweep {grid}` resumes them")
    else:
        print("nothing to cancel: no run of this sweep is queued or running.")
    return 0
