"""A depth buffer: every write of a step kept once, depth-major, read in place, its gradient summed in place.

A read over depth that takes its writes as separate tensors stacks them first, and its backward hands autograd a
gradient for each, which autograd then sums per write: the O(L²) traffic of the reads, several times over. A
``DepthBuffer`` instead holds the writes in preallocated (capacity, R, ·) tensors, one per field of a write (LDM's
key and value; AttnRes's and DenseFormer's one source), that each write fills one slot of, so a read loads its
``n`` writes where they lie; and a float32 gradient of the same shape that each read's backward adds into in
place, so every write's gradient is summed where it is used, once.

Autograd sees none of the buffer. Each write is linked to the buffer by ``link``, an op whose backward hands the
write its slot of the gradient, and which returns a token, an empty tensor, that the next link and the reads take
as an input. Autograd runs a node's backward only once every consumer of its outputs has run theirs, so the token
chain orders the backward of every read of write ``n`` before write ``n``'s link collects its gradient.
``torch.compile`` sees the same: the store mutates the buffer (and inductor updates it in place, no copy), the
reads' backward mutates the gradient, and the tokens order them.

The reads are the mixers' own ops, each beside its kernels: ``depth_read.buffer_read`` (LDM),
``softmax_read.buffer_read`` (AttnRes), ``weighted_read.buffer_read`` (DenseFormer). Each takes the buffer's slots,
gradients, ``n`` and token, keeps the buffer by reference (later writes fill later slots, never the first ``n``)
and saves only its own small inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from variants import kernels


class DepthBuffer(NamedTuple):
    slots: tuple[torch.Tensor, ...]  # one (capacity, R, ·) tensor per field of a write, in the writes' dtype
    grads: tuple[torch.Tensor, ...] | None  # their gradients, float32 (or float64); None without autograd
    n: int = 0  # the writes so far
    token: torch.Tensor | None = None  # the last write's link

    @classmethod
    def allocate(cls, capacity: int, *writes: torch.Tensor) -> DepthBuffer:
        """An empty buffer for ``capacity`` writes of fields like ``writes`` (R, ·) each, with a gradient where
        autograd records, in float32 (float64 for float64 writes)."""
        slots = tuple(w.new_empty(capacity, *w.shape) for w in writes)
        grads = None
        if torch.is_grad_enabled():
            dtype = kernels.compute_dtype(*writes)
            grads = tuple(s.new_zeros(s.shape, dtype=dtype) for s in slots)
        return cls(slots, grads)

    def append(self, *writes: torch.Tensor) -> DepthBuffer:
        """The buffer with ``writes`` (one per field, stored in the buffer's dtype) as its next write."""
        if self.n >= len(self.slots[0]):
            raise ValueError(f"a depth buffer of {len(self.slots[0])} writes is full")
        for slot, w in zip(self.slots, writes, strict=True):
            store(slot, self.n, w.detach())
        token = self.token
        if self.grads is not None and any(w.requires_grad for w in writes):
            token = link(list(writes), list(self.grads), self.n, self.token)
        return self._replace(n=self.n + 1, token=token)

    def written(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per field, the writes so far, one (R, ·) view each, outside autograd: for inspection."""
        return tuple(tuple(slot[: self.n].unbind()) for slot in self.slots)

    def gradients(self) -> tuple[torch.Tensor | None, ...]:
        """The gradient of each field, or None each where the buffer was allocated without autograd."""
        return self.grads or (None,) * len(self.slots)


@torch.library.custom_op("depthmem::depth_buffer_store", mutates_args=("slot",))
def store(slot: torch.Tensor, n: int, write: torch.Tensor) -> None:
    slot[n].copy_(write)


@store.register_fake
def _(slot, n, write):
    return None


@torch.library.custom_op("depthmem::depth_buffer_link", mutates_args=())
def link(writes: list[torch.Tensor], grads: list[torch.Tensor], n: int, previous: torch.Tensor | None) -> torch.Tensor:
    """The token of write ``n``: nothing forward; backward, the write's slot of each field's gradient."""
    return token_like(writes[0])


@link.register_fake
def _(writes, grads, n, previous):
    return token_like(writes[0])


def token_like(like: torch.Tensor) -> torch.Tensor:
    """A token: an empty tensor that orders backward passes, on ``like``'s device."""
    return like.new_empty(0, dtype=torch.float32)


def _link_setup(ctx, inputs, output):
    writes, grads, n, previous = inputs
    # The gradients are taken by reference, not saved: the reads' backward fills them after this forward.
    ctx.grads, ctx.n, ctx.dtypes, ctx.chained = grads, n, [w.dtype for w in writes], previous is not None


def _link_grad(ctx, _):
    # A copy: the slot stays the buffer's, whatever autograd does with the gradient it is handed.
    dwrites = [g[ctx.n].to(dtype, copy=True) for g, dtype in zip(ctx.grads, ctx.dtypes)]
    return dwrites, [None] * len(ctx.grads), None, token_like(ctx.grads[0]) if ctx.chained else None


link.register_autograd(_link_grad, setup_context=_link_setup)
