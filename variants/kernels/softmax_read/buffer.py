"""AttnRes's read of a depth buffer (``variants/kernels/buffer.py``): ``Σ_s softmax_s(w · RMSNorm(v_s)) v_s`` over
the buffer's first ``n`` sources, (capacity, R, d) depth-major, and optionally one ``extra`` source (R, d) outside
it (AttnRes's embedding, block AttnRes's partial sum), with the pseudo-query ``w`` (d,) -> (R, d). Its backward adds
each ``∂v_s`` into the buffer's gradient in place. The math is ``naive.buffer_read``, or the fused kernels where they
run (``variants.kernels``).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import register_flop_formula

from variants import kernels
from variants.kernels.buffer import DepthBuffer, gradients, token_like
from variants.kernels.softmax_read import naive

EPS = 1e-6  # the key norm's


def buffer_read(buffer: DepthBuffer, query: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The read over ``buffer``'s one field so far and ``extra``, in the dtype the read computes in (float32, or
    float64 where an input is)."""
    (values,) = buffer.slots
    return read(query, values, buffer.n, buffer.token, extra, EPS)[0]


def weights(buffer: DepthBuffer, query: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """The softmax weights of the same read, (R, S), outside autograd: for inspection."""
    (values,) = buffer.slots
    with torch.no_grad():
        dtype = kernels.compute_dtype(values, query)
        v = naive.sources(values, buffer.n, extra, dtype)
        return torch.softmax(naive.logits(v, query.to(dtype), EPS), dim=0).T


def _inputs(query, values, extra):
    return (query, values) if extra is None else (query, values, extra)


@torch.library.custom_op("depthmem::softmax_buffer_read", mutates_args=())
def read(
    query: torch.Tensor,
    values: torch.Tensor,
    n: int,
    token: torch.Tensor | None,
    extra: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The read and each row's log-sum-exp, in the dtype the read computes in: backward reads the read again,
    which must not carry a rounding to a narrower dtype into the gradients."""
    if kernels.active(*_inputs(query, values, extra)):
        from variants.kernels.softmax_read import fused

        return fused.buffer_read(query.contiguous(), values, n, extra, eps)
    dtype = kernels.compute_dtype(*_inputs(query, values, extra))
    return naive.buffer_read(query.to(dtype), values, n, extra, eps)


@read.register_fake
def _(query, values, n, token, extra, eps):
    dtype = kernels.compute_dtype(*_inputs(query, values, extra))
    return values.new_empty(values.shape[1:], dtype=dtype), values.new_empty(values.shape[1], dtype=dtype)


@torch.library.custom_op("depthmem::softmax_buffer_read_backward", mutates_args=("grad_values",))
def read_backward(
    da: torch.Tensor,
    query: torch.Tensor,
    values: torch.Tensor,
    grad_values: torch.Tensor,
    n: int,
    extra: torch.Tensor | None,
    a: torch.Tensor,
    lse: torch.Tensor,
    eps: float,
    fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``∂w`` and the extra source's gradient (empty without one); each ``∂v_s`` is added into ``grad_values``.
    ``fused``: whether the forward ran the kernel, which backward follows whatever the mode is by then."""
    if fused:
        from variants.kernels.softmax_read import fused as kernel

        return kernel.buffer_read_backward(da, query.contiguous(), values, grad_values, n, extra, a, lse, eps)
    dtype = kernels.compute_dtype(*_inputs(query, values, extra))
    dw, dx = naive.buffer_read_backward(da, query.to(dtype), values, grad_values, n, extra, a, lse, eps)
    return dw.to(query.dtype), dx


@read_backward.register_fake
def _(da, query, values, grad_values, n, extra, a, lse, eps, fused):
    return torch.empty_like(query), torch.empty_like(extra) if extra is not None else query.new_empty(0)


def _read_setup(ctx, inputs, output):
    query, values, n, token, extra, ctx.eps = inputs
    ctx.save_for_backward(query, extra, *output)
    # The buffer is taken by reference, not saved: later writes fill later slots, never the first n.
    ctx.values, ctx.n, ctx.chained = values, n, token is not None
    ctx.fused = kernels.active(*_inputs(query, values, extra))


def _read_grad(ctx, da, _):
    query, extra, a, lse = ctx.saved_tensors
    (grad_values,) = gradients((ctx.values,))
    dw, dx = read_backward(da, query, ctx.values, grad_values, ctx.n, extra, a, lse, ctx.eps, ctx.fused)
    return dw, None, None, token_like(query) if ctx.chained else None, dx if extra is not None else None, None


read.register_autograd(_read_grad, setup_context=_read_setup)


# The products inside the ops, for torch's FLOP counter (the cost model is held to it): a read's logits and
# weighted sum, 2·S·R·d each; its backward, twice that, as autograd's would be.


def _sources(values, n, extra) -> int:
    return n + (extra is not None)


@register_flop_formula(torch.ops.depthmem.softmax_buffer_read)
def _read_flops(query, values, n, token, extra, eps, out_shape=None) -> int:
    return 4 * _sources(values, n, extra) * values[1] * values[2]


@register_flop_formula(torch.ops.depthmem.softmax_buffer_read_backward)
def _read_backward_flops(da, query, values, grad_values, n, extra, a, lse, eps, fused, out_shape=None) -> int:
    return 8 * _sources(values, n, extra) * values[1] * values[2]
