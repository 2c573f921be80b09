"""AttnRes's depth read ``Σ_s softmax_s(w · RMSNorm(v_s)) v_s``: the fused kernel where it runs
(``variants.kernels.active``), the plain PyTorch of ``naive.py`` elsewhere. Shapes: ``values`` (R, S, d),
``query`` (d,) -> (R, d), in the dtype PyTorch gives the inputs together (the sources may be bfloat16, the query
float32)."""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.softmax_read import naive


def softmax_read(values: torch.Tensor, query: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    dtype = kernels.result_dtype(values, query)
    if kernels.active(values, query):
        from variants.kernels.softmax_read import fused

        return fused.softmax_read(values.contiguous(), query.contiguous(), eps)[0].to(dtype)
    return naive.softmax_read(values.to(dtype), query.to(dtype), eps)
