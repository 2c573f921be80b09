"""Benchmarks: cost against PreLN, measured.

``benchmark`` times and sizes every variant interleaved with PreLN in one process and fits how cost grows with
depth, width and sequence length; ``fused_probe`` measures what one hand-written CPU kernel per operation would
gain over the fast paths' eager operators (a measurement only: no model uses its kernels).
"""
