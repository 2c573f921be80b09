"""mHC: Manifold-Constrained Hyper-Connections, ``n`` residual streams mixed by doubly stochastic matrices
(Xie et al., 2025, arXiv:2512.24880).

The stream is ``X ∈ R^{n×d}`` per token, every row ``e`` at the start; the head reads the sum of the rows.
Layer ``l`` reads ``a_l = H^pre X`` and writes ``X ← H^res X + (H^post)^T v_l``. The coefficients come from
``x' = RMSNorm(vec(X))`` (all ``n·d`` channels at once): ``H̃^pre = α^pre x'φ^pre + b^pre``,
``H̃^post = α^post x'φ^post + b^post``, ``H̃^res = α^res mat(x'φ^res) + b^res``, then ``H^pre = sigmoid(H̃^pre)``,
``H^post = 2·sigmoid(H̃^post)`` and ``H^res = SinkhornKnopp(exp(H̃^res))`` (column then row normalization), all in
at least float32, with the gates ``α`` starting at 0.01. Unpublished choices: biases start at ``b^pre = 0``,
``b^post = 0`` and ``b^res`` = 0 on the diagonal, -8 elsewhere, so ``H^pre = 1/2``, ``H^post = 1`` and
``H^res ≈ I`` (within 1e-3): every stream starts as PreLN's ``x``, and the layer's own pre-norm removes the
scale of ``a``; ``φ ~ N(0, 1/(n·d))``, so ``x'φ`` has unit scale; the RMSNorm has no gain (it would only rescale
``φ``). Axes: b batch, t time, j and k streams, d width, s source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from variants.base import register
from variants.kernels.sinkhorn import sinkhorn
from variants.ops import mix_dtype, normalized_projection
from variants.ops.recompute import recomputed
from variants.ops.streams import ExpandedStream
from variants.registry import knob

OFF_DIAGONAL_LOGIT = -8.0  # exp(-8) ≈ 3e-4: H^res starts within 1e-3 of the identity for n up to 4


def _projection(X: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """``RMSNorm(vec(X)) φ`` per token: (b, t, n, d) and (n·d, n·n + 2n) -> (b, t, n·n + 2n)."""
    return normalized_projection(X, phi, dims=2)


@register("mhc")
class ManifoldHyperConnections(ExpandedStream):
    """mHC: n residual streams mixed by a Sinkhorn-projected, input-dependent doubly stochastic matrix."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        expansion: int = knob(4, "number of parallel residual streams n", allowed="an integer of at least 1")
        sinkhorn_iters: int = knob(
            20,
            "Sinkhorn-Knopp iterations projecting H^res onto doubly stochastic matrices",
            allowed="an integer of at least 1",
        )

        def __post_init__(self):
            if self.expansion < 1:
                raise ValueError(f"expansion must be an integer of at least 1, got {self.expansion}")
            if self.sinkhorn_iters < 1:
                raise ValueError(f"sinkhorn_iters must be an integer of at least 1, got {self.sinkhorn_iters}")

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__(cfg, d_model=d_model, n_layers=n_layers)
        n = self.n = cfg.expansion
        self.iters = cfg.sinkhorn_iters
        width = n * n + 2 * n  # outputs: n for H^pre, n for H^post, n·n for H^res
        # One projection per layer for all three coefficient sets: phi^pre | phi^post | phi^res.
        self.phi = nn.Parameter(torch.randn(n_layers, n * d_model, width) / (n * d_model) ** 0.5)
        self.alpha = nn.Parameter(torch.full((n_layers, 3), 0.01))  # gates of pre, post, res
        b_res = torch.full((n, n), OFF_DIAGONAL_LOGIT).fill_diagonal_(0.0)
        self.bias = nn.Parameter(torch.cat([torch.zeros(2 * n), b_res.flatten()]).repeat(n_layers, 1))

    def coefficients(self, X: torch.Tensor, layer: int):
        """``H^pre`` (b, t, k), ``H^post`` (b, t, j) and ``H^res`` (b, t, j, k) of ``layer`` for streams ``X``."""
        b, t, n, _ = X.shape
        dt = mix_dtype(X)
        # RMSNorm(vec(X)) φ, (b, t, n·n + 2n): the norm over all n·d channels of a token at once. The product
        # takes the caller's autocast, like the trunk's linear layers (bf16 on tensor cores): H^res is doubly
        # stochastic and averages streams that differ little, so the rounding stays at PreLN's own bf16 error. The
        # norm, the gates and Sinkhorn stay float32. Under autocast it is recomputed in backward, so that autocast's
        # bf16 copy of X (n·d per token and layer) is not kept for it; without, nothing would be saved by that.
        X, phi = X.to(dt), self.phi[layer].to(dt)
        autocast = torch.is_autocast_enabled(X.device.type)
        z = (recomputed(_projection, X, phi) if autocast else _projection(X, phi)).to(dt)
        alpha, bias = self.alpha[layer].to(dt), self.bias[layer].to(dt)
        pre = torch.sigmoid(alpha[0] * z[..., :n] + bias[:n])
        post = 2.0 * torch.sigmoid(alpha[1] * z[..., n : 2 * n] + bias[n : 2 * n])
        res_logits = (alpha[2] * z[..., 2 * n :] + bias[2 * n :]).view(b * t, n, n)  # (b·t, j, k)
        return pre, post, sinkhorn(res_logits, self.iters).view(b, t, n, n)

    def connections(self, X, layer):
        pre, post, res = self.coefficients(X, layer)
        return pre, res, post

    def sizes(self) -> dict[str, int]:
        return {"streams": self.n}

    def extra_flops_per_token(self):
        n, d, L = self.n, self.d_model, self.n_layers
        width = n * n + 2 * n
        coefficients = 3 * n * d + 2 * n * d * width + 3 * width  # norm, projection, gate, bias and activation
        sinkhorn = n * n + 4 * n * n * self.iters  # exp, then a sum and a division per entry per normalization
        streams = 2 * n * d + 2 * n * n * d + 2 * n * d  # read, stream mixing, writing v into n streams
        return L * (coefficients + sinkhorn + streams - d) + (n - 1) * d  # minus PreLN's additions; head sum
