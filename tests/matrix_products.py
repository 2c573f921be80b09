"""A dispatch mode that records the precision of every matrix product a forward makes."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class MatrixProducts(TorchDispatchMode):
    """Records the dtype of every matrix product: 2-D (``mm``, ``addmm``: linear layers) and batched (``bmm``, and
    a depth buffer's read, whose products run inside its op in its query's dtype)."""

    def __init__(self):
        super().__init__()
        self.seen = {"2d": [], "batched": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in ("mm", "addmm"):
            self.seen["2d"].append(args[-1].dtype)
        elif name in ("bmm", "baddbmm"):
            self.seen["batched"].append(args[-1].dtype)
        elif name == "depth_buffer_read":
            self.seen["batched"].append(args[0].dtype)
        return func(*args, **(kwargs or {}))
