"""A depthmem decoder as a transformers model, loaded by
``AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)``.

``depthmem export RUN --hf OUT`` copies this file into OUT beside ``config.json`` (whose ``auto_map`` names its
two classes) and the weights. The model is the project's own ``Decoder`` with the run's depth mixer, so loading
it needs the depthmem package importable (``pip install`` the project); the logits are exactly the run's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput


class DepthmemConfig(PretrainedConfig):
    """The run's ``model`` section and variant, as stored in ``config.json``."""

    model_type = "depthmem"

    def __init__(self, depthmem_model: dict[str, Any] | None = None, variant: str = "preln", **kwargs):
        self.depthmem_model = dict(depthmem_model or {})
        self.variant = variant
        m = self.depthmem_model
        # The names lm-eval and generation read.
        kwargs.setdefault("vocab_size", m.get("vocab_size"))
        kwargs.setdefault("hidden_size", m.get("d_model"))
        kwargs.setdefault("num_hidden_layers", m.get("n_blocks"))
        kwargs.setdefault("num_attention_heads", m.get("n_heads"))
        kwargs.setdefault("max_position_embeddings", m.get("max_seq_len"))
        kwargs.setdefault("tie_word_embeddings", m.get("tie_embeddings", True))
        super().__init__(**kwargs)


class DepthmemForCausalLM(PreTrainedModel, GenerationMixin):
    """Logits of the depthmem decoder; ``labels`` give the mean next-token cross-entropy as ``loss``."""

    config_class = DepthmemConfig
    base_model_prefix = "decoder"
    _tied_weights_keys = {"decoder.lm_head.weight": "decoder.embed.weight"}
    _supports_sdpa = True

    def __init__(self, config: DepthmemConfig):
        super().__init__(config)
        # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
        import variants
        from harness.config import ModelConfig
        from harness.model.decoder import Decoder

        model_cfg = ModelConfig(**config.depthmem_model)
        mixer = variants.build(config.variant, d_model=model_cfg.d_model, n_layers=model_cfg.n_layers)
        self.decoder = Decoder(model_cfg, mixer)
        self.post_init()

    def _init_weights(self, module):
        # The weights come from the checkpoint. The rotary tables are buffers it does not hold, and loading builds
        # the model without running its constructors' fills, so they are made again here.
        if hasattr(module, "reset_rope"):
            module.reset_rope()

    def get_input_embeddings(self):
        return self.decoder.embed

    def get_output_embeddings(self):
        return self.decoder.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutput:
        # Causal attention needs no mask for right padding, the only padding lm-eval's scoring uses.
        logits = self.decoder(input_ids)  # (b, t, vocab)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return {"input_ids": input_ids}  # no cache: every step recomputes the whole prefix
