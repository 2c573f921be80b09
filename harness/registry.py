"""The registry of named classes with composable, validated names; it lives in ``variants.registry``, beside the
mixers it registers, and is importable from here as well."""

from variants.registry import Entry, Registry, format_value, knob, knob_fields, parse_spec

__all__ = ["Entry", "Registry", "format_value", "knob", "knob_fields", "parse_spec"]
