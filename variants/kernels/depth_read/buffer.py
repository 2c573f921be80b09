"""A depth buffer: every write of a step kept once, depth-major, and read in place.

A read over depth that takes its writes as separate tensors stacks them first, and its backward hands autograd a
gradient for each, which autograd then sums per write: the O(L²) traffic of the reads, three times over. A
``DepthBuffer`` instead holds the writes in one preallocated (capacity, R, ·) tensor that each write fills one
slot of, so a read loads its ``n`` writes where they lie; and one float32 gradient of the same shape that each
read's backward adds into in place, so every write's gradient is summed where it is used, once.

Autograd sees none of the buffer. Each write is linked to the buffer by ``link``, an op whose backward hands the
write its slot of the gradient, and which returns a token, an empty tensor, that the next link and the reads take
as an input. Autograd runs a node's backward only once every consumer of its outputs has run theirs, so the token
chain orders the backward of every read of write ``n`` before write ``n``'s link collects its gradient.
``torch.compile`` sees the same: the store mutates the buffer (and inductor updates it in place, no copy), the
reads' backward mutates the gradient, and the tokens order them.

Shapes: keys (capacity, R, k), values (capacity, R, v), ``q`` (R, k), a read (R, v), with R every token and group.
The math is ``naive.buffer_read`` and its backward, or the fused kernels where they run (``variants.kernels``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.flop_counter import register_flop_formula

from variants import kernels
from variants.kernels.depth_read import naive


class DepthBuffer(NamedTuple):
    keys: torch.Tensor  # (capacity, R, k), in the writes' dtype
    values: torch.Tensor  # (capacity, R, v)
    grads: tuple[torch.Tensor, torch.Tensor] | None  # ∂keys, ∂values, float32 (or float64); None without autograd
    n: int = 0  # the writes so far
    token: torch.Tensor | None = None  # the last write's link

    @classmethod
    def allocate(cls, capacity: int, k: torch.Tensor, v: torch.Tensor) -> DepthBuffer:
        """An empty buffer for ``capacity`` writes like ``k`` (R, k) and ``v`` (R, v), with a gradient where autograd
        records, in float32 (float64 for float64 writes)."""
        keys = k.new_empty(capacity, *k.shape)
        values = v.new_empty(capacity, *v.shape)
        grads = None
        if torch.is_grad_enabled():
            dtype = kernels.compute_dtype(k, v)
            grads = (keys.new_zeros(keys.shape, dtype=dtype), values.new_zeros(values.shape, dtype=dtype))
        return cls(keys, values, grads)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> DepthBuffer:
        """The buffer with ``k`` and ``v`` (in the buffer's dtype) as its next write."""
        store(self.keys, self.values, self.n, k.detach(), v.detach())
        token = self.token
        if self.grads is not None and (k.requires_grad or v.requires_grad):
            token = link(k, v, *self.grads, self.n, self.token)
        return self._replace(n=self.n + 1, token=token)

    def read(self, q: torch.Tensor) -> torch.Tensor:
        """``Σ_i v_i (k_iᵀ q)`` over the writes so far, in the dtype PyTorch gives ``q`` and the writes together."""
        return read(q, self.keys, self.values, *(self.grads or (None, None)), self.n, self.token)

    def written(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The keys and the values written so far, one (R, ·) view each, outside autograd: for inspection."""
        return tuple(self.keys[: self.n].unbind()), tuple(self.values[: self.n].unbind())


@torch.library.custom_op("depthmem::depth_buffer_store", mutates_args=("keys", "values"))
def store(keys: torch.Tensor, values: torch.Tensor, n: int, k: torch.Tensor, v: torch.Tensor) -> None:
    keys[n].copy_(k)
    values[n].copy_(v)


@store.register_fake
def _(keys, values, n, k, v):
    return None


@torch.library.custom_op("depthmem::depth_buffer_link", mutates_args=())
def link(
    k: torch.Tensor,
    v: torch.Tensor,
    grad_keys: torch.Tensor,
    grad_values: torch.Tensor,
    n: int,
    previous: torch.Tensor | None,
) -> torch.Tensor:
    """The token of write ``n``: nothing forward; backward, the write's slot of the buffer's gradient."""
    return _token(k)


@link.register_fake
def _(k, v, grad_keys, grad_values, n, previous):
    return _token(k)


def _token(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, dtype=torch.float32)


def _link_setup(ctx, inputs, output):
    k, v, grad_keys, grad_values, n, previous = inputs
    # The gradients are taken by reference, not saved: the reads' backward fills them after this forward.
    ctx.grads, ctx.n, ctx.dtypes, ctx.chained = (grad_keys, grad_values), n, (k.dtype, v.dtype), previous is not None


def _link_grad(ctx, _):
    (grad_keys, grad_values), n = ctx.grads, ctx.n
    # A copy: the slot stays the buffer's, whatever autograd does with the gradient it is handed.
    dk, dv = (g[n].to(dtype, copy=True) for g, dtype in zip((grad_keys, grad_values), ctx.dtypes))
    return dk, dv, None, None, None, _token(grad_keys) if ctx.chained else None


link.register_autograd(_link_grad, setup_context=_link_setup)


@torch.library.custom_op("depthmem::depth_buffer_read", mutates_args=())
def read(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    grad_keys: torch.Tensor | None,
    grad_values: torch.Tensor | None,
    n: int,
    token: torch.Tensor | None,
) -> torch.Tensor:
    if kernels.active(q, keys, values):
        from variants.kernels.depth_read import fused

        return fused.buffer_read(q.contiguous(), keys, values, n)
    return naive.buffer_read(q.to(kernels.result_dtype(q, keys, values)), keys, values, n)


@read.register_fake
def _(q, keys, values, grad_keys, grad_values, n, token):
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
) -> torch.Tensor:
    if kernels.active(q, keys, values):
        from variants.kernels.depth_read import fused

        return fused.buffer_read_backward(dm, q.contiguous(), keys, values, grad_keys, grad_values, n)
    dtype = kernels.compute_dtype(q, keys, values)
    dq = naive.buffer_read_backward(dm.to(dtype), q.to(dtype), keys, values, grad_keys, grad_values, n)
    return dq.to(q.dtype)


@read_backward.register_fake
def _(dm, q, keys, values, grad_keys, grad_values, n):
    return torch.empty_like(q)


def _read_setup(ctx, inputs, output):
    q, keys, values, grad_keys, grad_values, n, token = inputs
    ctx.save_for_backward(q)
    # The buffer is taken by reference, not saved: later writes fill later slots, never the first n.
    ctx.buffer, ctx.n, ctx.chained = (keys, values, grad_keys, grad_values), n, token is not None


def _read_grad(ctx, dm):
    (q,) = ctx.saved_tensors
    keys, values, grad_keys, grad_values = ctx.buffer
    if grad_keys is None:
        raise RuntimeError("a depth buffer allocated without autograd cannot be differentiated through")
    dq = read_backward(dm, q, keys, values, grad_keys, grad_values, ctx.n)
    return dq, None, None, None, None, None, _token(q) if ctx.chained else None


read.register_autograd(_read_grad, setup_context=_read_setup)


# The products inside the ops, for torch's FLOP counter (the cost model is held to it): a read's scores and sum,
# 2·n·R·(k + v); its backward, twice that, as autograd's products would be.


@register_flop_formula(torch.ops.depthmem.depth_buffer_read)
def _read_flops(q, keys, values, grad_keys, grad_values, n, token, out_shape=None) -> int:
    return 2 * n * q[0] * (q[1] + values[-1])


@register_flop_formula(torch.ops.depthmem.depth_buffer_read_backward)
def _read_backward_flops(dm, q, keys, values, grad_keys, grad_values, n, out_shape=None) -> int:
    return 4 * n * q[0] * (q[1] + values[-1])
