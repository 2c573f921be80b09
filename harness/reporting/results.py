"""Read a sweep's run directories into one tidy table, without retraining anything.

A sweep is a folder (``results/<sweep>/``) whose run directories are found recursively as folders holding a
``config.json``, or the same files packed into one archive (``harness.reporting.archive``). ``load_sweep`` reads
every run once (config, status, summary, metrics, layers, mixing, eval and each item's score) and tolerates runs
that are still being written: a file that is missing or cannot be parsed is skipped with a note, never an error.
``aggregate`` turns the runs into one tidy frame, one row per run × step × metric, with the canonical variant name
split into its base variant and knobs; tables and figures consume that frame and the ``Run`` records.
"""

from __future__ import annotations

import functools
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pandas as pd

from harness.config import PRESETS
from harness.errors import UsageError
from harness.io import CHECKSUM_SUFFIX, atomic_write_bytes, matches_checksum
from harness.reporting.archive import FolderSource, is_archive, open_source
from harness.reporting.axes import IGNORED_KEYS, IGNORED_PREFIXES, axis_column_names, flatten, tuned_keys
from variants.registry import format_value, parse_spec

FINISHED = "done"
METRIC_COLUMNS = ("train_loss", "val_loss", "val_bpb", "lr", "grad_norm", "tokens_per_s")


@dataclass
class Run:
    """One run directory and everything read from it (``None`` where a file is missing or unreadable)."""

    run_id: str
    rel: str
    path: Path | PurePosixPath
    """The run directory; for a sweep archive, its path inside the archive."""
    config: dict[str, Any]
    variant: str
    base: str
    knobs: dict[str, str]
    preset: str
    seed: int
    status: dict[str, Any]
    summary: dict[str, Any] | None = None
    metrics: pd.DataFrame | None = None
    layers: pd.DataFrame | None = None
    mixing: dict[str, Any] | None = None
    eval: pd.DataFrame | None = None
    items: pd.DataFrame | None = None
    """Each item's score (``eval/items.csv.gz``: task, doc_id, metric, value), for differences paired on items."""
    setting: str = ""
    knob_values: dict[str, str] = field(default_factory=dict)
    """Every knob of the run's base variant: its own value, else the registry default."""
    axes: dict[str, Any] = field(default_factory=dict)
    """The config values in which the sweep's runs differ (besides variant and seed), by column name, typed."""

    def config_value(self, key: str, default: Any = None) -> Any:
        """A config value by dotted key (``model.n_blocks``)."""
        node: Any = self.config
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    @property
    def state(self) -> str:
        return str(self.status.get("state", "pending"))

    @property
    def message(self) -> str:
        return str(self.status.get("message") or "")

    @property
    def budget(self) -> tuple[int | None, int | None]:
        """``(train_steps, train_tokens)``: from summary.json, else from a config that fixes them (None if unknown)."""
        summary = self.summary or {}
        steps, tokens = summary.get("train_steps"), summary.get("train_tokens")
        if isinstance(steps, int) and isinstance(tokens, int):
            return steps, tokens
        train, model = self.config.get("train") or {}, self.config.get("model") or {}
        try:
            per_step = int(train["batch_size"]) * int(train.get("seq_len") or model["max_seq_len"])
            steps = int(train.get("max_steps") or 0) or math.ceil(int(train.get("tokens") or 0) / per_step)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None, None
        return (steps, steps * per_step) if steps else (None, None)

    @property
    def final_loss(self) -> float | None:
        """The final validation loss of a finished run, or None when it does not count."""
        if self.state != FINISHED or not self.summary:
            return None
        value = _as_float(self.summary.get("val_loss"))
        return value if value is not None and math.isfinite(value) else None


@dataclass
class Sweep:
    """All runs of a sweep, sorted by path, and the notes on what could not be read."""

    root: Path
    runs: list[Run]
    notes: list[str] = field(default_factory=list)
    knob_names: list[str] = field(default_factory=list)
    axis_keys: dict[str, str] = field(default_factory=dict)
    """Column name -> dotted config key of every axis the sweep varies besides variant and seed."""

    def finished(self) -> list[Run]:
        """Runs that count in averages: done, with a finite final validation loss."""
        return [r for r in self.runs if r.final_loss is not None]

    def excluded(self) -> list[Run]:
        """Runs listed in the report but kept out of every average."""
        return [r for r in self.runs if r.final_loss is None]


def _as_float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class _ChecksumMismatch(Exception):
    pass


def _checked_bytes(source: FolderSource, rel: str, notes: list[str]) -> bytes:
    """The bytes of ``rel``, checked against the checksum written beside it at save time where there is one (a
    mismatch is noted, naming the file, and raises ``_ChecksumMismatch``)."""
    data = source.read_bytes(rel)
    sidecar = rel + CHECKSUM_SUFFIX
    if source.exists(sidecar):
        recorded = source.read_bytes(sidecar).decode("utf-8", errors="replace").split()
        if matches_checksum(data, recorded) is False:
            notes.append(
                f"Left out {rel}: it does not match the checksum written when it was saved "
                f"({PurePosixPath(sidecar).name}), so its bytes changed on disk after saving."
            )
            raise _ChecksumMismatch(rel)
    return data


def _read_json(source: FolderSource, rel: str, notes: list[str]) -> Any:
    try:
        return json.loads(_checked_bytes(source, rel, notes))
    except (FileNotFoundError, _ChecksumMismatch):
        return None
    except (OSError, ValueError) as e:
        notes.append(f"Skipped {rel}: it could not be read ({type(e).__name__}).")
        return None


def _read_csv(source: FolderSource, rel: str, notes: list[str], numeric: tuple[str, ...] = ()) -> pd.DataFrame | None:
    try:
        data = _checked_bytes(source, rel, notes)
        compression = "gzip" if rel.endswith(".gz") else None  # from bytes pandas cannot tell by the name
        if compression is None and data and not data.endswith(b"\n") and b"\n" in data:
            # Rows are appended whole, newline included: a last line without one was cut short (a copy or a disk
            # that stopped mid-write), and its fields would read as numbers that were never logged.
            data = data[: data.rindex(b"\n") + 1]
            notes.append(f"Dropped the last line of {rel}: it was cut short.")
        frame = pd.read_csv(io.BytesIO(data), on_bad_lines="skip", compression=compression)
    except (FileNotFoundError, _ChecksumMismatch):
        return None
    except (OSError, ValueError) as e:
        notes.append(f"Skipped {rel}: it could not be read ({type(e).__name__}).")
        return None
    for col in numeric:
        if col in frame:
            # A line cut short by a writer still appending reads as NaN instead of failing the whole file.
            frame[col] = pd.to_numeric(frame[col], errors="coerce")
    return frame


def _member(run_dir: str, name: str) -> str:
    """The path of a run directory's file relative to the sweep (``run_dir`` is ``.`` for the sweep itself)."""
    return name if run_dir == "." else f"{run_dir}/{name}"


def _registry_knobs() -> dict[str, dict[str, str]]:
    """Base variant -> its knobs and their default values, from the variant registry."""
    try:
        # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
        import variants
    except Exception:  # a variant module mid-edit must not stop a report
        return {}
    return {v["name"]: {k["knob"]: k["default"] for k in v["knobs"]} for v in variants.describe()}


def split_variant(spec: str, notes: list[str] | None = None) -> tuple[str, str, dict[str, str]]:
    """The canonical variant name, its base variant and its non-default knobs."""
    try:
        import variants

        parsed = variants.spec(spec)
        return str(parsed), parsed.name, dict(parsed.knobs)
    except Exception:
        pass  # unknown to this checkout's registry (or the registry failed to load): keep the name as written
    try:
        base, knobs = parse_spec(spec)
    except UsageError:
        if notes is not None:
            notes.append(f"The variant name {spec!r} cannot be parsed; it is shown as written.")
        return spec, spec, {}
    if notes is not None:
        notes.append(f"The variant {spec!r} is not in the variant registry; its name is shown as written.")
    canonical = f"{base}({','.join(f'{k}={v}' for k, v in knobs.items())})" if knobs else base
    return canonical, base, knobs


@functools.cache
def _config_defaults() -> dict[str, Any]:
    """The flattened default of every train, data and eval key (model keys follow the preset each run names)."""
    from harness.config import build_config

    defaults = flatten(build_config({}).to_dict())
    return {k: v for k, v in defaults.items() if k.split(".")[0] in ("train", "data", "eval")}


def _settings(runs: list[Run], tuned: set[str] = frozenset()) -> dict[str, str]:
    """Label every run with the config keys (other than variant and seed) in which the sweep's runs differ; keys a
    tuning stage chose per variant (``tuned``) are left out, so variants tuned to different values still compare."""
    flat = []
    defaults = _config_defaults()
    for run in runs:
        # A key that a run's config lacks (it was written before the key existed) holds its default there.
        f = {
            k: v
            for k, v in {**defaults, **flatten(run.config)}.items()
            if k not in IGNORED_KEYS and not k.startswith(IGNORED_PREFIXES)
        }
        flat.append(f)
    keys = sorted({k for f in flat for k in f})
    differing = [k for k in keys if len({repr(f.get(k)) for f in flat}) > 1 and k not in tuned]
    for run, f in zip(runs, flat):
        preset = PRESETS.get(str(f.get("model.preset")), {})
        parts = []
        for k in differing:
            # Sizes that follow from a differing preset would only repeat it.
            if k.startswith("model.") and k != "model.preset" and preset.get(k[6:]) == f.get(k):
                continue
            label = k[6:] if k.startswith("model.") else k
            parts.append(f"{label}={format_value(f.get(k))}")
        run.setting = ", ".join(parts)
    columns = axis_column_names(differing)
    for run in runs:
        run.axes = {name: run.config_value(key) for name, key in columns.items()}
    return columns


def load_sweep(root: str | Path) -> Sweep:
    """Read every run directory under ``root``, a sweep folder or an archive ``depthmem pack`` wrote; unreadable
    files become notes, not errors."""
    root = Path(root)
    if is_archive(root) and not root.is_file():
        raise UsageError(f"The sweep archive {str(root)!r} does not exist: give the file `depthmem pack` wrote.")
    if not (root.is_dir() or is_archive(root)):
        raise UsageError(f"The sweep folder {str(root)!r} does not exist: give a folder of run directories.")
    source = open_source(root)
    notes: list[str] = list(source.notes)
    runs: list[Run] = []
    registry = _registry_knobs()
    dirs = source.run_dirs()
    names = [PurePosixPath(d).name or source.name for d in dirs]
    for rel, name in zip(dirs, names):
        config = _read_json(source, _member(rel, "config.json"), notes)
        if not isinstance(config, dict):
            if config is None and source.exists(_member(rel, "config.json")):
                continue  # already noted as unreadable
            notes.append(f"Skipped {rel}: its config.json holds no mapping.")
            continue
        if (config.get("data") or {}).get("eval_split") == "tune":
            continue  # a tuning run validated on the tuning split: the tuning table reports it, no average does
        spec = str(config.get("variant", "preln"))
        variant, base, knobs = split_variant(spec, notes)
        status = _read_json(source, _member(rel, "status.json"), notes)
        if not isinstance(status, dict):
            status = {"state": "pending", "message": "no readable status.json"}
        summary = _read_json(source, _member(rel, "summary.json"), notes)
        mixing = _read_json(source, _member(rel, "mixing.json"), notes)
        seed = config.get("train", {}).get("seed", 0)
        runs.append(
            Run(
                # Run ids are folder names; a name that repeats elsewhere in the tree falls back to its path.
                run_id=name if names.count(name) == 1 else rel,
                rel=rel,
                path=source.path(rel),
                config=config,
                variant=variant,
                base=base,
                knobs=knobs,
                preset=str(config.get("model", {}).get("preset", "")),
                seed=int(seed) if isinstance(seed, (int, float)) else 0,
                status=status,
                summary=summary if isinstance(summary, dict) else None,
                metrics=_read_csv(source, _member(rel, "metrics.csv"), notes, ("step", "tokens", *METRIC_COLUMNS)),
                layers=_read_csv(
                    source, _member(rel, "layers.csv"), notes, ("step", "layer", "input_rms", "output_rms", "grad_norm")
                ),
                mixing=mixing if isinstance(mixing, dict) else None,
                eval=_read_csv(source, _member(rel, "eval/table.csv"), notes, ("value", "stderr")),
                items=_read_csv(source, _member(rel, "eval/items.csv.gz"), notes, ("doc_id", "value")),
            )
        )
    axis_keys = _settings(runs, tuned_keys(source))
    seen = sorted({k for r in runs for k in r.knobs})
    for run in runs:
        defaults = registry.get(run.base)
        if defaults is not None:
            run.knob_values = {**defaults, **run.knobs}
        else:
            # The registry does not know this base, so a knob another run of it sets has an unnamed default.
            run.knob_values = {
                k: run.knobs.get(k, "default") for k in seen if any(k in r.knobs for r in runs if r.base == run.base)
            }
    return Sweep(root=root, runs=runs, notes=list(dict.fromkeys(notes)), knob_names=seen, axis_keys=axis_keys)


def knobs_text(knobs: dict[str, str]) -> str:
    """A readable knob setting such as ``groups=4, lambda=1.0`` (``default`` when there is none)."""
    return ", ".join(f"{k}={v}" for k, v in knobs.items()) or "default"


def _run_column_names(sweep: Sweep) -> list[str]:
    return [
        "run_id",
        "run_dir",
        "setting",
        "variant",
        "base",
        "knobs",
        *(f"knob_{k}" for k in sweep.knob_names),
        *sweep.axis_keys,
        "preset",
        "seed",
        "state",
        "train_tokens",
        "train_steps",
    ]


def _run_columns(run: Run, sweep: Sweep) -> dict[str, Any]:
    cols: dict[str, Any] = {
        "run_id": run.run_id,
        "run_dir": run.rel,
        "setting": run.setting,
        "variant": run.variant,
        "base": run.base,
        "knobs": knobs_text(run.knobs),
    }
    for k in sweep.knob_names:
        cols[f"knob_{k}"] = run.knob_values.get(k, "")
    for name in sweep.axis_keys:
        cols[name] = run.axes.get(name)
    steps, tokens = run.budget
    cols.update(preset=run.preset, seed=run.seed, state=run.state, train_tokens=tokens, train_steps=steps)
    return cols


def _missing(v: Any) -> bool:
    return v is None or v == "" or (isinstance(v, float) and math.isnan(v))


def typed_values(values: pd.Series) -> pd.Series:
    """Integers, floats or booleans where every present value is one (texts such as ``16`` included), else text."""
    present = [v for v in values if not _missing(v)]
    if present and all(isinstance(v, bool) for v in present):
        return values.map(lambda v: None if _missing(v) else v).astype("boolean")
    try:
        if not present or any(isinstance(v, bool) for v in present):
            raise ValueError
        [float(v) for v in present]
    except (TypeError, ValueError):
        return values.map(lambda v: "" if _missing(v) else format_value(v)).astype(str)
    numbers = pd.to_numeric(values.map(lambda v: None if _missing(v) else float(v)), errors="coerce")
    whole = all(isinstance(v, int) or (isinstance(v, str) and v.strip().lstrip("+-").isdigit()) for v in present)
    return numbers.astype("Int64" if whole else "float64")


def typed_columns(frame: pd.DataFrame, sweep: Sweep) -> pd.DataFrame:
    """The knob and axis columns of ``frame`` as numbers or booleans where their values allow it."""
    frame = frame.copy()
    for col in [*(f"knob_{k}" for k in sweep.knob_names), *sweep.axis_keys]:
        if col in frame:
            frame[col] = typed_values(frame[col])
    for col in ("train_tokens", "train_steps"):
        if col in frame:
            frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("Int64")
    return frame


TIDY_COLUMNS = ("source", "task", "step", "tokens", "metric", "value", "stderr")


def aggregate(root: str | Path | Sweep) -> pd.DataFrame:
    """One tidy frame for a sweep: a row per run × step × metric (training curves, final summary, downstream)."""
    sweep = root if isinstance(root, Sweep) else load_sweep(root)
    rows: list[dict[str, Any]] = []
    for run in sweep.runs:
        base = _run_columns(run, sweep)
        if run.metrics is not None and "step" in run.metrics:
            for rec in run.metrics.to_dict("records"):
                for metric in METRIC_COLUMNS:
                    value = _as_float(rec.get(metric))
                    if value is None or math.isnan(value) or _as_float(rec.get("step")) is None:
                        continue
                    rows.append(
                        {
                            **base,
                            "source": "train",
                            "task": "",
                            "step": rec.get("step"),
                            "tokens": rec.get("tokens"),
                            "metric": metric,
                            "value": value,
                            "stderr": None,
                        }
                    )
        summary = run.summary or {}
        final_step, final_tokens = _as_float(summary.get("step")), _as_float(summary.get("tokens"))
        for metric in sorted(summary):
            value = _as_float(summary[metric])
            if (
                metric in ("step", "tokens", "train_tokens", "train_steps")
                or value is None
                or isinstance(summary[metric], bool)
            ):
                continue
            rows.append(
                {
                    **base,
                    "source": "final",
                    "task": "",
                    "step": final_step,
                    "tokens": final_tokens,
                    "metric": metric,
                    "value": value,
                    "stderr": None,
                }
            )
        if run.eval is not None and {"task", "metric", "value"} <= set(run.eval.columns):
            for rec in run.eval.to_dict("records"):
                value = _as_float(rec.get("value"))
                if value is None or math.isnan(value):
                    continue
                rows.append(
                    {
                        **base,
                        "source": "eval",
                        "task": str(rec["task"]),
                        "step": final_step,
                        "tokens": final_tokens,
                        "metric": str(rec["metric"]),
                        "value": value,
                        "stderr": _as_float(rec.get("stderr")),
                    }
                )
    columns = [*_run_column_names(sweep), *TIDY_COLUMNS]
    frame = typed_columns(pd.DataFrame(rows, columns=columns), sweep)
    for col in ("step", "tokens"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("Int64")
    for col in ("value", "stderr"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("float64")
    frame["seed"] = frame["seed"].astype("int64")
    for col in ("train_tokens", "train_steps"):
        frame[col] = pd.to_numeric(frame[col], errors="coerce").astype("Int64")
    return frame.reset_index(drop=True)


def runs_frame(sweep: Sweep) -> pd.DataFrame:
    """One row per run: identity, state, last step and message (every run, counted or not)."""
    rows = []
    for run in sweep.runs:
        rows.append(
            {
                **_run_columns(run, sweep),
                "step": run.status.get("step"),
                "counted": run.final_loss is not None,
                "message": run.message,
            }
        )
    return typed_columns(pd.DataFrame(rows, columns=[*_run_column_names(sweep), "step", "counted", "message"]), sweep)


def save_frame(frame: pd.DataFrame, stem: str | Path) -> list[Path]:
    """Write ``frame`` as ``<stem>.parquet`` and ``<stem>.csv``, each atomically."""
    stem = Path(stem)
    buf = io.BytesIO()
    frame.to_parquet(buf, index=False)
    return [
        atomic_write_bytes(stem.with_suffix(".parquet"), buf.getvalue()),
        atomic_write_bytes(stem.with_suffix(".csv"), frame.to_csv(index=False).encode()),
    ]
