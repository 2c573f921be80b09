"""DenseFormer: depth-weighted averaging of every earlier block output (Pagliardini et al., 2024,
arXiv:2402.02622).

After transformer block ``i`` a depth-weighted average (DWA) replaces the residual stream by
``Y_i = Σ_{j≤i} α_{i,j} X_j``, where ``X_0 = e`` and ``X_j`` is the stream at the end of block ``j`` (its input
``Y_{j-1}`` plus the block's attention and MLP outputs); ``Y_i`` is the next block's input and, after the last
block, the head's. The ``α`` are static learned scalars initialized to the identity (``α_{i,i} = 1``, else 0),
so at the start this is PreLN exactly. Our layers are sublayers, so as in the paper the DWA runs after each
block, i.e. after every second layer (attention, MLP); a trailing odd layer counts as a block of its own. The
paper's dilation and period options (sparser DWA) are not implemented. Each block output is written once into
a depth buffer, and a DWA is one matrix-vector product over the outputs so far where they lie, whose backward adds
each output's gradient into the buffer's in place (``variants/kernels/weighted_read.py``). Axes: b batch, t time,
d width, s source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from variants.base import DepthMixer, register
from variants.kernels.buffer import DepthBuffer
from variants.kernels.weighted_read import buffer_read
from variants.ops import mix_dtype


@register("denseformer")
class DenseFormer(DepthMixer):
    """DenseFormer: a learned weighted average of all earlier block outputs after every block."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__(cfg, d_model=d_model, n_layers=n_layers)
        self.n_dwa = (n_layers + 1) // 2
        # alphas[i] weighs X_0 .. X_{i+1} after block i + 1: the identity, i.e. all weight on the newest.
        self.alphas = nn.ParameterList(
            nn.Parameter(torch.cat([torch.zeros(i + 1), torch.ones(1)])) for i in range(self.n_dwa)
        )

    def ends_block(self, layer: int) -> bool:
        """Whether a DWA follows ``layer`` (every MLP, and a trailing lone layer)."""
        return layer % 2 == 1 or layer == self.n_layers - 1

    def init_state(self, e):
        # (the running stream, the block outputs so far: X_0 = e, then one per block, (b·t, d) each)
        X0 = e.to(mix_dtype(e)).reshape(-1, self.d_model)
        return e, DepthBuffer.allocate(self.n_dwa + 1, X0).append(X0)

    def read(self, state, layer):
        return state[0]

    def write(self, state, layer, out):
        x, outputs = state
        x = x + out
        if not self.ends_block(layer):
            return x, outputs
        dt = mix_dtype(x)
        outputs = outputs.append(x.to(dt).reshape(-1, self.d_model))
        alpha = self.alphas[outputs.n - 2].to(dt)  # DWA i reads X_0 .. X_{i+1}
        with torch.autocast(x.device.type, enabled=False):
            return buffer_read(outputs, alpha).view(x.shape), outputs

    def read_head(self, state):
        return state[0]

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        L = self.n_layers
        dt = mix_dtype(trace.embed)
        c = torch.zeros(L + 1, L + 1, dtype=dt, device=trace.embed.device)
        # Static weights: track each stream as coefficients over the sources (0 the embedding, i + 1 the v_i).
        coef = torch.zeros(L + 1, dtype=dt, device=trace.embed.device)
        coef[0] = 1.0
        outputs = [coef]
        for l in range(L):
            c[l] = coef
            coef = coef.clone()
            coef[l + 1] += 1.0
            if self.ends_block(l):
                outputs.append(coef)
                alpha = self.alphas[len(outputs) - 2].detach().to(dt)
                coef = (torch.stack(outputs, dim=-1) * alpha).sum(-1)
        c[L] = coef
        return c[None, None, :, :, None].expand(b, t, -1, -1, 1)

    def stream_floats_per_token(self):
        # During the last block: X_0 .. X_{N-1} kept for the final DWA, plus the running stream.
        return (self.n_dwa + 1) * self.d_model

    def extra_flops_per_token(self):
        # The DWA after block i multiplies and adds i + 1 vectors; the residual additions are PreLN's own.
        return sum(2 * self.d_model * (i + 2) for i in range(self.n_dwa))
