"""The decoder under Lightning: its batches, its loss and optimiser, its validation in nats and bits per byte, and
what it adds to a checkpoint.

Batches are keyed by (seed, step) and every checkpoint holds optimizer, scheduler, step and RNG states, so a run
resumed from a checkpoint continues exactly where it left off.

Bits per byte = total validation nats / ln 2 / total UTF-8 bytes the validation target tokens stand for (each
byte-level token is exactly its bytes; the end-of-text separator counts none).
"""

from __future__ import annotations

import io
import math
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.io import TorchCheckpointIO
from torch import nn

from harness.config import RunConfig
from harness.data import corpus as datalib
from harness.model.checkpoint import save_with_checksum
from harness.training.budget import seq_len_of
from harness.training.optim import (
    accumulation,
    compiles,
    divergence,
    global_grad_norm,
    layer_grad_norms,
    lr_factor,
    param_groups,
    rng_states,
    set_rng_states,
)
from harness.training.sharding import is_sharded, least_over_ranks, shard
from variants import kernels


class AtomicCheckpointIO(TorchCheckpointIO):
    """Checkpoints written atomically with their checksum, the one replaced kept beside (``harness.model.checkpoint``):
    a kill mid-save leaves the previous checkpoint intact, and damage after saving is named at load."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        save_with_checksum(path, buf.getvalue())


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
        self.step_layer_grads: torch.Tensor | None = None  # per layer, on the device until a validation logs it
        self.diverged: dict | None = None
        self._loss_sum: torch.Tensor | None = None  # summed over the passes of the current step

    def forward(self, idx):
        return self.model(idx)

    def configure_model(self):
        # Only under train.strategy=fsdp (Lightning's model-parallel strategy gives the module its device mesh).
        mesh = getattr(self, "_device_mesh", None)
        if mesh is not None and not is_sharded(self.model.parameters()):
            shard(self.model, mesh["data_parallel"])

    def training_step(self, batch, batch_idx):
        if int(batch["step"]) != self.global_step:
            raise RuntimeError(f"data step {int(batch['step'])} does not match optimizer step {self.global_step}")
        logits = self.step_model(batch["x"])  # (b, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())
        self._loss_sum = loss.detach() if int(batch["micro"]) == 0 else self._loss_sum + loss.detach()
        # The bar's alone: the loggers get each step's row once, from RunFiles, on the optimizer's step axis (Lightning
        # would send the micro batch's loss again at step - 1, with an ``epoch`` series beside it).
        self.log("train_loss", loss.detach(), prog_bar=True, logger=False, batch_size=batch["x"].shape[0])
        return loss

    def on_before_optimizer_step(self, optimizer):
        # Gradients are synchronized across ranks here and not yet clipped.
        grad_norm = global_grad_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        mean = self._loss_sum.float() / self.trainer.accumulate_grad_batches
        loss = float(self.trainer.strategy.reduce(mean, reduce_op="mean"))
        self.step_loss, self.step_grad_norm = loss, grad_norm
        # Here, where the step has waited for the device already; agreed over the ranks, so that every replica
        # switches and withholds this update together.
        note = self.model.mixer.step_checks(least_over_ranks)
        if note is not None:
            # The update this step computed is withheld; the mixer has changed how it computes from the next step on
            # (a compiled model recompiles for it).
            self.fallbacks.append({"step": self.global_step + 1, "reason": note})
            if self.global_rank == 0:  # every rank took the same decision
                print(f"depthmem: step {self.global_step + 1}: {note}; this step's update is skipped.", flush=True)
            for p in self.model.parameters():
                p.grad = None
        self.step_lr = optimizer.param_groups[0]["lr"]
        step = self.global_step + 1
        if step % self.cfg.train.val_every_steps == 0 or step == self.total:
            self.step_layer_grads = layer_grad_norms(self.model)
        reason = divergence(step, loss, grad_norm, self.cfg.train.max_grad_norm_diverge)
        if reason is not None:
            self.diverged = {"step": step, "reason": reason}
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
            "rng": rng_states(),
            "elapsed_s": self.elapsed_before + (time.time() - self._segment_start),
        }

    def on_load_checkpoint(self, checkpoint):
        extra = checkpoint.get("depthmem", {})
        if "rng" in extra:
            set_rng_states(extra["rng"])
        self.elapsed_before = float(extra.get("elapsed_s", 0.0))

    def on_fit_start(self):
        self._segment_start = time.time()
