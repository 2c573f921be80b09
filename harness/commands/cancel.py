"""``depthmem cancel``: cancel the queued and running jobs of a sweep."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser("cancel", help="cancel the queued and running jobs of a sweep",
                       description="Cancel every queued or running job of SWEEP (scancel on SLURM) and mark its "
                                   "runs failed; resubmit them later with depthmem sweep --retry-failed.")
    p.add_argument("sweep", metavar="SWEEP", help="sweep name (results/<name>) or grid file")
    p.add_argument("--results", metavar="DIR", help="results root (default: $DEPTHMEM_RESULTS or ./results)")
    return p


def run(args) -> int:
    from harness.dispatch import cancel

    cancelled = cancel(args.sweep, args.results)
    if cancelled:
        print(f"cancelled {len(cancelled)} run(s): {', '.join(cancelled)}")
    else:
        print("nothing to cancel: no run of this sweep is queued or running.")
    return 0
