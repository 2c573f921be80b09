"""LDM's depth read as Triton kernels: a tile of rows per program streams each write's key and value once.

Forward ``m = Σ_i v_i (k_iᵀ q)``; backward, from ``∂m``, ``∂q = Σ_i (v_iᵀ ∂m) k_i``, ``∂k_i = (v_iᵀ ∂m) q`` and
``∂v_i = (k_iᵀ q) ∂m`` in one more pass that recomputes the scores: nothing beyond the inputs is saved, where
autograd on ``naive.py`` would keep an (R, n) table of scores per read, O(L²) over the depth.

Rows are independent, so the programs need no communication. Inputs may be float64, float32, bfloat16 or float16,
each its own: they are widened as they are loaded and the sums are in ``ACC``, float64 where an input is float64
and float32 otherwise; the read comes out in the dtype PyTorch gives the inputs together and each gradient in its
input's dtype.
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
    Q, K, V, M, R, n, KD, VD,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows, ok, ov, rmask, qmask, vmask = row_tile(R, KD, VD, BLOCK_R, BLOCK_K, BLOCK_V)
    q = tl.load(Q + rows[:, None] * KD + ok[None, :], mask=qmask, other=0.0).to(ACC)
    acc = tl.zeros([BLOCK_R, BLOCK_V], dtype=ACC)
    for i in range(n):
        k = tl.load(K + (rows[:, None] * n + i) * KD + ok[None, :], mask=qmask, other=0.0).to(ACC)
        v = tl.load(V + (rows[:, None] * n + i) * VD + ov[None, :], mask=vmask, other=0.0).to(ACC)
        acc += tl.sum(k * q, 1)[:, None] * v
    tl.store(M + rows[:, None] * VD + ov[None, :], acc, mask=vmask)


@triton.jit
def _backward(
    Q, K, V, DM, DQ, DK, DV, R, n, KD, VD,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    rows, ok, ov, rmask, qmask, vmask = row_tile(R, KD, VD, BLOCK_R, BLOCK_K, BLOCK_V)
    q = tl.load(Q + rows[:, None] * KD + ok[None, :], mask=qmask, other=0.0).to(ACC)
    dm = tl.load(DM + rows[:, None] * VD + ov[None, :], mask=vmask, other=0.0).to(ACC)
    dq = tl.zeros([BLOCK_R, BLOCK_K], dtype=ACC)
    for i in range(n):
        at_k = (rows[:, None] * n + i) * KD + ok[None, :]
        at_v = (rows[:, None] * n + i) * VD + ov[None, :]
        k = tl.load(K + at_k, mask=qmask, other=0.0).to(ACC)
        v = tl.load(V + at_v, mask=vmask, other=0.0).to(ACC)
        z = tl.sum(k * q, 1)[:, None]  # the score k_iᵀ q, recomputed
        dz = tl.sum(v * dm, 1)[:, None]
        dq += dz * k
        tl.store(DK + at_k, dz * q, mask=qmask)
        tl.store(DV + at_v, z * dm, mask=vmask)
    tl.store(DQ + rows[:, None] * KD + ok[None, :], dq, mask=qmask)


def launch(R: int, n: int, KD: int, VD: int, acc=tl.float32) -> tuple[tuple[int], tuple[int, ...], dict]:
    """The grid, the sizes and the tile (constexprs and warps) of both kernels for ``R`` rows of ``n`` writes,
    summed in ``acc``."""
    BLOCK_K, BLOCK_V = triton.next_power_of_2(KD), triton.next_power_of_2(VD)
    BLOCK_R = tiles.rows_per_program(max(BLOCK_K, BLOCK_V), PER_THREAD)
    blocks = dict(BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=tiles.WARPS, ACC=acc)
    return (triton.cdiv(R, BLOCK_R),), (R, n, KD, VD), blocks


def _launch(q, keys, values):
    return launch(*keys.shape, values.shape[-1], tiles.compute_dtype(q, keys, values))


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
    _backward[grid](q, keys, values, dm.contiguous(), dq, dk, dv, *sizes, **blocks)
    return dq, dk, dv


@depth_read_backward.register_fake
def _(dm, q, keys, values):
    return torch.empty_like(q), torch.empty_like(keys), torch.empty_like(values)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _grad(ctx, dm):
    return depth_read_backward(dm, *ctx.saved_tensors)


depth_read.register_autograd(_grad, setup_context=_setup)
