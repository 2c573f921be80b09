"""A small name -> class registry with composable, validated names.

A registered class carries a nested ``Config`` dataclass whose fields are its knobs. Names compose as
``ldm-rls(groups=4,lambda=1.0,omega=off)``: the registry parses the knobs, converts them to the field types,
builds the config (whose ``__post_init__`` validates it) and turns every mistake into one sentence that names
the allowed values.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from variants.errors import UsageError, did_you_mean

T = TypeVar("T")

_SPEC = re.compile(r"^\s*([A-Za-z0-9_.-]+)\s*(?:\((.*)\))?\s*$", re.S)


def knob(
    default: Any,
    help: str,
    *,
    choices: tuple | None = None,
    name: str | None = None,
    parse: Callable[[str], Any] | None = None,
    allowed: str | None = None,
):
    """A config field that is exposed as a knob of a registered name.

    ``name`` overrides the knob's public name (``lambda`` for the field ``lambda_``); ``parse`` turns the text
    of a knob into its value; ``allowed`` describes the allowed values in words when ``choices`` does not.
    """
    meta = {"help": help, "choices": choices, "name": name, "parse": parse, "allowed": allowed}
    return field(default=default, metadata=meta)


def knob_fields(config_cls) -> dict[str, dataclasses.Field]:
    """Public knob name -> dataclass field, in declaration order."""
    return {(f.metadata.get("name") or f.name): f for f in dataclasses.fields(config_cls)}


def _allowed_text(f: dataclasses.Field) -> str:
    meta = f.metadata
    if meta.get("choices"):
        return ", ".join(str(c) for c in meta["choices"])
    if meta.get("allowed"):
        return meta["allowed"]
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(_field_type(f), "a value")


def _field_type(f: dataclasses.Field):
    t = f.type
    if isinstance(t, str):  # from __future__ annotations
        t = {"int": int, "float": float, "str": str, "bool": bool}.get(t, t)
    return t


def _convert(f: dataclasses.Field, text: str) -> Any:
    if f.metadata.get("parse") is not None:
        return f.metadata["parse"](text)
    t = _field_type(f)
    if t is bool:
        low = text.lower()
        if low in ("true", "on", "yes", "1"):
            return True
        if low in ("false", "off", "no", "0"):
            return False
        raise ValueError(text)
    if t is int:
        return int(text)
    if t is float:
        return float(text)
    return text


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _top_level(body: str) -> list[str]:
    """``body`` split at the commas outside parentheses, so a knob's value may itself be a name with knobs."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(body):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    return parts + [body[start:]]


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split ``name(k=v,k=v)`` into the name and the knob texts."""
    m = _SPEC.match(spec or "")
    if not m:
        raise UsageError(f"Cannot read the name {spec!r}: write it as name or name(knob=value,...).")
    name, body = m.group(1), m.group(2)
    knobs: dict[str, str] = {}
    if body and body.strip():
        for part in _top_level(body):
            if "=" not in part:
                raise UsageError(f"Cannot read {part.strip()!r} in {spec!r}: write each knob as knob=value.")
            k, v = (s.strip() for s in part.split("=", 1))
            if k in knobs:
                raise UsageError(f"The knob {k!r} is given twice in {spec!r}.")
            knobs[k] = v
    return name, knobs


@dataclass
class Entry:
    name: str
    cls: type
    defaults: dict[str, Any]
    description: str


class Registry(Generic[T]):
    """Registered classes by name, with composable knob syntax and helpful errors."""

    def __init__(self, kind: str, base: type | None = None):
        self.kind = kind
        self.base = base
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, *, defaults: dict[str, Any] | None = None, description: str | None = None):
        """Class decorator; ``defaults`` overrides config defaults, so one class can serve two names."""

        def deco(cls):
            self.add(name, cls, defaults=defaults, description=description)
            return cls

        return deco

    def add(
        self, name: str, cls: type, *, defaults: dict[str, Any] | None = None, description: str | None = None
    ) -> None:
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        if self.base is not None and not issubclass(cls, self.base):
            raise TypeError(f"{cls.__name__} must subclass {self.base.__name__}")
        missing = sorted(getattr(cls, "__abstractmethods__", ()))
        if missing:
            raise TypeError(
                f"{cls.__name__} cannot be registered as {name!r}: it does not implement {', '.join(missing)}"
            )
        defaults = dict(defaults or {})
        unknown = set(defaults) - {f.name for f in dataclasses.fields(cls.Config)}
        if unknown:
            raise ValueError(f"defaults for {name!r} name unknown fields {sorted(unknown)}")
        doc = description or (cls.__doc__ or "").strip().splitlines()[0] if (description or cls.__doc__) else ""
        self._entries[name] = Entry(name, cls, defaults, doc)

    def names(self) -> list[str]:
        return list(self._entries)

    def order_by(self, key: Callable[[Entry], Any]) -> None:
        """Put the entries in the order of ``key`` (ties keep their order), whatever order they registered in."""
        self._entries = dict(sorted(self._entries.items(), key=lambda item: key(item[1])))

    def entry(self, name: str) -> Entry:
        if name not in self._entries:
            raise UsageError(
                f"Unknown {self.kind} {name!r}.{did_you_mean(name, self._entries)} Known: {', '.join(self._entries)}."
            )
        return self._entries[name]

    def config(self, spec: str):
        """Parse ``name(knob=value,...)`` into ``(entry, config)``, validating every knob."""
        name, texts = parse_spec(spec)
        entry = self.entry(name)
        fields = knob_fields(entry.cls.Config)
        values = dict(entry.defaults)
        for key, text in texts.items():
            if key not in fields:
                raise UsageError(
                    f"{self.kind} {name!r} has no knob {key!r}.{did_you_mean(key, fields)} "
                    f"Its knobs: {', '.join(fields) or 'none'}."
                )
            f = fields[key]
            try:
                values[f.name] = _convert(f, text)
            except ValueError:
                raise UsageError(
                    f"Bad value {text!r} for knob {key!r} of {name!r}: allowed values are {_allowed_text(f)}."
                ) from None
        try:
            cfg = entry.cls.Config(**values)
        except ValueError as e:
            raise UsageError(f"Bad knobs for {self.kind} {name!r}: {str(e).rstrip('.')}.") from None
        return entry, cfg

    def canonical(self, spec: str) -> str:
        """The spec with knobs in declaration order, defaults omitted: a stable name for tables and run ids.

        A knob is omitted when it has the listed default and leaving it out gives the same config. A default that
        follows another knob (a config may fill it in its ``__post_init__``) is therefore written out wherever it
        differs from the listed one, so the name says what runs and reports see every knob's value."""
        entry, cfg = self.config(spec)
        base = entry.cls.Config(**entry.defaults)
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        parts = []
        for key, f in knob_fields(entry.cls.Config).items():
            value = getattr(cfg, f.name)
            try:
                implied = entry.cls.Config(**{**values, f.name: entry.defaults.get(f.name, f.default)}) == cfg
            except ValueError:  # the other knobs need this one as given
                implied = False
            if value != getattr(base, f.name) or not implied:
                parts.append(f"{key}={format_value(value)}")
        return f"{entry.name}({','.join(parts)})" if parts else entry.name

    def describe(self) -> list[dict[str, Any]]:
        """Every entry with its knobs, allowed values, defaults and help, for listings and ``--json``."""
        out = []
        for entry in self._entries.values():
            base = entry.cls.Config(**entry.defaults)
            knobs = []
            for key, f in knob_fields(entry.cls.Config).items():
                knobs.append(
                    {
                        "knob": key,
                        "default": format_value(getattr(base, f.name)),
                        "allowed": _allowed_text(f),
                        "help": f.metadata.get("help", ""),
                    }
                )
            out.append({"name": entry.name, "description": entry.description, "knobs": knobs})
        return out
