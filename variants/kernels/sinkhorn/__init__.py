"""mHC's Sinkhorn projection: the fused kernel where it runs (``variants.kernels.active``) and the matrices are at
most 16×16, the plain PyTorch of ``naive.py`` elsewhere. Shapes: ``logits`` (R, n, n) -> (R, n, n)."""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.sinkhorn import naive

MAX_STREAMS = 16  # one token's matrix stays in a program's registers


def fused_runs(logits: torch.Tensor) -> bool:
    return kernels.active(logits) and logits.shape[-1] <= MAX_STREAMS


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    if fused_runs(logits):
        from variants.kernels.sinkhorn import fused

        return fused.sinkhorn(logits.contiguous(), iters)
    return naive.sinkhorn(logits, iters)
