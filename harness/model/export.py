"""Export a trained run as a Hugging Face model folder that transformers (and lm-eval's ``--model hf``) load.

PreLN is a Llama: its weights map one to one onto ``LlamaForCausalLM`` (pre-norm RMSNorm, RoPE attention without
biases, SwiGLU MLP, optionally tied head), so the folder is a plain Llama checkpoint. Every other variant mixes
depth in a way Llama cannot express; its folder holds the depthmem decoder as a model with remote code
(``harness/model/hf_remote.py``), loaded with ``trust_remote_code=True`` where the depthmem package is installed.
Both folders carry the run's tokenizer (``tokenizer.json`` with ``<|endoftext|>`` as BOS, EOS and padding).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import torch

from harness.data.tokenizer import EOT
from harness.errors import UsageError
from harness.io import honour_umask, writable_dir
from harness.model.checkpoint import load_model


def llama_state_dict(model) -> dict[str, torch.Tensor]:
    """The PreLN decoder's weights under ``LlamaForCausalLM``'s names."""
    sd = {
        "model.embed_tokens.weight": model.embed.weight,
        "model.norm.weight": model.final_norm.weight,
        "lm_head.weight": model.lm_head.weight,
    }
    for i in range(model.cfg.n_blocks):
        att, mlp = model.layers[2 * i], model.layers[2 * i + 1]
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = att.norm.weight
        sd[p + "post_attention_layernorm.weight"] = mlp.norm.weight
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[p + f"self_attn.{n}.weight"] = getattr(att.fn, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[p + f"mlp.{n}.weight"] = getattr(mlp.fn, n).weight
    return {k: v.detach().clone().contiguous() for k, v in sd.items()}


def llama_config(cfg):
    import transformers

    return transformers.LlamaConfig(
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
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        torch_dtype="float32",
    )


def _save_tokenizer(tok, out: Path, max_len: int) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok._tok, bos_token=EOT, eos_token=EOT, pad_token=EOT, unk_token=EOT, model_max_length=max_len
    )
    hf.save_pretrained(str(out))


@contextlib.contextmanager
def _no_progress_bar():
    """transformers draws a bar while it writes even one small file: a flash in a terminal, a stray line in a log."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _stamps(folder: Path) -> dict[Path, tuple[int, int]]:
    return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file()}


def export_hf(run: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write the run's model and tokenizer to ``out`` as a transformers folder; returns ``out``."""
    try:
        import transformers
    except ImportError:
        raise UsageError("Exporting to Hugging Face needs transformers: pip install transformers.") from None

    model, tok, cfg = load_model(run)
    out = writable_dir(out, "export folder")
    before = _stamps(out)
    eot = tok.eot_id
    if cfg.variant == "preln":
        hf_cfg = llama_config(cfg.model)
        hf_cfg.bos_token_id = hf_cfg.eos_token_id = hf_cfg.pad_token_id = eot
        hf = transformers.LlamaForCausalLM(hf_cfg)
        missing, unexpected = hf.load_state_dict(llama_state_dict(model), strict=False)
        if unexpected or any("rotary" not in m for m in missing):
            raise RuntimeError(f"PreLN does not map onto Llama: missing {missing}, unexpected {unexpected}")
    else:
        # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
        from harness.model.hf_remote import DepthmemConfig, DepthmemForCausalLM

        DepthmemConfig.register_for_auto_class()
        DepthmemForCausalLM.register_for_auto_class("AutoModelForCausalLM")
        hf_cfg = DepthmemConfig(
            depthmem_model=dataclasses.asdict(cfg.model),
            variant=cfg.variant,
            bos_token_id=eot,
            eos_token_id=eot,
            pad_token_id=eot,
        )
        hf = DepthmemForCausalLM(hf_cfg)
        hf.decoder.load_state_dict(model.state_dict())
    with _no_progress_bar():
        hf.eval().save_pretrained(str(out))
        _save_tokenizer(tok, out, cfg.model.max_seq_len)
    # Only what this export wrote: other files already in the folder keep the mode their owner gave them.
    honour_umask(p for p, stamp in _stamps(out).items() if before.get(p) != stamp)
    return out
