"""LDM's depth read in plain PyTorch: ``m = Σ_i v_i (k_iᵀ q)``, linear attention over the writes so far.

Shapes: ``q`` (R, k), ``keys`` (R, n, k), ``values`` (R, n, v) -> (R, v), with R every token and group. A depth
buffer keeps its writes depth-major, (capacity, R, ·), and its read's backward adds into the buffer's gradients in
place instead of returning them (``variants/kernels/depth_read/buffer.py``).
"""

from __future__ import annotations

import torch

from variants.kernels.buffer import row_dot


def depth_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1)  # k_iᵀ q, (R, n)
    return (scores.unsqueeze(-2) @ values).squeeze(-2)


# The buffer read and its backward go write by write, each write's terms added in place, as the kernels do: nothing
# of the size of the writes is allocated beyond the read and the gradients (a batched product over all n writes
# holds an (n, R, ·) temporary in the backward, and under bf16 storage every write widened at once).


@torch.no_grad()
def buffer_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """``depth_read`` over the first ``n`` writes of depth-major ``keys`` and ``values``, in ``q``'s dtype."""
    m = q.new_zeros(q.shape[0], values.shape[-1])
    for k, v in zip(keys[:n], values[:n], strict=True):
        m.addcmul_(row_dot(k.to(q.dtype), q).unsqueeze(-1), v.to(q.dtype))
    return m


@torch.no_grad()
def buffer_read_backward(dm, q, keys, values, grad_keys, grad_values, n: int) -> torch.Tensor:
    """``∂q`` of ``buffer_read``, with ``∂k_i = (v_iᵀ ∂m) q`` and ``∂v_i = (k_iᵀ q) ∂m`` added into ``grad_keys`` and
    ``grad_values`` (depth-major, each rounded once to its own dtype); the arithmetic in ``q``'s dtype."""
    dq = torch.zeros_like(q)
    for i in range(n):
        k, v = keys[i].to(q.dtype), values[i].to(q.dtype)
        dscore = row_dot(v, dm).unsqueeze(-1)
        grad_keys[i].addcmul_(dscore, q)
        grad_values[i].addcmul_(row_dot(k, q).unsqueeze(-1), dm)
        dq.addcmul_(dscore, k)
    return dq
