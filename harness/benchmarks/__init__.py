"""Benchmarks: cost against PreLN, measured.

``benchmark`` times and sizes every variant interleaved with PreLN in one process and fits how cost grows with
depth, width and sequence length.
"""
