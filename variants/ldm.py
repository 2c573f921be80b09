"""Linear depth memory (LDM, spec §3) and its exact recursive-least-squares form (LDM-RLS, spec §4), with the
ablation knobs of spec §5. Two streams: the residual ``x`` and a matrix memory ``M`` of ``G`` groups, group ``g``
holding ``M^g ∈ R^{(d/G) × d_k}`` over the ``g``-th slice of the channels (LDM-RLS adds ``P^g ∈ R^{d_k × d_k}``).
Layer ``l`` reads ``a_l = x_{l-1} + concat_g(M^g_{l-1} q_l^g)`` and writes ``x_l = x_{l-1} + v_l`` and either
``M^g_l = M^g_{l-1} + v_l^g (k_l^g)ᵀ`` (``write=outer``) or one exact RLS step (``write=rls``, in
``variants/ops/rls.py``). Queries and keys are unit vectors per group from small per-layer MLPs on ``x_{l-1}``, or
with ``qk_source=read`` on the latest read (``variants/ops/ldm_knobs.py``); the head reads like a layer with its own
query MLP.

Two implementations compute the same function (``mixer.impl``). ``dual``, the default, never forms ``M``: it keeps
the writes ``(k_i, v_i)`` and reads ``M q = Σ_i v_i (k_iᵀ q)``, linear attention over depth (for RLS the writes are
whitened first, ``rls.whiten``), so backward keeps no per-layer memory and a read costs O(writes · d) per
token. It is one set of operations that eager CPU and GPU runs and ``torch.compile`` all take. The writes (for
RLS the whitened ones) go once into a depth buffer that every read and whitening reads in place and whose gradient
their backward sums in place (``variants/kernels/buffer.py``). Only once LDM-RLS's float32 guard has tripped do its
float64 square-root writes stay tuples, stacked for every read and whitening (and again in backward:
``variants/ops/recompute.py``). The reads and the whitening go through the ops of ``variants/kernels/`` (the fused
kernels where they run, their ``naive.py`` elsewhere). ``recurrent``
materializes ``M`` (and ``P``) at every layer exactly as the spec writes it; it is the reference the tests hold
the dual form to, and costs O(d · d_k) per layer whatever the depth (docs/ldm-performance.md).

Axes: b batch, t time, d width, g groups, v value width d/G, k key width d_k, l depth.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from variants.base import DepthMixer, register
from variants.kernels.buffer import DepthBuffer
from variants.kernels.depth_read import depth_read
from variants.kernels.depth_read.buffer import buffer_read
from variants.kernels.whiten.buffer import buffer_whiten
from variants.ops import ldm_costs, ldm_knobs, rls
from variants.ops.layers import RMSNorm
from variants.ops.ldm_state import DualState, LDMState
from variants.ops.recompute import recomputed
from variants.registry import knob

READS = ("residual+memory", "memory", "residual")
NORM_EPS = 1e-6  # the mixer does not see the model's norm_eps; the decoder's default


class SmallMLP(nn.Module):
    """``RMSNorm → Linear(d, h) → SiLU → Linear(h, out)``: one layer's query or key network (spec §3)."""

    def __init__(self, d: int, hidden: int, out: int):
        super().__init__()
        self.norm = RMSNorm(d, NORM_EPS)
        # Biases: the spec leaves them open; kept, as in a default nn.Linear.
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x):
        # Weights are cast to the input's precision, so the network runs in float32 even when the model's
        # parameters are bf16 (and float64 in a float64 model); under autocast its matmuls take autocast's.
        dt = x.dtype
        h = F.silu(F.linear(self.norm(x), self.fc1.weight.to(dt), self.fc1.bias.to(dt)))
        return F.linear(h, self.fc2.weight.to(dt), self.fc2.bias.to(dt))


def _read_writes(q: torch.Tensor, *writes: torch.Tensor) -> torch.Tensor:
    """LDM-RLS's read in the square-root form (float64, once its guard has tripped), ``Σ_i ṽ_i (k̃_iᵀ q)`` per group
    over the whitened writes so far, given as their keys then their values: ``q`` (b, t, g, k), each key
    (b, t, g, k), each value (b, t, g, v) -> (b, t, g, v), in their precision together."""
    n = len(writes) // 2
    keys, values = torch.stack(writes[:n], -2), torch.stack(writes[n:], -2)  # (b, t, g, n, k|v)
    R = q.numel() // q.shape[-1]
    q = q.to(torch.promote_types(q.dtype, keys.dtype))  # float64 once LDM-RLS's guard has tripped; never below q's
    m = depth_read(q.reshape(R, -1), keys.view(R, n, -1), values.view(R, n, -1))
    return m.view(*q.shape[:-1], -1)


def _parse_lambda(text: str) -> str | float:
    return "learned" if text.strip().lower() == "learned" else float(text)


@register("ldm")
class LDM(DepthMixer):
    """Linear depth memory: the residual stream plus an outer-product matrix memory read by per-layer queries."""

    @dataclass(kw_only=True, frozen=True)
    class Config:
        write: Literal["outer", "rls"] = knob(
            "outer", "memory update: outer product or exact recursive least squares", choices=("outer", "rls")
        )
        read: Literal["residual+memory", "memory", "residual"] = knob(
            "residual+memory", "a layer's input: x + Mq, Mq alone, or x alone (= PreLN)", choices=READS
        )
        residual_write: bool = knob(True, "off: x_l = x_{l-1}, outputs go only into the memory", choices=("on", "off"))
        qk_source: Literal["residual", "read"] | None = knob(
            None,
            "what the query and key MLPs read: the residual stream x, or the latest read (a layer's input); "
            "read when residual_write=off",
            choices=ldm_knobs.QK_SOURCES,
        )
        groups: int = knob(16, "memory groups G, each over d/G channels", allowed="a divisor of d_model")
        key_dim: int = knob(
            0,
            "key width d_k of every group, fixed while groups vary; 0 means d_model / groups",
            allowed="a positive integer, or 0 for d_model / groups",
        )
        qk_hidden: int = knob(64, "hidden width of the query and key MLPs", allowed="a positive integer")
        lambda_: str | float = knob(
            "learned",
            "forgetting factor λ (write=rls only)",
            name="lambda",
            parse=_parse_lambda,
            allowed="learned or a number in (0, 1]",
        )
        omega: bool = knob(True, "importance weights ω from the key MLP (write=rls only)", choices=("on", "off"))
        alpha: float = knob(1.0, "ridge scale, P_{-1} = αI (write=rls only)", allowed="a number > 0")
        scalar_lr: float = knob(
            1.0,
            "learning-rate multiplier of the forgetting factors λ and the importance weights ω (write=rls only), "
            "applied as a gain on their parameters",
            allowed="a number > 0",
        )

        def __post_init__(self):
            if self.qk_source is None:  # frozen: set once here, so the config says what the model does
                object.__setattr__(self, "qk_source", ldm_knobs.default_qk_source(self.residual_write))
            ldm_knobs.check(self, READS)

    def __init__(self, cfg: Config, *, d_model: int, n_layers: int):
        super().__init__(cfg, d_model=d_model, n_layers=n_layers)
        G = cfg.groups
        if d_model % G:
            divisors = [str(n) for n in range(1, d_model + 1) if d_model % n == 0]
            raise ValueError(f"groups={G} must divide d_model={d_model}; allowed: {', '.join(divisors)}")
        self.G, self.dv = G, d_model // G
        self.dk = cfg.key_dim or self.dv
        self.rls = cfg.write == "rls"
        self.uses_memory = cfg.read != "residual"
        # read=memory writes the embedding first (spec §5), otherwise reads would all be zero.
        self.embed_write = cfg.read == "memory"
        self.omega_on = self.rls and cfg.omega
        # "dual" (the default) carries the writes and reads them as linear attention over depth; "recurrent" is
        # the spec's recursion with M (and P) materialized at every layer, kept as the reference.
        self.impl: Literal["dual", "recurrent"] = "dual"
        # LDM-RLS, dual form: the least precision its whitening (and so its reads) runs in. ``step_checks`` raises
        # it to float64 once the guard has tripped, and the whitening then takes the square-root form; a Python
        # attribute, so a compiled graph recompiles for it instead of branching on a tensor.
        self.whiten_dtype = torch.float32
        if not self.uses_memory:
            return  # read=residual is PreLN: no memory, no parameters, nothing to compute.

        key_out = G * self.dk + (G if self.omega_on else 0)  # ω comes from G extra key outputs (spec §4)
        n_writes = n_layers + self.embed_write
        self.keys = nn.ModuleList(SmallMLP(d_model, cfg.qk_hidden, key_out) for _ in range(n_writes))
        # Readers 0..L-1 are the layers, L the head. Layer 0 reads the zero memory M_{-1} unless the embedding
        # was written, so it gets a parameter-free placeholder instead of a query MLP that could never learn.
        self.queries = nn.ModuleList(
            SmallMLP(d_model, cfg.qk_hidden, G * self.dk) if (r > 0 or self.embed_write) else nn.Identity()
            for r in range(n_layers + 1)
        )
        # Initialization: PyTorch's default Linear init, so keys and queries are random unit vectors at step 0;
        # the ω outputs start at zero, so ω = 1 at step 0 (spec §4 leaves ω's init open).
        if self.omega_on:
            for mlp in self.keys:
                nn.init.zeros_(mlp.fc2.weight[G * self.dk :])
                nn.init.zeros_(mlp.fc2.bias[G * self.dk :])
        if self.rls:
            # The precision guard, kept on the device (``_note_margin``): the smallest whitening margin since the
            # last ``step_checks``, in units of ``rls.min_margin``; below 1 a read lost its digits.
            self.register_buffer("margin", torch.full((), math.inf), persistent=False)
        if self.rls and cfg.lambda_ == "learned":
            # One λ per write and group; the embedding write (read=memory) gets its own like any layer,
            # a detail the spec leaves open.
            # θ is stored over the gain, so λ starts at the same value whatever the multiplier.
            self.theta = nn.Parameter(torch.full((n_writes, G), rls.theta_for_lambda() / cfg.scalar_lr))

    # -- helpers -------------------------------------------------------------------------------------------
    def _lambda(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """λ of write ``n`` per group, (g,)."""
        if self.cfg.lambda_ == "learned":
            return rls.forgetting_factor(self.theta[n].to(like.dtype) * self.cfg.scalar_lr)
        return torch.full((self.G,), float(self.cfg.lambda_), dtype=like.dtype, device=like.device)

    def _note_margin(self, margin: torch.Tensor, floor: float) -> None:
        if self.margin.device == margin.device:  # not on the meta device, where a config is only validated
            self.margin.copy_(torch.minimum(self.margin, margin.detach().to(self.margin.dtype) / floor))

    def step_checks(self, least: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> str | None:
        """LDM-RLS: whether a whitening margin fell below ``rls.min_margin`` since the last call, read from the
        device once per step instead of once per write. Then the whitening runs in float64, in the square-root
        form, from here on (``whiten_dtype``) and the sentence says so; the caller decides what to do with the step
        that lost its digits."""
        if not self.rls or not self.uses_memory:
            return None
        worst = float(least(self.margin))
        self.margin.fill_(math.inf)
        if worst >= 1.0:
            return None
        if self.whiten_dtype == torch.float64:
            return (
                f"a whitening margin of LDM-RLS fell to {worst:.2g} of its floor even in float64, so its reads lost "
                "precision"
            )
        self.whiten_dtype = torch.float64
        return (
            f"a whitening margin of LDM-RLS fell to {worst:.2g} of its floor, so its reads lost precision; "
            "its whitening and reads run in float64 from here on, in the square-root form"
        )

    def _query(self, z: torch.Tensor) -> torch.Tensor:
        """A query MLP's output as unit vectors per group, (b, t, g, k)."""
        return F.normalize(z.unflatten(-1, (self.G, self.dk)), dim=-1)

    def _key(self, z: torch.Tensor, n: int, layer: int) -> tuple:
        """Key (b, t, g, k) as unit vectors per group, importance ω (b, t, g) and forgetting λ (g,) of write ``n``,
        from its key MLP's output ``z``."""
        G, dk = self.G, self.dk
        k = F.normalize(z[..., : G * dk].unflatten(-1, (G, dk)), dim=-1)
        self.record("k", layer, k)
        if not self.rls:
            return k, None, None
        # The gain on ω's logits is its learning-rate multiplier (``scalar_lr``); they start at zero, where it does
        # not change ω.
        omega = (
            rls.importance_weight(z[..., G * dk :] * self.cfg.scalar_lr)
            if self.omega_on
            else torch.ones_like(k[..., 0])
        )
        lam = self._lambda(n, k)
        self.record("omega", layer, omega)
        self.record("lambda", layer, lam)
        return k, omega, lam

    def _qk_input(self, state) -> torch.Tensor:
        """What the query and key MLPs read now: the residual ``x``, or with ``qk_source=read`` the latest read, so
        that layer ``l``'s key comes from its input ``a_l`` and reader ``l``'s query from ``a_{l-1}``; before the
        first read that is ``x_{-1} = e``."""
        if self.cfg.qk_source == "residual":
            return state.x
        return state.pending.get("read", state.x)

    def _write_memory(self, state, n: int, layer: int, value: torch.Tensor):
        """Write ``value`` (b, t, d) under the key of write ``n`` computed from ``_qk_input``: the new memory part
        of the state, ``(M, P)`` in the recurrent form, its changed fields in the dual form (the depth buffer for
        the outer-product write; the whitened keys and values, the decay and the ridge coordinates for RLS)."""
        dt = torch.promote_types(value.dtype, torch.float32)
        # LDM's key network multiplies in the caller's precision (bf16 on tensor cores under autocast, like the
        # trunk's projections). LDM-RLS's multiplies in float32: its writes are whitened against each other, which
        # amplifies a key's rounding by the keys' conditioning; in bf16 its logits' error reached 14 times PreLN's
        # own (tests/test_rls_float32.py). From the network's output on, keys, ω and the memory are float32.
        precision = torch.autocast(value.device.type, enabled=False) if self.rls else contextlib.nullcontext()
        with precision:
            z = self.keys[n](self._qk_input(state).to(dt))
        with torch.autocast(device_type=value.device.type, enabled=False):
            k, omega, lam = self._key(z.to(dt), n, layer)
            if self.impl == "dual" and not self.rls:
                # The value is the sublayer's output, kept in its own precision (bf16 under autocast): widening it
                # here would add no digits, only bytes to every later read, which widens it as it loads it. The key,
                # a unit vector computed in float32, is kept in that precision too: it halves the bytes every read
                # loads, for logits within a few percent of float32 keys' error (tests/test_ldm_fast.py). ``dt`` is
                # never below the value's precision, so this only ever rounds the key down to it.
                k, v = k.to(value.dtype).reshape(-1, self.dk), value.reshape(-1, self.dv)  # (R, k), (R, v)
                buffer = state.buffer or DepthBuffer.allocate(len(self.keys), k, v)
                return {"buffer": buffer.append(k, v)}
            v = value.to(dt).unflatten(-1, (self.G, self.dv))  # (b, t, g, v)
            if self.impl == "recurrent":
                if not self.rls:
                    step = v.unsqueeze(-1) * k.unsqueeze(-2)  # v kᵀ, (b, t, g, v, k)
                    return (step if state.M is None else state.M + step), None
                return rls.rls_write(state.M, state.P, k, v, lam, omega)
            wt = torch.promote_types(dt, self.whiten_dtype)
            decay = lam.to(wt) if state.decay is None else state.decay * lam.to(wt)  # Π_{j≤n} λ_j
            ridge = rls.ridge_diagonal(decay, omega.to(wt), self.cfg.alpha)
            if self.whiten_dtype == torch.float64:
                # Where the guard has sent a model whose whitening lost its digits: the square-root form does not
                # subtract what cancelled, so float64 does not lose the same digits again (rls.whiten_square_root).
                writes = (state.keys, state.values, state.coords)
                k, v, c, margin = rls.whiten_square_root(k.to(wt), v.to(wt), ridge, n, len(self.keys), writes)
                coords = state.coords + (c,)
                self._note_margin(margin, rls.min_margin(wt, square_root=True))
                return {"keys": state.keys + (k,), "values": state.values + (v,), "decay": decay, "coords": coords}
            # The whitened writes in a depth buffer, as LDM's: each whitening and read takes the earlier ones where
            # they lie and adds their gradients into the buffer's in place.
            ridge = torch.broadcast_to(ridge, k.shape[:-1]).flatten()  # (R,)
            k, v = k.to(wt).reshape(-1, self.dk), v.to(wt).reshape(-1, self.dv)  # (R, k), (R, v)
            buffer = state.buffer or DepthBuffer.allocate(len(self.keys), k, v)
            kt, vt, margin = buffer_whiten(buffer, k, v, ridge)
            self._note_margin(margin.amin(), rls.min_margin(wt))
            return {"buffer": buffer.append(kt, vt), "decay": decay}

    def _read(self, state, reader: int) -> torch.Tensor:
        """Reader ``reader``'s input, kept as the latest read when queries and keys come from the reads."""
        a = self._read_streams(state, reader)
        if self.uses_memory and self.cfg.qk_source == "read":
            state.pending["read"] = a
        return a

    def _read_streams(self, state, reader: int) -> torch.Tensor:
        """Reader ``reader``'s input: ``x``, ``x + concat_g(M^g q^g)`` or the memory read alone."""
        x = state.x
        # M_{-1} = 0: nothing to read
        empty = state.M is None if self.impl == "recurrent" else state.n_writes == 0
        if not self.uses_memory or empty:
            return x
        src = self._qk_input(state)
        dt = torch.promote_types(x.dtype, torch.float32)
        z = self.queries[reader](src.to(dt))  # in the caller's precision, as LDM's key networks (``_write_memory``)
        with torch.autocast(device_type=x.device.type, enabled=False):
            q = self._query(z.to(dt))
            self.record("q", reader, q)  # (b, t, g, k)
            if self.impl == "recurrent":
                m = torch.einsum("btgvk,btgk->btgv", state.M, q)
            elif state.buffer is not None:  # LDM's writes, or LDM-RLS's whitened ones in float32
                m = buffer_read(state.buffer, q.reshape(-1, self.dk)).view(*q.shape[:-1], self.dv).to(dt)
            else:  # LDM-RLS's square-root form: float64 writes, read in their precision, back in the stream's after
                m = recomputed(_read_writes, q, *state.keys, *state.values).to(dt)
            m = m.flatten(-2)  # (b, t, g, v) -> (b, t, d)
            self.record("read", reader, m)
        m = m.to(x.dtype)
        return m if self.cfg.read == "memory" else x + m

    # -- the interface -------------------------------------------------------------------------------------
    def init_state(self, e):
        if self.impl == "recurrent":
            P = None
            if self.uses_memory and self.rls:
                dt = torch.promote_types(e.dtype, torch.float32)
                P = rls.initial_inverse_covariance(
                    self.cfg.alpha, (*e.shape[:2], self.G), self.dk, dtype=dt, device=e.device
                )
            state = LDMState(e, None, P, {})
        else:
            state = DualState(e, alpha=self.cfg.alpha if self.rls else None, pending={})
        if self.embed_write:
            # v_{-1} = e under a key from its own key MLP on e, before layer 0 (spec §5).
            state = self._next(state, e, self._write_memory(state, 0, -1, e))
        return state

    def _next(self, state, x: torch.Tensor, memory: tuple):
        """The state with residual ``x`` and the memory part returned by ``_write_memory``."""
        if self.impl == "recurrent":
            return LDMState(x, *memory, state.pending)
        return state._replace(x=x, **memory)

    def read(self, state, layer):
        return self._read(state, layer)

    def write(self, state, layer, out):
        x = state.x + out if self.cfg.residual_write else state.x
        if not self.uses_memory:
            return state._replace(x=x)
        return self._next(state, x, self._write_memory(state, layer + self.embed_write, layer, out))

    def read_head(self, state):
        return self._read(state, self.n_layers)

    # -- introspection -------------------------------------------------------------------------------------
    def mixing_matrix(self, trace):
        """``c[l, i]``: residual ones (spec §2) plus ``q_lᵀ k_i`` (LDM) or ``ω_i β_{l-1,i} k_iᵀ P_{l-1} q_l``
        (LDM-RLS) per group, for the memory reads (spec §7); the latter is solved for directly in its dual form,
        ``r = (K Kᵀ + D)⁻¹ K q``, from the recorded keys, queries, ω and λ."""
        L, G = self.n_layers, (self.G if self.uses_memory else 1)
        b, t, _ = trace.embed.shape
        c = trace.embed.new_zeros(b, t, L + 1, L + 1, G)
        if self.cfg.read != "memory":
            c[:, :, :, 0] = 1.0  # the embedding is in x
            if self.cfg.residual_write:
                c[:, :, :, 1:] += torch.ones(L + 1, L, dtype=c.dtype, device=c.device).tril(-1)[..., None]
        if not self.uses_memory:
            return c
        rec = trace.mixer
        writers = ([-1] if self.embed_write else []) + list(range(L))  # write order; source of writer i is i+1
        for reader in range(L + 1):
            held = writers[: reader + self.embed_write]  # writes made before this reader
            if not held:
                continue
            q = rec[("q", reader)]  # (b, t, g, k)
            keys = torch.stack([rec[("k", w)] for w in held], -2)  # (b, t, g, n, k)
            if self.rls:
                decay = torch.cumprod(torch.stack([rec[("lambda", w)] for w in held], -1), -1)  # (g, n)
                omega = torch.stack([rec[("omega", w)] for w in held], -1)  # (b, t, g, n)
                weight = rls.read_weights(keys, rls.ridge_diagonal(decay, omega, self.cfg.alpha), q)
            else:
                weight = (keys @ q.unsqueeze(-1)).squeeze(-1)  # k_iᵀ q, (b, t, g, n)
            c[:, :, reader, held[0] + 1 : held[-1] + 2] += weight.transpose(-1, -2).to(c.dtype)
        return c

    def stream_floats_per_token(self):
        """d for x, plus G·(d/G)·d_k for M and, with RLS, G·d_k² for P (nothing extra for read=residual)."""
        if not self.uses_memory:
            return self.d_model
        return self.d_model + self.G * self.dv * self.dk + (self.G * self.dk**2 if self.rls else 0)

    def extra_flops_per_token(self):
        """Analytic forward FLOPs per token over PreLN for the implementation that runs
        (``variants/ops/ldm_costs.py``)."""
        return sum(ldm_costs.flops_per_token(self))

    @torch.no_grad()
    def sizes(self) -> dict[str, int]:
        return {"groups": self.G, "key width": self.dk, "value width": self.dv}

    def learned_statistics(self, trace):
        """LDM-RLS: the forgetting factor λ of every layer's write per group (from the parameters, or the fixed
        value), and the importance weights ω of every layer's write over the traced tokens and groups: mean,
        standard deviation (over all of them, not a sample estimate), min and max. The embedding's own write
        (``read=memory``) is left out, so there is one entry per layer. With learned λ and a gradient from the last
        step, also the norm of that gradient of λ's parameters (``lambda_grad_norm``), which says whether λ can
        move at all (``scalar_lr``). Nothing for the outer-product write."""
        if not (self.rls and self.uses_memory):
            return {}
        like = trace.embed.new_zeros((), dtype=torch.float64)
        lam = [self._lambda(layer + self.embed_write, like).tolist() for layer in range(self.n_layers)]
        omega = []
        for layer in range(self.n_layers):
            w = trace.mixer[("omega", layer)].double()  # (b, t, g)
            omega.append(
                {
                    "mean": float(w.mean()),
                    "std": float(w.std(unbiased=False)),
                    "min": float(w.min()),
                    "max": float(w.max()),
                }
            )
        stats = {"lambda": lam, "omega": omega}
        theta = getattr(self, "theta", None)
        if theta is not None and theta.grad is not None:
            stats["lambda_grad_norm"] = float(theta.grad.double().norm())
        return stats
