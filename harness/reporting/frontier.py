"""The compute frontier: final loss against training compute, a power law per variant, the compute multiplier.

Every finished run trained at a tokens-per-parameter budget (``train.max_steps`` 0) is a point: its training
compute ``C = 3 · F · D``, with ``F`` the forward FLOPs per token (PreLN's count from ``harness.model.costs`` at the
run's model size and sequence length, plus the mixer's ``extra_flops_per_token``) and ``D`` its training tokens,
and its final validation loss. The runs that agree on everything but the model's size and the variant form one
frontier; the one with the most sizes is shown. Per variant, ``L = a · C^(−b)`` is fitted by least squares on
``log L`` against ``log C`` over the mean loss of each size. The compute multiplier of a variant at a size is
``C_base(L) / C``: the compute at which the baseline's law reaches the variant's loss, over the variant's own
compute, the measure the Attention Residuals and mHC reports give.

Its interval depends on how many seeds there are. With at least ``MIN_BOOTSTRAP_SEEDS`` seeds in every cell it
rests on (the variant's and the baseline's) it is a percentile bootstrap over seeds: the seed labels are resampled
jointly (a seed drawn twice counts twice in every cell that has it), the means recomputed and the baseline's law
refitted in every resample, with a fixed generator so reports repeat. With fewer seeds a bootstrap has too few
distinct resamples to mean anything (three seeds give ten), so the interval comes from the fit instead: the delta
method on ``log C_base(L) − log C`` with the covariance of the baseline's least-squares law (its residuals over
``sizes − 2`` degrees of freedom) and the variance of the variant's mean log loss over its seeds, Student t with
``sizes − 2`` degrees of freedom. The ``interval`` column says which (``bootstrap``, ``fit``, or ``fit, one seed``
where a cell's own seed spread cannot be estimated and only the fit's uncertainty is in it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from scipy import stats

from harness.config import ModelConfig
from harness.reporting.axes import flatten
from harness.reporting.results import Run, Sweep, split_variant

BOOTSTRAP = 2000
MIN_SIZES = 3
MIN_BOOTSTRAP_SEEDS = 5
# Config keys that a point on the frontier may change: the model's size, and the steps and tokens its budget gives.
_FREE_PREFIXES = ("model.", "eval.", "slurm.")
_FREE_KEYS = {"variant", "train.seed", "name", "data.cache_dir", "train.logger", "train.max_steps", "train.tokens"}


@dataclass
class Frontier:
    """The points, the fitted laws and the multipliers of one frontier (empty frames and a reason when none)."""

    points: pd.DataFrame
    fits: pd.DataFrame
    multipliers: pd.DataFrame
    baseline: str
    budget_text: str = ""
    reason: str = ""
    left_out: list[str] = field(default_factory=list)


def forward_flops_per_token(run: Run) -> float | None:
    """PreLN's forward FLOPs per token at the run's size and sequence length plus what its mixer adds, and for
    ``preln(match=...)`` what its widened MLPs add."""
    # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
    from harness.model.costs import preln_flops_per_token

    try:
        model = ModelConfig(**run.config["model"])
    except (KeyError, TypeError, ValueError):
        return None
    seq_len = int(run.config_value("train.seq_len", 0) or 0) or model.max_seq_len
    extra = (run.summary or {}).get("extra_flops_per_token")
    extra = float(extra) if isinstance(extra, (int, float)) and math.isfinite(extra) else 0.0
    widened = _widened_flops(model, str(run.config.get("variant")))
    return None if widened is None else float(preln_flops_per_token(model, seq_len)) + extra + widened


def _widened_flops(model: ModelConfig, variant: str) -> float | None:
    """Forward FLOPs per token that a parameter-matched PreLN's wider MLPs add (0 for every other variant; None
    when the variant does not build at this size, so the run is left out of the frontier and named)."""
    if "match=" not in variant:
        return 0.0
    import torch

    import variants
    from harness.errors import UsageError
    from harness.model.costs import matched_width_cost

    try:
        with torch.device("meta"):  # shapes only
            mixer = variants.build(variant, d_model=model.d_model, n_layers=model.n_layers)
        return float(matched_width_cost(model, mixer)[1])
    except (UsageError, ValueError):
        return None


def training_tokens(run: Run) -> float | None:
    s = run.summary or {}
    value = s.get("train_tokens", s.get("tokens"))
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def training_flops(run: Run) -> float | None:
    """Training compute of a run: 3 × forward FLOPs per token (forward plus a backward of twice its cost) × tokens."""
    f, d = forward_flops_per_token(run), training_tokens(run)
    return None if f is None or d is None else 3.0 * f * d


def _budget_key(run: Run) -> str:

    flat = {k: v for k, v in flatten(run.config).items() if k not in _FREE_KEYS and not k.startswith(_FREE_PREFIXES)}
    return json.dumps(flat, sort_keys=True, default=str)


def frontier_points(sweep: Sweep) -> tuple[pd.DataFrame, str, list[str]]:
    """One row per finished run of the largest frontier: variant, size key, params, FLOPs, seed, loss."""
    rows, left_out = [], []
    for run in sweep.finished():
        if int(run.config_value("train.max_steps", 0) or 0) != 0:
            continue  # a budget in steps, not per parameter
        flops = training_flops(run)
        params = (run.summary or {}).get("params")
        if flops is None or not isinstance(params, (int, float)):
            left_out.append(run.run_id)
            continue
        size = json.dumps(run.config.get("model", {}), sort_keys=True, default=str)
        rows.append(
            {
                "budget": _budget_key(run),
                "variant": run.variant,
                "size": size,
                "setting": run.setting,
                "params": float(params),
                "flops": flops,
                "seed": run.seed,
                "loss": float(run.final_loss),
                "tokens_per_param": float(run.config_value("train.tokens_per_param", math.nan)),
            }
        )
    frame = pd.DataFrame(
        rows, columns=["budget", "variant", "size", "setting", "params", "flops", "seed", "loss", "tokens_per_param"]
    )
    if frame.empty:
        return frame, "", left_out
    sizes = frame.groupby("budget")["size"].nunique()
    best = sorted(sizes.index, key=lambda b: (-sizes[b], b))[0]
    frame = frame[frame["budget"] == best].drop(columns="budget").reset_index(drop=True)
    budget = frame["tokens_per_param"].iloc[0]
    return frame, f"{budget:g} training tokens per parameter (of the baseline at each size)", left_out


def fit_power_law(flops, loss) -> tuple[float, float]:
    """``(a, b)`` of ``loss = a · flops^(−b)``, least squares in log–log space."""
    x, y = np.log(np.asarray(flops, dtype=np.float64)), np.log(np.asarray(loss, dtype=np.float64))
    slope, intercept = np.polyfit(x, y, 1)
    return float(math.exp(intercept)), float(-slope)


def compute_for_loss(a: float, b: float, loss):
    """The compute at which ``a · C^(−b)`` equals ``loss``."""
    return np.exp((math.log(a) - np.log(np.asarray(loss, dtype=np.float64))) / b)


def _cells(points: pd.DataFrame) -> pd.DataFrame:
    """Mean loss and compute per variant and size."""
    return (
        points.groupby(["variant", "size"], as_index=False)
        .agg(
            params=("params", "mean"),
            flops=("flops", "mean"),
            loss=("loss", "mean"),
            loss_var=("loss", lambda x: float(np.var(x, ddof=1)) if len(x) > 1 else math.nan),
            seeds=("seed", "nunique"),
            setting=("setting", "first"),
        )
        .sort_values(["variant", "params"], kind="stable")
        .reset_index(drop=True)
    )


def _multipliers(cells: pd.DataFrame, baseline: str) -> dict[tuple[str, str], float] | None:
    ref = cells[cells["variant"] == baseline]
    if ref["size"].nunique() < 2:
        return None
    a, b = fit_power_law(ref["flops"], ref["loss"])
    if not b > 0:
        return None  # a law that does not fall with compute cannot be inverted into a multiplier
    need = compute_for_loss(a, b, cells["loss"])
    return {(v, s): float(n / c) for v, s, n, c in zip(cells["variant"], cells["size"], need, cells["flops"])}


def _geomean(values) -> float:
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return float(math.exp(np.mean(np.log(values)))) if values else math.nan


def _fits(cells: pd.DataFrame) -> pd.DataFrame:
    """The power law of loss in compute of each variant with at least two sizes."""
    fits = []
    for variant, sub in cells.groupby("variant", sort=False):
        if sub["size"].nunique() >= 2:
            a, b = fit_power_law(sub["flops"], sub["loss"])
            fits.append({"variant": variant, "a": a, "b": b, "sizes": int(sub["size"].nunique())})
    return pd.DataFrame(fits, columns=["variant", "a", "b", "sizes"])


def _multiplier_rows(cells: pd.DataFrame, keys: list, point: dict, baseline: str, interval) -> list[dict]:
    """One row per variant and size with its compute multiplier, and their geometric mean per variant."""
    rows = []
    for variant in [v for v in dict.fromkeys(cells["variant"]) if v != baseline]:
        idx = [i for i, k in enumerate(keys) if k[0] == variant]
        for i in idx:
            row = cells.iloc[i]
            lo, hi, how = interval([i])
            rows.append(
                {
                    "variant": variant,
                    "setting": row["setting"],
                    "params": row["params"],
                    "seeds": int(row["seeds"]),
                    "flops": row["flops"],
                    "loss": row["loss"],
                    "multiplier": point[keys[i]],
                    "low": lo,
                    "high": hi,
                    "interval": how,
                }
            )
        if len(idx) < 2:
            continue
        lo, hi, how = interval(idx)
        rows.append(
            {
                "variant": variant,
                "setting": "",
                "params": math.nan,
                "seeds": int(cells["seeds"].iloc[idx].min()),
                "flops": math.nan,
                "loss": math.nan,
                "multiplier": _geomean([point[keys[i]] for i in idx]),
                "low": lo,
                "high": hi,
                "interval": how,
            }
        )
    return rows


def analyse(
    points: pd.DataFrame, baseline: str, *, budget_text: str = "", resamples: int = BOOTSTRAP, seed: int = 0
) -> Frontier:
    """Fits, multipliers and bootstrap intervals for the frontier ``points`` (one row per run)."""
    empty = pd.DataFrame()
    if points.empty:
        return Frontier(
            points,
            empty,
            empty,
            baseline,
            budget_text,
            "no finished run trained at a tokens-per-parameter budget (train.max_steps 0) with params and "
            "tokens in its summary.json",
        )
    cells = _cells(points)
    fits = _fits(cells)
    n_ref = cells.loc[cells["variant"] == baseline, "size"].nunique()
    if n_ref < MIN_SIZES:
        return Frontier(
            points,
            fits,
            empty,
            baseline,
            budget_text,
            f"{baseline} has {n_ref} model size(s) on the frontier; the compute multiplier needs at least {MIN_SIZES}",
        )
    point = _multipliers(cells, baseline)
    if point is None:
        return Frontier(
            points,
            fits,
            empty,
            baseline,
            budget_text,
            f"{baseline}'s fitted loss does not fall with compute, so it cannot be inverted",
        )
    keys = list(zip(cells["variant"], cells["size"]))
    draws = _bootstrap(points, cells, keys, baseline, resamples, seed)  # (resamples, cells), NaN rows dropped
    ref_seeds = int(cells.loc[cells["variant"] == baseline, "seeds"].min())

    def interval(idx: list[int]) -> tuple[float, float, str]:
        if min(ref_seeds, int(cells["seeds"].iloc[idx].min())) >= MIN_BOOTSTRAP_SEEDS:
            values = draws[:, idx[0]] if len(idx) == 1 else np.exp(np.log(draws[:, idx]).mean(axis=1))
            return (*_interval(values), "bootstrap")
        return fit_interval(cells, idx, baseline)

    rows = _multiplier_rows(cells, keys, point, baseline, interval)
    multipliers = pd.DataFrame(
        rows,
        columns=["variant", "setting", "params", "seeds", "flops", "loss", "multiplier", "low", "high", "interval"],
    )
    reason = "" if not multipliers.empty else f"no variant besides {baseline} is on the frontier"
    return Frontier(points, fits, multipliers, baseline, budget_text, reason)


def fit_interval(cells: pd.DataFrame, idx: list[int], baseline: str, level: float = 0.95) -> tuple[float, float, str]:
    """The interval of the (geometric mean) multiplier of the cells ``idx`` from the baseline's fit and the cells'
    seed spread, by the delta method (module docstring); NaNs and ``""`` where it cannot be formed."""
    ref = cells[cells["variant"] == baseline]
    x = np.log(ref["flops"].to_numpy(dtype=np.float64))
    y = np.log(ref["loss"].to_numpy(dtype=np.float64))
    n = len(x)
    if n < 3:
        return math.nan, math.nan, ""
    design = np.column_stack([np.ones(n), x])
    beta, *_ = np.linalg.lstsq(design, y, rcond=None)
    residual = y - design @ beta
    cov = float(residual @ residual) / (n - 2) * np.linalg.inv(design.T @ design)
    b0, b1 = beta
    sub = cells.iloc[idx]
    yv = np.log(sub["loss"].to_numpy(dtype=np.float64))
    xv = np.log(sub["flops"].to_numpy(dtype=np.float64))
    # log multiplier_i = (y_i − β0) / β1 − x_i, averaged over the cells for the geometric mean.
    estimate = float(np.mean((yv - b0) / b1 - xv))
    grad = np.array([-1.0 / b1, float(np.mean(-(yv - b0) / b1**2))])
    var_fit = float(grad @ cov @ grad)
    # The variance of a cell's mean log loss over its seeds, by the delta method (d log L = dL / L).
    var_cells = (sub["loss_var"] / sub["seeds"] / sub["loss"] ** 2).to_numpy(dtype=np.float64)
    one_seed = bool(np.isnan(var_cells).any())
    var_y = float(np.nansum(var_cells)) / (b1**2 * len(idx) ** 2)
    half = stats.t.ppf(0.5 + level / 2, n - 2) * math.sqrt(var_fit + var_y)
    if not math.isfinite(half):
        return math.nan, math.nan, ""
    return math.exp(estimate - half), math.exp(estimate + half), "fit, one seed" if one_seed else "fit"


def _bootstrap(
    points: pd.DataFrame, cells: pd.DataFrame, keys: list[tuple[str, str]], baseline: str, resamples: int, seed: int
) -> np.ndarray:
    """Multipliers of every cell in each bootstrap resample of the seeds, one row per usable resample.

    A resample draws the seed labels with replacement; a cell's mean is over its runs weighted by how often their
    seed was drawn. Resamples in which a cell has none of its seeds, or the baseline's law does not fall with
    compute, are dropped.
    """
    seeds = sorted(points["seed"].unique())
    if len(seeds) < 2 or resamples < 1:
        return np.empty((0, len(keys)))
    by_cell = {k: dict(zip(g["seed"], g["loss"])) for k, g in points.groupby(["variant", "size"])}
    values = np.array([[by_cell[k].get(s, np.nan) for s in seeds] for k in keys])  # (cells, seeds)
    present = ~np.isnan(values)
    counts = np.random.default_rng(seed).multinomial(len(seeds), [1 / len(seeds)] * len(seeds), size=resamples)
    weight = counts @ present.T  # (resamples, cells)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = (counts @ np.where(present, values, 0.0).T) / weight
    ref = [i for i, k in enumerate(keys) if k[0] == baseline]
    x = np.log(cells["flops"].to_numpy(dtype=np.float64))
    xr = x[ref] - x[ref].mean()
    yr = np.log(means[:, ref])
    slope = (yr - yr.mean(axis=1, keepdims=True)) @ xr / (xr @ xr)
    intercept = yr.mean(axis=1) - slope * x[ref].mean()
    ok = (weight > 0).all(axis=1) & (slope < 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        need = (intercept[:, None] - np.log(means)) / -slope[:, None]  # log of the baseline's compute for the loss
    return np.exp(need - x[None, :])[ok]


def _interval(values) -> tuple[float, float]:
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if len(values) < 2:
        return math.nan, math.nan
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def from_sweep(sweep: Sweep, baseline: str = "preln", **kwargs) -> Frontier:
    """The frontier of a loaded sweep (see the module docstring for which runs it takes)."""
    points, budget_text, left_out = frontier_points(sweep)
    result = analyse(points, split_variant(baseline)[0], budget_text=budget_text, **kwargs)
    result.left_out = left_out
    return result
