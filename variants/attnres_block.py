"""AttnRes, block: attention over depth at the granularity of blocks of layers (Kimi Team, "Attention
Residuals", 2026, arXiv:2603.15031, Block AttnRes).

Layers are grouped into blocks of ``S`` consecutive layers; ``b_n`` is the sum of block ``n``'s outputs and
``b_0 = e``. Layer ``i`` of block ``n`` reads ``Σ_s softmax_s(w_l^T RMSNorm(src_s)) src_s`` over the sources
``[b_0, ..., b_{n-1}]`` plus the partial sum of its own block so far, when it has one (``i > 0``). The head reads
every completed block and the last partial one with its own pseudo-query. The carried state shrinks from
``L + 1`` to about ``L / S + 1`` vectors per token; ``S = 1`` is full AttnRes. Pseudo-queries start at zero
(uniform weights), the key RMSNorm has no gain, as in ``attnres``.

Each completed block is written once into a depth buffer; a read attends over the blocks where they lie and the
partial sum beside them, taking every key norm in the same pass, as full AttnRes does (``attend``: the fused
kernel where it runs). Axes: b batch, t time, d width, s source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from variants.attnres import attend, sources
from variants.base import DepthMixer, register
from variants.ops import mix_dtype
from variants.registry import knob


@register("attnres-block")
class AttnResBlock(DepthMixer):
    """Block Attention Residuals: softmax over block sums and the current block's partial sum."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        block_size: int = knob(
            4,
            "layers per block (attention and MLP count one each); 1 is full attnres",
            allowed="an integer of at least 1",
        )

        def __post_init__(self):
            if self.block_size < 1:
                raise ValueError(f"block_size must be an integer of at least 1, got {self.block_size}")

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__(cfg, d_model=d_model, n_layers=n_layers)
        self.block_size = cfg.block_size
        # Row l - 1 is layer l's pseudo-query, the last row the head's; zeros give uniform weights at step 0.
        # Layer 0 sees only the embedding, where a softmax over one source is 1 whatever its query: it has none.
        self.queries = nn.Parameter(torch.zeros(n_layers, d_model))

    def init_state(self, e):
        # (completed block sums in a depth buffer, (b·t, d) each; the current block's partial sum or None; e, to
        # shape the reads)
        return sources(e, 1 + self.n_layers // self.block_size), None, e

    def read(self, state, layer):
        blocks, partial, e = state
        return attend(self, blocks, layer, e, partial)

    def write(self, state, layer, out):
        blocks, partial, e = state
        # Sums accumulate in at least float32, like PreLN's stream under bf16 autocast.
        out = out.to(mix_dtype(out))
        partial = out if partial is None else partial + out
        if (layer + 1) % self.block_size:
            return blocks, partial, e
        return blocks.append(partial.reshape(-1, self.d_model)), None, e

    def read_head(self, state):
        return self.read(state, self.n_layers)

    def _source_spans(self, reader: int) -> list[tuple[int, int]]:
        """Each source of ``reader`` as a half-open range of mixing-matrix columns (0 the embedding)."""
        S = self.block_size
        done = reader // S  # completed blocks before this reader
        spans = [(0, 1)] + [(1 + n * S, 1 + (n + 1) * S) for n in range(done)]
        if reader % S:
            spans.append((1 + done * S, 1 + reader))
        return spans

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        L = self.n_layers
        c = torch.zeros(b, t, L + 1, L + 1, 1, dtype=mix_dtype(trace.embed), device=trace.embed.device)
        for reader in range(L + 1):
            w = trace.mixer[("weights", reader)].to(c.dtype)  # (b, t, sources)
            for s, (lo, hi) in enumerate(self._source_spans(reader)):
                c[:, :, reader, lo:hi, 0] = w[:, :, s, None]
        return c

    def stream_floats_per_token(self):
        # The head reads the embedding, every completed block and the last partial one.
        return (1 + math.ceil(self.n_layers / self.block_size)) * self.d_model

    def sizes(self) -> dict[str, int]:
        return {"block size": self.block_size, "blocks": math.ceil(self.n_layers / self.block_size)}

    def extra_flops_per_token(self):
        d, L = self.d_model, self.n_layers
        sources = sum(len(self._source_spans(r)) for r in range(L + 1))
        partial_keys = sum(1 for r in range(L + 1) if r % self.block_size)
        keys = 3 * d * (1 + L // self.block_size + partial_keys)  # RMS normalizations
        attend = 4 * d * sources + 3 * sources  # logits and weighted sum (2 flops per multiply-add), softmax
        # The partial sums cost the L additions PreLN makes too, so they are not extra.
        return keys + attend
