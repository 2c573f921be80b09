"""Sweeps: a grid file in, one run directory per grid point out, run locally or on SLURM through submitit.

``grid`` expands and validates a grid; ``profiles`` reads resource profiles; ``submit`` plans and submits;
``job`` is what runs inside a submitted job; ``jobstate`` reads where every run stands, and cancels.
"""
