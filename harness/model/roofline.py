"""A roofline per depth mixer: the FLOPs and the bytes of depth state a training step moves per token, and the time
below which no implementation on a given card can go.

A step has two parts. The trunk (PreLN's projections, attention, MLPs and head) is compute-bound on these cards:
its FLOPs per token are ``harness.model.costs.preln_flops_per_token`` forward, three times that with backward, and its
own memory traffic (weights, activations inside a layer) is taken as hidden under that compute. The depth mixing is
memory-bound: its FLOPs are the mixer's ``extra_flops_per_token()``, its bytes the depth state it reads and writes.
The floor of each part is ``max(FLOPs / peak, bytes / bandwidth)`` and a step's floor is the sum of the two parts'.

Depth traffic, forward, in floats per token (``d`` the width, ``L`` the sublayers, readers ``r = 0..L`` where ``L``
is the head's read; every write and read of a ``d``-wide vector counts ``d``):

- ``preln``: each sublayer's residual addition reads ``x`` and the output and writes ``x``: ``3dL``.
- ``ldm``, ``ldm-rls`` (dual form): reader ``r`` reads every earlier write, key and value, ``n_r = r + e`` of them
  (``e = 1`` when the embedding is written first, ``read=memory``), and writes its ``d``-wide input (reading ``x``
  too when the read adds the residual): ``Σ_r n_r·(G·d_k + d) = (G·d_k + d)·(L(L+1)/2 + e(L+1))`` for the writes,
  i.e. ``Σ_l l·(d_k + d_v)`` per group; each write stores its key (``G·d_k``), and the residual addition is PreLN's
  ``3dL`` when ``residual_write=on``. The RLS write whitens against every earlier whitened write, key and value,
  once more ``Σ_j j·(G·d_k + d)``, and stores its whitened pair.
- ``attnres``: reader ``r`` reads the embedding and all ``r`` earlier outputs and writes its input:
  ``Σ_r (r + 2)·d``; each output is stored once (``L·d``).
- ``attnres-block`` (block size ``S``): reader ``r`` reads the embedding, the ``⌊r/S⌋`` completed block sums and the
  partial one when ``r mod S ≠ 0``, and writes its input; each write adds into the partial sum (``2d`` opening a
  block, ``3d`` after).
- ``hc``, ``mhc`` (``n`` streams): a sublayer reads the ``n·d`` stream to form its input (``d``), then reads the stream
  and its output and writes the stream: ``(3n + 2)·d`` per sublayer, and ``(n + 1)·d`` for the head.
- ``denseformer``: PreLN's ``3dL``, and after block ``i`` (``i = 0..⌈L/2⌉-1``) a weighted average that reads the
  ``i + 2`` block outputs so far and writes the new stream and the stored block output: ``Σ_i (i + 4)·d``.

Backward moves more: a residual addition's gradient is one more addition (2x the forward in all), a weighted read's
backward reads each source again for its weight's gradient and accumulates the source's gradient (3x in all). The
trunk's and the mixers' FLOPs triple. The dtype sets the bytes per float of the depth state (``float32``, as most
variants keep it under bf16 autocast; ``bf16``, as LDM keeps its keys and values there, and AttnRes the sublayers'
outputs, all of its sources but the embedding); the peak is always the
card's dense bf16 tensor-core peak, which the trunk runs at under autocast.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UsageError


@dataclass(frozen=True)
class Card:
    name: str
    peak_tflops: float
    """Dense (not sparse) bf16 tensor-core peak, TFLOP/s."""
    bandwidth_tbs: float
    """HBM bandwidth, TB/s."""


# From the vendor datasheets: NVIDIA A100 Tensor Core GPU datasheet (2021: bf16 312 TFLOP/s dense; HBM2 1,555 GB/s on
# the 40GB, HBM2e 2,039 GB/s on the 80GB SXM), NVIDIA H100 Tensor Core GPU datasheet (SXM: bf16 1,979 TFLOP/s with
# sparsity, so 989 dense; 3.35 TB/s), NVIDIA H200 Tensor Core GPU datasheet (SXM: the H100's 989 dense; 4.8 TB/s).
CARDS = {
    c.name: c
    for c in (
        Card("A100 40GB", 312.0, 1.555),
        Card("A100 80GB", 312.0, 2.039),
        Card("H100 SXM", 989.0, 3.35),
        Card("H200", 989.0, 4.8),
    )
}

BYTES_PER_FLOAT = {"float32": 4, "bf16": 2}


def card_named(name: str) -> Card | None:
    """The card of the table that a table name or a CUDA device name (``NVIDIA A100-SXM4-80GB``,
    ``NVIDIA H100 80GB HBM3``) names; None for a card not in the table (the H100 PCIe and NVL differ from the SXM)."""
    text = name.upper()
    for card in CARDS.values():
        if text == card.name.upper():
            return card
    if "H200" in text:
        return CARDS["H200"]
    if "H100" in text and "PCIE" not in text and "NVL" not in text:
        return CARDS["H100 SXM"]
    if "A100" in text:
        return CARDS["A100 80GB" if "80G" in text else "A100 40GB"]
    return None


def card_or_refuse(name: str) -> Card:
    card = card_named(name)
    if card is None:
        raise UsageError(f"Unknown card {name!r}; known cards: {', '.join(CARDS)}.")
    return card


def _ldm_reads(mixer) -> tuple[int, int]:
    """(residual floats, weighted floats) of LDM and LDM-RLS's dual form, forward, per token."""
    cfg, d, L = mixer.cfg, mixer.d_model, mixer.n_layers
    if not mixer.uses_memory:  # read=residual: PreLN
        return 3 * d * L, 0
    e = int(mixer.embed_write)
    pair = mixer.G * mixer.dk + d  # a write's key and value
    per_reader_out = 2 * d if cfg.read == "residual+memory" else d
    # Reader r holds n = r + e writes, reads them all and writes its input (reading x too when it adds it).
    weighted = sum(n * pair + (per_reader_out if n else 0) for n in range(e, L + 1 + e))
    writes = L + e
    weighted += writes * (pair if mixer.rls else mixer.G * mixer.dk)  # the stored key (RLS: the whitened pair)
    if mixer.rls:  # the whitening of write j against the j earlier ones
        weighted += sum(j * pair for j in range(writes))
    return (3 * d * L if cfg.residual_write else 0), weighted


def depth_floats(family: str, mixer) -> tuple[int, int]:
    """(residual-addition floats, weighted-read floats) of depth state moved per token in a forward pass, by the
    formulas of this module's docstring; ``family`` is the registered name (``ldm-rls``), ``mixer`` the built mixer,
    read only through its public attributes."""
    d, L = mixer.d_model, mixer.n_layers
    if family == "preln":
        return 3 * d * L, 0
    if family in ("ldm", "ldm-rls"):
        return _ldm_reads(mixer)
    if family == "attnres":
        return 0, d * ((L + 1) * (L + 2) // 2 + (L + 1)) + d * L
    if family == "attnres-block":
        S = mixer.block_size
        reads = sum((1 + r // S + (1 if r % S else 0) + 1) * d for r in range(L + 1))
        return sum(2 * d if l % S == 0 else 3 * d for l in range(L)), reads
    if family in ("hc", "mhc"):
        n = mixer.n
        return 0, (3 * n + 2) * d * L + (n + 1) * d
    if family == "denseformer":
        return 3 * d * L, sum((i + 4) * d for i in range((L + 1) // 2))
    raise UsageError(f"No roofline for variant family {family!r}; known: {', '.join(FAMILIES)}.")


FAMILIES = ("preln", "ldm", "ldm-rls", "attnres", "attnres-block", "hc", "mhc", "denseformer")


@dataclass(frozen=True)
class Costs:
    """FLOPs and bytes per token of one variant's step, forward and forward with backward, split into the trunk
    (compute only) and the depth mixing."""

    trunk_flops: int
    mixer_flops: int
    residual_floats: int
    weighted_floats: int
    bytes_per_float: int

    def flops(self, backward: bool) -> int:
        return (3 if backward else 1) * (self.trunk_flops + self.mixer_flops)

    def bytes(self, backward: bool) -> int:
        floats = (2 if backward else 1) * self.residual_floats + (3 if backward else 1) * self.weighted_floats
        return floats * self.bytes_per_float

    def floor_s(self, card: Card, backward: bool = True) -> float:
        """Seconds per token below which no implementation goes on ``card``: the trunk at peak, plus the larger of
        the mixing's FLOPs at peak and its bytes at full bandwidth."""
        k = 3 if backward else 1
        peak, bandwidth = card.peak_tflops * 1e12, card.bandwidth_tbs * 1e12
        return k * self.trunk_flops / peak + max(k * self.mixer_flops / peak, self.bytes(backward) / bandwidth)


def variant_costs(spec, model, seq_len: int | None = None, dtype: str = "float32") -> Costs:
    """The roofline costs of variant ``spec`` on decoder ``model`` (a ``ModelConfig``) at context ``seq_len``."""
    import torch

    import variants
    from harness.model.costs import matched_width_cost, mixer_flops_per_token, preln_flops_per_token

    if dtype not in BYTES_PER_FLOAT:
        raise UsageError(f"Unknown dtype {dtype!r} for the roofline; allowed: {', '.join(BYTES_PER_FLOAT)}.")
    parsed = variants.spec(spec)
    with torch.device("meta"):  # shapes only, no storage
        mixer = variants.build(parsed, d_model=model.d_model, n_layers=model.n_layers)
    residual, weighted = depth_floats(parsed.name, mixer)
    extra = mixer_flops_per_token(mixer)
    trunk = preln_flops_per_token(model, seq_len) + matched_width_cost(model, mixer)[1]
    return Costs(trunk, extra, residual, weighted, BYTES_PER_FLOAT[dtype])


def resized(preset: str, depth: int | None = None, width: int | None = None):
    """The preset's ``ModelConfig`` at ``depth`` sublayers (``n_blocks = depth / 2``) and ``width``, its MLP keeping
    the preset's ratio; the preset's own where not given."""
    from harness.config import PRESETS, model_preset

    base = model_preset(preset)
    if depth is not None and (depth < 2 or depth % 2):
        raise UsageError(f"The depth must be an even number of sublayers of at least 2, got {depth}.")
    d = width or base.d_model
    return model_preset(
        preset,
        n_blocks=(depth or base.n_layers) // 2,
        d_model=d,
        ffn_hidden=max(1, round(PRESETS[preset]["ffn_hidden"] * d / PRESETS[preset]["d_model"])),
    )


def floor_column(card: Card) -> str:
    return f"floor_x_preln_{card.name.replace(' ', '_')}"


def roofline_table(model, specs=None, seq_len: int | None = None, dtype: str = "float32"):
    """One row per variant (every registered one unless ``specs`` names some): FLOPs and bytes per token, forward
    and forward with backward, and per card of ``CARDS`` the training step's floor as a multiple of PreLN's."""
    import pandas as pd

    import variants

    base = variant_costs("preln", model, seq_len, dtype)
    rows, unmodelled = [], []
    for spec in specs if specs is not None else variants.names():
        if variants.spec(spec).name not in FAMILIES:
            # A mixer added since this module's formulas: the cost table still lists it, the roofline says it has none.
            unmodelled.append(str(variants.canonical(spec)))
            continue
        c = variant_costs(spec, model, seq_len, dtype)
        row = {"variant": str(variants.canonical(spec))}
        for label, backward in (("fwd", False), ("step", True)):
            row[f"flops_{label}"] = c.flops(backward)
            row[f"bytes_{label}"] = c.bytes(backward)
        row.update({floor_column(card): c.floor_s(card) / base.floor_s(card) for card in CARDS.values()})
        rows.append(row)
    table = pd.DataFrame(rows)
    table.attrs.update(
        n_layers=model.n_layers,
        d_model=model.d_model,
        seq_len=seq_len or model.max_seq_len,
        dtype=dtype,
        preln_floor_ns={card.name: base.floor_s(card) * 1e9 for card in CARDS.values()},
        unmodelled=unmodelled,
    )
    return table


def describe_roofline(table) -> str:
    """The roofline table for a reader: counts with SI prefixes, floors as multiples of PreLN's."""
    import pandas as pd

    from harness import units

    rows = []
    for r in table.to_dict(orient="records"):
        row = {"variant": r["variant"]}
        for label in ("fwd", "step"):
            row[f"FLOPs/token {label}"] = units.si(r[f"flops_{label}"])
            row[f"bytes/token {label}"] = units.si(r[f"bytes_{label}"])
        row.update({card.name: f"{r[floor_column(card)]:.2f}x" for card in CARDS.values()})
        rows.append(row)
    a = table.attrs
    preln = ", ".join(f"{name} {ns:.4g} ns" for name, ns in a["preln_floor_ns"].items())
    head = (
        f"roofline at L = {a['n_layers']} sublayers, d = {a['d_model']}, T = {a['seq_len']}, depth state in "
        f"{a['dtype']} (step = forward + backward; floor of a step as a multiple of PreLN's, whose floor per token "
        f"is {preln})"
    )
    width = max((len(r["variant"]) for r in rows), default=0)
    text = pd.DataFrame(rows).to_string(index=False, formatters={"variant": f"{{:<{width}}}".format})
    if a.get("unmodelled"):
        text += (
            f"\nno roofline for {', '.join(a['unmodelled'])}: its depth traffic has no formula in "
            "harness/model/roofline.py (depth_floats)"
        )
    return head + "\n" + text
