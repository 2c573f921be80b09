"""DenseFormer: depth-weighted averaging of every earlier block output (Pagliardini et al., 2024,
arXiv:2402.02622).

After transformer block ``i`` a depth-weighted average (DWA) replaces the residual stream by
``Y_i = Σ_{j≤i} α_{i,j} X_j``, where ``X_0 = e`` and ``X_j`` is the stream at the end of block ``j`` (its input
``Y_{j-1}`` plus the block's attention and MLP outputs); ``Y_i`` is the next block's input and, after the last
block, the head's. The ``α`` are static learned scalars initialized to the identity (``α_{i,i} = 1``, else 0),
so at the start this is PreLN exactly. Our layers are sublayers, so as in the paper the DWA runs after each
block, i.e. after every second layer (attention, MLP); a trailing odd layer counts as a block of its own. The
paper's dilation and period options (sparser DWA) are not implemented. ``mixer.impl``: ``fused`` (the default)
computes each DWA with ``WeightedAverage``, whose backward keeps nothing but the block outputs the state holds
anyway, and each output's gradient is summed in one buffer (``variants/gradients.py``); ``reference`` stacks
them as the formula reads (autograd then saves a fresh (b, t, d, s) stack per DWA, O(L²·d) floats per token).
tests/test_fast_paths.py holds them equal in float64. Axes: b batch, t time, d width, s source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from variants.base import DepthMixer, register
from variants.gradients import Gathered, GradientSum


def mix_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32 for mixing weights, never below the input precision (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


class WeightedAverage(torch.autograd.Function):
    """``Y = Σ_j α_j X_j``: ``apply(alpha, grads, *outputs)`` with ``alpha`` (s,) and outputs (b, t, d), one
    precision; ``grads`` one ``GradientSum`` per output (or None, to return its gradient to autograd)."""

    @staticmethod
    def forward(ctx, alpha, grads, *outputs):
        y = outputs[0] * alpha[0]
        for j in range(1, len(outputs)):
            y.addcmul_(outputs[j], alpha[j])
        ctx.grads = grads
        ctx.save_for_backward(alpha, *outputs)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        alpha, *outputs = ctx.saved_tensors
        dy = dy.contiguous()
        flat = dy.reshape(-1)
        dalpha = torch.stack([x.reshape(-1) @ flat for x in outputs]) if ctx.needs_input_grad[0] else None
        doutputs = []
        for j, grad in enumerate(ctx.grads):
            if not ctx.needs_input_grad[2 + j]:
                doutputs.append(None)
            elif grad is None:
                doutputs.append(dy * alpha[j])
            else:
                grad.add(dy, alpha[j])
                doutputs.append(None)
        return dalpha, None, *doutputs


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
        # (the running stream, the block outputs X_0 .. X_i so far, their gradients' collectors)
        source, grad = self._source(e)
        return e, [source], [grad]

    def _source(self, x: torch.Tensor) -> tuple[torch.Tensor, GradientSum | None]:
        """A block output as the DWAs read it, and where they add its gradient: through ``Gathered`` on the fused
        path under autograd, where the DWAs read it in its own precision; as it is otherwise."""
        if (
            self.impl != "fused"
            or not (torch.is_grad_enabled() and x.requires_grad)
            or x.dtype != mix_dtype(x)
            or torch.compiler.is_compiling()
        ):
            return x, None
        grad = GradientSum()
        (source,) = Gathered.apply((grad,), x)
        return source, grad

    def read(self, state, layer):
        return state[0]

    def write(self, state, layer, out):
        x, outputs, grads = state
        x = x + out
        if not self.ends_block(layer):
            return x, outputs, grads
        source, grad = self._source(x)
        outputs, grads = outputs + [source], grads + [grad]
        dt = mix_dtype(x)
        alpha = self.alphas[len(outputs) - 2].to(dt)
        with torch.autocast(x.device.type, enabled=False):
            if self.impl == "reference":
                stacked = torch.stack([X.to(dt) for X in outputs], dim=-1)  # (b, t, d, s)
                return (stacked * alpha).sum(-1), outputs, grads
            return WeightedAverage.apply(alpha, tuple(grads), *[X.to(dt) for X in outputs]), outputs, grads

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
