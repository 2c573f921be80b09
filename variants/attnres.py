"""AttnRes, full: each layer's input is a softmax attention over depth (Kimi Team, "Attention Residuals", 2026,
arXiv:2603.15031).

The stream is the list of every earlier output ``[v_{-1} = e, v_0, ..., v_{l-1}]`` (the paper's ``v_0 = e``).
Layer ``l`` reads ``a_l = Σ_i softmax_i(w_l^T RMSNorm(v_i)) v_i`` with a learned, input-independent
pseudo-query ``w_l ∈ R^d``, zero-initialized so that every layer starts from the uniform average of what came
before; keys are normalized, values are not, and there is no residual ``x + ...``: the read is the input. The
head aggregates all ``L + 1`` sources with its own pseudo-query. Unpublished detail: the key RMSNorm has no
gain, since a per-channel gain would only rescale ``w_l``.

Every output is written once into a depth buffer, and a read attends over the sources so far where they lie,
taking each key norm in the same pass (``variants/kernels/softmax_read``: the fused kernel where it runs); its
backward adds each source's gradient into the buffer's in place. Eager, compiled and on GPU alike, the read is
that one op. The buffer keeps the outputs in their own precision (bf16 under autocast, which halves what every read
loads); the embedding, float32 there, is the read's one source outside it, so no digit of it is lost. Axes: b batch,
t time, d width, s source.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from variants.base import DepthMixer, register
from variants.kernels import softmax_read
from variants.kernels.buffer import DepthBuffer
from variants.ops import mix_dtype


def sources(e: torch.Tensor, capacity: int) -> DepthBuffer:
    """A depth buffer for ``capacity`` sources like ``e`` (b, t, d), in mixing precision, with ``e`` written."""
    e = e.to(mix_dtype(e)).reshape(-1, e.shape[-1])
    return DepthBuffer.allocate(capacity, e).append(e)


def attend(mixer: DepthMixer, buffer: DepthBuffer, reader: int, like: torch.Tensor, extra=None) -> torch.Tensor:
    """Reader ``reader``'s softmax read over ``buffer``'s sources (and ``extra``), shaped like ``like`` (b, t, d),
    with its weights recorded when the mixer traces. Reader 0 has no pseudo-query: a softmax over its one source
    is 1 whatever the query, so a zero query stands in."""
    query = mixer.queries[reader - 1] if reader else mixer.queries.new_zeros(mixer.d_model)
    x = None if extra is None else extra.reshape(-1, mixer.d_model)
    if mixer.trace is not None:
        mixer.record("weights", reader, softmax_read.weights(buffer, query, x).view(*like.shape[:-1], -1))
    return softmax_read.buffer_read(buffer, query, x).view(like.shape)


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
        # (the outputs so far, (b·t, d) each in a depth buffer that the first write allocates in its own dtype; e,
        # the source read beside them)
        return None, e

    def read(self, state, layer):
        buffer, e = state
        if buffer is None:  # layer 0 reads the embedding alone, with weight 1
            if self.trace is not None:
                self.record("weights", layer, e.new_ones(*e.shape[:-1], 1))
            return e.to(mix_dtype(e))
        return attend(self, buffer, layer, e, e)

    def write(self, state, layer, out):
        buffer, e = state
        out = out.reshape(-1, self.d_model)
        buffer = buffer or DepthBuffer.allocate(self.n_layers, out)
        return buffer.append(out), e

    def read_head(self, state):
        return self.read(state, self.n_layers)

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        L = self.n_layers
        c = torch.zeros(b, t, L + 1, L + 1, 1, dtype=mix_dtype(trace.embed), device=trace.embed.device)
        for reader in range(L + 1):
            w = trace.mixer[("weights", reader)].to(c.dtype)  # (b, t, reader + 1): v_0 .. v_{reader-1}, then e
            c[:, :, reader, 0, 0] = w[..., -1]
            c[:, :, reader, 1 : reader + 1, 0] = w[..., :-1]
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
