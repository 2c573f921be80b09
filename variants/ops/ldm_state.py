"""The streams LDM and LDM-RLS carry from layer to layer (``variants/ldm.py``): the recurrent form's ``(x, M, P)``
and the dual form's residual and writes, with the memory they stand for rebuilt on demand for inspection and tests.

Axes: b batch, t time, g groups, v value width d/G, k key width d_k.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from variants.kernels.buffer import DepthBuffer


class LDMState(NamedTuple):
    """The recurrent form's streams after a layer: residual ``x`` (b, t, d), memory ``M`` (b, t, g, v, k) or None
    while it is still zero, and for RLS the inverse key covariance ``P`` (b, t, g, k, k)."""

    x: torch.Tensor
    M: torch.Tensor | None
    P: torch.Tensor | None
    pending: dict | None = None  # qk_source=read: the latest read, under "read" (see ``LDM._qk_input``)


class DualState(NamedTuple):
    """The dual form's streams: residual ``x`` (b, t, d) and the writes so far, each key and value once in a depth
    buffer (``variants/kernels/buffer.py``; for RLS the whitened ones); or, once LDM-RLS's float32 guard has tripped,
    its whitened keys (b, t, g, k), values (b, t, g, v) and ridge coordinates in float64, as tuples
    (``variants/ops/rls.py``, the square-root form).
    ``M`` and ``P`` rebuild the recurrent form's memory from them, for inspection and tests."""

    x: torch.Tensor
    buffer: DepthBuffer | None = None  # the keys and values, (writes, b·t·g, k | v)
    keys: tuple[torch.Tensor, ...] = ()  # RLS in float64
    values: tuple[torch.Tensor, ...] = ()  # RLS in float64
    decay: torch.Tensor | None = None  # RLS: Π_j λ_j over the writes so far, (g,)
    alpha: float | None = None  # RLS: the ridge scale; None for the outer-product write
    coords: tuple[torch.Tensor, ...] = ()  # RLS in float64: each write's ridge coordinates (rls.whiten_square_root)
    pending: dict | None = None  # qk_source=read: the latest read, under "read" (see ``LDM._qk_input``)

    @property
    def _dtype(self) -> torch.dtype:
        """The precision of the stream the memory is read into: float32, or the residual's if wider."""
        return torch.promote_types(self.x.dtype, torch.float32)

    @property
    def n_writes(self) -> int:
        return self.buffer.n if self.buffer is not None else len(self.keys)

    def writes(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The keys (b, t, g, k) and values (b, t, g, v) written so far, whitened for RLS: a depth buffer's views,
        outside autograd, or the square-root form's own."""
        if self.buffer is None:
            return self.keys, self.values
        keys, values = self.buffer.written()  # (b·t·g, ·) each
        return tuple(tuple(t.view(*self.x.shape[:-1], -1, t.shape[-1]) for t in ts) for ts in (keys, values))

    @property
    def M(self) -> torch.Tensor | None:
        """``Σ_i ṽ_i k̃_iᵀ`` (b, t, g, v, k), or None before the first write."""
        if not self.n_writes:
            return None
        keys, values = self.writes()
        return sum(v.unsqueeze(-1) * k.unsqueeze(-2) for k, v in zip(keys, values)).to(self._dtype)

    @property
    def P(self) -> torch.Tensor | None:
        """RLS: ``(α / Π λ)(I − Σ_i k̃_i k̃_iᵀ)`` (b, t, g, k, k) by Woodbury; None before the first write."""
        if self.alpha is None or not self.n_writes:
            return None
        gram = sum(k.unsqueeze(-1) * k.unsqueeze(-2) for k in self.writes()[0])  # each term exactly symmetric
        eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
        return ((self.alpha / self.decay)[:, None, None] * (eye - gram)).to(self._dtype)
