"""YAML as researchers write it: ``1e-3`` is a number.

PyYAML follows YAML 1.1, where a float needs a dot (``1.0e-3``) and ``1e-3`` is read as the text ``"1e-3"``; a
grid axis of such values would hold text, sort as text and show as text in every table. This loader reads floats
as YAML 1.2 (and OmegaConf's command-line overrides) do; everything else is PyYAML's safe loader.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from harness.errors import UsageError

FLOAT = "tag:yaml.org,2002:float"


class DuplicateKey(yaml.YAMLError):
    """A mapping names one key twice; PyYAML would keep the last value without a word."""

    def __init__(self, key: Any, first: int, again: int):
        self.key, self.first, self.again = key, first, again
        super().__init__(f"the key {key!r} appears twice (lines {first} and {again})")


class NumberLoader(yaml.SafeLoader):
    def construct_mapping(self, node, deep=False):
        # Only the keys written in this mapping count: a merge (``<<: *base``) may set a key the mapping overrides.
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:
                continue  # an unhashable key: the base constructor says so in its own words
        return super().construct_mapping(node, deep=deep)


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


__all__ = ["DuplicateKey", "NumberLoader", "load"]


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """The parsed YAML of ``path``; a missing file or malformed YAML is a one-sentence ``UsageError`` (with line)."""
    path = Path(path)
    if not path.exists():
        raise UsageError(f"The {what} {str(path)!r} does not exist.")
    if path.is_dir():
        raise UsageError(f"The {what} {str(path)!r} is a folder; give the path of a YAML or JSON file.")
    try:
        raw = path.read_bytes()
    except PermissionError:
        raise UsageError(f"The {what} {str(path)!r} cannot be read: permission denied.") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UsageError(
            f"The {what} {str(path)!r} is not UTF-8 text (byte {raw[e.start]:#04x} at line {line}); save it as UTF-8."
        ) from None
    try:
        return load(text)
    except DuplicateKey as e:
        lines = f"lines {e.first} and {e.again}" if e.first != e.again else f"line {e.again}"
        raise UsageError(
            f"The key {e.key!r} appears twice in the {what} {path} ({lines}); keep one, "
            "since only the last would count."
        ) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"Malformed YAML in {path}{where}: {getattr(e, 'problem', None) or e}.") from None
