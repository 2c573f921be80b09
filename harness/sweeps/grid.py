"""Ablation grids: a YAML file of a base config and axes, expanded into validated, uniquely named runs.

A grid file holds ``base`` (any ``RunConfig`` keys, nested or dotted), ``axes`` (dotted key -> list of values,
crossed as a product), ``zip`` (groups of keys whose lists vary together, each group one more axis of the
product), ``exclude`` (partial assignments whose matching combinations are dropped; a list of values under a key
matches any one of them, so one entry can keep the extra seeds of the headline rows from a whole ablation list)
and ``include`` (extra runs, each a set of overrides on the base). Optional ``name`` (default: the file's stem),
``profile`` (the default resource profile), ``parallelism`` (most runs at once) and ``tune`` (a learning-rate
tuning stage run before the grid: ``{axis: train.lr, values: [...], select_on: tune_split}``, optionally
``seeds``, ``metric`` and ``variants``; see ``harness.sweeps.tuning``). Every run is built as
``build_config`` builds it and its variant checked against its model size before anything is submitted, so a bad
grid fails as one sentence.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config import ConfigBuilder, RunConfig
from harness.errors import UsageError, did_you_mean
from harness.rundir import run_id
from harness.training import budget
from harness.yamltext import read_yaml

GRID_KEYS = (
    "name",
    "description",
    "profile",
    "parallelism",
    "base",
    "axes",
    "zip",
    "include",
    "exclude",
    "tune",
    "report",
)
TUNE_KEYS = ("axis", "values", "select_on", "metric", "seeds", "variants", "allow_shared_seeds")
TUNE_AXES = ("train.lr",)
TUNE_SELECT_ON = ("tune_split",)
TUNE_METRICS = ("val_loss",)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class GridRun:
    """One run of a grid: its id, its full config, and the grid values that distinguish it."""

    run_id: str
    cfg: RunConfig
    overrides: dict[str, Any]


@dataclass
class Tune:
    """A grid's tuning stage: the values of one key tried per cell of the grid, the best kept for its runs."""

    axis: str
    values: list[float]
    select_on: str = "tune_split"
    metric: str = "val_loss"
    seeds: list[int] | None = None
    """Seeds of the tuning runs; None means each cell's first seed in the grid."""
    variants: list[str] | None = None
    """The variants tuned; None means every one. Another variant takes its family's choice (see tuning.py)."""
    allow_shared_seeds: bool = False
    """Let ``seeds`` overlap the grid's evaluation seeds (refused otherwise: a rate chosen on a seed is then judged
    on the same seed)."""


@dataclass
class Grid:
    """A parsed grid file, not yet expanded."""

    name: str
    source: str
    base: dict[str, Any] = field(default_factory=dict)
    axes: dict[str, list] = field(default_factory=dict)
    zips: list[dict[str, list]] = field(default_factory=list)
    include: list[dict[str, Any]] = field(default_factory=list)
    exclude: list[dict[str, Any]] = field(default_factory=list)
    profile: str | None = None
    parallelism: int | None = None
    description: str = ""
    baseline: str = "preln"
    """The variant a per-parameter token budget is counted against (the grid's ``report.baseline``)."""
    tune: Tune | None = None


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Turn ``{"train.lr": 1e-3}`` (or already nested dicts, or a mix) into nested dicts for ``build_config``."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = str(key).split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UsageError(f"The key {key!r} sets a field inside {part!r}, which already has a plain value.")
        if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]] = {**node[parts[-1]], **nest(value)}
        elif isinstance(value, dict):
            node[parts[-1]] = nest(value)
        else:
            node[parts[-1]] = value
    return out


def _mapping(value: Any, what: str, source: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UsageError(f"{what} in {source} must be a mapping of config keys to values, not {type(value).__name__}.")
    return value


def _axis_lists(mapping: dict, what: str, source: str) -> dict[str, list]:
    out = {}
    for key, values in mapping.items():
        if not isinstance(values, list) or not values:
            raise UsageError(f"The {what} {key!r} in {source} must be a non-empty list of values.")
        out[str(key)] = values
    return out


def parse_grid(data: dict[str, Any], *, source: str = "grid", default_name: str = "grid") -> Grid:
    """A ``Grid`` from the mapping of a grid file, checking its shape (not yet its configs)."""
    if not isinstance(data, dict):
        raise UsageError(f"The grid file {source} must hold a mapping with base and axes, not {type(data).__name__}.")
    for key in data:
        if key not in GRID_KEYS:
            raise UsageError(
                f"Unknown key {key!r} in the grid file {source}.{did_you_mean(str(key), GRID_KEYS)} "
                f"Allowed keys: {', '.join(GRID_KEYS)}."
            )
    name = str(data.get("name") or default_name)
    if not _NAME.match(name):
        raise UsageError(f"The grid name {name!r} in {source} may only use letters, digits, '.', '_' and '-'.")
    zips = []
    raw_zips = data.get("zip") or []
    if isinstance(raw_zips, dict):  # a single group may be written without the list around it
        raw_zips = [raw_zips]
    if not isinstance(raw_zips, list):
        raise UsageError(f"zip in {source} must be a list of groups, each a mapping of keys to equal-length lists.")
    for group in raw_zips:
        lists = _axis_lists(_mapping(group, "A zip group", source), "zipped key", source)
        lengths = {k: len(v) for k, v in lists.items()}
        if len(set(lengths.values())) > 1:
            raise UsageError(
                f"The zipped keys in {source} must have lists of one length; got "
                + ", ".join(f"{k} ({n})" for k, n in lengths.items())
                + "."
            )
        zips.append(lists)
    for what in ("include", "exclude"):
        entries = data.get(what) or []
        if not isinstance(entries, list) or not all(isinstance(e, dict) and e for e in entries):
            raise UsageError(f"{what} in {source} must be a list of non-empty mappings of config keys to values.")
    parallelism = data.get("parallelism")
    if parallelism is not None and (not isinstance(parallelism, int) or parallelism < 1):
        raise UsageError(f"parallelism in {source} must be a positive integer, got {parallelism!r}.")
    axes = _axis_lists(_mapping(data.get("axes"), "axes", source), "axis", source)
    taken = list(axes) + [k for g in zips for k in g]
    twice = sorted({k for k in taken if taken.count(k) > 1})
    if twice:
        raise UsageError(f"The key {twice[0]!r} is varied twice in {source}: keep it in one axis or zip group.")
    values = {**axes, **{k: v for g in zips for k, v in g.items()}}
    for entry in data.get("exclude") or []:
        stray = [str(k) for k in entry if str(k) not in taken]
        if stray:
            raise UsageError(
                f"exclude in {source} names {stray[0]!r}, which no axis or zip group varies; "
                f"exclude entries may use: {', '.join(taken) or 'no keys (there are no axes)'}."
            )
        for key, wanted in entry.items():
            # A value no run has would exclude nothing: most likely a misspelt name, so it is refused.
            for value in _alternatives(wanted, values[str(key)]):
                if not any(same_value(value, v) for v in values[str(key)]):
                    raise UsageError(
                        f"exclude in {source} gives {key}={value!r}, which is not one of its values; "
                        f"allowed: {', '.join(str(v) for v in values[str(key)])}."
                    )
    tune = parse_tune(data.get("tune"), source)
    grid = Grid(
        name=name,
        source=source,
        base=_mapping(data.get("base"), "base", source),
        axes=axes,
        zips=zips,
        include=list(data.get("include") or []),
        exclude=list(data.get("exclude") or []),
        profile=data.get("profile"),
        parallelism=parallelism,
        description=str(data.get("description") or ""),
        baseline=_baseline(data.get("report"), source),
        tune=tune,
    )
    check_tune(grid)
    check_tune_seeds(grid)
    check_claims(grid, data.get("report"))
    return grid


def _listed(value: Any, what: str, source: str, kind: type | tuple[type, ...], allowed: str) -> list:
    if not isinstance(value, list) or not value:
        raise UsageError(f"tune.{what} in {source} must be a non-empty list of {allowed}, got {value!r}.")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, kind):
            raise UsageError(f"tune.{what} in {source} must hold only {allowed}; {v!r} is not one.")
    if len({repr(v) for v in value}) != len(value):
        raise UsageError(f"tune.{what} in {source} names a value twice; each value is tried once.")
    return list(value)


def _one_of(value: Any, what: str, allowed: tuple[str, ...], source: str) -> str:
    if value not in allowed:
        raise UsageError(f"tune.{what} in {source} is {value!r}; allowed: {', '.join(allowed)}.")
    return value


def parse_tune(data: Any, source: str) -> Tune | None:
    """The grid's ``tune`` mapping, checked: one sentence naming the allowed values for anything wrong."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise UsageError(
            f"tune in {source} must be a mapping such as {{axis: train.lr, values: [1e-3, 2e-3], "
            f"select_on: tune_split}}, not {type(data).__name__}."
        )
    for key in data:
        if key not in TUNE_KEYS:
            raise UsageError(
                f"Unknown key {key!r} under tune in {source}.{did_you_mean(str(key), TUNE_KEYS)} "
                f"Allowed keys: {', '.join(TUNE_KEYS)}."
            )
    for key in ("axis", "values", "select_on"):
        if key not in data:
            raise UsageError(f"tune in {source} needs {key!r} (it has {', '.join(map(str, data)) or 'no keys'}).")
    axis = _one_of(data["axis"], "axis", TUNE_AXES, source)
    values = _listed(_numbers(data["values"]), "values", source, (int, float), "positive numbers")
    if any(not 0 < v < float("inf") for v in values):
        raise UsageError(f"tune.values in {source} must be positive finite numbers, got {values!r}.")
    if len(values) < 2:
        raise UsageError(f"tune.values in {source} has one value; tuning chooses among at least two.")
    seeds = data.get("seeds")
    if seeds is not None:
        seeds = _listed(seeds, "seeds", source, int, "integer seeds")
    variants = data.get("variants")
    if variants is not None:
        variants = [str(v) for v in _listed(variants, "variants", source, str, "variant names")]
    shared = data.get("allow_shared_seeds", False)
    if not isinstance(shared, bool):
        raise UsageError(f"tune.allow_shared_seeds in {source} must be true or false, got {shared!r}.")
    return Tune(
        allow_shared_seeds=shared,
        axis=axis,
        values=sorted(values),
        select_on=_one_of(data["select_on"], "select_on", TUNE_SELECT_ON, source),
        metric=_one_of(data.get("metric", "val_loss"), "metric", TUNE_METRICS, source),
        seeds=seeds,
        variants=variants,
    )


def _numbers(values: Any) -> Any:
    # YAML reads 1e-3 (no dot) as text; a value that reads as a number is one.
    if not isinstance(values, list):
        return values
    out = []
    for v in values:
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        out.append(v)
    return out


def check_tune(grid: Grid) -> None:
    """Refuse a tuned key that the grid also varies, and a tuned variant the grid does not run."""
    if grid.tune is None:
        return
    key = grid.tune.axis
    varied = list(grid.axes) + [k for g in grid.zips for k in g] + [str(k) for e in grid.include for k in e]
    if key in varied:
        raise UsageError(
            f"{key} is tuned in {grid.source} and also varied by an axis, zip group or include; each "
            "variant's value comes from the tuning stage, so drop it from one of them."
        )
    if grid.tune.variants:
        ran = grid_variants(grid)
        for v in grid.tune.variants:
            if not any(same_value(v, r) for r in ran):
                raise UsageError(
                    f"tune.variants in {grid.source} names {v!r}, which the grid does not run; "
                    f"allowed: {', '.join(ran) or 'the variants of the grid'}."
                )


def evaluation_seeds(grid: Grid) -> set[int]:
    """The seeds the grid's own runs train with (an axis, zip group or include, else the base's)."""
    base_seed = nest(grid.base).get("train", {}).get("seed", RunConfig().train.seed)
    return {int(c.get("train.seed", base_seed)) for c in combinations(grid)}


def check_tune_seeds(grid: Grid) -> None:
    """Refuse tuning seeds that are also evaluation seeds, unless ``tune.allow_shared_seeds`` says so."""
    if grid.tune is None or grid.tune.seeds is None or grid.tune.allow_shared_seeds:
        return
    shared = sorted(set(grid.tune.seeds) & evaluation_seeds(grid))
    if shared:
        raise UsageError(
            f"tune.seeds in {grid.source} shares the seed(s) {', '.join(map(str, shared))} with the grid's "
            "evaluation runs; give tuning seeds of their own (e.g. [100, 101]) or set tune.allow_shared_seeds: true."
        )


def grid_variants(grid: Grid) -> list[str]:
    """Every variant the grid runs, canonical, in file order."""
    import variants

    names = [str(v) for v in grid.axes.get("variant", [])] + [str(v) for g in grid.zips for v in g.get("variant", [])]
    names += [str(e["variant"]) for e in grid.include if "variant" in e]
    names = names or [str(grid.base.get("variant", "preln"))]
    ran = []
    for name in names:
        try:
            ran.append(str(variants.spec(name)))
        except UsageError:
            continue  # expanding the grid names a bad variant with the run it belongs to
    return list(dict.fromkeys(ran))


def check_claims(grid: Grid, report: Any) -> None:
    """Parse the report's declared families (``report.primary``, ``report.secondary``) and refuse a claim about a
    variant the grid does not run."""
    from harness.reporting import claims

    declared = claims.parse_claims(report, grid.source)
    if declared is not None:
        claims.check_claims_run(declared, grid_variants(grid), grid.source)


def _baseline(report: Any, source: str) -> str:
    """The report's baseline variant, which every run's token budget is counted against."""
    baseline = report.get("baseline") if isinstance(report, dict) else None
    if baseline is None:
        return "preln"
    if not isinstance(baseline, str):
        raise UsageError(f"report.baseline in {source} must be a variant name, got {baseline!r}.")
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    import variants

    variants.validate(baseline)
    return baseline


def load_grid(path: str | Path) -> Grid:
    """Read and check a grid file (``experiments/*.yaml``)."""
    path = Path(path)
    return parse_grid(read_yaml(path, "grid file"), source=str(path), default_name=path.stem)


def grid_name(path: str | Path) -> str:
    """The sweep name of a grid file, read without checking its runs: what ``status`` and ``cancel`` need, without
    loading the variants (and torch) that checking a report baseline takes."""
    path = Path(path)
    data = read_yaml(path, "grid file")
    if not isinstance(data, dict) or not isinstance(data.get("report"), dict) and "tune" not in data:
        return load_grid(path).name
    # Checking the report's baseline or the tuned variants would load the variants; the name needs neither.
    shape = {k: v for k, v in data.items() if k not in ("report", "tune")}
    return parse_grid(shape, source=str(path), default_name=path.stem).name


def combinations(grid: Grid) -> list[dict[str, Any]]:
    """The grid's override sets, in order: the product of axes and zip groups, less excludes, plus includes."""
    factors: list[list[dict[str, Any]]] = [[{key: v} for v in values] for key, values in grid.axes.items()]
    for group in grid.zips:
        keys = list(group)
        factors.append([dict(zip(keys, row)) for row in zip(*group.values())])
    combos = [dict(kv for part in parts for kv in part.items()) for parts in itertools.product(*factors)]
    if not grid.axes and not grid.zips and not grid.include:
        combos = [{}]  # a grid of just a base is one run
    elif not grid.axes and not grid.zips:
        combos = []
    values = {**grid.axes, **{k: v for g in grid.zips for k, v in g.items()}}
    combos = [c for c in combos if not any(_matches(c, ex, values) for ex in grid.exclude)]
    return combos + [dict(inc) for inc in grid.include]


def _alternatives(wanted: Any, axis_values: list) -> list:
    """The values an exclude entry's ``wanted`` stands for: itself, or each element of a list that is not itself
    one of the axis's values (an axis may vary a list-valued key such as ``eval.tasks``)."""
    if isinstance(wanted, list) and not any(wanted == v for v in axis_values):
        return wanted
    return [wanted]


def _matches(combo: dict[str, Any], partial: dict[str, Any], axis_values: dict[str, list] | None = None) -> bool:
    return all(
        str(k) in combo
        and any(same_value(combo[str(k)], x) for x in _alternatives(v, (axis_values or {}).get(str(k), [])))
        for k, v in partial.items()
    )


def same_value(a: Any, b: Any) -> bool:
    if a == b:
        return True
    try:  # ``ldm-rls(groups=4)`` and ``ldm-rls(groups=4, lambda=learned)`` name one variant
        import variants

        return variants.canonical(str(a)) == variants.canonical(str(b))
    except Exception:
        return False


def axis_keys(grid: Grid) -> list[str]:
    """The keys the grid varies, in file order: axes, zip groups, then keys that only includes set."""
    keys = list(grid.axes) + [k for g in grid.zips for k in g]
    for inc in grid.include:
        keys += [str(k) for k in inc if str(k) not in keys]
    return keys


def describe_overrides(overrides: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in overrides.items()) or "the base config"


def expand(grid: Grid, *, defaults: dict[str, Any] | None = None) -> list[GridRun]:
    """Every run of the grid as a validated ``RunConfig`` with its stable id.

    ``defaults`` is a config layer under the grid's base (a resource profile's ``slurm`` and device settings).
    """
    builder = ConfigBuilder(nest(defaults or {}), nest(grid.base), source=grid.source)
    counted: dict = {}  # the baseline's parameter count per model size, built once
    runs: list[GridRun] = []
    seen: dict[str, dict[str, Any]] = {}
    for overrides in combinations(grid):
        where = f"{grid.source} (run {describe_overrides(overrides)})"
        # Building the config parses its variant and checks it against the model's size.
        cfg = builder.build(nest(overrides), {"name": grid.name}, source=where)
        # One budget for every run of a model size: tokens per parameter of the baseline, not of each variant.
        cfg = budget.resolve(cfg, grid.baseline, cache=counted)
        rid = run_id(cfg, overrides)
        if rid in seen:
            raise UsageError(
                f"Two runs of {grid.source} collide as {rid!r}: {describe_overrides(seen[rid])} and "
                f"{describe_overrides(overrides)} give the same config; drop one or vary another key."
            )
        seen[rid] = overrides
        runs.append(GridRun(rid, cfg, dict(overrides)))
    if not runs:
        raise UsageError(
            f"The grid {grid.source} expands to no runs: give axes or include entries, "
            f"and check that exclude does not remove every combination."
        )
    return runs
