"""The registry of depth mixers. Every variant module is imported here, by name and in one order, so
registration is deterministic; adding a variant means adding its file and one line below.

The mixers sit at the top of the package; the math they share is in ``variants.ops`` and the fused GPU kernels,
each beside its plain reference, in ``variants.kernels``. Nothing here imports ``harness``. The mixer modules
(and torch) load on the first call that needs them, so ``harness.errors``, which takes its base classes from
``variants.errors``, stays cheap to import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from variants.base import DepthMixer

# Registration order is this order, whichever module was imported first: the order of every listing, table and
# colour.
MODULES = ("preln", "ldm", "ldm_rls", "attnres", "attnres_block", "hc", "mhc", "denseformer")


_loaded = False


def _registry():
    global _loaded
    from variants.base import REGISTRY

    if not _loaded:
        for module in MODULES:
            importlib.import_module(f"variants.{module}")
        REGISTRY.order_by(lambda entry: _rank(entry.cls.__module__))
        _loaded = True
    return REGISTRY


def _rank(module: str) -> int:
    name = module.rpartition(".")[2]
    return MODULES.index(name) if module.startswith("variants.") and name in MODULES else len(MODULES)


def __getattr__(name: str):
    if name == "REGISTRY":
        return _registry()
    if name in ("DepthMixer", "register"):
        return getattr(importlib.import_module("variants.base"), name)
    raise AttributeError(f"module 'variants' has no attribute {name!r}")


def names() -> list[str]:
    return _registry().names()


def describe() -> list[dict]:
    return _registry().describe()


def canonical(spec: str) -> str:
    """The stable form of a variant name: knobs in order, defaults dropped."""
    return _registry().canonical(spec)


def validate(spec: str, *, d_model: int | None = None, n_layers: int | None = None) -> None:
    """Raise a ``UsageError`` naming the allowed values when ``spec`` is not a valid variant (for this size)."""
    if d_model is None or n_layers is None:
        _registry().config(spec)
    else:
        import torch

        with torch.device("meta"):  # shapes only: validating a 78-run grid allocates and initializes nothing
            build(spec, d_model=d_model, n_layers=n_layers)


def build(spec: str, *, d_model: int, n_layers: int) -> DepthMixer:
    """The mixer named by ``spec`` (e.g. ``ldm-rls(groups=4)``) for a model of this width and depth."""
    from variants.errors import UsageError
    from variants.ops import ldm_knobs

    entry, cfg = _registry().config(spec)
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
