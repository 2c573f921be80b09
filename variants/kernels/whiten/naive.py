"""LDM-RLS's write in plain PyTorch: one Gram–Schmidt step of the dual form (``variants/ops/rls.py``).

With the earlier whitened writes ``k̃_j``, ``ṽ_j`` and this write's ridge entry ``d``: ``l_j = k̃_jᵀ k``,
``δ² = max(|k|² + d − Σ l_j², d)``, ``k̃ = (k − Σ l_j k̃_j) / δ``, ``ṽ = (v − Σ l_j ṽ_j) / δ``; and per row the
margin ``δ² / (|k|² + d)``, how much of ``|k|² + d`` survived the subtraction.

Shapes: ``k`` (R, k), ``v`` (R, v), ``ridge`` (R,), ``keys`` (R, n, k), ``values`` (R, n, v) -> ``k̃`` (R, k),
``ṽ`` (R, v), margin (R,).
"""

from __future__ import annotations

import torch

from variants import kernels
from variants.kernels.buffer import row_dot


def whiten(
    k: torch.Tensor, v: torch.Tensor, ridge: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = ridge.unsqueeze(-1)
    total = (k * k).sum(-1, keepdim=True) + r
    coeffs = keys @ k.unsqueeze(-1)  # l_j, (R, n, 1)
    k_rest = k - (coeffs * keys).sum(-2)
    v_rest = v - (coeffs * values).sum(-2)
    sq = total - coeffs.square().sum(-2)
    # The floor: δ² is never below d in exact arithmetic; where rounding takes it there, δ² is d and its gradient
    # goes to d alone.
    sq = torch.maximum(sq, r)
    delta = sq.sqrt()
    return k_rest / delta, v_rest / delta, (sq / total).squeeze(-1)


def outputs(k, v, ridge, keys, values):
    """Empty ``k̃``, ``ṽ``, margin, ``δ`` and the floor's mask (one byte per row) for these inputs, all but the
    mask in the dtype the whitening computes in."""
    acc = kernels.compute_dtype(k, v, ridge, keys, values)
    rows = k.shape[0]
    floored = torch.empty(rows, dtype=torch.int8, device=k.device)
    kt, vt = k.new_empty(k.shape, dtype=acc), v.new_empty(v.shape, dtype=acc)
    return kt, vt, k.new_empty(rows, dtype=acc), k.new_empty(rows, dtype=acc), floored


# A depth buffer's whitening (``whiten/buffer.py``): the earlier whitened writes are the buffer's first ``n``,
# depth-major (capacity, R, ·). It goes write by write, each term added in place, as the kernels do: nothing of the
# size of the writes is allocated beyond the outputs, so a step's memory is what the memory plan
# (harness/training/memory_plan.py) simulates from the ops' outputs.


@torch.no_grad()
def buffer_whiten(k, v, ridge, keys, values, n: int):
    """``whiten`` against ``keys[:n]`` and ``values[:n]``, in ``k``'s dtype, with ``δ`` and the floor's mask (int8)
    for the backward: ``k̃``, ``ṽ``, margin, ``δ``, mask."""
    total = torch.linalg.vector_norm(k, dim=-1).square() + ridge
    kt, vt, sq = k.clone(), v.to(k.dtype, copy=True), total.clone()
    for kj, vj in zip(keys[:n], values[:n]):
        kj, vj = kj.to(k.dtype), vj.to(k.dtype)
        c = row_dot(kj, k)
        kt.addcmul_(c.unsqueeze(-1), kj, value=-1)
        vt.addcmul_(c.unsqueeze(-1), vj, value=-1)
        sq -= c.square()
    floored = sq < ridge
    sq = torch.maximum(sq, ridge)
    delta = sq.sqrt()
    kt /= delta.unsqueeze(-1)
    vt /= delta.unsqueeze(-1)
    return kt, vt, sq / total, delta, floored.to(torch.int8)


@torch.no_grad()
def buffer_whiten_backward(dkt, dvt, k, keys, values, grad_keys, grad_values, kt, vt, delta, floored, n: int):
    """``∂k``, ``∂v``, ``∂d`` of ``buffer_whiten`` in ``k``'s dtype, the computing one, with ``∂k̃_j`` and ``∂ṽ_j``
    added into ``grad_keys`` and ``grad_values`` (in their own dtype); the formulas of ``fused.py``'s docstring."""
    dkt, dvt = dkt.to(k.dtype), dvt.to(k.dtype)
    dsq = -0.5 * (row_dot(dkt, kt) + row_dot(dvt, vt)) / delta.square()
    dridge = dsq.clone()  # d enters δ² with weight 1, or is δ² where the floor held
    dsq = torch.where(floored != 0, 0.0, dsq)
    # ∂k_r = ∂k̃/δ, to which the rest of ∂k adds; ∂v = ∂v_r = ∂ṽ/δ. Where ∂k_r enters a product below, it is
    # ∂k̃/δ again, so no copy of it is kept.
    dk, dv = dkt / delta.unsqueeze(-1), dvt / delta.unsqueeze(-1)
    dk.addcmul_((2.0 * dsq).unsqueeze(-1), k)
    for j, (kj, vj) in enumerate(zip(keys[:n], values[:n])):
        kj, vj = kj.to(k.dtype), vj.to(k.dtype)
        c = row_dot(kj, k)
        dc = -(row_dot(dkt, kj) + row_dot(dvt, vj)) / delta - 2.0 * c * dsq
        dk.addcmul_(dc.unsqueeze(-1), kj)
        # ∂k̃_j = ∂l_j k − l_j ∂k_r, ∂ṽ_j = −l_j ∂v_r
        cr = (c / delta).unsqueeze(-1)
        grad_keys[j].addcmul_(dc.unsqueeze(-1), k).addcmul_(cr, dkt, value=-1)
        grad_values[j].addcmul_(cr, dvt, value=-1)
    return dk, dv, dridge
