"""What a training step costs in memory, and whether its throughput was measured on cores of its own.

``AllocatorPeak`` measures the peak bytes the allocator holds while a stretch of code runs: on CUDA with
``torch.cuda.max_memory_allocated``, on CPU from the allocator totals that ``torch.profiler`` records with
``profile_memory=True`` (their running total of bytes allocated, whose maximum above its starting level is the
peak). It counts tensors only, never the Python heap or a tokenizer's memory, so it is the same quantity on both
devices, unlike the process's peak RSS. ``CoreLoad`` samples how many other tasks were runnable while a run
trained on CPU; throughput from a run whose threads and the others outnumbered the cores is no measure of
the variant's cost.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch


@contextlib.contextmanager
def _stderr_silenced():
    """Send file descriptor 2 to /dev/null: Kineto prints a line at every profiler start and stop, unasked."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class AllocatorPeak:
    """Peak bytes allocated above the level at ``start()`` until ``stop()``, on the given device."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._prof = None
        self._before = 0

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._before = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        from torch.profiler import ProfilerActivity, profile

        with _stderr_silenced():
            # The allocator warns once per process when a block from before profiling is freed under it; freeing
            # one here, while its stderr is silenced, spends that warning where nobody reads it, instead of in the
            # middle of a job's log.
            early = torch.empty(1)
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.start()
            del early

    def stop(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self._before)
        from torch._C._profiler import _ExtraFields_Allocation

        with _stderr_silenced():
            self._prof.stop()
        events = []
        stack = list(self._prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            node = stack.pop()
            stack.extend(node.children)
            fields = node.extra_fields
            if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.total_allocated, fields.alloc_size))
        self._prof = None
        if not events:
            return 0
        # The running total also carries tensors from earlier profiling sessions that were freed while no profiler
        # watched (their frees are never subtracted), so measure from the total just before the first allocation.
        events.sort(key=lambda e: e[0])
        base = events[0][1] - events[0][2]
        return int(max(0, max(total for _, total, _ in events) - base))


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensor storages (a storage shared by several tensors counted once); of a sharded tensor,
    the shard this process holds."""
    seen = {}
    for t in tensors:
        if hasattr(t, "to_local"):
            t = t.to_local()
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def live_training_bytes(model: torch.nn.Module, optimizers) -> int:
    """Parameters, buffers, gradients and optimizer state: what every step holds before it allocates anything."""
    tensors = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters() if p.grad is not None)]
    for opt in optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes(tensors)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class CoreLoad:
    """Samples of the tasks runnable besides the sampling thread itself (Linux ``/proc/loadavg``)."""

    def __init__(self):
        self.others: list[int] = []

    def sample(self) -> None:
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return
        self.others.append(max(0, running - 1))

    def summary(self, threads: int) -> dict:
        """``cores``, mean other runnable tasks, and ``cores_shared``: whether they and this run's threads
        outnumbered the cores on average (absent where nothing could be sampled)."""
        cores = usable_cores()
        if not self.others:
            return {"cpu_cores": cores}
        others = sum(self.others) / len(self.others)
        return {"cpu_cores": cores, "cpu_other_runnable": round(others, 3), "cores_shared": others + threads > cores}
