"""DenseFormer: depth-weighted averaging of every earlier block output (Pagliardini et al., 2024,
arXiv:2402.02622).

After transformer block ``i`` a depth-weighted average (DWA) replaces the residual stream by
``Y_i = Σ_{j≤i} α_{i,j} X_j``, where ``X_0 = e`` and ``X_j`` is the stream at the end of block ``j`` (its input
``Y_{j-1}`` plus the block's attention and MLP outputs); ``Y_i`` is the next block's input and, after the last
block, the head's. The ``α`` are static learned scalars initialized to the identity (``α_{i,i} = 1``, else 0),
so at the start this is PreLN exactly. Our layers are sublayers, so as in the paper the DWA runs after each
block, i.e. after every second layer (attention, MLP); a trailing odd layer counts as a block of its own. The
paper's dilation and period options (sparser DWA) are not implemented. ``mixer.impl``: ``fused`` (the default)
keeps the block outputs in one buffer, a row each (``OutputBuffer``), so that a DWA is one matrix-vector product
over its rows (``WeightedAverage``) and so is its weights' gradient; each DWA's backward leaves ``∂Y_i`` in the
row of an output no DWA still to run reads, and each output's gradient ``Σ_i α_{i,j} ∂Y_i`` is one product over
the DWAs that read it (``Stored``), taken once they have all run. A DWA then reads each output once in forward
and once in backward instead of making a pass over it and over its sum for every term. ``reference`` stacks them
as the formula reads (autograd then saves a fresh (b, t, d, s) stack per DWA, O(L²·d) floats per token).
tests/test_fast_paths.py holds them equal in float64. Axes: b batch, t time, d width, s source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from variants.base import DepthMixer, register
from variants.ops.tape import graph_kept


def mix_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32 for mixing weights, never below the input precision (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


class OutputBuffer:
    """One forward pass of the fused path: block output ``j`` in row ``j`` of ``outputs`` and the weights each DWA
    used in row ``i`` of ``weights``. In backward, DWA ``i`` leaves ``∂Y_i`` in row ``i + 1`` of ``outputs``: once its
    own backward has taken its weights' gradient, no DWA still to run reads ``X_{i+1}``, so the output's memory
    holds the gradient instead of a second buffer, which on CPU would be fresh memory to touch. A backward that keeps
    the graph for another leaves the outputs alone and uses a buffer of its own."""

    def __init__(self, e: torch.Tensor, n_dwa: int):
        dt = mix_dtype(e)
        self.shape = e.shape
        self.outputs = e.new_empty(n_dwa + 1, *e.shape, dtype=dt)  # X_0 = e, X_1, ..., X_n
        self.weights = e.new_zeros(n_dwa, n_dwa + 1, dtype=dt)  # [i, j] = α_{i,j}, zero where DWA i did not run
        self.kept: torch.Tensor | None = None  # ∂Y_i in row i + 1 when the graph is kept
        self.dys = self.outputs  # where this backward pass leaves ∂Y_i (row i + 1)
        self.done: set[int] = set()  # the DWAs whose backward has run in this pass

    @staticmethod
    def rows(buf: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows ``lo`` .. ``hi - 1`` of ``buf``, each flattened: the matrix the products take."""
        return buf[lo:hi].view(hi - lo, -1)

    def dy_row(self, i: int) -> torch.Tensor:
        """Where DWA ``i``'s backward leaves ``∂Y_i``, flat."""
        if graph_kept():
            if self.kept is None:
                self.kept = torch.empty_like(self.outputs)
            self.dys = self.kept
        else:
            self.dys = self.outputs
        self.done.add(i)
        return self.dys[i + 1].view(-1)


class Stored(torch.autograd.Function):
    """Block output ``j`` into its row of the buffer. Returns an empty handle: the DWAs read the row, and take the
    handle so that autograd runs this backward after all of theirs, which returns ``Σ_i α_{i,j} ∂Y_i`` over the
    DWAs ``i ≥ j - 1`` that read it. The output itself is not kept."""

    @staticmethod
    def forward(ctx, x, buf: OutputBuffer, j: int):
        buf.outputs[j].copy_(x)
        ctx.buf, ctx.j, ctx.x_dtype = buf, j, x.dtype
        ctx.set_materialize_grads(False)
        return x.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, _):
        buf, j = ctx.buf, ctx.j
        if not buf.done:  # no DWA's backward ran
            return None, None, None
        first, n_dwa = max(j - 1, 0), buf.weights.shape[0]  # DWA i reads X_0 .. X_{i+1}
        for i in set(range(first, n_dwa)) - buf.done:  # a DWA that got no gradient adds nothing
            buf.dys[i + 1].zero_()
            buf.done.add(i)
        dx = torch.mv(buf.rows(buf.dys, first + 1, n_dwa + 1).mT, buf.weights[first:, j])
        if j == 0:  # the last of this backward pass
            buf.done.clear()
        return dx.view(buf.shape).to(ctx.x_dtype), None, None


class WeightedAverage(torch.autograd.Function):
    """DWA ``i``: ``Y_i = Σ_{j≤i+1} α_j X_j`` over the buffer's rows, one product; ``apply(alpha, buf, i,
    *handles)`` with ``alpha`` (i + 2,) and the handles of ``X_0 .. X_{i+1}``. Backward returns the weights'
    gradient ``⟨X_j, ∂Y_i⟩``, one product too, and then leaves ``∂Y_i`` for the outputs' ``Stored`` nodes."""

    @staticmethod
    def forward(ctx, alpha, buf: OutputBuffer, i: int, *handles):
        k = alpha.shape[0]
        buf.weights[i, :k] = alpha
        ctx.buf, ctx.i, ctx.n_handles = buf, i, len(handles)
        return torch.mv(buf.rows(buf.outputs, 0, k).mT, alpha).view(buf.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        buf, i = ctx.buf, ctx.i
        dy = dy.reshape(-1)
        dalpha = torch.mv(buf.rows(buf.outputs, 0, i + 2), dy) if ctx.needs_input_grad[0] else None
        buf.dy_row(i).copy_(dy)  # over X_{i+1}, which no DWA still to run reads
        return dalpha, None, None, *(None,) * ctx.n_handles


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

    impl: Literal["fused", "reference"] = "fused"

    def ends_block(self, layer: int) -> bool:
        """Whether a DWA follows ``layer`` (every MLP, and a trailing lone layer)."""
        return layer % 2 == 1 or layer == self.n_layers - 1

    def init_state(self, e):
        # (the running stream, the block outputs so far or their handles, the buffer of the fused path or None).
        # The fused path hands buffers between its autograd nodes outside the graph, which torch.compile cannot
        # trace; a compiled model runs the reference form of the same math, as AttnRes does.
        if self.impl == "reference" or torch.compiler.is_compiling():
            return e, [e], None
        buf = OutputBuffer(e, self.n_dwa)
        with torch.autocast(e.device.type, enabled=False):
            return e, [Stored.apply(e, buf, 0)], buf

    def read(self, state, layer):
        return state[0]

    def write(self, state, layer, out):
        x, outputs, buf = state
        x = x + out
        if not self.ends_block(layer):
            return x, outputs, buf
        dt = mix_dtype(x)
        i = len(outputs) - 1  # this DWA's index; it reads X_0 .. X_{i+1}
        alpha = self.alphas[i].to(dt)
        with torch.autocast(x.device.type, enabled=False):
            if buf is None:
                outputs = outputs + [x]
                stacked = torch.stack([X.to(dt) for X in outputs], dim=-1)  # (b, t, d, s)
                return (stacked * alpha).sum(-1), outputs, None
            outputs = outputs + [Stored.apply(x, buf, i + 1)]
            return WeightedAverage.apply(alpha, buf, i, *outputs), outputs, buf

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
