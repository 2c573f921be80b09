"""AttnRes, full: each layer's input is a softmax attention over depth (Kimi Team, "Attention Residuals", 2026,
arXiv:2603.15031).

The stream is the list of every earlier output ``[v_{-1} = e, v_0, ..., v_{l-1}]`` (the paper's ``v_0 = e``).
Layer ``l`` reads ``a_l = Σ_i softmax_i(w_l^T RMSNorm(v_i)) v_i`` with a learned, input-independent
pseudo-query ``w_l ∈ R^d``, zero-initialized so that every layer starts from the uniform average of what came
before; keys are normalized, values are not, and there is no residual ``x + ...``: the read is the input. The
head aggregates all ``L + 1`` sources with its own pseudo-query. Unpublished detail: the key RMSNorm has no
gain, since a per-channel gain would only rescale ``w_l``.

Two implementations compute the same function (``mixer.impl``). ``reference`` follows the formula: each read
stacks every earlier key and value and attends over them, so autograd keeps a fresh (b, t, s, d) stack per read,
O(L²·d) floats per token. ``fused``, the default, keeps every value once in one buffer and, because the query is
input-independent, turns the logits into ``ρ_s (v_s · w_r)`` with ``ρ_s`` the key norm's scale: each value's logits
for all later readers are one matrix product when it is written. A read is then a softmax over a row of that table
and one batched product; its backward leaves ``∂a_r`` and the logits' gradients in buffers (``∂a_r`` over value
``r + 1``, which no read still to run needs), and each write's backward collects its value's gradient from them at
once (``FusedWrite``). Nothing per (read, source) pair is saved or allocated, and the outputs are let go of once
copied into the buffer. tests/test_fast_paths.py holds it to the reference in float64.
Axes: b batch, t time, d width, s source, r reader, n token (b·t flattened).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from variants import kernels
from variants.base import DepthMixer, register
from variants.kernels.softmax_read import softmax_read
from variants.ops import _rms
from variants.ops.tape import graph_kept


def mix_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32 for mixing weights, never below the input precision (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


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
    if query is not None and weights is None and kernels.active(keys[0]):
        # One pass of the fused kernel, which takes the key norm itself: the keys go unused (a compiled graph
        # drops them).
        v = torch.stack([x.to(dt) for x in values], dim=-2)  # (b, t, s, d)
        return softmax_read(v.flatten(0, -3), query.to(dt), RMS_EPS).view(*v.shape[:-2], -1), None
    k = torch.stack(keys, dim=-2)  # (b, t, s, d)
    if query is None:
        weights = k.new_ones(k.shape[:-1])
    else:
        # Elementwise product and sum rather than a matmul, so bf16 autocast cannot lower the precision.
        logits = (k * query.to(dt)).sum(-1)  # (b, t, s)
        weights = torch.softmax(logits, dim=-1)
    v = torch.stack([x.to(dt) for x in values], dim=-2)  # (b, t, s, d)
    return (weights.unsqueeze(-1) * v).sum(-2), weights


RMS_EPS = 1e-6


def store_source(buf, v: torch.Tensor, queries: torch.Tensor, s: int, first: int) -> None:
    """Keep source ``s`` in ``buf.values`` (n, sources, d), its key scale ``ρ_s`` in ``buf.scale`` and its logits
    ``ρ_s v_s · w_r`` for readers ``first`` .. L in ``buf.logits`` (n, sources, readers): the pseudo-queries do not
    depend on the input, so every later reader's logit is known when the source is written."""
    n, _, d = buf.values.shape
    x = v.reshape(n, d).to(buf.values.dtype)
    buf.values[:, s] = x
    rho = _rms(x, RMS_EPS)  # (n, 1)
    buf.scale[:, s] = rho.squeeze(-1)
    if first < buf.logits.shape[-1]:
        buf.logits[:, s, first:] = (x @ queries[first - 1 :].to(x.dtype).mT) * rho


def logits_backward(dv, g, rho, logits, x, queries, queries_grad: bool) -> torch.Tensor | None:
    """Add into ``dv`` (n, d) what the logits ``ℓ_r = ρ (x · w_r)`` of one source ``x`` (n, d) pass back,
    ``Σ_r g_r (ρ w_r − ρ² ℓ_r x / d)`` with ``g`` their gradients and ``ℓ`` their values (n, r'), ``ρ`` the key
    norm's scale (n, 1), ``queries`` the readers' ``w_r`` (r', d); return the queries' share ``Σ_n g_r ρ x``
    (r', d), or None when ``queries_grad`` is false."""
    gr = g * rho
    dv.addmm_(gr, queries)
    c = (g * logits).sum(-1, keepdim=True) * rho.square() / x.shape[-1]
    dv.addcmul_(c, x, value=-1.0)
    return gr.mT @ x if queries_grad else None


def add_logits_backward(buf, s: int, first: int, dv: torch.Tensor, queries_grad: bool) -> torch.Tensor | None:
    """``logits_backward`` for source ``s`` of the buffers, its logits' gradients from ``buf.dlogits`` (n, sources,
    readers); the queries' share is returned as a gradient of all of ``buf.queries``."""
    x = buf.values[:, s]
    queries = buf.queries[first - 1 :].to(x.dtype)
    g, logits = buf.dlogits[:, s, first:], buf.logits[:, s, first:]
    dw = logits_backward(dv, g, buf.scale[:, s, None], logits, x, queries, queries_grad)
    if dw is None:
        return None
    dq = torch.zeros_like(buf.queries)
    dq[first - 1 :] = dw.to(dq.dtype)
    return dq


class DepthBuffers:
    """One forward pass of the fused path: every source's value and key scale, the logits of every (reader, source)
    pair, the reads' softmax weights, and what the reads' backward passes leave for the writes' backward."""

    def __init__(self, e: torch.Tensor, queries: torch.Tensor):
        b, t, d = e.shape
        n, L = b * t, queries.shape[0]
        dt = mix_dtype(e)
        self.shape, self.queries = (b, t, d), queries
        # Source s at [:, s]: e, v_0, ..., v_{L-1}; the last row takes the head's ∂a in backward (``backward_buffers``).
        self.values = e.new_empty(n, L + 2, d, dtype=dt)
        self.scale = e.new_empty(n, L + 1, dtype=dt)  # ρ_s = 1 / sqrt(mean(v_s²) + eps)
        self.logits = e.new_zeros(n, L + 1, L + 1, dtype=dt)  # [n, s, r] = ρ_s v_s · w_r for r ≥ max(s, 1)
        self.weights = e.new_zeros(n, L + 1, L + 1, dtype=dt)  # [n, r, s] = softmax_s of reader r
        self.dlogits: torch.Tensor | None = None  # [n, s, r], filled by the reads' backward passes
        self.dreads: torch.Tensor | None = None  # [n, r, d] = ∂a_r
        self.read_back: set[int] = set()  # the readers whose backward has run in this pass

    @staticmethod
    def first_reader(s: int) -> int:
        """The first reader that needs source ``s``'s logit (reader 0 reads the embedding alone, with weight 1)."""
        return max(s, 1)

    def backward_buffers(self) -> None:
        """Reader ``r``'s ``∂a_r`` goes over source ``r + 1``: the read's backward runs after the backward of source
        ``r + 1``'s write (which the read's output produced), and only readers after ``r`` read that source. So the
        values' memory holds the gradients, instead of a second buffer of fresh memory, slow to touch on CPU; a
        backward that keeps the graph for another leaves the values alone and uses a buffer of its own."""
        n, rows, d = self.values.shape
        if self.dlogits is None:
            self.dlogits = self.values.new_zeros(n, rows - 1, rows - 1)
        if self.dreads is None:  # kept by a backward that kept the graph, for the next one
            self.dreads = self.values.new_zeros(n, rows - 1, d) if graph_kept() else self.values[:, 1:]

    def collected_reads(self, first: int) -> torch.Tensor:
        """``∂a_r`` of readers ``first`` .. L, with zeros for any whose backward did not run."""
        readers = self.dreads.shape[1]
        for r in set(range(first, readers)) - self.read_back:
            self.dreads[:, r].zero_()
            self.read_back.add(r)
        return self.dreads[:, first:]


class FusedWrite(torch.autograd.Function):
    """Source ``s`` into the buffers, returning a handle for the reads to take. Forward stores it and its logits
    for every later reader; backward collects ``∂v_s = Σ_r p_rs ∂a_r + Σ_r g_rs (ρ_s w_r − ρ_s² ℓ_rs v_s / d)``
    (``g`` the logits' gradients, ``ℓ`` the logits) and the queries' share ``∂w_r = Σ_n g_rs ρ_s v_s`` once every
    read of it has run its backward."""

    @staticmethod
    def forward(ctx, v, queries, buf: DepthBuffers, s: int):
        store_source(buf, v, queries, s, first=buf.first_reader(s))
        ctx.buf, ctx.s, ctx.v_dtype = buf, s, v.dtype
        ctx.set_materialize_grads(False)  # the reads return None for their sources
        # The reads take the buffer's copy; an output is then let go of, and only its handle (empty) orders the
        # backward passes. The embedding stays itself: reader 0 returns it.
        return v.view_as(v) if s == 0 else v.new_empty(0)

    @staticmethod
    @once_differentiable
    def backward(ctx, dv_in):
        buf, s = ctx.buf, ctx.s
        S = buf.logits.shape[-1]  # readers
        first = buf.first_reader(s)
        dq = None
        with torch.autocast(buf.values.device.type, enabled=False):
            if first < S and buf.dreads is not None:
                # Contiguous: a batched product on this strided column falls back to one call per token.
                p = buf.weights[:, first:, s].contiguous().unsqueeze(1)  # (n, 1, r')
                dv = torch.bmm(p, buf.collected_reads(first)).squeeze(1)  # Σ_r p_rs ∂a_r
                if s == 0:  # the embedding's: the last write's backward of this pass
                    buf.read_back.clear()
                dq = add_logits_backward(buf, s, first, dv, ctx.needs_input_grad[1])
            else:
                dv = None
        if dv is None:
            return dv_in, dq, None, None
        dv = dv.view(buf.shape).to(ctx.v_dtype)
        return (dv if dv_in is None else dv.add_(dv_in)), dq, None, None


class FusedRead(torch.autograd.Function):
    """``a_r = Σ_{s≤r} softmax_s(ℓ_rs) v_s`` from the buffers; ``apply(buf, r, *sources)``, the sources passed only
    so that autograd runs their writes' backward after this one."""

    @staticmethod
    def forward(ctx, buf: DepthBuffers, r: int, *sources):
        p = torch.softmax(buf.logits[:, : r + 1, r], dim=-1)  # (n, s)
        buf.weights[:, r, : r + 1] = p
        a = torch.bmm(p.unsqueeze(1), buf.values[:, : r + 1]).squeeze(1)  # (n, d)
        ctx.buf, ctx.r, ctx.n_sources = buf, r, len(sources)
        return a.view(buf.shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, da):
        buf, r = ctx.buf, ctx.r
        n, _, d = buf.values.shape
        buf.backward_buffers()
        with torch.autocast(buf.values.device.type, enabled=False):
            da = da.reshape(n, d).to(buf.values.dtype)
            p = buf.weights[:, r, : r + 1]
            # ∂a_rᵀ V_sᵀ rather than V_s ∂a_r: the same products, about twice as fast on CPU as batched matvecs.
            dp = torch.bmm(da.unsqueeze(1), buf.values[:, : r + 1].mT).squeeze(1)  # v_s · ∂a_r, (n, s)
            buf.dlogits[:, : r + 1, r] = p * (dp - (p * dp).sum(-1, keepdim=True))
            buf.dreads[:, r] = da  # after the products above: it may go over source r + 1
            buf.read_back.add(r)
        return (None, None) + (None,) * ctx.n_sources


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

    impl: Literal["fused", "reference"] = "fused"

    def init_state(self, e):
        # The fused path hands buffers between its autograd nodes outside the graph, which torch.compile cannot
        # trace; a compiled model runs the reference form of the same math (tests/test_compile.py). Reads and
        # writes follow the state's form, so they agree with the choice made here.
        if self.impl == "reference" or torch.compiler.is_compiling() or kernels.runs_on(e.device):
            # Values and their normalized keys; each key is computed once, when its output is written.
            return [e], [rms_normalize(e)]
        buf = DepthBuffers(e, self.queries)
        return buf, [FusedWrite.apply(e, self.queries, buf, 0)]

    def _read(self, state, reader: int):
        if not isinstance(state[0], DepthBuffers):
            values, keys = state
            a, weights = depth_attention(self.queries[reader - 1] if reader else None, keys, values, self.trace)
            self.record("weights", reader, weights)
            return a
        buf, sources = state
        if reader == 0:  # the embedding alone, with weight 1
            self.record("weights", 0, sources[0].new_ones(*buf.shape[:2], 1, dtype=buf.values.dtype))
            return sources[0].to(buf.values.dtype)
        with torch.autocast(buf.values.device.type, enabled=False):
            a = FusedRead.apply(buf, reader, *sources[: reader + 1])
        if self.trace is not None:
            self.record("weights", reader, buf.weights[:, reader, : reader + 1].reshape(*buf.shape[:2], -1))
        return a

    def read(self, state, layer):
        return self._read(state, layer)

    def write(self, state, layer, out):
        if not isinstance(state[0], DepthBuffers):
            values, keys = state
            return values + [out], keys + [rms_normalize(out)]
        buf, sources = state
        with torch.autocast(out.device.type, enabled=False):
            return buf, sources + [FusedWrite.apply(out, self.queries, buf, layer + 1)]

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
