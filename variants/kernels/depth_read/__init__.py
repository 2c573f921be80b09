"""LDM's depth read ``m = Σ_i v_i (k_iᵀ q)``: the fused kernel where it runs (``variants.kernels.active``), the
plain PyTorch of ``naive.py`` elsewhere. Shapes: ``q`` (R, k), ``keys`` (R, n, k), ``values`` (R, n, v) -> (R, v)."""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.depth_read import naive


def depth_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if kernels.active(q) and q.dtype == keys.dtype == values.dtype:
        from variants.kernels.depth_read import fused

        return fused.depth_read(q.contiguous(), keys.contiguous(), values.contiguous())
    return naive.depth_read(q, keys, values)
