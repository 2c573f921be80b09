"""Reads over depth that keep references to their sources, not a stacked copy of them.

A read over depth stacks every earlier write (or output) into one tensor and attends over it, and autograd keeps
what the read saves for backward: that stacked copy, one per read, so O(L²·d) floats per token over L layers,
where the sources themselves are O(L·d) and kept anyway. ``recomputed`` runs a read so that backward stacks the
sources again instead: the memory of a step grows like the writes, at the price of one more pass over them in
backward (measured in docs/training.md). Most reads over depth now read a depth buffer in place and stack nothing
(``variants/kernels/buffer.py``); LDM-RLS's float64 square-root form and mHC's projection under autocast run here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from variants import kernels


def recomputed(fn: Callable[..., torch.Tensor | tuple], *args):
    """``fn(*args)``, with everything ``fn`` saves for backward recomputed there from ``args`` instead of kept.

    ``fn`` must be a pure function of its arguments: it runs twice when gradients are wanted, and draws nothing at
    random."""
    if not torch.is_grad_enabled():
        return fn(*args)
    if torch.compiler.is_compiling():  # one graph: forward and its recomputation take the same path by construction
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=_same_path)


def _same_path():
    """Forward runs as it is; the recomputation under the fused kernels' mode of that forward."""
    return contextlib.nullcontext(), kernels.pinned()
