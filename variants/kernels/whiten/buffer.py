"""LDM-RLS's whitening against a depth buffer (``variants/kernels/buffer.py``): one Gram–Schmidt step of the dual
form against the buffer's first ``n`` whitened writes, keys (capacity, R, k) and values (capacity, R, v)
depth-major, for ``k`` (R, k), ``v`` (R, v) and ``ridge`` (R,) -> ``k̃`` (R, k), ``ṽ`` (R, v), margin (R,). Its
backward adds each earlier write's gradient into the buffer's gradients in place. The math is
``naive.buffer_whiten``, or the fused kernels where they run (``variants.kernels``).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from variants import kernels
from variants.kernels.buffer import DepthBuffer, gradients, token_like
from variants.kernels.whiten import naive


def buffer_whiten(
    buffer: DepthBuffer, k: torch.Tensor, v: torch.Tensor, ridge: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k̃``, ``ṽ`` and the margin of the write ``(k, v)`` against ``buffer``'s whitened writes so far, in the
    dtype the whitening computes in (float32, or float64 where an input is)."""
    kt, vt, margin, _, _ = whiten(k, v, ridge, *buffer.slots, buffer.n, buffer.token)
    return kt, vt, margin


@torch.library.custom_op("depthmem::whiten_buffer", mutates_args=())
def whiten(
    k: torch.Tensor,
    v: torch.Tensor,
    ridge: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    n: int,
    token: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k̃``, ``ṽ``, the margin, ``δ`` and the floor's mask (for backward), all but the mask in the computing
    dtype: backward reads ``k̃`` and ``ṽ`` again, which must not carry a narrower rounding into the gradients."""
    if kernels.active(k, v, ridge, keys, values):
        from variants.kernels.whiten import fused

        return fused.buffer_whiten(k.contiguous(), v.contiguous(), ridge.contiguous(), keys, values, n)
    dtype = kernels.compute_dtype(k, v, ridge, keys, values)
    return naive.buffer_whiten(k.to(dtype), v.to(dtype), ridge.to(dtype), keys, values, n)


@whiten.register_fake
def _(k, v, ridge, keys, values, n, token):
    return naive.outputs(k, v, ridge, keys, values)


@torch.library.custom_op("depthmem::whiten_buffer_backward", mutates_args=("grad_keys", "grad_values"))
def whiten_backward(
    dkt: torch.Tensor,
    dvt: torch.Tensor,
    k: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    grad_keys: torch.Tensor,
    grad_values: torch.Tensor,
    kt: torch.Tensor,
    vt: torch.Tensor,
    delta: torch.Tensor,
    floored: torch.Tensor,
    n: int,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``∂k``, ``∂v`` and ``∂d`` in the computing dtype; ``∂k̃_j`` and ``∂ṽ_j`` are added into ``grad_keys`` and
    ``grad_values``. ``fused``: whether the forward ran the kernel, which backward follows whatever the mode is by
    then."""
    if fused:
        from variants.kernels.whiten import fused as kernel

        return kernel.buffer_whiten_backward(
            dkt, dvt, k.contiguous(), keys, values, grad_keys, grad_values, kt, vt, delta, floored, n
        )
    dtype = kt.dtype
    args = (k.to(dtype), keys, values, grad_keys, grad_values, kt, vt, delta, floored, n)
    return naive.buffer_whiten_backward(dkt, dvt, *args)


@whiten_backward.register_fake
def _(dkt, dvt, k, keys, values, grad_keys, grad_values, kt, vt, delta, floored, n, fused):
    return torch.empty_like(kt), torch.empty_like(vt), torch.empty_like(delta)


def _setup(ctx, inputs, output):
    k, v, ridge, keys, values, n, token = inputs
    kt, vt, margin, delta, floored = output
    ctx.save_for_backward(k, kt, vt, delta, floored)
    # The buffer is taken by reference, not saved: later writes fill later slots, never the first n.
    ctx.buffer, ctx.n, ctx.chained = (keys, values), n, token is not None
    ctx.dtypes = (k.dtype, v.dtype, ridge.dtype)
    ctx.fused = kernels.active(k, v, ridge, keys, values)
    ctx.mark_non_differentiable(margin, delta, floored)


def _grad(ctx, dkt, dvt, *_):
    k, kt, vt, delta, floored = ctx.saved_tensors
    keys, values = ctx.buffer
    grad_keys, grad_values = gradients(ctx.buffer)
    dkt = torch.zeros_like(kt) if dkt is None else dkt
    dvt = torch.zeros_like(vt) if dvt is None else dvt
    dk, dv, dridge = whiten_backward(
        dkt, dvt, k, keys, values, grad_keys, grad_values, kt, vt, delta, floored, ctx.n, ctx.fused
    )
    # ∂k, ∂v and ∂d come out in the computing dtype, k̃'s, ṽ's and δ's: one rounding to the inputs' own
    dk, dv, dridge = (g.to(dtype) for g, dtype in zip((dk, dv, dridge), ctx.dtypes))
    token = token_like(kt) if ctx.chained else None
    return dk, dv, dridge, None, None, None, token


whiten.register_autograd(_grad, setup_context=_setup)


# The products inside the ops, for torch's FLOP counter (the cost model is held to it): a whitening's coefficients
# l_j = k̃_jᵀk, 2·n·R·k (the projections that follow are counted as the plain form's elementwise sums are, not at
# all); its backward, twice that, as autograd's products would be.


@register_flop_formula(torch.ops.depthmem.whiten_buffer)
def _whiten_flops(k, v, ridge, keys, values, n, token, out_shape=None) -> int:
    return 2 * n * k[0] * k[1]


@register_flop_formula(torch.ops.depthmem.whiten_buffer_backward)
def _whiten_backward_flops(
    dkt, dvt, k, keys, values, grad_keys, grad_values, kt, vt, delta, floored, n, fused, out_shape=None
) -> int:
    return 4 * n * k[0] * k[1]
