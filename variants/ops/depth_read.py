"""The depth read of LDM's dual form, ``M q = Σ_i v_i (k_iᵀ q)`` from the writes themselves, and its chunkwise
form, which folds every ``C`` writes into a carried memory ``M`` and reads ``M q`` plus the writes since.

Read over the writes alone, the read costs O(n · d) per token with ``n`` writes so far, so a whole depth costs
O(L² · d). The carried memory costs O(d · d_k) per read whatever the depth, the price of reading ``d_k / 2`` writes
(``M`` holds ``d · d_k`` floats per token, a write ``2d``); carrying it beyond every ``C``-th write keeps the
dual form's cost within a chunk and the carried form's slope over depth, as chunkwise linear attention does along
time. ``M`` is never saved for backward: one buffer serves the whole forward pass, and backward recovers the memory
each read saw by subtracting the folded writes again, in the reverse order autograd visits the folds.

Autograd orders all of it. A fold's output is a token that every later read of its chunk and the next fold take as
an input, so a fold's backward runs after the backward of every read that saw its memory, and before that of any
read that came earlier (those produced the writes the fold consumed). The reads' gradients of ``M`` are kept as
their ``(∂m, q)`` pairs and summed by one batched product in the fold's backward.

Axes: b batch, t time, g groups, k key width d_k, v value width d/G; B = b·t·g; n writes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from variants.ops import _bdot
from variants.ops.gradients import GradientSum
from variants.ops.tape import graph_kept


class WriteGradient(NamedTuple):
    """Where the reads add a write's key and value gradients (``variants/ops/gradients.py``): a read returns None for
    the write, and the write's ``Gathered`` node hands both sums to autograd after every read's backward."""

    key: GradientSum
    value: GradientSum

    @classmethod
    def new(cls) -> WriteGradient:
        return cls(GradientSum(), GradientSum())


def _read_writes(q, keys, values, m=None):
    """``m + Σ_i v_i (k_iᵀ q)``, accumulated in place into ``m`` when one is given."""
    for k, v in zip(keys, values):
        z = _bdot(k, q)  # k_iᵀ q, (b, t, g, 1)
        m = z * v if m is None else m.addcmul_(z, v)
    return m


def _read_writes_backward(dm, q, keys, values, grads, dq=None):
    """``(dq, dkeys, dvalues)`` of ``_read_writes``; a write with a ``WriteGradient`` gets its gradient added there
    and None in the lists. The scores ``k_iᵀ q`` are recomputed, not saved (see ``DepthRead``)."""
    dkeys, dvalues = [], []
    for k, v, grad in zip(keys, values, grads):
        dz = _bdot(v, dm)  # (b, t, g, 1)
        dq = dz * k if dq is None else dq.addcmul_(dz, k)
        z = _bdot(k, q)
        if grad is None:
            dkeys.append(dz * q)
            dvalues.append(z * dm)
        else:
            grad.key.add(dz, q)
            grad.value.add(z, dm)
            dkeys.append(None)
            dvalues.append(None)
    return dq, dkeys, dvalues


class DepthRead(torch.autograd.Function):
    """``M q = Σ_i v_i (k_iᵀ q)`` from the writes themselves: linear attention over depth, O(writes · d) per token.

    ``apply(q, grads, *keys, *values)``: ``q`` and keys (b, t, g, k), values (b, t, g, v) -> (b, t, g, v);
    ``grads`` holds one ``WriteGradient`` per write (or None, to return the write's gradient to autograd).
    Written out by hand so that backward keeps only the query and the writes (which the graph holds anyway), and
    accumulates in place instead of building one temporary per write and operation. The per-token scores
    ``k_iᵀ q`` are recomputed in backward rather than saved: saved, they are one (b, t, g) tensor per (read,
    write) pair, O(L²) over the depth (147 MiB at 48 layers of the ``small`` preset), for one batched product
    each to recompute.
    """

    @staticmethod
    def forward(ctx, q, grads, *writes):
        n = len(writes) // 2
        ctx.grads = grads
        ctx.save_for_backward(q, *writes)
        return _read_writes(q, writes[:n], writes[n:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dm):
        q, *rest = ctx.saved_tensors
        n = len(rest) // 2
        dq, dkeys, dvalues = _read_writes_backward(dm, q, rest[:n], rest[n:], ctx.grads)
        return dq, None, *dkeys, *dvalues


# -- the chunkwise form --------------------------------------------------------------------------------------


def _stacked(keys, values) -> torch.Tensor:
    """A chunk's writes as one batched matrix ``[V; Kᵀ]`` (B, v + k, n): values (B, v, n) over keys (B, k, n), the
    left factor of a fold into ``[M; S]`` (``CarriedMemory``). ``_split`` gives K (B, n, k) and V as views."""
    v = values[0].shape[-1]
    VK = values[0].new_empty(*values[0].shape[:-1], v + keys[0].shape[-1], len(keys))
    for i, (k_i, v_i) in enumerate(zip(keys, values)):
        VK[..., :v, i] = v_i
        VK[..., v:, i] = k_i
    return VK.flatten(0, -3)


def _split(VK: torch.Tensor, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` of ``_stacked``'s buffer: keys (B, n, k) and values (B, v, n)."""
    return VK[:, v:].mT, VK[:, :v]


class CarriedMemory:
    """``M = Σ v_i k_iᵀ`` over the folded writes of one forward pass, (B, v, k), shared by its folds and reads;
    with ``gram`` also the keys' ``S = Σ k_i k_iᵀ`` (B, k, k), which LDM-RLS's whitening reads
    (``variants/ops/rls.py``).

    In forward the memories grow in place, one fold per chunk. In backward they hold their value as of fold
    ``phase`` (the latest fold whose writes they include), which each fold's backward lowers by one, and ``grad``
    the gradient of each summed over every use after the fold being differentiated. ``pending`` keeps, per phase
    and memory, the pairs ``(a, b)`` whose outer products ``a bᵀ`` the uses of that phase owe the gradient (a read's
    ``(∂m, q)``), for one batched product instead of one (B, v, k) update per use.

    With ``gram`` both live in one buffer ``MS = [M; S]`` (B, v + k, k): what the whitening reads, ``M k`` and
    ``S k``, is then one batched product, and so is its backward's ``Mᵀ ∂ṽ + Sᵀ ∂k̃``. On CPU a batched
    product of such small matrices costs about the same per token whatever their height, so one product of twice
    the height is about twice as fast as two.
    """

    __slots__ = ("M", "S", "MS", "v", "gram", "shape", "folds", "phase", "chunks", "pending", "grad", "__weakref__")

    def __init__(self, gram: bool = False):
        self.M: torch.Tensor | None = None
        self.S: torch.Tensor | None = None
        self.MS: torch.Tensor | None = None  # with gram: M and S are views of it
        self.v = 0  # value width: M's height
        self.gram = gram
        self.shape: tuple[int, ...] = ()  # (b, t, g): the leading axes B flattens
        self.folds = 0
        self.phase = -1
        self.chunks: list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
        self.pending: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.grad: dict[str, torch.Tensor] = {}

    def _add(self, VK: torch.Tensor, alpha: float = 1.0) -> None:
        # In place, and written as baddbmm(out=) so that FLOP counters see the forward's folds. Into views of MS a
        # product falls back to one call per token, so [M; S] += [V; Kᵀ] K is one product.
        K, V = _split(VK, self.v)
        if self.gram:
            torch.baddbmm(self.MS, VK, K, alpha=alpha, out=self.MS)
        else:
            torch.baddbmm(self.M, V, K, alpha=alpha, out=self.M)

    def _build(self, VK: torch.Tensor) -> None:
        K, V = _split(VK, self.v)
        if self.gram:
            self.MS = torch.bmm(VK, K)
            self.M, self.S = self.MS[:, : self.v], self.MS[:, self.v :]
        else:
            self.M = torch.bmm(V, K)

    def fold(self, keys, values) -> int:
        """Add a chunk's writes to the memories; its phase number."""
        VK = _stacked(keys, values)
        if self.M is None:
            self.shape, self.v = keys[0].shape[:-1], values[0].shape[-1]
            self._build(VK)
        else:
            self._add(VK)
        # Detached (the same storage): the graph holds this object through its nodes' contexts, and a tensor that
        # held its graph in turn would make a reference cycle that outlives the step.
        self.chunks.append((tuple(k.detach() for k in keys), tuple(v.detach() for v in values)))
        self.phase = self.folds
        self.folds += 1
        return self.phase

    def at(self, phase: int) -> None:
        """Bring the memories to where the uses of ``phase`` saw them. Backward starts at the last phase; after
        ``release``, or in a second backward through a retained graph (which finds them lowered by the first), that
        adds every chunk again, in the forward's order."""
        if self.phase != phase:
            if phase != self.folds - 1:
                raise RuntimeError(f"carried memory asked for phase {phase} while at {self.phase}")
            for i, chunk in enumerate(self.chunks):
                if chunk is None:
                    raise RuntimeError(
                        "the carried memory's writes were freed by a backward pass that did not keep the graph"
                    )
                VK = _stacked(*chunk)
                if i == 0:
                    self._build(VK)
                else:
                    self._add(VK)
            self.phase = phase

    def release(self) -> None:
        """Let go of the memories once the forward pass has read them for the last time. The first use in backward
        rebuilds them from the folded writes (``at``), after the head's backward has freed its own buffers, so the
        step's peak does not hold them: one more product per fold, for ``d · d_k`` floats per token (with ``gram``
        ``d_k²`` more)."""
        self.M = self.S = self.MS = None
        self.phase = -1

    def owe(self, phase: int, name: str, a: torch.Tensor, b: torch.Tensor, sign: float = 1.0) -> None:
        """A use of memory ``name`` at ``phase`` adds ``sign · a bᵀ`` to its gradient: ``a`` (B, r), ``b`` (B, c).
        The sign is applied when the pairs are stacked, so a use need not keep a negated copy of a gradient it
        also returns."""
        # Detached, as in ``fold``.
        self.pending.setdefault((phase, name), []).append((a.detach(), b.detach(), sign))

    def gradient(self, phase: int, name: str) -> torch.Tensor | None:
        """``∂L/∂`` memory ``name`` after fold ``phase``: what its uses owe plus what later folds handed on; None
        where nothing used it (RLS's Gram matrix after the last write, which only reads follow)."""
        later = self.grad.pop(name, None) if phase < self.folds - 1 else None
        owed = self.pending.pop((phase, name), [])
        if owed:
            a = torch.stack([a for a, _, _ in owed], -1)  # (B, r, uses)
            for i, (_, _, sign) in enumerate(owed):
                if sign != 1.0:
                    a[..., i].mul_(sign)
            b = torch.stack([b for _, b, _ in owed], -2)  # (B, uses, c)
            del owed  # the pairs, now copied, need not outlive the product below
            return torch.bmm(a, b) if later is None else later.baddbmm_(a, b)
        return later


class Fold(torch.autograd.Function):
    """``M ← M + Σ_{i in the chunk} v_i k_iᵀ`` (and ``S ← S + Σ k_i k_iᵀ``). ``apply(memory, token, *keys,
    *values)`` -> the new token.

    ``token`` (the previous fold's, or None for the first) and the returned empty tensor carry no values; they
    are the edges that order the folds' and reads' backward passes (module docstring)."""

    @staticmethod
    def forward(ctx, memory: CarriedMemory, token, *writes):
        n = len(writes) // 2
        ctx.memory, ctx.phase = memory, memory.fold(writes[:n], writes[n:])
        ctx.save_for_backward(*writes)
        ctx.set_materialize_grads(False)
        return writes[0].new_empty(0)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, _):
        memory, phase = ctx.memory, ctx.phase
        writes = ctx.saved_tensors
        n = len(writes) // 2
        memory.at(phase)
        VK = _stacked(writes[:n], writes[n:])
        K, V = _split(VK, memory.v)
        G = memory.gradient(phase, "M")  # (B, v, k)
        if G is None:
            G = torch.zeros_like(memory.M)
        dK = torch.bmm(V.mT, G)  # Gᵀ v_i, (B, n, k)
        dV = torch.bmm(G, K.mT)  # G k_i, (B, v, n)
        grads = {"M": G}
        if memory.gram:
            GS = memory.gradient(phase, "S")  # (B, k, k)
            if GS is not None:
                dK.baddbmm_(K, GS).baddbmm_(K, GS.mT)  # (G_S + G_Sᵀ) k_i, without a (B, k, k) temporary
                grads["S"] = GS
        # The memories before this fold, for the uses between the previous fold and this one; this fold's are the
        # previous ones plus its writes, so the gradients pass on unchanged.
        memory._add(VK, alpha=-1.0)
        memory.phase = phase - 1
        if not graph_kept():
            memory.chunks[phase] = None  # only a second backward rebuilds the memories from it
        memory.grad = grads if phase > 0 else {}
        dK, dV = dK.unflatten(0, memory.shape), dV.unflatten(0, memory.shape)  # (b, t, g, n, k), (b, t, g, v, n)
        return None, None, *dK.unbind(-2), *dV.unbind(-1)


class CarriedRead(torch.autograd.Function):
    """``M q + Σ_{i in the open chunk} v_i (k_iᵀ q)``. ``apply(q, memory, token, grads, *keys, *values)``: as
    ``DepthRead``, plus the carried memory and the token of its latest fold."""

    @staticmethod
    def forward(ctx, q, memory: CarriedMemory, token, grads, *writes):
        n = len(writes) // 2
        M = memory.M
        # qᵀ Mᵀ rather than M q: the same products, faster on CPU than batched matvecs.
        m = torch.bmm(q.reshape(-1, 1, q.shape[-1]), M.mT).view(*q.shape[:-1], M.shape[-2])  # (b, t, g, v)
        ctx.memory, ctx.phase, ctx.grads = memory, memory.phase, grads
        ctx.save_for_backward(q, *writes)
        return _read_writes(q, writes[:n], writes[n:], m)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dm):
        q, *rest = ctx.saved_tensors
        n = len(rest) // 2
        memory = ctx.memory
        memory.at(ctx.phase)
        dm_flat = dm.reshape(-1, dm.shape[-1])
        dq = torch.bmm(dm_flat.unsqueeze(1), memory.M).view_as(q)  # Mᵀ ∂m, as a row
        memory.owe(ctx.phase, "M", dm_flat, q.reshape(-1, q.shape[-1]))
        dq, dkeys, dvalues = _read_writes_backward(dm, q, rest[:n], rest[n:], ctx.grads, dq)
        return dq, None, None, None, *dkeys, *dvalues
