"""LDM's query and key networks (spec §3), and the pass that runs a layer's networks on one input together and
recomputes them in backward instead of keeping their activations (``MLPPass``).

Axes: b batch, t time, d width.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from variants.ops import rms_scale
from variants.ops.layers import RMSNorm
from variants.ops.tape import Recomputes, Tape, graph_kept

NORM_EPS = 1e-6  # the mixer does not see the model's norm_eps; the decoder's default


class SmallMLP(nn.Module):
    """``RMSNorm → Linear(d, h) → SiLU → Linear(h, out)``: one layer's query or key network (spec §3)."""

    def __init__(self, d: int, hidden: int, out: int):
        super().__init__()
        self.norm = RMSNorm(d, NORM_EPS)
        # Biases: the spec leaves them open; kept, as in a default nn.Linear.
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x):
        # Weights are cast to the input's precision so the memory math stays float32 even when the model's
        # parameters are bf16 (and float64 in a float64 model).
        dt = x.dtype
        h = F.silu(F.linear(self.norm(x), self.fc1.weight.to(dt), self.fc1.bias.to(dt)))
        return F.linear(h, self.fc2.weight.to(dt), self.fc2.bias.to(dt))


def shared_input_mlps(x: torch.Tensor, mlps: list[SmallMLP]) -> list[torch.Tensor]:
    """``[mlp(x) for mlp in mlps]``, for MLPs that all read ``x``: one RMS normalization and one first-layer
    product for all of them, each norm's gain folded into its first layer's weights; under autograd recomputed
    in backward (``MLPPass``)."""
    return MLPPass(mlps).run(x)


class MLPPass(Recomputes):
    """One pass of query/key MLPs over one input (``_shared_input_mlps``), recomputed in backward at most once for
    everything that needs it, instead of keeping its normalized input and hidden layer (three (b, t, d)-sized
    tensors per layer, the largest share of the mixer's saved memory).

    The pass keeps no tensor of its own for backward. Its input comes back from the residual stream's tape
    (``variants/ops/tape.py``) where the mixer has one, or is held here (the residual or a read, which the model holds
    anyway). ``finish`` (the normalization of queries and keys) runs inside the pass, so the nodes of the same
    layer that use its outputs need not keep them either: within ``keeping(t)`` autograd gets a handle for output
    ``t``. The first backward to need the pass (the read's, the whitening's, or the pass's own) runs it again with
    autograd on, for all of them. Recomputation repeats the same operations on the same inputs, so values and
    gradients are the forward's bit for bit."""

    def __init__(self, mlps, finish=None, tape: Tape | None = None, layer: int = 0):
        self.mlps, self.finish = mlps, finish
        self.tape, self.layer = tape, layer
        self.x: torch.Tensor | None = None
        self.dtype: torch.dtype | None = None
        self.graph: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.recomputes = False
        self._outputs: list[int] = []  # the outputs' storages, by position

    def _forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = _shared_input_mlps(x.to(self.dtype), self.mlps)
        return outs if self.finish is None else self.finish(outs)

    def run(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """The MLPs' outputs on ``x`` taken in ``dtype`` (``x``'s own by default), through ``finish``."""
        self.dtype = dtype or x.dtype
        params = [p for m in self.mlps for p in m.parameters()]
        if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
            return self._forward(x)
        if torch.compiler.is_compiling():
            return list(checkpoint(self._forward, x, use_reentrant=False))
        if self.tape is not None:
            self.tape.keep(self.layer, x)
        else:
            self.x = x.detach()  # the residual or a read, which the model holds anyway
        self.recomputes = True
        outs = list(_RecomputedMLPs.apply(x, self, *params))
        self._outputs = [o.untyped_storage().data_ptr() for o in outs]
        return outs

    def recomputed(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The input (a leaf) and the outputs of the pass run again with autograd on, until its backward used them."""
        if self.graph is None:
            x = self.tape.stream(self.layer) if self.tape is not None else self.x
            # The recomputation's saved tensors live only in this backward: hooks around the forward (save_on_cpu,
            # a meter of saved bytes) are not for them, so an innermost pair of hooks keeps them as they are.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(torch.Tensor.detach, _identity):
                x = x.detach().requires_grad_()
                self.graph = (x, self._forward(x))
        return self.graph

    def again(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The pass on ``x`` once more, with autograd as the caller has it: for a use of an output that comes after
        the pass's backward would have recomputed it (``RawKey``)."""
        return self._forward(x)

    def index(self, t: torch.Tensor) -> int | None:
        """Which output of the pass ``t`` is, or None where the pass does not recompute (nothing to save)."""
        return self._outputs.index(t.untyped_storage().data_ptr()) if self.recomputes else None

    def keeping(self, t: torch.Tensor):
        """A context in which autograd keeps ``t``, an output of this pass, as a handle to its recomputation."""
        if not self.recomputes:
            return contextlib.nullcontext()
        return self._instead_of(t, self.index(t))

    def recompute(self, index: int) -> torch.Tensor:
        return self.recomputed()[1][index].detach()


class RawKey(NamedTuple):
    """LDM-RLS's raw key for the float64 hand-over (``rls.replay``), made again from its pass's input if the
    hand-over happens rather than kept alive through the forward pass: a (b, t, d)-sized tensor per layer that
    nothing else keeps. The pass runs with autograd on its input, which the model holds anyway, so the replay's
    gradient reaches the MLPs and the residual as the kept key's would."""

    mlp_pass: MLPPass
    x: torch.Tensor
    index: int

    def __call__(self) -> torch.Tensor:
        return self.mlp_pass.again(self.x)[self.index]


class _RecomputedMLPs(torch.autograd.Function):
    """``MLPPass``'s node: ``apply(x, mlp_pass, *params)`` with ``params`` every MLP's parameters in ``parameters()``
    order, so that autograd hands them their gradients. It saves nothing; backward takes the recomputed pass."""

    @staticmethod
    def forward(ctx, x, mlp_pass, *params):
        ctx.mlp_pass = mlp_pass
        return tuple(mlp_pass._forward(x))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *douts):
        mlp_pass, need = ctx.mlp_pass, ctx.needs_input_grad
        x, outs = mlp_pass.recomputed()
        mlp_pass.graph = None  # used: a second backward through a retained graph recomputes it
        if not graph_kept():
            mlp_pass.x = None  # the graph holds this node until the step ends; its input is not needed again
        params = [p for m in mlp_pass.mlps for p in m.parameters()]
        used = [(o, g) for o, g in zip(outs, douts) if g is not None]
        inputs = [x] + [p for p, n in zip(params, need[2:]) if n]
        if not used:
            return (None,) * len(need)
        grads = iter(torch.autograd.grad([o for o, _ in used], inputs, [g for _, g in used], allow_unused=True))
        dx = next(grads)
        return dx if need[0] else None, None, *(next(grads) if n else None for n in need[2:])


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _shared_input_mlps(x: torch.Tensor, mlps: list[SmallMLP]) -> list[torch.Tensor]:
    dt = x.dtype
    xn = x * rms_scale(x, NORM_EPS)
    w1 = torch.cat([m.fc1.weight.to(dt) * m.norm.weight.to(dt) for m in mlps])
    b1 = torch.cat([m.fc1.bias.to(dt) for m in mlps])
    hidden = F.silu(F.linear(xn, w1, b1)).split([m.fc1.out_features for m in mlps], dim=-1)
    return [F.linear(h, m.fc2.weight.to(dt), m.fc2.bias.to(dt)) for h, m in zip(hidden, mlps)]
