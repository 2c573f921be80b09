"""What a training run prints besides its progress: the part of the start line that names its processes, and the
Lightning messages it drops because they describe every run rather than this one."""

from __future__ import annotations

import logging

from harness.config import RunConfig


class LightningNoise(logging.Filter):
    """Drops what Lightning says of every run and not of this one: tips for its cloud products, the devices it did
    not use and each process joining the group (the start line names the run's devices and processes), and that
    ``fit`` stopped at ``max_steps`` (the run's own last line says how it ended)."""

    NOISE = (
        "💡",
        "GPU available",
        "TPU available",
        "HPU available",
        "`Trainer.fit` stopped",
        "Initializing distributed:",
        "-" * 100 + "\ndistributed_backend=",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith(self.NOISE)


def processes_text(cfg: RunConfig) -> str:
    """``, on 2 processes (strategy auto: DDP)`` for the start line where more than one process trains."""
    world = cfg.train.devices * cfg.train.num_nodes
    if world == 1:
        return ""
    nodes = f" on {cfg.train.num_nodes} nodes" if cfg.train.num_nodes > 1 else ""
    from harness.model.costs import preln_params
    from harness.training.sharding import resolved_strategy

    chosen = resolved_strategy(cfg.train.strategy, world, preln_params(cfg.model))
    strategy = f"auto: {chosen.upper()}" if cfg.train.strategy == "auto" else cfg.train.strategy
    return f", on {world} processes{nodes} (strategy {strategy})"


def quiet_lightning() -> None:
    for name in (
        "lightning.pytorch.utilities.rank_zero",
        "lightning.fabric.utilities.rank_zero",
        "lightning.fabric.utilities.distributed",
    ):
        log = logging.getLogger(name)
        if not any(isinstance(f, LightningNoise) for f in log.filters):
            log.addFilter(LightningNoise())
