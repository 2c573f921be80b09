"""LDM-RLS's write in plain PyTorch: one Gram–Schmidt step of the dual form (``variants/ops/rls.py``).

With the earlier whitened writes ``k̃_j``, ``ṽ_j`` and this write's ridge entry ``d``: ``l_j = k̃_jᵀ k``,
``δ² = max(|k|² + d − Σ l_j², d)``, ``k̃ = (k − Σ l_j k̃_j) / δ``, ``ṽ = (v − Σ l_j ṽ_j) / δ``; and per row the
margin ``δ² / (|k|² + d)``, how much of ``|k|² + d`` survived the subtraction.

Shapes: ``k`` (R, k), ``v`` (R, v), ``ridge`` (R,), ``keys`` (R, n, k), ``values`` (R, n, v) -> ``k̃`` (R, k),
``ṽ`` (R, v), margin (R,).
"""

from __future__ import annotations

import torch


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
