"""Training: a resolved ``RunConfig`` in, a run directory out (config, metrics, checkpoints, summary).

``trainer`` is the Lightning module and the ``train`` entry point; ``checkpoint`` loads trained models back;
``budget`` turns a token budget into steps, the same for every run of a comparison.
"""
