"""``depthmem train``: train one variant into a run directory, resuming it when it was interrupted."""

from __future__ import annotations

import json
from pathlib import Path

from harness import preflight
from harness.config import build_config, load_config
from harness.errors import UsageError
from harness.yamltext import read_yaml


def add_parser(sub):
    p = sub.add_parser(
        "train",
        help="train one variant into a run directory (resumes an interrupted run)",
        description="Train one depth-mixing variant with Lightning into the run directory --out. Running the same "
        "command again resumes from the last checkpoint; a finished run returns at once.",
    )
    p.add_argument(
        "--variant",
        help="depth mixer with optional knobs, e.g. 'ldm-rls(groups=4)' "
        "(default: the config file's, else preln; list them with depthmem variants)",
    )
    p.add_argument(
        "--preset",
        help="model size preset: tiny, cpu, small, gpt2-small, gpt2-medium, gpt2-large or 1.3b (default: the config "
        "file's, else tiny)",
    )
    p.add_argument("--config", metavar="FILE", help="YAML or JSON file with config sections (model, data, train, ...)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="override config fields, e.g. train.lr=1e-3 model.n_blocks=4 (applied last)",
    )
    p.add_argument(
        "--set",
        dest="set_overrides",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="the same as a KEY=VALUE argument (repeatable)",
    )
    p.add_argument("--wandb-project", metavar="NAME", help="W&B project for train.logger=wandb")
    p.add_argument("--out", required=True, metavar="DIR", help="run directory to write (created if missing)")
    p.add_argument("--devices", type=int, help="processes on this node (CPU: DDP on gloo); sets train.devices")
    p.add_argument("--max-steps", type=int, help="optimizer steps; 0 spends the token budget; sets train.max_steps")
    p.add_argument("--no-resume", action="store_true", help="start over even when the run directory has a checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config as JSON and exit")
    return p


def check_overrides(items: list[str]) -> list[str]:
    """``key=value`` overrides, each checked for its ``=`` so a slip is one sentence, not OmegaConf's words."""

    for item in items:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"The override {item!r} needs the form KEY=VALUE, e.g. train.lr=1e-3.")
    return items


def check_single_values(overrides: list[str]) -> None:
    """Refuse ``train.lr=1e-3,3e-3``: one run takes one value, and a comma list means a sweep over them."""
    from harness.sweeps.planning import split_choices

    for item in overrides:
        key, _, value = item.partition("=")
        if len(split_choices(value)) > 1:
            raise UsageError(
                f"{item!r} gives {key} several values, but comma lists are sweep axes: use `depthmem sweep` "
                "to train one run per value (a list value is written in brackets, e.g. eval.tasks=[a,b])."
            )


def resolve(args):
    """The RunConfig the arguments describe: config file, then --preset/--variant, then the flags, then the
    KEY=VALUE overrides (``--set`` ones first)."""

    layers: list = []
    if args.config:
        load_config(args.config)  # validates the file, with its own error messages
        layers.append(read_yaml(args.config) or {})
    for flag, value in (("--preset", args.preset), ("--variant", args.variant)):
        if value is not None and not value.strip():
            raise UsageError(
                f"{flag} is empty: give a name (list them with `depthmem variants`), or leave the "
                "flag out for the config's own."
            )
    if args.preset:
        layers.append({"model": {"preset": args.preset}})
    if args.variant:
        layers.append({"variant": args.variant})
    train = {k: v for k, v in (("devices", args.devices), ("max_steps", args.max_steps)) if v is not None}
    if train:
        layers.append({"train": train})
    overrides = check_overrides(list(getattr(args, "set_overrides", [])) + list(args.overrides))
    check_single_values(overrides)
    if getattr(args, "wandb_project", None):
        overrides.append(f"train.wandb_project={args.wandb_project}")
    layers.append(overrides)
    return build_config(*layers, source=args.config or "command line")


def run(args) -> int:
    cfg = resolve(args)  # its variant parsed and checked against the model's size, once
    problems = preflight.here(cfg)
    if problems:
        raise UsageError(problems[0])
    if cfg.eval.tasks:  # a run directory's config names tasks that a sweep evaluates later: known ones only
        from harness.evaluation.evaluator import check_tasks

        check_tasks(cfg.eval.tasks)
    from harness.rundir import check_same_run

    check_same_run(Path(args.out), cfg)
    if args.dry_run:
        print(json.dumps(cfg.to_dict(), indent=2))
        return 0
    from harness import tracking
    from harness.rundir import read_status, write_config
    from harness.training.trainer import train

    out = Path(args.out)
    finished = not args.no_resume and read_status(out).get("state") == "done" and (out / "summary.json").exists()
    run_dir = train(cfg, args.out, resume=not args.no_resume)
    if finished and tracking.needs_backfill(run_dir, cfg):
        rows = tracking.backfill(run_dir, cfg)
        write_config(run_dir, cfg)
        print(f"depthmem: sent {rows} logged step(s) of the finished run to {cfg.train.logger} from its metrics.csv")
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank == 0:  # every process of a multi-process run returns here; one line says where it is
        print(f"depthmem: run directory {run_dir}")
    return 0
