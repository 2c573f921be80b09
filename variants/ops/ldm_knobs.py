"""Which knob combinations of LDM and LDM-RLS make a model worth training, and what ``qk_source`` defaults to.

Every knob of spec §5 builds on its own, but some combinations do not give the model their names promise: with
``read=residual`` and ``residual_write=off`` no layer's output reaches the head, and with ``read=residual`` the
memory's knobs change nothing (the model is PreLN under another name). A key width of one (``key_dim=1``, or
``key_dim=0`` with ``groups`` equal to the width) makes every unit-normalised key ±1: a sign, not a direction, so
the memory cannot address what it wrote, and float32 and float64 part wherever a key's sign flips near zero.
Those are refused with one sentence that names the problem and the values that would work.

``qk_source`` says what the query and key MLPs read. ``residual``, the method's choice, is the residual stream
``x_{l-1}``. ``read`` is the latest read, the input of a layer: layer ``l``'s key comes from its own input ``a_l``
and reader ``l``'s query from ``a_{l-1}`` (a read cannot address the memory with its own result; the embedding is
the read before layer 0). With ``residual_write=off`` the residual stream stays the embedding, so queries and keys
from it would address the memory by token identity alone; the no-residual ablation therefore defaults to
``qk_source=read``, whose reads carry the context the memory has gathered.
"""

from __future__ import annotations

import math

from variants.registry import format_value

QK_SOURCES = ("residual", "read")

# Knobs that only shape the memory, with the field defaults they must keep when nothing reads the memory.
MEMORY_KNOBS = (
    ("groups", "groups", 16),
    ("key_dim", "key_dim", 0),
    ("qk_hidden", "qk_hidden", 64),
    ("qk_source", "qk_source", "residual"),
    ("lambda", "lambda_", "learned"),
    ("omega", "omega", True),
    ("alpha", "alpha", 1.0),
)


def default_qk_source(residual_write: bool) -> str:
    """``residual`` while the residual stream accumulates outputs, ``read`` when it stays the embedding."""
    return "residual" if residual_write else "read"


def _text(value) -> str:
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


MIN_KEY_DIM = 2


def refuse_degenerate(cfg) -> None:
    """Raise ``ValueError`` (one sentence, naming the allowed values) for a combination that is not the model its
    name describes."""
    if cfg.read != "residual":
        if cfg.key_dim == 1:
            raise ValueError(
                "key_dim=1 gives keys that are only a sign (a unit-normalised 1-d key is ±1), so the memory "
                f"cannot tell its writes apart; use key_dim=0 (d_model / groups) or an integer ≥ {MIN_KEY_DIM}"
            )
        return
    if not cfg.residual_write:
        raise ValueError(
            "read=residual with residual_write=off gives a model whose output ignores every layer "
            "(the residual stream stays the embedding and nothing reads the memory), so with "
            "read=residual keep residual_write=on, or use read=residual+memory or read=memory"
        )
    for key, name, default in MEMORY_KNOBS:
        value = getattr(cfg, name)
        if value != default:
            raise ValueError(
                f"with read=residual nothing reads the memory, so {key}={_text(value)} changes nothing "
                f"(the model is preln); leave {key} at {_text(default)}, or use read=residual+memory "
                f"or read=memory"
            )


def refuse_narrow_keys(mixer, d_model: int) -> None:
    """Raise ``ValueError`` when a built LDM mixer's key width ``d_model / groups`` is below ``MIN_KEY_DIM``
    (``key_dim=1`` itself is refused from the config alone, by ``refuse_degenerate``)."""
    if not getattr(mixer, "uses_memory", False) or getattr(mixer, "dk", MIN_KEY_DIM) >= MIN_KEY_DIM:
        return
    allowed = [str(g) for g in range(1, d_model + 1) if d_model % g == 0 and d_model // g >= MIN_KEY_DIM]
    raise ValueError(
        f"groups={mixer.G} at d_model={d_model} gives keys of width {mixer.dk} (d_model / groups), which are only "
        f"a sign (a unit-normalised 1-d key is ±1), so the memory cannot tell its writes apart; use groups in "
        f"{', '.join(allowed)}, or key_dim ≥ {MIN_KEY_DIM}"
    )


RLS_ONLY = {"lambda": "learned", "omega": True, "alpha": 1.0, "scalar_lr": 1.0}
"""The knobs of the RLS write alone, with the value each must keep under ``write=outer``."""


def check(cfg, reads: tuple[str, ...]) -> None:
    """Every knob of an LDM config in its allowed values, and the combinations that make a model: a
    ``ValueError`` of one sentence naming the allowed values otherwise (``reads``: the allowed ``read`` values)."""
    if cfg.write not in ("outer", "rls"):
        raise ValueError(f"write must be outer or rls, got {cfg.write!r}")
    if cfg.read not in reads:
        raise ValueError(f"read must be one of {', '.join(reads)}, got {cfg.read!r}")
    for name in ("residual_write", "omega"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name} must be on or off, got {getattr(cfg, name)!r}")
    if cfg.qk_source not in QK_SOURCES:
        raise ValueError(f"qk_source must be one of {', '.join(QK_SOURCES)}, got {cfg.qk_source!r}")
    if not isinstance(cfg.groups, int) or cfg.groups < 1:
        raise ValueError(f"groups must be a positive integer dividing d_model, got {cfg.groups!r}")
    if not isinstance(cfg.key_dim, int) or cfg.key_dim < 0:
        raise ValueError(f"key_dim must be a positive integer, or 0 for d_model / groups, got {cfg.key_dim!r}")
    if not isinstance(cfg.qk_hidden, int) or cfg.qk_hidden < 1:
        raise ValueError(f"qk_hidden must be a positive integer, got {cfg.qk_hidden!r}")
    lam = cfg.lambda_
    if lam != "learned" and not (isinstance(lam, (int, float)) and not isinstance(lam, bool) and 0.0 < lam <= 1.0):
        raise ValueError(f"lambda must be learned or a number in (0, 1], got {lam!r}")
    for key, value in (("alpha", cfg.alpha), ("scalar_lr", cfg.scalar_lr)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{key} must be a number > 0, got {value!r}")
    if cfg.write == "outer":
        values = {"lambda": lam, "omega": cfg.omega, "alpha": cfg.alpha, "scalar_lr": cfg.scalar_lr}
        for key, default in RLS_ONLY.items():
            if values[key] != default:
                raise ValueError(
                    f"{key} applies only to write=rls, so with write=outer it must stay "
                    f"{format_value(default)}, got {key}={format_value(values[key])}"
                )
    refuse_degenerate(cfg)
