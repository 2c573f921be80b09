"""HC's and mHC's stream code is ``variants.ops.streams``. This name stays for the fused-kernel probe of the
benchmarks, which imports ``StreamWrite`` from here, until that probe is removed."""

from variants.ops.streams import StreamWrite

__all__ = ["StreamWrite"]
