"""TensorBoard and W&B for runs that finished before their logger was switched on.

``train.logger`` is not part of a run's identity, so switching it on for a finished sweep trains nothing again;
what the logger would have shown is in the run's ``metrics.csv`` (every logged step) and ``config.json``. This
module sends those to the logger as the training would have: the same metric names at the same steps, the full
config as the hyperparameters, TensorBoard's files in ``<run>/tensorboard/`` and the run's own W&B id, project,
group and job type. W&B keeps its own settings: ``WANDB_DIR`` decides where its files go (the run folder
otherwise), and ``WANDB_MODE``, ``WANDB_ENTITY`` and the rest apply as they always do; ``WANDB_PROJECT`` names the
project when the config does not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.config import RunConfig
from harness.io import atomic_write_json, atomic_write_text, read_json
from harness.rundir import now_iso, read_metric_rows

LOGGERS = ("tensorboard", "wandb")
TB_FOLDER = "tensorboard"


def _record(run_dir: Path) -> dict[str, Any]:
    return read_json(Path(run_dir) / "tracking.json", default={}) or {}


def has_logged(run_dir: Path, logger: str) -> bool:
    """Whether the run's metrics already reached ``logger``, while it trained or by an earlier backfill."""
    run_dir = Path(run_dir)
    if logger == "tensorboard":
        return any((run_dir / TB_FOLDER).glob("events.out.tfevents.*"))
    if logger == "wandb":
        # The trainer makes the run's W&B id when it opens its W&B run, and so does a backfill.
        return bool(_record(run_dir).get("wandb_id"))
    return True


def needs_backfill(run_dir: Path, cfg: RunConfig) -> bool:
    """A finished run whose config asks for TensorBoard or W&B that has never received its metrics."""
    return cfg.train.logger in LOGGERS and not has_logged(run_dir, cfg.train.logger)


def _rows(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """``(step, {metric: value})`` per row of metrics.csv, in step order, with the names the trainer logs."""
    out = []
    for row in read_metric_rows(Path(run_dir) / "metrics.csv", up_to_step=2**62):
        values = {}
        for key, text in row.items():
            if key == "step" or text in ("", None):
                continue
            try:
                values[key] = float(text)
            except ValueError:
                continue
        out.append((int(row["step"]), values))
    return sorted(out, key=lambda r: r[0])


def backfill(run_dir: str | os.PathLike, cfg: RunConfig) -> int:
    """Send a finished run's metrics.csv and config to its ``train.logger``; returns the number of rows sent."""
    run_dir = Path(run_dir)
    rows = _rows(run_dir)
    if cfg.train.logger == "tensorboard":
        _tensorboard(run_dir, cfg, rows)
    elif cfg.train.logger == "wandb":
        _wandb(run_dir, cfg, rows)
    else:
        return 0
    record = _record(run_dir)
    record.setdefault("backfilled", {})[cfg.train.logger] = now_iso()
    atomic_write_json(run_dir / "tracking.json", record)
    return len(rows)


def hparams_flat(d: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": 1e-3}}`` as ``{"train/lr": 1e-3}``; lists and None as text, which HParams takes."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(hparams_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def _tensorboard(run_dir: Path, cfg: RunConfig, rows) -> None:
    import yaml
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    folder = run_dir / TB_FOLDER
    writer = SummaryWriter(log_dir=str(folder))
    try:
        # The HParams view pairs the config with the val_loss curve, as for a run that trained with the logger.
        for summary in hparams(hparams_flat(cfg.to_dict()), {"val_loss": 0.0}):
            writer.file_writer.add_summary(summary)
        for step, values in rows:
            for key, value in values.items():
                writer.add_scalar(key, value, global_step=step)
    finally:
        writer.close()
    atomic_write_text(folder / "hparams.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def wandb_dir(run_dir: Path) -> str:
    """Where W&B writes: ``WANDB_DIR`` when set, else the run folder. Named explicitly either way: W&B reads its
    environment once per process, so a later run in the same process would not see a changed ``WANDB_DIR``."""
    return os.environ.get("WANDB_DIR") or str(run_dir)


def _wandb(run_dir: Path, cfg: RunConfig, rows) -> None:
    import uuid

    os.environ.setdefault("WANDB_SILENT", "true")  # ~26 lines a run otherwise; WANDB_SILENT=false shows them
    import wandb

    record = _record(run_dir)
    if not record.get("wandb_id"):
        record["wandb_id"] = f"{run_dir.name[:100]}-{uuid.uuid4().hex[:8]}"
        atomic_write_json(run_dir / "tracking.json", record)
    run = wandb.init(
        dir=wandb_dir(run_dir),
        project=cfg.train.wandb_project or os.environ.get("WANDB_PROJECT") or cfg.name or "depthmem",
        group=cfg.name or None,
        job_type=str(cfg.variant),  # the canonical name
        name=run_dir.name,
        id=record["wandb_id"],
        resume="allow",
        config=cfg.to_dict(),
    )
    try:
        # The step axis Lightning's W&B logger gives live runs, so backfilled and live runs line up.
        run.define_metric("trainer/global_step")
        run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        for step, values in rows:
            run.log({**values, "trainer/global_step": step})
    finally:
        run.finish()


__all__ = ["LOGGERS", "has_logged", "needs_backfill", "backfill", "wandb_dir"]
