"""``depthmem sweep``: expand a grid file, validate every run, and submit the unfinished ones through submitit."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.commands import add_results_option
from harness.commands.train import check_overrides
from harness.errors import UsageError
from harness.sweeps.announce import closing_table, describe_plan
from harness.sweeps.grid import combinations, load_grid
from harness.sweeps.planning import check_executor, plan
from harness.sweeps.submit import sweep


def add_parser(sub):
    p = sub.add_parser(
        "sweep",
        help="run an ablation grid locally or on SLURM (idempotent: finished runs are skipped)",
        description="Expand the grid FILE (experiments/*.yaml) into runs under RESULTS/<sweep name>/<run id>/, "
        "validate them all, and submit the unfinished ones as job arrays through submitit. Submitting "
        "again skips finished and queued runs, resumes interrupted and cancelled ones from their "
        "checkpoint, evaluates finished runs on tasks added since, and reruns failed ones only with "
        "--retry-failed. KEY=VALUE arguments, anywhere after FILE, override the grid's base, e.g. "
        "train.max_steps=200; KEY=V1,V2 (Hydra multirun style) makes KEY an axis with those values, adding it "
        "or replacing the grid's own (a list value is written in brackets: eval.tasks=[a,b]).",
    )
    p.add_argument("grid", metavar="FILE", help="grid file with base, axes, zip, include and exclude")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override a base config field; KEY=V1,V2,... sweeps KEY over those values as an axis",
    )
    p.add_argument(
        "--set",
        dest="set_overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="the same as a KEY=VALUE argument (repeatable)",
    )
    p.add_argument(
        "--executor",
        choices=("local", "slurm"),
        default=None,
        help="where the runs go (default: the profile's executor: slurm for a cluster profile, else this machine)",
    )
    p.add_argument(
        "--profile",
        metavar="NAME|FILE",
        help="resource profile: a name in slurm/profiles/ (local, gpu-cluster, ...) or a YAML path "
        "(default: the grid's profile, else built-in defaults)",
    )
    p.add_argument("--parallelism", type=int, metavar="N", help="most runs at once (default: grid, then profile)")
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="rerun runs that failed with an error or diverged (interrupted and cancelled runs resume without it)",
    )
    p.add_argument(
        "--wandb-project", metavar="NAME", help="W&B project for train.logger=wandb (default: the sweep name)"
    )
    p.add_argument(
        "--yes",
        action="store_true",
        help="run a cluster grid of more than a few runs on this machine, or submit a grid of more than "
        f"$DEPTHMEM_CONFIRM_RUNS runs (default {CONFIRM_RUNS}), without asking",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the runs and the resources requested, checking sbatch and the partition for "
        "--executor slurm; submit nothing",
    )
    p.add_argument(
        "--memory-plan",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --dry-run: simulate one training step of each model on shapes alone and print the memory per "
        "process and the micro batch that fits 40, 80 and 141 GB cards (default: when the profile asks for GPUs)",
    )
    wait = p.add_mutually_exclusive_group()
    wait.add_argument(
        "--wait",
        dest="wait",
        action="store_true",
        default=None,
        help="wait for the runs and print their results (the default with --executor local)",
    )
    wait.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once submitted (the default with --executor slurm)"
    )
    add_results_option(p)
    return p


CONFIRM_RUNS = 1000
"""Grids of more runs than this are submitted only with --yes (``DEPTHMEM_CONFIRM_RUNS`` changes it)."""


def confirm_limit() -> int:
    import os

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

    limit = confirm_limit()
    n = len(combinations(load_grid(grid_file)))
    if n > limit and not yes:
        raise UsageError(
            f"The grid {grid_file} expands to {n:,} runs, more than the {limit:,} a submission takes "
            "without confirmation: check it with --dry-run, then submit again with --yes "
            "(DEPTHMEM_CONFIRM_RUNS sets the limit)."
        )


def overrides_of(args) -> list[str]:
    # ``sweep train.seed=0,1 g.yaml``: argparse took the first override for FILE and FILE for an override.
    if "=" in args.grid and not Path(args.grid).exists():
        files = [o for o in args.overrides if "=" not in o]
        if files:
            args.overrides = [args.grid] + [o for o in args.overrides if o != files[0]]
            args.grid = files[0]
    extra = [f"train.wandb_project={args.wandb_project}"] if getattr(args, "wandb_project", None) else []
    return check_overrides(list(args.set_overrides) + list(args.overrides)) + extra


def run(args) -> int:

    if args.parallelism is not None and args.parallelism < 1:
        raise UsageError(f"--parallelism must be a positive integer, got {args.parallelism}.")
    overrides = overrides_of(args)
    if args.dry_run:
        p = plan(
            args.grid,
            executor=args.executor,
            profile=args.profile,
            root=args.results,
            retry_failed=args.retry_failed,
            parallelism=args.parallelism,
            overrides=overrides,
        )
        print(describe_plan(p, memory=args.memory_plan, log=lambda m: print(m, file=sys.stderr, flush=True)))
        if args.executor == "slurm":  # asked for explicitly: can this machine submit it, and is the partition known?
            check_executor(p.executor, p.profile)
        return 0
    check_size(args.grid, args.yes)
    sub = sweep(
        args.grid,
        executor=args.executor,
        profile=args.profile,
        root=args.results,
        retry_failed=args.retry_failed,
        wait=args.wait,
        parallelism=args.parallelism,
        yes=args.yes,
        overrides=overrides,
    )
    waited = args.wait if args.wait is not None else sub.plan.executor == "local"
    if waited:
        print(closing_table(sub.rows, sub.plan.sweep_dir))
        if sub.plan.waiting:
            print(f"{len(sub.plan.waiting)} run(s) have no tuned learning rate yet (see tuning.json).")
        return 0 if all(r["state"] == "done" for r in sub.rows) and not sub.plan.waiting else 1
    print(
        f"follow it with: depthmem status {sub.plan.grid.name}"
        + (f" --results {args.results}" if args.results else "")
        + " --watch"
    )
    return 0
