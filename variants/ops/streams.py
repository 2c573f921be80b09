"""The expanded residual stream shared by HC and mHC: ``n`` parallel copies of the residual, mixed per token.

The state is ``X ∈ R^{n×d}`` per token, every row ``e`` at the start; the head reads the sum of the rows. Layer
``l`` reads ``a_l = Σ_k pre_k X_k`` and writes ``X ← res X + post ⊗ v_l``, where ``pre`` (n), ``res`` (n×n) and
``post`` (n) are the connections a subclass computes from ``X`` (``connections``). Only how those are computed
differs between Hyper-Connections and mHC; reading, writing and the depth-mixing matrix are the same.

Two implementations compute the same function (``mixer.impl``). ``fused``, the default, reads and writes through
``StreamRead`` and ``StreamWrite``, whose backward passes are written out (a few passes over a token's ``n·d``
floats instead of the layout copies and temporaries autograd makes around per-token ``einsum``s), applies the
connections' RMSNorm after their projection (``normalized_projection``) and, in mHC, runs Sinkhorn with a
hand-written backward. ``reference`` is the plain form of all three; tests/test_fast_paths.py holds the fused one
to it in float64, and docs/notes/benchmark-history.md has what each change saved.

The fused path also checkpoints the stream (``StreamTape``, on ``variants/ops/tape.py``). Every layer's read,
connections and write need that layer's ``X`` in backward, ``n·d`` floats per token per layer, which was most of
what HC and mHC held above PreLN. Autograd keeps ``X`` only at every ``segment``-th layer (``⌈√L⌉`` by default);
the others are recomputed in backward, one segment at a time, from the nearest kept ``X`` and the writes
``X ← res X + post ⊗ v`` after it, whose ``res``, ``post`` and ``v`` autograd keeps anyway. The recomputation
repeats the forward's own operations on the same inputs, so it is bit for bit the ``X`` of the forward pass.
Axes: b batch, t time, j and k streams, d width, s source.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch.autograd.function import once_differentiable

from variants.base import DepthMixer
from variants.ops import normalized_projection
from variants.ops.gradients import Gathered, GradientSum
from variants.ops.tape import Tape, default_segment


def mix_dtype(x: torch.Tensor) -> torch.dtype:
    """At least float32 for mixing weights, never below the input precision (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


class StreamRead(torch.autograd.Function):
    """``a = Σ_k pre_k X_k``: ``pre`` (..., k), ``X`` (..., k, d) -> (..., d). Given ``grad``, the ``GradientSum`` of
    ``X``, backward adds ``X``'s gradient there and returns none (as ``StreamWrite`` and the connections do)."""

    @staticmethod
    def forward(ctx, pre, X, grad=None):
        pre = pre.contiguous()  # static weights arrive broadcast over tokens; the product wants real strides
        ctx.grad = grad
        ctx.save_for_backward(pre, X)
        return (pre.unsqueeze(-2) @ X).squeeze(-2)

    @staticmethod
    @once_differentiable
    def backward(ctx, da):
        pre, X = ctx.saved_tensors
        # daᵀ Xᵀ rather than X da: the same products, about twice as fast on CPU as batched matvecs.
        dpre = (da.unsqueeze(-2) @ X.mT).squeeze(-2) if ctx.needs_input_grad[0] else None  # X_k · da
        dX = None
        if ctx.needs_input_grad[1]:  # pre ⊗ da
            if ctx.grad is None:
                dX = pre.unsqueeze(-1) * da.unsqueeze(-2)
            else:
                ctx.grad.add(pre.unsqueeze(-1), da.unsqueeze(-2))
        return dpre, dX, None


def stream_write(res: torch.Tensor, X: torch.Tensor, post: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``res X + post ⊗ v`` for contiguous ``res`` and ``post``: the forward of ``StreamWrite``, and what the tape
    runs again to recompute a stream."""
    # In place on the product's fresh output: no temporary for post ⊗ v.
    return (res @ X).addcmul_(post.unsqueeze(-1), v.unsqueeze(-2))


class StreamWrite(torch.autograd.Function):
    """``Y = res X + post ⊗ v``: ``res`` (..., j, k), ``X`` (..., k, d), ``post`` (..., j), ``v`` (..., d)."""

    @staticmethod
    def forward(ctx, res, X, post, v, tape=None, layer=None, grad=None):
        res, post = res.contiguous(), post.contiguous()
        ctx.grad = grad
        ctx.save_for_backward(res, X, post, v)
        if tape is not None:
            tape.writes[layer] = (res.detach(), post.detach(), v.detach())
        return stream_write(res, X, post, v)

    @staticmethod
    @once_differentiable
    def backward(ctx, dY):
        res, X, post, v = ctx.saved_tensors
        need = ctx.needs_input_grad
        # The head's sum over streams hands back a broadcast gradient; products on it would loop per token.
        dY = dY.contiguous()
        dres = dY @ X.mT if need[0] else None  # dY_j · X_k
        dX = res.mT @ dY if need[1] else None
        if dX is not None and ctx.grad is not None:
            ctx.grad.add_tensor(dX)
            dX = None
        dpost = (v.unsqueeze(-2) @ dY.mT).squeeze(-2) if need[2] else None  # dY_j · v, as dpre in StreamRead
        dv = (post.unsqueeze(-2) @ dY).squeeze(-2) if need[3] else None  # Σ_j post_j dY_j
        return dres, dX, dpost, dv, None, None, None


class StreamTape(Tape):
    """The tape of the expanded stream: ``X_l`` kept at every ``segment``-th layer, the others recomputed by
    ``stream_write`` from the ``(res, post, v)`` that ``StreamWrite`` records for each layer."""

    def __init__(self, segment: int):
        super().__init__(segment, lambda X, res, post, v: stream_write(res, X, post, v))


class ExpandedStream(DepthMixer):
    """Base of mixers that carry ``n`` residual streams; subclasses set ``self.n`` and define ``connections``."""

    n: int
    impl: Literal["fused", "reference"] = "fused"
    # Layers per checkpointed segment of the stream on the fused path: None for ⌈√L⌉, which keeps about 2√L of
    # the L streams at once (√L kept, one segment recomputed); 1 keeps every layer's stream, as autograd would.
    stream_segment: int | None = None

    def segment(self) -> int:
        return self.stream_segment or default_segment(self.n_layers)

    def connections(self, X: torch.Tensor, layer: int, grad: GradientSum | None = None):
        """``pre`` (b, t, k), ``res`` (b, t, j, k) and ``post`` (b, t, j) of ``layer`` for streams ``X``; ``grad``,
        where ``X``'s gradient is summed, goes on to ``normalized_projection``."""
        raise NotImplementedError

    def normalized_projection(self, x, weight, *, dims: int = 1, grad: GradientSum | None = None) -> torch.Tensor:
        """``RMSNorm(x) W`` with a gainless norm over the last ``dims`` axes of ``x`` taken as one; the fused path
        is ``ops``'s, which never makes the normalized copy of ``x``."""
        if self.impl == "reference":
            x = x.flatten(-dims)
            return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ weight
        return normalized_projection(x, weight, dims=dims, grad=grad)

    def init_state(self, e):
        # Contiguous, not a broadcast view: the products below would otherwise fall back to one call per token.
        X = e.to(mix_dtype(e)).unsqueeze(-2).expand(*e.shape[:-1], self.n, e.shape[-1]).contiguous()
        segment = self.segment()
        return self._state(X, StreamTape(segment) if segment > 1 and self._fused_autograd() else None)

    def _fused_autograd(self) -> bool:
        # Under torch.compile the compiler plans the backward; eager training without gradients saves nothing.
        return self.impl == "fused" and torch.is_grad_enabled() and not torch.compiler.is_compiling()

    def _state(self, X, tape):
        # A dict so that read can leave the connections it computed for write, which sees the same X.
        state = {"X": X}
        if tape is not None:
            state["tape"] = tape
        # The write, the read and the connections each use X: on the fused path they add X's gradient into one
        # sum, which Gathered hands to autograd, instead of each making an (n·d)-float gradient to be added up.
        if X.requires_grad and self._fused_autograd():
            state["grad"] = GradientSum()
            (state["X"],) = Gathered.apply((state["grad"],), X)
        return state

    @staticmethod
    def _saving(state, layer):
        tape = state.get("tape")
        return tape.saving(layer, state["X"]) if tape is not None else contextlib.nullcontext()

    def read(self, state, layer):
        X = state["X"]
        with self._saving(state, layer):
            pre, res, post = self.connections(X, layer, state.get("grad"))
            state["connections"] = (layer, pre, res, post)
            for key, value in (("pre", pre), ("res", res), ("post", post)):
                self.record(key, layer, value)
            with torch.autocast(X.device.type, enabled=False):
                if self.impl == "reference":
                    return torch.einsum("btk,btkd->btd", pre, X)
                return StreamRead.apply(pre, X, state.get("grad"))

    def write(self, state, layer, out):
        X, tape = state["X"], state.get("tape")
        with self._saving(state, layer):
            cached = state.get("connections")
            if cached is None or cached[0] != layer:
                cached = (layer, *self.connections(X, layer, state.get("grad")))
            _, pre, res, post = cached
            with torch.autocast(X.device.type, enabled=False):
                v = out.to(X.dtype)
                if self.impl == "reference":
                    X = torch.einsum("btjk,btkd->btjd", res, X) + post.unsqueeze(-1) * v.unsqueeze(-2)
                else:
                    X = StreamWrite.apply(res, X, post, v, tape, layer, state.get("grad"))
        return self._state(X, tape)

    def read_head(self, state):
        return state["X"].sum(-2)

    def mixing_matrix(self, trace):
        b, t, _ = trace.embed.shape
        L, n = self.n_layers, self.n
        dt = mix_dtype(trace.embed)
        c = torch.zeros(b, t, L + 1, L + 1, 1, dtype=dt, device=trace.embed.device)
        # coef[b, t, k, s]: how much of source s stream k holds; every stream starts as the embedding.
        coef = torch.zeros(b, t, n, L + 1, dtype=dt, device=trace.embed.device)
        coef[..., 0] = 1.0
        for l in range(L):
            pre, res, post = (trace.mixer[(key, l)].to(dt) for key in ("pre", "res", "post"))
            c[:, :, l, :, 0] = torch.einsum("btk,btks->bts", pre, coef)
            coef = torch.einsum("btjk,btks->btjs", res, coef)
            coef[..., l + 1] += post
        c[:, :, L, :, 0] = coef.sum(2)
        return c

    def stream_floats_per_token(self):
        return self.n * self.d_model
