"""What every row-tiled kernel of this wing starts with: its rows, the key and value columns, and their masks."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_tile(R, KD, VD, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's ``BLOCK_R`` rows of ``R`` (64-bit: row × stride passes 2³¹ at large micro batches), the
    column offsets of a key (width ``KD``) and of a value (width ``VD``), and the masks of the valid rows, keys and
    values."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    ok, ov = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    rmask = rows < R
    return rows, ok, ov, rmask, rmask[:, None] & (ok < KD)[None, :], rmask[:, None] & (ov < VD)[None, :]
