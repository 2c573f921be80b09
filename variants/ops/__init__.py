"""Per-token dot products and normalizations shared by the depth mixers, in plain PyTorch.

Each reduces over the last axis and keeps it as an axis of 1 where the result is a scalar per vector, so it
broadcasts back over the vector. Autograd differentiates them like any other operation, eager or compiled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mix_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32 for mixing weights, never below the input precision (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aᵀb`` over the last axis, kept as an axis of 1: (..., c) and (..., c) of the same shape -> (..., 1)."""
    # A batch of 1×c by c×1 products: several times faster on CPU than a product and a sum over a short last axis.
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1)


def rms_scale(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``1 / sqrt(mean(x²) + eps)`` over the last axis, kept as an axis of 1.

    A gainless RMSNorm is ``x · rms_scale(x)``."""
    return torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def unit(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``x / max(|x|, eps)`` over the last axis, as ``torch.nn.functional.normalize``.

    The clamped norm keeps a zero vector at zero, and its gradient finite: there the norm's own gradient is zero
    and only ``1 / eps`` times the incoming gradient passes."""
    return F.normalize(x, dim=-1, eps=eps)


def normalized_projection(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, dims: int = 1) -> torch.Tensor:
    """``RMSNorm(x) W`` with a gainless norm over the last ``dims`` axes of ``x`` taken as one: (..., c) by (c, m)
    -> (..., m), with ``c`` those axes' size.

    The product's rows are scaled instead of ``x``: the same values, without a normalized copy of ``x`` (``n·d``
    floats per token in mHC) made in forward and kept for backward."""
    flat = x.flatten(-dims)
    return (flat @ weight) * rms_scale(flat, eps)
