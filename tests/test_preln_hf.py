"""PreLN with the shared decoder equals Hugging Face's LlamaForCausalLM given the same weights.

transformers' LlamaRMSNorm computes in float32 even inside a float64 model; for a float64 reference the test
patches it to compute at the input's precision (at least float32), which is what our RMSNorm does. RoPE needs no
patch: both compute cos/sin in float32 and cast them to the model dtype.
"""

from __future__ import annotations

import pytest
import torch

from harness import build_model, model_preset

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402


def _rmsnorm_at_input_precision(self, hidden_states):
    dt = torch.promote_types(hidden_states.dtype, torch.float32)
    h = hidden_states.to(dt)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(hidden_states.dtype)


def _hf_twin(model, monkeypatch):
    cfg = model.cfg
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", _rmsnorm_at_input_precision)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden,
        num_hidden_layers=cfg.n_blocks,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",
    )
    hf = transformers.LlamaForCausalLM(hf_cfg).to(torch.float64).eval()
    sd = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.final_norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i in range(cfg.n_blocks):
        att, mlp = model.layers[2 * i], model.layers[2 * i + 1]
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = att.norm.weight
        sd[p + "post_attention_layernorm.weight"] = mlp.norm.weight
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = getattr(att.fn, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{n}.weight"] = getattr(mlp.fn, n).weight
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf


@pytest.mark.parametrize("tie", [True, False])
def test_preln_equals_hf_llama_in_float64(tie, rng_seed, monkeypatch):
    cfg = model_preset("tiny", n_blocks=3, tie_embeddings=tie)
    model = build_model(cfg, "preln").to(torch.float64).eval()
    with torch.no_grad():  # random norm gains too, so a swapped norm would show
        for layer in model.layers:
            layer.norm.weight.uniform_(0.5, 1.5)
        model.final_norm.weight.uniform_(0.5, 1.5)
    hf = _hf_twin(model, monkeypatch)
    idx = torch.randint(0, cfg.vocab_size, (3, 40))
    with torch.no_grad():
        ours = model(idx)
        ref = hf(idx).logits
    rel = (ours - ref).norm() / ref.norm()
    assert rel < 1e-10, f"relative difference {rel:.3e}"
