"""Typed run configuration: model, variant, data, training, evaluation and SLURM sections.

One ``RunConfig`` describes a run completely. It round-trips through JSON (``to_dict``/``from_dict``), takes
dotlist overrides such as ``train.lr=3e-4`` that reject unknown keys, and validates every field in
``__post_init__`` with a ``ValueError`` that names the field and the allowed values. OmegaConf does the typed
merging; this module turns its errors into one sentence.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from harness.errors import UsageError, did_you_mean


@dataclass(kw_only=True)
class ModelConfig:
    """The shared Llama-style decoder. Its sizes come from a named preset, overridable field by field."""

    preset: str = "tiny"
    """Name of the size preset this config started from (kept for tables)."""
    vocab_size: int = 512
    """Vocabulary size; 50257 means the GPT-2 tokenizer, anything else a byte-level BPE trained to that size."""
    d_model: int = 64
    n_blocks: int = 2
    """Transformer blocks; each has an attention and an MLP layer, so there are 2 * n_blocks depth-mixing layers."""
    n_heads: int = 4
    ffn_hidden: int = 192
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_blocks", "n_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("the attention head width (d_model / n_heads) must be even for RoPE")
        if self.norm_eps <= 0 or self.init_std <= 0 or self.rope_theta <= 0:
            raise ValueError("model.norm_eps, model.init_std and model.rope_theta must be positive")

    @property
    def n_layers(self) -> int:
        """Depth-mixing layers: every attention and every MLP is one layer."""
        return 2 * self.n_blocks


# Sizes are counted with tied embeddings; "small" matches the 256-wide, 12-layer model of the benchmarks.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, d_model=64, n_blocks=2, n_heads=4, ffn_hidden=192, max_seq_len=64),
    "cpu": dict(vocab_size=4096, d_model=128, n_blocks=4, n_heads=4, ffn_hidden=384, max_seq_len=128),
    "small": dict(vocab_size=50257, d_model=256, n_blocks=6, n_heads=4, ffn_hidden=768, max_seq_len=256),
    "gpt2-small": dict(vocab_size=50257, d_model=768, n_blocks=12, n_heads=12, ffn_hidden=2048, max_seq_len=1024),
    "medium": dict(vocab_size=50257, d_model=1024, n_blocks=24, n_heads=16, ffn_hidden=2816, max_seq_len=1024),
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset with field overrides, e.g. ``model_preset("small", n_blocks=16)``."""
    if name not in PRESETS:
        raise UsageError(f"Unknown preset {name!r}.{did_you_mean(name, PRESETS)} Known presets: {', '.join(PRESETS)}.")
    try:
        return ModelConfig(preset=name, **{**PRESETS[name], **overrides})
    except (TypeError, ValueError) as e:
        raise UsageError(f"Bad model settings for preset {name!r}: {e}.") from None


@dataclass(kw_only=True)
class DataConfig:
    """Where training tokens come from."""

    corpus: str = "shakespeare"
    """``shakespeare`` (the embedded default) or the path of a folder of token shards made by ``depthmem prepare``."""
    tokenizer: str = "auto"
    """``auto`` (GPT-2 BPE when the vocabulary is 50257, else a byte-level BPE of that size), ``gpt2`` or ``bpe``."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation (by document, deterministically)."""
    cache_dir: str = ""
    """Where tokenized corpora and trained tokenizers are cached; empty means ``$DEPTHMEM_CACHE`` or ``~/.cache/depthmem``."""

    def __post_init__(self):
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.tokenizer not in ("auto", "gpt2", "bpe"):
            raise ValueError(f"data.tokenizer must be one of auto, gpt2, bpe, got {self.tokenizer!r}")


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and logging."""

    seed: int = 0
    batch_size: int = 8
    """Global batch size in sequences (split across devices)."""
    micro_batch_size: int = 0
    """Sequences per device in one forward/backward pass; 0 means the whole per-device share of the batch. Below
    that share, gradients are accumulated over batch_size / (devices x num_nodes x micro_batch_size) passes."""
    seq_len: int = 0
    """Training sequence length; 0 means the model's max_seq_len."""
    max_steps: int = 0
    """Optimizer steps; 0 means the token budget below decides."""
    tokens: int = 0
    """Tokens to train on (rounded up to whole steps) when max_steps is 0; 0 means tokens_per_param decides."""
    tokens_per_param: float = 20.0
    """Token budget per parameter of the baseline (PreLN at this size; a grid's report.baseline), when
    max_steps and tokens are 0. Counted against the baseline so every variant trains on the same tokens."""
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    schedule: str = "cosine"
    """``cosine`` or ``wsd`` (warmup, stable, decay)."""
    decay_fraction: float = 0.2
    """Share of steps in the final decay of the WSD schedule."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    precision: str = "auto"
    """``auto`` (bf16-mixed on GPU, 32-true on CPU), or any Lightning precision string."""
    compile: bool = False
    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "auto"
    strategy: str = "auto"
    log_every_steps: int = 10
    val_every_steps: int = 50
    val_batches: int = 8
    ckpt_every_steps: int = 50
    max_grad_norm_diverge: float = 1e4
    """A gradient norm above this (or a non-finite loss) stops the run as diverged."""
    logger: str = "csv"
    """``csv``, ``tensorboard`` or ``wandb`` (CSV is always written)."""
    wandb_project: str = ""
    """W&B project; empty means the sweep's name (``name``), else ``depthmem``."""

    def __post_init__(self):
        for name in ("batch_size", "log_every_steps", "val_every_steps", "ckpt_every_steps", "devices", "num_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("seq_len", "max_steps", "tokens", "warmup_steps", "val_batches", "micro_batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be zero or positive, got {getattr(self, name)}")
        if self.max_steps and self.tokens:
            raise ValueError(f"train.max_steps ({self.max_steps}) and train.tokens ({self.tokens}) both fix the "
                             "budget; set one of them and leave the other 0")
        if not self.tokens_per_param > 0:
            raise ValueError(f"train.tokens_per_param must be a positive number, got {self.tokens_per_param}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be positive, got {self.lr}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"train.schedule must be cosine or wsd, got {self.schedule!r}")
        if self.logger not in ("csv", "tensorboard", "wandb"):
            raise ValueError(f"train.logger must be csv, tensorboard or wandb, got {self.logger!r}")


@dataclass(kw_only=True)
class EvalConfig:
    """Downstream evaluation through lm-eval after training."""

    tasks: list[str] = field(default_factory=list)
    """Suite or task names; empty skips evaluation."""
    limit: Optional[int] = None
    batch_size: int = 16


@dataclass(kw_only=True)
class SlurmConfig:
    """Resources requested for a run (the sweep's profile fills these)."""

    partition: str = ""
    account: str = ""
    qos: str = ""
    time_min: int = 60
    nodes: int = 1
    tasks_per_node: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float = 4.0
    setup: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class RunConfig:
    """Everything that determines a run."""

    name: str = ""
    """Experiment name; run directories go under results/<name>/."""
    variant: str = "preln"
    """A registered depth mixer with optional knobs, e.g. ``ldm-rls(groups=4,lambda=1.0)``."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> "RunConfig":
        return build_config(d, source=source)


def _suggest(key: str, node) -> str:
    names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
    return did_you_mean(key.split(".")[-1], names)


def build_config(*layers: dict[str, Any] | list[str], source: str = "config") -> RunConfig:
    """Merge dicts and dotlists (``["train.lr=1e-3"]``) over the defaults into a validated RunConfig.

    A ``model.preset`` in any layer selects that preset's sizes first; explicit model fields win over it.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        confs = [OmegaConf.from_dotlist(list(x)) if isinstance(x, (list, tuple)) else OmegaConf.create(x or {})
                 for x in layers]
        merged_raw = OmegaConf.merge(*confs) if confs else OmegaConf.create({})
        preset = OmegaConf.select(merged_raw, "model.preset", default="tiny")
        base = OmegaConf.structured(RunConfig(model=model_preset(str(preset))))
        merged = OmegaConf.merge(base, *confs)
        return OmegaConf.to_object(merged)
    except UsageError:
        raise
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or ""
        msg = str(e).splitlines()[0]
        if type(e).__name__ == "ConfigKeyError" and key:
            parent = RunConfig()
            for part in key.split(".")[:-1]:
                parent = getattr(parent, part, parent)
            raise UsageError(f"Unknown config key {key!r} in {source}.{_suggest(key, parent)}") from None
        where = f" at {key!r}" if key else ""
        raise UsageError(f"Bad value in {source}{where}: {msg}.") from None
    except ValueError as e:
        raise UsageError(f"Bad value in {source}: {e}.") from None


def read_yaml(path: str | Path, what: str = "config file") -> Any:
    """The parsed YAML of ``path``; a missing file or malformed YAML is a one-sentence ``UsageError`` (with line)."""
    import yaml

    path = Path(path)
    if not path.exists():
        raise UsageError(f"The {what} {str(path)!r} does not exist.")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"Malformed YAML in {path}{where}: {getattr(e, 'problem', None) or e}.") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a YAML or JSON file plus dotlist overrides."""
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise UsageError(f"The config file {path} must hold a mapping of sections, not {type(data).__name__}.")
    return build_config(data, overrides or [], source=str(path))
