"""LDM-RLS's memory math is ``variants.ops.rls``. This name stays for the report's learned-statistics figure,
which imports ``LAMBDA_INIT`` from here, until that module imports it from ``variants.ops.rls``."""

from variants.ops.rls import LAMBDA_INIT

__all__ = ["LAMBDA_INIT"]
