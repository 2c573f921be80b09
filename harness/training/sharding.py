"""Sharded training: FSDP2 (``torch.distributed.fsdp.fully_shard``) through Lightning's model-parallel strategy.

Each layer of the decoder is its own shard unit and the rest (embedding, head, the depth mixer) one more, so the
parameters, gradients and optimizer state are split over the processes. A checkpoint is gathered into one full
state dict on rank 0, so a run resumes on any number of processes, sharded or not. FSDP2 runs on CPU processes
over gloo too, which is how the tests run it on machines without a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

SHARD_FROM_PARAMS = 1_000_000_000
"""``train.strategy=auto`` shards a multi-process run from this many parameters on: a DDP replica holds 16 bytes per
parameter (float32 weights and gradients, AdamW's two moments), 16 GB at a billion, before any activation."""


def resolved_strategy(strategy: str, world: int, params: int) -> str:
    """What ``train.strategy`` means for a run of ``world`` processes and ``params`` parameters: ``auto`` is one
    process alone, DDP below ``SHARD_FROM_PARAMS`` and ``fsdp`` from there; any other value is itself."""
    if strategy != "auto":
        return strategy
    if world == 1:
        return "single"
    return "fsdp" if params >= SHARD_FROM_PARAMS else "ddp"


def sharded_strategy(accelerator: str, world: int):
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(
        tensor_parallel_size=1,
        data_parallel_size=world,
        save_distributed_checkpoint=False,
        process_group_backend="gloo" if accelerator == "cpu" else "nccl",
    )


def least_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """The elementwise minimum of ``t`` over the processes of a multi-process run (``t`` itself in a run of one):
    what a decision every replica must take alike is taken from. Every rank must call it at the same point."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t


def shard(model: torch.nn.Module, mesh) -> None:
    """Shard every decoder layer, then the root (embedding, head, mixer), over the data-parallel mesh."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def local(t: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local shard (the tensor itself where it is not sharded)."""
    return t.to_local() if hasattr(t, "to_local") else t


def is_sharded(params) -> bool:
    return any(hasattr(p, "to_local") for p in params)


def unsharded_copy(model: torch.nn.Module, cfg) -> torch.nn.Module | None:
    """A plain copy of a sharded decoder on rank 0's CPU (None on the other ranks), for what reads a whole model
    outside the training step: the traced forward of the depth statistics and the final mixing matrix. Every rank
    must call it, since gathering the parameters is a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from harness.model.factory import build_model

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    copy = build_model(cfg.model, cfg.variant)
    copy.load_state_dict(state)
    return copy.train(model.training)


def _whole(t: torch.Tensor) -> torch.Tensor:
    """The whole of a sharded tensor, gathered on every rank (a collective); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def whole_mixer(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """A plain copy of a sharded decoder's depth mixer on every rank, on the device of its shards, with its
    parameters' gradients: what the mixer's statistics read, without gathering the layers. Every rank must call
    it, since gathering is a collective; the mixer is a small part of the model (at most a few percent)."""
    import variants

    mixer = model.mixer
    shards = [local(p) for p in mixer.parameters()]
    copy = variants.build(cfg.variant, d_model=cfg.model.d_model, n_layers=model.n_layers)
    copy.load_state_dict({k: _whole(v) for k, v in mixer.state_dict().items()})
    if shards:
        copy.to(shards[0].device)
    for p, q in zip(mixer.parameters(), copy.parameters()):
        if p.grad is not None:
            q.grad = _whole(p.grad).to(q.device)
    return copy.train(mixer.training)
