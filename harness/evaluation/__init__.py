"""Evaluation: a run directory in, lm-eval results out.

``lm_adapter`` is the lm-eval model over a depthmem checkpoint; ``evaluator`` runs lm-eval's own evaluator and
writes the results next to the run; ``tasks`` holds the offline task YAMLs and their data loaders.
"""
