"""HC: Hyper-Connections, ``n`` parallel residual streams mixed by learned matrices (Zhu et al., 2024,
arXiv:2409.19606).

The stream is ``H ∈ R^{n×d}`` per token, every row ``e`` at the start; the head reads the sum of the rows.
Layer ``l`` reads ``a = A_m^T H`` and writes ``H ← A_r^T H + B^T v`` with ``A_m ∈ R^n``, ``A_r ∈ R^{n×n}`` and
``B ∈ R^n``. Static initialization, as in the paper: ``A_m = e_{l mod n}``, ``A_r = I``, ``B = 1``, so with
``n = 1`` this is PreLN exactly. Dynamic HC adds input-dependent terms ``s · tanh(norm(H) W)`` (per row of
``H``) with ``W = 0`` and learned scales ``s = 0.01`` at the start (the paper's Algorithm 2). Unpublished
detail: ``norm`` is an RMSNorm without gain, like the decoder's norms (a gain would only rescale ``W``).
Axes: b batch, t time, k and j streams, d width, s source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from variants.base import register
from variants.ops import mix_dtype, normalized_projection
from variants.ops.streams import ExpandedStream
from variants.registry import knob


@register("hc")
class HyperConnections(ExpandedStream):
    """Hyper-Connections: n residual streams, read and rewritten by (dynamic) mixing matrices."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        expansion: int = knob(4, "number of parallel residual streams n", allowed="an integer of at least 1")
        dynamic: bool = knob(True, "input-dependent mixing weights (DHC) or static ones (SHC)", allowed="on or off")

        def __post_init__(self):
            if self.expansion < 1:
                raise ValueError(f"expansion must be an integer of at least 1, got {self.expansion}")

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__(cfg, d_model=d_model, n_layers=n_layers)
        n = self.n = cfg.expansion
        self.dynamic = cfg.dynamic
        am = torch.zeros(n_layers, n)
        am[torch.arange(n_layers), torch.arange(n_layers) % n] = 1.0
        self.static_am = nn.Parameter(am)
        self.static_ar = nn.Parameter(torch.eye(n).repeat(n_layers, 1, 1))
        self.static_b = nn.Parameter(torch.ones(n_layers, n))
        if self.dynamic:
            # One projection per layer for all three: column 0 is A_m, columns 1..n are A_r, column n + 1 is B.
            self.proj = nn.Parameter(torch.zeros(n_layers, d_model, n + 2))
            # Learned scales s_alpha (A_m, A_r) and s_beta (B) per layer; their gradient is zero only while W is.
            self.scale = nn.Parameter(torch.full((n_layers, 2), 0.01))

    def weights(self, H: torch.Tensor, layer: int):
        """``A_m`` (b, t, k), ``A_r`` (b, t, k, j) and ``B`` (b, t, j) of ``layer`` for streams ``H`` (b, t, k, d)."""
        b, t, n, _ = H.shape
        dt = mix_dtype(H)
        am, ar, bw = (p[layer].to(dt) for p in (self.static_am, self.static_ar, self.static_b))
        if not self.dynamic:
            return am.expand(b, t, n), ar.expand(b, t, n, n), bw.expand(b, t, n)
        # Float32 even under bf16 autocast, unlike mHC's: A_r = I + s·tanh(·) scales the whole stream, so a bf16
        # product's rounding would land on all of it, not only on the sublayer's output as in PreLN.
        with torch.autocast(H.device.type, enabled=False):
            H = H.to(dt)
            z = torch.tanh(normalized_projection(H, self.proj[layer].to(dt)))  # (b, t, k, n + 2)
        sa, sb = self.scale[layer].to(dt)
        return am + sa * z[..., 0], ar + sa * z[..., 1 : n + 1], bw + sb * z[..., n + 1]

    def connections(self, H, layer):
        am, ar, bw = self.weights(H, layer)
        return am, ar.transpose(-1, -2), bw  # H ← A_r^T H: the shared stream code mixes with res = A_r^T

    def sizes(self) -> dict[str, int]:
        return {"streams": self.n}

    def extra_flops_per_token(self):
        n, d, L = self.n, self.d_model, self.n_layers
        per_layer = 2 * n * d + 2 * n * n * d + 2 * n * d  # read, stream mixing, writing v into n streams
        if self.dynamic:
            per_layer += 3 * n * d + 2 * n * d * (n + 2) + 3 * n * (n + 2)  # norm, projection, tanh and scale
        return L * (per_layer - d) + (n - 1) * d  # minus PreLN's additions; the head sums n rows
