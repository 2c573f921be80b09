"""The expanded residual stream shared by HC and mHC: ``n`` parallel copies of the residual, mixed per token.

The state is ``X ∈ R^{n×d}`` per token, every row ``e`` at the start; the head reads the sum of the rows. Layer
``l`` reads ``a_l = Σ_k pre_k X_k`` and writes ``X ← res X + post ⊗ v_l``, where ``pre`` (n), ``res`` (n×n) and
``post`` (n) are the connections a subclass computes from ``X`` (``connections``). Only how those are computed
differs between Hyper-Connections and mHC; reading, writing and the depth-mixing matrix are the same.

Autograd differentiates the read, the write and the connections as written, eager or compiled; on CPU the read
and write are batched products over tokens (``(..., 1, k) @ (..., k, d)`` and ``(..., j, k) @ (..., k, d)``).
Axes: b batch, t time, j and k streams, d width, s source.
"""

from __future__ import annotations

import torch

from variants.base import DepthMixer
from variants.ops import mix_dtype


class ExpandedStream(DepthMixer):
    """Base of mixers that carry ``n`` residual streams; subclasses set ``self.n`` and define ``connections``."""

    n: int

    def connections(self, X: torch.Tensor, layer: int):
        """``pre`` (b, t, k), ``res`` (b, t, j, k) and ``post`` (b, t, j) of ``layer`` for streams ``X``."""
        raise NotImplementedError

    def init_state(self, e):
        # Contiguous, not a broadcast view: the products below would otherwise fall back to one call per token.
        X = e.to(mix_dtype(e)).unsqueeze(-2).expand(*e.shape[:-1], self.n, e.shape[-1]).contiguous()
        # A dict so that read can leave the connections it computed for write, which sees the same X.
        return {"X": X}

    def read(self, state, layer):
        X = state["X"]
        pre, res, post = self.connections(X, layer)
        state["connections"] = (layer, pre, res, post)
        for key, value in (("pre", pre), ("res", res), ("post", post)):
            self.record(key, layer, value)
        with torch.autocast(X.device.type, enabled=False):
            return (pre.unsqueeze(-2) @ X).squeeze(-2)  # Σ_k pre_k X_k

    def write(self, state, layer, out):
        X = state["X"]
        cached = state.get("connections")
        if cached is None or cached[0] != layer:
            cached = (layer, *self.connections(X, layer))
        _, pre, res, post = cached
        with torch.autocast(X.device.type, enabled=False):
            v = out.to(X.dtype)
            return {"X": torch.addcmul(res @ X, post.unsqueeze(-1), v.unsqueeze(-2))}  # res X + post ⊗ v

    def read_head(self, state):
        return state["X"].sum(-2)

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        L, n = self.n_layers, self.n
        dt = mix_dtype(trace.embed)
        c = torch.zeros(b, t, L + 1, L + 1, 1, dtype=dt, device=trace.embed.device)
        # coef[b, t, k, s]: how much of source s stream k holds; every stream starts as the embedding.
        coef = torch.zeros(b, t, n, L + 1, dtype=dt, device=trace.embed.device)
        coef[..., 0] = 1.0
        for l in range(L):
            pre, res, post = (trace.mixer[(key, l)].to(dt) for key in ("pre", "res", "post"))
            c[:, :, l, :, 0] = torch.einsum("btk,btks->bts", pre, coef)
            coef = torch.einsum("btjk,btks->btjs", res, coef)
            coef[..., l + 1] += post
        c[:, :, L, :, 0] = coef.sum(2)
        return c

    def stream_floats_per_token(self):
        return self.n * self.d_model
