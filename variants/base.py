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

from typing import Any

import torch
from torch import nn

from harness.registry import Registry


class DepthMixer(nn.Module):
    """Base class of all depth mixers; subclasses define a nested ``Config`` dataclass of knobs."""

    def __init__(self, cfg, *, d_model: int, n_layers: int):
        super().__init__()
        self.cfg = cfg
        self.d_model = d_model
        self.n_layers = n_layers
        # A dict while the decoder records a trace, else None: variants store their mixing weights here.
        self.trace: dict | None = None

    # -- the interface -------------------------------------------------------------------------------------
    def init_state(self, e: torch.Tensor) -> Any:
        raise NotImplementedError

    def read(self, state: Any, layer: int) -> torch.Tensor:
        raise NotImplementedError

    def write(self, state: Any, layer: int, out: torch.Tensor) -> Any:
        raise NotImplementedError

    def read_head(self, state: Any) -> torch.Tensor:
        raise NotImplementedError

    # -- introspection -------------------------------------------------------------------------------------
    def mixing_matrix(self, trace) -> torch.Tensor:
        """``c`` of shape (b, t, L+1, L+1, G) from a ``harness.model.Trace`` of one forward pass."""
        raise NotImplementedError

    def stream_floats_per_token(self) -> int:
        """Floats of carried state per token at the widest point of depth (PreLN: d)."""
        raise NotImplementedError

    def extra_flops_per_token(self) -> int:
        """Forward FLOPs per token spent on depth mixing beyond PreLN's residual additions."""
        raise NotImplementedError

    def extra_params(self) -> int:
        """Parameters added over PreLN: everything the mixer owns."""
        return sum(p.numel() for p in self.parameters())

    def learned_statistics(self, trace) -> dict:
        """What the mixer learned, as plain JSON numbers, from a ``harness.model.Trace`` of one forward pass (e.g.
        forgetting factors and importance weights per layer); empty for a mixer that has nothing of the kind."""
        return {}

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
