"""LDM-RLS's write, one Gram–Schmidt step of the dual form against the whitened writes in a depth buffer: the
fused kernel where it runs (``variants.kernels.active``), the plain PyTorch of ``naive.py`` elsewhere, both behind
the buffer's op (``buffer.py``)."""

from variants.kernels.whiten.buffer import buffer_whiten

__all__ = ["buffer_whiten"]
