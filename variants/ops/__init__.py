"""Per-token dot products and normalizations with their backward passes written out.

The depth mixers take many small reductions per token: dots over a group of ``d/G`` channels, norms over ``d`` or
``n·d`` channels. Written with elementwise products and sums, each costs several passes over memory on CPU, and
autograd adds more in backward (it materializes broadcast quotients and masks); the functions here take one pass
where one will do, and their backward passes are the textbook formulas. Each is tested against autograd on the
plain formula in float64 (``tests/test_fast_paths.py``); docs/notes/benchmark-history.md has the measurements.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from variants.ops.gradients import GradientSum


def _bdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # A batch of 1×c by c×1 products: several times faster on CPU than a product and a sum over a short last axis.
    return (a.unsqueeze(-2) @ b.unsqueeze(-1)).squeeze(-1)


def _norm(x: torch.Tensor) -> torch.Tensor:
    # A vector's product with itself is not one for _bdot: the norm's own reduction takes 1.2 to 5 times less time,
    # the most on long axes (1 024 floats, mHC's stream), measured on CPU over data that does not fit in cache.
    return torch.linalg.vector_norm(x, dim=-1, keepdim=True)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x²) + eps)`` over the last axis, kept as an axis of 1, outside autograd."""
    return torch.rsqrt(_norm(x).square_().div_(x.shape[-1]).add_(eps))


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
        r = _rms(x, eps)
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
        n = _norm(x).clamp_min_(eps)
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


class _NormalizedProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, dims, grad):
        flat = x.flatten(-dims) if dims > 1 else x
        r = _rms(flat, eps)
        y = (flat @ weight).mul_(r)
        ctx.dims, ctx.grad = dims, grad
        ctx.save_for_backward(x, weight, r, y)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        x, weight, r, y = ctx.saved_tensors
        c, m = weight.shape
        dz = (dy * r).reshape(-1, m)  # the product's gradient, with m a few dozen at most
        dx = dweight = None
        if ctx.needs_input_grad[0]:
            # d r / d x = -r³ x / c and Σ_m dy z r³ = Σ_m dy y r²: the norm's share is x scaled per row. The product's
            # share is added onto it in place, so x's gradient is made once, not twice and summed, or not at all
            # when it goes into the sum of every use of x (``ctx.grad``).
            coef = _bdot(dy, y).mul_(r.square()).div_(-c).view(*dy.shape[:-1], *(1,) * ctx.dims)
            total = x * coef if ctx.grad is None else ctx.grad.add(x, coef)
            total.view(-1, c).addmm_(dz, weight.mT)
            dx = total if ctx.grad is None else None
        if ctx.needs_input_grad[1]:
            # (dzᵀ x)ᵀ, not xᵀ dz: the same product over the long token axis, 1.6 to 2.7 times faster on CPU at
            # HC's and mHC's shapes (docs/notes/benchmark-history.md).
            dweight = (dz.mT @ x.reshape(-1, c)).mT
        return dx, dweight, None, None, None


def normalized_projection(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, dims: int = 1, grad: GradientSum | None = None
) -> torch.Tensor:
    """``RMSNorm(x) W`` with a gainless norm over the last ``dims`` axes of ``x`` taken as one: (..., c) by (c, m)
    -> (..., m), with ``c`` those axes' size.

    The product's rows are scaled instead of ``x``, so the normalized copy of ``x`` and its gradient are never
    made. Backward makes ``x``'s gradient in one buffer, the product's share added in place onto the norm's; given a
    ``GradientSum`` of ``x`` (``variants/ops/gradients.py``), it adds that gradient there instead and returns none."""
    return _NormalizedProjection.apply(x, weight, eps, dims, grad)
