"""A depth buffer: every write of a step kept once, depth-major, read in place, its gradient summed in place.

A read over depth that takes its writes as separate tensors stacks them first, and its backward hands autograd a
gradient for each, which autograd then sums per write: the O(L²) traffic of the reads, several times over. A
``DepthBuffer`` instead holds the writes in preallocated (capacity, R, ·) tensors, one per field of a write (LDM's
key and value; AttnRes's and DenseFormer's one source), that each write fills one slot of, so a read loads its
``n`` writes where they lie; and a float32 gradient of the same shape that each read's backward adds into in
place, so every write's gradient is summed where it is used, once. The gradient is allocated by the first backward
that needs it (``gradients``), so the forward pass does not hold it.

Autograd sees none of the buffer. Each write is linked to the buffer by ``link``, an op whose backward hands the
write its slot of the gradient, and which returns a token, an empty tensor, that the next link and the reads take
as an input. Autograd runs a node's backward only once every consumer of its outputs has run theirs, so the token
chain orders the backward of every read of write ``n`` before write ``n``'s link collects its gradient.
``torch.compile`` sees the same: the store mutates the buffer (and inductor updates it in place, no copy), the
reads' backward mutates the gradient, and the tokens order them.

The reads are the mixers' own ops, each beside its kernels: ``depth_read.buffer_read`` (LDM and LDM-RLS),
``whiten.buffer_whiten`` (LDM-RLS's write), ``softmax_read.buffer_read`` (AttnRes), ``weighted_read.buffer_read``
(DenseFormer). Each takes the buffer's slots, ``n`` and token, keeps the slots by reference (later writes fill
later slots, never the first ``n``), saves only its own small inputs, and in backward takes the buffer's
gradients from ``gradients``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from variants import kernels


class DepthBuffer(NamedTuple):
    slots: tuple[torch.Tensor, ...]  # one (capacity, R, ·) tensor per field of a write, in the writes' dtype
    n: int = 0  # the writes so far
    token: torch.Tensor | None = None  # the last write's link

    @classmethod
    def allocate(cls, capacity: int, *writes: torch.Tensor) -> DepthBuffer:
        """An empty buffer for ``capacity`` writes of fields like ``writes`` (R, ·) each."""
        return cls(tuple(w.new_empty(capacity, *w.shape) for w in writes))

    def append(self, *writes: torch.Tensor) -> DepthBuffer:
        """The buffer with ``writes`` (one per field, stored in the buffer's dtype) as its next write."""
        if self.n >= len(self.slots[0]):
            raise ValueError(f"a depth buffer of {len(self.slots[0])} writes is full")
        for slot, w in zip(self.slots, writes, strict=True):
            store(slot, self.n, w.detach())
        token = self.token
        if torch.is_grad_enabled() and any(w.requires_grad for w in writes):
            token = link(list(writes), list(self.slots), self.n, self.token)
        return self._replace(n=self.n + 1, token=token)

    def written(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per field, the writes so far, one (R, ·) view each, outside autograd: for inspection."""
        return tuple(tuple(slot[: self.n].unbind()) for slot in self.slots)


_GRADIENTS = WeakIdKeyDictionary()


def gradients(slots: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The gradients of a buffer's ``slots``, float32 (float64 for float64 writes), zero where nothing has been added
    yet. Allocated the first time a backward asks for them, not with the buffer: the forward pass, whose end is
    where a training step's memory peaks, does not hold them. The ops take them by their buffer's first slot, as the
    backward of every read and link of that buffer does."""
    grads = _GRADIENTS.get(slots[0])
    if grads is None:
        dtype = kernels.compute_dtype(*slots)
        grads = _GRADIENTS[slots[0]] = tuple(s.new_zeros(s.shape, dtype=dtype) for s in slots)
    return grads


@torch.library.custom_op("depthmem::depth_buffer_store", mutates_args=("slot",))
def store(slot: torch.Tensor, n: int, write: torch.Tensor) -> None:
    slot[n].copy_(write)


@store.register_fake
def _(slot, n, write):
    return None


@torch.library.custom_op("depthmem::depth_buffer_link", mutates_args=())
def link(writes: list[torch.Tensor], slots: list[torch.Tensor], n: int, previous: torch.Tensor | None) -> torch.Tensor:
    """The token of write ``n``: nothing forward; backward, the write's slot of each field's gradient."""
    return token_like(writes[0])


@link.register_fake
def _(writes, slots, n, previous):
    return token_like(writes[0])


def token_like(like: torch.Tensor) -> torch.Tensor:
    """A token: an empty tensor that orders backward passes, on ``like``'s device."""
    return like.new_empty(0, dtype=torch.float32)


def _link_setup(ctx, inputs, output):
    writes, slots, n, previous = inputs
    # The slots are taken by reference, not saved: later writes fill later slots, never the n-th.
    ctx.slots, ctx.n, ctx.dtypes, ctx.chained = slots, n, [w.dtype for w in writes], previous is not None


def _link_grad(ctx, _):
    # A copy: the slot stays the buffer's, whatever autograd does with the gradient it is handed. The slot is then
    # zeroed, so that a second backward through the same graph (``retain_graph=True``) sums from zero again.
    dwrites = []
    for g, dtype in zip(gradients(ctx.slots), ctx.dtypes):
        dwrites.append(g[ctx.n].to(dtype, copy=True))
        g[ctx.n].zero_()
    return dwrites, [None] * len(ctx.slots), None, token_like(ctx.slots[0]) if ctx.chained else None


link.register_autograd(_link_grad, setup_context=_link_setup)


def row_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Row-wise ``x·y`` of (R, ·) tensors, as a batched product: no (R, ·) temporary. The plain reads of a buffer
    take their writes one at a time with it."""
    return (x.unsqueeze(-2) @ y.unsqueeze(-1)).flatten()
