"""``depthmem sweep``: expand a grid file, validate every run, and submit the unfinished ones through submitit."""

from __future__ import annotations


def add_parser(sub):
    p = sub.add_parser(
        "sweep", help="run an ablation grid locally or on SLURM (idempotent: finished runs are skipped)",
        description="Expand the grid FILE (experiments/*.yaml) into runs under RESULTS/<sweep name>/<run id>/, "
                    "validate them all, and submit the unfinished ones as job arrays through submitit. Submitting "
                    "again skips finished and queued runs, resumes interrupted ones from their checkpoint and "
                    "reruns failed ones only with --retry-failed.")
    p.add_argument("grid", metavar="FILE", help="grid file with base, axes, zip, include and exclude")
    p.add_argument("--executor", choices=("local", "slurm"), default="local",
                   help="run on this machine (default) or submit to SLURM with sbatch")
    p.add_argument("--profile", metavar="NAME|FILE",
                   help="resource profile: a name in slurm/profiles/ (local, gpu-cluster, ...) or a YAML path "
                        "(default: the grid's profile, else built-in defaults)")
    p.add_argument("--parallelism", type=int, metavar="N", help="most runs at once (default: grid, then profile)")
    p.add_argument("--retry-failed", action="store_true", help="rerun failed and diverged runs too")
    p.add_argument("--dry-run", action="store_true", help="print the runs and the resources requested; submit nothing")
    wait = p.add_mutually_exclusive_group()
    wait.add_argument("--wait", dest="wait", action="store_true", default=None,
                      help="wait for the runs and print their results (the default with --executor local)")
    wait.add_argument("--no-wait", dest="wait", action="store_false",
                      help="return once submitted (the default with --executor slurm)")
    p.add_argument("--results", metavar="DIR", help="results root (default: $DEPTHMEM_RESULTS or ./results)")
    p.add_argument("--yes", action="store_true",
                   help=f"submit a grid of more than $DEPTHMEM_CONFIRM_RUNS runs (default {CONFIRM_RUNS})")
    return p


CONFIRM_RUNS = 1000
"""Grids of more runs than this are submitted only with --yes (``DEPTHMEM_CONFIRM_RUNS`` changes it)."""


def confirm_limit() -> int:
    import os

    from harness.errors import UsageError

    text = os.environ.get("DEPTHMEM_CONFIRM_RUNS", "").strip()
    if not text:
        return CONFIRM_RUNS
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise UsageError(f"DEPTHMEM_CONFIRM_RUNS must be a number of runs (0 or more), got {text!r}.")
    return value


def check_size(grid_file: str, yes: bool) -> None:
    """Refuse, before anything is expanded or written, a grid larger than the limit unless --yes confirms it."""
    from harness.errors import UsageError
    from harness.grid import combinations, load_grid

    limit = confirm_limit()
    n = len(combinations(load_grid(grid_file)))
    if n > limit and not yes:
        raise UsageError(f"The grid {grid_file} expands to {n:,} runs, more than the {limit:,} a submission takes "
                         "without confirmation: check it with --dry-run, then submit again with --yes "
                         "(DEPTHMEM_CONFIRM_RUNS sets the limit).")


RESULT_COLUMNS = ["variant", "run_id", "state", "val_loss", "val_bpb", "params", "tokens_per_s", "reason"]


def run(args) -> int:
    from harness.errors import UsageError
    from harness.dispatch import describe_plan, format_rows, plan, sweep

    if args.parallelism is not None and args.parallelism < 1:
        raise UsageError(f"--parallelism must be a positive integer, got {args.parallelism}.")
    if args.dry_run:
        p = plan(args.grid, executor=args.executor, profile=args.profile, root=args.results,
                 retry_failed=args.retry_failed, parallelism=args.parallelism)
        print(describe_plan(p))
        return 0
    check_size(args.grid, args.yes)
    sub = sweep(args.grid, executor=args.executor, profile=args.profile, root=args.results,
                retry_failed=args.retry_failed, wait=args.wait, parallelism=args.parallelism)
    waited = args.wait if args.wait is not None else args.executor == "local"
    if waited:
        print(format_rows(sub.rows, RESULT_COLUMNS))
        return 0 if all(r["state"] == "done" for r in sub.rows) else 1
    print(f"follow it with: depthmem status {sub.plan.grid.name}"
          + (f" --results {args.results}" if args.results else ""))
    return 0
