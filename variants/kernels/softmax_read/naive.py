"""AttnRes's depth read in plain PyTorch: ``a = Σ_s softmax_s(w · RMSNorm(v_s)) v_s`` with a gainless key norm.

Shapes: ``values`` (R, S, d) the sources, ``query`` (d,) the reader's pseudo-query -> (R, d).
"""

from __future__ import annotations

import torch


def softmax_read(values: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    rho = torch.rsqrt(values.square().mean(-1) + eps)  # the key norm's scale, (R, S)
    weights = torch.softmax(rho * (values @ query), dim=-1)
    return (weights.unsqueeze(-2) @ values).squeeze(-2)
