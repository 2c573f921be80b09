"""DenseFormer's depth-weighted average over a depth buffer (``variants/kernels/buffer.py``): ``Σ_s α_s X_s`` over
the buffer's first ``n`` sources, (capacity, R, d) depth-major, with ``α`` (n,) -> (R, d).

No Triton kernel: the sources lie contiguous in the buffer, so the average is one matrix-vector product,
``αᵀ X`` over the (n, R·d) view, which reads each source once on any device; its backward is another,
``∂α = X ∂y``, and a rank-one update ``∂X += α ∂yᵀ`` that adds each source's gradient into the buffer's in place.
All in ``α``'s dtype (at least float32); sources stored narrower are widened first.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from variants.kernels.buffer import DepthBuffer, gradients, token_like


def buffer_read(buffer: DepthBuffer, alpha: torch.Tensor) -> torch.Tensor:
    """``Σ_s α_s X_s`` over ``buffer``'s one field so far, (R, d) in ``alpha``'s dtype."""
    (values,) = buffer.slots
    if len(alpha) != buffer.n:
        raise ValueError(f"{len(alpha)} weights for {buffer.n} sources")
    return read(alpha, values, buffer.n, buffer.token)


def _flat(values: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    return values[:n].flatten(1).to(dtype)  # (n, R·d)


@torch.library.custom_op("depthmem::weighted_buffer_read", mutates_args=())
def read(alpha: torch.Tensor, values: torch.Tensor, n: int, token: torch.Tensor | None) -> torch.Tensor:
    return (alpha @ _flat(values, n, alpha.dtype)).view(values.shape[1:])


@read.register_fake
def _(alpha, values, n, token):
    return values.new_empty(values.shape[1:], dtype=alpha.dtype)


@torch.library.custom_op("depthmem::weighted_buffer_read_backward", mutates_args=("grad_values",))
def read_backward(
    dy: torch.Tensor, alpha: torch.Tensor, values: torch.Tensor, grad_values: torch.Tensor, n: int
) -> torch.Tensor:
    """``∂α``; each source's ``α_s ∂y`` is added into ``grad_values``."""
    dy = dy.flatten().to(alpha.dtype)
    grad = grad_values[:n].flatten(1)
    if grad.dtype == alpha.dtype:
        grad.addr_(alpha, dy)
    else:
        grad += torch.outer(alpha, dy).to(grad.dtype)
    return _flat(values, n, alpha.dtype) @ dy


@read_backward.register_fake
def _(dy, alpha, values, grad_values, n):
    return torch.empty_like(alpha)


def _read_setup(ctx, inputs, output):
    alpha, values, n, token = inputs
    ctx.save_for_backward(alpha)
    # The buffer is taken by reference, not saved: later writes fill later slots, never the first n.
    ctx.values, ctx.n, ctx.chained = values, n, token is not None


def _read_grad(ctx, dy):
    (alpha,) = ctx.saved_tensors
    (grad_values,) = gradients((ctx.values,))
    dalpha = read_backward(dy, alpha, ctx.values, grad_values, ctx.n)
    return dalpha, None, None, token_like(alpha) if ctx.chained else None


read.register_autograd(_read_grad, setup_context=_read_setup)


@register_flop_formula(torch.ops.depthmem.weighted_buffer_read)
def _read_flops(alpha, values, n, token, out_shape=None) -> int:
    return 2 * n * values[1] * values[2]


@register_flop_formula(torch.ops.depthmem.weighted_buffer_read_backward)
def _read_backward_flops(dy, alpha, values, grad_values, n, out_shape=None) -> int:
    return 4 * n * values[1] * values[2]
