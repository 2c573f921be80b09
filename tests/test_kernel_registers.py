"""Every fused kernel fits an A100's and an H100's register file at the GPT-2 training shapes: compiled ahead of
time for sm_80 and sm_90 with the tile its dispatch code chooses (``variants/kernels/registers.py``), with the
stored state in float32 and in bfloat16, none spills and an SM holds at least four programs of four warps of each.

The compilation runs in a subprocess with ``TRITON_INTERPRET`` unset (the conftest sets it where there is no
card, and under it ``triton.jit`` gives functions that cannot be compiled). Skipped with the reason where Triton,
its NVIDIA backend or its bundled ``ptxas`` and ``cuobjdump`` are missing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
KERNELS = {
    f"{op}.{part}" for op in ("depth_read", "whiten", "softmax_read", "sinkhorn") for part in ("_forward", "_backward")
}


def _missing_toolchain() -> str | None:
    """Why the kernels cannot be compiled for NVIDIA targets here, or None."""
    try:
        import triton
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as e:
        return f"Triton's NVIDIA backend is not installed ({e})"
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    try:
        ptxas = [Path(get_ptxas(arch).path) for arch in (80, 90)]
    except Exception as e:  # Triton raises a plain RuntimeError where no ptxas is found
        return f"no ptxas for sm_80 and sm_90 ({e})"
    for tool in (*ptxas, cuobjdump):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing or not executable"
    return None


@pytest.fixture(scope="module")
def usage() -> list[dict]:
    reason = _missing_toolchain()
    if reason:
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the launch default; set, so Triton does not warn about it
    cmd = [sys.executable, "-m", "variants.kernels.registers", "--json", "--state", "float32", "--state", "bfloat16"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


def test_every_kernel_is_compiled_for_both_cards_at_both_models_and_states(usage):
    compiled = {(u["kernel"], u["arch"], u["shape"], u["state"]) for u in usage}
    models, states = ("gpt2-small", "gpt2-medium"), ("float32", "bfloat16")
    want = {(k, arch, m, s) for k in KERNELS for arch in (80, 90) for m in models for s in states}
    assert want <= compiled


def test_no_kernel_spills_or_leaves_fewer_than_four_programs_of_four_warps(usage):
    misfits = [u for u in usage if u["spill_bytes"] > 0 or u["programs_per_sm"] * u["warps"] < 16]
    assert not misfits, "\n".join(
        f"{u['kernel']} sm_{u['arch']} {u['shape']} {u['state']}: {u['registers']} registers, "
        f"{u['spill_bytes']} bytes spilled, {u['programs_per_sm']} programs of {u['warps']} warps per SM"
        for u in misfits
    )
    # at four warps, four programs an SM is at most 128 registers a thread
    assert all(u["registers"] <= 128 for u in usage if u["warps"] == 4)
