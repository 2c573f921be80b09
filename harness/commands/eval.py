"""``depthmem eval``: score a run directory or checkpoint on downstream tasks with lm-eval's own evaluator."""

from __future__ import annotations

import json


def add_parser(sub):
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint on downstream benchmarks through lm-eval",
        description="Evaluate a run directory or .ckpt file with lm-eval. Writes lm-eval's results JSON "
        "(eval/results_<iso-time>.json) and eval/table.csv (task, metric, value, stderr) into the "
        "run directory. The offline suite reads benchmark data from disk; other lm-eval task names "
        "need the Hugging Face hub.",
    )
    p.add_argument("path", metavar="RUN_DIR_OR_CHECKPOINT", help="a run directory or a .ckpt file")
    p.add_argument(
        "--tasks",
        required=True,
        metavar="SUITE_OR_NAMES",
        help="comma-separated: the suite 'offline', offline_* tasks (offline_sciq is opt-in), or lm-eval task names",
    )
    p.add_argument("--limit", type=int, default=None, metavar="N", help="documents per task (default: all)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="sequences per forward pass (default 16)")
    p.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:N or mps (default: cuda when available); a GPU must be present"
    )
    p.add_argument("--out", default=None, metavar="DIR", help="write here instead of RUN_DIR/eval")
    p.add_argument(
        "--bootstrap-iters",
        type=int,
        default=1000,
        metavar="N",
        help="bootstrap draws for stderrs without a closed form, 0 to skip (default 1000)",
    )
    p.add_argument("--dry-run", action="store_true", help="print what would be evaluated and exit")
    return p


def run(args) -> int:
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from pathlib import Path

    from harness.evaluation.evaluator import check_device, check_options, check_tasks, evaluate, run_directory
    from harness.model.checkpoint import check_not_sweep

    if args.dry_run:  # the checks ``evaluate`` makes before it loads the model, and nothing else
        check_not_sweep(Path(args.path))
        check_options(limit=args.limit, batch_size=args.batch_size, bootstrap_iters=args.bootstrap_iters)
        check_device(args.device)
        tasks = check_tasks(args.tasks)
        out = args.out or str(run_directory(Path(args.path)) / "eval")
        print(
            json.dumps(
                {
                    "checkpoint": args.path,
                    "tasks": tasks,
                    "limit": args.limit,
                    "batch_size": args.batch_size,
                    "device": args.device,
                    "out": out,
                    "bootstrap_iters": args.bootstrap_iters,
                },
                indent=2,
            )
        )
        return 0
    from lm_eval.utils import make_table

    results = evaluate(
        args.path,
        args.tasks,
        limit=args.limit,
        batch_size=args.batch_size,
        out_dir=args.out,
        device=args.device,
        bootstrap_iters=args.bootstrap_iters,
    )
    print(make_table(results))
    out = Path(args.out) if args.out else run_directory(Path(args.path)) / "eval"
    print(f"depthmem: wrote lm-eval's results_*.json, table.csv and tasks.json in {out}")
    return 0
