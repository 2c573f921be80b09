"""AttnRes's depth read ``Σ_s softmax_s(w · RMSNorm(v_s)) v_s`` over the sources in a depth buffer: the fused
kernel where it runs (``variants.kernels.active``), the plain PyTorch of ``naive.py`` elsewhere, both behind the
buffer's read op (``buffer.py``)."""

from variants.kernels.softmax_read.buffer import buffer_read, weights

__all__ = ["buffer_read", "weights"]
