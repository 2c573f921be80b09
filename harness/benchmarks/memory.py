"""The memory and core-load meters of the benchmarks. The meters training uses too live in ``harness.measure``,
below training; this module keeps the benchmarks' import path and adds the step-memory measurements."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable

import torch

from harness.benchmarks.timing import sync
from harness.measure import AllocatorPeak, CoreLoad, live_training_bytes, tensor_bytes, usable_cores

__all__ = [
    "AllocatorPeak",
    "CoreLoad",
    "live_training_bytes",
    "tensor_bytes",
    "usable_cores",
    "static_bytes",
    "cpu_peak_allocated_bytes",
    "saved_activation_bytes",
    "peak_step_bytes",
]


def static_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers (tied weights counted once)."""
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def cpu_peak_allocated_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes live at any moment while ``fn`` runs, counting only what ``fn`` allocates (CPU allocator)."""

    # The CPU counterpart of torch.cuda.max_memory_allocated, from the profiler's allocator totals.
    peak = AllocatorPeak("cpu")
    peak.start()
    try:
        fn()
    finally:
        result = peak.stop()
    return result


@contextlib.contextmanager
def saved_activation_bytes(exclude: Iterable[torch.Tensor] = ()):
    """Count the bytes of distinct tensors autograd saves for backward inside the block (``exclude`` left out).

    Yields a dict whose ``"bytes"`` entry holds the total once the block has ended.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    result = {"bytes": 0}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t  # the hook only counts; autograd keeps the tensor as usual

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result
    result["bytes"] = sum(storages.values())


def peak_step_bytes(model, step: Callable[[], None], device: torch.device) -> tuple[int, int]:
    """(peak bytes of one training step including the model's own, bytes saved for backward)."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    with saved_activation_bytes(exclude=list(model.parameters())) as saved:
        if device.type == "cuda":
            sync(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            sync(device)
            # Other variants' models share the device, so count only what this step added above the start.
            peak = torch.cuda.max_memory_allocated(device) - before
        else:
            peak = cpu_peak_allocated_bytes(step)
    model.zero_grad(set_to_none=True)
    return static_bytes(model) + peak, saved["bytes"]
