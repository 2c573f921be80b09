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
whitened first, ``variants/ops/rls.py``), so backward keeps no per-layer memory and a read costs O(writes · d) per
token. The dual form also computes a layer's query and key MLPs in one pass (they read the same ``x``:
``shared_input_mlps``) and lets the reads add each write's gradient in place (``WriteGradient``). ``recurrent``
materializes ``M`` (and ``P``) at every layer exactly as the spec writes it, with each MLP on its own; it is the
reference the tests hold the dual form to, and costs O(d · d_k) per layer whatever the depth
(docs/ldm-performance.md). In deep models with narrow keys the dual form (either write) reads
chunkwise (``LDM.chunk``, ``variants/ops/depth_read.py``): every ``C`` writes are folded into a carried ``M``, so a read
is ``M q`` plus the writes since the latest fold, and its cost stops growing with depth.

Axes: b batch, t time, d width, g groups, v value width d/G, k key width d_k, l depth.
"""

from __future__ import annotations

import contextlib
import math
import operator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from variants import kernels
from variants.base import DepthMixer, register
from variants.kernels.depth_read import depth_read
from variants.ops import ldm_costs, ldm_knobs, rls, unit
from variants.ops.depth_read import CarriedMemory, CarriedRead, DepthRead, Fold, WriteGradient
from variants.ops.gradients import Gathered
from variants.ops.ldm_state import Carried, DualState, LDMState
from variants.ops.mlp_pass import NORM_EPS, MLPPass, RawKey, SmallMLP, shared_input_mlps  # noqa: F401
from variants.ops.tape import Tape, default_segment
from variants.registry import knob

READS = ("residual+memory", "memory", "residual")


def _parse_lambda(text: str) -> str | float:
    return "learned" if text.strip().lower() == "learned" else float(text)


CHUNK = 4
"""Writes per chunk of the chunked depth read (4 and 6 measured alike at 48 layers, 4 ahead at 32)."""


def default_chunk(n_writes: int, key_dim: int) -> int:
    """How many writes the dual read folds into a carried memory at a time, 0 for never: only where the writes
    outnumber what the carried memory costs to read (``M`` holds ``d · d_k`` floats per token, ``d_k / 2`` writes'
    worth) by enough to pay for the folds: from 28 writes at ``d_k = 16``, where it was measured to gain
    (docs/ldm-performance.md), and beyond GPT-2 small's 25 at its ``d_k = 48``."""
    return CHUNK if n_writes >= 2 * (key_dim // 2 + CHUNK) + CHUNK else 0


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
        # Dual form: fold every `chunk` writes into a carried memory (0: never), where that is cheaper than
        # reading the writes one by one (``default_chunk``).
        self.chunk = default_chunk(n_layers + (cfg.read == "memory"), self.dk)
        # Dual form: layers per checkpointed segment of the residual x (``tape``); None for ⌈√L⌉, 1 keeps every x.
        self.stream_segment: int | None = None
        # Set by ``step_checks`` once the plain path's guard has tripped: the eager, guarded path from then on.
        self.exact_guard = False
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
            # The plain path's precision guard, kept on the device (``_note_margin``): the smallest whitening margin
            # since the last ``step_checks``, in units of ``rls.min_margin``; below 1 a read lost its digits.
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

    def _plain(self, t: torch.Tensor) -> bool:
        """Whether the dual form runs as plain tensor operations (and the fused kernels where they run): under
        ``torch.compile``, which cannot follow the eager path's hand-written nodes and the Python objects they
        share, on a GPU, for which those nodes were not written (they trade passes over memory for CPU calls),
        and wherever the kernels take over its reads. The plain path never asks the host anything: its
        float32 guard is a device-side minimum (``_note_margin``) read once per step (``step_checks``)."""
        return (torch.compiler.is_compiling() or t.device.type != "cpu" or kernels.active(t)) and not self.exact_guard

    def _note_margin(self, margin: torch.Tensor, dtype: torch.dtype) -> None:
        if self.margin.device == margin.device:  # not on the meta device, where a config is only validated
            self.margin.copy_(torch.minimum(self.margin, margin.detach().to(self.margin.dtype) / rls.min_margin(dtype)))

    def step_checks(self) -> str | None:
        """LDM-RLS on the plain path: whether a whitening margin fell below ``rls.min_margin`` since the last call.
        Then the eager path, whose guard hands over to the float64 recursion, runs from here on (``exact_guard``)
        and the sentence says so; the caller decides what to do with the step that lost its digits."""
        if not self.rls or not self.uses_memory:
            return None
        worst = float(self.margin)
        self.margin.fill_(math.inf)
        if worst >= 1.0:
            return None
        self.exact_guard = True
        return (
            f"a whitening margin of LDM-RLS fell to {worst:.2g} of its float32 floor, so its reads lost precision; "
            "the guarded eager path, which hands over to the float64 recursion, runs from here on"
        )

    def _unit(self, z: torch.Tensor) -> torch.Tensor:
        """Unit vectors per group; the recurrent reference keeps the plain ``F.normalize``."""
        return F.normalize(z, dim=-1) if self.impl == "recurrent" else unit(z)

    def _query(self, z: torch.Tensor) -> torch.Tensor:
        """A query MLP's output as unit vectors per group, (b, t, g, k)."""
        return self._unit(z.unflatten(-1, (self.G, self.dk)))

    def _key_parts(self, z: torch.Tensor) -> list[torch.Tensor]:
        """A key MLP's output ``z`` (b, t, g*k [+ g]) as the key, unit vectors per group (b, t, g, k), and with ω
        the raw ω outputs (b, t, g)."""
        G, dk = self.G, self.dk
        k = self._unit(z[..., : G * dk].unflatten(-1, (G, dk)))
        # The gain on ω's logits is its learning-rate multiplier (``scalar_lr``); they start at zero, where it does
        # not change ω.
        return [k, z[..., G * dk :] * self.cfg.scalar_lr] if self.omega_on else [k]

    def _finish_read(self, outs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The read's pass: the query, then the parts of the key of the same layer's write, if the pass made it."""
        return [self._query(outs[0]), *(self._key_parts(outs[1]) if len(outs) > 1 else ())]

    def _key(self, state, n: int, layer: int, dt: torch.dtype, pending: tuple | None = None) -> tuple:
        """Key (b, t, g, k), importance ω (b, t, g) and forgetting λ (g,) of write ``n``, from ``_qk_input`` in
        ``dt`` (or ``pending``: the pass of a read that computed it already, and the key's parts), and the pass
        that made it (None in the recurrent form)."""
        if pending is None:
            x = self._qk_input(state)
            if self.impl == "recurrent":
                mlp_pass, parts = None, self._key_parts(self.keys[n](x.to(dt)))
            else:  # the embedding's own write (layer -1) reads x_0 = e
                mlp_pass = self._mlp_pass(state, [self.keys[n]], max(layer, 0), finish=lambda o: self._key_parts(o[0]))
                parts = mlp_pass.run(x, dt)
        else:
            mlp_pass, parts = pending
        k = parts[0]
        self.record("k", layer, k)
        if not self.rls:
            return k, None, None, mlp_pass
        omega = rls.importance_weight(parts[1]) if self.omega_on else torch.ones_like(k[..., 0])
        lam = self._lambda(n, k)
        self.record("omega", layer, omega)
        self.record("lambda", layer, lam)
        return k, omega, lam, mlp_pass

    def segment(self) -> int:
        return self.stream_segment or default_segment(self.n_layers + 1)

    def tape(self) -> Tape | None:
        """The dual form's checkpoint of the residual stream, or None where it would not save memory.

        The query and key MLPs read ``x_l`` and keep it for their backward, one (b, t, d) tensor per layer. With the
        outer-product write every layer's output ``v_l`` is kept anyway (the reads need it), and ``x_{l+1} = x_l +
        v_l``, so backward can recompute ``x`` from every ``segment()``-th one. Not with the RLS write, which keeps
        only whitened values (the raw ``v_l`` would have to be kept instead of ``x``), nor where the MLPs read
        the reads or ``x`` never changes; not under ``torch.compile``, which plans what it saves, nor without
        gradients."""
        cfg = self.cfg
        if (
            self.impl != "dual"
            or self.rls
            or not (self.uses_memory and cfg.residual_write and cfg.qk_source == "residual")
            or self.segment() <= 1
            or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()
        ):
            return None
        return Tape(self.segment(), operator.add)

    def _mlp_pass(self, state, mlps, layer: int, finish) -> MLPPass:
        """The dual form's pass of ``mlps`` over ``_qk_input`` before ``layer``, through the tape where there is one."""
        tape = state.tape if self.cfg.qk_source == "residual" else None
        return MLPPass(mlps, finish, tape, layer)

    def _qk_input(self, state) -> torch.Tensor:
        """What the query and key MLPs read now: the residual ``x``, or with ``qk_source=read`` the latest read, so
        that layer ``l``'s key comes from its input ``a_l`` and reader ``l``'s query from ``a_{l-1}``; before the
        first read that is ``x_{-1} = e``."""
        if self.cfg.qk_source == "residual":
            return state.x
        return state.pending.get("read", state.x)

    def _write_memory(self, state, n: int, layer: int, value: torch.Tensor):
        """Write ``value`` (b, t, d) under the key of write ``n`` computed from ``_qk_input``: the new memory part
        of the state, ``(M, P)`` in the recurrent form, ``(keys, values, decay, grads, raw, exact, carried)`` in
        the dual form."""
        dt = torch.promote_types(value.dtype, torch.float32)
        with torch.autocast(device_type=value.device.type, enabled=False):
            pending = None if self.impl == "recurrent" else state.pending.pop(layer, None)
            k, omega, lam, mlp_pass = self._key(state, n, layer, dt, pending)
            v = value.to(dt).unflatten(-1, (self.G, self.dv))  # (b, t, g, v)
            if self.impl == "recurrent":
                if not self.rls:
                    step = v.unsqueeze(-1) * k.unsqueeze(-2)  # v kᵀ, (b, t, g, v, k)
                    return (step if state.M is None else state.M + step), None
                return rls.rls_write(state.M, state.P, k, v, lam, omega)
            decay, raw, exact = None, (), None
            plain = self._plain(v)
            if self.rls and plain:
                decay = lam if state.decay is None else state.decay * lam
                ridge = rls.ridge_diagonal(decay, omega, self.cfg.alpha)
                with mlp_pass.keeping(k):
                    k, v, margin = rls.whiten_plain(k, v, ridge, state.keys, state.values)
                self._note_margin(margin, k.dtype)
            elif self.rls:
                decay = lam if state.decay is None else state.decay * lam  # Π_{j≤n} λ_j
                index = mlp_pass.index(k)
                raw_k = k if index is None else RawKey(mlp_pass, self._qk_input(state), index)
                raw = state.raw + ((raw_k, v, lam, omega),)
                if state.exact is not None:  # already handed over: one more step of the recursion
                    exact = rls.rls_write(*state.exact, k.double(), v.double(), lam.double(), omega.double())
                    return state.keys, state.values, decay, state.grads, raw, exact, state.carried
                ridge = rls.ridge_diagonal(decay, omega, self.cfg.alpha)
                # The raw key is the whitening's alone (reads use the whitened one): its backward recomputes it.
                with mlp_pass.keeping(k):
                    k, v, margin = rls.whiten(k, v, ridge, state.keys, state.values, state.grads, state.carried)
                if margin < rls.min_margin(k.dtype):
                    # This write's δ² cancelled below the precision: the exact recursion from here on.
                    exact = rls.replay([(k() if callable(k) else k, *rest) for k, *rest in raw], self.cfg.alpha)
                    return state.keys, state.values, decay, state.grads, raw, exact, state.carried
            grad = None
            if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad) and not plain:
                grad = WriteGradient.new()
                k, v = Gathered.apply(grad, k, v)
            keys, values, grads, carried = state.keys + (k,), state.values + (v,), state.grads + (grad,), state.carried
            # The plain path cannot follow the carried memory's buffer, so it reads every write.
            if len(keys) == self.chunk and not plain:
                memory = carried.memory if carried is not None else CarriedMemory(gram=self.rls)
                token = Fold.apply(memory, carried.token if carried is not None else None, *keys, *values)
                keys, values, grads, carried = (), (), (), Carried(memory, token)
            return keys, values, decay, grads, raw, exact, carried

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
        if self.impl == "recurrent":
            empty = state.M is None
        else:
            empty = len(state.keys) == 0 and state.exact is None and state.carried is None
        if not self.uses_memory or empty:
            return x
        src = self._qk_input(state)
        dt = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(device_type=x.device.type, enabled=False):
            keeping = contextlib.nullcontext()
            if self.impl == "recurrent":
                q = self._query(self.queries[reader](src.to(dt)))
            else:
                mlps = [self.queries[reader]]
                shared = reader < self.n_layers and self.cfg.qk_source == "residual"
                if shared:  # this layer's write keys the same x: both MLPs in one pass, the key kept for the write
                    mlps.append(self.keys[reader + self.embed_write])
                mlp_pass = self._mlp_pass(state, mlps, reader, finish=self._finish_read)
                q, *key = mlp_pass.run(src, dt)
                if shared:
                    state.pending[reader] = (mlp_pass, key)
                keeping = mlp_pass.keeping(q)  # the read's backward gets q from the pass's recomputation
            self.record("q", reader, q)  # (b, t, g, k)
            if self.impl == "recurrent":
                m = torch.einsum("btgvk,btgk->btgv", state.M, q)
            elif state.exact is not None:
                m = torch.einsum("btgvk,btgk->btgv", state.exact[0], q.double()).to(dt)
            elif self._plain(q):
                R = q.numel() // q.shape[-1]
                keys, values = torch.stack(state.keys, -2), torch.stack(state.values, -2)  # (b, t, g, n, k|v)
                with keeping:
                    m = depth_read(q.reshape(R, -1), keys.view(R, *keys.shape[-2:]), values.view(R, *values.shape[-2:]))
                m = m.view(*q.shape[:-1], -1)
            elif state.carried is not None:
                memory, token = state.carried
                with keeping:
                    m = CarriedRead.apply(q, memory, token, state.grads, *state.keys, *state.values)
            else:
                with keeping:
                    m = DepthRead.apply(q, state.grads, *state.keys, *state.values)
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
            state = DualState(e, alpha=self.cfg.alpha if self.rls else None, pending={}, tape=self.tape())
        if self.embed_write:
            # v_{-1} = e under a key from its own key MLP on e, before layer 0 (spec §5).
            state = self._next(state, e, self._write_memory(state, 0, -1, e))
        return state

    def _next(self, state, x: torch.Tensor, memory: tuple):
        """The state with residual ``x`` and the memory part returned by ``_write_memory``."""
        if self.impl == "recurrent":
            return LDMState(x, *memory, state.pending)
        keys, values, decay, grads, raw, exact, carried = memory
        return state._replace(
            x=x, keys=keys, values=values, decay=decay, grads=grads, raw=raw, exact=exact, carried=carried
        )

    def read(self, state, layer):
        return self._read(state, layer)

    def write(self, state, layer, out):
        if getattr(state, "tape", None) is not None:
            state.tape.writes[layer] = (out.detach(),)  # x_{l+1} = x_l + v_l, recomputed as written here
        x = state.x + out if self.cfg.residual_write else state.x
        if not self.uses_memory:
            return state._replace(x=x)
        return self._next(state, x, self._write_memory(state, layer + self.embed_write, layer, out))

    def read_head(self, state):
        h = self._read(state, self.n_layers)
        if getattr(state, "carried", None) is not None:
            state.carried.memory.release()  # nothing reads it again in this forward pass
        return h

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
