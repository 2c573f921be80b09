"""A grid's declared claims: the comparisons its verdicts rest on, grouped into the families Holm corrects over.

``report.primary`` is a list of comparisons; ``report.secondary`` maps a family name to such a list. A comparison
is ``{variant: V, against: R}``, or ``{variants: [V1, V2], against: R}`` for several rows against one reference.
``R`` is a variant name, or one of the words ``matched`` (``preln(match=V)``, V's parameter-matched PreLN),
``base`` (V's registry variant at its defaults: ``ldm-rls`` for ``ldm-rls(groups=4)``) and ``baseline`` (the
report's baseline). Holm's procedure runs within each family; a Δ outside every family gets its interval and no
adjusted p. This module only parses and checks (it loads the variant registry, and so torch, but not pandas), so the
grid loader can refuse a bad declaration before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from harness.errors import UsageError, did_you_mean

PRIMARY = "primary"
REFERENCE_WORDS = ("matched", "base", "baseline")
ENTRY_KEYS = ("variant", "variants", "against")
SHAPE = (
    "a list of comparisons such as {variant: ldm-rls, against: preln} or {variants: [ldm, ldm-rls], against: matched}"
)


@dataclass(frozen=True)
class Claim:
    """One declared comparison: ``variant − against`` in final validation loss, tested within ``family``."""

    family: str
    variant: str
    against: str


def _canonical(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise UsageError(f"{where} must name a variant, got {name!r}.")
    import variants  # here, not at the top, so the CLI starts without loading the registry

    try:
        return str(variants.spec(name))
    except UsageError as e:
        raise UsageError(f"{where}: {e}") from None


def matched_preln(variant: str) -> str:
    """The canonical name of ``variant``'s parameter-matched PreLN, ``preln(match=<variant>)``."""
    import variants

    return str(variants.spec(f"preln(match={variant})"))


def reference_of(variant: str, against: str, baseline: str) -> str:
    """The canonical reference a comparison of ``variant`` names with ``against`` (a variant or a reference word)."""
    import variants

    if against == "matched":
        return matched_preln(variant)
    if against == "base":
        return variants.spec(variant).name
    if against == "baseline":
        return str(variants.spec(baseline))
    return str(variants.spec(against))


def _entry(entry: Any, family: str, where: str, baseline: str) -> list[Claim]:
    if not isinstance(entry, dict):
        raise UsageError(f"{where} must be {SHAPE}; {entry!r} is not a mapping.")
    for key in entry:
        if key not in ENTRY_KEYS:
            raise UsageError(
                f"Unknown key {key!r} in a comparison of {where}.{did_you_mean(str(key), ENTRY_KEYS)} "
                f"Allowed keys: {', '.join(ENTRY_KEYS)}."
            )
    if ("variant" in entry) == ("variants" in entry) or "against" not in entry:
        raise UsageError(f"Each comparison of {where} needs 'against' and one of 'variant' or 'variants': {SHAPE}.")
    names = [entry["variant"]] if "variant" in entry else entry["variants"]
    if not isinstance(names, list) or not names:
        raise UsageError(f"'variants' in {where} must be a non-empty list of variant names, got {names!r}.")
    against = entry["against"]
    if not isinstance(against, str) or not against:
        raise UsageError(f"'against' in {where} must be a variant name or one of {', '.join(REFERENCE_WORDS)}.")
    claims = []
    for name in names:
        variant = _canonical(name, f"A variant of {where}")
        if against not in REFERENCE_WORDS:
            _canonical(against, f"'against' in {where}")
        reference = reference_of(variant, against, baseline)
        if reference == variant:
            raise UsageError(f"{where} compares {variant} with itself; give another variant as 'against'.")
        claims.append(Claim(family, variant, reference))
    return claims


def _family(value: Any, family: str, where: str, baseline: str) -> list[Claim]:
    if not isinstance(value, list) or not value:
        raise UsageError(f"{where} must be {SHAPE}.")
    claims = [c for entry in value for c in _entry(entry, family, where, baseline)]
    seen = set()
    for c in claims:
        if (c.variant, c.against) in seen:
            raise UsageError(f"{where} names {c.variant} against {c.against} twice; each comparison is tested once.")
        seen.add((c.variant, c.against))
    return claims


def parse_claims(section: Any, source: str) -> list[Claim] | None:
    """Every declared comparison of a ``report:`` mapping, primary family first; None when it declares none."""
    if not isinstance(section, dict) or ("primary" not in section and "secondary" not in section):
        return None
    baseline = section.get("baseline") or "preln"
    claims = []
    if section.get("primary") is not None:
        claims += _family(section["primary"], PRIMARY, f"report.primary in {source}", baseline)
    secondary = section.get("secondary")
    if secondary is not None:
        if not isinstance(secondary, dict) or not secondary:
            raise UsageError(
                f"report.secondary in {source} must map each family's name to {SHAPE}, "
                "e.g. {ldm-rls ablations: [{variants: [ldm-rls(omega=off)], against: base}]}."
            )
        for name, value in secondary.items():
            if not isinstance(name, str) or not name or name == PRIMARY:
                raise UsageError(f"A family name in report.secondary of {source} must be a word other than primary.")
            claims += _family(value, name, f"report.secondary.{name} in {source}", baseline)
    where: dict[tuple[str, str], str] = {}
    for c in claims:
        other = where.setdefault((c.variant, c.against), c.family)
        if other != c.family:
            raise UsageError(
                f"{c.variant} against {c.against} is declared in the families {other} and {c.family} of {source}; "
                "a comparison belongs to one family."
            )
    return claims


def check_claims_run(claims: list[Claim] | None, ran: list[str], source: str) -> None:
    """Refuse a claim about a variant the grid does not run (``ran``: the grid's variants, canonical)."""
    for c in claims or []:
        for name in (c.variant, c.against):
            if name not in ran:
                raise UsageError(
                    f"The family {c.family} of {source} compares {c.variant} with {c.against}, but the grid does "
                    f"not run {name}; allowed: {', '.join(ran)}."
                )


def families(claims: list[Claim]) -> dict[str, list[Claim]]:
    """Claims by family, the primary family first, the others in the order they were declared."""
    out: dict[str, list[Claim]] = {}
    for c in claims:
        out.setdefault(c.family, []).append(c)
    return out
