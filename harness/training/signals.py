"""SIGTERM in a run of several processes: every rank stops after the same optimizer step.

SLURM signals the tasks of a requeued or preempted job one by one, so the ranks see SIGTERM at slightly different
moments. Lightning's own handler runs a broadcast inside the signal handler of whichever rank the signal reaches;
that broadcast then meets a different collective on the other ranks (a gradient all-reduce), and the job hangs or
crashes with a checkpoint that is not resumable. ``SyncedStop`` replaces the handler in multi-process runs: the
handler only notes the signal, and at the end of every optimizer step the ranks agree with one all-reduce, so all
of them stop after the same step, where the run saves its checkpoint. Single-process runs keep Lightning's handler.
"""

from __future__ import annotations

import signal

import lightning.pytorch as pl
import torch
import torch.distributed as dist


class SyncedStop(pl.Callback):
    def __init__(self):
        self.signalled = False
        self.active = False
        self._earlier = None
        self._launcher = None

    def setup(self, trainer, pl_module, stage):
        # Lightning installs its handler after this hook, composed with whatever was there (submitit's, under SLURM).
        self._earlier = signal.getsignal(signal.SIGTERM)

    def on_train_start(self, trainer, pl_module):
        self.active = trainer.world_size > 1 and dist.is_available() and dist.is_initialized()
        if self.active:
            self._launcher = trainer.strategy.launcher
            signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum, frame):
        if not self.signalled:
            self.signalled = True
            if self._launcher is not None:
                self._launcher.kill(signum)  # the processes this one started (rank 0 of a local multi-process run)
        if callable(self._earlier):
            self._earlier(signum, frame)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if not (self.active and batch["last"]):
            return
        flag = torch.tensor([int(self.signalled)], device=pl_module.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            # Lightning checks this after the step's hooks and stops as it does for its own handler.
            trainer._signal_connector.received_sigterm = True
