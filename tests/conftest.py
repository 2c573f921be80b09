"""Shared fixtures: float64 by default where numerics are checked, fresh random seeds per test."""

from __future__ import annotations

import os

# Tests run on two cores, shared by the pytest-xdist workers and the subprocesses some tests start: one thread
# each keeps them from contending (set before torch loads, so subprocesses inherit it too).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_THREADS = str(max(1, (os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("OMP_NUM_THREADS", _THREADS)
os.environ.setdefault("MKL_NUM_THREADS", _THREADS)
# Without a GPU the fused Triton kernels run in Triton's interpreter on CPU tensors (variants/kernels/), which
# decides when a kernel is defined: set before anything imports them.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture
def rng_seed(request) -> int:
    """A fresh seed per test (printed on failure through the test id), never a fixed zero input."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed
