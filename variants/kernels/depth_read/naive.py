"""LDM's depth read in plain PyTorch: ``m = Σ_i v_i (k_iᵀ q)``, linear attention over the writes so far.

Shapes: ``q`` (R, k), ``keys`` (R, n, k), ``values`` (R, n, v) -> (R, v), with R every token and group.
"""

from __future__ import annotations

import torch


def depth_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    scores = (keys @ q.unsqueeze(-1)).squeeze(-1)  # k_iᵀ q, (R, n)
    return (scores.unsqueeze(-2) @ values).squeeze(-2)
