"""Typed run configuration: model, variant, data, training, evaluation and SLURM sections.

One ``RunConfig`` describes a run completely. It round-trips through JSON (``to_dict``/``from_dict``), takes
dotlist overrides such as ``train.lr=3e-4`` that reject unknown keys, and validates every field in
``__post_init__`` with a ``ValueError`` that names the field and the allowed values. OmegaConf does the typed
merging; this module turns its errors into one sentence.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import UsageError, did_you_mean
from harness.yamltext import read_yaml


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
        if not all(0 < v < math.inf for v in (self.norm_eps, self.init_std, self.rope_theta)):
            raise ValueError(
                "model.norm_eps, model.init_std and model.rope_theta must be positive finite numbers, "
                f"got {self.norm_eps}, {self.init_std} and {self.rope_theta}"
            )

    @property
    def n_layers(self) -> int:
        """Depth-mixing layers: every attention and every MLP is one layer."""
        return 2 * self.n_blocks


# Sizes are counted with tied embeddings; "small" matches the 256-wide, 12-layer model of the benchmarks. The GPT-2
# ladder keeps GPT-2's widths, depths and heads (head width 64) with SwiGLU MLPs of about 8/3 the width, rounded to
# a multiple of 128; "1.3b" is the 24 x 2048 model of the 1.3B rung of the usual scaling ladders (head width 128).
# `depthmem variants --costs --preset NAME` gives each one's parameters and the mixers' sizes there.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, d_model=64, n_blocks=2, n_heads=4, ffn_hidden=192, max_seq_len=64),
    "cpu": dict(vocab_size=4096, d_model=128, n_blocks=4, n_heads=4, ffn_hidden=384, max_seq_len=128),
    "small": dict(vocab_size=50257, d_model=256, n_blocks=6, n_heads=4, ffn_hidden=768, max_seq_len=256),
    "gpt2-small": dict(vocab_size=50257, d_model=768, n_blocks=12, n_heads=12, ffn_hidden=2048, max_seq_len=1024),
    "gpt2-medium": dict(vocab_size=50257, d_model=1024, n_blocks=24, n_heads=16, ffn_hidden=2816, max_seq_len=1024),
    "gpt2-large": dict(vocab_size=50257, d_model=1280, n_blocks=36, n_heads=20, ffn_hidden=3456, max_seq_len=1024),
    "1.3b": dict(vocab_size=50257, d_model=2048, n_blocks=24, n_heads=16, ffn_hidden=5504, max_seq_len=2048),
}


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """The named preset with field overrides, e.g. ``model_preset("small", n_blocks=16)``."""
    if name not in PRESETS:
        raise UsageError(f"Unknown preset {name!r}.{did_you_mean(name, PRESETS)} Known presets: {', '.join(PRESETS)}.")
    try:
        return ModelConfig(preset=name, **{**PRESETS[name], **overrides})
    except (TypeError, ValueError) as e:
        raise UsageError(f"Bad model settings for preset {name!r}: {e}.") from None


EVAL_SPLITS = ("val", "tune")


@dataclass(kw_only=True)
class DataConfig:
    """Where training tokens come from."""

    corpus: str = "shakespeare"
    """``shakespeare`` (the embedded default) or the path of a folder of token shards made by ``depthmem prepare``."""
    tokenizer: str = "auto"
    """``auto`` (GPT-2 BPE when the vocabulary is 50257, else a byte-level BPE of that size), ``gpt2`` or ``bpe``."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation (by document, deterministically)."""
    eval_split: str = "val"
    """What a run validates on: ``val`` (the held-out split the report's tables show) or ``tune`` (a further
    ``val_fraction`` share carved from the training stream, which the run then does not train on; for choosing
    a learning rate without touching ``val``)."""
    cache_dir: str = ""
    """Where tokenized corpora and trained tokenizers are cached; empty means ``$DEPTHMEM_CACHE`` or
    ``~/.cache/depthmem``."""

    def __post_init__(self):
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.tokenizer not in ("auto", "gpt2", "bpe"):
            raise ValueError(f"data.tokenizer must be one of auto, gpt2, bpe, got {self.tokenizer!r}")
        if self.eval_split not in EVAL_SPLITS:
            raise ValueError(f"data.eval_split must be one of {', '.join(EVAL_SPLITS)}, got {self.eval_split!r}")


# Lightning's precision names (its ``_PRECISION_INPUT_STR`` and aliases) and ours, ``auto``; kept here so a config
# is checked without importing Lightning.
PRECISIONS = (
    "auto",
    "32-true",
    "bf16-mixed",
    "bf16-true",
    "16-mixed",
    "16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
    "32",
    "16",
    "64",
    "bf16",
)
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
MAX_SEED = 2**32 - 1
"""The largest seed Lightning's ``seed_everything`` takes."""


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
    compile: str = "auto"
    """``auto`` (torch.compile on a CUDA GPU, eager elsewhere), ``true`` or ``false``."""
    kernels: str = "auto"
    """The depth mixers' fused Triton kernels: ``auto`` (on a CUDA GPU where Triton is installed), ``on`` or ``off``."""
    devices: int = 1
    num_nodes: int = 1
    accelerator: str = "auto"
    strategy: str = "auto"
    activation_checkpointing: bool = False
    """Recompute each layer's attention or MLP activations in the backward pass instead of keeping them; the depth
    mixer's state (every written value and what its reads keep) is kept, so the loss is the same bit for bit."""
    log_every_steps: int = 10
    val_every_steps: int = 50
    val_batches: int = 8
    ckpt_every_steps: int = 50
    max_grad_norm_diverge: float = 1e4
    """A gradient norm above this, a non-finite gradient or a non-finite loss stops the run as diverged."""
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
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"train.seed must be an integer from 0 to {MAX_SEED}, got {self.seed}")
        # Written as "not in range" so that nan, which fails every comparison, fails these too.
        if self.max_steps and self.tokens:
            raise ValueError(
                f"train.max_steps ({self.max_steps}) and train.tokens ({self.tokens}) both fix the "
                "budget; set one of them and leave the other 0"
            )
        if not 0 < self.tokens_per_param < math.inf:
            raise ValueError(f"train.tokens_per_param must be a positive number, got {self.tokens_per_param}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"train.lr must be positive, got {self.lr}")
        if not self.max_grad_norm_diverge > 0:  # inf is allowed: never stop on the gradient norm alone
            raise ValueError(f"train.max_grad_norm_diverge must be positive, got {self.max_grad_norm_diverge}")
        for name in ("weight_decay", "grad_clip"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"train.{name} must be zero or a positive finite number, got {getattr(self, name)}")
        for name in ("min_lr_ratio", "decay_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"train.{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be in [0, 1), got {getattr(self, name)}")
        if str(self.precision) not in PRECISIONS:
            raise ValueError(
                f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
                f"{did_you_mean(self.precision, PRECISIONS)}"
            )
        # YAML and OmegaConf hand a boolean to a text field as "True"/"False".
        self.compile = {"on": "true", "off": "false"}.get(str(self.compile).lower(), str(self.compile).lower())
        for name, allowed in (("compile", ("auto", "true", "false")), ("kernels", ("auto", "on", "off"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"train.{name} must be {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"train.accelerator must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"train.schedule must be cosine or wsd, got {self.schedule!r}")
        if self.logger not in ("csv", "tensorboard", "wandb"):
            raise ValueError(f"train.logger must be csv, tensorboard or wandb, got {self.logger!r}")


@dataclass(kw_only=True)
class EvalConfig:
    """Downstream evaluation through lm-eval after training."""

    tasks: list[str] = field(default_factory=list)
    """Suite or task names; empty skips evaluation."""
    limit: int | None = None
    batch_size: int = 16

    def __post_init__(self):
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"eval.limit must be a positive number of documents per task, got {self.limit}")
        if self.batch_size < 1:
            raise ValueError(f"eval.batch_size must be a positive integer, got {self.batch_size}")


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

    def __post_init__(self):
        for name in ("time_min", "nodes", "tasks_per_node", "cpus_per_task"):
            if getattr(self, name) < 1:
                raise ValueError(f"slurm.{name} must be a positive integer, got {getattr(self, name)}")
        if self.gpus_per_node < 0:
            raise ValueError(f"slurm.gpus_per_node must be zero or more, got {self.gpus_per_node}")
        if not 0 < self.mem_gb < math.inf:
            raise ValueError(f"slurm.mem_gb must be a positive number, got {self.mem_gb}")
        from harness.sbatch import check_values

        for name in ("partition", "account", "qos", "setup"):
            check_values(getattr(self, name), f"slurm.{name}")


@dataclass(kw_only=True)
class RunConfig:
    """Everything that determines a run."""

    name: str = ""
    """Experiment name; run directories go under results/<name>/."""
    variant: str = "preln"
    """A registered depth mixer with optional knobs, e.g. ``ldm-rls(groups=4,lambda=1.0)``; once built, the parsed
    ``variants.VariantSpec``, a ``str`` holding the canonical name."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self):
        if not str(self.variant).strip():
            raise ValueError("variant is empty: name a depth mixer from `depthmem variants`, e.g. preln")
        import variants

        # Parsed here, once, for this model's width and depth (a UsageError naming the allowed values otherwise):
        # everything downstream takes the parsed value, the canonical name with the mixer's typed knobs.
        self.variant = variants.validate(self.variant, d_model=self.model.d_model, n_layers=self.model.n_layers)

    def to_dict(self) -> dict[str, Any]:
        # What dataclasses.asdict gives, without its deep copy of every scalar, which dominated the expansion of
        # large grids: the sections hold only scalars and lists of strings, so copying the lists is enough.
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                out[f.name] = {k: (_copied(v) if type(v) in (list, dict) else v) for k, v in vars(value).items()}
            else:
                out[f.name] = _copied(value)
        # Plain types only: a checkpoint's copy of the config loads with torch's weights-only unpickler.
        out["variant"] = str(self.variant)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "config") -> RunConfig:
        return build_config(d, source=source)


def _copied(value: Any) -> Any:
    if isinstance(value, list) and all(isinstance(v, (str, int, float, bool)) for v in value):
        return list(value)
    return copy.deepcopy(value) if isinstance(value, (list, dict)) else value


def _suggest(key: str, node) -> str:
    names = [f.name for f in dataclasses.fields(node)] if dataclasses.is_dataclass(node) else []
    return did_you_mean(key.split(".")[-1], names)


def build_config(*layers: dict[str, Any] | list[str], source: str = "config") -> RunConfig:
    """Merge dicts and dotlists (``["train.lr=1e-3"]``) over the defaults into a validated RunConfig.

    A ``model.preset`` in any layer selects that preset's sizes first; explicit model fields win over it.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    for layer in layers:
        for item in layer if isinstance(layer, (list, tuple)) else ():
            if "=" not in str(item) or not str(item).split("=", 1)[0].strip():
                raise UsageError(
                    f"The override {str(item)!r} in {source} is not KEY=VALUE: write it as "
                    f"{str(item).strip('=') or 'train.lr'}=VALUE, e.g. --set train.lr=1e-3."
                )
    try:
        confs = [
            OmegaConf.from_dotlist(list(x)) if isinstance(x, (list, tuple)) else OmegaConf.create(x or {})
            for x in layers
        ]
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


_SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "eval": EvalConfig, "slurm": SlurmConfig}


class _Unsure(Exception):
    """The fast path cannot vouch for this config; ``build_config`` decides (and words any error)."""


def flat_keys(layer: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1e-3}}`` as ``{"train.lr": 1e-3}``; an empty mapping adds no key."""
    out: dict[str, Any] = {}
    for key, value in layer.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_keys(value, name + "."))
        elif isinstance(value, dict):
            continue  # an empty mapping changes nothing in a merge
        else:
            out[name] = value
    return out


class ConfigBuilder:
    """Many RunConfigs that share their lower layers, as ``build_config`` would build them, but fast.

    OmegaConf's typed merge costs tens of milliseconds per config, so a grid of 10^4 runs would take minutes. A
    grid repeats a few values in many combinations, so each distinct (key, value) is typed once by OmegaConf's own
    value nodes (the same conversions its merge applies) and every config is then built from plain dataclasses,
    whose ``__post_init__`` checks run as usual. Whatever this path cannot vouch for (unknown keys, interpolation,
    a value that does not convert, a field check that fails) goes through ``build_config``, which gives the same
    config or the same error.
    """

    def __init__(self, *layers: dict[str, Any], source: str = "config"):
        self.layers = [dict(x or {}) for x in layers]
        self.source = source
        self.flat: dict[str, Any] = {}
        for layer in self.layers:
            self.flat.update(flat_keys(layer))
        self._typed: dict[tuple, Any] = {}
        self._hints = {name: typing.get_type_hints(cls) for name, cls in _SECTIONS.items()}
        self._hints[""] = {"name": str, "variant": str}

    def build(self, *layers: dict[str, Any], source: str | None = None) -> RunConfig:
        flat = dict(self.flat)
        for layer in layers:
            flat.update(flat_keys(layer or {}))
        try:
            return self._fast(flat)
        except _Unsure:
            return build_config(*self.layers, *layers, source=source or self.source)

    def _type(self, key: str, value: Any) -> Any:
        memo = (key, type(value).__name__, repr(value))
        if memo in self._typed:
            return self._typed[memo]
        section, _, name = key.rpartition(".")
        hint = self._hints.get(section, {}).get(name)
        if hint is None or "." in section:
            raise _Unsure
        if isinstance(value, str) and ("${" in value or value == "???"):
            raise _Unsure  # interpolation and missing values are OmegaConf's to resolve
        from omegaconf import ListConfig, OmegaConf
        from omegaconf.errors import OmegaConfBaseException
        from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

        nodes = {int: IntegerNode, float: FloatNode, str: StringNode, bool: BooleanNode}
        optional = typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint)
        if optional:
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        try:
            if hint in nodes:
                typed = nodes[hint](value, is_optional=optional)._value()
            elif typing.get_origin(hint) is list and typing.get_args(hint) == (str,) and isinstance(value, list):
                typed = OmegaConf.to_container(ListConfig(value, element_type=str))
            else:
                raise _Unsure
        except OmegaConfBaseException:
            raise _Unsure from None
        if typed is None and not optional:
            raise _Unsure
        self._typed[memo] = typed
        return typed

    def _fast(self, flat: dict[str, Any]) -> RunConfig:
        typed = {k: self._type(k, v) for k, v in flat.items()}
        parts: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        top: dict[str, Any] = {}
        for key, value in typed.items():
            section, _, name = key.rpartition(".")
            (parts[section] if section else top)[name] = copy.deepcopy(value) if isinstance(value, list) else value
        preset = parts["model"].get("preset", "tiny")
        if preset not in PRESETS:
            raise _Unsure
        try:
            return RunConfig(
                **top,
                model=ModelConfig(**{**PRESETS[preset], **parts["model"], "preset": preset}),
                **{name: cls(**parts[name]) for name, cls in _SECTIONS.items() if name != "model"},
            )
        except (TypeError, ValueError):
            raise _Unsure from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """A RunConfig from a YAML or JSON file plus dotlist overrides."""
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise UsageError(f"The config file {path} must hold a mapping of sections, not {type(data).__name__}.")
    return build_config(data, overrides or [], source=str(path))
