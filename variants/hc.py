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

from harness.registry import knob
from variants.base import DepthMixer, register


def mix_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32 for mixing weights, never below the input precision (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


@register("hc")
class HyperConnections(DepthMixer):
    """Hyper-Connections: n residual streams, read and rewritten by (dynamic) mixing matrices."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        expansion: int = knob(4, "number of parallel residual streams n", allowed="an integer of at least 1")
        dynamic: bool = knob(True, "input-dependent mixing weights (DHC) or static ones (SHC)",
                             allowed="on or off")

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
        with torch.autocast(H.device.type, enabled=False):
            Hn = H.to(dt)
            Hn = Hn * torch.rsqrt(Hn.pow(2).mean(-1, keepdim=True) + 1e-6)
            z = torch.tanh(torch.einsum("btkd,dc->btkc", Hn, self.proj[layer].to(dt)))  # (b, t, k, n + 2)
        sa, sb = self.scale[layer].to(dt)
        return am + sa * z[..., 0], ar + sa * z[..., 1 : n + 1], bw + sb * z[..., n + 1]

    def init_state(self, e):
        # A dict so that read can leave the weights it computed for write, which sees the same H.
        return {"H": e.unsqueeze(-2).expand(*e.shape[:-1], self.n, e.shape[-1]).to(mix_dtype(e))}

    def read(self, state, layer):
        H = state["H"]
        am, ar, bw = self.weights(H, layer)
        state["weights"] = (layer, am, ar, bw)
        for key, value in (("A_m", am), ("A_r", ar), ("B", bw)):
            self.record(key, layer, value)
        with torch.autocast(H.device.type, enabled=False):
            return torch.einsum("btk,btkd->btd", am, H)

    def write(self, state, layer, out):
        H = state["H"]
        cached = state.get("weights")
        if cached is None or cached[0] != layer:
            cached = (layer, *self.weights(H, layer))
        _, am, ar, bw = cached
        with torch.autocast(H.device.type, enabled=False):
            H = torch.einsum("btkj,btkd->btjd", ar, H) + bw.unsqueeze(-1) * out.to(H.dtype).unsqueeze(-2)
        return {"H": H}

    def read_head(self, state):
        return state["H"].sum(-2)

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        L, n = self.n_layers, self.n
        dt = mix_dtype(trace.embed)
        c = torch.zeros(b, t, L + 1, L + 1, 1, dtype=dt, device=trace.embed.device)
        # coef[b, t, k, s]: how much of source s stream k holds; every stream starts as the embedding.
        coef = torch.zeros(b, t, n, L + 1, dtype=dt, device=trace.embed.device)
        coef[..., 0] = 1.0
        for l in range(L):
            am, ar, bw = (trace.mixer[(key, l)].to(dt) for key in ("A_m", "A_r", "B"))
            c[:, :, l, :, 0] = torch.einsum("btk,btks->bts", am, coef)
            coef = torch.einsum("btkj,btks->btjs", ar, coef)
            coef[..., l + 1] += bw
        c[:, :, L, :, 0] = coef.sum(2)
        return c

    def stream_floats_per_token(self):
        return self.n * self.d_model

    def extra_flops_per_token(self):
        n, d, L = self.n, self.d_model, self.n_layers
        per_layer = 2 * n * d + 2 * n * n * d + 2 * n * d  # read, stream mixing, writing v into n streams
        if self.dynamic:
            per_layer += 3 * n * d + 2 * n * d * (n + 2) + 3 * n * (n + 2)  # norm, projection, tanh and scale
        return L * (per_layer - d) + (n - 1) * d  # minus PreLN's additions; the head sums n rows
