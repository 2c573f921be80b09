"""Resource profiles: what every job of a sweep asks the scheduler for (``slurm/profiles/*.yaml``).

A profile is a run's ``slurm`` section plus how the sweep is scheduled (array parallelism, requeue signal and
limit, further sbatch options) and where it runs by default: ``executor: slurm`` makes ``depthmem sweep`` submit
to SLURM unless ``--executor local`` is given.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.config import SlurmConfig
from harness.errors import UsageError, did_you_mean
from harness.yamltext import read_yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROFILE_DIR = PROJECT_ROOT / "slurm" / "profiles"
EXECUTORS = ("local", "slurm")


@dataclass(kw_only=True)
class Profile(SlurmConfig):
    """Resources for every job of a sweep: a run's ``slurm`` section plus how the sweep is scheduled.
    ``tasks_per_node`` processes per node run DDP (train.devices follows it); ``setup`` lines run in the job
    script before Python starts (modules, environment variables)."""

    name: str = "default"
    executor: str = "local"
    """Where the sweep runs when ``--executor`` is not given: ``local`` or ``slurm``."""
    array_parallelism: int = 4
    """Most array tasks running at once."""
    signal_delay_s: int = 90
    """Seconds before the time limit at which the job is signalled to requeue itself."""
    max_requeues: int = 3
    """Most requeues after time limits (preemptions do not count)."""
    additional: dict[str, Any] = field(default_factory=dict)
    """Further sbatch options, e.g. ``{constraint: a100}``."""
    gpu_peak_tflops: float = 312.0
    """bf16 dense peak of one card in TFLOP/s (A100 312, H100 SXM 989), for the dry run's GPU-hour estimate."""
    utilisation: float = 0.4
    """Assumed share of that peak a run reaches, for the same estimate."""
    micro_batch_size: int = 0
    """Sequences per GPU in one pass (train.micro_batch_size; 0: the whole per-GPU share): what fits the card."""
    gpu_mem_gb: float = 0.0
    """Memory of one card in GB (40, 80, 141); the dry run's memory plan warns of runs that do not fit it. 0: not
    said, and only runs that fit no card are warned of."""

    def __post_init__(self):
        for name in ("time_min", "nodes", "tasks_per_node", "cpus_per_task", "array_parallelism"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UsageError(
                    f"The profile {self.name!r} needs {name} as a positive integer, got {getattr(self, name)!r}."
                )
        if not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 0:
            raise UsageError(
                f"The profile {self.name!r} needs micro_batch_size as zero or a positive integer, "
                f"got {self.micro_batch_size!r}."
            )
        if not isinstance(self.gpu_mem_gb, (int, float)) or self.gpu_mem_gb < 0:
            raise UsageError(
                f"The profile {self.name!r} needs gpu_mem_gb as a card's memory in GB (e.g. 80), or 0 when not "
                f"said, got {self.gpu_mem_gb!r}."
            )
        if not (self.gpu_peak_tflops > 0 and 0 < self.utilisation <= 1):
            raise UsageError(
                f"The profile {self.name!r} needs a positive gpu_peak_tflops and a utilisation in "
                f"(0, 1], got {self.gpu_peak_tflops!r} and {self.utilisation!r}."
            )
        if self.gpus_per_node < 0 or self.mem_gb <= 0 or self.signal_delay_s < 0 or self.max_requeues < 0:
            raise UsageError(
                f"The profile {self.name!r} needs gpus_per_node, signal_delay_s and max_requeues "
                f"of zero or more, and a positive mem_gb."
            )
        from harness.sbatch import check_values

        for name in ("partition", "account", "qos", "setup", "additional"):
            try:
                check_values(getattr(self, name), name)
            except ValueError as e:
                raise UsageError(f"The profile {self.name!r}: {e}.") from None
        if self.executor not in EXECUTORS:
            raise UsageError(
                f"The profile {self.name!r} has executor {self.executor!r}; allowed: {', '.join(EXECUTORS)}."
            )

    def config_layer(self) -> dict[str, Any]:
        """The run-config settings this profile implies: its ``slurm`` section and the DDP layout."""
        slurm = {f.name: getattr(self, f.name) for f in dataclasses.fields(SlurmConfig)}
        slurm["setup"] = list(self.setup)
        train = {"devices": self.tasks_per_node, "num_nodes": self.nodes}
        if self.micro_batch_size:
            train["micro_batch_size"] = self.micro_batch_size
        return {"slurm": slurm, "train": train}


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | None) -> Profile:
    """A profile by name (``slurm/profiles/NAME.yaml``) or by path; ``None`` gives the defaults."""
    if not name_or_path:
        return Profile()
    path = Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") and path.exists()):
        path = PROFILE_DIR / f"{path.stem if path.suffix in ('.yaml', '.yml') else name_or_path}.yaml"
    if not path.exists():
        known = profile_names()
        hint = did_you_mean(Path(str(name_or_path)).stem, known)
        raise UsageError(
            f"Unknown profile {name_or_path!r}.{hint} Known profiles: {', '.join(known) or 'none'} "
            f"(in {PROFILE_DIR}), or give the path of a profile file."
        )
    data = read_yaml(path, "profile") or {}
    if not isinstance(data, dict):
        raise UsageError(f"The profile {path} must hold a mapping of resource settings.")
    known = [f.name for f in dataclasses.fields(Profile) if f.name != "name"]
    for key in data:
        if key not in known:
            raise UsageError(
                f"Unknown key {key!r} in the profile {path}.{did_you_mean(key, known)} "
                f"Allowed keys: {', '.join(known)}."
            )
    data.setdefault("setup", [])
    if not isinstance(data["setup"], list):
        raise UsageError(f"setup in the profile {path} must be a list of shell lines.")
    return Profile(name=path.stem, **data)


__all__ = ["Profile", "PROFILE_DIR", "EXECUTORS", "load_profile", "profile_names"]
