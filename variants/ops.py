"""Per-token dot products and normalizations with their backward passes written out.

The depth mixers take many small reductions per token: dots over a group of ``d/G`` channels, norms over ``d`` or
``n·d`` channels. Written with elementwise products and sums, each costs several passes over memory on CPU, and
autograd adds more in backward (it materializes broadcast quotients and masks); the functions here take one pass
where one will do, and their backward passes are the textbook formulas. Each is tested against autograd on the
plain formula in float64 (``tests/test_fast_paths.py``); docs/benchmarks.md has the measurements.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


def _bdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # A batch of 1×c by c×1 products: several times faster on CPU than a product and a sum over a short last axis.
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1)


class _Dot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _bdot(a, b)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        # Elementwise, not the transposed batched products autograd would take (c×1 by 1×1 ones are slow).
        return g * b if ctx.needs_input_grad[0] else None, g * a if ctx.needs_input_grad[1] else None


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``aᵀb`` over the last axis, kept as an axis of 1: (..., c) and (..., c) of the same shape -> (..., 1)."""
    return _Dot.apply(a, b)


class _RMSScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        r = torch.rsqrt(_bdot(x, x) / x.shape[-1] + eps)
        ctx.save_for_backward(x, r)
        return r

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, r = ctx.saved_tensors
        # d r / d x = -r³ x / c
        return x * (g * r.pow(3) / -x.shape[-1]), None


def rms_scale(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``1 / sqrt(mean(x²) + eps)`` over the last axis, kept as an axis of 1.

    A gainless RMSNorm is ``x · rms_scale(x)``."""
    return _RMSScale.apply(x, eps)


class _Unit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        n = _bdot(x, x).sqrt().clamp_min(eps)
        u = x / n
        ctx.save_for_backward(u, n)
        return u

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        u, n = ctx.saved_tensors
        # The tangential part of g, over the norm (where the norm was clamped this is exact only away from 0).
        return torch.addcmul(g, u, _bdot(u, g), value=-1.0).div_(n), None


def unit(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """``x / max(|x|, eps)`` over the last axis, as ``torch.nn.functional.normalize``."""
    return _Unit.apply(x, eps)
