"""LDM's read of a depth buffer (``variants/kernels/buffer.py``): ``Σ_i v_i (k_iᵀ q)`` over the buffer's first
``n`` writes, keys and values depth-major, (capacity, R, k) and (capacity, R, v), ``q`` (R, k) -> (R, v), with R every
token and group. Its backward adds ``∂k_i`` and ``∂v_i`` into the buffer's gradients in place. The math is
``naive.buffer_read`` and its backward, or the fused kernels where they run (``variants.kernels``).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from variants import kernels
from variants.kernels.buffer import DepthBuffer, gradients, token_like
from variants.kernels.depth_read import naive


def buffer_read(buffer: DepthBuffer, q: torch.Tensor) -> torch.Tensor:
    """``Σ_i v_i (k_iᵀ q)`` over the writes of ``buffer`` (keys, values) so far, in the dtype PyTorch gives ``q`` and
    the writes together."""
    return read(q, *buffer.slots, buffer.n, buffer.token)


@torch.library.custom_op("depthmem::depth_buffer_read", mutates_args=())
def read(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n: int,
    token: torch.Tensor | None,
) -> torch.Tensor:
    if kernels.active(q, keys, values):
        from variants.kernels.depth_read import fused

        return fused.buffer_read(q.contiguous(), keys, values, n)
    dtype = kernels.compute_dtype(q, keys, values)
    return naive.buffer_read(q.to(dtype), keys, values, n).to(kernels.result_dtype(q, keys, values))


@read.register_fake
def _(q, keys, values, n, token):
    return q.new_empty(q.shape[0], values.shape[-1], dtype=kernels.result_dtype(q, keys, values))


@torch.library.custom_op("depthmem::depth_buffer_read_backward", mutates_args=("grad_keys", "grad_values"))
def read_backward(
    dm: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    grad_keys: torch.Tensor,
    grad_values: torch.Tensor,
    n: int,
    fused: bool,
) -> torch.Tensor:
    """``∂q``; ``∂k_i`` and ``∂v_i`` are added into ``grad_keys`` and ``grad_values``. ``fused``: whether the forward
    ran the kernel, which backward follows whatever the mode is by then."""
    if fused:
        from variants.kernels.depth_read import fused as kernel

        return kernel.buffer_read_backward(dm, q.contiguous(), keys, values, grad_keys, grad_values, n)
    dtype = kernels.compute_dtype(q, keys, values)
    dq = naive.buffer_read_backward(dm.to(dtype), q.to(dtype), keys, values, grad_keys, grad_values, n)
    return dq.to(q.dtype)


@read_backward.register_fake
def _(dm, q, keys, values, grad_keys, grad_values, n, fused):
    return torch.empty_like(q)


def _read_setup(ctx, inputs, output):
    q, keys, values, n, token = inputs
    ctx.save_for_backward(q)
    # The buffer is taken by reference, not saved: later writes fill later slots, never the first n.
    ctx.buffer, ctx.n, ctx.chained = (keys, values), n, token is not None
    ctx.fused = kernels.active(q, keys, values)


def _read_grad(ctx, dm):
    (q,) = ctx.saved_tensors
    keys, values = ctx.buffer
    grad_keys, grad_values = gradients(ctx.buffer)
    dq = read_backward(dm, q, keys, values, grad_keys, grad_values, ctx.n, ctx.fused)
    return dq, None, None, None, token_like(q) if ctx.chained else None


read.register_autograd(_read_grad, setup_context=_read_setup)


# The products inside the ops, for torch's FLOP counter (the cost model is held to it): a read's scores and sum,
# 2·n·R·(k + v); its backward, twice that, as autograd's products would be.


@register_flop_formula(torch.ops.depthmem.depth_buffer_read)
def _read_flops(q, keys, values, n, token, out_shape=None) -> int:
    return 2 * n * q[0] * (q[1] + values[-1])


@register_flop_formula(torch.ops.depthmem.depth_buffer_read_backward)
def _read_backward_flops(dm, q, keys, values, grad_keys, grad_values, n, fused, out_shape=None) -> int:
    return 4 * n * q[0] * (q[1] + values[-1])
