"""Loading a trained model for evaluation and reports: a run directory or a ``.ckpt`` file in, a float32 decoder in
eval mode, its tokenizer and its config out.

The config comes from the run directory's ``config.json`` when there is one (the checkpoint's own copy
otherwise), so a checkpoint that does not fit the config it sits beside is reported rather than half loaded.

Every checkpoint is written with its SHA-256 beside it (``last.ckpt.sha256``), and the checkpoint it replaces is kept
as ``last.previous.ckpt``: bytes that change on disk after saving (a bad sector, a copy cut short, a stray write)
are named at load, where ``torch.load`` would read them as weights, and the previous good checkpoint is used.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import torch

from harness import rundir
from harness.config import RunConfig, build_config
from harness.data import tokenizer as toklib
from harness.data.corpus import get_tokenizer
from harness.errors import UsageError
from harness.io import (
    atomic_write_checked,
    atomic_write_text,
    checksum_path,
    file_digest,
    recorded_digests,
)
from harness.model.factory import build_model


def previous_path(path: Path) -> Path:
    """Where the checkpoint that ``path`` replaced is kept: ``last.ckpt`` -> ``last.previous.ckpt``."""
    return path.with_name(f"{path.stem}.previous{path.suffix}")


def verify(path: str | os.PathLike) -> bool | None:
    """Whether the checkpoint's bytes are the ones saved: True or False, None where no checksum was written."""
    path = Path(path)
    allowed = recorded_digests(path)
    return file_digest(path) in allowed if allowed else None


def save_with_checksum(path: str | os.PathLike, data: bytes) -> None:
    """Write checkpoint bytes atomically with their checksum (``atomic_write_checked``), keeping the checkpoint they
    replace, with its checksum, as the previous."""
    path = Path(path)
    current = recorded_digests(path)
    if path.is_file():
        previous = previous_path(path)
        atomic_write_text(checksum_path(previous), "\n".join(current + recorded_digests(previous)) + "\n")
        link = previous.with_name(f".{previous.name}.link")
        link.unlink(missing_ok=True)
        os.link(path, link)  # the old bytes stay where they are; only a second name is made
        os.replace(link, previous)
        atomic_write_text(checksum_path(previous), "\n".join(current) + "\n")
    atomic_write_checked(path, data)


def usable_checkpoint(path: str | os.PathLike, then: str = "train again") -> Path:
    """``path`` if its bytes are the ones saved, else the previous checkpoint kept beside it if that one's are (with
    a line saying so); a usage error naming the damaged file and what to do (``then``) where neither is."""
    path = Path(path)
    if verify(path) is not False:
        return path
    previous = previous_path(path)
    damaged = (
        f"The checkpoint {str(path)!r} does not match the checksum written when it was saved "
        f"({checksum_path(path).name}): its bytes changed on disk after saving"
    )
    if previous.is_file() and verify(previous) is not False:
        print(f"depthmem: {damaged}; using the previous checkpoint, {str(previous)!r}.", flush=True)
        return previous
    raise UsageError(f"{damaged}, and no earlier good checkpoint is kept beside it; {then}.")


def check_not_sweep(path: Path) -> None:
    """Refuse a sweep folder where a run is expected, naming the commands that evaluate its runs."""
    record = path / "sweep.json"
    if not (path.is_dir() and record.is_file()):
        return
    try:
        grid = (rundir.read_sweep_record(path) or {}).get("grid") or "GRID"
    except UsageError:
        grid = "GRID"
    raise UsageError(
        f"{str(path)!r} is a sweep folder, not a run: evaluate all its runs with "
        f"`depthmem sweep {grid} eval.tasks=[TASK,...]`, or one of them with "
        f"`depthmem eval {path}/RUN_ID --tasks TASK,...` (`depthmem status {path}` lists the run ids)."
    )


def _locate(path: Path) -> tuple[Path, Path | None]:
    """(checkpoint file, run directory or None) for a run directory or a checkpoint path."""
    check_not_sweep(path)
    if path.is_dir():
        ckpt = path / "ckpt" / "last.ckpt"
        if not ckpt.is_file():
            raise UsageError(
                f"The run directory {str(path)!r} has no checkpoint ckpt/last.ckpt: it has not trained "
                "far enough to save one."
            )
        return usable_checkpoint(ckpt), path
    if not path.is_file():
        raise UsageError(f"{str(path)!r} is neither a run directory nor a checkpoint file.")
    for candidate in (path.parent.parent, path.parent):
        if (candidate / "config.json").is_file():
            return usable_checkpoint(path), candidate
    return usable_checkpoint(path), None


def read_checkpoint(path: str | os.PathLike) -> dict:
    """The checkpoint dictionary (tensors on CPU), or a usage error when the file is truncated or corrupt. Its bytes
    are checked against their checksum by ``usable_checkpoint``, which chooses the file, not here again."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError, KeyError, OSError) as e:
        # A zip cut short inside its directory makes the reader seek before the file's start (EINVAL).
        raise UsageError(
            f"The checkpoint {str(path)!r} is truncated or corrupt ({type(e).__name__}); "
            "use an earlier checkpoint or train again."
        ) from None


def load_model(path: str | os.PathLike, *, device: str | torch.device = "cpu"):
    """``(decoder, tokenizer, config)`` of a run directory or checkpoint: float32, eval mode, on ``device``."""

    ckpt_path, run_dir = _locate(Path(path))
    ckpt = read_checkpoint(ckpt_path)
    extra = ckpt.get("depthmem") or {}
    if "state_dict" not in ckpt:
        raise UsageError(f"The checkpoint {str(ckpt_path)!r} holds no model weights (no state_dict).")
    if run_dir is not None:
        cfg: RunConfig = rundir.read_config(run_dir)
    elif "config" in extra:
        cfg = build_config(extra["config"], source=str(ckpt_path))
    else:
        raise UsageError(f"The checkpoint {str(ckpt_path)!r} carries no config and has no config.json beside it.")
    model = build_model(cfg.model, cfg.variant)
    prefix = "model."
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    # torch.compile'd training leaves an ``_orig_mod.`` in the names when the whole module was wrapped.
    state = {k.replace("_orig_mod.", ""): v for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError:
        raise UsageError(
            f"The checkpoint {str(ckpt_path)!r} does not match its config (variant {cfg.variant!r}, "
            f"preset {cfg.model.preset!r}, d_model {cfg.model.d_model}, {cfg.model.n_layers} layers): "
            "it was saved by a different model."
        ) from None
    tok = toklib.load_from_run(run_dir) if run_dir is not None else None
    if tok is None and "tokenizer" in extra:
        tok = toklib.from_spec(extra["tokenizer"])
    if tok is None:
        tok = get_tokenizer(cfg)
    model = model.float().to(device).eval()
    return model, tok, cfg
