"""Model: a config and a variant name in, a ``Decoder`` out.

``decoder`` is the Llama-style trunk that hands every layer's input and output to a depth mixer and names no
variant; ``factory`` builds it with the mixer from the registry in ``variants``; ``costs`` is the analytic cost
model; ``diagnostics`` reads mixing matrices and gradient norms off a trained model; ``export`` writes a run as a
Hugging Face checkpoint.
"""
