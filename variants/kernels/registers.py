"""Register use of the fused kernels on NVIDIA cards, from compiling them ahead of time: no card is needed.

Every kernel, forward and backward, is compiled for sm_80 (A100) and sm_90 (H100, H200) at the shapes of
gpt2-small and gpt2-medium training (batch 8 of 1024 tokens) and at widths that are no multiple of 16, with the
tile and warps its dispatch code chooses for those shapes and the argument specialization Triton gives a real
launch. The registers per thread and the spills are read from the compiled cubin with Triton's bundled
``cuobjdump``. A kernel fits when it spills nothing and an SM holds at least ``MIN_WARPS_PER_SM`` of its warps
(4 programs of 4 warps).

    python -m variants.kernels.registers                    # the table of docs/benchmarks.md
    python -m variants.kernels.registers --state bfloat16   # the stored state in bfloat16 (repeatable)
    python -m variants.kernels.registers --json             # one object per compilation

Run with ``TRITON_INTERPRET`` unset: under the interpreter ``triton.jit`` gives functions that cannot be compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import MockTensor, create_function_from_signature

from variants.kernels.depth_read import fused as depth_read
from variants.kernels.sinkhorn import fused as sinkhorn
from variants.kernels.softmax_read import fused as softmax_read
from variants.kernels.whiten import fused as whiten

ARCHS = (80, 90)
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
SHARED_PER_SM = {80: 164 * 1024, 90: 228 * 1024}  # bytes a program may claim, less 1 KiB reserved per program
MIN_WARPS_PER_SM = 16
STATES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Shape:
    """A model's training shape as the kernels see it: LDM's ``groups`` groups per token, mHC's ``streams``."""

    name: str
    d_model: int
    sublayers: int
    batch: int = 8
    seq: int = 1024
    groups: int = 16
    streams: int = 4
    sinkhorn_iters: int = 20

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


# The GPT-2 sizes, and widths no power of two divides by 16: Triton specializes a launch on which sizes are
# multiples of 16, and the other specialization needs more registers for the same tile.
SHAPES = (
    Shape("gpt2-small", 768, 24),
    Shape("gpt2-medium", 1024, 48),
    Shape("d 1000, 20 groups", 1000, 23, groups=20, streams=3),
)


@dataclass(frozen=True)
class Usage:
    kernel: str
    arch: int
    shape: str
    state: str
    warps: int
    registers: int
    spill_bytes: int
    shared_bytes: int

    @property
    def programs_per_sm(self) -> int:
        per_warp = -(-self.registers * 32 // 256) * 256  # registers are allocated per warp, 256 at a time
        by_registers = REGISTERS_PER_SM // per_warp // self.warps
        by_shared = SHARED_PER_SM[self.arch] // (self.shared_bytes + 1024)
        return min(by_registers, by_shared, MAX_WARPS_PER_SM // self.warps, MAX_PROGRAMS_PER_SM)

    @property
    def fits(self) -> bool:
        return self.spill_bytes == 0 and self.programs_per_sm * self.warps >= MIN_WARPS_PER_SM


def launches(shape: Shape, state: torch.dtype = torch.float32):
    """``(name, kernel, args, launch options)`` of every kernel as the models call it at ``shape``: the last
    sublayer's read, over all the writes (``n``) or sources (``S``) before it, with the stored writes, sources and
    mHC's logits in ``state`` and everything else in float32; pointers stand in by their dtype."""
    p, s, flags = MockTensor(torch.float32), MockTensor(state), MockTensor(torch.int8)
    rows, width, n = shape.tokens * shape.groups, shape.d_model // shape.groups, shape.sublayers
    # LDM and LDM-RLS read a depth buffer and add into its float32 gradient; LDM-RLS's reads stack its writes per
    # row only in the square-root form (float64, after its guard has tripped).
    _, sizes, tile = depth_read.launch(rows, n, width, width, depth_major=True)
    yield "depth_read._forward", depth_read._forward, (p, s, s, p) + sizes, tile
    args = (p, s, s, p, p, p, p) + sizes
    yield "depth_read._backward", depth_read._backward, args, dict(tile, ACCUMULATE=True)
    _, sizes, tile = depth_read.launch(rows, n, width, width)
    args = (p, s, s, p, p, s, s) + sizes
    yield "depth_read._backward (stacked)", depth_read._backward, args, dict(tile, ACCUMULATE=False)
    # LDM-RLS whitens against a depth buffer of its whitened writes and adds into its float32 gradient.
    _, sizes, tile = whiten.launch(rows, n, width, width)
    yield "whiten._forward", whiten._forward, (p, p, p, s, s, p, p, p, flags, p) + sizes, tile
    args = (p, s, s, p, p, p, flags, p, p, p, p, p, p, p) + sizes
    yield "whiten._backward", whiten._backward, args, tile
    # A softmax read over a buffer of sources, adding into its float32 gradient, alone and with one float32 source
    # beside it: AttnRes's embedding beside its outputs, block AttnRes's partial sum beside its block sums.
    R, D = shape.tokens, shape.d_model
    for extra, suffix in ((False, ""), (True, " (extra source)")):
        _, tile = softmax_read.launch(R, D, extra=extra)
        args = (s, p, p, p, p, R, n + 1, D, 1e-6)
        yield f"softmax_read._forward{suffix}", softmax_read._forward, args, tile
        args = (s, p, p, p, p, p, p, p, p, R, n + 1, D, 1e-6)
        yield f"softmax_read._backward{suffix}", softmax_read._backward, args, tile
    sizes = (shape.tokens, shape.streams, shape.sinkhorn_iters)
    _, tile = sinkhorn.launch(shape.tokens, shape.streams)
    yield "sinkhorn._forward", sinkhorn._forward, (s, s) + sizes, tile
    yield "sinkhorn._backward", sinkhorn._backward, (s, s, s, p) + sizes, tile


def compile_for(kernel, args: tuple, tile: dict, arch: int):
    """``kernel`` compiled for ``sm_<arch>`` as a launch with ``args`` and ``tile`` would compile it: the same
    binding and specialization (divisibility by 16 of sizes and pointers) as ``kernel[grid](*args, **tile)``."""
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = bind(*args, **tile)
    options, signature, constexprs, attrs = kernel._pack_args(backend, tile, bound, specialization, options)
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(cubin: bytes) -> tuple[int, int]:
    """Registers per thread and the bytes per thread it spills of the one function in ``cubin``: its stack frame
    and local memory, which hold nothing else in these kernels (they call no functions and index no arrays)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    registers, stack, local = re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", out).groups()
    return int(registers), int(stack) + int(local)


def usage(shapes=SHAPES, archs=ARCHS, states=(torch.float32,)) -> list[Usage]:
    rows = []
    for state in states:
        for shape in shapes:
            for name, kernel, args, tile in launches(shape, state):
                for arch in archs:
                    compiled = compile_for(kernel, args, tile, arch)
                    registers, spill = resources(compiled.asm["cubin"])
                    meta = compiled.metadata
                    state_name = str(state).removeprefix("torch.")
                    row = Usage(name, arch, shape.name, state_name, meta.num_warps, registers, spill, meta.shared)
                    rows.append(row)
    return rows


def table(rows: list[Usage]) -> str:
    lines = [
        "| kernel | arch | shape | state | warps | registers | spill bytes | programs/SM |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for u in rows:
        lines.append(
            f"| `{u.kernel}` | sm_{u.arch} | {u.shape} | {u.state} | {u.warps} | {u.registers} | {u.spill_bytes} | "
            f"{u.programs_per_sm} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per compilation instead of the table")
    parser.add_argument(
        "--state",
        action="append",
        choices=sorted(STATES),
        help="dtype of the stored writes, sources and logits (repeat for several; default float32)",
    )
    opts = parser.parse_args(argv)
    rows = usage(states=[STATES[name] for name in opts.state or ["float32"]])
    if opts.json:
        print(json.dumps([dict(asdict(u), programs_per_sm=u.programs_per_sm, fits=u.fits) for u in rows]))
    else:
        print(table(rows))


if __name__ == "__main__":
    main()
