"""The registry of depth mixers. Every variant module is imported here, by name, so registration is
deterministic; adding a variant means adding its file and one line below."""

from __future__ import annotations

import importlib

import torch

from harness.errors import UsageError
from variants import ldm_knobs
from variants.base import REGISTRY, DepthMixer, register

# Importing a module registers its variants, in this order: the order of every listing, table and colour.
MODULES = ("preln", "ldm", "ldm_rls", "attnres", "attnres_block", "hc", "mhc", "denseformer")
for _module in MODULES:
    importlib.import_module(f"variants.{_module}")


def names() -> list[str]:
    return REGISTRY.names()


def describe() -> list[dict]:
    return REGISTRY.describe()


def canonical(spec: str) -> str:
    """The stable form of a variant name: knobs in order, defaults dropped."""
    return REGISTRY.canonical(spec)


def validate(spec: str, *, d_model: int | None = None, n_layers: int | None = None) -> None:
    """Raise a ``UsageError`` naming the allowed values when ``spec`` is not a valid variant (for this size)."""
    if d_model is None or n_layers is None:
        REGISTRY.config(spec)
    else:
        with torch.device("meta"):  # shapes only: validating a 78-run grid allocates and initializes nothing
            build(spec, d_model=d_model, n_layers=n_layers)


def build(spec: str, *, d_model: int, n_layers: int) -> DepthMixer:
    """The mixer named by ``spec`` (e.g. ``ldm-rls(groups=4)``) for a model of this width and depth."""
    entry, cfg = REGISTRY.config(spec)
    try:
        mixer = entry.cls(cfg, d_model=d_model, n_layers=n_layers)
        ldm_knobs.refuse_narrow_keys(mixer, d_model)
        return mixer
    except ValueError as e:
        # Knobs that only fail against a size (groups not dividing the width) are checked here.
        raise UsageError(
            f"Bad knobs for variant {spec!r} at width {d_model} and {n_layers} layers: {str(e).rstrip('.')}."
        ) from None


__all__ = ["DepthMixer", "REGISTRY", "register", "names", "describe", "canonical", "validate", "build"]
