"""How much memory one training process needs, and the largest micro batch that fits a card, before anything runs.

The step is simulated, not run. The decoder is built on fake tensors (shapes and dtypes without storage, PyTorch's
``FakeTensorMode``), and one training step runs on them: forward under the run's precision, cross-entropy,
backward, AdamW as the trainer builds it. A dispatch mode (``LiveBytes``) adds each storage's bytes when an op
creates it and subtracts them when it is freed. The peak it sees equals the CPU allocator's peak for the same step,
to the byte, for every variant at the ``tiny`` and ``small`` presets (``tests/test_memory_plan.py``). At ``1.3b`` a
step takes seconds, not the minutes and the memory a real one would.

Memory grows linearly with the micro batch, since every activation is per sequence. Two simulations, at one and two
sequences, give the plan's formula::

    peak(m) = fixed + m * per_sequence

``fixed`` holds the weights, AdamW's moments, the gradients where micro batches accumulate, and what a step keeps
whatever its batch, such as the bf16 copies of the weights under autocast.

The strategy changes what one process holds:

- Single process: the simulation as it is.
- DDP: adds its gradient buckets, one more float32 copy of the gradients (4 bytes per parameter).
- FSDP over ``W`` processes: weights, gradients and moments count ``1/W``. A gradient is whole from the moment it is
  computed until it is reduce-scattered. Gathered weights are added in full: the root unit (embedding, head, mixer,
  final norm) for the whole step, and two layers at a time, the one computing and the one prefetched.

``fits`` leaves ``headroom`` of each card (15%) for what no tensor shows: the CUDA context, the collective library's
buffers and the caching allocator's fragmentation. The simulation counts tensors, not those. What a card really
peaks at is measured by ``depthmem bench --micro-batch-memory`` on that card.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.config import ModelConfig, RunConfig

CARDS_GB = (40, 80, 141)
"""The cards the plan is printed for: A100 40 GB, A100/H100 80 GB, H200 141 GB (decimal gigabytes, as sold)."""
HEADROOM = 0.15
MIXED = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
FULL = ("32-true", "32")


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive under this mode, and their peak; ``scale`` weighs a storage's bytes (a shard's
    share under FSDP). Storages that exist before the mode starts are added with ``hold``."""

    def __init__(self):
        super().__init__()
        self.live = 0.0
        self.peak = 0.0
        self._weight: dict[int, float] = {}  # id(storage) -> bytes counted for it
        self._refs: dict[int, weakref.ref] = {}

    def hold(self, t: torch.Tensor, scale: float = 1.0) -> None:
        st = t.untyped_storage()
        key = id(st)
        counted = st.nbytes() * scale
        if key in self._weight:  # already counted: take its new weight instead of adding it again
            self.live += counted - self._weight[key]
            self._weight[key] = counted
        else:
            self._weight[key] = counted
            self.live += counted
            self._refs[key] = weakref.ref(st, lambda _, key=key: self._free(key))
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._weight.pop(key, 0.0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self._weight:
                self.hold(t)
        return out


def training_step(model, optimizer, tokens: torch.Tensor, precision: str) -> None:
    """One micro batch of ``tokens`` (b, t + 1) through the model, the loss and backward, then AdamW's step: the
    trainer's step without Lightning, under ``precision`` (a Lightning precision string of ``MIXED`` or ``FULL``).
    The optimizer's gradients are left for the caller to clear."""
    dtype = MIXED.get(precision)
    with torch.autocast(tokens.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(tokens[:, :-1])  # (b, t, vocab)
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()


def simulated_peak(
    model_cfg: ModelConfig,
    variant: str,
    micro_batch: int,
    seq_len: int,
    *,
    precision: str = "bf16-mixed",
    checkpointing: bool = False,
    accumulating: bool = False,
    shards: int = 1,
    fused: bool = True,
) -> float:
    """Peak bytes of one training step on one process: weights, AdamW's moments and everything the step allocates.
    ``shards`` > 1 counts weights, moments and gradients as one of that many FSDP shards (the gathered weights are
    added by ``plan``); ``accumulating`` keeps the gradients of an earlier micro batch; ``fused`` takes the fused
    kernels' path, as a card with Triton does (``train.kernels`` other than ``off``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from harness.model.factory import build_model
    from harness.training.optim import param_groups

    if precision not in MIXED and precision not in FULL:
        raise ValueError(f"no memory plan for precision {precision!r}; it knows {', '.join([*MIXED, *FULL])}")
    from variants import kernels

    path = kernels.as_on_card() if fused else kernels.mode("off")
    # Non-fake inputs are allowed for the generator state the model's initialisation reads; the seeds it derives
    # from that state only place values, which shapes do not have.
    with path, FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        torch.manual_seed(0)
        model = build_model(model_cfg, variant).train()
        model.checkpoint_layers = checkpointing
        optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=0.0, foreach=False)
        params = list(model.parameters())
        for p in params:  # AdamW's moments exist from the first step on; this is every later step
            p.grad = torch.zeros_like(p)
        optimizer.step()
        if not accumulating:
            optimizer.zero_grad(set_to_none=True)
        tokens = torch.randint(model_cfg.vocab_size, (micro_batch, seq_len + 1))
        live = LiveBytes()
        share = 1.0 / shards
        state = [*params, *(s for st in optimizer.state.values() for s in st.values() if torch.is_tensor(s))]
        for t in state + [p.grad for p in params if p.grad is not None]:
            live.hold(t, share)
        for t in model.buffers():
            live.hold(t)
        live.hold(tokens)
        if shards > 1:  # a gradient counts whole until FSDP reduce-scatters it, which it does once it is complete
            for p in params:
                p.register_post_accumulate_grad_hook(lambda p: live.hold(p.grad, share))
        with live:
            training_step(model, optimizer, tokens, precision)
    return live.peak


@dataclass(frozen=True)
class MemoryPlan:
    """One process's memory for a run: ``fixed`` + ``per_sequence`` × micro batch, in bytes."""

    params: int
    strategy: str
    world: int
    micro_batch: int
    checkpointing: bool
    fixed: float
    per_sequence: float

    def peak(self, micro_batch: int | None = None) -> float:
        return self.fixed + (self.micro_batch if micro_batch is None else micro_batch) * self.per_sequence

    def fits(self, card_gb: float, headroom: float = HEADROOM) -> int:
        """The largest micro batch whose step fits a card of ``card_gb`` decimal gigabytes, ``headroom`` aside;
        0 when not even one sequence fits."""
        usable = card_gb * 1e9 * (1 - headroom) - self.fixed
        return max(0, math.floor(usable / self.per_sequence))


def _unit_params(model_cfg: ModelConfig, variant: str) -> tuple[int, int, int]:
    """Parameters of the whole decoder, of its root FSDP unit (everything outside the layers) and of its largest
    layer, counted on the meta device."""
    from harness.model.factory import build_model

    with torch.device("meta"):
        model = build_model(model_cfg, variant)
    total = model.num_params()
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    return total, total - sum(layers), max(layers)


def plan(cfg: RunConfig, *, precision: str | None = None) -> MemoryPlan:
    """The memory plan of a run as its config asks: its micro batch, processes, strategy and checkpointing, at its
    precision on a GPU (``auto`` is bf16-mixed there)."""
    from harness.training.budget import seq_len_of
    from harness.training.optim import accumulation, micro_batch
    from harness.training.sharding import resolved_strategy

    t = cfg.train
    world = t.devices * t.num_nodes
    micro, accumulating = micro_batch(cfg), accumulation(cfg) > 1
    precision = precision or ("bf16-mixed" if t.precision == "auto" else t.precision)
    total, root, layer = _unit_params(cfg.model, cfg.variant)
    strategy = resolved_strategy(t.strategy, world, total)
    shards = world if strategy == "fsdp" else 1
    at = {
        m: simulated_peak(
            cfg.model,
            cfg.variant,
            m,
            seq_len_of(cfg),
            precision=precision,
            checkpointing=t.activation_checkpointing,
            accumulating=accumulating,
            shards=shards,
            fused=t.kernels != "off",
        )
        for m in (1, 2)
    }
    fixed = 2 * at[1] - at[2]
    if strategy == "ddp":
        fixed += 4 * total  # the gradient buckets
    elif strategy == "fsdp":
        fixed += 4 * (root + 2 * layer) * (1 - 1 / shards)  # gathered float32 weights, counted 1/W above
    return MemoryPlan(
        params=total,
        strategy=strategy,
        world=world,
        micro_batch=micro,
        checkpointing=t.activation_checkpointing,
        fixed=fixed,
        per_sequence=at[2] - at[1],
    )


def plans(configs: Sequence[RunConfig]) -> list[MemoryPlan]:
    """``plan`` of every config. Configs that differ only in what memory does not see (seed, rate, budget) share one
    simulation, and distinct ones are simulated in parallel, one process per core."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from harness.measure import usable_cores

    keys = [_memory_key(c) for c in configs]
    distinct = {k: c for k, c in zip(keys, configs)}
    workers = min(len(distinct), usable_cores())
    if workers > 1 and len(distinct) > 2:
        # Spawned, not forked: the parent's torch may already hold threads a fork would copy mid-lock.
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            done = dict(zip(distinct, pool.map(plan, distinct.values())))
    else:
        done = {k: plan(c) for k, c in distinct.items()}
    return [done[k] for k in keys]


def distinct_models(configs: Sequence[RunConfig]) -> int:
    """How many simulations ``plans`` runs for these configs."""
    return len({_memory_key(c) for c in configs})


def _memory_key(c: RunConfig) -> tuple:
    t = c.train
    return (
        repr(c.model),
        c.variant,
        t.seq_len,
        t.batch_size,
        t.micro_batch_size,
        t.devices,
        t.num_nodes,
        t.strategy,
        t.precision,
        t.kernels,
        t.activation_checkpointing,
    )
