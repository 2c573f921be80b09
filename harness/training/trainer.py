"""Training with Lightning: one ``train(cfg, run_dir)`` call makes a complete, resumable run directory.

The plain ``Decoder`` is wrapped by a small LightningModule (``harness.training.module``); a callback
(``harness.training.runfiles``) writes the run directory of ``harness.rundir`` from rank 0 only; the optimiser's
pieces are in ``harness.training.optim``. A run killed at any moment and started again continues exactly where its
last checkpoint left it; on CPU its loss curve equals an uninterrupted run's.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from harness import rundir, tracking
from harness.config import RunConfig
from harness.data import corpus as datalib
from harness.data import tokenizer as toklib
from harness.errors import RunFailed, RunStopped, UsageError
from harness.io import (
    DiskFull,
    atomic_write_checked,
    atomic_write_json,
    check_checkpoint_room,
    json_bytes,
    read_json,
    remove_stale_temps,
)
from harness.model import diagnostics
from harness.model.checkpoint import read_checkpoint, usable_checkpoint
from harness.model.costs import preln_params
from harness.model.factory import build_model
from harness.training.budget import seq_len_of
from harness.training.console import processes_text, quiet_lightning
from harness.training.module import AtomicCheckpointIO, LitDecoder, StepBatches
from harness.training.optim import accumulation, total_steps
from harness.training.runfiles import DEPTH_STATS, RunFiles, StepCosts, StepProgressBar
from harness.training.sharding import is_sharded, resolved_strategy, sharded_strategy, unsharded_copy
from harness.training.signals import SyncedStop


def _plus(value: int | None, more: int) -> int | None:
    return None if value is None else value + more


def _safe_cost(fn) -> Any:
    try:
        return fn()
    except NotImplementedError:
        return None


def _cluster_environment():
    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment

    # Under submitit, which owns requeueing, Lightning must neither requeue nor exit on its own signals.
    if "SLURM_NTASKS" in os.environ:
        return SLURMEnvironment(auto_requeue=False)
    return LightningEnvironment()


def _trainer(cfg: RunConfig, callbacks: list, run_dir: Path, total: int, plain_logs: bool) -> pl.Trainer:
    from lightning.pytorch.strategies import DDPStrategy

    t = cfg.train
    accelerator = t.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    precision = t.precision
    if precision == "auto":
        precision = "bf16-mixed" if accelerator in ("gpu", "cuda") else "32-true"
    env, ckpt_io = _cluster_environment(), AtomicCheckpointIO()
    world = t.devices * t.num_nodes
    chosen = resolved_strategy(t.strategy, world, preln_params(cfg.model))
    if chosen == "fsdp":
        strategy, plugins = sharded_strategy(accelerator, world), [env, ckpt_io]
    elif chosen == "ddp" and t.strategy == "auto":
        strategy = DDPStrategy(
            cluster_environment=env,
            checkpoint_io=ckpt_io,
            process_group_backend="gloo" if accelerator == "cpu" else "nccl",
        )
        plugins = []
    else:
        strategy, plugins = t.strategy, [env, ckpt_io]
    try:
        loggers = _loggers(cfg, run_dir)
        return pl.Trainer(
            accelerator=accelerator,
            devices=t.devices,
            num_nodes=t.num_nodes,
            strategy=strategy,
            plugins=plugins,
            precision=precision,
            max_steps=total,
            max_epochs=-1,
            gradient_clip_val=t.grad_clip or None,
            deterministic=True if accelerator == "cpu" else "warn",
            logger=loggers or False,
            callbacks=callbacks,
            enable_checkpointing=False,
            enable_model_summary=False,
            enable_progress_bar=not plain_logs,
            log_every_n_steps=t.log_every_steps,
            limit_val_batches=0,
            accumulate_grad_batches=accumulation(cfg),
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            default_root_dir=str(run_dir),
        )
    except ModuleNotFoundError as e:
        raise UsageError(
            f"train.logger={t.logger} needs a package that is not installed: pip install {e.name or t.logger}."
        ) from None


def tracking_id(run_dir: Path) -> str:
    """The run's W&B id: made once per run directory and kept in ``tracking.json``, so a requeued job resumes the
    same W&B run while two sweeps with a run folder of the same name never share one."""
    import uuid

    from lightning.fabric.utilities.rank_zero import rank_zero_only

    path = run_dir / "tracking.json"
    record = read_json(path, default={}) or {}
    if not record.get("wandb_id") and rank_zero_only.rank != 0:
        return run_dir.name  # other ranks never open the W&B run; only rank 0 makes the id
    if not record.get("wandb_id"):
        record["wandb_id"] = f"{run_dir.name[:100]}-{uuid.uuid4().hex[:8]}"
        atomic_write_json(path, record)
    return record["wandb_id"]


def _loggers(cfg: RunConfig, run_dir: Path) -> list:
    """TensorBoard or W&B, each given the full resolved config as the run's hyperparameters."""
    t = cfg.train
    if t.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", default_hp_metric=False)
    elif t.logger == "wandb":
        from lightning.pytorch.loggers import WandbLogger

        os.environ.setdefault("WANDB_SILENT", "true")  # W&B's banners and sync hints; WANDB_SILENT=false shows them

        # Project from the grid (train.wandb_project) or the sweep's name; one group per sweep, one job type per
        # variant, the run id as the name.
        # W&B's own settings win over the run folder: WANDB_DIR for the files (Lightning's save_dir would
        # override it), WANDB_PROJECT where the grid names no project.
        logger = WandbLogger(
            save_dir=tracking.wandb_dir(run_dir),
            project=t.wandb_project or os.environ.get("WANDB_PROJECT") or cfg.name or "depthmem",
            group=cfg.name or None,
            job_type=str(cfg.variant),  # the canonical name
            name=run_dir.name,
            id=tracking_id(run_dir),
            resume="allow",
        )
    else:
        return []
    logger.log_hyperparams(cfg.to_dict())
    if t.logger == "tensorboard":
        _tensorboard_hparams(logger, cfg)
    return [logger]


def _tensorboard_hparams(logger, cfg: RunConfig) -> None:
    """The config in TensorBoard's HParams view, paired with the val_loss curve the run logs (Lightning writes
    it only together with a placeholder metric)."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    if rank_zero_only.rank != 0:
        return
    from torch.utils.tensorboard.summary import hparams

    writer = logger.experiment._get_file_writer()
    for summary in hparams(tracking.hparams_flat(cfg.to_dict()), {"val_loss": 0.0}):
        writer.add_summary(summary)


def _finish_tracking(cfg: RunConfig, rank0: bool, *, failed: bool) -> None:
    """Close the W&B run, so its record (offline: the run file) is complete before the job goes on or ends."""
    if cfg.train.logger == "wandb" and rank0:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=1 if failed else 0)


def _check_run_dir(run_dir: Path) -> None:
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"Cannot create the run directory {str(run_dir)!r}: {e.strerror}.") from None
    if not os.access(run_dir, os.W_OK | os.X_OK):
        raise UsageError(f"The run directory {str(run_dir)!r} is not writable.")


def _model_words(cfg: RunConfig) -> str:
    return (
        f"variant {cfg.variant!r}, preset {cfg.model.preset!r}, d_model {cfg.model.d_model}, "
        f"{cfg.model.n_layers} layers, seed {cfg.train.seed}"
    )


def _check_resumable(ckpt_path: Path, cfg: RunConfig, model: nn.Module) -> int:
    """The step a checkpoint resumes from, once it is known to load and to hold this run's model."""

    try:
        ckpt = read_checkpoint(ckpt_path)
    except UsageError:
        raise UsageError(
            f"The checkpoint {str(ckpt_path)!r} is truncated or corrupt, so the run cannot resume "
            "from it; restore an earlier copy or start over with --no-resume."
        ) from None
    saved = (ckpt.get("depthmem") or {}).get("config")
    if saved is not None:
        try:
            other = RunConfig.from_dict(saved, source=str(ckpt_path))
        except UsageError:
            other = None
        if other is None or rundir.config_hash(other, with_seed=True) != rundir.config_hash(cfg, with_seed=True):
            what = _model_words(other) if other is not None else "another config"
            raise UsageError(
                f"The checkpoint {str(ckpt_path)!r} belongs to a different run ({what}), not to this "
                f"one ({_model_words(cfg)}); remove it or start over with --no-resume."
            )
    # Even without a recorded config, the weights must fit this model name for name and shape.
    state = {
        k[len("model.") :]: tuple(v.shape) for k, v in (ckpt.get("state_dict") or {}).items() if k.startswith("model.")
    }
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if state != expected:
        raise UsageError(
            f"The checkpoint {str(ckpt_path)!r} holds weights of another model than this run's "
            f"({_model_words(cfg)}); remove it or start over with --no-resume."
        )
    return int(ckpt.get("global_step", 0))


def _check_shapes(cfg: RunConfig) -> int:
    """The run's sequence length, once the batch splits over the processes and the sequence fits the model."""
    world = cfg.train.devices * cfg.train.num_nodes
    if cfg.train.batch_size % world:
        raise UsageError(
            f"train.batch_size ({cfg.train.batch_size}) must be divisible by the number of processes ({world})."
        )
    accumulation(cfg)
    seq_len = seq_len_of(cfg)
    if seq_len > cfg.model.max_seq_len:
        raise UsageError(f"train.seq_len ({seq_len}) must not exceed model.max_seq_len ({cfg.model.max_seq_len}).")
    return seq_len


def _already_done(cfg: RunConfig, run_dir: Path, status: dict, resume: bool, rank0: bool) -> bool:
    """Whether ``run_dir`` holds this very run, finished; refuses a folder that holds another run."""
    rundir.check_same_run(run_dir, cfg)
    if resume and status.get("state") == "done" and (run_dir / "summary.json").exists():
        if rank0:
            print(f"depthmem: {run_dir} is already done (step {status.get('step')}); nothing to train.", flush=True)
        return True
    return False


def _resume_point(cfg: RunConfig, ckpt_path: Path, model: nn.Module, resume: bool, rank0: bool):
    """The checkpoint to resume from (None to start over) and its step."""
    resume_from = None
    if resume and ckpt_path.exists():
        resume_from = usable_checkpoint(ckpt_path, then="start the run over with --no-resume")
    if resume_from is None:
        return None, 0
    resume_step = _check_resumable(resume_from, cfg, model)
    if resume_from != ckpt_path and rank0:
        # Set the damaged bytes aside, so that the next save keeps the good checkpoint as the previous one.
        os.replace(ckpt_path, ckpt_path.with_name(ckpt_path.name + ".damaged"))
    return resume_from, resume_step


def _start_run_dir(
    cfg: RunConfig,
    run_dir: Path,
    ckpt_path: Path,
    model,
    tok,
    step: int,
    last_loss,
    what: str,
    total: int,
    fresh: bool,
) -> None:
    """Write the run's config, environment and tokenizer, clear a fresh run's old files, and mark it running."""
    remove_stale_temps(run_dir, run_dir / "ckpt")  # what a killed write of this run left behind
    # Weights and both AdamW moments in float32: the checkpoint's size, to the first digit.
    check_checkpoint_room(ckpt_path, 12 * sum(p.numel() for p in model.parameters()))
    rundir.write_config(run_dir, cfg)
    rundir.write_env(run_dir)
    toklib.save_to_run(tok, run_dir)
    if fresh:
        for name in ("metrics.csv", "layers.csv", "summary.json", "mixing.json", DEPTH_STATS):
            (run_dir / name).unlink(missing_ok=True)
    rundir.write_status(run_dir, "running", step=step, last_loss=last_loss, message=f"{what}, {total} steps")


def _signal_name(e: BaseException, trainer) -> str | None:
    """The signal that stopped training, or None when it failed."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    # Lightning turns Ctrl-C into a graceful stop and then SystemExit; a signal is an interruption, not a failure.
    # (trainer.interrupted alone says nothing: Lightning sets it for every exception that leaves fit.)
    if isinstance(e, SIGTERMException):
        return "SIGTERM"
    if isinstance(e, KeyboardInterrupt) or (isinstance(e, SystemExit) and trainer.interrupted):
        return "Ctrl-C"
    return None


def _record_stop(e: BaseException, signal_name: str | None, trainer, files: RunFiles, run_dir: Path) -> None:
    """Mark the run interrupted (by a signal) or failed, with the step its last checkpoint resumes from."""
    try:
        if signal_name:
            rundir.write_status(
                run_dir,
                "interrupted",
                step=trainer.global_step,
                last_loss=files.last_loss,
                ckpt_step=files.ckpt_step,
                message=f"stopped by {signal_name} at step {trainer.global_step}; the last "
                f"checkpoint is at step {files.ckpt_step}",
            )
        else:
            rundir.write_status(
                run_dir,
                "failed",
                step=trainer.global_step,
                last_loss=files.last_loss,
                message=f"failed: {type(e).__name__}: {e}; run the same command again to "
                f"resume from the last checkpoint (step {files.ckpt_step})",
            )
    except DiskFull:
        pass  # the disk that refused the run's files refuses this one too; the error below says why


def _fit(cfg: RunConfig, trainer, module, loader, resume_from, files: RunFiles, run_dir: Path, rank0: bool) -> None:
    """Run Lightning's fit; a signal becomes RunStopped saying how to resume, and the status says what happened."""
    try:
        trainer.fit(
            module, train_dataloaders=loader, ckpt_path=str(resume_from) if resume_from else None, weights_only=True
        )
    except BaseException as e:
        _finish_tracking(cfg, rank0, failed=True)
        signal_name = _signal_name(e, trainer)
        if rank0:
            _record_stop(e, signal_name, trainer, files, run_dir)
        if signal_name:
            raise RunStopped(
                f"Training was stopped by {signal_name} at step {trainer.global_step}; run the same "
                f"command again to resume from step {files.ckpt_step}."
            ) from None
        raise


def _write_results(cfg, run_dir: Path, model, module, trainer, files: RunFiles, costs: StepCosts, total, wall):
    """Write summary.json (and mixing.json where the variant has a mixing matrix) and mark the run done."""
    measured = [r for r in files.metrics if r.get("val_loss") not in (None, "")]
    val_loss = float(measured[-1]["val_loss"]) if measured else None
    val_bpb = float(measured[-1]["val_bpb"]) if measured else None
    mixer = model.mixer
    from harness.model.costs import matched_width_cost

    widened_params, widened_flops = matched_width_cost(cfg.model, mixer)  # nonzero only for preln(match=...)
    summary = {
        "val_loss": val_loss,
        "val_bpb": val_bpb,
        "val_ppl": math.exp(val_loss) if val_loss is not None else None,
        "step": trainer.global_step,
        "tokens": trainer.global_step * files.tokens_per_step,
        "train_steps": total,
        "train_tokens": total * files.tokens_per_step,
        "params": model.num_params(),
        "extra_params": _plus(_safe_cost(mixer.extra_params), widened_params),
        "stream_floats_per_token": _safe_cost(mixer.stream_floats_per_token),
        "extra_flops_per_token": _plus(_safe_cost(mixer.extra_flops_per_token), widened_flops),
        "tokens_per_s": files.segment_tokens_per_s,
        **costs.summary(module),
        "skipped_updates": module.fallbacks,
        "wall_s": wall,
    }
    if files.depth_stats:
        summary["depth_memory"] = {k: v for k, v in files.depth_stats[-1].items() if k != "step"}
    model.float().eval()
    try:
        mixing = diagnostics.mixing_summary(model, module.val_windows[:4, :-1])
        atomic_write_checked(run_dir / "mixing.json", json_bytes(mixing))
    except NotImplementedError:
        pass  # a variant without a mixing matrix still trains; it simply has no mixing.json
    atomic_write_checked(run_dir / "summary.json", json_bytes(summary))
    rundir.write_status(
        run_dir,
        "done",
        step=trainer.global_step,
        last_loss=files.last_loss,
        message=f"done: val_loss {val_loss if val_loss is None else round(val_loss, 4)}",
    )


def train(cfg: RunConfig, run_dir: str | os.PathLike, *, resume: bool = True) -> Path:
    """Train ``cfg`` into ``run_dir`` (resuming its last checkpoint unless ``resume=False``); returns run_dir."""
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    from lightning.pytorch import seed_everything

    run_dir = Path(run_dir)
    rank0 = rank_zero_only.rank == 0
    _check_run_dir(run_dir)
    ckpt_path = run_dir / "ckpt" / "last.ckpt"
    status = rundir.read_status(run_dir)
    if _already_done(cfg, run_dir, status, resume, rank0):
        return run_dir
    seq_len = _check_shapes(cfg)

    tok = datalib.get_tokenizer(cfg)
    tokens = datalib.load_tokens(cfg, tok)
    datalib.check_sizes(tokens, seq_len, need_val=cfg.train.val_batches > 0)
    val = datalib.val_windows(tokens.val, count=max(1, cfg.train.val_batches * cfg.train.batch_size), seq_len=seq_len)
    byte_lengths = torch.tensor(tok.token_byte_lengths() + [0] * (cfg.model.vocab_size - tok.vocab_size))

    seed_everything(cfg.train.seed, workers=True, verbose=False)
    for noise in (".*does not have many workers.*", ".*The `srun` command is available.*", ".*LeafSpec.*"):
        warnings.filterwarnings("ignore", noise)  # advice that does not apply to these runs
    model = build_model(cfg.model, cfg.variant)
    model.checkpoint_layers = cfg.train.activation_checkpointing
    total = total_steps(cfg)
    resume_from, resume_step = _resume_point(cfg, ckpt_path, model, resume, rank0)
    what = f"resuming at step {resume_step}" if resume_from else "starting"
    if rank0:
        last_loss, fresh = status.get("last_loss"), resume_from is None
        _start_run_dir(cfg, run_dir, ckpt_path, model, tok, resume_step, last_loss, what, total, fresh)
    plain_logs = not sys.stderr.isatty()
    if rank0:
        print(
            f"depthmem: {cfg.variant} {cfg.model.preset}, {model.num_params():,} parameters, {total} steps "
            f"of {cfg.train.batch_size}x{seq_len} tokens = {total * cfg.train.batch_size * seq_len:,} tokens "
            f"({what}){processes_text(cfg)}; writing {run_dir}",
            flush=True,
        )

    module = LitDecoder(
        cfg, model, total=total, val_windows=torch.from_numpy(val), byte_lengths=byte_lengths, tokenizer_spec=tok.spec()
    )
    files = RunFiles(cfg, run_dir, ckpt_path, resume_step, plain_logs)
    costs = StepCosts(resume_step, total)
    quiet_lightning()
    callbacks = [files, costs] if plain_logs else [files, costs, StepProgressBar(files)]
    callbacks.append(SyncedStop())  # after RunFiles, whose step-end work (checkpoints, validation) comes first
    trainer = _trainer(cfg, callbacks, run_dir, total, plain_logs)
    dataset = StepBatches(
        tokens.train, cfg, total, lambda: (trainer.global_step, trainer.global_rank, trainer.world_size)
    )
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=0)
    start = time.time()
    _fit(cfg, trainer, module, loader, resume_from, files, run_dir, rank0)
    _finish_tracking(cfg, rank0, failed=module.diverged is not None)
    if module.diverged is not None:
        d = module.diverged
        kept = f"the last good checkpoint is {ckpt_path}" if ckpt_path.exists() else "no checkpoint was saved yet"
        message = f"{d['reason']}; {kept}"
        if rank0:
            rundir.write_status(run_dir, "diverged", step=d["step"], last_loss=files.last_loss, message=message)
        raise RunFailed(f"The run {message}.")
    if is_sharded(model.parameters()):
        model = unsharded_copy(model, cfg)  # every rank gathers; rank 0 reads the whole model below
    if rank0:
        wall = module.elapsed_before + (time.time() - start)
        _write_results(cfg, run_dir, model, module, trainer, files, costs, total, wall)
    return run_dir
