"""The Read/Write interface every depth mixer implements (spec §1), and the variant registry.

A mixer carries its streams from layer to layer. For layer ``l`` the decoder calls ``read(state, l)`` for the
layer's input ``a_l``, runs the layer to get ``v_l``, then ``write(state, l, v_l)`` for the next state; both calls
see the state before the layer, ``S_{l-1}``, so queries and keys come from the same streams. The state is
whatever the mixer wants it to be (a tensor, a tuple, a dict); the decoder only passes it along.

Introspection (spec §7) is part of the interface: ``mixing_matrix`` gives the weight ``c[l, i]`` with which
reader ``l`` (layer ``l``, or the head at ``l = L``) contains source ``i`` (``0`` the embedding, ``i + 1`` the
output ``v_i``), per token and per channel group; the cost methods give the analytic floor of a variant's
overhead over PreLN.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from variants.registry import Registry


class DepthMixer(nn.Module, abc.ABC):
    """Base class of all depth mixers; subclasses define a nested ``Config`` dataclass of knobs.

    Shapes: ``b`` batch, ``t`` tokens, ``d`` the model width, ``L`` the number of layers (each attention and each
    MLP sublayer is one layer), ``G`` the mixer's channel groups (1 where it has none). A subclass must implement
    every abstract method below; registering a class that misses one is an error at import time. The decoder
    calls them in this order for one forward pass::

        state = init_state(e)
        for l in range(L):
            a = read(state, l); v = layer_l(a); state = write(state, l, v)
        h = read_head(state)

    Under bf16 weights a mixer may keep its state in float32 (the decoder casts each read to the model's dtype);
    reads must be differentiable with respect to everything the state was built from.
    """

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__()
        self.cfg = cfg
        self.d_model = d_model
        self.n_layers = n_layers
        # A dict while the decoder records a trace, else None: variants store their mixing weights here.
        self.trace: dict | None = None

    # -- the interface -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def init_state(self, e: torch.Tensor) -> Any:
        """The state before layer 0 from the embedding ``e`` (b, t, d): any object the mixer's own methods read."""

    @abc.abstractmethod
    def read(self, state: Any, layer: int) -> torch.Tensor:
        """Layer ``layer``'s input ``a_l`` (b, t, d) from the state before it. Must not modify ``state``."""

    @abc.abstractmethod
    def write(self, state: Any, layer: int, out: torch.Tensor) -> Any:
        """The state after layer ``layer`` given its output ``v_l`` (b, t, d) and the state before it.

        The returned state may share storage with the old one only where autograd allows it (no in-place
        update of a tensor that a read has already used)."""

    @abc.abstractmethod
    def read_head(self, state: Any) -> torch.Tensor:
        """The head's input (b, t, d) from the state after the last layer; the decoder applies the final norm."""

    # -- introspection -------------------------------------------------------------------------------------
    @abc.abstractmethod
    def mixing_matrix(self, trace) -> torch.Tensor:
        """``c`` of shape (b, t, L+1, L+1, G) from the ``trace`` dict of one recorded forward pass.

        ``c[..., l, i, g]`` is the weight with which reader ``l`` (layer ``l``, or the head at ``l = L``)
        contains source ``i`` (0 the embedding, ``i + 1`` the output ``v_i``) in channel group ``g``, such that
        each reader's input is rebuilt exactly from the sources (the mixing test checks this in float64).
        Entries for sources a reader cannot see (``i > l``) are zero."""

    @abc.abstractmethod
    def stream_floats_per_token(self) -> int:
        """Floats of carried state per token at the widest point of depth (PreLN: d)."""

    @abc.abstractmethod
    def extra_flops_per_token(self) -> int:
        """Forward FLOPs per token spent on depth mixing beyond PreLN's residual additions, for the path the
        mixer actually runs (the cost model and the benchmark's analytic floor read it)."""

    # -- optional ------------------------------------------------------------------------------------------
    def extra_params(self) -> int:
        """Parameters added over PreLN: everything the mixer owns, unless it says otherwise."""
        return sum(p.numel() for p in self.parameters())

    def learned_statistics(self, trace) -> dict:
        """What the mixer learned, as plain JSON numbers, from the trace of one forward pass (e.g.
        forgetting factors and importance weights per layer); empty for a mixer that has nothing of the kind."""
        return {}

    def sizes(self) -> dict[str, int]:
        """The sizes the mixer's knobs resolve to at this width and depth (memory groups, key width, streams), for
        the cost listing of a preset; empty for a mixer without any."""
        return {}

    def step_checks(self, least: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> str | None:
        """Called once per optimizer step, where training already waits for the device: a sentence when what this
        step computed cannot be trusted (the mixer has then switched to a path that can), else None. Lets a mixer
        keep its checks on the device inside a step instead of stopping the step to ask.

        ``least`` gives a tensor's minimum over the processes of a multi-process run (itself in a run of one), and
        a mixer decides from what it returns: each process sees its own batch, and a decision taken from one
        alone would switch one replica and skip its update while the others go on."""
        return None

    def params_to_match(self) -> str | None:
        """A variant whose decoder's parameter count this one's should match by widening its MLPs (the model
        factory does so), or None to keep the configured width."""
        return None

    # -- helpers -------------------------------------------------------------------------------------------
    def record(self, key: str, layer: int, value: torch.Tensor) -> None:
        """Keep ``value`` for ``mixing_matrix`` when the decoder is recording a trace."""
        if self.trace is not None:
            self.trace[(key, layer)] = value.detach()


REGISTRY: Registry[DepthMixer] = Registry("variant", DepthMixer)
register = REGISTRY.register


def prefix_ones(n_layers: int, like: torch.Tensor) -> torch.Tensor:
    """PreLN's mixing matrix, (L+1, L+1): reader ``l`` holds the embedding and every earlier output once."""
    return torch.ones(n_layers + 1, n_layers + 1, dtype=like.dtype, device=like.device).tril()
