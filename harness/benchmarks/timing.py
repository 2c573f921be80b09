"""Timing a training step: one step without an optimizer, and seconds per step with the device synchronised.

Every benchmark here (the cost benchmark, ``compile``, ``gpu``, the self-check) times through these, so their
numbers count the same work.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_fn(model, idx, targets, dtype: str) -> Callable[[], None]:
    """One training step without an optimizer: zero the gradients, forward, cross-entropy, backward."""
    device_type = idx.device.type
    autocast = (
        (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if dtype == "bf16" else contextlib.nullcontext
    )

    def step():
        model.zero_grad(set_to_none=True)
        with autocast():
            logits = model(idx)  # (b, t, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()

    return step


def time_steps(step: Callable[[], None], n_steps: int, device: torch.device) -> float:
    """Seconds per step, averaged over ``n_steps`` back-to-back steps."""
    sync(device)
    start = time.perf_counter()
    for _ in range(n_steps):
        step()
    sync(device)
    return (time.perf_counter() - start) / n_steps
