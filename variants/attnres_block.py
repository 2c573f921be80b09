"""AttnRes, block: attention over depth at the granularity of blocks of layers (Kimi Team, "Attention
Residuals", 2026, arXiv:2603.15031, Block AttnRes).

Layers are grouped into blocks of ``S`` consecutive layers; ``b_n`` is the sum of block ``n``'s outputs and
``b_0 = e``. Layer ``i`` of block ``n`` reads ``Σ_s softmax_s(w_l^T RMSNorm(src_s)) src_s`` over the sources
``[b_0, ..., b_{n-1}]`` plus the partial sum of its own block so far, when it has one (``i > 0``). The head reads
every completed block and the last partial one with its own pseudo-query. The carried state shrinks from
``L + 1`` to about ``L / S + 1`` vectors per token; ``S = 1`` is full AttnRes. Pseudo-queries start at zero
(uniform weights), the key RMSNorm has no gain, as in ``attnres``.

Two implementations compute the same function (``mixer.impl``). ``reference`` stacks the sources and attends over
them as the formula reads. ``fused``, the default, works like full AttnRes's: the queries do not depend on the
input, so a completed block's logits for every later reader, ``ρ_s (b_s · w_r)``, are one matrix product when the
block completes, and the block sums live once in one buffer. A block's partial sums are one autograd node per
layer (``BlockSum``) that passes no gradient through autograd: every read adds its share into the block's gradient
row, and each layer's output takes the row as it stands when its backward runs. A read is a softmax over a row
of the logits table plus the partial sum's logit, one batched product and one scaled addition (``BlockRead``);
its backward adds ``p_rs ∂a_r`` into one gradient row per block and leaves the logits' gradients in a table, and
each block's backward collects its gradient and the queries' from them at once. tests/test_fast_paths.py holds
the two equal in float64. Axes: b batch, t time, d width, s source, r reader, n token (b·t flattened).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from variants import kernels
from variants.attnres import (
    RMS_EPS,
    add_logits_backward,
    depth_attention,
    logits_backward,
    mix_dtype,
    rms_normalize,
    store_source,
)
from variants.base import DepthMixer, register
from variants.ops import _bdot, _rms
from variants.registry import knob


class BlockBuffers:
    """One forward pass of the fused path: the completed block sums, their logits for every later reader, and what
    the reads' backward passes leave for the blocks' backward."""

    def __init__(self, e: torch.Tensor, queries: torch.Tensor, block_size: int):
        b, t, d = e.shape
        n, readers = b * t, queries.shape[0] + 1  # layers 0 .. L - 1 and the head
        sources = 1 + (readers - 1) // block_size  # the embedding and every completed block
        dt = mix_dtype(e)
        self.shape, self.queries, self.block_size = (b, t, d), queries, block_size
        # The head may read the partial sum of an unfinished last block: its gradient needs a row of its own.
        self.gradient_rows = 1 + math.ceil((readers - 1) / block_size)
        self.values = e.new_empty(n, sources, d, dtype=dt)  # b_0 = e, b_1, ...
        self.scale = e.new_empty(n, sources, dtype=dt)  # ρ_s = 1 / sqrt(mean(b_s²) + eps)
        self.logits = e.new_zeros(n, sources, readers, dtype=dt)  # [n, s, r] = ρ_s b_s · w_r for r ≥ first(s)
        self.dlogits: torch.Tensor | None = None  # [n, s, r], filled by the reads' backward passes
        # [n, s] = Σ_r p_rs ∂a_r, likewise; for the block in progress, also what its partial sums' reads pass back
        self.dvalues: torch.Tensor | None = None

    def first_reader(self, s: int) -> int:
        """The first reader that sees block ``s`` and needs its logit (reader 0 reads the embedding alone)."""
        return max(s * self.block_size, 1)

    def backward_buffers(self) -> None:
        if self.dvalues is None:
            n, _, d = self.values.shape
            self.dlogits = torch.zeros_like(self.logits)
            self.dvalues = self.values.new_zeros(n, self.gradient_rows, d)


class BlockSum(torch.autograd.Function):
    """The partial sum of block ``s`` after one more layer, ``prev + out`` (``prev`` None for the block's first
    layer); ``completes`` when the layer is the block's last, and then the sum is stored as source ``s`` with its
    logits for every later reader. The embedding is block 0, a sum of one that completes at once.

    The partial sums pass no gradient through autograd: every read of the block's partial sums, and the later
    reads of the finished block, add theirs into the block's gradient row ``buf.dvalues[:, s]``. Backward runs
    after every read that came later (they take the sum as an input), so the row then holds ``∂(prev + out)``,
    which is ``out``'s gradient; ``prev``'s backward finds it there with the reads in between added."""

    @staticmethod
    def forward(ctx, out, prev, queries, buf: BlockBuffers, s: int, completes: bool):
        total = out.view_as(out) if prev is None else prev + out
        if completes:
            store_source(buf, total, queries, s, first=buf.first_reader(s))
        ctx.buf, ctx.s, ctx.first, ctx.completes, ctx.out_dtype = buf, s, prev is None, completes, out.dtype
        ctx.set_materialize_grads(False)  # the reads return None for the sums they read
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, dtotal):
        buf, s = ctx.buf, ctx.s
        if buf.dvalues is None:  # nothing read the sum
            return dtotal, None, None, None, None, None
        dq = None
        with torch.autocast(buf.values.device.type, enabled=False):
            row = buf.dvalues[:, s]
            first = buf.first_reader(s)
            if ctx.completes and first < buf.logits.shape[-1]:
                dq = add_logits_backward(buf, s, first, row, ctx.needs_input_grad[2])
            dout = row.clone()
            if ctx.first:
                row.zero_()  # collected: a second backward through a retained graph adds from zero
        dout = dout.view(buf.shape).to(ctx.out_dtype)
        return (dout if dtotal is None else dout.add_(dtotal)), None, dq, None, None, None


class BlockRead(torch.autograd.Function):
    """``a_r = Σ_s p_s b_s + p_partial · partial`` with ``p = softmax([ℓ_r0, ..., ℓ_partial])`` from the buffers and
    the partial sum's logit ``ℓ_partial = ρ (partial · w_r)``; ``apply(buf, r, query, partial, *blocks)`` with the
    query (d,) and the partial sum (b, t, d), or None where the reader has no partial sum. The blocks and the
    partial sum are passed so that autograd runs their backward after this one; their gradients go into the
    buffers' rows, the partial sum's into the row of the block in progress. Returns ``a_r`` (n, d) and the
    weights (n, sources)."""

    @staticmethod
    def forward(ctx, buf: BlockBuffers, r: int, query, partial, *blocks):
        m = len(blocks)
        logits = buf.logits[:, :m, r]
        if partial is not None:
            partial = partial.reshape(-1, partial.shape[-1])
            rho = _rms(partial, RMS_EPS)  # (n, 1)
            logits = torch.cat([logits, (partial @ query).unsqueeze(-1).mul_(rho)], dim=-1)
        p = torch.softmax(logits, dim=-1)  # (n, m) or (n, m + 1)
        if m == 1:  # the embedding alone: a batched product with one term runs per token
            a = buf.values[:, 0] * p[:, :1]
        else:
            a = torch.bmm(p[:, None, :m], buf.values[:, :m]).squeeze(1)  # (n, d)
        if partial is not None:
            a.addcmul_(partial, p[:, m:])
            ctx.save_for_backward(p, partial, query, rho, logits[:, m:])
        else:
            ctx.save_for_backward(p)
        ctx.buf, ctx.r, ctx.m = buf, r, m
        ctx.mark_non_differentiable(p)
        return a, p

    @staticmethod
    @once_differentiable
    def backward(ctx, da, _):
        buf, r, m = ctx.buf, ctx.r, ctx.m
        p, *partial_terms = ctx.saved_tensors
        buf.backward_buffers()
        dp = torch.bmm(da.unsqueeze(1), buf.values[:, :m].mT).squeeze(1)  # b_s · ∂a_r, (n, m), as in attnres
        if partial_terms:
            partial, query, rho, logit = partial_terms
            dp = torch.cat([dp, _bdot(partial, da)], dim=-1)
        g = p * (dp - _bdot(p, dp))  # the logits' gradient
        buf.dlogits[:, :m, r] = g[:, :m]
        # p_rs ∂a_r into every block's row, and the partial sum's into its block's, elementwise: a batched product
        # on this strided slice runs per token.
        rows = p.shape[-1]
        buf.dvalues[:, :rows].addcmul_(p[:, :, None], da[:, None, :])
        if not partial_terms:
            return (None, None, None, None) + (None,) * m
        # What the partial sum's logit passes back, into the same row.
        dquery = logits_backward(buf.dvalues[:, m], g[:, m:], rho, logit, partial, query[None], ctx.needs_input_grad[2])
        return (None, None, None if dquery is None else dquery[0], None) + (None,) * m


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

    impl: Literal["fused", "reference"] = "fused"

    def init_state(self, e):
        # The fused path hands buffers between its autograd nodes outside the graph, which torch.compile cannot
        # trace; a compiled model runs the reference form of the same math, as full AttnRes does.
        if self.impl == "reference" or torch.compiler.is_compiling() or kernels.runs_on(e.device):
            # (completed block sums, their normalized keys, partial sum of the current block or None)
            return [e], [rms_normalize(e)], None
        # (completed block sums, the buffers that also hold them, partial sum or None)
        buf = BlockBuffers(e, self.queries, self.block_size)
        with torch.autocast(e.device.type, enabled=False):
            return [BlockSum.apply(e, None, self.queries, buf, 0, True)], buf, None

    def _read(self, state, reader: int):
        blocks, keys_or_buffers, partial = state
        if not isinstance(keys_or_buffers, BlockBuffers):
            keys = keys_or_buffers
            if partial is not None:
                blocks, keys = blocks + [partial], keys + [rms_normalize(partial)]
            a, weights = depth_attention(self.queries[reader - 1] if reader else None, keys, blocks, self.trace)
            self.record("weights", reader, weights)
            return a
        buf = keys_or_buffers
        (b, t, d), dt = buf.shape, buf.values.dtype
        if reader == 0:  # the embedding alone, with weight 1
            self.record("weights", 0, blocks[0].new_ones(b, t, 1, dtype=dt))
            return blocks[0].to(dt)
        with torch.autocast(buf.values.device.type, enabled=False):
            # ρ (partial · w): the partial sum's key is never materialized.
            query = None if partial is None else self.queries[reader - 1].to(dt)
            a, weights = BlockRead.apply(buf, reader, query, partial, *blocks)
        self.record("weights", reader, weights.view(b, t, -1))
        return a.view(b, t, d)

    def read(self, state, layer):
        return self._read(state, layer)

    def write(self, state, layer, out):
        blocks, keys_or_buffers, partial = state
        # Sums accumulate in at least float32, like PreLN's stream under bf16 autocast.
        out = out.to(mix_dtype(out))
        completes = (layer + 1) % self.block_size == 0
        if not isinstance(keys_or_buffers, BlockBuffers):
            partial = out if partial is None else partial + out
            if not completes:
                return blocks, keys_or_buffers, partial
            return blocks + [partial], keys_or_buffers + [rms_normalize(partial)], None
        buf, s = keys_or_buffers, 1 + layer // self.block_size
        with torch.autocast(out.device.type, enabled=False):
            partial = BlockSum.apply(out, partial, self.queries, buf, s, completes)
        return (blocks + [partial], buf, None) if completes else (blocks, buf, partial)

    def read_head(self, state):
        return self._read(state, self.n_layers)

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

    def extra_flops_per_token(self):
        d, L = self.d_model, self.n_layers
        sources = sum(len(self._source_spans(r)) for r in range(L + 1))
        partial_keys = sum(1 for r in range(L + 1) if r % self.block_size)
        keys = 3 * d * (1 + L // self.block_size + partial_keys)  # RMS normalizations
        attend = 4 * d * sources + 3 * sources  # logits and weighted sum (2 flops per multiply-add), softmax
        # The partial sums cost the L additions PreLN makes too, so they are not extra.
        return keys + attend
