"""Shared fixtures: float64 by default where numerics are checked, fresh random seeds per test."""

from __future__ import annotations

import os

import pytest
import torch

# Tests run on two cores; more threads only contend.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def rng_seed(request) -> int:
    """A fresh seed per test (printed on failure through the test id), never a fixed zero input."""
    seed = int.from_bytes(os.urandom(4), "little")
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    return seed
