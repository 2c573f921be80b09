"""Benchmarks: cost against PreLN, measured.

``benchmark`` times and sizes every variant interleaved with PreLN in one process; ``timing`` times a training
step, ``memory`` measures its peak, ``reference`` gives each variant's straightforward implementation beside it,
``targets`` the targets and analytic floors, ``outputs`` the growth fits, table, plot and files, and ``quiet``
whether other work shared the cores. ``loop`` measures the harness against a bare loop, ``compile`` eager against
compiled, ``gpu`` and ``selftest`` the checks on a card.
"""
