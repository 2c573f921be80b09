"""LDM's depth read in plain PyTorch: ``m = Σ_i v_i (k_iᵀ q)``, linear attention over the writes so far.

Shapes: ``q`` (R, k), ``keys`` (R, n, k), ``values`` (R, n, v) -> (R, v), with R every token and group. A depth
buffer keeps its writes depth-major, (capacity, R, ·), and its read's backward adds into the buffer's gradients in
place instead of returning them (``variants/kernels/depth_read/buffer.py``).
"""

from __future__ import annotations

import torch


def depth_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1)  # k_iᵀ q, (R, n)
    return (scores.unsqueeze(-2) @ values).squeeze(-2)


def buffer_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """``depth_read`` over the first ``n`` writes of depth-major ``keys`` and ``values``, in ``q``'s dtype."""
    scores = torch.einsum("nrk,rk->nr", keys[:n].to(q.dtype), q)
    return torch.einsum("nr,nrv->rv", scores, values[:n].to(q.dtype))


@torch.no_grad()
def buffer_read_backward(dm, q, keys, values, grad_keys, grad_values, n: int) -> torch.Tensor:
    """``∂q`` of ``buffer_read``, with ``∂k_i = (v_iᵀ ∂m) q`` and ``∂v_i = (k_iᵀ q) ∂m`` added into ``grad_keys`` and
    ``grad_values`` (depth-major, in their own dtype); the arithmetic in ``q``'s dtype."""
    keys, values = keys[:n].to(q.dtype), values[:n].to(q.dtype)
    scores = torch.einsum("nrk,rk->nr", keys, q)
    dscores = torch.einsum("nrv,rv->nr", values, dm)
    grad_keys[:n] += (dscores.unsqueeze(-1) * q).to(grad_keys.dtype)
    grad_values[:n] += (scores.unsqueeze(-1) * dm).to(grad_values.dtype)
    return torch.einsum("nr,nrk->rk", dscores, keys)
