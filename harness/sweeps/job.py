"""The submitted job: ``RunJob`` trains one run and then evaluates it, and is requeued with the same run.

It holds only the run directory: everything else is read from ``config.json`` in the job, and training resumes
from ``ckpt/last.ckpt``, so the resubmitted callable needs no state of its own. Whatever stops it, the run's
``status.json`` says why: a start that fails (a config that does not load, a corpus that does not read) ends as
``failed`` with the error, a signal as ``interrupted`` with the step it resumes from. The harness reads these
files, never submitit's result pickles, so a results folder from elsewhere cannot run code when read.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from harness.errors import RunFailed, RunStopped
from harness.io import read_json
from harness.rundir import now_iso, read_config, read_status, write_status

# States a job leaves a run in that its next start must not take for its own.
FINAL = ("done", "failed", "diverged")


def pending_tasks(run_dir: Path, tasks: list[str], limit: int | float | None) -> list[str]:
    """The requested evaluation tasks this run has not been evaluated on yet (with this limit).

    ``eval/tasks.json`` records each task name evaluated and its limit; a run evaluated before that record
    existed counts as evaluated on every task when its ``eval/table.csv`` exists.
    """
    done = read_json(Path(run_dir) / "eval" / "tasks.json", default=None)
    if done is None:
        return [] if (Path(run_dir) / "eval" / "table.csv").exists() else list(tasks)
    return [t for t in tasks if t not in done or done[t].get("limit") != limit]


class RunJob:
    """Train one run, then evaluate it on the tasks it asks for and has no result of; requeued on preemption."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = str(run_dir)

    def __call__(self) -> dict[str, Any]:
        import submitit

        run_dir = Path(self.run_dir)
        try:
            env = submitit.JobEnvironment()
            job_id, rank = env.job_id, env.global_rank
        except RuntimeError:  # called outside submitit (a plain function call): still a valid way to run
            job_id, rank = None, 0
        try:
            cfg = read_config(run_dir)
            if rank == 0:
                before = read_status(run_dir)
                write_status(
                    run_dir,
                    "done" if before.get("state") == "done" else "running",
                    message="",
                    job_id=job_id,
                    node=os.environ.get("SLURMD_NODENAME") or socket.gethostname(),
                    attempts=int(before.get("attempts", 0)) + 1,
                    started=now_iso(),
                )
            import torch

            # The same thread count in every executor keeps CPU results identical between local and SLURM runs.
            torch.set_num_threads(max(1, cfg.slurm.cpus_per_task))
            # Imported here, not at the top, so the CLI starts without loading torch, pandas or lm-eval.
            from harness.training.trainer import train

            train(cfg, run_dir, resume=True)
            todo = pending_tasks(run_dir, list(cfg.eval.tasks), cfg.eval.limit) if cfg.eval.tasks else []
            if rank == 0 and todo:
                from harness.evaluation.evaluator import evaluate

                write_status(run_dir, "done", message=f"evaluating {', '.join(todo)}")
                evaluate(run_dir, todo, limit=cfg.eval.limit, batch_size=cfg.eval.batch_size)
                write_status(run_dir, "done", message=f"evaluated {', '.join(todo)}")
        except RunStopped as e:
            # A stop that was asked for is no error of the job: the run's status says interrupted and where it
            # resumes, and this line is all the job's log needs (submitit would add a traceback to a raise).
            print(f"depthmem: {e}", file=sys.stderr, flush=True)
            return {}
        except RunFailed:
            raise  # training already marked the run diverged or failed, with its reason
        except BaseException as e:
            if rank == 0 and read_status(run_dir).get("state") not in ("failed", "diverged", "interrupted"):
                what = "interrupted" if isinstance(e, KeyboardInterrupt) else f"{type(e).__name__}: {e}"
                write_status(run_dir, "interrupted" if isinstance(e, KeyboardInterrupt) else "failed", message=what)
            raise
        return read_json(run_dir / "summary.json", default={}) or {}

    def checkpoint(self, *args: Any, **kwargs: Any):
        """Requeue the same run: training picks up its last checkpoint when the job starts again."""
        from submitit.helpers import DelayedSubmission

        try:
            status = read_status(Path(self.run_dir))
            if status.get("state") not in FINAL:
                write_status(
                    Path(self.run_dir),
                    "interrupted",
                    message=f"requeued at the time limit; resumes from step {status.get('ckpt_step') or 0}",
                )
        except OSError:
            pass  # requeueing matters more than the note
        return DelayedSubmission(RunJob(self.run_dir))


__all__ = ["RunJob", "pending_tasks"]
