"""The suite's own setup: each test process takes its share of the cores (tests/conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_each_process_takes_its_share_of_the_cores():
    if "DEPTHMEM_TEST_THREADS" not in os.environ:
        pytest.skip("OMP_NUM_THREADS was set by the user, and the suite keeps it")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = max(1, (os.cpu_count() or 1) // workers)
    assert (os.environ["OMP_NUM_THREADS"], torch.get_num_threads()) == (str(share), share)


@pytest.mark.slow
def test_xdist_workers_do_not_inherit_the_controllers_count():
    # The controller imports conftest.py before it starts the workers: its one-process count must not reach them.
    inherited = (
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "DEPTHMEM_TEST_THREADS",
        "PYTEST_XDIST_WORKER",
        "PYTEST_XDIST_WORKER_COUNT",
    )
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    node = f"{Path(__file__).relative_to(ROOT)}::test_each_process_takes_its_share_of_the_cores"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", "-rs", node],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
