"""mHC's projection onto doubly stochastic matrices in plain PyTorch: ``exp(logits)``, then ``iters`` column and row
normalizations. Shapes: ``logits`` (R, n, n) -> (R, n, n)."""

from __future__ import annotations

import torch


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    # Sinkhorn is invariant to a common factor, so subtracting the max only guards exp against overflow.
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-2, keepdim=True)  # columns sum to 1
        m = m / m.sum(-1, keepdim=True)  # rows sum to 1
    return m
