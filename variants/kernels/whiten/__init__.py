"""LDM-RLS's write, one Gram–Schmidt step of the dual form: the fused kernel where it runs
(``variants.kernels.active``), the plain PyTorch of ``naive.py`` elsewhere. Shapes: ``k`` (R, k), ``v`` (R, v),
``ridge`` (R,), ``keys`` (R, n, k), ``values`` (R, n, v) -> ``k̃`` (R, k), ``ṽ`` (R, v), margin (R,), in the
dtype PyTorch gives the inputs together (the earlier writes may be bfloat16, this one float32)."""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.whiten import naive


def whiten(
    k: torch.Tensor, v: torch.Tensor, ridge: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    inputs = (k, v, ridge, keys, values)
    dtype = kernels.result_dtype(*inputs)
    if kernels.active(*inputs):
        from variants.kernels.whiten import fused

        kt, vt, margin, _, _ = fused.whiten(*(t.contiguous() for t in inputs))
        return kt.to(dtype), vt.to(dtype), margin.to(dtype)
    return naive.whiten(*(t.to(dtype) for t in inputs))
