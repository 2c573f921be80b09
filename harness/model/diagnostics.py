"""Per-layer diagnostics and the depth-mixing summary, the same for every variant (spec §7).

Input and output RMS come from a recorded forward pass, gradient norms from the layers' parameters after a
backward pass; the depth-mixing matrix is the variant's own ``mixing_matrix`` averaged over tokens.
"""

from __future__ import annotations

import torch

from harness.model.decoder import Decoder, Trace


def _rms(x: torch.Tensor) -> float:
    return float(x.double().pow(2).mean().sqrt())


@torch.no_grad()
def traced_forward(model: Decoder, idx: torch.Tensor) -> tuple[torch.Tensor, Trace]:
    """Logits and the trace of one forward pass, run eagerly even when the model is compiled: a one-off pass that
    records every layer's tensors is not worth a compile of its own graph."""
    trace = Trace()
    with torch.compiler.set_stance("force_eager"):
        logits = model(idx, trace=trace)
    return logits, trace


def layer_stats(model: Decoder, trace: Trace) -> list[dict]:
    """RMS of every layer's input and output in a recorded pass, with the layer's kind (attention or mlp)."""
    return [
        {"layer": l, "kind": layer.kind, "input_rms": _rms(a), "output_rms": _rms(v)}
        for l, (layer, a, v) in enumerate(zip(model.layers, trace.inputs, trace.outputs))
    ]


@torch.no_grad()
def mixing_summary(model: Decoder, idx: torch.Tensor) -> dict:
    """The depth-mixing matrix on a batch, averaged over tokens: per group and over groups (JSON-ready).

    ``matrix`` is the mean weight; ``matrix_abs`` the mean of its magnitude per token and group. They differ where a
    weight's sign changes from token to token, as a memory read's ``k_iᵀ q`` does: there the mean can be near zero
    while every token reads the source with weight of order one, and only ``matrix_abs`` shows how much it is read.
    """
    _, trace = traced_forward(model, idx)
    c = model.mixer.mixing_matrix(trace).double()  # (b, t, L+1, L+1, G)
    per_group = c.mean(dim=(0, 1))  # (L+1, L+1, G)
    return {
        "readers": [f"layer {l}" for l in range(model.n_layers)] + ["head"],
        "sources": ["embedding"] + [f"v{i}" for i in range(model.n_layers)],
        "groups": int(per_group.shape[-1]),
        "matrix": per_group.mean(-1).tolist(),
        "matrix_abs": c.abs().mean(dim=(0, 1, 4)).tolist(),
        "per_group": per_group.permute(2, 0, 1).tolist(),
    }
