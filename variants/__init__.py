"""The registry of depth mixers. Every variant module is imported here, by name and in one order, so
registration is deterministic; adding a variant means adding its file and one line below.

The mixers sit at the top of the package; the math they share is in ``variants.ops`` and the fused GPU kernels,
each beside its plain reference, in ``variants.kernels``. Nothing here imports ``harness``. The mixer modules
(and torch) load on the first call that needs them, so ``harness.errors``, which takes its base classes from
``variants.errors``, stays cheap to import.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from variants.registry import Entry, parse_spec

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


# A run's variant is parsed once, into a ``VariantSpec``: a ``str`` holding the canonical name (knobs in declaration
# order, defaults dropped), so it compares, hashes, prints and serialises as the name does, carrying what parsing
# gave (the registry entry and the mixer's typed knob config). Pickling keeps the name and parses it again on the
# other side (a SLURM job's process), where the registry is the same code.


class VariantSpec(str):
    """The canonical variant name, with what parsing it gave: ``entry``, ``config`` and ``knobs``."""

    entry: Entry
    config: Any
    """The mixer's typed ``Config`` dataclass, validated by its ``__post_init__``; shared, never to be changed."""
    knobs: dict[str, str]
    """The knobs the canonical name writes out (those that differ from the defaults), as text."""

    @property
    def name(self) -> str:
        """The registered base name (``ldm-rls``)."""
        return self.entry.name

    def __reduce__(self):
        return (spec, (str(self),))


@lru_cache(maxsize=4096)
def _parse(text: str) -> VariantSpec:
    registry = _registry()
    entry, config = registry.config(text)
    out = VariantSpec(registry.canonical(text))
    out.entry, out.config, out.knobs = entry, config, parse_spec(out)[1]
    return out


def spec(text: str | VariantSpec) -> VariantSpec:
    """``text`` parsed against the variant registry (a ``UsageError`` naming the allowed values if it is not a
    valid variant); a ``VariantSpec`` is returned as it is. Parses are remembered, so a grid of many runs of a few
    variants parses each once."""
    if isinstance(text, VariantSpec):
        return text
    return _parse(str(text))


def canonical(name: str | VariantSpec) -> VariantSpec:
    """The stable form of a variant name: knobs in order, defaults dropped (the parsed ``spec``, which is it)."""
    return spec(name)


def validate(name: str | VariantSpec, *, d_model: int | None = None, n_layers: int | None = None) -> VariantSpec:
    """The parsed variant; a ``UsageError`` naming the allowed values when ``name`` is not a valid variant (for a
    model of this width and depth, when they are given)."""
    parsed = spec(name)
    if d_model is not None and n_layers is not None:
        _validate_size(parsed, d_model, n_layers)
    return parsed


@lru_cache(maxsize=4096)
def _validate_size(parsed: VariantSpec, d_model: int, n_layers: int) -> None:
    import torch

    with torch.device("meta"):  # shapes only: validating a 78-run grid allocates and initializes nothing
        build(parsed, d_model=d_model, n_layers=n_layers)


def build(name: str | VariantSpec, *, d_model: int, n_layers: int) -> DepthMixer:
    """The mixer named by ``name`` (e.g. ``ldm-rls(groups=4)``, or its parsed ``spec``) for a model of this width
    and depth."""
    from variants.errors import UsageError
    from variants.ops import ldm_knobs

    parsed = spec(name)
    try:
        mixer = parsed.entry.cls(parsed.config, d_model=d_model, n_layers=n_layers)
        ldm_knobs.refuse_narrow_keys(mixer, d_model)
        return mixer
    except ValueError as e:
        # Knobs that only fail against a size (groups not dividing the width) are checked here.
        raise UsageError(
            f"Bad knobs for variant {str(name)!r} at width {d_model} and {n_layers} layers: {str(e).rstrip('.')}."
        ) from None


__all__ = [
    "DepthMixer",
    "REGISTRY",
    "VariantSpec",
    "register",
    "names",
    "describe",
    "spec",
    "canonical",
    "validate",
    "build",
]
