"""AttnRes's depth read in plain PyTorch: ``a = Σ_s softmax_s(w · RMSNorm(v_s)) v_s`` with a gainless key norm.

``softmax_read`` is the formula on stacked sources, ``values`` (R, S, d) and the reader's pseudo-query ``query``
(d,) -> (R, d): the reference. The models read a depth buffer (``variants/kernels/buffer.py``): the sources are its
first ``n`` writes, depth-major (capacity, R, d), and optionally one ``extra`` source (R, d) outside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from variants.kernels.buffer import row_dot


def softmax_read(values: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    rho = torch.rsqrt(values.square().mean(-1) + eps)  # the key norm's scale, (R, S)
    weights = torch.softmax(rho * (values @ query), dim=-1)
    return (weights.unsqueeze(-2) @ values).squeeze(-2)


def sources(values: torch.Tensor, n: int, extra: torch.Tensor | None, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The sources of a buffer read, (R, d) each in ``dtype``, one at a time: views of the buffer where no cast is
    needed, and where one is (bf16 sources read in float32) one cast source at a time, never all of them at once."""
    for x in (*values[:n], *([] if extra is None else [extra])):
        yield x.to(dtype)


def _scale_and_logit(v: torch.Tensor, query: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``ρ = (mean(v²) + ε)^{-1/2}`` and ``w·v`` of a source ``v`` (R, d), each (R,)."""
    rho = torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / v.shape[-1] + eps)
    return rho, v @ query


def logits(v: Iterable[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """``ρ_s w·v_s`` of the sources ``v``, (S, R)."""
    return torch.stack([rho * wv for rho, wv in (_scale_and_logit(x, query, eps) for x in v)])


# The buffer read and its backward go source by source, each source's terms added in place, as the kernels do:
# nothing of the size of the sources is allocated beyond the read and the gradients, so a step's memory is what
# the memory plan (harness/training/memory_plan.py) simulates from the ops' outputs.


@torch.no_grad()
def buffer_read(query, values, n: int, extra, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The read (R, d) and each row's log-sum-exp of the logits (R,), in ``query``'s dtype."""
    z = logits(sources(values, n, extra, query.dtype), query, eps)
    lse = z.logsumexp(0)
    p = (z - lse).exp_()
    a = query.new_zeros(values.shape[1:])
    for p_s, v_s in zip(p, sources(values, n, extra, query.dtype), strict=True):
        a.addcmul_(p_s.unsqueeze(-1), v_s)
    return a, lse


@torch.no_grad()
def buffer_read_backward(da, query, values, grad_values, n: int, extra, a, lse, eps: float):
    """``∂w`` and the extra source's gradient (an empty tensor without one), with each ``∂v_s`` added into
    ``grad_values`` (in its own dtype), from the read ``a`` and the log-sum-exp ``lse`` of ``buffer_read``; the
    arithmetic in ``query``'s dtype. With ``δ = aᵀ∂a`` and ``∂z_s = p_s (v_sᵀ∂a − δ)``:
    ``∂v_s = p_s ∂a + ∂z_s (ρ_s w − (w·v_s) ρ_s³ v_s / d)`` and ``∂w = Σ_s ∂z_s ρ_s v_s``."""
    da = da.to(query.dtype)
    delta = row_dot(a.to(query.dtype), da)
    dw = torch.zeros_like(query)
    dx = query.new_zeros(values.shape[1:]) if extra is not None else query.new_empty(0)
    for s, v_s in enumerate(sources(values, n, extra, query.dtype)):
        rho, wv = _scale_and_logit(v_s, query, eps)
        p = (rho * wv - lse).exp_()
        dz = p * (row_dot(v_s, da) - delta)
        g = grad_values[s] if s < n else dx
        # ∂v_s = p ∂a + (∂z ρ) w − (∂z (w·v) ρ³ / d) v
        g.addcmul_(p.unsqueeze(-1), da).addcmul_((dz * rho).unsqueeze(-1), query)
        g.addcmul_((dz * wv * rho.pow(3) / v_s.shape[-1]).unsqueeze(-1), v_s, value=-1)
        dw.addmv_(v_s.T, dz * rho)
    return dw, dx.to(extra.dtype) if extra is not None else dx
