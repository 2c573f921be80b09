"""A dispatch mode that counts the elements of every tensor the ops it sees produce."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DispatchedOutputs(TorchDispatchMode):
    """The elements of every tensor the ops seen at dispatch produce: what autograd moves around the custom ops,
    whose own passes it does not see into."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.elements += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out
