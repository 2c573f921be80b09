"""Fused GPU kernels for the depth mixers' hot loops, each beside the plain PyTorch it computes.

One folder per operation, as ``naive.py`` (the math in plain PyTorch: the reference the kernel is tested against
and the fallback wherever the kernel does not run) and ``fused.py`` (the Triton kernels and their autograd), with
the choice between them in the folder's ``__init__``:

- ``depth_read``: LDM's read ``Σ_i v_i (k_iᵀ q)`` over the writes so far, one pass over each key and value, and a
  backward that recomputes the scores instead of saving them; ``buffer.py`` reads LDM's depth buffer.
- ``whiten``: LDM-RLS's write, one Gram–Schmidt step of its dual form against the earlier whitened writes in its
  depth buffer in one pass, and a backward that recomputes the projection coefficients.
- ``softmax_read``: AttnRes's read ``Σ_s softmax_s(ρ_s w·v_s) v_s`` over its depth buffer, with the key norm
  ``ρ_s`` taken inside the pass (an online softmax), and a backward that recomputes the weights from the saved
  log-sum-exp.

- ``sinkhorn``: mHC's projection of ``exp(H̃^res)`` onto doubly stochastic matrices, every iteration in registers,
  and a backward that runs the iterations again and walks them in reverse.

Beside them, ``buffer.py`` is the depth buffer LDM, LDM-RLS, AttnRes and DenseFormer keep their writes in, once each,
depth-major, with a float32 gradient that the reads' backward adds into in place; ``weighted_read.py`` is
DenseFormer's average over it, one matrix-vector product, which needs no kernel of its own.

``mode`` decides where the kernels run: ``auto`` (the default) on CUDA tensors when Triton is installed, ``on``
wherever Triton can run them (with ``TRITON_INTERPRET=1`` also on CPU tensors, which is how the tests run them
without a card), ``off`` never. ``train.kernels`` sets it for a run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

MODES = ("auto", "on", "off")
_mode = "auto"
_as_on_card = False


TRITON = importlib.util.find_spec("triton") is not None
"""Whether Triton is installed (looked up once: a compiled graph must not call into the import system)."""


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def set_mode(mode: str) -> None:
    """Choose where the kernels run: one of ``MODES``."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}, got {mode!r}")
    _mode = mode


@contextlib.contextmanager
def mode(name: str):
    """``set_mode`` for the duration of a ``with`` block."""
    before = _mode
    set_mode(name)
    try:
        yield
    finally:
        set_mode(before)


@contextlib.contextmanager
def as_on_card():
    """Take every device for a CUDA card inside the block, so that fake tensors (shapes without storage, as the
    training memory plan simulates a step with) take the path a card takes: each fused op's fake implementation
    allocates what its kernel would, and its autograd saves what the kernel's backward reads."""
    global _as_on_card
    before, _as_on_card = _as_on_card, True
    try:
        yield
    finally:
        _as_on_card = before


def pinned() -> contextlib.AbstractContextManager:
    """A context that sets the mode and the card simulation (``as_on_card``) to what they are now, wherever it is
    entered later: a read recomputed in backward (``variants.ops.recompute``) runs under it, so that it takes the
    path its forward took even if the mode has changed in between."""
    mode_now, card_now = _mode, _as_on_card

    @contextlib.contextmanager
    def restore():
        global _mode, _as_on_card
        before = _mode, _as_on_card
        _mode, _as_on_card = mode_now, card_now
        try:
            yield
        finally:
            _mode, _as_on_card = before

    return restore()


def runs_on(device: torch.device) -> bool:
    """Whether the fused kernels run on ``device`` in the current mode."""
    if _mode == "off" or not TRITON:
        return False
    if device.type == "cuda" or _as_on_card:
        return True
    return _mode == "on" and device.type == "cpu" and interpreting()


DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
"""What the kernels load (each input its own): they compute in float64 where an input is float64, else float32."""


def active(*tensors: torch.Tensor) -> bool:
    """Whether the fused kernels take tensors like ``tensors``: floating point of ``DTYPES`` on a device they
    run on."""
    return all(t.dtype in DTYPES for t in tensors) and runs_on(tensors[0].device)


def compute_dtype(*inputs: torch.Tensor) -> torch.dtype:
    """What the kernels compute in for these inputs: float64 where any is float64, else float32 (bfloat16 and
    float16 inputs, such as state kept in bfloat16 under autocast, are widened as they are loaded)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in inputs) else torch.float32


def result_dtype(*inputs: torch.Tensor) -> torch.dtype:
    """The dtype of a kernel's output from these inputs: the one PyTorch gives them together."""
    out = inputs[0].dtype
    for t in inputs[1:]:
        out = torch.promote_types(out, t.dtype)
    return out
