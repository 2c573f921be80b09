"""Checkpointing a residual stream across depth: keep it for backward at every ``segment``-th layer only.

A mixer whose stream after layer ``l`` is a fixed function of the stream before it and of that layer's write,
``X_{l+1} = step(X_l, *write_l)``, need not let autograd keep every ``X_l``: the writes are kept anyway (the
graph needs them for their own gradients), so backward can run ``step`` again from the nearest kept stream.
HC and mHC use it for their ``n·d`` stream (``step`` is ``res X + post ⊗ v``). The recomputation repeats the
forward's own operations on the same inputs, so it is bit for bit the stream of the forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


def graph_kept() -> bool:
    """Whether the backward pass now running keeps the graph for another (``retain_graph``): what a node holds
    outside its saved tensors can be let go of after its own backward only when not."""
    kept = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if kept is None else kept()


def default_segment(n_layers: int) -> int:
    """``⌈√L⌉``: about ``2√L`` of the ``L`` streams alive at once (``√L`` kept, one segment recomputed)."""
    return math.isqrt(n_layers - 1) + 1


class _Handle:
    """What autograd holds instead of a tensor that a ``Recomputes`` object makes again: its key and the view."""

    __slots__ = ("source", "key", "size", "stride", "offset")

    def __init__(self, source, key, view):
        self.source, self.key = source, key
        self.size, self.stride, self.offset = view.size(), view.stride(), view.storage_offset()


class Recomputes:
    """Saved-tensor hooks that hand autograd a handle instead of one tensor (and every view of it), for an object
    that can make that tensor again in backward (``recompute(key)``). Every other saved tensor goes on to the hooks
    around these (the benchmark's counter of saved bytes, ``save_on_cpu``), or is kept as usual."""

    _storage: int | None = None
    _key = None
    _outer = None

    def recompute(self, key) -> torch.Tensor:
        raise NotImplementedError

    def _instead_of(self, t: torch.Tensor | None, key):
        """A context in which autograd saves a handle with ``key`` instead of ``t`` (or saves as usual, for None)."""
        self._storage = None if t is None else t.untyped_storage().data_ptr()
        self._key = key
        # Hooks pushed outside this one would be masked by it (only the innermost pair runs): pass tensors on.
        self._outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, t: torch.Tensor):
        if self._storage is not None and t.untyped_storage().data_ptr() == self._storage:
            return _Handle(self, self._key, t)
        # Detached: a saved output must not hold its own graph (see torch.autograd.graph.saved_tensors_hooks).
        return (self._outer[1], self._outer[0](t)) if self._outer else t.detach()


def _unpack(packed):
    if isinstance(packed, _Handle):
        return packed.source.recompute(packed.key).as_strided(packed.size, packed.stride, packed.offset)
    if isinstance(packed, tuple):  # (the outer unpack hook, what the outer pack hook returned)
        return packed[0](packed[1])
    return packed


class Tape(Recomputes):
    """Keeps the stream ``X_l`` for backward at every ``segment``-th layer and recomputes the others.

    The mixer records each layer's write in ``writes[l]`` (a tuple of detached tensors, ``step``'s arguments after
    the stream). While something that saves the stream before layer ``l`` runs (``saving(l, X_l)``),
    saved-tensor hooks replace every tensor autograd saves that is ``X_l`` or a view of it by a handle, except at
    the kept layers. In backward the first handle of a segment recomputes that segment's streams from its kept
    ``X`` and the recorded writes; the previous segment's are dropped, so backward holds one segment at a time.
    """

    def __init__(self, segment: int, step: Callable[..., torch.Tensor]):
        self.segment, self.step = segment, step
        self.kept: dict[int, torch.Tensor] = {}
        self.writes: dict[int, tuple[torch.Tensor, ...]] = {}
        self.cache: dict[int, torch.Tensor] = {}

    def saving(self, layer: int, X: torch.Tensor):
        """A context in which autograd saves ``X`` (the stream before ``layer``) only if ``layer`` is kept."""
        self.keep(layer, X)
        return self._instead_of(None if layer in self.kept else X, layer)

    def keep(self, layer: int, X: torch.Tensor) -> None:
        """Keep ``X``, the stream before ``layer``, if ``layer`` is one the tape keeps; ``stream`` gives it back."""
        if layer % self.segment == 0:
            # Detached, as everything the tape holds: autograd's nodes hold the tape, which must not hold them.
            self.kept[layer] = X.detach()

    def recompute(self, layer: int) -> torch.Tensor:
        return self.stream(layer)

    def stream(self, layer: int) -> torch.Tensor:
        """``X_layer`` as the forward pass computed it."""
        if layer in self.kept:
            return self.kept[layer]
        if layer not in self.cache:
            start = layer - layer % self.segment
            self.cache = {}  # free the segment backward has left before making the next
            X = self.kept[start]
            with torch.no_grad():
                # The whole segment at once: backward asks for its streams from the top down.
                for l in range(start, start + self.segment - 1):
                    if l not in self.writes:
                        break
                    X = self.step(X, *self.writes[l])
                    self.cache[l + 1] = X
        return self.cache[layer]
