"""YAML as researchers write it: ``1e-3`` is a number.

PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-3``) and ``1e-3`` is read as the text ``"1e-3"``; a
grid axis of such values would hold text, sort as text and show as text in every table. This loader reads floats
as YAML 1.2 (and OmegaConf's command-line overrides) do; everything else is PyYAML's safe loader.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

FLOAT = "tag:yaml.org,2002:float"


class NumberLoader(yaml.SafeLoader):
    pass


NumberLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != FLOAT]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
NumberLoader.add_implicit_resolver(
    FLOAT,
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load(text: str) -> Any:
    """``yaml.safe_load`` with YAML 1.2's floats."""
    return yaml.load(text, Loader=NumberLoader)  # noqa: S506 - a SafeLoader subclass


__all__ = ["NumberLoader", "load"]
