"""LDM's depth read as Triton kernels: a tile of rows per program streams each write's key and value once.

Forward ``m = Σ_i v_i (k_iᵀ q)``; backward, from ``∂m``, ``∂q = Σ_i (v_iᵀ ∂m) k_i``, ``∂k_i = (v_iᵀ ∂m) q`` and
``∂v_i = (k_iᵀ q) ∂m`` in one more pass that recomputes the scores: nothing beyond the inputs is saved, where
autograd on ``naive.py`` would keep an (R, n) table of scores per read, O(L²) over the depth.

Rows are independent, so the programs need no communication. Inputs may be float64, float32, bfloat16 or float16,
each its own: they are widened as they are loaded and the sums are in ``ACC``, float64 where an input is float64
and float32 otherwise; the read comes out in the dtype PyTorch gives the inputs together and each gradient in its
input's dtype.

The writes are addressed by strides, so one pair of kernels serves both layouts: stacked per row, (R, n, ·), as
``depth_read`` takes them, and depth-major, (capacity, R, ·), as a depth buffer keeps them
(``variants/kernels/depth_read/buffer.py``). There the backward adds each write's gradient into the buffer's
float32 gradient in place (``ACCUMULATE``), so no read writes a gradient stack of its own for autograd to sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from variants import kernels
from variants.kernels import tiles
from variants.kernels.tiles import row_tile

PER_THREAD = 4  # elements of each tile per thread: one 16-byte load of float32


@triton.jit
def _forward(
    Q, K, V, M, R, n, KD, VD, ROW, WRITE,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    # Write i of row r is the (r · ROW + i · WRITE)-th key and value: ROW = n, WRITE = 1 stacked per row;
    # ROW = 1, WRITE = R depth-major.
    rows, ok, ov, rmask, qmask, vmask = row_tile(R, KD, VD, BLOCK_R, BLOCK_K, BLOCK_V)
    q = tl.load(Q + rows[:, None] * KD + ok[None, :], mask=qmask, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=ACC)
    for i in range(n):
        at = rows[:, None] * ROW + i * WRITE
        k = tl.load(K + at * KD + ok[None, :], mask=qmask, other=0.0).to(ACC)
        v = tl.load(V + at * VD + ov[None, :], mask=vmask, other=0.0).to(ACC)
        acc += tl.sum(k * q, 1)[:, None] * v
    tl.store(M + rows[:, None] * VD + ov[None, :], acc, mask=vmask)


@triton.jit
def _backward(
    Q, K, V, DM, DQ, DK, DV, R, n, KD, VD, ROW, WRITE,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):  # fmt: skip
    rows, ok, ov, rmask, qmask, vmask = row_tile(R, KD, VD, BLOCK_R, BLOCK_K, BLOCK_V)
    q = tl.load(Q + rows[:, None] * KD + ok[None, :], mask=qmask, other=0.0).to(ACC)
    dm = tl.load(DM + rows[:, None] * VD + ov[None, :], mask=vmask, other=0.0).to(ACC)
    dq = tl.zeros([BLOCK_R, BLOCK_K], dtype=ACC)
    for i in range(n):
        at = rows[:, None] * ROW + i * WRITE
        at_k = at * KD + ok[None, :]
        at_v = at * VD + ov[None, :]
        k = tl.load(K + at_k, mask=qmask, other=0.0).to(ACC)
        v = tl.load(V + at_v, mask=vmask, other=0.0).to(ACC)
        z = tl.sum(k * q, 1)[:, None]  # the score k_iᵀ q, recomputed
        dz = tl.sum(v * dm, 1)[:, None]
        dq += dz * k
        dk, dv = dz * q, z * dm
        if ACCUMULATE:  # this row's own slots: no other program touches them
            dk += tl.load(DK + at_k, mask=qmask, other=0.0).to(ACC)
            dv += tl.load(DV + at_v, mask=vmask, other=0.0).to(ACC)
        tl.store(DK + at_k, dk, mask=qmask)
        tl.store(DV + at_v, dv, mask=vmask)
    tl.store(DQ + rows[:, None] * KD + ok[None, :], dq, mask=qmask)


def launch(
    R: int, n: int, KD: int, VD: int, acc=tl.float32, depth_major: bool = False
) -> tuple[tuple[int], tuple[int, ...], dict]:
    """The grid, the sizes and strides, and the tile (constexprs and warps) of both kernels for ``R`` rows of
    ``n`` writes, stacked per row or ``depth_major``, summed in ``acc``."""
    BLOCK_K, BLOCK_V = triton.next_power_of_2(KD), triton.next_power_of_2(VD)
    BLOCK_R = tiles.rows_per_program(max(BLOCK_K, BLOCK_V), PER_THREAD)
    blocks = dict(BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=tiles.WARPS, ACC=acc)
    strides = (1, R) if depth_major else (n, 1)
    return (triton.cdiv(R, BLOCK_R),), (R, n, KD, VD, *strides), blocks


def _launch(q, keys, values):
    return launch(*keys.shape, values.shape[-1], tiles.compute_dtype(q, keys, values))


def _launch_buffer(q, keys, values, n):
    return launch(q.shape[0], n, q.shape[1], values.shape[-1], tiles.compute_dtype(q, keys, values), True)


@torch.library.custom_op("depthmem::depth_read", mutates_args=())
def depth_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``naive.depth_read`` by the forward kernel; contiguous inputs."""
    grid, sizes, blocks = _launch(q, keys, values)
    m = values.new_empty(keys.shape[0], values.shape[-1], dtype=kernels.result_dtype(q, keys, values))
    _forward[grid](q, keys, values, m, *sizes, **blocks)
    return m


@depth_read.register_fake
def _(q, keys, values):
    return values.new_empty(keys.shape[0], values.shape[-1], dtype=kernels.result_dtype(q, keys, values))


@torch.library.custom_op("depthmem::depth_read_backward", mutates_args=())
def depth_read_backward(
    dm: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grid, sizes, blocks = _launch(q, keys, values)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values)
    _backward[grid](q, keys, values, dm.contiguous(), dq, dk, dv, *sizes, **blocks, ACCUMULATE=False)
    return dq, dk, dv


@depth_read_backward.register_fake
def _(dm, q, keys, values):
    return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grad(ctx, dm):
    return depth_read_backward(dm, *ctx.saved_tensors)


depth_read.register_autograd(_grad, setup_context=_setup)


# A depth buffer's read, depth-major over its first ``n`` writes (``variants/kernels/depth_read/buffer.py``): the
# forward as above; the backward adds each write's gradient into the buffer's gradients in place.


def buffer_read(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    grid, sizes, blocks = _launch_buffer(q, keys, values, n)
    m = values.new_empty(q.shape[0], values.shape[-1], dtype=kernels.result_dtype(q, keys, values))
    _forward[grid](q, keys, values, m, *sizes, **blocks)
    return m


def buffer_read_backward(
    dm: torch.Tensor,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    grad_keys: torch.Tensor,
    grad_values: torch.Tensor,
    n: int,
) -> torch.Tensor:
    grid, sizes, blocks = _launch_buffer(q, keys, values, n)
    dq = torch.empty_like(q)
    _backward[grid](q, keys, values, dm.contiguous(), dq, grad_keys, grad_values, *sizes, **blocks, ACCUMULATE=True)
    return dq
