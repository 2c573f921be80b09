"""LDM-RLS's write, one Gram–Schmidt step of the dual form: the fused kernel where it runs
(``variants.kernels.active``), the plain PyTorch of ``naive.py`` elsewhere. Shapes: ``k`` (R, k), ``v`` (R, v),
``ridge`` (R,), ``keys`` (R, n, k), ``values`` (R, n, v) -> ``k̃`` (R, k), ``ṽ`` (R, v), margin (R,)."""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.whiten import naive


def whiten(
    k: torch.Tensor, v: torch.Tensor, ridge: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if kernels.active(k) and k.dtype == v.dtype == ridge.dtype == keys.dtype == values.dtype:
        from variants.kernels.whiten import fused

        args = (t.contiguous() for t in (k, v, ridge, keys, values))
        kt, vt, margin, _, _ = fused.whiten(*args)
        return kt, vt, margin
    return naive.whiten(k, v, ridge, keys, values)
