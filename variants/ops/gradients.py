"""A tensor's gradient summed in place by every node that used it, handed to autograd once.

Where one tensor is read by many custom nodes (HC's and mHC's read, write and connections each use a layer's
stream), autograd gives every (reader, tensor) pair a fresh gradient tensor and then adds them up: one allocation
and two more passes over the tensor per pair, the largest cost of such a backward on CPU. Instead the tensor passes
once through ``Gathered``, the readers add their share into its ``GradientSum`` and return None for it, and
``Gathered``'s backward, which autograd runs only after every reader's, returns the sum.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable


class GradientSum:
    """One tensor's gradient, added up in place."""

    __slots__ = ("buf",)

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Add ``a * b``; returns the sum, to which a caller may add more in place."""
        if self.buf is None:
            self.buf = a * b
        else:
            self.buf.addcmul_(a, b)
        return self.buf

    def add_tensor(self, t: torch.Tensor) -> None:
        """Add ``t``, a fresh tensor the sum may take over as its buffer."""
        if self.buf is None:
            self.buf = t
        else:
            self.buf.add_(t)

    def take(self, incoming: torch.Tensor | None) -> torch.Tensor | None:
        """The sum plus any gradient that reached the tensor another way, emptying the sum."""
        buf, self.buf = self.buf, None  # a second backward through a retained graph starts from zero again
        if buf is None:
            return incoming
        return buf if incoming is None else buf.add_(incoming)


class Gathered(torch.autograd.Function):
    """Identity on tensors: ``apply(sums, *tensors)`` with one ``GradientSum`` per tensor; backward returns the
    sums."""

    @staticmethod
    def forward(ctx, sums, *tensors):
        ctx.sums = sums
        ctx.set_materialize_grads(False)  # the readers return None for the tensors: no zeros to fill and add
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return None, *(s.take(g) for s, g in zip(ctx.sums, grads))
