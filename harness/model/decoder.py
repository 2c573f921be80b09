"""The shared Llama-style decoder: token embedding, RoPE causal attention, SwiGLU MLP, RMSNorm and LM head.

Depth mixing is delegated entirely to a ``DepthMixer`` (spec §1): the decoder only asks it for each layer's
input (``read``), hands it each layer's output (``write``) and asks for the head's input (``read_head``). It names
no variant. Every attention and every MLP is one layer, so ``n_blocks`` blocks make ``L = 2 * n_blocks`` layers.

Axes: b batch, t time, d model width, h heads, e head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.config import ModelConfig
from variants.ops.layers import RMSNorm


def preln_params(model: ModelConfig) -> int:
    """Parameters of the PreLN decoder of this size, counted from the config."""
    d, f, V = model.d_model, model.ffn_hidden, model.vocab_size
    per_block = 4 * d * d + 3 * d * f + 2 * d  # attention, SwiGLU, the two pre-norm gains
    head = 0 if model.tie_embeddings else V * d
    return V * d + model.n_blocks * per_block + d + head


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None):
    """cos and sin of shape (t, e), computed in float32 as Llama does, whatever the model dtype."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    pos = torch.arange(seq_len, device=device).float()
    freqs = pos[:, None] * inv_freq[None, :]  # (t, e/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (t, e)
    return emb.cos(), emb.sin()


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary positions and no biases."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.head_dim = d // cfg.n_heads
        self.theta = cfg.rope_theta
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        # Buffers made once for the longest context, so they follow the model's device and a compiled forward
        # sees no attribute appear on its first call (which would compile the whole graph a second time). Not in
        # the state dict: they are a function of the config.
        self.register_buffer("rope_cos", torch.empty(cfg.max_seq_len, self.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(cfg.max_seq_len, self.head_dim), persistent=False)
        self.reset_rope()

    @torch.no_grad()
    def reset_rope(self) -> None:
        """Fill the rotary tables (again: a loader that materializes the model from the meta device needs it)."""
        if self.rope_cos.is_meta:
            return
        cos, sin = rope_tables(self.head_dim, self.rope_cos.shape[0], self.theta, device=self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def _tables(self, t: int, x: torch.Tensor):
        if t <= self.rope_cos.shape[0]:
            cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        else:  # longer than the model was built for: only an evaluation can ask this
            cos, sin = rope_tables(self.head_dim, t, self.theta, device=x.device)
        return cos.to(x.dtype), sin.to(x.dtype)

    def forward(self, x):
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, t, e)
        k = self.k_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        cos, sin = self._tables(t, x)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, t, e)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One depth-mixing layer: its own pre-norm, then attention or MLP (``v_l = F_l(Norm_l(a_l))``)."""

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.fn = Attention(cfg) if kind == "attention" else SwiGLU(cfg)

    def forward(self, a):
        return self.fn(self.norm(a))


@dataclass
class Trace:
    """What one forward pass recorded: the embedding, every layer's input and output, the head's input, and
    whatever the mixer chose to record (queries, keys, mixing weights) under ``mixer``."""

    embed: torch.Tensor | None = None
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    head_input: torch.Tensor | None = None
    mixer: dict = field(default_factory=dict)


class Decoder(nn.Module):
    """Embedding, ``L`` layers whose inputs and outputs flow through a depth mixer, final norm and head."""

    def __init__(self, cfg: ModelConfig, mixer: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        kinds = ["attention", "mlp"] * cfg.n_blocks
        self.layers = nn.ModuleList(Layer(cfg, k) for k in kinds)
        self.mixer = mixer
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Activation checkpointing (train.activation_checkpointing): a layer's inner activations are recomputed in
        # the backward pass. Only the layer is recomputed: the mixer's reads and writes, which may carry state of
        # their own (a guard's precision, a trace), run once, and their state is kept.
        self.checkpoint_layers = False
        self._init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    def _init_weights(self):
        # GPT-2 style: N(0, init_std), output projections scaled down by depth. The mixer initializes itself.
        std = self.cfg.init_std
        nn.init.normal_(self.embed.weight, std=std)
        nn.init.normal_(self.lm_head.weight, std=std)
        for layer in self.layers:
            for name, p in layer.fn.named_parameters():
                scale = 1.0 / math.sqrt(2 * self.n_layers) if name.startswith(("o_proj", "down_proj")) else 1.0
                nn.init.normal_(p, std=std * scale)

    def forward(self, idx: torch.Tensor, trace: Trace | None = None) -> torch.Tensor:
        """Logits of shape (b, t, vocab) for token ids of shape (b, t); fills ``trace`` when one is given."""
        e = self.embed(idx)  # (b, t, d)
        self.mixer.trace = None if trace is None else trace.mixer
        state = self.mixer.init_state(e)
        for l, layer in enumerate(self.layers):
            a = self.mixer.read(state, l)
            # Mixers may keep their streams in float32 under bf16 weights; layers compute in the model's dtype.
            if self.checkpoint_layers and torch.is_grad_enabled():
                v = checkpoint(layer, a.to(e.dtype), use_reentrant=False)
            else:
                v = layer(a.to(e.dtype))
            state = self.mixer.write(state, l, v)
            if trace is not None:
                trace.inputs.append(a.detach())
                trace.outputs.append(v.detach())
        h = self.mixer.read_head(state)
        del state  # what the mixer kept for its reads alone need not live on under the logits
        self.mixer.trace = None
        if trace is not None:
            trace.embed = e.detach()
            trace.head_input = h.detach()
        return self.lm_head(self.final_norm(h.to(e.dtype)))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
