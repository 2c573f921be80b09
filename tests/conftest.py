"""Shared fixtures: every test's random draws come from a seed derived from its id, so a red run replays exactly.

Each test gets its own seed, ``hash(base, test id)``: the same on every run, in any order and on any xdist worker,
and a different one for every test. ``DEPTHMEM_TEST_SEED`` (or ``--test-seed``) sets the base (0 by default), so a
new base draws new inputs everywhere. ``--fuzz N`` runs each randomised test (one that takes ``rng_seed``) over N
seeds under the base; ``make test-fuzz`` passes a new base each time (the clock's seconds, printed in the header).
Nothing here draws from the operating system's randomness, so every run, the fuzz lane's included, replays from the
base in its header. A failing test's report names its
seed and the command that replays it (``--rng-seed S`` pins ``rng_seed`` to ``S``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re

# Tests run on two cores, shared by the pytest-xdist workers and the subprocesses some tests start: one thread
# each keeps them from contending (set before torch loads, so subprocesses inherit it too). xdist's controller
# imports this file before it starts the workers, and they inherit its environment: a count it set for one process
# would give every worker all the cores, where OpenMP threads waiting on descheduled ones make small products ten
# to a hundred times slower. So a count this file set is recomputed in each process, from its own worker count;
# one the user set stays.
_SET_BY_A_PARENT = os.environ.pop("DEPTHMEM_TEST_THREADS", None)
if _SET_BY_A_PARENT is not None and os.environ.get("OMP_NUM_THREADS") == _SET_BY_A_PARENT:
    os.environ.pop("OMP_NUM_THREADS", None)
    os.environ.pop("MKL_NUM_THREADS", None)
if "OMP_NUM_THREADS" not in os.environ:
    _THREADS = str(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = os.environ["DEPTHMEM_TEST_THREADS"] = _THREADS
# Without a GPU the fused Triton kernels run in Triton's interpreter on CPU tensors (variants/kernels/), which
# decides when a kernel is defined: set before anything imports them.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

SEED_ENV = "DEPTHMEM_TEST_SEED"


def pytest_addoption(parser):
    group = parser.getgroup("depthmem", "depthmem's random seeds")
    group.addoption(
        "--test-seed", type=int, default=None, help=f"base of every test's seed (default: ${SEED_ENV}, else 0)"
    )
    group.addoption(
        "--fuzz", type=int, default=0, metavar="N", help="run each randomised test over N seeds under the base"
    )
    group.addoption("--rng-seed", type=int, default=None, metavar="S", help="pin rng_seed to S (replays one failure)")


def pytest_configure(config):
    base = config.getoption("test_seed")
    if base is None and os.environ.get(SEED_ENV):
        base = int(os.environ[SEED_ENV])
    if base is None:
        base = 0
    # xdist's workers start after this and inherit the environment: every process derives the same seeds, so
    # they collect the same fuzzed parametrizations.
    os.environ[SEED_ENV] = str(base)


def pytest_report_header(config):
    base, fuzz = os.environ[SEED_ENV], config.getoption("fuzz")
    lane = f"; fuzz: {fuzz} seeds per randomised test" if fuzz else ""
    return f"test seeds: base {base} (replay this run with {SEED_ENV}={base}){lane}"


def derive_seed(key: str) -> int:
    """A 32-bit seed for ``key`` (a test or module id) under this run's base."""
    digest = hashlib.blake2b(f"{os.environ[SEED_ENV]}/{key}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def pytest_generate_tests(metafunc):
    fuzz = metafunc.config.getoption("fuzz")
    if fuzz and "rng_seed" in metafunc.fixturenames:
        seeds = [derive_seed(f"{metafunc.definition.nodeid}#{i}") for i in range(fuzz)]
        metafunc.parametrize("rng_seed", seeds, indirect=True, ids=[f"seed{s}" for s in seeds])


def pytest_collection_modifyitems(config, items):
    if not config.getoption("fuzz"):
        return
    # The fuzz lane is for the randomised tests alone: the others would only run again unchanged.
    fixed = [item for item in items if "rng_seed" not in getattr(item, "fixturenames", ())]
    if fixed:
        config.hook.pytest_deselected(items=fixed)
        items[:] = [item for item in items if item not in fixed]


def _seed_of(item) -> int:
    pinned = item.config.getoption("rng_seed")
    if pinned is not None:
        return pinned
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "rng_seed" in callspec.params:
        return callspec.params["rng_seed"]
    return derive_seed(item.nodeid)


@pytest.fixture(autouse=True)
def _seed_everything(request):
    """Every test starts torch, NumPy and ``random`` from its own seed, whatever ran before it on its worker."""
    seed = _seed_of(request.node)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    request.node.user_properties.append(("seed", seed))


@pytest.fixture
def rng_seed(request) -> int:
    """This test's seed (its draws are random, never fixed zeros, and replay exactly from it)."""
    return _seed_of(request.node)


@pytest.fixture(scope="module")
def module_seed(request) -> int:
    """A seed for a module-scoped fixture's draws, derived from the module's id like a test's."""
    return derive_seed(request.node.nodeid)


def _replay_id(nodeid: str, seed: int) -> str:
    """The test's id without the fuzz lane's ``seedS`` parameter, which ``--rng-seed`` stands in for."""
    name = re.sub(rf"(\[seed{seed}\]|-seed{seed}(?=[-\]])|(?<=\[)seed{seed}-)", "", nodeid)
    return name


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        seed = _seed_of(item)
        base = os.environ[SEED_ENV]
        replay = f"{SEED_ENV}={base} pytest '{_replay_id(item.nodeid, seed)}' --rng-seed {seed}"
        report.sections.append(("depthmem seed", f"this test's seed: {seed}; replay: {replay}"))
    return report


@pytest.fixture
def shared_cache(tmp_path_factory, monkeypatch):
    """One tokenizer and token cache for every test worker (the cache is safe under concurrent use): a module that
    trains or tokenizes asks for it with ``pytestmark = pytest.mark.usefixtures("shared_cache")``."""
    path = tmp_path_factory.getbasetemp().parent / "depthmem-cache"
    monkeypatch.setenv("DEPTHMEM_CACHE", str(path))
    return path


@pytest.fixture
def quiet_stale_log_handlers(monkeypatch):
    """Libraries attach log handlers to the stderr of the test that imported them, and pytest closes that stream
    afterwards: logging would print its own "--- Logging error ---" traceback into a later test's stderr, which the
    CLI tests read."""
    monkeypatch.setattr(logging, "raiseExceptions", False)
