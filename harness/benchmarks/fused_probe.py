"""What one hand-written CPU kernel per operation would gain over the eager operators of the fast paths.

The time targets that block AttnRes and HC miss on CPU are memory traffic: each of their operations is a few
passes over per-token tensors, and eager PyTorch makes one pass per operator. This probe measures, alone and on
the same tensors, the fast path's operators against a C++ loop (OpenMP, ``-O3 -march=native``) that does the
same arithmetic in one sweep per token, for the two operations that dominate:

- **block AttnRes's weighted sums over its sources**, every read of one training step at ``--depth`` sublayers:
  forward ``a = Σ_s p_s b_s (+ p_partial · partial)``, backward ``b_s · ∂a`` and ``∂b_s += p_s ∂a``, as
  ``variants/attnres_block.py``'s ``BlockRead`` does them with batched products and ``addcmul_``;
- **HC's write** ``Y = res X + post ⊗ v`` of one layer, forward and backward, against ``StreamWrite`` itself.

It is a measurement, not a path any model takes: the kernels exist only here, need a C++ compiler and are built
with ``torch.utils.cpp_extension`` on first use. Each kernel is checked against the eager result before it is
timed. Run ``python -m harness.benchmarks.fused_probe``; docs/benchmarks.md ("Not met, and why") records its
numbers.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from harness.benchmarks.benchmark import _time_steps
from harness.benchmarks.quiet import OtherLoad
from harness.errors import DepthmemError
from variants.ops import _bdot
from variants.streams import StreamWrite

_CPU = torch.device("cpu")

_KERNELS = r"""
#include <torch/extension.h>

// dst += w * x over d floats.
static inline void axpy(float w, const float* x, float* dst, int64_t d) {
#pragma omp simd
  for (int64_t k = 0; k < d; ++k) dst[k] += w * x[k];
}

// Returns x . g and adds w * g into dst, in one sweep: a backward's dot product and gradient row together.
static inline float dot_axpy(const float* x, const float* g, float w, float* dst, int64_t d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t k = 0; k < d; ++k) {
    acc += x[k] * g[k];
    dst[k] += w * g[k];
  }
  return acc;
}

// a[t] = sum_{s<m} p[t,s] b[t,s] (+ p[t,m] partial[t]); b is (tokens, sources, d) with any row strides.
torch::Tensor read_forward(torch::Tensor p, torch::Tensor b, int64_t m, c10::optional<torch::Tensor> partial) {
  const int64_t n = b.size(0), d = b.size(2), ps = p.stride(0), bs0 = b.stride(0), bs1 = b.stride(1);
  auto a = torch::empty({n, d}, b.options());
  const float *P = p.data_ptr<float>(), *B = b.data_ptr<float>(), *X = partial ? partial->data_ptr<float>() : nullptr;
  float* A = a.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    float* at = A + t * d;
    const float* pt = P + t * ps;
    for (int64_t k = 0; k < d; ++k) at[k] = 0.f;
    for (int64_t s = 0; s < m; ++s) axpy(pt[s], B + t * bs0 + s * bs1, at, d);
    if (X) axpy(pt[m], X + t * d, at, d);
  }
  return a;
}

// dp[t,s] = src_s . da[t] and db[t,s] += p[t,s] da[t] over the read's sources, in one sweep per token.
torch::Tensor read_backward(torch::Tensor da, torch::Tensor p, torch::Tensor b, int64_t m, torch::Tensor db,
                            c10::optional<torch::Tensor> partial) {
  const int64_t n = b.size(0), d = b.size(2), rows = p.size(1), ps = p.stride(0);
  const int64_t bs0 = b.stride(0), bs1 = b.stride(1), gs0 = db.stride(0), gs1 = db.stride(1);
  auto dp = torch::empty({n, rows}, b.options());
  const float *G = da.data_ptr<float>(), *P = p.data_ptr<float>(), *B = b.data_ptr<float>();
  const float* X = partial ? partial->data_ptr<float>() : nullptr;
  float *DB = db.data_ptr<float>(), *DP = dp.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n; ++t) {
    const float* g = G + t * d;
    for (int64_t s = 0; s < rows; ++s) {
      const float* src = s < m ? B + t * bs0 + s * bs1 : X + t * d;
      DP[t * rows + s] = dot_axpy(src, g, P[t * ps + s], DB + t * gs0 + s * gs1, d);
    }
  }
  return dp;
}

// Y[t,j] = sum_k res[t,j,k] X[t,k] + post[t,j] v[t]; X and Y (tokens, n, d), all contiguous.
torch::Tensor write_forward(torch::Tensor res, torch::Tensor X, torch::Tensor post, torch::Tensor v) {
  const int64_t N = X.size(0), n = X.size(1), d = X.size(2);
  auto Y = torch::empty_like(X);
  const float *x = X.data_ptr<float>(), *r = res.data_ptr<float>();
  const float *p = post.data_ptr<float>(), *vv = v.data_ptr<float>();
  float* y = Y.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t j = 0; j < n; ++j) {
      float* yj = y + (t * n + j) * d;
      const float pj = p[t * n + j];
      const float* vt = vv + t * d;
#pragma omp simd
      for (int64_t k = 0; k < d; ++k) yj[k] = pj * vt[k];
      for (int64_t i = 0; i < n; ++i) axpy(r[(t * n + j) * n + i], x + (t * n + i) * d, yj, d);
    }
  }
  return Y;
}

// dres[t,j,k] = dY_j . X_k, dX_k = sum_j res[j,k] dY_j, dpost_j = dY_j . v, dv = sum_j post_j dY_j.
std::vector<torch::Tensor> write_backward(torch::Tensor dY, torch::Tensor res, torch::Tensor X, torch::Tensor post,
                                          torch::Tensor v) {
  const int64_t N = X.size(0), n = X.size(1), d = X.size(2);
  auto dX = torch::zeros_like(X), dres = torch::empty_like(res), dpost = torch::empty_like(post);
  auto dv = torch::zeros_like(v);
  const float *g = dY.data_ptr<float>(), *x = X.data_ptr<float>(), *r = res.data_ptr<float>();
  const float *p = post.data_ptr<float>(), *vv = v.data_ptr<float>();
  float *gx = dX.data_ptr<float>(), *gr = dres.data_ptr<float>();
  float *gp = dpost.data_ptr<float>(), *gv = dv.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < N; ++t) {
    const float* vt = vv + t * d;
    float* gvt = gv + t * d;
    for (int64_t j = 0; j < n; ++j) {
      const float* gj = g + (t * n + j) * d;
      gp[t * n + j] = dot_axpy(vt, gj, p[t * n + j], gvt, d);
      for (int64_t i = 0; i < n; ++i)
        gr[(t * n + j) * n + i] = dot_axpy(x + (t * n + i) * d, gj, r[(t * n + j) * n + i], gx + (t * n + i) * d, d);
    }
  }
  return {dres, dX, dpost, dv};
}
"""


def kernels():
    """The probe's C++ kernels, compiled on first use (cached by torch under ~/.cache/torch_extensions)."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline(
            "depthmem_fused_probe",
            cpp_sources=_KERNELS,
            functions=["read_forward", "read_backward", "write_forward", "write_backward"],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except (RuntimeError, OSError) as e:  # no compiler, no ninja, or a failed build
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DepthmemError(
            f"the fused-kernel probe could not build its C++ kernels ({first}); it needs g++ with OpenMP and "
            "ninja (pip install ninja)"
        ) from None


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm: first-touch page faults and thread start-up
    return 1e3 * statistics.median(_time_steps(fn, 1, _CPU) for _ in range(repeats))


def _check(name: str, got, want) -> None:
    for g, w in zip(got, want, strict=True):
        err = (g - w).abs().max().item() / w.abs().max().clamp_min(1e-30).item()
        if err > 1e-5:
            raise DepthmemError(f"the fused {name} differs from the eager one by {err:.1e} (relative); not timing it")


def block_reads(k, *, depth: int, block_size: int, tokens: int, width: int, repeats: int, gen) -> dict:
    """Every read of one step of block AttnRes at ``depth`` sublayers, forward then backward, eager and fused."""
    sources = 1 + depth // block_size
    blocks = torch.randn(tokens, sources, width, generator=gen)
    dblocks = torch.zeros(tokens, sources + 1, width)
    partial, da = torch.randn(tokens, width, generator=gen), torch.randn(tokens, width, generator=gen)
    reads = []  # (completed blocks read, partial sum read?, weights); reader 0 reads the embedding alone
    for r in range(1, depth + 1):
        m, has_partial = min(1 + r // block_size, sources), r % block_size != 0
        reads.append((m, has_partial, torch.softmax(torch.randn(tokens, m + has_partial, generator=gen), -1)))

    def eager():  # BlockRead's operators on the same tensors
        out = []
        for m, has_partial, p in reads:
            a = torch.bmm(p[:, None, :m], blocks[:, :m]).squeeze(1)
            out.append(a.addcmul_(partial, p[:, m:]) if has_partial else a)
        for m, has_partial, p in reversed(reads):
            dp = torch.bmm(da.unsqueeze(1), blocks[:, :m].mT).squeeze(1)
            out.append(torch.cat([dp, _bdot(partial, da)], -1) if has_partial else dp)
            dblocks[:, : p.shape[1]].addcmul_(p[:, :, None], da[:, None, :])
        return out

    def fused():
        out = [k.read_forward(p, blocks, m, partial if hp else None) for m, hp, p in reads]
        out += [k.read_backward(da, p, blocks, m, dblocks, partial if hp else None) for m, hp, p in reversed(reads)]
        return out

    want = eager()
    dblocks_eager = dblocks.clone()
    dblocks.zero_()
    got = fused()
    _check("block read", got + [dblocks], want + [dblocks_eager])
    # Bytes the reads must move: forward reads each source once; backward reads it again and reads and writes its
    # gradient row.
    passes = sum(4 * (m + hp) for m, hp, _ in reads)
    return _timed("block AttnRes reads", eager, fused, repeats, passes * tokens * width * 4)


def stream_write(k, *, streams: int, tokens: int, width: int, repeats: int, gen) -> dict:
    """One layer's HC write, forward and backward, through ``StreamWrite`` and through the fused loops."""
    res = torch.randn(tokens, streams, streams, generator=gen, requires_grad=True)
    X = torch.randn(tokens, streams, width, generator=gen, requires_grad=True)
    post = torch.randn(tokens, streams, generator=gen, requires_grad=True)
    v = torch.randn(tokens, width, generator=gen, requires_grad=True)
    dY = torch.randn(tokens, streams, width, generator=gen)

    def eager():
        return list(torch.autograd.grad(StreamWrite.apply(res, X, post, v), (res, X, post, v), dY))

    def fused():
        with torch.no_grad():
            Y = k.write_forward(res, X, post, v)
            return [Y] + list(k.write_backward(dY, res, X, post, v))

    with torch.no_grad():
        Y = StreamWrite.apply(res, X, post, v)
    _check("stream write", fused(), [Y] + eager())
    # Forward reads X and v and writes Y; backward reads dY, X and v and writes dX and dv.
    stream, row = tokens * streams * width * 4, tokens * width * 4
    return _timed("HC write, one layer", eager, fused, repeats, 5 * stream + 3 * row)


def _timed(name: str, eager, fused, repeats: int, traffic: int, rounds: int = 5) -> dict:
    eager_ms, fused_ms = [], []
    with OtherLoad() as load:
        for _ in range(rounds):  # alternate, so a drift of the machine hits both
            eager_ms.append(_median_ms(eager, repeats))
            fused_ms.append(_median_ms(fused, repeats))
    e, f = statistics.median(eager_ms), statistics.median(fused_ms)
    ratios = [a / b for a, b in zip(eager_ms, fused_ms, strict=True)]
    return {
        "operation": name,
        "eager_ms": round(e, 2),
        "fused_ms": round(f, 2),
        "speedup": round(e / f, 2),
        "speedup_range": f"{min(ratios):.2f}-{max(ratios):.2f}",
        "eager_GBps": round(traffic / e / 1e6, 1),
        "fused_GBps": round(traffic / f / 1e6, 1),
        "others_during": load.others,
    }


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer of at least 1, got {text!r}")
    return value


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=_positive, default=48, help="sublayers of the block AttnRes step (default 48)")
    parser.add_argument("--block-size", type=_positive, default=4, help="block AttnRes's block size (default 4)")
    parser.add_argument(
        "--tokens", type=_positive, default=2048, help="tokens per step: batch × sequence (default 2048)"
    )
    parser.add_argument("--width", type=_positive, default=256, help="model width d (default 256)")
    parser.add_argument("--streams", type=_positive, default=4, help="HC's expansion n (default 4)")
    parser.add_argument("--repeats", type=_positive, default=7, help="timed calls per median (default 7)")
    parser.add_argument("--threads", type=_positive, default=None, help="torch CPU threads (default: torch's setting)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    sizes = dict(tokens=args.tokens, width=args.width, repeats=args.repeats, gen=gen)
    try:
        k = kernels()
        reads = block_reads(k, depth=args.depth, block_size=args.block_size, **sizes)
        write = stream_write(k, streams=args.streams, **sizes)
    except DepthmemError as e:
        raise SystemExit(f"depthmem: {e}") from None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens, width {args.width}")
    for row in (reads, write):
        print("  ".join(f"{key}={value}" for key, value in row.items()))


if __name__ == "__main__":
    main()
