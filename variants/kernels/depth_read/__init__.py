"""LDM's depth read ``m = Σ_i v_i (k_iᵀ q)``: the fused kernel where it runs (``variants.kernels.active``), the
plain PyTorch of ``naive.py`` elsewhere. Shapes: ``q`` (R, k), ``keys`` (R, n, k), ``values`` (R, n, v) -> (R, v),
in the dtype PyTorch gives the inputs together (the stored keys and values may be bfloat16, the query float32)."""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.depth_read import naive


def depth_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if kernels.active(q, keys, values):
        from variants.kernels.depth_read import fused

        return fused.depth_read(q.contiguous(), keys.contiguous(), values.contiguous())
    dtype = kernels.result_dtype(q, keys, values)
    return naive.depth_read(q.to(dtype), keys.to(dtype), values.to(dtype))
