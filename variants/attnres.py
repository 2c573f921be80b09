"""AttnRes, full: each layer's input is a softmax attention over depth (Kimi Team, "Attention Residuals", 2026,
arXiv:2603.15031).

The stream is the list of every earlier output ``[v_{-1} = e, v_0, ..., v_{l-1}]`` (the paper's ``v_0 = e``).
Layer ``l`` reads ``a_l = Σ_i softmax_i(w_l^T RMSNorm(v_i)) v_i`` with a learned, input-independent
pseudo-query ``w_l ∈ R^d``, zero-initialized so that every layer starts from the uniform average of what came
before; keys are normalized, values are not, and there is no residual ``x + ...``: the read is the input. The
head aggregates all ``L + 1`` sources with its own pseudo-query. Unpublished detail: the key RMSNorm has no
gain, since a per-channel gain would only rescale ``w_l``.

Each key is normalized once, when its output is written; a read stacks the keys and values so far and attends over
them, where the fused kernel runs as its one pass (``variants/kernels/softmax_read``, which takes the key norm
itself), and stacks them again in backward rather than keep each read's stacked copy. Eager, compiled and on GPU
alike, autograd differentiates it. Axes: b batch, t time, d width, s source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from variants import kernels
from variants.base import DepthMixer, register
from variants.kernels.softmax_read import softmax_read
from variants.ops import mix_dtype
from variants.ops.recompute import recomputed


def rms_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm without a gain, over the last axis, in at least float32."""
    x = x.to(mix_dtype(x))
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def depth_attention(
    query: torch.Tensor | None, keys: list[torch.Tensor], values: list[torch.Tensor], weights: dict | None = None
):
    """``Σ_s softmax_s(query · keys_s) values_s`` and the weights (b, t, s), all in at least float32.

    ``query`` may be None only for a single source, whose weight is 1 whatever the query. ``weights`` is the
    trace the weights are wanted for (the mixer's ``trace``); without one, where the fused kernels run
    (``variants.kernels``), the read is their one pass and no weights are returned.
    """
    dt = keys[0].dtype  # already normalized and in mixing precision
    # The sources are stacked inside the read and again in backward, not kept stacked per read (``recomputed``).
    if query is not None and weights is None and kernels.active(keys[0]):
        # One pass of the fused kernel, which takes the key norm itself: the keys go unused (a compiled graph
        # drops them).
        return recomputed(_fused_read, query.to(dt), *values), None
    return recomputed(_attend, query, *keys, *values)


def _fused_read(query: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
    v = torch.stack([x.to(query.dtype) for x in values], dim=-2)  # (b, t, s, d)
    return softmax_read(v.flatten(0, -3), query, RMS_EPS).view(*v.shape[:-2], -1)


def _attend(query: torch.Tensor | None, *sources: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``depth_attention`` in plain PyTorch, with the sources given as the keys then the values."""
    n = len(sources) // 2
    k = torch.stack(sources[:n], dim=-2)  # (b, t, s, d)
    dt = k.dtype
    if query is None:
        weights = k.new_ones(k.shape[:-1])
    else:
        # Elementwise product and sum rather than a matmul, so bf16 autocast cannot lower the precision.
        logits = (k * query.to(dt)).sum(-1)  # (b, t, s)
        weights = torch.softmax(logits, dim=-1)
    v = torch.stack([x.to(dt) for x in sources[n:]], dim=-2)  # (b, t, s, d)
    return (weights.unsqueeze(-1) * v).sum(-2), weights


RMS_EPS = 1e-6


@register("attnres")
class AttnRes(DepthMixer):
    """Full Attention Residuals: softmax over all earlier outputs with a learned pseudo-query per layer."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        pass

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__(cfg, d_model=d_model, n_layers=n_layers)
        # Row l - 1 is layer l's pseudo-query, the last row the head's; zeros give uniform weights at step 0.
        # Layer 0 sees only the embedding, where a softmax over one source is 1 whatever its query: it has none.
        self.queries = nn.Parameter(torch.zeros(n_layers, d_model))

    def init_state(self, e):
        # Values and their normalized keys; each key is computed once, when its output is written.
        return [e], [rms_normalize(e)]

    def _read(self, state, reader: int):
        values, keys = state
        a, weights = depth_attention(self.queries[reader - 1] if reader else None, keys, values, self.trace)
        self.record("weights", reader, weights)
        return a

    def read(self, state, layer):
        return self._read(state, layer)

    def write(self, state, layer, out):
        values, keys = state
        return values + [out], keys + [rms_normalize(out)]

    def read_head(self, state):
        return self._read(state, self.n_layers)

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        L = self.n_layers
        c = torch.zeros(b, t, L + 1, L + 1, 1, dtype=mix_dtype(trace.embed), device=trace.embed.device)
        for reader in range(L + 1):
            w = trace.mixer[("weights", reader)]  # (b, t, reader + 1): the embedding, then v_0 .. v_{reader-1}
            c[:, :, reader, : reader + 1, 0] = w.to(c.dtype)
        return c

    def stream_floats_per_token(self):
        # The head reads the embedding and all L outputs (the cached keys can be recomputed, so they don't count).
        return (self.n_layers + 1) * self.d_model

    def extra_flops_per_token(self):
        d, L = self.d_model, self.n_layers
        sources = sum(r + 1 for r in range(L + 1))  # readers 0..L see r + 1 sources each
        keys = 3 * d * (L + 1)  # one RMS normalization per source
        attend = 4 * d * sources + 3 * sources  # logits and weighted sum (2 flops per multiply-add), softmax
        return keys + attend - L * d  # PreLN's own additions are not extra
