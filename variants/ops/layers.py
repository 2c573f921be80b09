"""Layers the decoder and the depth mixers both use, in a module below both: the trunk (``harness/model/decoder.py``)
and the mixers (``variants/``) import from here, never from each other."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        # At least float32 for the statistics, but never below the input precision (float64 stays float64).
        dt = torch.promote_types(x.dtype, torch.float32)
        y = x.to(dt)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)
