"""The streams LDM and LDM-RLS carry from layer to layer (``variants/ldm.py``): the recurrent form's ``(x, M, P)``
and the dual form's residual and writes, with the memory they stand for rebuilt on demand for inspection and tests.

Axes: b batch, t time, g groups, v value width d/G, k key width d_k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from variants.ops.depth_read import CarriedMemory, WriteGradient
from variants.ops.tape import Tape


class LDMState(NamedTuple):
    """The recurrent form's streams after a layer: residual ``x`` (b, t, d), memory ``M`` (b, t, g, v, k) or None
    while it is still zero, and for RLS the inverse key covariance ``P`` (b, t, g, k, k)."""

    x: torch.Tensor
    M: torch.Tensor | None
    P: torch.Tensor | None
    pending: dict | None = None  # qk_source=read: the latest read, under "read" (see ``LDM._qk_input``)


class Carried(NamedTuple):
    """The chunkwise read's carried memory (``variants/ops/depth_read.py``) and the token of its latest fold."""

    memory: CarriedMemory
    token: torch.Tensor


class DualState(NamedTuple):
    """The dual form's streams: residual ``x`` (b, t, d) and the writes so far, keys (b, t, g, k) and values
    (b, t, g, v), whitened for RLS (``variants/ops/rls.py``); ``M`` and ``P`` rebuild the recurrent form's memory
    from them, for inspection and tests. With chunked reads (``LDM.chunk``) the writes are those since the latest
    fold, and ``carried`` holds the memory of the folded ones; it grows in place, so a state is current only until
    the next write."""

    x: torch.Tensor
    keys: tuple[torch.Tensor, ...] = ()
    values: tuple[torch.Tensor, ...] = ()
    decay: torch.Tensor | None = None  # RLS: Π_j λ_j over the writes so far, (g,)
    alpha: float | None = None  # RLS: the ridge scale; None for the outer-product write
    # Key-MLP outputs a read computed alongside its query, by layer, for the write of the same layer to take;
    # with qk_source=read also the latest read, under "read".
    pending: dict | None = None
    grads: tuple[WriteGradient | None, ...] = ()  # per write, where the reads add its gradient (DepthRead)
    # RLS: every write as it came, (k, v, λ, ω), for the float64 recursion to start from if whitening loses its
    # digits (rls.whiten's margin); then ``exact`` holds that recursion's (M, P) and the reads use it.
    raw: tuple = ()
    exact: tuple[torch.Tensor, torch.Tensor] | None = None
    carried: Carried | None = None
    # With the outer-product write, the residual x for backward at every ``segment()``-th layer only (``LDM.tape``)
    tape: Tape | None = None

    @property
    def _dtype(self) -> torch.dtype:
        """The precision the memory is kept in: float32, or the residual's if wider."""
        return torch.promote_types(self.x.dtype, torch.float32)

    @property
    def M(self) -> torch.Tensor | None:
        """``Σ_i ṽ_i k̃_iᵀ`` (b, t, g, v, k), or None before the first write."""
        if self.exact is not None:
            return self.exact[0].to(self._dtype)
        parts = [v.unsqueeze(-1) * k.unsqueeze(-2) for k, v in zip(self.keys, self.values)]
        if self.carried is not None:
            memory = self.carried.memory
            memory.at(memory.folds - 1)  # rebuilt if the head's read released it
            parts.insert(0, memory.M.detach().clone().unflatten(0, memory.shape))
        return sum(parts) if parts else None

    @property
    def P(self) -> torch.Tensor | None:
        """RLS: ``(α / Π λ)(I − Σ_i k̃_i k̃_iᵀ)`` (b, t, g, k, k) by Woodbury; None before the first write."""
        if self.alpha is None or not (self.keys or self.carried is not None):
            return None
        if self.exact is not None:
            return self.exact[1].to(self._dtype)
        parts = [k.unsqueeze(-1) * k.unsqueeze(-2) for k in self.keys]  # each exactly symmetric
        if self.carried is not None:
            memory = self.carried.memory
            memory.at(memory.folds - 1)
            S = memory.S.detach().unflatten(0, memory.shape)
            parts.insert(0, (S + S.mT) / 2)  # a batched product's sum, symmetric up to its rounding
        eye = torch.eye(parts[0].shape[-1], dtype=parts[0].dtype, device=parts[0].device)
        return (self.alpha / self.decay)[:, None, None] * (eye - sum(parts))
