"""The optimiser's side of a training step, without Lightning: the learning-rate schedule, AdamW's parameter groups,
gradient accumulation, the gradient norm and the divergence guard, and the random states a checkpoint carries.

Weight decay (decoupled, AdamW) applies to the matrices of attention and MLP layers and to the weights of the
mixer's ``nn.Linear`` layers only: never to norms, the (tied) embedding, or any other mixer parameter (scalars,
gates, mixing coefficients), whose pull towards zero would change what a variant computes.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch
from torch import nn

from harness.config import RunConfig
from harness.errors import UsageError
from harness.training import budget
from harness.training.sharding import local


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


def micro_batch(cfg: RunConfig) -> int:
    """Sequences one process takes in one forward/backward pass: ``train.micro_batch_size``, else its whole share of
    the global batch."""
    t = cfg.train
    return t.micro_batch_size or t.batch_size // (t.devices * t.num_nodes)


def accumulation(cfg: RunConfig) -> int:
    """Forward/backward passes per optimizer step: the global batch over processes x micro batch."""
    t = cfg.train
    world = t.devices * t.num_nodes
    micro = micro_batch(cfg)
    if t.batch_size % (world * micro):
        raise UsageError(
            f"train.batch_size ({t.batch_size}) must be a multiple of devices x nodes x "
            f"train.micro_batch_size ({t.devices} x {t.num_nodes} x {micro} = {world * micro})."
        )
    return t.batch_size // (world * micro)


def squared_norms(groups: list[list[torch.Tensor]], block: int = 4096) -> torch.Tensor:
    """The sum of squares of each group's gradients, as one float64 tensor on their device (0 for an empty group),
    to float64 accuracy without a float64 copy of them; nothing is read back to the host.

    Each run of ``block`` entries is reduced in its own precision (relative error ~1e-7 over a block, not over
    millions of entries) and the block sums are added in float64: about ten times cheaper per step than
    converting every gradient to float64, which took ~2 % of a ``small`` training step on CPU. A sharded run's
    gradients are each process's shard, so the sums are added over the processes (every rank must call this).
    """
    flat_groups = [g for group in groups for g in group]
    sharded = any(hasattr(g, "to_local") for g in flat_groups)
    device = flat_groups[0].device if flat_groups else None
    totals = torch.zeros(len(groups), dtype=torch.float64, device=device)
    for i, group in enumerate(groups):
        for g in map(local, group):
            flat = g.reshape(-1)
            k = flat.numel() // block * block
            if k:
                low = torch.float32 if g.dtype in (torch.float16, torch.bfloat16) else None  # accumulate in float32
                blocks = torch.linalg.vector_norm(flat[:k].view(-1, block), dim=1, dtype=low)
                totals[i] += blocks.double().square().sum()
            totals[i] += flat[k:].double().square().sum()
    if sharded:
        torch.distributed.all_reduce(totals)
    return totals


def global_grad_norm(grads: list[torch.Tensor], block: int = 4096) -> float:
    """L2 norm of all gradients together (``squared_norms``), read back as a number."""
    return float(squared_norms([grads], block)[0].sqrt())


def layer_grad_norms(model) -> torch.Tensor:
    """L2 norm of each decoder layer's parameter gradients (0 where a layer has none yet), left on the device:
    whoever logs them reads them back where it waits for the device anyway."""
    return squared_norms([[p.grad for p in layer.parameters() if p.grad is not None] for layer in model.layers]).sqrt()


def divergence(step: int, loss: float, grad_norm: float, limit: float) -> str | None:
    """Why step ``step`` stops the run, or None: a non-finite loss, a non-finite gradient norm at a finite loss, or
    a gradient norm above ``limit``. The second is named apart: a loss that is still finite says the model has not
    blown up, so a NaN or inf in its gradient points at the backward pass's numerics, not at the learning rate."""
    if not math.isfinite(loss):
        return f"diverged at step {step} (loss {loss:.4g}, gradient norm {grad_norm:.4g})"
    if not math.isfinite(grad_norm):
        return f"stopped on a non-finite gradient at step {step} with finite loss {loss:.4g}"
    if grad_norm > limit:
        above = f"above train.max_grad_norm_diverge = {limit:g}"
        return f"diverged at step {step} (loss {loss:.4g}, gradient norm {grad_norm:.4g} {above})"
    return None


def rng_states() -> dict:
    # Plain lists and tensors only, so checkpoints load with torch.load(weights_only=True).
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }


def set_rng_states(s: dict) -> None:
    version, state, gauss = s["python"]
    random.setstate((version, tuple(state), gauss))
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(s["torch"])
