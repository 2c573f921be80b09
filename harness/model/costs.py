"""The cost model (spec §7): what each depth mixer adds over PreLN at a model size, before anything is trained.

For every registered variant (default knobs, or the given specs) one row: the parameters it adds over PreLN,
the floats of depth state it carries per token, and the forward FLOPs per token it spends on depth mixing, each
also relative to PreLN's own totals. Only the mixers are built, on the meta device, so even the largest preset
costs no memory. PreLN's forward FLOPs per token count every matrix multiply at 2 FLOPs per multiply-add:
the projections, the MLP and the head, plus the attention scores and weighted sum over the full context
(``4·T·d`` per attention layer, as the math kernel computes them); norms and activations are not counted.
A mixer with more than one implementation counts the one it runs by default (LDM: ``variants/ops/ldm_costs.py``).
"""

from __future__ import annotations

import pandas as pd
import torch

from harness.config import ModelConfig, model_preset
from harness.model.decoder import preln_params
from harness.model.factory import matched_ffn_hidden

COLUMNS = [
    "variant",
    "params_added",
    "params_added_frac",
    "stream_floats_per_token",
    "extra_flops_per_token",
    "extra_flops_frac",
    "sizes",
]


def preln_flops_per_token(model: ModelConfig, seq_len: int | None = None) -> int:
    """Forward FLOPs per token of the PreLN decoder at context ``seq_len`` (default: the model's maximum)."""
    d, f, V = model.d_model, model.ffn_hidden, model.vocab_size
    T = seq_len or model.max_seq_len
    matmuls = model.n_blocks * (4 * d * d + 3 * d * f) + d * V
    return 2 * matmuls + model.n_blocks * 4 * T * d


def mixer_flops_per_token(mixer) -> int:
    """The mixer's forward FLOPs per token over PreLN (``extra_flops_per_token``); 0 without a cost model."""
    try:
        return int(mixer.extra_flops_per_token())
    except NotImplementedError:
        return 0


def matched_width_cost(model: ModelConfig, mixer) -> tuple[int, int]:
    """Parameters and forward FLOPs per token that a parameter-matched model (``preln(match=...)``) adds over PreLN
    by widening its MLPs: ``3 d`` parameters and ``6 d`` FLOPs per extra hidden unit and block; (0, 0) otherwise."""
    target = mixer.params_to_match()
    if not target:
        return 0, 0

    units = (matched_ffn_hidden(model, target, mixer.extra_params()) - model.ffn_hidden) * model.n_blocks
    return 3 * model.d_model * units, 6 * model.d_model * units


def cost_table(preset: str, specs: list[str] | None = None) -> pd.DataFrame:
    """One row per variant (every registered one, default knobs, unless ``specs`` names some) at ``preset``."""
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    import variants

    model = model_preset(preset)
    base_params = preln_params(model)
    base_flops = preln_flops_per_token(model)
    rows = []
    for spec in specs if specs is not None else variants.names():
        # Parameters on the meta device have shapes but no storage: counting them allocates nothing.
        with torch.device("meta"):
            mixer = variants.build(spec, d_model=model.d_model, n_layers=model.n_layers)
        widened_params, widened_flops = matched_width_cost(model, mixer)
        params = mixer.extra_params() + widened_params
        flops = mixer.extra_flops_per_token() + widened_flops
        rows.append(
            {
                "variant": variants.canonical(spec),
                "params_added": params,
                "params_added_frac": params / base_params,
                "stream_floats_per_token": mixer.stream_floats_per_token(),
                "extra_flops_per_token": flops,
                "extra_flops_frac": flops / base_flops,
                "sizes": mixer.sizes(),
            }
        )
    table = pd.DataFrame(rows, columns=COLUMNS)
    table.attrs.update(preset=preset, preln_params=base_params, preln_flops_per_token=base_flops)
    return table
