"""What every row-tiled kernel of this wing starts with: how many rows a program takes, and its rows, the key and
value columns, and their masks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from variants import kernels

WARPS = 4
MAX_ROWS = 32


def rows_per_program(width: int, per_thread: int, warps: int = WARPS) -> int:
    """The rows of a program's (rows, ``width``) tile that give each of its ``warps`` × 32 threads ``per_thread``
    elements of every such tensor it holds (at least 1, at most ``MAX_ROWS``; ``width`` a power of two).

    The kernels keep several tiles live through their loop (the inputs, an accumulator, the addresses), so the
    elements per thread set their registers: ``per_thread`` is each kernel's budget that keeps it under 128
    registers at four warps without spilling (four programs of 128 threads on an SM), as
    ``python -m variants.kernels.registers`` measures on the compiled kernels."""
    return max(1, min(MAX_ROWS, per_thread * 32 * warps // width))


def compute_dtype(*inputs: torch.Tensor) -> tl.dtype:
    """``variants.kernels.compute_dtype`` as the kernels' ``ACC``."""
    return tl.float64 if kernels.compute_dtype(*inputs) == torch.float64 else tl.float32


@triton.jit
def row_tile(R, KD, VD, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's ``BLOCK_R`` rows of ``R`` (64-bit: row × stride passes 2³¹ at large micro batches), the
    column offsets of a key (width ``KD``) and of a value (width ``VD``), and the masks of the valid rows, keys and
    values."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    ok, ov = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    rmask = rows < R
    return rows, ok, ov, rmask, rmask[:, None] & (ok < KD)[None, :], rmask[:, None] & (ov < VD)[None, :]
