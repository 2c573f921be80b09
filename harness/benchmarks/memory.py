"""The memory and core-load meters of the benchmarks. They live in ``harness.measure``, below training, which
measures its own steps with them; this module keeps the benchmarks' import path."""

from harness.measure import AllocatorPeak, CoreLoad, live_training_bytes, tensor_bytes, usable_cores

__all__ = ["AllocatorPeak", "CoreLoad", "live_training_bytes", "tensor_bytes", "usable_cores"]
