"""What a run writes as it trains: metrics.csv, layers.csv and the depth statistics (appended, cut back exactly on
resume), status.json, the checkpoint at its interval, the progress line or bar, and the step's memory and core load.

Rank 0 writes; every rank validates its share.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import TQDMProgressBar

from harness import rundir
from harness.config import RunConfig
from harness.io import (
    append_bytes,
    atomic_write_text,
    fsync_path,
)
from harness.measure import AllocatorPeak, CoreLoad, live_training_bytes
from harness.model.diagnostics import layer_stats, traced_forward
from harness.training.budget import seq_len_of
from harness.training.sharding import is_sharded, whole_mixer
from harness.units import duration

METRICS_COLUMNS = ["step", "tokens", "train_loss", "val_loss", "val_bpb", "lr", "grad_norm", "tokens_per_s"]
LAYERS_COLUMNS = ["step", "layer", "kind", "input_rms", "output_rms", "grad_norm"]
DEPTH_STATS = "depth_stats.jsonl"


def csv_text(columns: list[str], rows: list[dict], header: bool = True) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    return buf.getvalue()


class CsvLog:
    """A CSV file that grows by appended lines: cost per row independent of the run's length.

    ``rows`` are those kept from an earlier segment of the run. The first ``add`` rewrites the file atomically
    with them, which drops every row a killed segment wrote after its last checkpoint (exact truncation on
    resume); later rows are appended whole, one line per ``write``.
    """

    def __init__(self, path: Path, columns: list[str], rows: list[dict]):
        self.path, self.columns, self.rows = path, columns, rows
        self._fresh = True

    def add(self, rows: list[dict]) -> None:
        self.rows.extend(rows)
        if self._fresh:
            atomic_write_text(self.path, csv_text(self.columns, self.rows))
            self._fresh = False
        else:
            append_bytes(self.path, csv_text(self.columns, rows, header=False).encode("utf-8"))

    def sync(self) -> None:
        """Make the rows appended so far durable (before a checkpoint that vouches for them)."""
        if not self._fresh and self.path.exists():
            fsync_path(self.path)


def _read_jsonl(path: Path, up_to_step: int) -> list[dict]:
    """Records of an earlier segment of this run, up to the step it is resumed from (a torn last line is dropped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= up_to_step:
            records.append(rec)
    return records


def progress_line(
    step: int,
    total: int,
    elapsed: float,
    eta: float | None,
    tokens_per_s: float | None,
    train_loss: float | None,
    val_loss: float | None,
) -> str:
    """One line of progress for logs that are not a terminal (SLURM's): where, how fast, how long, how good."""
    parts = [
        f"step {step}/{total} ({100 * step / max(total, 1):.0f}%)",
        f"elapsed {duration(elapsed)}",
        f"eta {duration(eta)}",
    ]
    if tokens_per_s:
        parts.append(f"{tokens_per_s:,.0f} tok/s")
    if train_loss is not None:
        parts.append(f"loss {train_loss:.4f}")
    if val_loss is not None:
        parts.append(f"val_loss {val_loss:.4f}")
    return "  ".join(parts)


class RunFiles(pl.Callback):
    """Writes metrics.csv, layers.csv, status.json and ckpt/last.ckpt as training goes (rank 0 writes)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ckpt_path: Path, resume_step: int, plain_logs: bool):
        self.cfg, self.run_dir, self.ckpt_path, self.plain_logs = cfg, run_dir, ckpt_path, plain_logs
        self.metrics_log = CsvLog(
            run_dir / "metrics.csv", METRICS_COLUMNS, rundir.read_metric_rows(run_dir / "metrics.csv", resume_step)
        )
        self.layers_log = CsvLog(
            run_dir / "layers.csv", LAYERS_COLUMNS, rundir.read_metric_rows(run_dir / "layers.csv", resume_step)
        )
        self.metrics = self.metrics_log.rows
        # What the mixer learned (its forgetting factors, importance weights), one record per validation.
        self.depth_stats = _read_jsonl(run_dir / DEPTH_STATS, resume_step)
        self.tokens_per_step = cfg.train.batch_size * seq_len_of(cfg)
        self.last_loss: float | None = None
        self._mark = (time.time(), resume_step)
        self.segment_tokens_per_s: float | None = None
        self._segment = (time.time(), resume_step)
        self.ckpt_step = resume_step
        self.latest_val: float | None = None
        earlier_val = [r["val_loss"] for r in self.metrics if r.get("val_loss") not in (None, "")]
        if earlier_val:
            self.latest_val = float(earlier_val[-1])
        self.smoothed_rate: float | None = None

    def _validate(self, trainer, module, step: int, row: dict) -> None:
        if not self.cfg.train.val_batches:
            return
        val_loss, val_bpb = module.evaluate()
        row.update(val_loss=val_loss, val_bpb=val_bpb)
        model, sharded = module.model, is_sharded(module.model.parameters())
        if sharded or trainer.is_global_zero:
            # A sharded forward and a gather are collectives, so there every rank traces the same windows, and each
            # gathers the mixer alone (not the layers) for what the mixer learned.
            _, trace = traced_forward(model, module.val_windows[:4, :-1].to(module.device))
            mixer = whole_mixer(model, self.cfg) if sharded else model.mixer
        if trainer.is_global_zero:
            grads = module.step_layer_grads.tolist() if step and module.step_layer_grads is not None else None
            self.layers_log.add(
                [
                    {"step": step, **s, "grad_norm": None if grads is None else grads[l]}
                    for l, s in enumerate(layer_stats(model, trace))
                ]
            )
            learned = mixer.learned_statistics(trace)
            if learned:
                self.depth_stats.append({"step": step, **learned})
                atomic_write_text(
                    self.run_dir / DEPTH_STATS, "".join(json.dumps(r, sort_keys=True) + "\n" for r in self.depth_stats)
                )

    def _write_row(self, trainer, row: dict) -> None:
        if row.get("val_loss") is not None:
            self.latest_val = row["val_loss"]
        if row.get("tokens_per_s") is not None and row["step"] > 1:  # step 1 carries the start-up time
            rate = row["tokens_per_s"]
            self.smoothed_rate = rate if self.smoothed_rate is None else 0.7 * self.smoothed_rate + 0.3 * rate
        if not trainer.is_global_zero:
            return
        self.metrics_log.add([row])
        for logger in trainer.loggers:  # TensorBoard or W&B, when asked for
            logger.log_metrics({k: v for k, v in row.items() if k != "step" and v is not None}, step=row["step"])
        module = trainer.lightning_module
        step, total = row["step"], module.total
        elapsed = module.elapsed_before + (time.time() - self._segment[0])
        eta = ((total - step) * self.tokens_per_step / self.smoothed_rate) if self.smoothed_rate else None
        rundir.write_status(
            self.run_dir,
            "running",
            step=step,
            last_loss=self.last_loss,
            total_steps=total,
            eta_s=None if eta is None else round(eta, 1),
            elapsed_s=round(elapsed, 1),
            message=f"training, step {step} of {total}",
        )
        if self.plain_logs:
            print(
                "depthmem: "
                + progress_line(step, total, elapsed, eta, self.smoothed_rate, row.get("train_loss"), self.latest_val),
                flush=True,
            )

    def on_train_start(self, trainer, module):
        if trainer.global_step == 0 and not self.metrics:
            row = {"step": 0, "tokens": 0}
            self._validate(trainer, module, 0, row)
            self._write_row(trainer, row)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not batch["last"]:
            return  # an accumulation pass: the step is not taken yet
        step, t = trainer.global_step, self.cfg.train
        self.last_loss = module.step_loss if module.diverged is None else self.last_loss
        logged = step % t.log_every_steps == 0 or step in (1, module.total) or module.diverged is not None
        validated = step % t.val_every_steps == 0 or step == module.total
        if logged or validated:
            now = time.time()
            rate = (step - self._mark[1]) * self.tokens_per_step / max(now - self._mark[0], 1e-9)
            self._mark = (now, step)
            row = {
                "step": step,
                "tokens": step * self.tokens_per_step,
                "train_loss": module.step_loss,
                "lr": module.step_lr,
                "grad_norm": module.step_grad_norm,
                "tokens_per_s": rate,
            }
            if validated and module.diverged is None:
                self._validate(trainer, module, step, row)
            self._write_row(trainer, row)
        if module.diverged is None and (step % t.ckpt_every_steps == 0 or step == module.total):
            self._save(trainer, step)
        if step == module.total:
            self.segment_tokens_per_s = (
                (step - self._segment[1]) * self.tokens_per_step / max(time.time() - self._segment[0], 1e-9)
            )

    def _save(self, trainer, step: int) -> None:
        # The rows up to this step must be on disk before a checkpoint that resumes past them is.
        self.metrics_log.sync()
        self.layers_log.sync()
        trainer.save_checkpoint(self.ckpt_path, weights_only=False)
        self.ckpt_step = step
        if trainer.is_global_zero:  # what status shows as the step a stopped run resumes from
            rundir.write_status(self.run_dir, rundir.read_status(self.run_dir).get("state", "running"), ckpt_step=step)

    def on_exception(self, trainer, module, exception):
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        # Lightning stops on SIGTERM and Ctrl-C between two steps, so the state is consistent and worth keeping.
        stopped = isinstance(exception, (SIGTERMException, KeyboardInterrupt))
        if stopped and module.diverged is None and trainer.global_step > self.ckpt_step:
            self._save(trainer, trainer.global_step)


class StepProgressBar(TQDMProgressBar):
    """The terminal bar over optimizer steps (``train 30/120``), with the loss and the latest validation loss."""

    def __init__(self, files: RunFiles):
        super().__init__()
        self.files = files

    def on_train_epoch_start(self, trainer, *_):
        bar = self.train_progress_bar
        bar.reset(total=trainer.lightning_module.total)
        bar.initial = 0
        bar.n = trainer.global_step
        bar.set_description("train")
        bar.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        bar = self.train_progress_bar
        bar.n = trainer.global_step
        bar.set_postfix(self.get_metrics(trainer, pl_module))
        bar.refresh()

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        if self.files.latest_val is not None:
            items["val_loss"] = f"{self.files.latest_val:.4f}"
        return items


class StepCosts(pl.Callback):
    """The training step's allocator peak and, on CPU, whether other work shared the cores.

    On CUDA the peak is ``torch.cuda.max_memory_allocated`` over the whole segment. On CPU one step is profiled
    (the second of the segment, once the optimizer holds its state): the allocator's peak above the step's start,
    plus the parameters, gradients and optimizer state live at its start, as ``depthmem bench`` counts a step.
    """

    def __init__(self, resume_step: int, total: int):
        self.at_step = min(resume_step + 1, total - 1)
        self.peak: int | None = None
        self.method: str | None = None
        self.load = CoreLoad()
        self._meter: AllocatorPeak | None = None
        self._live = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if module.device.type == "cpu" and trainer.global_step == self.at_step:
            self._live = live_training_bytes(module.model, trainer.optimizers)
            self._meter = AllocatorPeak("cpu")
            self._meter.start()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self._meter is not None:
            self.peak, self.method, self._meter = self._live + self._meter.stop(), "cpu", None
        if module.device.type == "cpu" and trainer.global_step % module.cfg.train.log_every_steps == 0:
            self.load.sample()

    def on_train_end(self, trainer, module):
        if module.device.type == "cuda":
            self.peak, self.method = int(torch.cuda.max_memory_allocated(module.device)), "cuda"

    def summary(self, module) -> dict:
        out: dict = {"peak_mem_bytes": self.peak, "peak_mem_method": self.method}
        if module.device.type == "cpu":
            out.update(self.load.summary(torch.get_num_threads()))
        return out
