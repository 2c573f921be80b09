"""Training with Lightning: one ``train(cfg, run_dir)`` call makes a complete, resumable run directory.

The plain ``Decoder`` is wrapped by a small LightningModule (``LitDecoder``); a callback (``RunFiles``) writes the
run directory of ``harness.rundir`` from rank 0 only. Batches are keyed by (seed, step) and every checkpoint holds
optimizer, scheduler, step and RNG states, so a run killed at any moment and started again continues exactly
where its last checkpoint left it; on CPU its loss curve equals an uninterrupted run's.

Weight decay (decoupled, AdamW) applies to the matrices of attention and MLP layers and to the weights of the
mixer's ``nn.Linear`` layers only: never to norms, the (tied) embedding, or any other mixer parameter (scalars,
gates, mixing coefficients), whose pull towards zero would change what a variant computes.

Bits per byte = total validation nats / ln 2 / total UTF-8 bytes the validation target tokens stand for (each
byte-level token is exactly its bytes; the end-of-text separator counts none).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from harness import rundir, tracking
from harness.config import RunConfig
from harness.data import corpus as datalib
from harness.data import tokenizer as toklib
from harness.errors import RunFailed, UsageError
from harness.io import (
    DiskFull,
    append_bytes,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    check_checkpoint_room,
    fsync_path,
    read_json,
    remove_stale_temps,
)
from harness.measure import AllocatorPeak, CoreLoad, live_training_bytes
from harness.model import diagnostics
from harness.model.checkpoint import read_checkpoint
from harness.model.diagnostics import layer_grad_norms, layer_stats, traced_forward
from harness.model.factory import build_model
from harness.training import budget
from harness.training.budget import seq_len_of
from harness.training.signals import SyncedStop
from variants import kernels

METRICS_COLUMNS = ["step", "tokens", "train_loss", "val_loss", "val_bpb", "lr", "grad_norm", "tokens_per_s"]
LAYERS_COLUMNS = ["step", "layer", "kind", "input_rms", "output_rms", "grad_norm"]
DEPTH_STATS = "depth_stats.jsonl"


# -- plain pieces (no Lightning) ------------------------------------------------------------------------------
def lr_factor(step: int, *, total: int, warmup: int, schedule: str, min_ratio: float, decay_fraction: float) -> float:
    """Multiplier of the peak learning rate for the update with 0-based index ``step``."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "cosine":
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    decay_start = max(warmup, total - round(decay_fraction * total))  # wsd: flat, then linear to min_ratio
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, total - decay_start))
    return 1.0 - (1.0 - min_ratio) * progress


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay for layer matrices and the mixer's Linear weights, none for everything else."""
    mixer_linear = {id(m.weight) for m in model.mixer.modules() if isinstance(m, nn.Linear)}
    mixer_params = {id(p) for p in model.mixer.parameters()}
    embed = {id(model.embed.weight), id(model.lm_head.weight)}
    decay, no_decay = [], []
    for p in model.parameters():  # shared (tied) parameters appear once
        if not p.requires_grad:
            continue
        if id(p) in mixer_params:
            (decay if id(p) in mixer_linear else no_decay).append(p)
        elif p.ndim >= 2 and id(p) not in embed:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def on_gpu(cfg: RunConfig) -> bool:
    """Whether the run trains on a CUDA GPU."""
    accelerator = cfg.train.accelerator
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def compiles(cfg: RunConfig) -> bool:
    """Whether the training forward runs under ``torch.compile``: ``train.compile``, where ``auto`` means on a GPU."""
    return cfg.train.compile == "true" or (cfg.train.compile == "auto" and on_gpu(cfg))


def total_steps(cfg: RunConfig) -> int:
    """``train.max_steps``, or the steps of its token budget (``harness.training.budget``)."""
    return budget.train_steps(cfg)


def accumulation(cfg: RunConfig) -> int:
    """Forward/backward passes per optimizer step: the global batch over processes x micro batch."""
    t = cfg.train
    world = t.devices * t.num_nodes
    micro = t.micro_batch_size or t.batch_size // world
    if t.batch_size % (world * micro):
        raise UsageError(
            f"train.batch_size ({t.batch_size}) must be a multiple of devices x nodes x "
            f"train.micro_batch_size ({t.devices} x {t.num_nodes} x {micro} = {world * micro})."
        )
    return t.batch_size // (world * micro)


def global_grad_norm(grads: list[torch.Tensor], block: int = 4096) -> float:
    """L2 norm of all gradients together, to float64 accuracy without a float64 copy of them.

    Each run of ``block`` entries is reduced in its own precision (relative error ~1e-7 over a block, not over
    millions of entries) and the block sums are added in float64: about ten times cheaper per step than
    converting every gradient to float64, which took ~2 % of a ``small`` training step on CPU.
    """
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device if grads else None)
    for g in grads:
        flat = g.reshape(-1)
        k = flat.numel() // block * block
        if k:
            low = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None  # accumulate in float32
            total += torch.linalg.vector_norm(flat[:k].view(-1, block), dim=1, dtype=low).double().square().sum()
        total += flat[k:].double().square().sum()
    return float(total.sqrt())


def is_diverged(loss: float, grad_norm: float, limit: float) -> bool:
    """A non-finite loss or gradient norm, or a gradient norm above ``limit``."""
    return not (math.isfinite(loss) and math.isfinite(grad_norm)) or grad_norm > limit


def _rng_states() -> dict:
    # Plain lists and tensors only, so checkpoints load with torch.load(weights_only=True).
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }


def _set_rng_states(s: dict) -> None:
    version, state, gauss = s["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(s["torch"])


def _csv_text(columns: list[str], rows: list[dict], header: bool = True) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if row.get(k) is None else row[k] for k in columns})
    return buf.getvalue()


def _read_rows(path: Path, up_to_step: int) -> list[dict]:
    """Rows of an earlier segment of this run, up to the step it is resumed from."""
    return rundir.read_metric_rows(path, up_to_step)


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
            atomic_write_text(self.path, _csv_text(self.columns, self.rows))
            self._fresh = False
        else:
            append_bytes(self.path, _csv_text(self.columns, rows, header=False).encode("utf-8"))

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


def _plus(value: int | None, more: int) -> int | None:
    return None if value is None else value + more


def _safe_cost(fn) -> Any:
    try:
        return fn()
    except NotImplementedError:
        return None


def duration(seconds: float | None) -> str:
    """``1:02:03`` or ``2:03``; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, sec = divmod(rest, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


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


class _NoAdvertising(logging.Filter):
    """Drops Lightning's tips for its own cloud products, which are not about this run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.getMessage()).lstrip().startswith("💡")


def _quiet_lightning() -> None:
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        log = logging.getLogger(name)
        if not any(isinstance(f, _NoAdvertising) for f in log.filters):
            log.addFilter(_NoAdvertising())


# -- Lightning ------------------------------------------------------------------------------------------------
import lightning.pytorch as pl  # noqa: E402  (kept below the plain helpers, which need no Lightning)
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written through ``harness.io``: a kill mid-save leaves the previous checkpoint intact."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        atomic_write_bytes(path, buf.getvalue())


class StepBatches(torch.utils.data.IterableDataset):
    """This process's rows of the global batch of every step from the current one on."""

    def __init__(self, tokens: datalib.Tokens, cfg: RunConfig, total: int, context):
        self.tokens, self.cfg, self.total, self.context = tokens, cfg, total, context

    def __iter__(self):
        start, rank, world = self.context()  # read at iteration time: after a checkpoint is restored
        rows = datalib.rank_slice(self.cfg.train.batch_size, rank, world)
        passes = accumulation(self.cfg)
        for step in range(start, self.total):
            batch = datalib.train_batch(
                self.tokens,
                seed=self.cfg.train.seed,
                step=step,
                batch_size=self.cfg.train.batch_size,
                seq_len=seq_len_of(self.cfg),
            )
            # The same rows as without accumulation, in equal consecutive parts: the mean of the parts' mean
            # losses is the mean over the rank's share, so the update does not change.
            for micro, w in enumerate(torch.from_numpy(batch[rows]).chunk(passes)):  # (b_micro, t + 1)
                yield {"step": step, "micro": micro, "last": micro == passes - 1, "x": w[:, :-1], "y": w[:, 1:]}


class LitDecoder(pl.LightningModule):
    """The decoder under Lightning: loss, AdamW with a warmup schedule, validation in nats and bits per byte."""

    def __init__(
        self,
        cfg: RunConfig,
        model: nn.Module,
        *,
        total: int,
        val_windows: torch.Tensor,
        byte_lengths: torch.Tensor,
        tokenizer_spec: dict,
    ):
        super().__init__()
        self.cfg, self.model, self.total = cfg, model, total
        self.val_windows = val_windows  # (n_val, t + 1), all ranks hold all; each evaluates its share
        self.byte_lengths = byte_lengths  # (vocab,)
        self.tokenizer_spec = tokenizer_spec
        kernels.set_mode(cfg.train.kernels)
        # The training forward, compiled or not. Kept outside the module tree (a plain attribute), so state-dict
        # keys keep their names, and the eager model stays at hand for a mixer whose step checks ask for it.
        object.__setattr__(self, "step_model", torch.compile(model, fullgraph=True) if compiles(cfg) else model)
        self.fallbacks: list[dict] = []  # steps whose update a mixer's step check withheld
        self.elapsed_before = 0.0
        self.step_loss: float | None = None
        self.step_grad_norm: float | None = None
        self.step_lr: float | None = None
        self.step_layer_grads: list[float] | None = None
        self.diverged: dict | None = None
        self._loss_sum: torch.Tensor | None = None  # summed over the passes of the current step

    def forward(self, idx):
        return self.model(idx)

    def training_step(self, batch, batch_idx):
        if int(batch["step"]) != self.global_step:
            raise RuntimeError(f"data step {int(batch['step'])} does not match optimizer step {self.global_step}")
        logits = self.step_model(batch["x"])  # (b, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())
        self._loss_sum = loss.detach() if int(batch["micro"]) == 0 else self._loss_sum + loss.detach()
        self.log("train_loss", loss.detach(), prog_bar=True, batch_size=batch["x"].shape[0])
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Gradients are synchronized across ranks here and not yet clipped.
        grad_norm = global_grad_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        mean = self._loss_sum.float() / self.trainer.accumulate_grad_batches
        loss = float(self.trainer.strategy.reduce(mean, reduce_op="mean"))
        self.step_loss, self.step_grad_norm = loss, grad_norm
        note = self.model.mixer.step_checks()  # here, where the step has waited for the device already
        if note is not None:
            # The update this step computed is withheld, and the eager model, whose mixer now takes its guarded
            # path, trains from the next step on.
            self.fallbacks.append({"step": self.global_step + 1, "reason": note})
            print(f"depthmem: step {self.global_step + 1}: {note}; this step's update is skipped.", flush=True)
            for p in self.model.parameters():
                p.grad = None
            object.__setattr__(self, "step_model", self.model)
        self.step_lr = optimizer.param_groups[0]["lr"]
        step = self.global_step + 1
        if step % self.cfg.train.val_every_steps == 0 or step == self.total:
            self.step_layer_grads = layer_grad_norms(self.model)
        if is_diverged(loss, grad_norm, self.cfg.train.max_grad_norm_diverge):
            self.diverged = {"step": step, "loss": loss, "grad_norm": grad_norm}
            for p in self.model.parameters():
                p.grad = None  # skip this update: the weights stay those of the last good step
            self.trainer.should_stop = True

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        # Only the tokens go to the device: the step counters are read on the host every pass, and a counter on
        # the GPU would make each read wait for the device.
        return {**batch, "x": batch["x"].to(device), "y": batch["y"].to(device)}

    def configure_optimizers(self):
        t = self.cfg.train
        opt = torch.optim.AdamW(
            param_groups(self.model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2), foreach=False
        )
        total, cfg = self.total, self.cfg

        def factor(step):
            return lr_factor(
                step,
                total=total,
                warmup=cfg.train.warmup_steps,
                schedule=cfg.train.schedule,
                min_ratio=cfg.train.min_lr_ratio,
                decay_fraction=cfg.train.decay_fraction,
            )

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """Validation loss (nats per token) and bits per byte over the fixed validation windows, all ranks."""
        rank, world = self.trainer.global_rank, self.trainer.world_size
        mine = self.val_windows[rank::world]
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # nats, tokens, bytes
        was_training = self.model.training
        self.model.eval()
        per = max(1, self.cfg.train.micro_batch_size or self.cfg.train.batch_size // world)
        with self.trainer.precision_plugin.forward_context():
            for w in mine.split(per):
                w = w.to(self.device)
                logits = self.model(w[:, :-1])  # (b, t, vocab)
                nats = F.cross_entropy(logits.flatten(0, 1).float(), w[:, 1:].flatten(), reduction="sum")
                totals[0] += nats.double()
                totals[1] += w[:, 1:].numel()
                totals[2] += self.byte_lengths.to(self.device)[w[:, 1:]].sum().double()
        self.model.train(was_training)
        totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        nats, tokens, n_bytes = (float(x) for x in totals)
        return nats / tokens, nats / math.log(2) / max(n_bytes, 1.0)

    def on_save_checkpoint(self, checkpoint):
        checkpoint["depthmem"] = {
            "config": self.cfg.to_dict(),
            "tokenizer": self.tokenizer_spec,
            "total_steps": self.total,
            "rng": _rng_states(),
            "elapsed_s": self.elapsed_before + (time.time() - self._segment_start),
        }

    def on_load_checkpoint(self, checkpoint):
        extra = checkpoint.get("depthmem", {})
        if "rng" in extra:
            _set_rng_states(extra["rng"])
        self.elapsed_before = float(extra.get("elapsed_s", 0.0))

    def on_fit_start(self):
        self._segment_start = time.time()


class RunFiles(pl.Callback):
    """Writes metrics.csv, layers.csv, status.json and ckpt/last.ckpt as training goes (rank 0 writes)."""

    def __init__(self, cfg: RunConfig, run_dir: Path, ckpt_path: Path, resume_step: int, plain_logs: bool):
        self.cfg, self.run_dir, self.ckpt_path, self.plain_logs = cfg, run_dir, ckpt_path, plain_logs
        self.metrics_log = CsvLog(
            run_dir / "metrics.csv", METRICS_COLUMNS, _read_rows(run_dir / "metrics.csv", resume_step)
        )
        self.layers_log = CsvLog(
            run_dir / "layers.csv", LAYERS_COLUMNS, _read_rows(run_dir / "layers.csv", resume_step)
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
        if trainer.is_global_zero:
            _, trace = traced_forward(module.model, module.val_windows[:4, :-1].to(module.device))
            grads = module.step_layer_grads if step else None
            self.layers_log.add(
                [
                    {"step": step, **s, "grad_norm": None if grads is None else grads[l]}
                    for l, s in enumerate(layer_stats(module.model, trace))
                ]
            )
            learned = module.model.mixer.learned_statistics(trace)
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


from lightning.pytorch.callbacks import TQDMProgressBar  # noqa: E402


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


def _cluster_environment():
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    # Under submitit, which owns requeueing, Lightning must neither requeue nor exit on its own signals.
    if "SLURM_NTASKS" in os.environ:
        return SLURMEnvironment(auto_requeue=False)
    return LightningEnvironment()


def _trainer(cfg: RunConfig, callbacks: list, run_dir: Path, total: int, plain_logs: bool) -> pl.Trainer:
    from lightning.pytorch.strategies import DDPStrategy

    t = cfg.train
    accelerator = t.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    precision = t.precision
    if precision == "auto":
        precision = "bf16-mixed" if accelerator in ("gpu", "cuda") else "32-true"
    env, ckpt_io = _cluster_environment(), AtomicCheckpointIO()
    world = t.devices * t.num_nodes
    if t.strategy == "auto" and world > 1:
        strategy = DDPStrategy(
            cluster_environment=env,
            checkpoint_io=ckpt_io,
            process_group_backend="gloo" if accelerator == "cpu" else "nccl",
        )
        plugins = []
    else:
        strategy, plugins = t.strategy, [env, ckpt_io]
    try:
        loggers = _loggers(cfg, run_dir)
        return pl.Trainer(
            accelerator=accelerator,
            devices=t.devices,
            num_nodes=t.num_nodes,
            strategy=strategy,
            plugins=plugins,
            precision=precision,
            max_steps=total,
            max_epochs=-1,
            gradient_clip_val=t.grad_clip or None,
            deterministic=True if accelerator == "cpu" else "warn",
            logger=loggers or False,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=not plain_logs,
            log_every_n_steps=t.log_every_steps,
            limit_val_batches=0,
            accumulate_grad_batches=accumulation(cfg),
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            default_root_dir=str(run_dir),
        )
    except ModuleNotFoundError as e:
        raise UsageError(
            f"train.logger={t.logger} needs a package that is not installed: pip install {e.name or t.logger}."
        ) from None


def tracking_id(run_dir: Path) -> str:
    """The run's W&B id: made once per run directory and kept in ``tracking.json``, so a requeued job resumes the
    same W&B run while two sweeps with a run folder of the same name never share one."""
    import uuid

    from lightning.fabric.utilities.rank_zero import rank_zero_only

    path = run_dir / "tracking.json"
    record = read_json(path, default={}) or {}
    if not record.get("wandb_id") and rank_zero_only.rank != 0:
        return run_dir.name  # other ranks never open the W&B run; only rank 0 makes the id
    if not record.get("wandb_id"):
        record["wandb_id"] = f"{run_dir.name[:100]}-{uuid.uuid4().hex[:8]}"
        atomic_write_json(path, record)
    return record["wandb_id"]


def _loggers(cfg: RunConfig, run_dir: Path) -> list:
    """TensorBoard or W&B, each given the full resolved config as the run's hyperparameters."""
    t = cfg.train
    if t.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False)
    elif t.logger == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
        import variants

        # Project from the grid (train.wandb_project) or the sweep's name; one group per sweep, one job type per
        # variant, the run id as the name.
        # W&B's own settings win over the run folder: WANDB_DIR for the files (Lightning's save_dir would
        # override it), WANDB_PROJECT where the grid names no project.
        logger = WandbLogger(
            save_dir=tracking.wandb_dir(run_dir),
            project=t.wandb_project or os.environ.get("WANDB_PROJECT") or cfg.name or "depthmem",
            group=cfg.name or None,
            job_type=variants.canonical(cfg.variant),
            name=run_dir.name,
            id=tracking_id(run_dir),
            resume="allow",
        )
    else:
        return []
    logger.log_hyperparams(cfg.to_dict())
    if t.logger == "tensorboard":
        _tensorboard_hparams(logger, cfg)
    return [logger]


def _tensorboard_hparams(logger, cfg: RunConfig) -> None:
    """The config in TensorBoard's HParams view, paired with the val_loss curve the run logs (Lightning writes
    it only together with a placeholder metric)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank != 0:
        return
    from torch.utils.tensorboard.summary import hparams

    writer = logger.experiment._get_file_writer()
    for summary in hparams(_flatten(cfg.to_dict()), {"val_loss": 0.0}):
        writer.add_summary(summary)


def _flatten(d: dict, prefix: str = "") -> dict:
    """``{"train": {"lr": 1e-3}}`` as ``{"train/lr": 1e-3}``; lists and None as text, which HParams takes."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return out


def _finish_tracking(cfg: RunConfig, rank0: bool, *, failed: bool) -> None:
    """Close the W&B run, so its record (offline: the run file) is complete before the job goes on or ends."""
    if cfg.train.logger == "wandb" and rank0:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=1 if failed else 0)


def _check_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"Cannot create the run directory {str(run_dir)!r}: {e.strerror}.") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(f"The run directory {str(run_dir)!r} is not writable.")


def _model_words(cfg: RunConfig) -> str:
    return (
        f"variant {cfg.variant!r}, preset {cfg.model.preset!r}, d_model {cfg.model.d_model}, "
        f"{cfg.model.n_layers} layers, seed {cfg.train.seed}"
    )


def _check_resumable(ckpt_path: Path, cfg: RunConfig, model: nn.Module) -> int:
    """The step a checkpoint resumes from, once it is known to load and to hold this run's model."""

    try:
        ckpt = read_checkpoint(ckpt_path)
    except UsageError:
        raise UsageError(
            f"The checkpoint {str(ckpt_path)!r} is truncated or corrupt, so the run cannot resume "
            "from it; restore an earlier copy or start over with --no-resume."
        ) from None
    saved = (ckpt.get("depthmem") or {}).get("config")
    if saved is not None:
        try:
            other = RunConfig.from_dict(saved, source=str(ckpt_path))
        except UsageError:
            other = None
        if other is None or rundir.config_hash(other, with_seed=True) != rundir.config_hash(cfg, with_seed=True):
            what = _model_words(other) if other is not None else "another config"
            raise UsageError(
                f"The checkpoint {str(ckpt_path)!r} belongs to a different run ({what}), not to this "
                f"one ({_model_words(cfg)}); remove it or start over with --no-resume."
            )
    # Even without a recorded config, the weights must fit this model name for name and shape.
    state = {
        k[len("model.") :]: tuple(v.shape) for k, v in (ckpt.get("state_dict") or {}).items() if k.startswith("model.")
    }
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if state != expected:
        raise UsageError(
            f"The checkpoint {str(ckpt_path)!r} holds weights of another model than this run's "
            f"({_model_words(cfg)}); remove it or start over with --no-resume."
        )
    return int(ckpt.get("global_step", 0))


def train(cfg: RunConfig, run_dir: str | os.PathLike, *, resume: bool = True) -> Path:
    """Train ``cfg`` into ``run_dir`` (resuming its last checkpoint unless ``resume=False``); returns run_dir."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch import seed_everything

    import variants

    run_dir = Path(run_dir)
    rank0 = rank_zero_only.rank == 0
    _check_run_dir(run_dir)
    ckpt_path = run_dir / "ckpt" / "last.ckpt"
    earlier = rundir.read_config(run_dir) if (run_dir / "config.json").exists() else None
    if earlier is not None and rundir.config_hash(earlier, with_seed=True) != rundir.config_hash(cfg, with_seed=True):
        raise UsageError(f"{run_dir} holds a run with a different config; give this run another --out directory.")
    status = rundir.read_status(run_dir)
    if resume and status.get("state") == "done" and (run_dir / "summary.json").exists():
        if rank0:
            print(f"depthmem: {run_dir} is already done (step {status.get('step')}); nothing to train.", flush=True)
        return run_dir
    world = cfg.train.devices * cfg.train.num_nodes
    if cfg.train.batch_size % world:
        raise UsageError(
            f"train.batch_size ({cfg.train.batch_size}) must be divisible by the number of processes ({world})."
        )
    accumulation(cfg)
    seq_len = seq_len_of(cfg)
    if seq_len > cfg.model.max_seq_len:
        raise UsageError(f"train.seq_len ({seq_len}) must not exceed model.max_seq_len ({cfg.model.max_seq_len}).")
    variants.validate(cfg.variant, d_model=cfg.model.d_model, n_layers=cfg.model.n_layers)

    tok = datalib.get_tokenizer(cfg)
    tokens = datalib.load_tokens(cfg, tok)
    datalib.check_sizes(tokens, seq_len, need_val=cfg.train.val_batches > 0)
    val = datalib.val_windows(tokens.val, count=max(1, cfg.train.val_batches * cfg.train.batch_size), seq_len=seq_len)
    byte_lengths = torch.tensor(tok.token_byte_lengths() + [0] * (cfg.model.vocab_size - tok.vocab_size))

    seed_everything(cfg.train.seed, workers=True, verbose=False)
    for noise in (".*does not have many workers.*", ".*The `srun` command is available.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", noise)  # advice that does not apply to these runs
    model = build_model(cfg.model, cfg.variant)
    total = total_steps(cfg)
    resume_from = ckpt_path if resume and ckpt_path.exists() else None
    resume_step = 0
    if resume_from is not None:
        resume_step = _check_resumable(resume_from, cfg, model)
    if rank0:
        remove_stale_temps(run_dir, run_dir / "ckpt")  # what a killed write of this run left behind
        # Weights and both AdamW moments in float32: the checkpoint's size, to the first digit.
        check_checkpoint_room(ckpt_path, 12 * sum(p.numel() for p in model.parameters()))
        rundir.write_config(run_dir, cfg)
        rundir.write_env(run_dir)
        toklib.save_to_run(tok, run_dir)
        if resume_from is None:
            for name in ("metrics.csv", "layers.csv", "summary.json", "mixing.json", DEPTH_STATS):
                (run_dir / name).unlink(missing_ok=True)
        what = f"resuming at step {resume_step}" if resume_from else "starting"
        rundir.write_status(
            run_dir, "running", step=resume_step, last_loss=status.get("last_loss"), message=f"{what}, {total} steps"
        )
    plain_logs = not sys.stderr.isatty()
    if rank0 and plain_logs:
        print(
            f"depthmem: {cfg.variant} {cfg.model.preset}, {model.num_params():,} parameters, {total} steps "
            f"of {cfg.train.batch_size}x{seq_len} tokens = {total * cfg.train.batch_size * seq_len:,} tokens "
            f"({what}); writing {run_dir}",
            flush=True,
        )

    module = LitDecoder(
        cfg, model, total=total, val_windows=torch.from_numpy(val), byte_lengths=byte_lengths, tokenizer_spec=tok.spec()
    )
    files = RunFiles(cfg, run_dir, ckpt_path, resume_step, plain_logs)
    costs = StepCosts(resume_step, total)
    _quiet_lightning()
    callbacks = [files, costs] if plain_logs else [files, costs, StepProgressBar(files)]
    callbacks.append(SyncedStop())  # after RunFiles, whose step-end work (checkpoints, validation) comes first
    trainer = _trainer(cfg, callbacks, run_dir, total, plain_logs)
    dataset = StepBatches(
        tokens.train, cfg, total, lambda: (trainer.global_step, trainer.global_rank, trainer.world_size)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)
    start = time.time()
    try:
        trainer.fit(
            module, train_dataloaders=loader, ckpt_path=str(resume_from) if resume_from else None, weights_only=True
        )
    except BaseException as e:
        _finish_tracking(cfg, rank0, failed=True)
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        # Lightning turns Ctrl-C into a graceful stop and then SystemExit; a signal is an interruption, not a failure.
        # (trainer.interrupted alone says nothing: Lightning sets it for every exception that leaves fit.)
        signal_name = (
            "SIGTERM"
            if isinstance(e, SIGTERMException)
            else "Ctrl-C"
            if isinstance(e, KeyboardInterrupt) or (isinstance(e, SystemExit) and trainer.interrupted)
            else None
        )
        if rank0:
            try:
                if signal_name:
                    rundir.write_status(
                        run_dir,
                        "interrupted",
                        step=trainer.global_step,
                        last_loss=files.last_loss,
                        ckpt_step=files.ckpt_step,
                        message=f"stopped by {signal_name} at step {trainer.global_step}; the last "
                        f"checkpoint is at step {files.ckpt_step}",
                    )
                else:
                    rundir.write_status(
                        run_dir,
                        "failed",
                        step=trainer.global_step,
                        last_loss=files.last_loss,
                        message=f"failed: {type(e).__name__}: {e}; run the same command again to "
                        f"resume from the last checkpoint (step {files.ckpt_step})",
                    )
            except DiskFull:
                pass  # the disk that refused the run's files refuses this one too; the error below says why
        if signal_name:
            raise RunFailed(
                f"Training was stopped by {signal_name} at step {trainer.global_step}; run the same "
                f"command again to resume from step {files.ckpt_step}."
            ) from None
        raise
    _finish_tracking(cfg, rank0, failed=module.diverged is not None)
    if module.diverged is not None:
        d = module.diverged
        kept = f"the last good checkpoint is {ckpt_path}" if ckpt_path.exists() else "no checkpoint was saved yet"
        message = f"diverged at step {d['step']} (loss {d['loss']:.4g}, gradient norm {d['grad_norm']:.4g}); {kept}"
        if rank0:
            rundir.write_status(run_dir, "diverged", step=d["step"], last_loss=files.last_loss, message=message)
        raise RunFailed(f"The run {message}.")
    if not rank0:
        return run_dir

    wall = module.elapsed_before + (time.time() - start)
    measured = [r for r in files.metrics if r.get("val_loss") not in (None, "")]
    val_loss = float(measured[-1]["val_loss"]) if measured else None
    val_bpb = float(measured[-1]["val_bpb"]) if measured else None
    mixer = model.mixer
    from harness.model.costs import matched_width_cost

    widened_params, widened_flops = matched_width_cost(cfg.model, mixer)  # nonzero only for preln(match=...)
    summary = {
        "val_loss": val_loss,
        "val_bpb": val_bpb,
        "val_ppl": math.exp(val_loss) if val_loss is not None else None,
        "step": trainer.global_step,
        "tokens": trainer.global_step * files.tokens_per_step,
        "train_steps": total,
        "train_tokens": total * files.tokens_per_step,
        "params": model.num_params(),
        "extra_params": _plus(_safe_cost(mixer.extra_params), widened_params),
        "stream_floats_per_token": _safe_cost(mixer.stream_floats_per_token),
        "extra_flops_per_token": _plus(_safe_cost(mixer.extra_flops_per_token), widened_flops),
        "tokens_per_s": files.segment_tokens_per_s,
        **costs.summary(module),
        "skipped_updates": module.fallbacks,
        "wall_s": wall,
    }
    if files.depth_stats:
        summary["depth_memory"] = {k: v for k, v in files.depth_stats[-1].items() if k != "step"}
    model.float().eval()
    try:
        mixing = diagnostics.mixing_summary(model, module.val_windows[:4, :-1])
        atomic_write_json(run_dir / "mixing.json", mixing)
    except NotImplementedError:
        pass  # a variant without a mixing matrix still trains; it simply has no mixing.json
    atomic_write_json(run_dir / "summary.json", summary)
    rundir.write_status(
        run_dir,
        "done",
        step=trainer.global_step,
        last_loss=files.last_loss,
        message=f"done: val_loss {val_loss if val_loss is None else round(val_loss, 4)}",
    )
    return run_dir
